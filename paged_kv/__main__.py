"""``python -m paged_kv``: the command line of ``paged_kv.apps.cli``."""

import sys

from paged_kv.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
