"""Ctrl-C for the command line, and its test hook.

Python turns SIGINT into KeyboardInterrupt, which only surfaces between bytecodes: a Ctrl-C while
XLA compiles waits for the compiler, and unwinding with XLA threads still at work can crash the
interpreter on the way out (a segmentation fault seconds after "interrupted"); during imports it
prints a long traceback. Instead the CLI exits at once: the C-level signal handler writes to a
wakeup pipe that a watcher thread reads (it runs even while the main thread is inside XLA), and
the Python-level handler covers the main thread; whichever comes first flushes the output, writes
the partial report where one is set (``on_interrupt_write``), prints its lines and leaves through
``os._exit(130)`` (no interpreter teardown to crash in).

Imports nothing heavy: the handler is installed before JAX is imported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

INTERRUPTED_STATUS = 130
_exit_lock = threading.Lock()
_installed = False


def flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream, a reentrant flush from the signal handler
            pass


_on_interrupt: Callable[[], str] | None = None
"""Set while requests are being served: writes the partial report of the requests that finished
(``paged_kv.apps.cli``'s ``_RunFiles.write_partial``) and returns the line that says where."""
PARTIAL_REPORT_S = 10.0
"""How long an interrupt waits for the partial report before it exits without it."""


def _partial_report_line() -> str:
    """``_on_interrupt``'s line, run in a thread of its own that may take ``PARTIAL_REPORT_S``
    (the main thread may be inside XLA); "" when nothing is set, it fails or it takes too long."""
    hook = _on_interrupt
    if hook is None:
        return ""
    result: list[str] = []

    def write() -> None:
        try:
            result.append(hook())
        except Exception as e:  # the interrupt must still exit: say why the report is missing
            from paged_kv.apps.options import first_line

            result.append(f"paged-kv: no partial report: {first_line(e)}")

    writer = threading.Thread(target=write, name="paged-kv-partial-report", daemon=True)
    writer.start()
    writer.join(PARTIAL_REPORT_S)
    return result[0] if result else "paged-kv: no partial report (writing it took too long)"


def _interrupted() -> None:
    if not _exit_lock.acquire(blocking=False):  # the other path is already exiting
        while True:
            time.sleep(1)
    flusher = threading.Thread(target=flush_streams, daemon=True)  # a stuck pipe must not hold us
    flusher.start()
    flusher.join(1.0)
    try:
        line = _partial_report_line()
        os.write(2, (b"\n" if os.isatty(2) else b"") + b"paged-kv: interrupted\n"  # (past a progress bar)
                 + (line.encode(errors="replace") + b"\n" if line else b""))
    finally:
        os._exit(INTERRUPTED_STATUS)


def _on_sigint(signum, frame) -> None:
    _interrupted()


def _watch_wakeup_fd(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT in data:
            _interrupted()


def install_interrupt_handler() -> None:
    """Ctrl-C (SIGINT) ends the program at once: flush stdout/stderr, write the partial report
    where one is set (``on_interrupt_write``), print ``paged-kv: interrupted`` (and where the
    report went) and exit with status 130, whatever the main thread is doing (importing JAX,
    compiling, serving, rendering the report). Idempotent; only from the main thread. Cheap: it
    imports nothing, so it can run before JAX is imported."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed = True
    signal.signal(signal.SIGINT, _on_sigint)
    phase("import")  # (the test hook; announced before the wakeup pipe is set: a signal now still exits)
    try:
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (OSError, ValueError):  # no pipes here: the Python-level handler alone
        return
    threading.Thread(target=_watch_wakeup_fd, args=(r,), name="paged-kv-sigint", daemon=True).start()


# Test hook (not an option): with PAGED_KV_TEST_PHASE=NAME the CLI announces phase NAME on stderr
# when it reaches it ("paged-kv: test phase NAME ..."), so that a test can send SIGINT at a known
# point; with PAGED_KV_TEST_PHASE=NAME:wait it then waits there (up to a minute) for the signal.
_PHASE_ENV = "PAGED_KV_TEST_PHASE"


def phase(name: str) -> None:
    """The test hook: announces (and with ``:wait`` waits at) phase ``name`` when asked to."""
    want = os.environ.get(_PHASE_ENV, "")
    if want.split(":")[0] != name:
        return
    sys.stderr.write(f"paged-kv: test phase {name} (jax imported: {'jax' in sys.modules})\n")
    sys.stderr.flush()
    if want.endswith(":wait"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)


def on_interrupt_write(hook: Callable[[], str] | None) -> None:
    """Sets (or clears) what a Ctrl-C writes before it exits (``_on_interrupt``)."""
    global _on_interrupt
    _on_interrupt = hook


def interrupted_without_handler() -> None:
    """Ctrl-C as a ``KeyboardInterrupt`` (where the handler could not be installed): the same
    lines as the handler's."""
    line = _partial_report_line()
    print("\npaged-kv: interrupted" if sys.stderr.isatty() else "paged-kv: interrupted", file=sys.stderr)
    if line:
        print(line, file=sys.stderr)


__all__ = ["INTERRUPTED_STATUS", "flush_streams", "install_interrupt_handler", "interrupted_without_handler",
           "on_interrupt_write", "phase"]
