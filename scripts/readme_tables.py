"""Tables that scripts regenerate inside README.md, between `<!-- NAME:begin -->` and
`<!-- NAME:end -->` markers (scripts/bench_generate.py, scripts/profile_decode.py)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_block(name: str, markdown: str, readme: Path = README) -> None:
    """Replaces the text between `name`'s markers in `readme` with `markdown`."""
    begin, end = markers(name)
    text = readme.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{readme} has no {begin} ... {end} block to replace")
    block = f"{begin}\n{markdown}\n{end}"
    readme.write_text(re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S))
    print(f"updated the {name} table in {readme}")
