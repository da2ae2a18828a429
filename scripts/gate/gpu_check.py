"""On a machine with a GPU: every Pallas kernel against its jnp reference, then the engine at a
Llama 3.1 8B-shaped random bfloat16 model (``engine.generate`` and a ``ServingEngine`` run).

Part of ``scripts/gpu_check.sh`` (which also runs ``bench_kernels.py``); see there. Writes
``results/gpu_kernels_check.json`` and ``results/gpu_engine.json``.

    python scripts/gate/gpu_check.py env     [--out results/gpu_env.json]
    python scripts/gate/gpu_check.py kernels [--out results/gpu_kernels_check.json]
    python scripts/gate/gpu_check.py engine  [--out results/gpu_engine.json] [--layers 32]
    python scripts/gate/gpu_check.py layouts [--out results/gpu_layouts.json] [--layers 32]

``env``: the versions this machine's Python runs (JAX, jaxlib, the CUDA plugin, flax, ...) against
the ranges pyproject.toml declares, and its devices. Installs nothing; exit status 1 when a package
is missing or outside its range.

``kernels``: decode and prefill for dtype x head_dim (64, 128, 256) x block size (8, 16, 32) x
GQA (1, 4, 8) on lengths 1, mid-block, several blocks and 0 in one batch; write_kv and
copy_blocks exactly (they move bits). The attention tolerance is the arithmetic bound of
``tests/tolerances.py`` (the same as the interpret-mode tests). Exit status 1 on any mismatch.

``engine``: random weights (normal(0.02), no checkpoint), Llama 3.1 8B shapes in bfloat16 (16 GB
of weights), block size 16. ``generate``: 64 prompts of 512 tokens, 128 new tokens each, greedy,
after one compiling call; a ``ServingEngine`` run of 64 requests arriving over the first steps.
Tokens/s, time per decode step, and for comparison the K/V-read lower bound of a step.

``kernels`` also checks ``layer_matmul`` (bfloat16, Llama 3.1 8B's projection shapes, rows 1 / 64 /
512). ``layouts``: the decode step (batch 64 at 1,024 tokens) on the stacked model's scan, whose
projections go through ``layer_matmul`` (untuned tiles, never timed on a GPU before), against the
per-layer model unrolled on XLA's autotuned matmuls: their step times and ratio.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from scripts import checkout_layout  # the lent GPU machine does not install the checkout

checkout_layout.install()

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv import pallas_kernels as pk
from paged_kv.pallas_kernels import testing as kt
from tests import tolerances as tol

# Roundings to the storage dtype (as in tests/test_kernels_decode.py): the kernel rounds the
# softmax weights before P V and the output, the reference only the output.
OURS, REFERENCE = 2, 1


def _meta() -> dict:
  return dict(backend=jax.default_backend(), device=str(jax.devices()[0]), jax=jax.__version__,
              python=platform.python_version())


def check_kernels(impl: str = "pallas", smoke: bool = False) -> dict:
  rows, failures = [], 0
  dtypes = (jnp.bfloat16, jnp.float16, jnp.float32)
  grid = list(itertools.product(dtypes, (64, 128, 256), (8, 16, 32), (1, 4, 8)))
  if smoke:  # a CPU smoke run of the script itself (interpret mode): two configurations
    grid = [(jnp.bfloat16, 64, 16, 4), (jnp.float32, 64, 8, 1)]
  for dtype, d, bs, g in grid:
    rng = np.random.default_rng(d + bs + g)
    lengths = [1, bs + 3, 6 * bs - 5, 0, 300]
    case = kt.make_paged_case(rng, lengths, block_size=bs, head_dim=d, num_kv_heads=2, dtype=dtype)
    ln = jnp.asarray(case.lengths)
    q = kt.random_queries(rng, (len(lengths), 2 * g, d), dtype)
    row = dict(dtype=jnp.dtype(dtype).name, head_dim=d, block_size=bs, group=g)
    got = pk.paged_decode_attention(q, case.pages, 1, case.block_tables, ln, impl=impl)
    want = pk.paged_decode_attention(q, case.pages, 1, case.block_tables, ln, impl="reference")
    atol = tol.paged_attention_atol(q, case.pages, 1, d ** -0.5, max(lengths), roundings=OURS + REFERENCE)
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    row["decode"] = dict(max_abs_err=err, atol=atol, ok=err <= atol)
    # Prefill: a 40-token chunk at the end of each sequence (padding rows where shorter).
    t = 40
    starts = np.maximum(case.lengths - t, 0).astype(np.int32)
    qlens = (case.lengths - starts).astype(np.int32)
    qp = kt.random_queries(rng, (len(lengths), t, 2 * g, d), dtype)
    args = (qp, case.pages, 1, case.block_tables, jnp.asarray(starts), jnp.asarray(qlens))
    gotp = pk.paged_prefill_attention(*args, impl=impl)
    wantp = pk.paged_prefill_attention(*args, impl="reference")
    atolp = tol.paged_attention_atol(qp, case.pages, 1, d ** -0.5, max(lengths), roundings=OURS + REFERENCE)
    errp = float(jnp.max(jnp.abs(gotp.astype(jnp.float32) - wantp.astype(jnp.float32))))
    row["prefill"] = dict(max_abs_err=errp, atol=atolp, ok=errp <= atolp)
    if g == 1:  # write_kv / copy_blocks never see query heads
      nb = case.pages.shape[3]
      slots = jnp.asarray(rng.choice(nb * bs, size=7, replace=False).astype(np.int32))
      k = kt.random_queries(rng, (7, 2, d), dtype)
      v = kt.random_queries(rng, (7, 2, d), dtype)
      w1 = pk.write_kv(case.pages, 0, k, v, slots, impl=impl)
      w2 = pk.write_kv(case.pages, 0, k, v, slots, impl="reference")
      src = jnp.asarray([1, 2, 0], jnp.int32)
      dst = jnp.asarray([nb - 1, nb - 2, 0], jnp.int32)
      c1 = pk.copy_blocks(case.pages, src, dst, impl=impl)
      c2 = pk.copy_blocks(case.pages, src, dst, impl="reference")
      row["write_kv_equal"] = bool(jnp.array_equal(w1, w2))
      row["copy_blocks_equal"] = bool(jnp.array_equal(c1, c2))
    ok = row["decode"]["ok"] and row["prefill"]["ok"] and row.get("write_kv_equal", True) and row.get(
        "copy_blocks_equal", True)
    failures += not ok
    rows.append(row)
    print(f"{row['dtype']:>8} d={d:3d} bs={bs:2d} G={g}: decode {err:.2e}/{atol:.2e} prefill {errp:.2e}/"
          f"{atolp:.2e} {'ok' if ok else 'MISMATCH'}", flush=True)
  mm_rows, mm_failures = check_layer_matmul(impl, smoke)
  return dict(_meta(), cases=rows, failures=failures + mm_failures, layer_matmul=mm_rows)


def check_layer_matmul(impl: str, smoke: bool) -> tuple[list[dict], int]:
  """``layer_matmul`` against its XLA reference at Llama 3.1 8B's projection shapes (bfloat16, the
  bound of tests/test_kernels_layer_matmul.py: float32 sums blocked differently, two bfloat16
  roundings per side), rows 1, 64 and 512, the norm weight in the prologue, a bias once."""
  shapes = [(5, 64, 96)] if smoke else [(m, k, n) for m in (1, 64, 512)
                                        for k, n in ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))]
  rows, failures, layers = [], 0, 3
  for i, (m, k, n) in enumerate(shapes):
    rs = np.random.default_rng(i)
    x = jnp.asarray(rs.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rs.standard_normal((layers, k, n)) / np.sqrt(k), jnp.bfloat16)
    scale = jnp.asarray(1 + 0.5 * rs.standard_normal((layers, k)), jnp.bfloat16) if k == 4096 or smoke else None
    bias = jnp.asarray(rs.standard_normal((layers, n)), jnp.bfloat16) if i == 0 else None
    got = pk.layer_matmul(x, w, layers - 1, scale=scale, bias=bias, impl=impl)
    want = pk.layer_matmul(x, w, layers - 1, scale=scale, bias=bias, impl="reference")
    atol = tol.layer_matmul_atol(x, w, scale, bias, layers - 1)
    err = float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())
    ok = err <= atol
    failures += not ok
    rows.append(dict(m=m, k=k, n=n, scale=scale is not None, bias=bias is not None, err=err, atol=atol, ok=ok))
  print(f"layer_matmul: {len(rows) - failures}/{len(rows)} within the bound", flush=True)
  return rows, failures


def check_layouts(layers: int, impl: str = "pallas", smoke: bool = False, steps: int = 20) -> dict:
  """The decode step on the two layer layouts a GPU can run, same weights, same inputs: the
  stacked model's scan (projections through ``layer_matmul``, the one-device default) and the
  per-layer model unrolled (XLA's matmuls, autotuned; what a mesh runs). Compile seconds, the
  median step time over ``steps`` calls, and the largest logit difference."""
  import statistics

  from flax import nnx

  from paged_kv.models import (
    allocate_pages,
    init_model,
    llama31_8b,
    make_paged_batch,
    page_spec,
    paged_decode_step,
    per_layer,
  )
  cfg = llama31_8b("bfloat16").replace(num_layers=layers)
  batch, context, bs = 64, 1024, 16
  if smoke:
    from paged_kv.models import tiny
    cfg, batch, context = tiny("float32"), 4, 40
  model = init_model(cfg, seed=0)
  per_seq = -(-context // bs)
  rs = np.random.default_rng(0)
  tables = rs.permutation(np.arange(1, 1 + batch * per_seq)).reshape(batch, per_seq).astype(np.int32)
  meta = make_paged_batch(tables, np.full(batch, context - 1, np.int32), np.ones(batch, np.int32), 1, bs)
  tokens = jnp.asarray(rs.integers(0, cfg.vocab_size, batch), jnp.int32)
  out = dict(_meta(), layers=cfg.num_layers, batch=batch, context=context)
  logits = {}
  for name, m in (("stacked_scan", model), ("per_layer_unrolled", per_layer(model))):
    graphdef, state = nnx.split(m)
    pages = allocate_pages(page_spec(cfg, 1 + batch * per_seq, bs))
    t0 = time.perf_counter()
    lg, pages = paged_decode_step(graphdef, state, pages, meta, tokens, impl=impl)
    jax.block_until_ready(lg)
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
      t = time.perf_counter()
      lg, pages = paged_decode_step(graphdef, state, pages, meta, tokens, impl=impl)
      jax.block_until_ready(lg)
      times.append(time.perf_counter() - t)
    logits[name] = np.asarray(lg, np.float32)
    out[name] = dict(first_call_s=round(first, 2), step_ms=round(1e3 * statistics.median(times), 3))
    print(name, out[name], flush=True)
    del pages, state, m
  out["stacked_over_per_layer"] = round(out["stacked_scan"]["step_ms"] / out["per_layer_unrolled"]["step_ms"], 3)
  out["max_logit_diff"] = float(np.abs(logits["stacked_scan"] - logits["per_layer_unrolled"]).max())
  return out


def check_engine(layers: int, impl: str = "pallas", smoke: bool = False) -> dict:
  from paged_kv import ManagerConfig, engine
  from paged_kv.engine.sampling import SamplingParams
  from paged_kv.engine.serving import Request, ServingConfig, ServingEngine
  from paged_kv.models import allocate_pages, init_model, llama31_8b, page_spec

  cfg = llama31_8b("bfloat16")
  if layers != cfg.num_layers:
    cfg = cfg.replace(num_layers=layers)
  if smoke:  # CPU smoke run: the same code on a tiny model
    from paged_kv.models import tiny
    cfg = tiny("float32")
  t0 = time.perf_counter()
  model = init_model(cfg, seed=0)
  out = dict(_meta(), layers=layers, init_s=round(time.perf_counter() - t0, 1))
  batch, prompt, new, bs = (4, 24, 4, 16) if smoke else (64, 512, 128, 16)
  per_seq = -(-(prompt + new) // bs) + 1
  mgr = ManagerConfig(num_blocks=batch * per_seq + 1, block_size=bs, max_seqs=batch,
                      max_blocks_per_seq=per_seq, prefix_caching=True)
  pages = allocate_pages(page_spec(cfg, mgr.num_blocks, bs))
  rng = np.random.default_rng(0)
  params = SamplingParams(max_new_tokens=new)

  def call(pages, seed):
    toks = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, prompt)), jnp.int32)
    lens = jnp.full((batch,), prompt, jnp.int32)
    t = time.perf_counter()
    res, pages, _ = engine.generate(model, pages, toks, lens, jax.random.key(0), params, manager=mgr,
                                    impl=impl)
    jax.block_until_ready(res.tokens)
    return pages, time.perf_counter() - t, res

  pages, t_first, _ = call(pages, 1)
  pages, t, res = call(pages, 2)
  n = int(jnp.sum(res.lengths))
  out["generate"] = dict(batch=batch, prompt=prompt, new=new, first_call_s=round(t_first, 2), s=round(t, 3),
                         tokens=n, tok_s=round(n / t, 1))
  print("generate:", out["generate"], flush=True)
  del pages

  scfg = ServingConfig(manager=mgr, chunk_size=256, max_prefill_rows=min(8, batch), impl=impl, record_tables=False)
  eng = ServingEngine(model, scfg)
  reqs = [Request(tuple(int(x) for x in rng.integers(0, cfg.vocab_size, prompt)),
                  SamplingParams(max_new_tokens=new), arrival=i // 8) for i in range(batch)]
  t = time.perf_counter()
  done = list(eng.run(reqs))
  wall = time.perf_counter() - t
  st = eng.stats()
  out["serving"] = dict(requests=len(done), ok=sum(o.ok for o in done), wall_s=round(wall, 2), steps=eng.step_count,
                        tokens_per_s=round(st.tokens_per_s, 1),
                        mean_step_ms=round(1e3 * wall / max(eng.step_count, 1), 2))
  print("serving:", out["serving"], flush=True)
  kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * batch * (prompt + new // 2)
  out["kv_bytes_per_decode_step_mid_generation"] = kv
  out["kv_read_lower_bound_ms_h200"] = round(1e3 * kv / 4.8e12, 3)
  return out


# The packages whose range pyproject.toml declares and the check reads: the JAX stack the kernels
# depend on, and the runtime libraries the engine imports.
CHECKED_PACKAGES = ("jax", "jaxlib", "flax", "chex", "optax", "numpy", "safetensors", "tqdm")


def declared_ranges(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
  """{package: version specifier} of the runtime dependencies pyproject.toml declares."""
  import tomllib

  from packaging.requirements import Requirement
  deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
  return {r.name: str(r.specifier) for r in map(Requirement, deps)}


def check_env(installed: dict[str, str | None] | None = None) -> dict:
  """What this machine's Python runs on, against the ranges pyproject.toml declares.

  Installs nothing: a lent GPU machine comes with its own JAX (0.11 with CUDA 13 when last seen),
  and the check runs on that one as it is. ``failures`` counts the packages that are missing or
  outside the declared range (carry the missing ones as wheels; the device tool's README says how).
  ``installed`` ({package: version or None}) replaces the installed versions, for tests."""
  from importlib import metadata

  from packaging.specifiers import SpecifierSet

  def version(name: str) -> str | None:
    try:
      return metadata.version(name)
    except metadata.PackageNotFoundError:
      return None

  ranges = declared_ranges()
  if installed is None:
    installed = {name: version(name) for name in CHECKED_PACKAGES}
  packages, failures = {}, 0
  for name in CHECKED_PACKAGES:
    got, want = installed.get(name), ranges.get(name, "")
    ok = got is not None and SpecifierSet(want).contains(got, prereleases=True)
    failures += not ok
    packages[name] = dict(installed=got, declared=want, ok=ok)
    print(f"{name:>12} {got or 'missing':>12}  declared {want or 'any'}  {'ok' if ok else 'OUT OF RANGE'}",
          flush=True)
  plugins = {d.metadata["Name"]: d.version for d in metadata.distributions()
             if (d.metadata["Name"] or "").startswith(("jax-cuda", "jax_cuda"))}
  devices = [dict(kind=d.device_kind, platform=d.platform) for d in jax.devices()]
  return dict(_meta(), packages=packages, plugins=plugins, devices=devices, failures=failures)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("what", choices=("env", "kernels", "engine", "layouts"))
  ap.add_argument("--out", default=None)
  ap.add_argument("--layers", type=int, default=32)
  ap.add_argument("--impl", default="pallas", help="pallas (GPU); interpret / reference for a CPU smoke run")
  ap.add_argument("--smoke", action="store_true", help="tiny sizes: check the script itself on a CPU")
  a = ap.parse_args()
  if jax.default_backend() != "gpu":
    print(f"warning: backend is {jax.default_backend()}, not gpu", file=sys.stderr)
  run = {"env": check_env, "kernels": lambda: check_kernels(a.impl, a.smoke),
         "engine": lambda: check_engine(a.layers, a.impl, a.smoke),
         "layouts": lambda: check_layouts(a.layers, a.impl, a.smoke)}[a.what]
  res = run()
  out = Path(a.out or ROOT / "results" / {"env": "gpu_env.json", "kernels": "gpu_kernels_check.json",
                                          "engine": "gpu_engine.json", "layouts": "gpu_layouts.json"}[a.what])
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(res, indent=1, default=str) + "\n")
  print(f"wrote {out}")
  return 1 if res.get("failures") else 0


if __name__ == "__main__":
  sys.exit(main())
