"""``python -m paged_kv``: the block-manager walkthrough (the serving demo replaces it later)."""

from paged_kv.walkthrough import main

main()
