"""Wall time of the main job (``python -m paged_kv``, default workload) in fresh processes: once
with an empty persistent compilation cache (cold), then with the cache it filled (warm, a few
times), and once with the cache turned off. Imports, compiling and serving included; each run also
records the main job's per-program compile table (``report.json``'s ``compile.programs``).

    python scripts/startup_time.py                          # writes results/startup_time.json
    python scripts/startup_time.py --baseline /tmp/before   # the same runs of another checkout,
                                                            # interleaved with these ones

``--job-args '--requests 2 --max-new-tokens 4'`` gives the main job a smaller workload,
``--warm 1 --no-no-cache-run`` fewer runs (a check that the script works).

The main job needs the ``cli`` extra (tqdm, matplotlib: ``pip install -e '.[cli]'``).

With ``--baseline DIR`` (a checkout of the code to compare with, e.g. ``git worktree add
/tmp/before HEAD~3``) every run is made twice in a row, once per tree, so that both see the same
machine; the medians of the warm runs and a ratio are reported. The machine's load (1-minute
average) is recorded around each run: the main job's own compile uses about 1.7 cores, so a
quiet machine reads about 2 after a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from scripts.extras import require
from scripts.run_record import record, table, utc_now


def run_main(tree: Path, cache: Path | None, out: Path, job_args: list[str] = ()) -> dict:
    args = [sys.executable, "-m", "paged_kv", "--no-progress", "--out-dir", str(out), *job_args]
    args += ["--no-compile-cache"] if cache is None else ["--compile-cache", str(cache)]
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(tree)}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run(args, cwd=tree, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"main job in {tree} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    return {"wall_s": round(wall, 2), "compile_s": report["throughput"]["compile_s"],
            "serving_s": report["throughput"].get("serving_s"),
            # per jitted program: compile seconds (cold) or lowering + cache loading (warm), and why it exists
            "programs": report.get("compile", {}).get("programs"),
            "load_avg_1min_before": load, "load_avg_1min_after": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> None:
    require("cli", "tqdm", "matplotlib")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "startup_time.json")
    ap.add_argument("--baseline", type=Path, help="another checkout, run interleaved with this one")
    ap.add_argument("--warm", type=int, default=3, help="warm runs (default 3)")
    ap.add_argument("--no-cache-run", action=argparse.BooleanOptionalAction, default=True,
                    help="also a run with the cache turned off (default: yes)")
    ap.add_argument("--job-args", default="",
                    help="arguments for the main job (default: none, its default workload), e.g. a small one: "
                         "'--requests 2 --max-new-tokens 4'")
    ap.add_argument("--label", default="", help="what this tree is (e.g. a commit)")
    args = ap.parse_args(argv)
    started = utc_now()
    trees = {"this": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    names = ["cold"] + [f"warm_{i}" for i in range(1, args.warm + 1)] + (["no_cache"] if args.no_cache_run else [])
    job_args = shlex.split(args.job_args)
    runs: dict = {t: {} for t in trees}
    with tempfile.TemporaryDirectory(prefix="paged-kv-startup-") as tmp:
        tmp = Path(tmp)
        for name in names:
            for t, tree in trees.items():
                cache = None if name == "no_cache" else tmp / f"cache-{t}"
                r = runs[t][name] = run_main(tree, cache, tmp / f"{t}-{name}", job_args)
                print(f"{t:8s} {name:8s} {r['wall_s']:6.1f} s wall (compile {r['compile_s']}, serving "
                      f"{r['serving_s']})  load {r['load_avg_1min_before']:.2f}", flush=True)
        entries = {t: len(list((tmp / f"cache-{t}").iterdir())) for t in trees}
    summary = {}
    for t in trees:
        warm = [runs[t][n]["wall_s"] for n in names if n.startswith("warm")]
        summary[t] = {"cold_s": runs[t]["cold"]["wall_s"], "warm_median_s": statistics.median(warm) if warm else None,
                      "no_cache_s": runs[t]["no_cache"]["wall_s"] if args.no_cache_run else None}
    if args.baseline:
        summary["ratio_this_to_baseline"] = {k: round(summary["this"][k] / summary["baseline"][k], 3)
                                             for k in summary["this"] if summary["this"][k] is not None}
    run = record(__file__, args, argv, started=started)
    result = {"run": run, "label": args.label, "trees": {t: str(p) for t, p in trees.items()}, "summary": summary,
              "runs": runs, "cache_entries": entries, "cpus": os.cpu_count(), "command": run["command"],
              "goal": "cold <= 15 s, warm <= 6 s (issue 17)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(["tree", "cold (s)", "warm, median (s)", "no cache (s)"],
                [[t, *(summary[t][k] if summary[t][k] is not None else "-" for k in ("cold_s", "warm_median_s",
                                                                                      "no_cache_s"))]
                 for t in trees]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
