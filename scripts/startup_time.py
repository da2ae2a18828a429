"""Wall time of the main job (``python -m paged_kv``, default workload) in fresh processes: once
with an empty persistent compilation cache (cold), then twice with the cache it filled (warm),
and once with the cache turned off. Imports, compiling and serving included; each run also
records the main job's per-program compile table (``report.json``'s ``compile.programs``).

    python scripts/startup_time.py          # writes results/startup_time.json (about 2 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_main(cache: Path | None, out: Path) -> dict:
    args = [sys.executable, "-m", "paged_kv", "--no-progress", "--out-dir", str(out)]
    args += ["--no-compile-cache"] if cache is None else ["--compile-cache", str(cache)]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_COLOR": "1"})
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"main job failed ({r.returncode}):\n{r.stderr[-2000:]}")
    report = json.loads((out / "report.json").read_text())
    return {"wall_s": round(wall, 2), "compile_s": report["throughput"]["compile_s"],
            "serving_s": report["throughput"].get("serving_s"),
            # per jitted program: compile seconds (cold) or lowering + cache loading (warm), and why it exists
            "programs": report.get("compile", {}).get("programs"),
            "load_avg_1min_before": load, "load_avg_1min_after": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "startup_time.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="paged-kv-startup-") as tmp:
        tmp = Path(tmp)
        cache = tmp / "cache"
        runs = {}
        for name, c in [("cold", cache), ("warm", cache), ("warm_again", cache), ("no_cache", None)]:
            runs[name] = run_main(c, tmp / name)
            print(f"{name:10s} {runs[name]['wall_s']:6.1f} s wall (compile {runs[name]['compile_s']})  "
                  f"load {runs[name]['load_avg_1min_before']:.2f}", flush=True)
        entries = len(list(cache.iterdir()))
    result = {"runs": runs, "cache_entries": entries, "cpus": os.cpu_count(),
              "command": "python " + " ".join(sys.argv), "goal": "cold <= 15 s, warm <= 6 s (issue 17)"}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
