"""How a run was made, for the files it writes: the command line and its parsed options, the
versions of paged-kv (and its git commit when it runs from a checkout), JAX, jaxlib, flax and
Python, the backend and device kind, and when the run started and ended (ISO 8601, UTC).

``run_record`` gives the record, ``finish_record`` adds the end time; ``write_atomic`` writes any
file (a report, a picture) so that an interrupted write or a full disk never leaves a truncated
one behind.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

PACKAGE = "paged-kv"


def utc_now() -> str:
    """The current time, ISO 8601 in UTC to the second: ``2026-12-07T08:14:26+00:00``."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def git_commit(folder: str | os.PathLike | None = None) -> str | None:
    """The commit checked out where the ``paged_kv`` package lives (``git rev-parse HEAD`` in its
    folder, ``folder`` by default the package's), with ``+dirty`` appended when tracked files
    differ from it; None when the package is not in a git checkout of its own (installed from a
    wheel, even into a virtual environment inside some other repository), when git is missing, or
    when it fails or takes over 5 s. Never raises."""
    pkg = Path(folder) if folder is not None else Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(pkg), *args], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    # The checkout must be the package's own: its top folder holds the package folder.
    if not top or Path(top).resolve() != pkg.resolve().parent:
        return None
    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no")
    return commit + ("+dirty" if changed else "")


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """The versions of paged-kv, JAX, jaxlib, flax and Python (None where a package is not
    installed), and paged-kv's git commit (``git_commit``)."""
    return {"paged_kv": _version(PACKAGE), "paged_kv_commit": git_commit(), "jax": _version("jax"),
            "jaxlib": _version("jaxlib"), "flax": _version("flax"), "python": platform.python_version()}


def device_info() -> dict:
    """JAX's backend, the kind and count of its devices (JAX must already be imported: the
    record never starts a backend by itself). Empty when JAX has not been imported."""
    jax = sys.modules.get("jax")
    if jax is None:
        return {}
    devices = jax.devices()
    return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind, "device_count": len(devices)}


def run_record(argv: Sequence[str], options: dict, *, prog: str = "python -m paged_kv",
               started: str | None = None) -> dict:
    """The record of a run: ``command`` (the program and its arguments, as given), ``argv``,
    ``options`` (every option after parsing, defaults included), ``versions``, ``started`` (now
    unless given) and ``ended`` (None until ``finish_record``). The device comes with
    ``finish_record`` (JAX has started by then)."""
    import shlex

    return {"command": " ".join([prog, *(shlex.quote(a) for a in argv)]), "argv": list(argv),
            "options": dict(options), "versions": versions(), "started": started or utc_now(), "ended": None}


def finish_record(record: dict) -> dict:
    """``record`` with the backend and devices (``device_info``) and ``ended`` set to now."""
    return {**record, **device_info(), "ended": utc_now()}


def write_atomic(path: str | os.PathLike, data: bytes | str) -> str:
    """Writes ``data`` to ``path``: first to a temporary file in the same folder, flushed to disk,
    then renamed over ``path`` (``os.replace``, atomic on one file system). A failure (a full
    disk, an interrupt) leaves ``path`` as it was and no temporary file behind. The folder must
    exist. Returns the path."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp made it 0600: the mode a plain open() would give
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return str(path)


def _read_umask() -> int:
    """The process's umask (read by setting it and back: there is no other way; done once, at
    import, not while another thread may create files)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


__all__ = ["device_info", "finish_record", "git_commit", "run_record", "utc_now", "versions", "write_atomic"]
