"""Progress display of the CLI: compiling, then serving.

* ``CompileProgress``: the callback of ``ServingEngine.compile``. Each program gets one line,
  "compiling step variant 1/2 (decode) ... 5.2 s"; on a terminal the line ticks its elapsed
  seconds while XLA works (a daemon thread rewrites it with ``\\r`` every ``tick`` seconds), so a
  long compile never looks like a hang.
* ``SteadyRate``: whether steps run at a steady rate yet, so the serving bar shows an ETA only
  then (an ETA from the first steps, or from a compile, is noise: "34:34" that means nothing).

Both take the clock and the stream as arguments, so they are tested without compiling anything.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO


class CompileProgress:
    """``progress(k, total, name, seconds)``: ``seconds`` None when program ``k`` starts, its
    compile seconds when it ends.

    Args:
      out: the stream (default ``sys.stdout``).
      live: tick the elapsed seconds (default: when ``out`` is a terminal).
      tick: seconds between ticks.
      clock: ``time.perf_counter`` (a test passes its own).
    """

    def __init__(self, out: TextIO | None = None, *, live: bool | None = None, tick: float = 0.5,
                 clock: Callable[[], float] = time.perf_counter):
        self.out = out if out is not None else sys.stdout
        self.live = self.out.isatty() if live is None else live
        self.tick, self.clock = tick, clock
        self.lines: list[tuple[str, float]] = []  # (label, seconds) of the programs done
        self._label = ""
        self._t0 = 0.0
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @staticmethod
    def label(k: int, total: int, name: str) -> str:
        """"compiling step variant 1/2 (decode)"; other programs say their place: "compiling admit (3/4)"."""
        return f"compiling {name}" if name.startswith("step variant") else f"compiling {name} ({k}/{total})"

    def __call__(self, k: int, total: int, name: str, seconds: float | None) -> None:
        if seconds is None:
            self._label, self._t0 = self.label(k, total, name), self.clock()
            self._write(f"{self._label} ...", end="")
            if self.live:
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._ticker, args=(self._stop,), daemon=True)
                self._thread.start()
            return
        if self._stop is not None:
            self._stop.set()
            self._thread.join()
            self._stop = self._thread = None
        self.lines.append((self._label, seconds))
        if self.live:
            self._write(f"\r{self._label} ... {seconds:.1f} s\x1b[K")
        else:
            self._write(f" {seconds:.1f} s")
        self._label = ""  # the line is ended

    def end_line(self) -> None:
        """Ends the line of a program still compiling (an error or an interrupt stopped it), so
        what is printed next starts on a line of its own; nothing when no line is open."""
        if self._stop is not None:
            self._stop.set()
            self._thread.join()
            self._stop = self._thread = None
        if self._label:
            self._write("")
            self._label = ""

    def _ticker(self, stop: threading.Event) -> None:
        while not stop.wait(self.tick):
            self._write(f"\r{self._label} ... {self.clock() - self._t0:.0f} s", end="")

    def _write(self, text: str, end: str = "\n") -> None:
        with self._lock:
            self.out.write(text + end)
            self.out.flush()


class SteadyRate:
    """Step times seen so far; ``steady`` once the last ``window`` steps each took within
    ``spread`` times the fastest of them (no compile, no warm-up outlier among them).

    ``observe(now)`` is called after each step with the clock."""

    def __init__(self, window: int = 5, spread: float = 3.0):
        self.window, self.spread = window, spread
        self._times: list[float] = []
        self.steady = False

    def observe(self, now: float) -> bool:
        self._times.append(now)
        self._times = self._times[-(self.window + 1):]
        if not self.steady and len(self._times) == self.window + 1:
            gaps = [b - a for a, b in zip(self._times, self._times[1:])]
            lo = min(gaps)
            self.steady = lo > 0 and max(gaps) <= self.spread * lo
        return self.steady


# tqdm formats: no ETA (nor rate) until the rate is steady.
BAR_WARMING = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
BAR_STEADY = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

__all__ = ["BAR_STEADY", "BAR_WARMING", "CompileProgress", "SteadyRate"]
