"""Paged-attention kernel benchmark, on whatever JAX backend is present.

GPU (Llama 3.1 8B attention shapes: 32 query heads, 8 KV heads, head dim 128, bfloat16, block
size 16, one layer of pages):
  * decode at batch 1..256 and contexts 512..32k (configurations over 4M cached tokens are
    skipped to bound memory): median time per call (block_until_ready), bytes of K/V read,
    achieved bandwidth against a plain device copy measured in the same run, and the ratio to
    JAX's ``pallas.ops.gpu.paged_attention`` and to contiguous (dense) XLA attention on the
    same data; a few batches with mixed lengths (uniform in [1, context]);
  * copy_blocks (32 layers, in place, donated) bandwidth against the plain device copy, and the
    XLA reference scatter.
CPU: the XLA reference path (what ``impl="auto"`` uses there), paged against contiguous
attention at scaled-down shapes (8 query heads, 2 KV heads, head dim 64, float32), plus the
write_kv / copy_blocks references.

    python scripts/bench_kernels.py            # writes results/bench_kernels_{cpu,gpu}.json
    python scripts/bench_kernels.py --smoke --out /tmp/k.json   # CPU, tiny sizes: a check that it runs
    python scripts/bench_kernels.py --quick    # fewer configurations
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from scripts import checkout_layout  # the lent GPU machine does not install the checkout

checkout_layout.install()
import jax
import jax.numpy as jnp
import numpy as np

from paged_kv import pallas_kernels as pk
from scripts.run_record import record, utc_now


def median_time(fn, *args, repeats: int, warmup: int = 2) -> float:
  """Median seconds per synchronised call."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def median_time_threaded(fn, state, *args, repeats: int, warmup: int = 2):
  """Like median_time for a function whose first argument is donated and returned."""
  for _ in range(warmup):
    state = jax.block_until_ready(fn(state, *args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    state = jax.block_until_ready(fn(state, *args))
    times.append(time.perf_counter() - t)
  return statistics.median(times), state


def copy_bandwidth(num_bytes: int, dtype=jnp.bfloat16, repeats: int = 10) -> float:
  """Bytes/s of a plain device copy (read + write counted)."""
  n = num_bytes // jnp.dtype(dtype).itemsize
  x = jnp.ones((n,), dtype)
  f = jax.jit(lambda a: a + jnp.asarray(1, dtype))
  t = median_time(f, x, repeats=repeats)
  del x
  return 2 * num_bytes / t


def contiguous_decode(q, k, v, lengths, *, scale):
  """Dense decode attention: q [B, Hq, D], k/v [B, Hkv, S, D]."""
  b, hq, d = q.shape
  hkv, s = k.shape[1], k.shape[2]
  qg = q.reshape(b, hkv, hq // hkv, d)
  logits = jnp.einsum("bkgd,bksd->bkgs", qg, k, preferred_element_type=jnp.float32) * scale
  mask = jnp.arange(s)[None, None, None, :] < lengths[:, None, None, None]
  logits = jnp.where(mask, logits, -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1)
  p = jnp.where(mask, p, 0.0)
  out = jnp.einsum("bkgs,bksd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(b, hq, d).astype(q.dtype)


def make_decode_data(key, batch, context, *, hq, hkv, d, bs, dtype, mixed):
  """One layer of pages holding batch * context tokens in random physical order."""
  m = context // bs
  num_blocks = 1 + batch * m
  k1, k2, k3, k4 = jax.random.split(key, 4)
  pages = jax.random.normal(k1, (1, 2, hkv, num_blocks, bs, d), dtype)
  perm = jax.random.permutation(k2, jnp.arange(1, num_blocks, dtype=jnp.int32))
  tables = perm.reshape(batch, m)
  if mixed:
    lengths = jax.random.randint(k3, (batch,), 1, context + 1, dtype=jnp.int32)
  else:
    lengths = jnp.full((batch,), context, jnp.int32)
  q = jax.random.normal(k4, (batch, hq, d), dtype)
  return q, pages, tables, lengths


def gather_contiguous(pages, tables):
  """[1, 2, Hkv, NB, bs, D] + [B, M] -> K, V as [B, Hkv, M * bs, D]."""
  kv = pages[0][:, :, tables]  # [2, Hkv, B, M, bs, D]
  two, hkv, b, m, bs, d = kv.shape
  kv = kv.reshape(2, hkv, b, m * bs, d).transpose(0, 2, 1, 3, 4)
  return kv[0], kv[1]


def bench_decode(configs, *, hq, hkv, d, bs, dtype, impl, repeats, copy_bw, with_jax_op,
                 budget_s=float("inf")):
  rows = []
  start = time.perf_counter()
  scale = d ** -0.5
  key = jax.random.PRNGKey(0)
  ours = jax.jit(lambda q, p, t, lens: pk.paged_decode_attention(q, p, 0, t, lens, scale=scale, impl=impl))
  dense = jax.jit(functools.partial(contiguous_decode, scale=scale))
  for batch, context, mixed in configs:
    if time.perf_counter() - start > budget_s:
      print(f"time budget of {budget_s:.0f} s spent: skipping the remaining decode configurations")
      break
    key, sub = jax.random.split(key)
    q, pages, tables, lengths = make_decode_data(sub, batch, context, hq=hq, hkv=hkv, d=d,
                                                 bs=bs, dtype=dtype, mixed=mixed)
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = int(jnp.sum(lengths)) * hkv * d * 2 * itemsize
    t_ours = median_time(ours, q, pages, tables, lengths, repeats=repeats)
    row = dict(batch=batch, context=context, lengths="mixed" if mixed else "uniform",
               kv_bytes=kv_bytes, ours_ms=t_ours * 1e3, ours_gbps=kv_bytes / t_ours / 1e9)
    if copy_bw:
      row["fraction_of_copy_bw"] = kv_bytes / t_ours / copy_bw
    k, v = gather_contiguous(pages, tables)
    k, v = jax.block_until_ready((k, v))
    t_dense = median_time(dense, q, k, v, lengths, repeats=repeats)
    row["contiguous_ms"] = t_dense * 1e3
    row["ours_over_contiguous"] = t_ours / t_dense
    del k, v
    if with_jax_op:
      from paged_kv.pallas_kernels.jax_compat import jax_paged_attention
      jax_paged = jax_paged_attention()
      kp, vp = jax.block_until_ready((pages[0, 0], pages[0, 1]))
      m = tables.shape[1]
      k_splits = 16 if m % 16 == 0 else 1
      op = jax.jit(functools.partial(jax_paged.paged_attention, k_splits=k_splits,
                                     pages_per_compute_block=min(8, m // k_splits)))
      qs = (q.astype(jnp.float32) * scale).astype(dtype)  # JAX's op applies no scale
      try:
        t_jax = median_time(op, qs, kp, vp, tables, lengths, repeats=repeats)
        row["jax_pallas_ms"] = t_jax * 1e3
        row["ours_over_jax_pallas"] = t_ours / t_jax
      except Exception as e:  # report and keep going
        row["jax_pallas_error"] = f"{type(e).__name__}: {str(e)[:200]}"
      del kp, vp
    rows.append(row)
    print_row(row)
    del q, pages, tables, lengths
    gc.collect()
  return rows


def bench_copy_blocks(*, layers, hkv, d, bs, num_blocks, copies, dtype, impls, repeats, copy_bw):
  rows = []
  shape = (layers, 2, hkv, num_blocks, bs, d)
  block_bytes = layers * 2 * hkv * bs * d * jnp.dtype(dtype).itemsize
  rng = np.random.default_rng(0)
  ids = rng.permutation(np.arange(1, num_blocks))[:2 * copies]
  src = jnp.asarray(ids[:copies], jnp.int32)
  dst = jnp.asarray(ids[copies:], jnp.int32)
  for impl in impls:
    pages = jnp.zeros(shape, dtype)
    f = jax.jit(functools.partial(pk.copy_blocks, impl=impl), donate_argnums=0)
    t, pages = median_time_threaded(f, pages, src, dst, repeats=repeats)
    moved = 2 * copies * block_bytes
    row = dict(kernel="copy_blocks", impl=impl, layers=layers, copies=copies,
               block_bytes=block_bytes, ms=t * 1e3, gbps=moved / t / 1e9)
    if copy_bw:
      row["fraction_of_copy_bw"] = moved / t / copy_bw
    rows.append(row)
    print(f"copy_blocks impl={impl:9s} copies={copies} block={block_bytes / 2**20:.2f} MiB "
          f"{t * 1e3:8.3f} ms {moved / t / 1e9:8.2f} GB/s")
    del pages
    gc.collect()
  return rows


def bench_write_kv(*, layers, hkv, d, bs, num_blocks, n, dtype, impl, repeats):
  pages = jnp.zeros((layers, 2, hkv, num_blocks, bs, d), dtype)
  rng = np.random.default_rng(1)
  slots = jnp.asarray(rng.permutation(num_blocks * bs)[:n], jnp.int32)
  k = jnp.ones((n, hkv, d), dtype)
  f = jax.jit(lambda p, k_, s_: pk.write_kv(p, 0, k_, k_, s_, impl=impl), donate_argnums=0)
  t, _ = median_time_threaded(f, pages, k, slots, repeats=repeats)
  row = dict(kernel="write_kv", impl=impl, rows=n, ms=t * 1e3)
  print(f"write_kv    impl={impl:9s} rows={n} {t * 1e3:8.3f} ms")
  return [row]


HEADER = (f"{'batch':>5} {'context':>7} {'lengths':>7} {'KV MiB':>9} {'ours ms':>9} {'GB/s':>8} "
          f"{'dense ms':>9} {'ours/dense':>10} {'jax ms':>8} {'ours/jax':>8}")


def print_row(r):
  jax_ms = f"{r['jax_pallas_ms']:8.3f}" if "jax_pallas_ms" in r else f"{'-':>8}"
  jax_ratio = f"{r['ours_over_jax_pallas']:8.2f}" if "ours_over_jax_pallas" in r else f"{'-':>8}"
  print(f"{r['batch']:5d} {r['context']:7d} {r['lengths']:>7} {r['kv_bytes'] / 2**20:9.1f} "
        f"{r['ours_ms']:9.3f} {r['ours_gbps']:8.2f} {r['contiguous_ms']:9.3f} "
        f"{r['ours_over_contiguous']:10.2f} {jax_ms} {jax_ratio}", flush=True)


def main(argv: list[str] | None = None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="fewer configurations")
  parser.add_argument("--smoke", action="store_true",
                      help="CPU: one tiny configuration per part (a check that it runs)")
  parser.add_argument("--out", default=None, help="JSON path (default results/bench_kernels_<backend>.json)")
  parser.add_argument("--decode", nargs="*", default=None, metavar="BATCH:CONTEXT",
                      help="GPU: only these decode configurations (e.g. 64:4096, the issue-15 goal)")
  args = parser.parse_args(argv)
  started = utc_now()
  backend = jax.default_backend()
  on_gpu = backend == "gpu"
  t0 = time.perf_counter()
  result = dict(run=None, backend=backend, device=str(jax.devices()[0]), jax=jax.__version__,
                python=platform.python_version(), machine=platform.machine(),
                cpu_count=__import__("os").cpu_count())
  if on_gpu:
    bw = copy_bandwidth(1 << 30)
    result["device_copy_gbps"] = bw / 1e9
    print(f"device copy bandwidth: {bw / 1e9:.1f} GB/s (1 GiB, read + write)")
    batches = [1, 8, 32, 64, 128, 256] if not args.quick else [1, 32, 256]
    contexts = [512, 2048, 8192, 32768] if not args.quick else [512, 8192]
    configs = [(b, c, False) for b in batches for c in contexts if b * c <= (1 << 22)]
    configs += [(b, 8192, True) for b in (8, 64)]
    if args.decode:
      configs = [(int(b), int(c), False) for b, c in (x.split(":") for x in args.decode)]
    shape = dict(hq=32, hkv=8, d=128, bs=16, dtype=jnp.bfloat16)
    result["decode_shape"] = dict(shape, dtype="bfloat16")
    print(HEADER)
    result["decode"] = bench_decode(configs, **shape, impl="pallas", repeats=20, copy_bw=bw,
                                    with_jax_op=True, budget_s=200)
    result["copy"] = bench_copy_blocks(layers=32, hkv=8, d=128, bs=16, num_blocks=2048,
                                       copies=256, dtype=jnp.bfloat16,
                                       impls=("pallas", "reference"), repeats=20, copy_bw=bw)
    result["write_kv"] = (
        bench_write_kv(layers=32, hkv=8, d=128, bs=16, num_blocks=2048, n=256,
                       dtype=jnp.bfloat16, impl="pallas", repeats=20)
        + bench_write_kv(layers=32, hkv=8, d=128, bs=16, num_blocks=2048, n=256,
                         dtype=jnp.bfloat16, impl="reference", repeats=20))
  else:
    # --smoke: one tiny configuration of each part (checks that the script runs, times nothing useful)
    reps, layers, num_blocks, n = (2, 2, 64, 4) if args.smoke else (10, 8, 512, 32)
    bw = copy_bandwidth(1 << (20 if args.smoke else 26), jnp.float32, repeats=reps // 2)
    result["device_copy_gbps"] = bw / 1e9
    print(f"host copy bandwidth: {bw / 1e9:.1f} GB/s ({'1' if args.smoke else '64'} MiB, read + write)")
    batches = [1, 8, 32] if not args.quick else [1, 8]
    contexts = [256, 1024, 4096] if not args.quick else [256, 1024]
    configs = [(b, c, False) for b in batches for c in contexts if b * c <= (1 << 17)]
    configs += [(8, 1024, True)]
    if args.smoke:
      configs = [(1, 64, False)]
    shape = dict(hq=8, hkv=2, d=64, bs=16, dtype=jnp.float32)
    result["decode_shape"] = dict(shape, dtype="float32")
    print(HEADER)
    result["decode"] = bench_decode(configs, **shape, impl="reference", repeats=reps, copy_bw=bw,
                                    with_jax_op=False)
    result["copy"] = bench_copy_blocks(layers=layers, hkv=2, d=64, bs=16, num_blocks=num_blocks, copies=n,
                                       dtype=jnp.float32, impls=("reference",), repeats=reps,
                                       copy_bw=bw)
    result["write_kv"] = bench_write_kv(layers=layers, hkv=2, d=64, bs=16, num_blocks=num_blocks, n=n,
                                        dtype=jnp.float32, impl="reference", repeats=reps)
  result["total_s"] = time.perf_counter() - t0
  result["run"] = record(__file__, args, argv, started=started)
  out = Path(args.out) if args.out else ROOT / "results" / f"bench_kernels_{'gpu' if on_gpu else 'cpu'}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  print(f"wrote {out} ({result['total_s']:.0f} s)")


if __name__ == "__main__":
  main()
