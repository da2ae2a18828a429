"""Tables that scripts regenerate inside docs/benchmarks.md (scripts/bench_generate.py,
scripts/profile_decode.py), docs/gpu-gate.md (scripts/gate/gpu_report.py, from the gate's
summary) and docs/design.md (the execution plan's table, ``python scripts/doc_tables.py``),
between `<!-- NAME:begin -->` and `<!-- NAME:end -->` markers. Scripts never write README.md."""

from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
GPU_GATE = Path(__file__).resolve().parents[1] / "docs" / "gpu-gate.md"
DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def shown_command(command: str) -> str:
    """The command a table shows: the recorded one without the flags that only write tables."""
    return " ".join(w for w in command.split() if not w.startswith(("--update-", "--render-")))


def replace_block(name: str, markdown: str, page: Path = BENCHMARKS) -> None:
    """Replaces the text between `name`'s markers in `page` with `markdown`."""
    begin, end = markers(name)
    text = page.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{page} has no {begin} ... {end} block to replace")
    block = f"{begin}\n{markdown}\n{end}"
    page.write_text(re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S))
    print(f"updated the {name} table in {page}")


def update_design() -> None:
    """Rewrites docs/design.md's execution-plan table from ``paged_kv.pallas_kernels.plan``."""
    from paged_kv.pallas_kernels import plan

    replace_block("execution_plan", plan.table_markdown(), DESIGN)


if __name__ == "__main__":
    update_design()
