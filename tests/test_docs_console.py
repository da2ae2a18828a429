"""The documentation's console sessions (```console blocks of the README and docs/) print what they
show: each ``$ `` command runs in a fresh folder (with ``scripts/`` of this checkout beside it, on
the CPU, with its own compile cache), and every output line the page shows is a line the command
printed, in the page's order; a line ``...`` stands for lines left out (timings, versions). A
```python block followed by "It prints ...:" and a ```text block prints exactly that text.

Not a smoke test: each session builds a checkpoint and compiles the serving step (about half a
minute each). The answers are those of this JAX version on a CPU; when a change of sampling or
seeding changes them, the failure prints the lines the command printed instead."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu",
       "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
ENV.pop("XLA_FLAGS", None)


def console_blocks(page: Path) -> list[str]:
    return re.findall(r"^```console\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


def sessions(block: str) -> list[tuple[str, list[str]]]:
    """``(command, shown output lines)`` per ``$ `` command of a console block (a command continues
    over lines that end with a backslash)."""
    out: list[tuple[str, list[str]]] = []
    lines = block.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            raise AssertionError(f"console block: output before any command: {lines[i]!r}")
        command = lines[i][2:]
        while command.endswith("\\"):
            i += 1
            command = command[:-1] + lines[i].strip()
        i += 1
        shown = []
        while i < len(lines) and not lines[i].startswith("$ "):
            shown.append(lines[i].rstrip())
            i += 1
        out.append((command, shown))
    return out


BLOCKS = [(page, k) for page in PAGES for k in range(len(console_blocks(page)))]


def test_console_blocks_are_parsed():
    assert len(BLOCKS) >= 2  # the README's Gemma 3 session, usage.md's Qwen3 session
    assert sessions("$ a \\\n    b\nout\n...\n$ c") == [("a b", ["out", "..."]), ("c", [])]


def missing_lines(shown: list[str], printed: list[str]) -> list[str]:
    """The shown lines (bar ``...``) that are not lines of ``printed`` in that order."""
    missing, at = [], 0
    for line in shown:
        if line == "...":
            continue
        try:
            at = printed.index(line, at) + 1
        except ValueError:
            missing.append(line)
    return missing


def test_missing_lines_keeps_order():
    assert missing_lines(["a", "...", "c"], ["a", "b", "c"]) == []
    assert missing_lines(["c", "a"], ["a", "b", "c"]) == ["a"]


@pytest.mark.parametrize("page, index", BLOCKS, ids=lambda v: v.name if isinstance(v, Path) else str(v))
def test_console_block_prints_what_it_shows(page, index, tmp_path):
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    env = {**ENV, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for command, shown in sessions(console_blocks(page)[index]):
        assert command.startswith("python "), f"{page.name}: a console command runs python: {command!r}"
        proc = subprocess.run(f"{sys.executable} {command[len('python '):]}", shell=True, cwd=tmp_path, env=env,
                              text=True, capture_output=True, timeout=600)
        assert proc.returncode == 0, f"{page.name}: {command!r} failed:\n{proc.stderr[-3000:]}"
        printed = [line.rstrip() for line in proc.stdout.splitlines()]
        missing = missing_lines(shown, printed)
        assert not missing, (f"{page.name}: {command!r} did not print, in this order:\n" + "\n".join(missing)
                             + "\n--- it printed:\n" + proc.stdout[-4000:])


def printed_examples(page: Path) -> list[tuple[str, str]]:
    """``(python block, the text it prints)`` for each ```python block the page follows with
    "It prints ...:" and a ```text block."""
    text = page.read_text()
    out = []
    for block in re.finditer(r"^```python\n(.*?)^```\n", text, flags=re.S | re.M):
        shown = re.compile(r"\nIt prints[^\n]*:\n\n```text\n(.*?)^```$", re.S | re.M).match(text, block.end())
        if shown:
            out.append((block.group(1), shown.group(1)))
    return out


EXAMPLES = [(page, k) for page in PAGES for k in range(len(printed_examples(page)))]


def test_printed_examples_are_found():
    assert (ROOT / "README.md", 0) in EXAMPLES  # generate's two prompts, two samples each


@pytest.mark.parametrize("page, index", EXAMPLES, ids=lambda v: v.name if isinstance(v, Path) else str(v))
def test_example_prints_what_the_page_shows(page, index, tmp_path):
    block, shown = printed_examples(page)[index]
    script = tmp_path / "example.py"
    script.write_text(block)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=ENV, text=True, capture_output=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == shown, f"{page.name}: the example printed\n{proc.stdout}"
