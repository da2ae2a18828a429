"""Cost of batch-invariant decoding: decode tokens/s of one paged decode step of the built-in
model with and without ``batch_invariant``, at batch 1, 8, 32 and 64, side by side in one process
(the two modes alternate per repeat, so a busy machine slows both alike); medians of repeats.

    python scripts/bench_batch_invariant.py                 # ~2 minutes on a CPU
    python scripts/bench_batch_invariant.py --batches 1 8 --repeats 20 --context 256

Prints a table and writes JSON (default results/bench_batch_invariant_<backend>.json). The
reference kernels (the CPU path); the Pallas kernels' invariant mode is not measured here.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paged_kv.apps.progress import bar
from paged_kv.checkpoints import BUILTIN
from paged_kv.models import allocate_pages, load_hf_checkpoint, page_spec, paged_decode_step
from scripts.bench_model import decode_inputs
from scripts.run_record import record, utc_now


def measure(batch: int, context: int, block_size: int, repeats: int) -> dict:
    model = load_hf_checkpoint(BUILTIN)
    cfg = model.config
    graphdef, state = nnx.split(model)
    tokens, _, meta, num_blocks = decode_inputs(cfg, batch, context, block_size)
    pages = {mode: allocate_pages(page_spec(cfg, num_blocks, block_size)) for mode in (False, True)}

    def step(mode):
        logits, pages[mode] = paged_decode_step(graphdef, state, pages[mode], meta, tokens, impl="reference",
                                                batch_invariant=mode)
        logits.block_until_ready()

    for mode in (False, True):  # compile and warm up
        for _ in range(3):
            step(mode)
    times = {False: [], True: []}
    for _ in range(repeats):
        for mode in (False, True):
            t0 = time.perf_counter()
            step(mode)
            times[mode].append(time.perf_counter() - t0)
    plain, inv = statistics.median(times[False]), statistics.median(times[True])
    return {"batch": batch, "context": context, "plain_step_ms": plain * 1e3, "invariant_step_ms": inv * 1e3,
            "plain_tok_s": batch / plain, "invariant_tok_s": batch / inv, "cost_pct": 100 * (inv / plain - 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=128, help="tokens in the cache per sequence")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    started = utc_now()
    shown = bar(len(args.batches), "batches", unit="batch")
    rows = []
    for b in args.batches:
        rows.append(measure(b, args.context, args.block_size, args.repeats))
        shown.update()
    shown.close()
    print(f"{'batch':>5} {'plain tok/s':>12} {'invariant tok/s':>16} {'cost':>7}")
    for r in rows:
        print(f"{r['batch']:>5} {r['plain_tok_s']:>12.0f} {r['invariant_tok_s']:>16.0f} {r['cost_pct']:>6.1f}%")
    out = Path(args.out or f"results/bench_batch_invariant_{jax.default_backend()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"run": record(__file__, args, argv, started=started), "backend": jax.default_backend(),
                               "machine": platform.processor() or platform.machine(), "jax": jax.__version__,
                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
