"""``python -m paged_kv`` / ``paged-kv``: the block-manager walkthrough (the serving demo replaces it later)."""

from paged_kv.walkthrough import main

if __name__ == "__main__":
    main()
