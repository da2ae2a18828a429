"""Run a script from this checkout in a Python environment that has not installed it.

pyproject.toml installs the folders ``models/``, ``pallas_kernels/`` and ``checkpoints/`` under the
names ``paged_kv.models``, ``paged_kv.pallas_kernels`` and ``paged_kv.checkpoints``. An
environment that installs the checkout (``pip install -e .``, what ``scripts/test.sh`` does) finds
them by itself. The GPU gate's cached CUDA environment (shared by every checkout on the machine)
and a lent GPU machine's own JAX do not install it; ``install()`` maps the names onto this
checkout's folders there. A no-op where the package is installed.
"""

import importlib.abc
import importlib.util
import os
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    FOLDERS = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
"""Installed name -> repository folder: pyproject.toml's own mapping, read, not restated."""


class CheckoutLayout(importlib.abc.MetaPathFinder):
    """Finds ``paged_kv.models`` etc. in this checkout's top-level folders."""

    def find_spec(self, name, path=None, target=None):
        folder = FOLDERS.get(name)
        if folder is None:
            return None
        where = os.path.join(ROOT, folder)
        return importlib.util.spec_from_file_location(name, os.path.join(where, "__init__.py"),
                                                      submodule_search_locations=[where])


def install() -> None:
    """Put this checkout on ``sys.path`` and its folders under their installed names."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    if not any(isinstance(f, CheckoutLayout) for f in sys.meta_path):
        sys.meta_path.append(CheckoutLayout())
