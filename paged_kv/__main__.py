"""``python -m paged_kv`` / ``paged-kv``: serve the ready-made workload and print the KV-cache report
(``--walkthrough``: the block-manager walkthrough). See ``paged_kv.cli``."""

import sys

from paged_kv.cli import main

if __name__ == "__main__":
    sys.exit(main())
