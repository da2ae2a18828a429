"""What ran: the record every benchmark writes into its results JSON (under ``"run"``).

``record(__file__, args, argv)`` returns the command that actually ran (the script and the
arguments it parsed, so a run from a test or another script records its own arguments, not the
caller's ``sys.argv``), every parsed option, the date (ISO 8601, UTC), the git commit of the
checkout and whether its tree had uncommitted changes (``None`` outside a git checkout), the
versions of paged-kv, JAX, jaxlib, flax, numpy and Python (and torch / transformers when the
script imported them), the backend, the device kind and count, the machine and its CPU count.

A file that gathers parts written by separate runs keeps each part's own record (``merge_parts``)
and says so in ``"parts_from_separate_runs"``. ``table`` formats a script's closing summary.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Imported by some scripts only: recorded when the script imported them.
OPTIONAL = ("torch", "transformers", "optax", "tqdm", "matplotlib")
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


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def commit() -> dict:
    """``{"commit": sha, "dirty": bool}`` of the checkout; both ``None`` outside a git checkout."""
    sha = _git("rev-parse", "HEAD")
    if sha is None:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": sha, "dirty": None if status is None else bool(status)}


def versions() -> dict:
    """Versions of paged-kv and its stack; torch / transformers / ... when this process imported them."""
    def dist(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    out = {"paged_kv": dist("paged-kv"), "jax": dist("jax"), "jaxlib": dist("jaxlib"), "flax": dist("flax"),
           "numpy": dist("numpy"), "python": platform.python_version()}
    for name in OPTIONAL:
        if name in sys.modules:
            out[name] = getattr(sys.modules[name], "__version__", None) or dist(name)
    return out


def device() -> dict:
    """Backend, device kind and count (initializes JAX's backend), machine and CPU count."""
    import jax

    devices = jax.devices()
    return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind, "device_count": len(devices),
            "machine": platform.machine(), "processor": platform.processor() or None, "cpu_count": os.cpu_count()}


def command(script: str, argv: list[str] | None = None) -> str:
    """The command line that ran ``script`` with ``argv`` (default ``sys.argv[1:]``), the script's
    path relative to the checkout."""
    path = Path(script).resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return shlex.join(["python", str(shown), *(sys.argv[1:] if argv is None else argv)])


def record(script: str, args=None, argv: list[str] | None = None) -> dict:
    """The run's record: ``command``, ``options`` (``vars(args)``), ``date``, ``commit``, ``dirty``,
    ``versions`` and the device (``device()``). ``script`` is the caller's ``__file__``; ``argv``
    the arguments it parsed (default ``sys.argv[1:]``)."""
    return {"command": command(script, argv),
            "options": _jsonable(vars(args)) if args is not None else {},
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            **commit(), "versions": versions(), **device()}


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
