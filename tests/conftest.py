"""Suite-wide fixtures."""

import collections
import gc

import jax
import jax.monitoring
import pytest


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module.

    XLA:CPU maps a few memory regions per compiled executable and keeps them while JAX's caches
    hold the executable. The whole suite compiles thousands of programs: kept, they passed the
    kernel's limit of 65,530 mappings per process (``vm.max_map_count``) about three quarters of
    the way through, and the next compilation crashed the process (a segfault inside XLA). No test
    relies on a program compiled by another module.
    """
    yield
    jax.clear_caches()
    gc.collect()


# The slowest test files (compile-bound: many distinct programs, subprocesses that compile), the
# slowest first. scripts/test.sh runs the suite on two workers with `--dist loadfile
# --no-loadscope-reorder`: xdist hands out whole files in collection order, so these go out first
# and the many short files fill in behind them; otherwise (xdist's default order, by number of
# tests) a slow file with few tests comes last and one core idles while the other finishes it.
# Only the order changes; a file missing here (renamed, new) just runs after these.
SLOW_FILES_FIRST = (
    "test_cli.py", "test_straight_line.py", "test_batch_invariant.py", "test_block_manager_properties.py",
    "test_prefix_cache.py", "test_readme.py", "test_model_gpt2.py", "test_serving_lifecycle.py",
    "test_engine_generate.py", "test_engine_groups.py", "test_block_manager_examples.py", "test_sharding.py",
    "test_model_families.py", "test_kernels_quant.py", "test_kv_quant_engines.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Puts the files of ``SLOW_FILES_FIRST`` first, in that order; every other file keeps its
    place after them, and the tests of a file keep their order (a stable sort by file)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# Seconds per test file (setup, call and teardown of its tests, summed on whichever worker ran
# them), printed after the run: the suite's time budget is kept per file (issue-level goal: the
# whole suite within 15 minutes on two cores), and --durations alone names tests, not files.
# Beside each, the seconds XLA spent compiling in the test process and the programs it compiled
# (subprocesses not counted): the suite is compile-bound, and a file's cost is its distinct programs.
_FILE_SECONDS: collections.Counter[str] = collections.Counter()
_FILE_COMPILE: collections.Counter[str] = collections.Counter()
_FILE_PROGRAMS: collections.Counter[str] = collections.Counter()
_COMPILED = [0.0, 0]  # backend-compile seconds and programs in this process so far


def _on_duration(event: str, seconds: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILED[0] += seconds
        _COMPILED[1] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)


_START = pytest.StashKey[tuple[float, int]]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    item.stash[_START] = (_COMPILED[0], _COMPILED[1])
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Adds to each test's teardown report, as a user property, what it compiled since its setup
    began: (seconds, programs). xdist sends it to the controller, which prints the table."""
    outcome = yield
    if call.when == "teardown" and _START in item.stash:
        seconds, programs = item.stash[_START]
        outcome.get_result().user_properties.append(("compile", (_COMPILED[0] - seconds, _COMPILED[1] - programs)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] += report.duration
    for name, value in report.user_properties:
        if name == "compile":
            _FILE_COMPILE[path] += value[0]
            _FILE_PROGRAMS[path] += value[1]


def pytest_terminal_summary(terminalreporter) -> None:
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.section("seconds per test file (slowest 25): wall, then XLA compile in-process and programs")
    for path, secs in _FILE_SECONDS.most_common(25):
        terminalreporter.write_line(f"{secs:8.1f} s  {100 * secs / total:5.1f} %  {_FILE_COMPILE[path]:7.1f} s "
                                    f"{_FILE_PROGRAMS[path]:6d}  {path}")
    terminalreporter.write_line(f"{total:8.1f} s  in all, over {len(_FILE_SECONDS)} files (summed over workers); "
                                f"compile {sum(_FILE_COMPILE.values()):.1f} s, "
                                f"{sum(_FILE_PROGRAMS.values())} programs")
