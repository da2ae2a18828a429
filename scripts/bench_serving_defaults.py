"""The serving engine as a library user gets it, ``ServingEngine(model, ServingConfig(manager))``,
against the on-device loop ``engine.generate``, beside earlier settings, with the time to first
token of a request that arrives mid-run.

Throughput: the workload of ``scripts/serving_overhead.py`` (R prompts of 16 tokens, all at step 0,
32 new tokens each, greedy, the built-in model), at R = 32 and R = 256 rows. Each round runs
``generate`` once and every configuration once, alternating in one process (the machine's speed
drifts between rounds); the ratio is the median of the rounds' ratios of tokens/s, and every
configuration's greedy tokens must equal ``generate``'s. A first round compiles and is not timed.
Beside the wall-time ratio, the ratio of process CPU seconds (every thread's work), steadier when
other processes share the cores.
Configurations (``--configs``):

* ``defaults``: ``ServingConfig(manager)``: the values it resolved are recorded
  (``chunk_size``, ``max_prefill_rows``, ``decode_steps``);
* ``defaults_k8``: the defaults with ``decode_steps=8`` (a loaded-machine probe found the
  steps of 16-step bursts slower than those of 8-step ones at R = 256; to be settled on a quiet
  machine);
* ``cli_before``: ``chunk_size=16, max_prefill_rows=min(32, R), decode_steps=8`` (the setting the
  issue measured as "CLI-like");
* ``defaults_before``: ``chunk_size=64, max_prefill_rows=min(8, R), decode_steps=1`` (the
  library's defaults before they changed).

Latency: the same pool runs R - 1 of those requests from step 0 and one more that arrives at step
``--late-step`` (default 8: every other row is decoding). Its time to first token
(``RequestStats.time_to_first_token_s``: wall time from its submission to its first token) and
the steps that took (``first_token_step - arrival_step``) are reported per configuration, the
median over the rounds; ``run`` ends a burst of decode steps at the arrival, so ``decode_steps``
does not delay it, and what is left is its admission and its prefill step.

Per configuration the median round's ``ServingEngine.stats()`` split of the run (seconds, summed
over the device calls: ``schedule_s``, ``inputs_s``, ``device_s``, ``process_s``) and its device
calls are recorded, so that where the gap to ``generate`` comes from can be read off the file.
The load average is recorded: figures from a loaded machine say so (``--label``).

    python scripts/bench_serving_defaults.py              # writes results/bench_serving_defaults.json
    python scripts/bench_serving_defaults.py --rows 256   # redoes R = 256 only; the file keeps R = 32
    python scripts/bench_serving_defaults.py --smoke --out /tmp/smoke.json   # a check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.run_record import merge_parts, record, table, utc_now
from scripts.serving_overhead import NEW, PROMPT, workload

CONFIGS = ("defaults", "defaults_k8", "cli_before", "defaults_before")


def serving_config(name: str, mgr):
    """The ``ServingConfig`` of configuration ``name`` (module docstring) on manager ``mgr``."""
    from paged_kv.engine import ServingConfig

    r = mgr.max_seqs
    if name == "defaults":
        return ServingConfig(mgr)
    if name == "defaults_k8":
        return ServingConfig(mgr, decode_steps=8)
    if name == "cli_before":
        return ServingConfig(mgr, chunk_size=16, max_prefill_rows=min(32, r), decode_steps=8)
    if name == "defaults_before":
        return ServingConfig(mgr, chunk_size=64, max_prefill_rows=min(8, r), decode_steps=1)
    raise ValueError(f"configuration {name!r} must be one of {CONFIGS}")


def manager(r: int):
    import paged_kv as pk

    # Blocks for every request's prompt and new tokens, as scripts/serving_overhead.py sizes them.
    return pk.ManagerConfig(num_blocks=r * -(-(PROMPT + NEW) // 16) + 1, block_size=16, max_seqs=r,
                            max_blocks_per_seq=8)


def serve(model, cfg, requests) -> tuple[float, float, list, object]:
    """One timed run on a fresh engine: (wall seconds, process CPU seconds, outputs in request
    order, its stats)."""
    from paged_kv.engine import ServingEngine

    engine = ServingEngine(model, cfg)
    c0, t0 = time.process_time(), time.perf_counter()
    outs = list(engine.run(requests))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    by_id = {o.request_id: o for o in outs}
    return wall, cpu, [by_id[i] for i in range(len(requests))], engine.stats()


def generate_run(model, r: int) -> tuple[float, float, list]:
    """``engine.generate`` on the workload, timed: (wall seconds, process CPU seconds, each row's
    tokens)."""
    import jax

    from paged_kv import engine as eng
    from paged_kv.models.paged import allocate_pages, page_spec

    mgr = manager(r)
    toks, lens = eng.pad_prompts(workload(r), width=PROMPT)
    params = eng.SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    pages = allocate_pages(page_spec(model, mgr.num_blocks, mgr.block_size))
    c0, t0 = time.process_time(), time.perf_counter()
    out, _, _ = eng.generate(model, pages, toks, lens, jax.random.key(0), params, manager=mgr, chunk_size=64)
    jax.block_until_ready(out.tokens)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, [row[0][:int(n)].tolist() for row, n in zip(out.tokens, out.lengths[:, 0])]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (after one that compiles)")
    ap.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    ap.add_argument("--late-step", type=int, default=8, help="the arrival step of the latency run's late request")
    ap.add_argument("--smoke", action="store_true", help="a check that it runs: R = 2, one round, defaults only")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_serving_defaults.json"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.repeats, args.configs, args.late_step = [2], 1, ["defaults"], 2
    started = utc_now()
    import jax

    from paged_kv.engine import Request, SamplingParams
    from paged_kv.models import load_hf_checkpoint

    model = load_hf_checkpoint(ROOT / "checkpoints" / "tiny-llama")
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    rows = {}
    for r in args.rows:
        mgr = manager(r)
        cfgs = {name: serving_config(name, mgr) for name in args.configs}
        prompts = workload(r)
        reqs = [Request(p, params, request_id=i) for i, p in enumerate(prompts)]
        # The latency run: R - 1 requests from step 0, the last one arriving at --late-step.
        late = [Request(p, params, request_id=i, arrival=args.late_step if i == r - 1 else 0)
                for i, p in enumerate(prompts)]
        load = os.getloadavg()
        for cfg in cfgs.values():  # compiles every program (jit's cache serves the next engines)
            serve(model, cfg, reqs)
            serve(model, cfg, late)
        generate_run(model, r)
        runs = {name: [] for name in cfgs}
        gen, same = [], True
        for _ in range(args.repeats):
            g_wall, g_cpu, g_tokens = generate_run(model, r)
            gen.append(r * NEW / g_wall)
            for name, cfg in cfgs.items():
                wall, cpu, outs, st = serve(model, cfg, reqs)
                same &= [o.tokens[0] for o in outs] == g_tokens
                _, _, louts, _ = serve(model, cfg, late)
                ls = louts[-1].stats
                runs[name].append({"tokens_per_s": r * NEW / wall, "ratio": g_wall / wall, "cpu_ratio": g_cpu / cpu,
                                   "ttft_ms": 1000 * ls.time_to_first_token_s,
                                   "ttft_steps": ls.first_token_step - ls.arrival_step,
                                   "stats": st})
        out = {}
        for name, cfg in cfgs.items():
            xs = runs[name]
            mid = sorted(xs, key=lambda x: x["ratio"])[len(xs) // 2]
            st = mid["stats"]
            out[name] = {
                "resolved": {"chunk_size": cfg.chunk_size, "max_prefill_rows": cfg.max_prefill_rows,
                             "decode_steps": cfg.decode_steps},
                "ratio_to_generate": round(statistics.median(x["ratio"] for x in xs), 3),
                "ratio_per_round": [round(x["ratio"], 3) for x in xs],
                # generate's process CPU seconds over serving's: steadier than wall time when other
                # processes share the cores (both count every thread's work)
                "cpu_ratio_to_generate": round(statistics.median(x["cpu_ratio"] for x in xs), 3),
                "cpu_ratio_per_round": [round(x["cpu_ratio"], 3) for x in xs],
                "tokens_per_s": [round(x["tokens_per_s"], 1) for x in xs],
                "late_ttft_ms": round(statistics.median(x["ttft_ms"] for x in xs), 2),
                "late_ttft_ms_per_round": [round(x["ttft_ms"], 2) for x in xs],
                "late_ttft_steps": mid["ttft_steps"],
                "median_round": {"steps": st.steps, "device_calls": st.device_calls,
                                 **{k: round(getattr(st, k), 4) for k in ("schedule_s", "inputs_s", "device_s",
                                                                          "process_s", "step_s")}},
            }
            print(f"R={r} {name} (C={cfg.chunk_size}, P={cfg.max_prefill_rows}, K={cfg.decode_steps}): "
                  f"{out[name]['ratio_to_generate']:.2f}x generate ({out[name]['cpu_ratio_to_generate']:.2f}x in CPU "
                  f"time), late arrival's first token "
                  f"{out[name]['late_ttft_ms']:.1f} ms", flush=True)
        rows[str(r)] = {"configs": out, "generate_tokens_per_s": [round(x, 1) for x in gen],
                        "same_greedy_tokens": same, "loadavg_before": [round(x, 2) for x in load],
                        "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    run = record(__file__, args, argv, started=started)
    result = {"run": run, "label": args.label, "jax": jax.__version__,
              "backend": jax.default_backend(), "cpus": os.cpu_count(),
              "workload": {"prompt_tokens": PROMPT, "new_tokens": NEW, "greedy": True, "arrivals": "all at step 0",
                           "late_request": f"R - 1 at step 0, one at step {args.late_step}"},
              "rows": rows}
    # A run of some row counts keeps the file's other rows, each with the record of its own run.
    old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else None
    result = merge_parts(old, result, [("rows", r) for r in rows],
                         [("rows", r) for r in (old or {}).get("rows", {})], run)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(["R", "config", "C", "P", "K", "x generate", "x (CPU time)", "late TTFT ms", "calls", "schedule s",
                 "inputs s", "device s", "process s"],
                [[r, name, *x["resolved"].values(), x["ratio_to_generate"], x["cpu_ratio_to_generate"],
                  x["late_ttft_ms"],
                  x["median_round"]["device_calls"], *(x["median_round"][k] for k in
                                                       ("schedule_s", "inputs_s", "device_s", "process_s"))]
                 for r, row in rows.items() for name, x in row["configs"].items()]))
    print("(x generate: median of the rounds' ratios of tokens/s; late TTFT: median; seconds: the median round's)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
