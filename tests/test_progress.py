"""The CLI's progress display, without compiling: the compile lines (with and without ticking) and
when the serving bar may show an ETA."""

import io
import time

from paged_kv.apps.progress import CompileProgress, SteadyRate


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_compile_lines_name_each_step_variant_and_its_seconds():
    out, clock = io.StringIO(), Clock()
    p = CompileProgress(out, live=False, clock=clock)
    names = ["step variant 1/2 (decode)", "step variant 2/2 (prefill chunk [8, 64] + decode)", "admit", "free"]
    for k, name in enumerate(names, start=1):
        p(k, 4, name, None)
        clock.t += 2.5 * k
        p(k, 4, name, 2.5 * k)
    assert out.getvalue().splitlines() == [
        "compiling step variant 1/2 (decode) ... 2.5 s",
        "compiling step variant 2/2 (prefill chunk [8, 64] + decode) ... 5.0 s",
        "compiling admit (3/4) ... 7.5 s",
        "compiling free (4/4) ... 10.0 s",
    ]
    assert [s for _, s in p.lines] == [2.5, 5.0, 7.5, 10.0]


def test_live_line_ticks_elapsed_seconds_while_compiling():
    out = io.StringIO()
    p = CompileProgress(out, live=True, tick=0.02)
    p(1, 2, "step variant 1/2 (decode)", None)
    time.sleep(0.2)  # "XLA at work": the thread rewrites the line meanwhile
    p(1, 2, "step variant 1/2 (decode)", 0.2)
    text = out.getvalue()
    ticks = text.count("\rcompiling step variant 1/2 (decode) ... ")
    assert ticks >= 3, text  # a few ticks, then the final line
    assert text.endswith(" s\x1b[K\n") and "\rcompiling step variant 1/2 (decode) ... 0.2 s" in text
    n = len(out.getvalue())
    time.sleep(0.1)
    assert len(out.getvalue()) == n  # the ticker stopped with the program


def test_eta_waits_for_a_steady_step_rate():
    r = SteadyRate(window=5, spread=3.0)
    t = 0.0
    assert not r.observe(t)
    t += 30.0  # a first step that compiled
    for _ in range(4):
        assert not r.observe(t)
        t += 0.1
    assert not r.observe(t)  # the 30 s step is still in the window
    t += 0.1
    assert r.observe(t)  # five steps of 0.1 s
    t += 5.0
    assert r.observe(t)  # once steady, it stays (the bar's format does not flip back)


def test_uneven_steps_are_not_steady():
    r = SteadyRate(window=3, spread=2.0)
    for t in (0.0, 0.1, 0.5, 0.6, 1.5, 1.6):
        r.observe(t)
    assert not r.steady


def test_bar_shows_an_eta_once_items_come_steadily():
    from paged_kv.apps.progress import BAR_STEADY, BAR_WARMING, bar

    out, clock = io.StringIO(), Clock()
    b = bar(10, "measuring", out=out, window=3, clock=clock)
    clock.t += 30.0  # the first item compiles
    b.update()
    for _ in range(2):
        clock.t += 1.0
        b.update()
    assert b.bar_format == BAR_WARMING  # 3 gaps needed, the first one an outlier
    for _ in range(3):
        clock.t += 1.0
        b.update()
    assert b.bar_format == BAR_STEADY and b.n == 6
    b.close()
    assert "measuring" in out.getvalue()
