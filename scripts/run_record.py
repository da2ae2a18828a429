"""What ran: the record every benchmark writes into its results JSON (under ``"run"``), in the
vocabulary of the main job's ``report.json`` (``paged_kv.apps.provenance``).

``record(__file__, args, argv)`` returns the command that actually ran (the script and the
arguments it parsed, so a run from a test or another script records its own arguments, not the
caller's ``sys.argv``), ``argv``, every parsed option, ``versions`` (paged-kv and its git commit,
with ``+dirty`` when tracked files differ from it, None outside a git checkout; JAX, jaxlib, flax,
Python; here also numpy, and torch / transformers / ... when the script imported them),
``started`` (when the script says, else when the record is made) and ``ended`` (ISO 8601, UTC),
the backend, device kind and count, the machine and its CPU count.

A file that gathers parts written by separate runs keeps each part's own record (``merge_parts``)
and says so in ``"parts_from_separate_runs"``. ``table`` formats a script's closing summary.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path

try:
    from paged_kv.apps import provenance
except ImportError:  # compile_time.py measuring an older checkout on PYTHONPATH: this checkout's module
    _spec = importlib.util.spec_from_file_location(
        "provenance", Path(__file__).resolve().parents[1] / "paged_kv" / "apps" / "provenance.py")
    provenance = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(provenance)

utc_now = provenance.utc_now  # a script's start, for ``record(..., started=...)``
ROOT = Path(__file__).resolve().parents[1]
# Imported by some scripts only: their versions are recorded when the script imported them.
OPTIONAL = ("numpy", "torch", "transformers", "optax", "tqdm", "matplotlib")
SEPARATE_RUNS = ("this file gathers parts written by separate runs: each part's 'run' records its own command, "
                 "date, commit and versions")


def _jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def record(script: str, args=None, argv: list[str] | None = None, *, started: str | None = None) -> dict:
    """The run's record (module docstring). ``script`` is the caller's ``__file__``, ``args`` its
    parsed arguments, ``argv`` the arguments it parsed (default ``sys.argv[1:]``), ``started``
    its start (``provenance.utc_now()``; default now)."""
    import jax  # noqa: F401  (the scripts have started it: finish_record reads its backend and devices)

    path = Path(script).resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    argv = list(sys.argv[1:] if argv is None else argv)
    options = _jsonable(vars(args)) if args is not None else {}
    run = provenance.finish_record(provenance.run_record(argv, options, prog=f"python {shown}", started=started))
    for name in OPTIONAL:
        if name in sys.modules:
            run["versions"][name] = getattr(sys.modules[name], "__version__", None)
    return {**run, "machine": platform.machine(), "cpu_count": os.cpu_count()}


def _at(data: dict, path: tuple[str, ...]):
    for k in path:
        if not isinstance(data, dict) or k not in data:
            return None
        data = data[k]
    return data


def merge_parts(old: dict | None, new: dict, ran: list[tuple[str, ...]], parts: list[tuple[str, ...]],
                run: dict) -> dict:
    """The file to write: ``new`` (this run's, ``run`` its record), each part it measured (the
    key paths ``ran``, e.g. ``("accuracy", "tiny")``) with its own ``run``, and the parts of
    ``old`` (the earlier file, or ``None``) among ``parts`` that this run did not measure, with
    the records they had (``None`` where the earlier file had none). A file that keeps any of
    those says ``parts_from_separate_runs``."""
    out = {**new, "run": run}
    for path in ran:
        parent = _at(out, path[:-1])
        parent[path[-1]] = {**parent[path[-1]], "run": run}
    kept = [p for p in parts if p not in ran and p[0] not in ("run", "parts_from_separate_runs")
            and isinstance(_at(old or {}, p), dict)]
    for path in kept:
        parent = out
        for k in path[:-1]:
            parent = parent.setdefault(k, {})
        parent[path[-1]] = {"run": None, **_at(old, path)}
    if kept:
        out["parts_from_separate_runs"] = SEPARATE_RUNS
    return out


def table(headers: list[str], rows: list[list]) -> str:
    """A plain-text table for a script's closing summary (columns right-aligned but the first)."""
    def cell(c) -> str:
        if not isinstance(c, float):
            return str(c)
        return f"{c:,.0f}" if abs(c) >= 100 else f"{c:.2f}" if abs(c) >= 1 else f"{c:.3g}"

    cells = [[str(h) for h in headers]] + [[cell(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(cells[0]), "  ".join("-" * w for w in widths), *map(fmt, cells[1:])])
