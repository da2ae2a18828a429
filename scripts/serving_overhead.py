"""Serving overhead: host time per step (scheduling, building inputs, processing the outputs) against
device time per step, and the serving engine's tokens/s (compile excluded) against the on-device
loop ``engine.generate`` on the same greedy workload with no arrivals (R prompts of 16 tokens, all
at step 0, 32 new tokens each), at R = 32 and R = 256 rows, on the built-in model.

The serving engine runs chunks of ``C = 16`` positions in ``P = min(32, R)`` rows (``--chunk-size``,
``--prefill-rows``): the prompts' own length, as ``generate`` clips its chunk to the prompt width.
With the engine's default ``C = 64, P = 8`` three quarters of every prefill row would be padding
(``--chunk-size 64 --prefill-rows 8`` measures that). A prompt longer than ``C`` takes several of
the ``P`` rows of a step (``serving_step.prefill_pieces``), so a small ``C`` costs a long prompt
no extra steps while rows are free. The engine runs bursts of up to ``K = 8`` decode steps per
device call (``--decode-steps``, ``ServingConfig.decode_steps``; the CLI's default), the way
``generate`` runs every step in one call. Serving and generate alternate, one timed run each per round
(``--repeats`` rounds); the reported ratio is the median of the rounds' ratios.

    python scripts/serving_overhead.py                      # writes results/serving_overhead.json

It times the step from outside. Per step:

* ``device_ms``: the jitted step's call until its outputs are ready (dispatch + compute), by
  wrapping the module's jitted step function;
* ``host_ms``: the rest of ``ServingEngine.step`` (admission policy, building inputs, copying the
  outputs back, processing them, statistics); ``inputs_ms`` and ``process_ms`` split out two parts
  of it.

Compile is excluded: a first engine runs the workload once (it compiles every program, cached by
jit for any engine of the same shapes), a second engine is timed. ``generate`` is timed on its
second call. The load average is recorded: numbers from a loaded machine say so.

    python scripts/serving_overhead.py --chunk-size 64 --prefill-rows 8 --decode-steps 1 --out /tmp/c64.json
    python scripts/serving_overhead.py --ab-decode-steps 1 8 --repeats 7 --out /tmp/bursts.json
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
PROMPT, NEW = 16, 32


def fixed_length(params_cls, **kw):
    """Sampling parameters that generate ``max_new_tokens`` whatever is sampled: ``ignore_eos``
    where the tree has it (its engines stop at the model's EOS by default), the plain ones in
    older trees (which never stopped without EOS ids)."""
    try:
        return params_cls(ignore_eos=True, **kw)
    except TypeError:
        return params_cls(**kw)


def workload(r: int):
    # Distinct prompts (no prefix-cache hits between them), bytes of the built-in tokenizer.
    return [[(7 * i + 3 * j) % 250 + 3 for j in range(PROMPT)] for i in range(r)]


def timed_serving(model, r: int, repeats: int, chunk: int, rows: int, decode_steps: int = 1,
                  requests: int | None = None) -> dict:
    import jax

    import paged_kv as pk
    from paged_kv.engine import serving
    from paged_kv.engine.sampling import SamplingParams

    try:  # after the split the step lives in serving_step and the inputs are built by a function
        from paged_kv.engine import scheduler as sched_mod, serving_step as step_mod
        jit_owner = step_mod  # the engine calls the packed step where there is one
        jit_name = "packed_step_jit" if hasattr(step_mod, "packed_step_jit") else "step_jit"
    except ImportError:
        sched_mod, jit_owner, jit_name = None, serving, "_step_jit"
    blocks = r * -(-(PROMPT + NEW) // 16) + 1
    mgr = pk.ManagerConfig(num_blocks=blocks, block_size=16, max_seqs=r, max_blocks_per_seq=8)
    extra = {"decode_steps": decode_steps} if decode_steps > 1 else {}  # older trees lack the field
    cfg = serving.ServingConfig(mgr, chunk_size=chunk, max_prefill_rows=min(rows, r), **extra)
    reqs = [serving.Request(p, fixed_length(SamplingParams, max_new_tokens=NEW)) for p in workload(requests or r)]

    def run(engine):
        return list(engine.run(reqs))

    run(serving.ServingEngine(model, cfg))  # compiles every program
    original = getattr(jit_owner, jit_name)

    def measure() -> dict:  # one run (a function, so each run's closures see its own lists)
        device = []

        def timed_step(*args, **kw):
            t = time.perf_counter()
            out = original(*args, **kw)
            jax.block_until_ready(out)
            device.append(time.perf_counter() - t)
            return out

        engine = serving.ServingEngine(model, cfg)
        parts = {"inputs": [], "process": []}

        def wrap(fn, key):
            def inner(*a, **kw):
                t = time.perf_counter()
                res = fn(*a, **kw)
                parts[key].append(time.perf_counter() - t)
                return res
            return inner

        engine._process = wrap(engine._process, "process")
        if sched_mod is not None:
            orig_build = sched_mod.build_inputs
            sched_mod.build_inputs = wrap(orig_build, "inputs")
        else:
            engine._inputs = wrap(engine._inputs, "inputs")
        setattr(jit_owner, jit_name, timed_step)
        steps = []  # (wall, device, inputs, process) per step that ran the model
        orig_step = engine.step

        def step(*a, **kw):
            n0, i0, p0 = len(device), len(parts["inputs"]), len(parts["process"])
            t = time.perf_counter()
            res = orig_step(*a, **kw)
            wall = time.perf_counter() - t
            if len(device) > n0:
                steps.append((wall, sum(device[n0:]), sum(parts["inputs"][i0:]), sum(parts["process"][p0:])))
            return res

        engine.step = step
        try:
            t0 = time.perf_counter()
            outs = run(engine)
            wall = time.perf_counter() - t0
        finally:
            setattr(jit_owner, jit_name, original)
            if sched_mod is not None:
                sched_mod.build_inputs = orig_build
        tokens = sum(len(t) for o in outs for t in o.tokens)
        st = engine.stats()
        med = lambda i: 1000 * statistics.median(x[i] for x in steps)
        mean = lambda i: 1000 * statistics.fmean(x[i] for x in steps)
        return {
            "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": st.steps,
            "step_ms_median": med(0), "device_ms_median": 1000 * statistics.median(x[1] for x in steps),
            "host_ms_median": 1000 * statistics.median(x[0] - x[1] for x in steps),
            "step_ms_mean": mean(0), "device_ms_mean": mean(1),
            "host_ms_mean": 1000 * statistics.fmean(x[0] - x[1] for x in steps),
            "inputs_ms_mean": mean(2), "process_ms_mean": mean(3),
            "host_fraction_of_step": sum(x[0] - x[1] for x in steps) / sum(x[0] for x in steps),
            "compile_s_in_run": st.compile_s,
            "outputs": [o.tokens[0] for o in outs],
        }

    results = [measure() for _ in range(repeats)]
    best = max(results, key=lambda x: x["tokens_per_s"])
    best["repeats_tokens_per_s"] = [round(x["tokens_per_s"], 1) for x in results]
    return best


def timed_generate(model, r: int, repeats: int, requests: int | None = None) -> dict:
    import jax

    import paged_kv as pk
    from paged_kv import engine as eng
    from paged_kv.models.paged import allocate_pages, page_spec

    r = requests or r  # generate runs every request at once
    blocks = r * -(-(PROMPT + NEW) // 16) + 1
    mgr = pk.ManagerConfig(num_blocks=blocks, block_size=16, max_seqs=r, max_blocks_per_seq=8)
    toks, lens = eng.pad_prompts(workload(r), width=PROMPT)
    params = fixed_length(eng.SamplingParams, max_new_tokens=NEW)
    best, outs = None, None
    for i in range(repeats + 1):
        pages = allocate_pages(page_spec(model, mgr.num_blocks, mgr.block_size))
        t0 = time.perf_counter()
        out, pages, _ = eng.generate(model, pages, toks, lens, jax.random.key(0), params, manager=mgr, chunk_size=64)
        jax.block_until_ready(out.tokens)
        dt = time.perf_counter() - t0
        if i and (best is None or dt < best):  # the first call compiles
            best = dt
            outs = [row[0][:int(n)].tolist() for row, n in zip(out.tokens, out.lengths[:, 0])]
    tokens = r * NEW
    return {"wall_s": best, "tokens": tokens, "tokens_per_s": tokens / best, "outputs": outs}


def ab_decode_steps(model, args) -> None:
    """Serving at two ``decode_steps`` and ``generate``, one timed run each per round, alternated
    in one process; medians of the per-round ratios (the machine's speed drifts between rounds)."""
    import jax
    k1, k2 = args.ab_decode_steps
    rows = {}
    for r in args.rows:
        load = os.getloadavg()
        runs = {f"serving_k{k1}": [], f"serving_k{k2}": [], "generate": []}
        for _ in range(args.repeats):
            for k in (k1, k2):
                runs[f"serving_k{k}"].append(timed_serving(model, r, 1, args.chunk_size, args.prefill_rows, k,
                                                           args.requests)["tokens_per_s"])
            runs["generate"].append(timed_generate(model, r, 1, args.requests)["tokens_per_s"])
        a, b, g = runs[f"serving_k{k1}"], runs[f"serving_k{k2}"], runs["generate"]
        med = lambda xs: round(statistics.median(xs), 3)
        rows[str(r)] = {"tokens_per_s": {k: [round(x, 1) for x in v] for k, v in runs.items()},
                        f"k{k1}_to_generate": med([x / y for x, y in zip(a, g)]),
                        f"k{k2}_to_generate": med([x / y for x, y in zip(b, g)]),
                        f"k{k2}_to_k{k1}": med([y / x for x, y in zip(a, b)]),
                        "loadavg_before": [round(x, 2) for x in load],
                        "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
        print(f"R={r}: K={k1} {rows[str(r)][f'k{k1}_to_generate']:.2f}x generate, K={k2} "
              f"{rows[str(r)][f'k{k2}_to_generate']:.2f}x, K={k2} / K={k1} {rows[str(r)][f'k{k2}_to_k{k1}']:.2f} "
              f"(medians of {args.repeats} rounds); load {load[0]:.1f}", flush=True)
    result = {"label": args.label, "jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
              "workload": {"prompt_tokens": PROMPT, "new_tokens": NEW, "greedy": True, "arrivals": "all at step 0",
                           "chunk_size": args.chunk_size, "max_prefill_rows": f"min({args.prefill_rows}, R)",
                           "requests": args.requests or "R"},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--repeats", type=int, default=5, help="rounds (one timed serving and generate run each)")
    ap.add_argument("--chunk-size", type=int, default=16,
                    help="the serving engine's C (default 16: the prompts' length, as generate clips its chunk)")
    ap.add_argument("--prefill-rows", type=int, default=32, help="the serving engine's P (capped at R)")
    ap.add_argument("--decode-steps", type=int, default=8,
                    help="the serving engine's decode_steps (K; default 8, the CLI's; 1: one call per step)")
    ap.add_argument("--ab-decode-steps", type=int, nargs=2, metavar=("K1", "K2"),
                    help="instead: serving with decode_steps K1 and K2 and generate, alternated per round")
    ap.add_argument("--requests", type=int, default=None,
                    help="with --ab-decode-steps: this many requests on R rows (default R; more: they wait for "
                         "rows; generate then runs them all in one batch)")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--out", default=str(ROOT / "results" / "serving_overhead.json"))
    args = ap.parse_args()
    import jax

    import paged_kv
    from paged_kv.models import load_hf_checkpoint

    model = load_hf_checkpoint(ROOT / "checkpoints" / "tiny-llama")
    rows = {}
    if args.ab_decode_steps:
        return ab_decode_steps(model, args)
    for r in args.rows:
        load = os.getloadavg()
        # Serving and generate alternate, one timed run each per round, so that both see the same
        # machine (its speed drifts); the ratio is the median of the rounds' ratios.
        rounds = []
        for _ in range(args.repeats):
            s = timed_serving(model, r, 1, args.chunk_size, args.prefill_rows, args.decode_steps)
            g = timed_generate(model, r, 1)
            rounds.append((s, g, s["tokens_per_s"] / g["tokens_per_s"]))
        ratios = [x[2] for x in rounds]
        s, g, _ = sorted(rounds, key=lambda x: x[2])[len(rounds) // 2]  # the median round
        same = all(x[0].pop("outputs") == x[1].pop("outputs") for x in rounds)
        s["repeats_tokens_per_s"] = [round(x[0]["tokens_per_s"], 1) for x in rounds]
        g["repeats_tokens_per_s"] = [round(x[1]["tokens_per_s"], 1) for x in rounds]
        rows[str(r)] = {"serving": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()},
                        "generate": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in g.items()},
                        "ratio_serving_to_generate": round(statistics.median(ratios), 3),
                        "ratio_per_round": [round(x, 3) for x in ratios],
                        "same_greedy_tokens": same,
                        "loadavg_before": [round(x, 2) for x in load],
                        "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
        print(f"R={r}: serving {s['tokens_per_s']:.0f} tok/s (step {s['step_ms_median']:.2f} ms median: device "
              f"{s['device_ms_median']:.2f}, host {s['host_ms_median']:.2f}; inputs {s['inputs_ms_mean']:.2f}, "
              f"process {s['process_ms_mean']:.2f} ms mean), generate {g['tokens_per_s']:.0f} tok/s: ratio "
              f"{rows[str(r)]['ratio_serving_to_generate']:.2f} (median of {len(ratios)} rounds, "
              f"{min(ratios):.2f}-{max(ratios):.2f}), same tokens: {same}; load {load[0]:.1f}", flush=True)
    result = {"label": args.label, "code": str(Path(paged_kv.__file__).resolve().parent.parent),
              "jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
              "workload": {"prompt_tokens": PROMPT, "new_tokens": NEW, "greedy": True, "arrivals": "all at step 0",
                           "chunk_size": args.chunk_size, "max_prefill_rows": f"min({args.prefill_rows}, R)",
                           "decode_steps": args.decode_steps, "record_tables": True},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
