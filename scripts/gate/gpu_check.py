"""On a machine with a GPU: every Pallas kernel against its jnp reference, the engine at a Llama
3.1 8B-shaped random bfloat16 model (``engine.generate`` and a ``ServingEngine`` run), the two
single-GPU layouts' decode step, and every figure the GPU compile gate's performance model
estimates, measured.

Part of ``scripts/gpu_check.sh``; see there. Writes ``results/gpu_env.json``,
``results/gpu_kernels_check.json``, ``results/gpu_engine.json``, ``results/gpu_layouts.json`` and
``results/gpu_perf_check.json``.

    python scripts/gate/gpu_check.py env     [--out results/gpu_env.json]
    python scripts/gate/gpu_check.py kernels [--out results/gpu_kernels_check.json]
    python scripts/gate/gpu_check.py engine  [--out results/gpu_engine.json] [--layers 32]
    python scripts/gate/gpu_check.py layouts [--out results/gpu_layouts.json] [--layers 32] [--batch 64 --context 4096]
    python scripts/gate/gpu_check.py perf    [--out results/gpu_perf_check.json] [--summary S] [--layouts L]
                                             [--only SUBSTRING ...] [--budget-s 175] [--smoke]

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
512). ``layouts``: the decode step (batch 64 at 4,096 tokens, one of the performance model's
layout shapes) on the stacked model's scan, whose projections go through ``layer_matmul``
(untuned tiles, never timed on a GPU before), against the per-layer model unrolled on XLA's
autotuned matmuls: their step times and ratio.

``perf``: every spec of ``scripts/gate/perf_plan.perf_specs()`` but the deliberately bad rule
checks (layer_matmul of both Llamas at M 1-256, decode at four batch x context shapes,
copy_blocks, and XLA's copy, XLA's GEMM and JAX's paged attention), built on random inputs as the
gate compiles them (``perf_call``), jitted, timed (median of up to 20 waited-for calls, min, max,
back to back, and 8 calls in one program: ``kernel_us``, free of the host's dispatch), next to
the model's estimate from the gate's summary (``--summary``, key
``performance_model``; estimates null where it has none): the measured fraction of the
roofline, measured / the estimate's low and high ends, within / slower / faster; copy_blocks
against XLA's copy of the same bytes and decode against JAX's paged attention, measured; and the
``layouts`` stage's step times (``--layouts``) next to the model's sums of the same step. Stops
starting specs after ``--budget-s`` and writes its JSON after every spec. ``--smoke``: the same
code on tiny shapes in interpret mode (a CPU run in well under a minute).
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
from paged_kv.pallas_kernels.gpu_figures import H200_BANDWIDTH
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


def check_layouts(layers: int, impl: str = "pallas", smoke: bool = False, steps: int = 20, batch: int = 64,
                  context: int = 4096) -> dict:
  """The decode step on the two layer layouts a GPU can run, same weights, same inputs: the
  stacked model's scan (projections through ``layer_matmul``, the one-device default) and the
  per-layer model unrolled (XLA's matmuls, autotuned; what a mesh runs), ``batch`` sequences at
  ``context`` tokens. Compile seconds, the median step time over ``steps`` calls, and the largest
  logit difference."""
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
  bs = 16
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
  params = SamplingParams(max_new_tokens=new, ignore_eos=True)  # every row generates `new` tokens

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

  scfg = ServingConfig(manager=mgr, chunk_size=256, max_prefill_rows=min(8, batch), impl=impl, record_tables=False,
                       decode_steps=1)  # the one-step program, as the gate's figures were measured
  eng = ServingEngine(model, scfg)
  reqs = [Request(tuple(int(x) for x in rng.integers(0, cfg.vocab_size, prompt)),
                  SamplingParams(max_new_tokens=new, ignore_eos=True), arrival=i // 8) for i in range(batch)]
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
  out["kv_read_lower_bound_ms_h200"] = round(1e3 * kv / H200_BANDWIDTH, 3)
  return out


# ------------------------------------------------------------------------------ perf: measured against the model
# The stage's time: compiling dominates (per spec, the single call and its chain of PERF_CHAIN
# calls: deviceless on the 2-core development CPU 0.2-1.6 s each, lowering included; 76 specs);
# the kernels themselves run in microseconds to a millisecond. Repeats stop at PERF_REPEATS or
# once a spec's repeats used PERF_SPEC_S; the whole stage skips what is left at PERF_BUDGET_S
# (scripts/gpu_check.sh gives the stage 200 s).
PERF_REPEATS, PERF_SPEC_S, PERF_BUDGET_S = 20, 1.0, 175.0
# Kernels per chained program (``time_chain``): the dispatch-free time of one kernel.
PERF_CHAIN = 8
# copy_blocks' page pool, as the gate compiles it (scripts/gate/gpu_compile.py::_perf_program).
COPY_POOL_BLOCKS = 4096
# The order specs are measured in, so that running out of time skips the most numerous and least
# telling ones last: the sanity copy first (is the timing itself right?), then attention, the
# copies and their baselines, XLA's GEMM, layer_matmul.
_PERF_ORDER = ("xla_copy_sanity", "decode", "jax_paged_attention", "copy_blocks", "xla_copy", "xla_gemm",
               "layer_matmul")
# Estimate fields copied from the gate's summary row next to each measurement.
_ESTIMATE_FIELDS = ("low_us", "high_us", "roofline_us", "fraction", "bound", "bytes", "vs_plain_copy", "gate")


def perf_run_specs(only: list[str] | None = None) -> list[dict]:
  """The specs ``perf`` measures: every spec of ``perf_plan.perf_specs()`` but the rule checks
  (deliberately bad variants), in ``_PERF_ORDER``; with ``only``, those each entry names
  (case-insensitive): the spec of exactly that name when there is one ("decode 64x4096", not also
  "decode 64x4096 kv=int8"), else every spec whose name contains it."""
  from scripts.gate import perf_plan
  specs = [s for s in perf_plan.perf_specs() if s["purpose"] != "perf_rule_check"]
  if only:
    names = {perf_plan.spec_name(s).lower() for s in specs}

    def picks(name: str, entry: str) -> bool:
      return name == entry if entry in names else entry in name

    subs = [o.lower() for o in only]
    specs = [s for s in specs if any(picks(perf_plan.spec_name(s).lower(), o) for o in subs)]

  def rank(s: dict) -> int:
    kind = "xla_copy_sanity" if s["kernel"] == "xla_copy" and s["purpose"] == "perf_sanity" else s["kernel"]
    return _PERF_ORDER.index(kind)
  return sorted(specs, key=rank)  # stable: layer_matmul stays grouped by model and projection


def smoke_spec(spec: dict) -> dict:
  """A tiny version of a perf spec for a CPU run of the same code (interpret mode): its name is
  the full spec's, its shapes a few KB. Specs collapse onto a handful of shapes, so the smoke
  compiles each only once."""
  s = dict(spec)
  k = s["kernel"]
  if k == "layer_matmul":
    s.update(m=1 if s["m"] == 1 else 8, k=64, n=64, layers=2)
    if s.get("group"):  # the same number of weights, 64 columns in all
      s["group"] = [64 - 16 * (len(s["group"]) - 1)] + [16] * (len(s["group"]) - 1)
  elif k == "decode":
    s.update(batch=2, context=64, q_heads=4, kv_heads=2, head_dim=64)
  elif k == "jax_paged_attention":  # JAX's kernel splits a sequence's table 16 ways: 16 blocks at least
    s.update(batch=2, context=256, q_heads=4, kv_heads=2, head_dim=64)
  elif k == "copy_blocks":
    s.update(copies=min(s["copies"], 4), layers=min(s["layers"], 2), kv_heads=2, head_dim=64, pool_blocks=16)
  elif k == "xla_copy":
    s.update(bytes=1 << 16)
  elif k == "xla_gemm":
    s.update(m=min(s["m"], 8), k=64, n=64)
  return s


def estimates_by_name(summary: dict | None) -> dict[str, dict]:
  """{spec name: the model's estimate} from the gate's summary (``performance_model.kernels``,
  rows named by ``perf_plan.spec_name``) or its full report (rows holding ``spec`` and
  ``model``). Empty when the summary has no performance model yet; the first row of a name wins."""
  from scripts.gate import perf_plan
  out: dict[str, dict] = {}
  for r in ((summary or {}).get("performance_model") or {}).get("kernels") or []:
    if "spec" in r:
      name, est = perf_plan.spec_name(r["spec"]), dict(r.get("model") or {}, gate=r.get("gate"))
    else:
      name, est = r.get("name"), r
    if name and name not in out and est.get("high_us") is not None:
      out[name] = {f: est.get(f) for f in _ESTIMATE_FIELDS if est.get(f) is not None}
  return out


def _ratio(a: float | None, b: float | None) -> float | None:
  return round(a / b, 3) if a is not None and b else None


def compare_to_estimate(measured_us: float | None, est: dict | None) -> dict:
  """The measured time of one spec against the model's estimate of it: the estimate's figures
  (null without one), the measured fraction of the roofline (``roofline_us / measured_us``),
  ``measured_over_estimate`` against both ends of the estimate's range (measured / low, measured /
  high: 1 at the end met, above 1 slower) and where the measurement falls: "within" the range,
  "slower" than its high end, "faster" than its low end."""
  est = est or {}
  low, high, roof = est.get("low_us"), est.get("high_us"), est.get("roofline_us")
  out = dict(low_us=low, high_us=high, roofline_us=roof, model_fraction=est.get("fraction"),
             model_gate=est.get("gate"), measured_fraction=_ratio(roof, measured_us),
             measured_over_estimate=None, vs_estimate=None)
  if measured_us is not None and low and high:
    out["measured_over_estimate"] = {"low": _ratio(measured_us, low), "high": _ratio(measured_us, high)}
    out["vs_estimate"] = "slower" if measured_us > high else "faster" if measured_us < low else "within"
  if measured_us and est.get("bytes"):
    out["measured_bandwidth_tb_s"] = round(est["bytes"] / (measured_us * 1e-6) / 1e12, 3)
  return out


def measured_comparisons(rows: list[dict]) -> dict:
  """The comparisons ``bench_kernels.py`` made, from the measured rows (``compared_us``, else
  ``measured_us``): each ``copy_blocks`` spec against XLA's copy of the same bytes
  (``vs_plain_copy`` = the copy's time / copy_blocks' time, the model's figure of that name next
  to it), and decode against JAX's
  ``pallas.ops.gpu.paged_attention`` at the same batch x context (JAX's time / ours: above 1, ours
  is faster)."""
  from scripts.gate import perf_plan
  by_name = {r["name"]: dict(r, measured_us=r.get("compared_us") or r.get("measured_us")) for r in rows
             if r.get("measured_us") is not None}
  copies, attention = [], []
  for r in rows:
    s = r["spec"]
    mine = by_name.get(r["name"])
    if s["kernel"] == "copy_blocks" and s["purpose"] == "perf":
      base_name = perf_plan.spec_name(dict(s, kernel="xla_copy", bytes=s["copies"] * perf_plan.copy_block_bytes(
          s["model"], s["layers"])))
      base = by_name.get(base_name)
      copies.append(dict(name=r["name"], baseline=base_name, copy_blocks_us=mine and mine["measured_us"],
                         xla_copy_us=base and base["measured_us"],
                         vs_plain_copy=_ratio(base and base["measured_us"], mine and mine["measured_us"]),
                         model_vs_plain_copy=r.get("model_vs_plain_copy")))
    if s["kernel"] == "decode" and s["purpose"] == "perf":
      theirs = by_name.get(perf_plan.spec_name(dict(s, kernel="jax_paged_attention")))
      if theirs is not None:
        attention.append(dict(name=r["name"], jax_paged_attention=theirs["name"],
                              decode_us=mine and mine["measured_us"], jax_us=theirs["measured_us"],
                              jax_over_ours=_ratio(theirs["measured_us"], mine and mine["measured_us"])))
  return {"copy_blocks_vs_xla_copy": copies, "decode_vs_jax_paged_attention": attention}


def decode_step_comparison(layouts: dict | None, layout_model: dict | None, programs: dict | None = None,
                           source: str | None = None) -> dict:
  """The whole decode step: the ``layouts`` stage's measured step times of the two single-GPU
  layouts (its JSON, ``layouts``) next to the model's sums of the same step
  (``performance_model.layout.shapes`` of the gate's summary, ``layout_model``) and its
  whole-program sums (``programs``). Where the measured batch x context and depth match a model
  shape, each layout's measured time against the model's range, and whether the faster layout
  agrees. Either side may be missing (null)."""
  from scripts.gate import perf_plan
  out: dict = {"source": source, "measured": None, "model_shapes": None, "matched": None, "model_programs": programs,
               "note": None}
  if layouts and "stacked_scan" in layouts and "per_layer_unrolled" in layouts:
    st, pl = layouts["stacked_scan"]["step_ms"], layouts["per_layer_unrolled"]["step_ms"]
    out["measured"] = dict(batch=layouts.get("batch"), context=layouts.get("context"), layers=layouts.get("layers"),
                           device=layouts.get("device"), stacked_ms=st, per_layer_ms=pl,
                           stacked_over_per_layer=_ratio(st, pl), faster="stacked" if st <= pl else "per_layer")
  if layout_model:
    out["model_shapes"] = [{"batch": x["batch"], "context": x["context"], "faster": x.get("faster"),
                            "margin": x.get("margin"),
                            **{lay: {f: x[lay].get(f) for f in ("low_ms", "high_ms", "roofline_ms")}
                               for lay in perf_plan.LAYOUTS if lay in x}}
                           for x in layout_model.get("shapes") or []]
  m = out["measured"]
  if m is None:
    out["note"] = "no measured step (the layouts stage's JSON is missing or incomplete)"
    return out
  if not out["model_shapes"]:
    out["note"] = "no model figures (re-run the full gate: its summary has no performance_model.layout yet)"
    return out
  depth = perf_plan.MODELS["llama3.1-8b"]["layers"]
  shape = next((x for x in out["model_shapes"] if (x["batch"], x["context"]) == (m["batch"], m["context"])), None)
  if shape is None or m["layers"] != depth:
    out["note"] = (f"the measured step ({m['batch']} x {m['context']}, {m['layers']} layers) is at none of the "
                   f"model's shapes ({depth} layers)")
    return out
  matched = {"batch": m["batch"], "context": m["context"], "model_faster": shape["faster"],
             "measured_faster": m["faster"], "agrees": shape["faster"] == m["faster"]}
  for lay, key in (("stacked", "stacked_ms"), ("per_layer", "per_layer_ms")):
    e = shape.get(lay) or {}
    c = compare_to_estimate(m[key], {"low_us": e.get("low_ms"), "high_us": e.get("high_ms"),
                                     "roofline_us": e.get("roofline_ms")})
    matched[lay] = {"measured_ms": m[key], "low_ms": e.get("low_ms"), "high_ms": e.get("high_ms"),
                    "roofline_ms": e.get("roofline_ms"), "measured_fraction": c["measured_fraction"],
                    "measured_over_estimate": c["measured_over_estimate"], "vs_estimate": c["vs_estimate"]}
  out["matched"] = matched
  return out


class _Inputs:
  """Random inputs on the default device: small ones from NumPy, large ones drawn on the device
  (``jax.random``: no multi-GB host array, no transfer); above ``DRAW`` elements one slice along
  the first axis is drawn and repeated (every layer's weights or pages alike: their values do not
  change a kernel's time, and ``jax.random`` stays far from 2^32 elements). ``keep`` holds one
  array set (the current projection's weights, shared by its row counts) until another replaces
  it."""

  SMALL, DRAW = 1 << 20, 1 << 28

  def __init__(self, seed: int = 0):
    self.rng = np.random.default_rng(seed)
    self.kept: dict = {}
    self.draws = 0
    self._drawers: dict = {}

  def normal(self, shape: tuple, dtype, scale: float = 1.0, shift: float = 0.0, keep: str | None = None):
    dtype = jnp.dtype(dtype)
    if keep is not None:
      key = (keep, shape, dtype.name, scale, shift)
      if key in self.kept:
        return self.kept[key]
    if int(np.prod(shape)) <= self.SMALL:
      a = jnp.asarray(shift + scale * self.rng.standard_normal(shape, np.float32), dtype)
    else:
      self.draws += 1
      a = self._drawer(shape, dtype, scale, shift)(jax.random.key(self.draws))
    if keep is not None:
      self.kept = {key: a}  # drops the previous set
    return a

  def _drawer(self, shape: tuple, dtype, scale: float, shift: float):
    key = (shape, dtype.name, scale, shift)
    if key not in self._drawers:
      part = shape[1:] if int(np.prod(shape)) > self.DRAW and len(shape) > 1 else shape

      def draw(k):
        x = (shift + scale * jax.random.normal(k, part, jnp.float32)).astype(dtype)
        return jnp.broadcast_to(x, shape) if part != shape else x
      self._drawers[key] = jax.jit(draw)
    return self._drawers[key]

  def tables(self, batch: int, per_seq: int):
    """Block tables: distinct valid block ids (1 .. batch x per_seq; block 0 is the null block)."""
    return jnp.asarray(self.rng.permutation(np.arange(1, 1 + batch * per_seq)).reshape(batch, per_seq), jnp.int32)

  def copy_lists(self, pool: int, copies: int):
    """src, dst: distinct block ids, no destination among the sources, none the null block."""
    ids = self.rng.choice(np.arange(1, pool), size=2 * copies, replace=False).astype(np.int32)
    return jnp.asarray(ids[:copies]), jnp.asarray(ids[copies:])


def perf_call(spec: dict, impl: str, inputs: _Inputs):
  """(cache key, function, concrete args, donated argnums, chain) of one perf spec, as
  ``gpu_compile._perf_program`` builds it from abstract arrays. Departures: the decode kernel's
  pages hold 2 layers (it reads layer 1), not 32 (its time does not depend on the others); JAX's
  paged attention reads distinct K and V pages (the same array twice would hit L2 on V);
  ``layer_matmul``'s weights have the model's depth (``spec["layers"]``).

  ``chain(args, k)``: (function, args) running the kernel ``k`` times in one program, each call
  on the previous one's result or on other data (``layer_matmul``: ``k`` different layers;
  ``copy_blocks``: ``k`` copy lists), so XLA can neither merge nor drop one and little of it sits
  in L2 from the call before. ``args``: the single call's args after its timing (its pages, when
  donated, are the last call's result)."""
  from paged_kv.pallas_kernels.jax_compat import jax_paged_attention
  dt = jnp.dtype(spec["dtype"])
  kernel = spec["kernel"]
  key = (kernel, impl) + tuple(sorted((k, str(v)) for k, v in spec.items() if k not in ("purpose", "model", "proj")))

  def chain_first(fn):  # the kernel's result is its next call's first operand
    def chain(args, k):
      def run(x, *rest):
        for _ in range(k):
          x = fn(x, *rest)
        return x
      return run, args
    return chain

  if kernel == "layer_matmul":
    m, k, n, layers = spec["m"], spec["k"], spec["n"], spec["layers"]
    extras = spec["extras"].split("+")
    proj = f"{spec.get('model')}/{spec.get('proj')}"
    x = inputs.normal((m, k), dt)
    group = spec.get("group")
    if group:  # one launch over several weights (q|k|v, gate|up): as the model calls it
      w = tuple(inputs.normal((layers, k, g), dt, k ** -0.5, keep=f"{proj}/{i}") for i, g in enumerate(group))
    else:
      w = inputs.normal((layers, k, n), dt, k ** -0.5, keep=proj)
    rest = ((inputs.normal((layers, k), dt, 0.1, 1.0),) if "scale" in extras else ()) + (
        (inputs.normal((layers, n), dt),) if "bias" in extras else ())

    def matmul(x, w, layer, *rest):
      rest = list(rest)
      scale = rest.pop(0) if "scale" in extras else None
      bias = rest.pop(0) if "bias" in extras else None
      return pk.layer_matmul(x, w, layer, scale=scale, bias=bias, impl=impl)

    def chain(args, kk):  # one operand per layer id: no index arithmetic between the kernels
      def run(*a):
        x, w, ids, rest = a[0], a[1], a[2:2 + kk], a[2 + kk:]
        return tuple(matmul(x, w, i, *rest) for i in ids)
      ids = tuple(jnp.asarray(i * layers // kk, jnp.int32) for i in range(kk))
      return run, (args[0], args[1]) + ids + tuple(args[3:])
    return key, matmul, (x, w, jnp.asarray(layers // 2, jnp.int32)) + rest, (), chain
  if kernel in ("decode", "jax_paged_attention"):
    b, ctx, bs, d, kvh = spec["batch"], spec["context"], spec["block_size"], spec["head_dim"], spec["kv_heads"]
    per_seq = ctx // bs
    nblocks = b * per_seq + 1
    q = inputs.normal((b, spec["q_heads"], d), dt)
    tables, lens = inputs.tables(b, per_seq), jnp.full((b,), ctx, jnp.int32)
    if kernel == "decode":
      pages = inputs.normal((2, 2, kvh, nblocks, bs, d), dt)
      fn = lambda q, p, t, n: pk.paged_decode_attention(q, p, 1, t, n, impl=impl)
      return key, fn, (q, pages, tables, lens), (), chain_first(fn)
    pa = jax_paged_attention()
    kp, vp = inputs.normal((kvh, nblocks, bs, d), dt), inputs.normal((kvh, nblocks, bs, d), dt)
    fn = lambda q, k, v, t, n: pa.paged_attention(q, k, v, t, n, interpret=impl == "interpret")
    return key, fn, (q, kp, vp, tables, lens), (), chain_first(fn)
  if kernel == "copy_blocks":
    pool = spec.get("pool_blocks", COPY_POOL_BLOCKS)
    pages = inputs.normal((spec["layers"], 2, spec["kv_heads"], pool, spec["block_size"], spec["head_dim"]), dt)
    fn = lambda p, s, t: pk.copy_blocks(p, s, t, impl=impl)

    def chain(args, kk):  # a copy list per call
      def run(p, *lists):
        for i in range(kk):
          p = fn(p, lists[2 * i], lists[2 * i + 1])
        return p
      return run, (args[0],) + tuple(a for _ in range(kk) for a in inputs.copy_lists(pool, spec["copies"]))
    return key, fn, (pages,) + inputs.copy_lists(pool, spec["copies"]), (0,), chain
  if kernel == "xla_copy":  # an elementwise kernel of XLA's, as the gate compiles it
    x = inputs.normal((spec["bytes"] // dt.itemsize,), dt)

    def chain(args, kk):  # the barrier keeps XLA from fusing the adds into one kernel
      def run(x):
        for _ in range(kk):
          x = jax.lax.optimization_barrier(x + jnp.asarray(1, dt))
        return x
      return run, args
    return key, (lambda x: x + jnp.asarray(1, dt)), (x,), (), chain
  if kernel == "xla_gemm":  # K = N: the product is the next call's left operand
    x, w = inputs.normal((spec["m"], spec["k"]), dt), inputs.normal((spec["k"], spec["n"]), dt, spec["k"] ** -0.5)
    fn = lambda x, w: x @ w
    return key, fn, (x, w), (), chain_first(fn) if spec["k"] == spec["n"] else None
  raise ValueError(f"unknown perf kernel {kernel!r}")


def _waited(fn, args: tuple, donate: tuple, repeats: int, spec_s: float) -> tuple[list[float], tuple, float]:
  """Two warm-up calls (the first compiles; the first Pallas call of a process retraces once),
  then up to ``repeats`` calls each waited for, stopping early once they took ``spec_s`` (one at
  least): (their seconds, the args after them, the first call's seconds). A donated argument
  (the pages) is replaced by the call's result each time."""
  def call(a):
    out = fn(*a)
    return out, ((out,) + tuple(a[1:]) if donate else a)

  t = time.perf_counter()
  out, args = call(args)
  jax.block_until_ready(out)
  first = time.perf_counter() - t
  out, args = call(args)
  jax.block_until_ready(out)
  times: list[float] = []
  t_start = time.perf_counter()
  while len(times) < max(1, repeats) and (not times or time.perf_counter() - t_start < spec_s):
    t = time.perf_counter()
    out, args = call(args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t)
  return times, args, first


def time_call(fn, args: tuple, donate: tuple, repeats: int, spec_s: float) -> tuple[dict, tuple]:
  """Times a jitted call (``_waited``): ``first_call_s``, the median, min and max of the waited-for
  calls in us (``measured_us``: each includes the host's dispatch and wait, about
  ``sync_floor_us``), and ``stream_us``: as many calls issued back to back, waited for once, per
  call. Returns the figures and the args after the calls."""
  import statistics
  times, args, first = _waited(fn, args, donate, repeats, spec_s)
  t = time.perf_counter()
  out = None
  for _ in times:
    out = fn(*args)
    if donate:
      args = (out,) + tuple(args[1:])
  jax.block_until_ready(out)
  stream = (time.perf_counter() - t) / len(times)
  del out
  return dict(first_call_s=round(first, 3), measured_us=round(1e6 * statistics.median(times), 2),
              min_us=round(1e6 * min(times), 2), max_us=round(1e6 * max(times), 2), repeats=len(times),
              stream_us=round(1e6 * stream, 2)), args


def time_chain(fn, args: tuple, donate: tuple, k: int, single_us: float, repeats: int, spec_s: float) -> dict:
  """Times ``k`` calls of the kernel in one program (``perf_call``'s chain), waited for:
  ``chain_us`` is its median over ``k``; ``kernel_us``, ``(chain - single) / (k - 1)``, the
  time one more kernel adds, free of the host's dispatch and wait (the kernel and the launch gap
  between two kernels of one program); null when noise makes it <= 0."""
  import statistics
  times, args, first = _waited(fn, args, donate, repeats, spec_s)
  del args
  t_k = 1e6 * statistics.median(times)
  kernel = (t_k - single_us) / (k - 1)
  return dict(chain=k, chain_first_call_s=round(first, 3), chain_us=round(t_k / k, 2),
              kernel_us=round(kernel, 2) if kernel > 0 else None)


def _sync_floor_us(n: int = 20) -> float:
  """The median time of an empty jitted call waited for: the dispatch and sync every measured
  call includes."""
  import statistics
  f = jax.jit(lambda x: x + 1)
  x = jnp.zeros((), jnp.float32)
  jax.block_until_ready(f(x))
  times = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t)
  return round(1e6 * statistics.median(times), 2)


def _read_json(path: Path | None) -> dict | None:
  try:
    return json.loads(Path(path).read_text()) if path else None
  except (OSError, ValueError):
    return None


def _write_json(path: Path, obj: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
  tmp.replace(path)


def check_perf(out_path: Path, smoke: bool = False, only: list[str] | None = None, impl: str = "pallas",
               summary_path: Path | None = ROOT / "results" / "gpu_compile_summary.json",
               layouts_path: Path | None = ROOT / "results" / "gpu_layouts.json",
               budget_s: float = PERF_BUDGET_S, repeats: int = PERF_REPEATS, spec_s: float = PERF_SPEC_S,
               chain_k: int = PERF_CHAIN) -> dict:
  """Every figure the performance model estimates, measured: each spec of
  ``perf_plan.perf_specs()`` but the rule checks, timed alone (``time_call``) and ``chain_k``
  times in one program (``time_chain``), next to the gate's estimate of it
  (``compare_to_estimate`` on ``compared_us``: the chain's dispatch-free ``kernel_us`` where
  measured, else the waited-for median ``measured_us``; ``compared`` names which), the
  bench-style comparisons (``measured_comparisons``),
  and the whole decode step (``decode_step_comparison``: the ``layouts`` stage's JSON next to the
  model's layout sums). Writes ``out_path`` after every spec, so a stage killed at its time limit
  leaves what it measured; specs left when ``budget_s`` is spent are recorded as skipped.
  ``smoke``: tiny shapes (``smoke_spec``), interpret mode, 2 repeats: the same code on a CPU."""
  from scripts.gate import perf_plan
  t0 = time.perf_counter()
  if smoke:
    impl, repeats, chain_k = "interpret", min(repeats, 2), min(chain_k, 2)
  summary = _read_json(summary_path)
  estimates = estimates_by_name(summary)
  pm = (summary or {}).get("performance_model") or {}
  res: dict = dict(_meta(), what="scripts/gate/gpu_check.py perf: measured time of every kernel the performance "
                   "model estimates, against its estimate", smoke=smoke, impl=impl,
                   summary=str(summary_path) if summary_path else None, estimates=len(estimates),
                   note=None if estimates else "no estimates in the summary (its performance_model is missing: re-run "
                   "the full gate); measured figures only", budget_s=budget_s, repeats=repeats, spec_s=spec_s,
                   chain=chain_k, sync_floor_us=_sync_floor_us(), kernels=[], failures=0)
  print(f"perf: {len(estimates)} estimates from {summary_path}; sync floor {res['sync_floor_us']} us", flush=True)
  inputs, jitted = _Inputs(0), {}
  for spec in perf_run_specs(only):
    name = perf_plan.spec_name(spec)
    run_spec = smoke_spec(spec) if smoke else spec
    row: dict = dict(name=name, purpose=spec["purpose"], kernel=spec["kernel"], spec=spec)
    if smoke:
      row["smoke_spec"] = run_spec
    left = budget_s - (time.perf_counter() - t0)
    if left <= 0:
      row.update(status="skipped", error=f"the stage's budget of {budget_s:.0f} s is spent")
    else:
      try:
        key, fn, args, donate, chain = perf_call(run_spec, impl, inputs)
        if key not in jitted:
          jitted[key] = jax.jit(fn, donate_argnums=donate)
        times, args = time_call(jitted[key], args, donate, repeats, min(spec_s, left))
        row.update(times, status="measured")
        if chain is not None and chain_k > 1 and budget_s > time.perf_counter() - t0:
          try:  # the single call's figures stand without it
            cfn, cargs = chain(args, chain_k)
            args = None
            if (key, chain_k) not in jitted:
              jitted[(key, chain_k)] = jax.jit(cfn, donate_argnums=donate)
            row.update(time_chain(jitted[(key, chain_k)], cargs, donate, chain_k, row["measured_us"], repeats,
                                  spec_s))
          except Exception as e:
            row["chain_error"] = f"{type(e).__name__}: {e}"[:1500]
          cargs = None
        args = None
      except Exception as e:  # one spec's failure (a lowering error, memory) must not lose the others
        row.update(status="failed", error=f"{type(e).__name__}: {e}"[:1500])
        res["failures"] += 1
    est = estimates.get(name)
    basis = "kernel_us" if row.get("kernel_us") else "measured_us"
    row.update(compared=basis, compared_us=row.get(basis))
    row.update(compare_to_estimate(row["compared_us"], est))
    row["model_vs_plain_copy"] = (est or {}).get("vs_plain_copy")
    res["kernels"].append(row)
    if row["status"] == "measured":
      one = f"{row['kernel_us']:,.2f}" if row.get("kernel_us") else "-"
      print(f"{name:>48}: {row['measured_us']:>10,.2f} us waited, {row['stream_us']:,.2f} back to back, {one} "
            f"in a chain (first call {row['first_call_s']:.2f} s)"
            + (f"; model {row['low_us']:,.2f}-{row['high_us']:,.2f} us: {row['vs_estimate']}" if row["vs_estimate"]
               else ""), flush=True)
    else:
      print(f"{name:>48}: {row['status']}: {row.get('error')}", flush=True)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    _write_json(out_path, res)
  inputs.kept.clear()
  rows = res["kernels"]
  res["counts"] = {s: sum(r["status"] == s for r in rows) for s in ("measured", "skipped", "failed")}
  res["counts"]["with_estimate"] = sum(r["high_us"] is not None for r in rows)
  res["counts"]["within_estimate"] = sum(r["vs_estimate"] == "within" for r in rows)
  res["comparisons"] = measured_comparisons(rows)
  res["decode_step"] = decode_step_comparison(_read_json(layouts_path), pm.get("layout"), pm.get("programs"),
                                              str(layouts_path) if layouts_path else None)
  res["wall_s"] = round(time.perf_counter() - t0, 1)
  _write_json(out_path, res)
  print(f"perf: {res['counts']} in {res['wall_s']} s", flush=True)
  return res


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
  ap.add_argument("what", choices=("env", "kernels", "engine", "layouts", "perf"))
  ap.add_argument("--out", default=None)
  ap.add_argument("--layers", type=int, default=32)
  ap.add_argument("--batch", type=int, default=64, help="layouts: sequences in the decode step")
  ap.add_argument("--context", type=int, default=4096, help="layouts: tokens per sequence")
  ap.add_argument("--impl", default="pallas", help="pallas (GPU); interpret / reference for a CPU smoke run")
  ap.add_argument("--smoke", action="store_true", help="tiny sizes: check the script itself on a CPU")
  ap.add_argument("--only", action="append", default=None, metavar="SUBSTRING",
                  help="perf: only the specs whose name contains it (repeatable)")
  ap.add_argument("--summary", default=str(ROOT / "results" / "gpu_compile_summary.json"),
                  help="perf: the gate's summary holding the model's estimates")
  ap.add_argument("--layouts", default=None, help="perf: the layouts stage's JSON (default: beside --out)")
  ap.add_argument("--budget-s", type=float, default=PERF_BUDGET_S, help="perf: skip the specs left after this long")
  a = ap.parse_args()
  if jax.default_backend() != "gpu":
    print(f"warning: backend is {jax.default_backend()}, not gpu", file=sys.stderr)
  out = Path(a.out or ROOT / "results" / {"env": "gpu_env.json", "kernels": "gpu_kernels_check.json",
                                          "engine": "gpu_engine.json", "layouts": "gpu_layouts.json",
                                          "perf": "gpu_perf_check.json"}[a.what])
  layouts = Path(a.layouts) if a.layouts else out.parent / "gpu_layouts.json"
  run = {"env": check_env, "kernels": lambda: check_kernels(a.impl, a.smoke),
         "engine": lambda: check_engine(a.layers, a.impl, a.smoke),
         "layouts": lambda: check_layouts(a.layers, a.impl, a.smoke, batch=a.batch, context=a.context),
         "perf": lambda: check_perf(out, a.smoke, a.only, a.impl, Path(a.summary), layouts, a.budget_s)}[a.what]
  res = run()
  _write_json(out, res)
  print(f"wrote {out}")
  return 1 if res.get("failures") else 0

if __name__ == "__main__":
  sys.exit(main())
