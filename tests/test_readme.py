"""README.md's Python examples run as printed, and the documentation's relative links resolve.

Each ```python block of the README runs as a file of its own in a fresh Python process, from the
repository root (the examples load `checkpoints/tiny-llama` by a relative path), on the CPU. The
processes run side by side, so the test takes about as long as the slowest example."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The pages whose links are checked: the README, docs/ and the kernels' page.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "pallas_kernels" / "README.md"]


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


def test_readme_python_blocks_run_as_printed(tmp_path):
    blocks = python_blocks(README)
    assert len(blocks) >= 3  # the block manager, generate, ServingEngine
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    procs = []
    for i, block in enumerate(blocks):
        script = tmp_path / f"readme_example_{i}.py"
        script.write_text(block)
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=600)
        first = blocks[i].strip().splitlines()[0]
        assert proc.returncode == 0, f"README example {i} ({first!r}) failed:\n{err[-3000:]}"
        assert out.strip(), f"README example {i} ({first!r}) printed nothing"


USAGE = ROOT / "docs" / "usage.md"
KERNELS = ROOT / "pallas_kernels" / "README.md"
RUN_PAGES = [USAGE, KERNELS]


@pytest.mark.parametrize("page, index", [(p, i) for p in RUN_PAGES for i in range(len(python_blocks(p)))],
                         ids=lambda v: v.parent.name + "/" + v.name if isinstance(v, Path) else str(v))
def test_usage_python_blocks_run_as_printed(page, index, tmp_path):
    """docs/usage.md's examples (beam search, streaming, tensor parallelism on 4 CPU devices, ...)
    and the kernels' page's run as printed too, each in a fresh process: the tensor-parallel one
    sets ``jax_num_cpu_devices`` itself, as a library user must."""
    block = python_blocks(page)[index]
    script = tmp_path / f"usage_example_{index}.py"
    script.write_text(block)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("XLA_FLAGS", None)  # no device count from the environment: the example sets its own
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, text=True, capture_output=True,
                          timeout=900)
    first = block.strip().splitlines()[0]
    assert proc.returncode == 0, f"{page.name} example {index} ({first!r}) failed:\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{page.name} example {index} ({first!r}) printed nothing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_are_python(page):
    """Every ```python block of the pages is valid Python (signatures and outlines are ```text)."""
    for i, block in enumerate(python_blocks(page)):
        try:
            ast.parse(block)
        except SyntaxError as e:
            raise AssertionError(f"{page.relative_to(ROOT)}: python block {i} is not Python: {e}") from None


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped,
    spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.S | re.M)  # headings only outside code
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"
