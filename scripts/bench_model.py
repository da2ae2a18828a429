"""Decode-step time of the Flax Llama: paged KV cache (pallas_kernels) vs a contiguous KV cache.

Both steps are jitted once, weights shared, caches donated; each measurement is the median over
`--repeats` calls of one decode step for the whole batch (after warm-up), with every sequence at
`--context` tokens. Prints a table and writes JSON (default results/bench_model_<backend>.json).

    python scripts/bench_model.py                 # CPU defaults, ~1 minute
    python scripts/bench_model.py --impl pallas   # on a GPU
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
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paged_kv.apps.progress import bar
from paged_kv.models import (
    LlamaConfig,
    allocate_pages,
    contiguous_step,
    init_contiguous_cache,
    init_model,
    make_paged_batch,
    page_spec,
    paged_decode_step,
)
from paged_kv.pallas_kernels import resolve_impl
from scripts.run_record import record, utc_now


def bench_config(dtype: str) -> LlamaConfig:
    return LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                       num_kv_heads=2, max_position_embeddings=4096, dtype=dtype)


def _median_time(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_inputs(cfg: LlamaConfig, batch: int, context: int, block_size: int):
    """One paged decode step's inputs, seeded: ``(tokens [batch], positions [batch] (the last of
    ``context``), the paged batch, the number of blocks the pages need)``. Each sequence owns
    ``ceil(context / block_size)`` blocks in a scrambled physical order."""
    rs = np.random.RandomState(0)
    tokens = jnp.asarray(rs.randint(0, cfg.vocab_size, batch), jnp.int32)
    pos = jnp.full((batch,), context - 1, jnp.int32)
    per_seq = -(-context // block_size)
    tables = rs.permutation(np.arange(1, 1 + batch * per_seq)).reshape(batch, per_seq).astype(np.int32)
    meta = make_paged_batch(tables, pos, np.ones(batch, np.int32), 1, block_size)
    return tokens, pos, meta, 1 + batch * per_seq


def run(batch: int, context: int, block_size: int, repeats: int, impl: str, dtype: str) -> dict:
    cfg = bench_config(dtype)
    model = init_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    tokens, pos, meta, num_blocks = decode_inputs(cfg, batch, context, block_size)
    box = {"pages": allocate_pages(page_spec(cfg, num_blocks, block_size))}

    def paged():
        logits, box["pages"] = paged_decode_step(graphdef, state, box["pages"], meta, tokens, impl=impl)
        logits.block_until_ready()

    # Contiguous: [layers, 2, batch, max_len = context, kv_heads, head_dim].
    box["cache"] = init_contiguous_cache(cfg, batch, context)
    ones = jnp.ones((batch,), jnp.int32)

    def contiguous():
        logits, box["cache"] = contiguous_step(graphdef, state, box["cache"], tokens[:, None], pos, ones,
                                               last_only=True)
        logits.block_until_ready()

    t_paged = _median_time(paged, repeats)
    t_contig = _median_time(contiguous, repeats)
    return {"batch": batch, "context": context, "block_size": block_size, "dtype": dtype,
            "paged_ms": 1e3 * t_paged, "contiguous_ms": 1e3 * t_contig, "paged_over_contiguous": t_paged / t_contig}


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    started = utc_now()

    backend = jax.default_backend()
    impl = resolve_impl(args.impl)
    configs = [(b, c) for b in args.batch for c in args.context]
    shown = bar(len(configs), "configurations")
    rows = []
    for b, c in configs:
        rows.append(run(b, c, args.block_size, args.repeats, impl, args.dtype))
        shown.update()
    shown.close()
    cfg = bench_config(args.dtype)
    print(f"decode step, {backend}, impl={impl}, model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_heads}/{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}; median of {args.repeats}")
    print(f"{'batch':>5} {'context':>7} {'paged ms':>9} {'contig ms':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>7} {r['paged_ms']:>9.3f} {r['contiguous_ms']:>9.3f} "
              f"{r['paged_over_contiguous']:>6.2f}")
    out = Path(args.out or Path(__file__).resolve().parents[1] / "results" / f"bench_model_{backend}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"backend": backend, "impl": impl, "jax": jax.__version__, "machine": platform.machine(),
            "cpu_count": __import__("os").cpu_count(), "repeats": args.repeats,
            "model": {k: v for k, v in cfg.to_hf_config().items() if k in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")}}
    made = record(__file__, args, argv, started=started)
    out.write_text(json.dumps({"run": made, "meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
