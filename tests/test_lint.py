"""ruff (pyproject.toml's [tool.ruff] rules) reports nothing in the whole repository.

ruff is in the ``test`` extra at one exact version (new ruff releases add checks to the selected
rule families); with another version installed, or none, the test fails and says how to install it.
"""

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINTED = (".",)


def _pinned_version() -> str:
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    (pin,) = [re.fullmatch(r"ruff==(\S+)", r).group(1) for r in test_extra if r.startswith("ruff")]
    return pin


def test_ruff_reports_nothing():
    pinned = _pinned_version()
    install = f"pip install 'ruff=={pinned}' (it is in the test extra: pip install -e '.[test]')"
    assert importlib.util.find_spec("ruff") is not None, f"ruff is not installed: {install}"
    installed = importlib.metadata.version("ruff")
    assert installed == pinned, f"ruff {installed} is installed; the rule set is checked with ruff {pinned}: {install}"
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *LINTED], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0, f"ruff check {' '.join(LINTED)}:\n{res.stdout}{res.stderr}"
