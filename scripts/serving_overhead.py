"""Serving overhead: host time per step (scheduling, building inputs, processing the outputs) against
device time per step, and the serving engine's tokens/s (compile excluded) against the on-device
loop ``engine.generate`` on the same greedy workload with no arrivals (R prompts of 16 tokens, all
at step 0, 32 new tokens each), at R = 32 and R = 256 rows, on the built-in model.

The serving engine runs chunks of ``C = 16`` positions in ``P = min(32, R)`` rows (``--chunk-size``,
``--prefill-rows``): the prompts' own length, as ``generate`` clips its chunk to the prompt width.
With the engine's former default ``C = 64, P = 8`` three quarters of every prefill row would be padding
(``--chunk-size 64 --prefill-rows 8`` measures that). A prompt longer than ``C`` takes several of
the ``P`` rows of a step (``serving_step.prefill_pieces``), so a small ``C`` costs a long prompt
no extra steps while rows are free (``scripts/bench_serving_defaults.py`` measures the engine's
defaults). The engine runs bursts of up to ``K = 8`` decode steps per
device call (``--decode-steps``, ``ServingConfig.decode_steps``), the way
``generate`` runs every step in one call. Serving and generate alternate, one timed run each per round
(``--repeats`` rounds); the reported ratio is the median of the rounds' ratios.

    python scripts/serving_overhead.py                      # writes results/serving_overhead.json

Per device call (a step, or a burst of decode steps), the means of ``ServingEngine.stats()``'s
host-time split (``EngineStats``: docs/usage.md, "Where the time goes"):

* ``device_ms_mean``: the jitted step's call until its outputs are on the host (dispatch, compute,
  the copy back);
* ``host_ms_mean``: the host's parts of the step, split into ``schedule_ms_mean`` (admission and
  the burst decision), ``inputs_ms_mean`` (building the inputs) and ``process_ms_mean``
  (processing the outputs); ``step_ms_median``: the median wall time of a step, from ``run``'s
  ``on_step`` callback.

Compile is excluded: a first engine runs the workload once (it compiles every program, cached by
jit for any engine of the same shapes), a second engine is timed. ``generate`` is timed on its
second call. The load average is recorded: numbers from a loaded machine say so.

    python scripts/serving_overhead.py --chunk-size 64 --prefill-rows 8 --decode-steps 1 --out /tmp/c64.json
    python scripts/serving_overhead.py --ab-decode-steps 1 8 --repeats 7 --out /tmp/bursts.json
    python scripts/serving_overhead.py --rows 2 --repeats 1 --out /tmp/smoke.json    # a check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.run_record import record, table, utc_now

PROMPT, NEW = 16, 32


def workload(r: int):
    # Distinct prompts (no prefix-cache hits between them), bytes of the built-in tokenizer.
    return [[(7 * i + 3 * j) % 250 + 3 for j in range(PROMPT)] for i in range(r)]


def timed_serving(model, r: int, repeats: int, chunk: int, rows: int, decode_steps: int = 1,
                  requests: int | None = None) -> dict:
    import paged_kv as pk
    from paged_kv.engine import Request, SamplingParams, ServingConfig, ServingEngine

    blocks = r * -(-(PROMPT + NEW) // 16) + 1
    mgr = pk.ManagerConfig(num_blocks=blocks, block_size=16, max_seqs=r, max_blocks_per_seq=8)
    cfg = ServingConfig(mgr, chunk_size=chunk, max_prefill_rows=min(rows, r), decode_steps=decode_steps)
    reqs = [Request(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in workload(requests or r)]
    list(ServingEngine(model, cfg).run(reqs))  # compiles every program (jit's cache serves the next engine)

    def measure() -> dict:
        engine = ServingEngine(model, cfg)
        ends = []  # the clock after each step (``on_step``): the steps' wall times
        t0 = time.perf_counter()
        outs = list(engine.run(reqs, on_step=lambda _: ends.append(time.perf_counter())))
        wall = time.perf_counter() - t0
        tokens = sum(len(t) for o in outs for t in o.tokens)
        st = engine.stats()  # the host-time split: EngineStats' schedule_s, inputs_s, device_s, process_s
        calls = max(st.device_calls, 1)
        ms = lambda seconds: 1000 * seconds / calls
        host = st.schedule_s + st.inputs_s + st.process_s
        return {
            "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": st.steps,
            "device_calls": st.device_calls,
            "step_ms_median": 1000 * statistics.median(np.diff([t0, *ends])),
            "step_ms_mean": ms(st.step_s), "device_ms_mean": ms(st.device_s), "host_ms_mean": ms(host),
            "schedule_ms_mean": ms(st.schedule_s), "inputs_ms_mean": ms(st.inputs_s),
            "process_ms_mean": ms(st.process_s), "host_fraction_of_step": host / st.step_s if st.step_s else None,
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
    params = eng.SamplingParams(max_new_tokens=NEW, ignore_eos=True)  # every row runs NEW tokens
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


def ab_decode_steps(model, args, argv: list[str] | None, started: str) -> None:
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
    result = {"run": record(__file__, args, argv, started=started), "label": args.label, "jax": jax.__version__,
              "backend": jax.default_backend(), "cpus": os.cpu_count(),
              "workload": {"prompt_tokens": PROMPT, "new_tokens": NEW, "greedy": True, "arrivals": "all at step 0",
                           "chunk_size": args.chunk_size, "max_prefill_rows": f"min({args.prefill_rows}, R)",
                           "requests": args.requests or "R"},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--repeats", type=int, default=5, help="rounds (one timed serving and generate run each)")
    ap.add_argument("--chunk-size", type=int, default=16,
                    help="the serving engine's C (default 16: the prompts' length, as generate clips its chunk)")
    ap.add_argument("--prefill-rows", type=int, default=32, help="the serving engine's P (capped at R)")
    ap.add_argument("--decode-steps", type=int, default=8,
                    help="the serving engine's decode_steps (K; default 8; 1: one call per step)")
    ap.add_argument("--ab-decode-steps", type=int, nargs=2, metavar=("K1", "K2"),
                    help="instead: serving with decode_steps K1 and K2 and generate, alternated per round")
    ap.add_argument("--requests", type=int, default=None,
                    help="with --ab-decode-steps: this many requests on R rows (default R; more: they wait for "
                         "rows; generate then runs them all in one batch)")
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--out", default=str(ROOT / "results" / "serving_overhead.json"))
    args = ap.parse_args(argv)
    started = utc_now()
    import jax

    import paged_kv
    from paged_kv.models import load_hf_checkpoint

    model = load_hf_checkpoint(ROOT / "checkpoints" / "tiny-llama")
    rows = {}
    if args.ab_decode_steps:
        return ab_decode_steps(model, args, argv, started)
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
        print(f"R={r}: ratio {rows[str(r)]['ratio_serving_to_generate']:.2f} (median of {len(ratios)} rounds, "
              f"{min(ratios):.2f}-{max(ratios):.2f}), same tokens: {same}; load {load[0]:.1f}", flush=True)
    result = {"run": record(__file__, args, argv, started=started), "label": args.label,
              "code": str(Path(paged_kv.__file__).resolve().parent.parent),
              "jax": jax.__version__, "backend": jax.default_backend(), "cpus": os.cpu_count(),
              "workload": {"prompt_tokens": PROMPT, "new_tokens": NEW, "greedy": True, "arrivals": "all at step 0",
                           "chunk_size": args.chunk_size, "max_prefill_rows": f"min({args.prefill_rows}, R)",
                           "decode_steps": args.decode_steps},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(["R", "serving tok/s", "generate tok/s", "ratio", "step ms (median)", "device ms", "schedule ms",
                 "inputs ms", "process ms"],
                [[r, x["serving"]["tokens_per_s"], x["generate"]["tokens_per_s"], x["ratio_serving_to_generate"],
                  x["serving"]["step_ms_median"], *(x["serving"][f"{k}_ms_mean"] for k in
                                                    ("device", "schedule", "inputs", "process"))]
                 for r, x in rows.items()]))
    print("(ms: per device call, the means of ServingEngine.stats()'s split; ratio: median of the rounds')")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
