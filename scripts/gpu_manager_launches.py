"""Before/after launch and sync counts of the block manager's GPU programs, from two runs of the
GPU compile gate (issue 15: the manager's share of a serving decode step should take <= 20 host
launches and <= 1 device-to-host sync on its common path).

The two gate reports come from the same gate (``scripts/gpu_compile.py``, deviceless XLA:GPU for
sm_90, 32 layers), run on the code before and after the change::

    bash scripts/gpu_gate.sh --only programs --workers 1 \\
        --programs serving_manager_share append admit free serving_step_decode \\
        --out results/gpu_compile_manager_after.json
    bash scripts/gpu_gate.sh --only programs --workers 1 \
        --programs generate_loop beam_search_loop serving_step_prefill serving_step_decode_tp2 \
        --out results/gpu_compile_engine_after.json
    python scripts/gpu_manager_launches.py --before results/gpu_compile_report_after_scan.json \
        --after results/gpu_compile_manager_after.json results/gpu_compile_engine_after.json \
        --out results/gpu_manager_launches_round1.json

Second round (one sync: ``share.free_select_append``, no pool-sized copy), before = main at
a2171fa, after = branch gpu-sync, the same gate on both checkouts::

    bash scripts/gpu_gate.sh --only programs --workers 1 --programs serving_manager_share append \
        admit free serving_step_decode serving_step_prefill --out results/gpu_compile_manager_sync_before.json
    # (the same on the branch, --out results/gpu_compile_manager_sync_after.json)
    python scripts/gpu_manager_launches.py     # the defaults: writes results/gpu_manager_launches.json

The first round's "before" report is ``results/gpu_compile_report_after_scan.json``, the same gate's CI run on
the code before the GPU forms (commit 1fc9faf; the manager is the same at faebdf1, where this
branch starts, and a rerun of the four manager programs there gave the same figures). Per program and path ("least": every ``cond`` takes its cheapest branch and every
``while`` runs no trip, the common path; "most": the costliest branch and one trip): kernels run
(those inside CUDA graphs included), copies, host launches (a kernel, copy or CUDA graph the host
launches: a graph counts once) and host syncs (a ``cond`` predicate or ``while`` condition read
back by the host), plus the conditionals, whiles and command buffers of the program.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = ("serving_manager_share", "append", "admit", "free", "serving_step_decode", "serving_step_prefill",
            "serving_step_decode_tp2", "generate_loop", "beam_search_loop")
GOAL = {"host_launches": 20, "host_syncs": 1}


def figures(report: dict) -> dict:
    out = {}
    for p in report["programs"]:
        if p["program"] not in PROGRAMS or p.get("status") != "compiled":
            continue
        s = p["per_step"]
        out[p["program"]] = {
            "least": s["least"], "most": s["most"], "conditionals": s["conditionals"], "whiles": s["whiles"],
            "control_flow_in_command_buffers": s["control_flow_in_command_buffers"],
            "command_buffers": s["command_buffers"], "temp_bytes": p["memory"]["temp_size_in_bytes"],
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default=os.path.join(ROOT, "results", "gpu_compile_manager_sync_before.json"))
    ap.add_argument("--after", nargs="+", default=[os.path.join(ROOT, "results", "gpu_compile_manager_sync_after.json")])
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "gpu_manager_launches.json"))
    a = ap.parse_args(argv)
    with open(a.before) as f:
        before = json.load(f)
    c = {}
    for path in a.after:
        with open(path) as f:
            after = json.load(f)
        c.update(figures(after))
    b = figures(before)
    share = c.get("serving_manager_share")
    report = {
        "what": "per-step thunks of the manager's GPU programs, deviceless XLA:GPU sm_90, same gate before/after",
        "jax": after.get("jax"),
        "before_report": os.path.relpath(a.before, ROOT),
        "after_reports": [os.path.relpath(p, ROOT) for p in a.after],
        "goal_common_path": GOAL,
        "goal_met": None if share is None else {
            k: share["least"][k] <= v for k, v in GOAL.items()},
        "programs": {name: {"before": b.get(name), "after": c.get(name)} for name in PROGRAMS
                     if name in b or name in c},
    }
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{'program':24} {'path':5} {'kernels':>15} {'host launches':>15} {'host syncs':>12}  conds/whiles")
    for name, v in report["programs"].items():
        for path in ("least", "most"):
            bb, aa = (v["before"] or {}).get(path, {}), (v["after"] or {}).get(path, {})
            cw = ""
            if path == "least":
                cw = (f"{(v['before'] or {}).get('conditionals')}/{(v['before'] or {}).get('whiles')} -> "
                      f"{(v['after'] or {}).get('conditionals')}/{(v['after'] or {}).get('whiles')}")
            print(f"{name:24} {path:5} {bb.get('kernels')!s:>6} -> {aa.get('kernels')!s:>5} "
                  f"{bb.get('host_launches')!s:>6} -> {aa.get('host_launches')!s:>5} "
                  f"{bb.get('host_syncs')!s:>4} -> {aa.get('host_syncs')!s:>4}  {cw}")
    print("goal met (common path of serving_manager_share):", report["goal_met"], "->", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
