"""One clear line when a script's optional dependencies are missing.

The library needs only its runtime dependencies; the command line's (``cli``: tqdm, matplotlib)
and the benchmarks' (``bench``: torch, transformers, the ShareGPT trace, optax; it includes
``cli``) are extras of pyproject.toml. A script calls ``require("bench", "torch", ...)`` before it
needs them."""

from __future__ import annotations

import importlib.util
import os
import sys


def missing(*modules: str) -> list[str]:
    """The modules of ``modules`` this Python cannot import."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(extra: str, *modules: str) -> None:
    """Exits with one line naming ``extra`` when any of ``modules`` is missing."""
    gone = missing(*modules)
    if gone:
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "this script"
        sys.exit(f"{script} needs the '{extra}' extra (missing: {', '.join(gone)}): "
                 f"pip install -e '.[{extra}]' in the checkout")
