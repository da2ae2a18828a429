"""A/B of one change to the on-device decode loop, in one process: both variants of
`paged_kv.engine.generate_jit` are compiled ahead of time (each under its own patch of the
library), then called alternately on the same prompts, so load on the machine hits both alike.
Reports the median call time of each and the ratio. Writes JSON (default
results/ab_decode_<change>.json).

    python scripts/ab_decode.py --change attention_gathers --batch 32 --prompt 512
    python scripts/ab_decode.py --change layer_weights --batch 32 --prompt 128

Changes (variant A is the code before the change, kept here only as the baseline):
  attention_gathers  A: one gather of K and V rows per chunk, then sliced into K and V (before
                     this change); B: the library's reference (separate K and V gathers).
  decode_mul_reduce  A: decode attention's two products as einsums over the gathered K and V
                     (before this change); B: the library's reference (multiply-reduces).
  prefill_chunk      A: prefill in chunks of 256 positions; B: chunks of 64 (each chunk's queries
                     walk the keys up to the chunk's end, so smaller chunks waste less of the causal
                     triangle).
  unrolled_layers    A: the library's scan over layers (each step slices every layer's weights
                     out of the stacked arrays: a copy on XLA:CPU); B: the layers unrolled.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import paged_kv as pk  # noqa: E402
from paged_kv.models import LlamaConfig, allocate_pages, init_model, page_spec  # noqa: E402
from paged_kv import engine  # noqa: E402
from paged_kv.engine.generate import generate_jit  # noqa: E402
from paged_kv.engine import requests  # noqa: E402
from paged_kv.pallas_kernels import reference  # noqa: E402

CONFIG = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                     num_kv_heads=2, max_position_embeddings=4096, rope_theta=10_000.0)


def _attention_before(q, pages, layer, block_tables, last_pos, valid, scale, soft_cap=None, slopes=None, *,
                      one_gather: bool):
  """The reference's blockwise attention before the CPU changes (no knobs: the benchmark uses
  none), both products as einsums: `one_gather` gathers K and V in one gather and slices it
  (before `attention_gathers`), else K and V separately (after it, before `decode_mul_reduce`)."""
  assert soft_cap is None and slopes is None
  b, t, hq, d = q.shape
  _, _, hkv, num_blocks, block_size, _ = pages.shape
  g = hq // hkv
  chunk = max(1, 128 // block_size)
  bt = reference.sanitize_block_tables(block_tables, num_blocks)
  num_chunks = -(-bt.shape[1] // chunk)
  bt = jnp.pad(bt, ((0, 0), (0, num_chunks * chunk - bt.shape[1])))
  keys = chunk * block_size
  rows = pages.reshape(-1, block_size * d)
  planes = (layer * 2 * hkv + jnp.arange(2 * hkv, dtype=jnp.int32)[:, None]) * num_blocks  # K heads, then V
  qk = q.reshape(b, t, hkv, g, d).transpose(2, 0, 1, 3, 4).reshape(hkv, b, t * g, d)
  hi = jax.lax.Precision.HIGHEST

  def step(c, carry):
    o, m, l = carry
    ids = jax.lax.dynamic_slice_in_dim(bt, c * chunk, chunk, axis=1).reshape(1, -1)
    if one_gather:
      kv = rows.at[planes + ids].get(mode="promise_in_bounds").reshape(2, hkv, b, keys, d)
      k, v = kv[0], kv[1]
    else:
      k = rows.at[planes[:hkv] + ids].get(mode="promise_in_bounds").reshape(hkv, b, keys, d)
      v = rows.at[planes[hkv:] + ids].get(mode="promise_in_bounds").reshape(hkv, b, keys, d)
    s = jnp.einsum("kbrd,kbsd->kbrs", qk, k, preferred_element_type=jnp.float32,
                   precision=hi).reshape(hkv, b, t, g, keys) * scale
    pos = c * keys + jnp.arange(keys, dtype=jnp.int32)
    mask = ((pos[None, None, :] <= last_pos[:, :, None]) & valid[:, :, None])[None, :, :, None, :]
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.exp(m - m_safe)
    p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
    pv = jnp.einsum("kbrs,kbsd->kbrd", p.reshape(hkv, b, t * g, keys), v.astype(jnp.float32),
                    preferred_element_type=jnp.float32, precision=hi).reshape(hkv, b, t, g, d)
    return alpha[..., None] * o + pv, m_new, alpha * l + p.sum(axis=-1)

  o = jnp.zeros((hkv, b, t, g, d), jnp.float32)
  m = jnp.full((hkv, b, t, g), -jnp.inf, jnp.float32)
  l = jnp.zeros((hkv, b, t, g), jnp.float32)
  needed = jnp.max(jnp.where(valid, last_pos + 1, 0))
  n = jnp.clip((needed + keys - 1) // keys, 0, num_chunks)
  o, m, l = jax.lax.fori_loop(0, n, step, (o, m, l))
  out = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
  return out.transpose(1, 2, 0, 3, 4).reshape(b, t, hq, d).astype(q.dtype)


@contextlib.contextmanager
def _patch(obj, name, value):
  old = getattr(obj, name)
  setattr(obj, name, value)
  try:
    yield
  finally:
    setattr(obj, name, old)


@contextlib.contextmanager
def _unrolled_layers():
  """The layers unrolled over static weight slices (the path `Llama.__call__` takes when the
  attend callback asks for a static layer id), which XLA hoists out of the decode loop."""
  import paged_kv.models.paged as mp
  make = mp._make_attend

  def make_static(*a, **k):
    attend = make(*a, **k)
    attend.static_layer = True
    return attend

  with _patch(mp, "_make_attend", make_static):
    yield


# change -> ((patch A, static overrides A), (patch B, static overrides B))
CHANGES = {
    "attention_gathers": ((lambda: _patch(reference, "_paged_attention",
                                          functools.partial(_attention_before, one_gather=True)), {}),
                          (contextlib.nullcontext, {})),
    "unrolled_layers": ((contextlib.nullcontext, {}), (_unrolled_layers, {})),
    "decode_mul_reduce": ((lambda: _patch(reference, "_paged_attention",
                                          functools.partial(_attention_before, one_gather=False)), {}),
                          (contextlib.nullcontext, {})),
    "prefill_chunk": ((contextlib.nullcontext, {"chunk_size": 256}), (contextlib.nullcontext, {"chunk_size": 64})),
}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--change", choices=sorted(CHANGES), required=True)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--prompt", type=int, default=128)
  ap.add_argument("--new", type=int, default=256)
  ap.add_argument("--block-size", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  out_path = Path(args.out or ROOT / "results" / f"ab_decode_{args.change}.json")

  model = init_model(CONFIG, seed=0, init_std=0.2)
  b, bs = args.batch, args.block_size
  per_seq = -(-(args.prompt + args.new) // bs)
  mgr = pk.ManagerConfig(num_blocks=1 + b * per_seq + b, block_size=bs, max_seqs=b, max_blocks_per_seq=per_seq)
  params = engine.SamplingParams(max_new_tokens=args.new)
  lens = np.full(b, args.prompt, np.int32)
  pages0 = allocate_pages(page_spec(CONFIG, mgr.num_blocks, bs))
  graphdef, weights, facts, pages0, mesh = requests.place(model, pages0, None)
  toks0 = np.zeros((b, args.prompt), np.int32)
  req = requests.check_request(facts, mgr, pages0, None, toks0, lens, rows_per_prompt=1, what="n", budgets=None,
                               chunk_size=None, impl="auto", eos_token_ids=params.eos_token_ids, top_k=params.top_k)
  static = dict(manager=mgr, params=params, impl="auto", chunk_size=req.chunk_size, context=req.context, mesh=mesh)
  budgets = jnp.full((b,), args.new, jnp.int32)

  def fresh():
    return allocate_pages(page_spec(CONFIG, mgr.num_blocks, bs)), pk.init_state(mgr)

  compiled, boxes, tokens = {}, {}, {}
  variant_static = {}
  for name, (ctx, overrides) in zip("AB", CHANGES[args.change]):
    variant_static[name] = {**static, **overrides}
    with ctx():
      jax.clear_caches()
      pages, state = fresh()
      t0 = time.perf_counter()
      compiled[name] = generate_jit.lower(graphdef, weights, pages, state, jnp.asarray(toks0), jnp.asarray(lens),
                                             budgets, jax.random.key(0), **variant_static[name]).compile()
      print(f"variant {name} compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    boxes[name] = fresh()

  def call(name, toks):
    pages, state = boxes[name]
    out, pages, state = compiled[name](weights, pages, state, jnp.asarray(toks), jnp.asarray(lens), budgets,
                                       jax.random.key(0))
    tokens[name] = np.asarray(out.tokens)
    boxes[name] = (pages, state)

  times = {"A": [], "B": []}
  load_before = os.getloadavg()[0]
  for r in range(-1, args.repeats):  # r = -1: warm-up
    toks = np.random.RandomState(r + 10).randint(0, CONFIG.vocab_size, (b, args.prompt)).astype(np.int32)
    for name in ("AB" if r % 2 else "BA"):
      t0 = time.perf_counter()
      call(name, toks)
      if r >= 0:
        times[name].append(time.perf_counter() - t0)
    same = bool((tokens["A"] == tokens["B"]).all())
  load_after = os.getloadavg()[0]
  med = {k: statistics.median(v) for k, v in times.items()}
  result = {"change": args.change, "batch": b, "prompt": args.prompt, "new_tokens": args.new, "repeats": args.repeats,
            "A_s": med["A"], "B_s": med["B"], "speedup_B_over_A": med["A"] / med["B"],
            "A_tok_s": b * args.new / med["A"], "B_tok_s": b * args.new / med["B"],
            "same_tokens_last_repeat": same, "times": times, "load_average_before": load_before,
            "load_average_after": load_after, "cpu_count": os.cpu_count(), "jax": jax.__version__,
            "command": " ".join(["python", "scripts/ab_decode.py", *sys.argv[1:]])}
  print(f"{args.change} at batch {b}, prompt {args.prompt}: A {med['A']:.3f} s, B {med['B']:.3f} s -> "
        f"B is {med['A'] / med['B']:.3f}x A (same tokens: {same}; load {load_before:.2f} -> {load_after:.2f})")
  out_path.parent.mkdir(parents=True, exist_ok=True)
  out_path.write_text(json.dumps(result, indent=2) + "\n")
  print(f"wrote {out_path}")


if __name__ == "__main__":
  main()
