"""The performance model's side of the gate: the named shapes every kernel is estimated at, the
work (bytes, FLOPs, tiles) each must do there, the targets, the model's sanity checks, and the
whole-program sums and layout decision.

Plain Python (no JAX import at module level), so ``tests/test_perf_model.py`` checks it on any
machine; the kernels' tile choices are read from their modules (plain Python functions) by the
``perf_work_*`` modules.

Named shapes (all bf16, H200 / sm_90; Llama 3.1 8B: d 4096, 32 q / 8 KV heads, head_dim 128,
intermediate 14,336, 32 layers; Llama 3.2 1B: d 2048, 32 q / 8 KV heads, head_dim 64,
intermediate 8,192, 16 layers; block size 16):

* ``layer_matmul``: every launch of the projections (the q|k|v group, o, the gate|up group,
  down) of both models at M = 1, 8, 64 and 256 rows; target 80 % of the roofline.
* decode attention (8B heads): batch x context 64 x 4k, 256 x 1k, 1 x 32k, 4 x 8k, every
  sequence at full context, and 64 x 32k with a sliding window of 4096 (Mistral's; only the
  window's K/V count); 64 x 4k over int8 pages (``kv_dtype``: one byte per element plus a float32
  scale per token and head, so the roofline's bytes are about 0.52x bf16's); target 85 %.
* ``copy_blocks``: 1, 16 and 256 blocks of the 8B's pages (all 32 layers: 2 MiB a block) and of
  the 1B's per-layer pages (one layer: 32 KB a block); target 80 % of XLA's own copy of the same
  bytes, estimated the same way.
* sanity checks of the model on kernels whose speed is known: XLA's elementwise copy of 256 MiB
  (must come out at >= 80 % of the bandwidth, or the model is wrong), XLA's GEMM as compiled
  without a GPU, and JAX's own ``pallas.ops.gpu.paged_attention`` (purpose "perf_sanity"); and
  XLA's copy of the bytes each ``copy_blocks`` spec moves (purpose "perf_baseline").
"""

from __future__ import annotations

import dataclasses

from scripts.gate import perf_model

MODELS = {
    "llama3.1-8b": dict(d=4096, f=14_336, q_heads=32, kv_heads=8, head_dim=128, layers=32, vocab=128_256),
    "llama3.2-1b": dict(d=2048, f=8192, q_heads=32, kv_heads=8, head_dim=64, layers=16, vocab=128_256),
}
MATMUL_ROWS = (1, 8, 64, 256)
DECODE_SHAPES = ((64, 4096), (256, 1024), (1, 32_768), (4, 8192))
# (batch, context, window) of sliding-window decode: the kernel reads only the window's tiles.
DECODE_WINDOW_SHAPES = ((64, 32_768, 4096),)
# (batch, context, kv_dtype) of decode over quantized pages (paged_kv.pallas_kernels.quant).
DECODE_QUANT_SHAPES = ((64, 4096, "int8"),)
COPY_COUNTS = (1, 16, 256)
BLOCK_SIZE = 16
TARGETS = {"layer_matmul": 0.80, "decode": 0.85, "copy_blocks": 0.80}
# XLA's own elementwise copy of a large array (large enough that no kernel is latency-bound: many
# waves of CTAs): the model must rate it at least this fraction of the bandwidth.
COPY_SANITY = 0.80
SANITY_COPY_BYTES = 256 << 20
KERNEL_NAMES = {"layer_matmul": "layer_matmul", "decode": "paged_decode_attention", "copy_blocks": "copy_blocks"}


def projections(model: str) -> list[tuple[str, int, int, str]]:
  """(name, K, N, extras) of the ``layer_matmul`` launches of one decoder layer, as the model on
  the in-place path launches them: "qkv" (q, k and v as one group: N the sum of their widths),
  "o", "gate_up" (gate and up as one group), "down"; ``extras`` is "scale" where the model folds
  the preceding RMSNorm's weight into the projection (qkv and gate_up). ``group_widths`` gives
  a group's widths."""
  c = MODELS[model]
  return [(name, k, sum(ns), extras) for name, k, ns, extras in _launches(c)]


def group_widths(model: str, name: str) -> tuple[int, ...]:
  """The widths ``N_i`` of the weights launch ``name`` of ``projections(model)`` runs together
  (one entry for a single weight)."""
  return next(ns for n, _, ns, _ in _launches(MODELS[model]) if n == name)


def _launches(c: dict) -> list[tuple[str, int, tuple[int, ...], str]]:
  q, kv = c["q_heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
  return [("qkv", c["d"], (q, kv, kv), "scale"), ("o", q, (c["d"],), "none"),
          ("gate_up", c["d"], (c["f"], c["f"]), "scale"), ("down", c["f"], (c["d"],), "none")]


def perf_specs() -> list[dict]:
  """Every kernel configuration the model estimates (purpose "perf"), and its sanity checks
  (purpose "perf_sanity")."""
  base = dict(target="sm_90", dtype="bfloat16", purpose="perf")
  specs = []
  for model in MODELS:
    for name, k, n, extras in projections(model):
      for m in MATMUL_ROWS:
        widths = group_widths(model, name)
        group = {"group": list(widths)} if len(widths) > 1 else {}
        specs.append(dict(base, kernel="layer_matmul", model=model, proj=name, m=m, k=k, n=n, extras=extras,
                          layers=MODELS[model]["layers"], **group))
  c = MODELS["llama3.1-8b"]
  for batch, context in DECODE_SHAPES:
    specs.append(dict(base, kernel="decode", model="llama3.1-8b", batch=batch, context=context,
                      q_heads=c["q_heads"], kv_heads=c["kv_heads"], head_dim=c["head_dim"], block_size=BLOCK_SIZE))
  for batch, context, window in DECODE_WINDOW_SHAPES:
    specs.append(dict(base, kernel="decode", model="llama3.1-8b", batch=batch, context=context, window=window,
                      q_heads=c["q_heads"], kv_heads=c["kv_heads"], head_dim=c["head_dim"], block_size=BLOCK_SIZE))
  for batch, context, kv_dtype in DECODE_QUANT_SHAPES:
    specs.append(dict(base, kernel="decode", model="llama3.1-8b", batch=batch, context=context, kv_dtype=kv_dtype,
                      q_heads=c["q_heads"], kv_heads=c["kv_heads"], head_dim=c["head_dim"], block_size=BLOCK_SIZE))
  for model, layers in (("llama3.1-8b", 32), ("llama3.2-1b", 1)):
    m = MODELS[model]
    for copies in COPY_COUNTS:
      specs.append(dict(base, kernel="copy_blocks", model=model, copies=copies, layers=layers, kv_heads=m["kv_heads"],
                        head_dim=m["head_dim"], block_size=BLOCK_SIZE))
  sanity = dict(base, purpose="perf_sanity")
  # XLA's own copy of what each copy_blocks spec moves: the baseline it is judged against.
  for model, layers in (("llama3.1-8b", 32), ("llama3.2-1b", 1)):
    for copies in COPY_COUNTS:
      specs.append(dict(base, purpose="perf_baseline", kernel="xla_copy",
                        bytes=copies * copy_block_bytes(model, layers)))
  specs.append(dict(sanity, kernel="xla_copy", bytes=SANITY_COPY_BYTES))
  specs += rule_check_specs()
  for m in (1, 64):
    specs.append(dict(sanity, kernel="xla_gemm", m=m, k=4096, n=4096))
  specs.append(dict(sanity, kernel="jax_paged_attention", batch=64, context=4096, q_heads=c["q_heads"],
                    kv_heads=c["kv_heads"], head_dim=c["head_dim"], block_size=BLOCK_SIZE))
  return specs


def rule_check_specs() -> list[dict]:
  """Kernel variants that break the gate's rules on purpose (purpose "perf_rule_check"): each
  must be caught by the rule it names (``expect``), so the rules are known to fire on real
  compile output, not only on made-up facts. ``variant`` holds the kernel arguments that make
  it bad: decode attention at batch 1 x 32k without a split (8 CTAs: the grid rule, and one
  CTA's tile per SM at most: the in-flight rule); ``copy_blocks`` of one block with 16 tile rows
  per program (32 CTAs); ``layer_matmul`` with its tiles before the model (64 CTAs of one
  single-buffered 4 KB tile)."""
  c = MODELS["llama3.1-8b"]
  base = dict(target="sm_90", dtype="bfloat16", purpose="perf_rule_check")
  return [
      dict(base, kernel="decode", model="llama3.1-8b", batch=1, context=32_768, q_heads=c["q_heads"],
           kv_heads=c["kv_heads"], head_dim=c["head_dim"], block_size=BLOCK_SIZE, variant={"num_splits": 1},
           expect=["grid", "in flight"]),
      dict(base, kernel="copy_blocks", model="llama3.1-8b", copies=1, layers=32, kv_heads=c["kv_heads"],
           head_dim=c["head_dim"], block_size=BLOCK_SIZE, variant={"head_rows": 16}, expect=["grid"]),
      # layer_matmul's tiles before the model (bm 16, bk 64, bn 32, one buffer): Llama 3.2 1B's o
      # projection at M = 1 gets 64 CTAs of one 4 KB tile each.
      dict(base, kernel="layer_matmul", model="llama3.2-1b", proj="o", m=1, k=2048, n=2048, extras="none",
           layers=MODELS["llama3.2-1b"]["layers"],
           variant={"config": dict(bm=16, bk=64, bn=32, splits=1, num_warps=4, num_stages=2)},
           expect=["grid", "in flight"]),
  ]


def copy_block_bytes(model: str, layers: int, itemsize: int = 2) -> int:
  """Bytes of one block of ``model``'s pages over ``layers`` layers (K and V)."""
  m = MODELS[model]
  return layers * 2 * m["kv_heads"] * BLOCK_SIZE * m["head_dim"] * itemsize


def spec_name(spec: dict) -> str:
  """A short readable name of a perf spec."""
  k = spec["kernel"]
  if spec.get("variant"):
    flat = {}
    for a, b in spec["variant"].items():
      flat.update(b if isinstance(b, dict) else {a: b})
    return spec_name({key: v for key, v in spec.items() if key != "variant"}) + " " + " ".join(
        f"{a}={b}" for a, b in flat.items())
  if k == "layer_matmul":
    return f"layer_matmul {spec['model']} {spec['proj']} M={spec['m']}"
  if k in ("decode", "jax_paged_attention"):
    window = f" window={spec['window']}" if spec.get("window") else ""
    kv = f" kv={spec['kv_dtype']}" if spec.get("kv_dtype") else ""
    return f"{k} {spec['batch']}x{spec['context']}{window}{kv}"
  if k == "copy_blocks":
    return f"copy_blocks {spec['model']} {spec['layers']} layer(s) x {spec['copies']}"
  if k == "xla_copy":
    return f"xla_copy {spec['bytes']:,} B"
  return f"{k} M={spec['m']} K={spec['k']} N={spec['n']}"


def work(spec: dict, facts: dict) -> perf_model.Work:
  """What the kernel of ``spec`` must do (``facts``: its compile facts, for the kernels whose
  tiles only the compile knows: XLA's own)."""
  k = spec["kernel"]
  if k == "layer_matmul":
    from scripts.gate.perf_work_matmul import matmul_work
    n = tuple(spec["group"]) if spec.get("group") else spec["n"]
    return matmul_work(spec["m"], spec["k"], n, 2, "scale" in spec["extras"], "bias" in spec["extras"],
                       **spec.get("variant", {}))
  if k == "decode":
    from scripts.gate.perf_work_decode import decode_work
    return decode_work(spec["batch"], spec["context"], spec["q_heads"], spec["kv_heads"], spec["head_dim"],
                       spec["block_size"], 2, window=spec.get("window"), kv_dtype=spec.get("kv_dtype"),
                       **spec.get("variant", {}))
  if k == "copy_blocks":
    from scripts.gate.perf_work_copy import copy_work
    return copy_work(spec["copies"], spec["layers"] * 2 * spec["kv_heads"], spec["block_size"], spec["head_dim"], 2,
                     **spec.get("variant", {}))
  if k == "xla_copy":
    return elementwise_work(spec["bytes"], facts)
  if k == "xla_gemm":
    return xla_gemm_work(spec["m"], spec["k"], spec["n"], 2, facts)
  if k == "jax_paged_attention":
    kv = spec["batch"] * spec["context"] * spec["kv_heads"] * spec["head_dim"] * 2 * 2
    grid = facts.get("grid") or [1, 1, 1]
    ctas = max(1, grid[0] * grid[1] * grid[2])
    pipe = facts.get("pipeline") or {}
    per_thread = (pipe.get("cp_async_bytes") or 0) + (pipe.get("ld_global_bytes") or 0)
    step = max(1, per_thread * (facts.get("threads") or [128])[0])
    return perf_model.Work(bytes=kv, flops=4 * spec["batch"] * spec["context"] * spec["q_heads"] * spec["head_dim"],
                           step_bytes=step, steps=max(1, -(-kv // (ctas * step))))
  raise ValueError(f"no work model for {k!r}")


def elementwise_work(nbytes: int, facts: dict) -> perf_model.Work:
  """An elementwise kernel (read ``nbytes``, write ``nbytes``) with no loop: every thread issues
  its loads at once, so one step of ``threads x loads per thread`` bytes per CTA."""
  threads = (facts.get("threads") or [128])[0]
  pipe = facts.get("pipeline") or {}
  per_thread = (pipe.get("ld_global_bytes") or 0) + (pipe.get("cp_async_bytes") or 0)
  return perf_model.Work(bytes=2 * nbytes, flops=0, step_bytes=max(1, per_thread * threads), steps=1,
                         read_fraction=0.5)


def xla_gemm_work(m: int, k: int, n: int, itemsize: int, facts: dict) -> perf_model.Work:
  """XLA's GEMM fusion as compiled without a GPU: the bytes of the product, and per CTA the
  bytes one iteration of its loop loads (from the PTX) over the K steps its share implies."""
  threads = (facts.get("threads") or [128])[0]
  grid = facts.get("grid") or [1, 1, 1]
  ctas = max(1, grid[0] * grid[1] * grid[2])
  pipe = facts.get("pipeline") or {}
  step = max(1, ((pipe.get("ld_global_bytes") or 0) + (pipe.get("cp_async_bytes") or 0)) * threads)
  total = (m * k + k * n + m * n) * itemsize
  return perf_model.Work(bytes=total, flops=2 * m * k * n, step_bytes=step,
                         steps=max(1, -(-k * n * itemsize // (ctas * step))))


def evaluate(spec: dict, facts: dict, gpu: perf_model.Gpu | None = None) -> dict:
  """The model's estimate of one compiled perf spec (``facts``: the kernel's entry of the
  compile result: grid, threads, registers, shared memory, mma, pipeline)."""
  gpu = gpu or perf_model.GPUS[spec["target"]]
  pipe = perf_model.Pipeline(**facts["pipeline"])
  grid = facts.get("grid") or [1, 1, 1]
  ctas = grid[0] * grid[1] * grid[2]
  w = work(spec, facts)
  est = perf_model.estimate(gpu, ctas, (facts.get("threads") or [128])[0], facts.get("registers") or 0,
                            facts.get("shared_memory_bytes") or 0, pipe, w, facts.get("mma"))
  out = est.as_dict()
  out.update(bytes=w.bytes, extra_bytes=w.extra_bytes, flops=w.flops, step_bytes=w.step_bytes, steps=w.steps,
             rules=perf_model.rule_violations(est), gpu=gpu.name)
  return out


def kernel_entry(spec: dict, kernels: dict) -> tuple[str, dict] | None:
  """(name, facts) of the kernel a perf spec estimates among a compile's kernels."""
  k = spec["kernel"]
  if k in KERNEL_NAMES:
    name = KERNEL_NAMES[k]
    return (name, kernels[name]) if name in kernels else None
  # XLA's or JAX's kernels: the one that moves the data (the largest grid with a pipeline).
  cands = [(n, f) for n, f in kernels.items() if f.get("pipeline")]
  if k == "xla_gemm":
    cands = [(n, f) for n, f in cands if "gemm" in n or "dot" in n] or cands
  if k == "jax_paged_attention":
    cands = [(n, f) for n, f in cands if "attention" in n] or cands
  if not cands:
    return None
  return max(cands, key=lambda nf: (nf[1].get("grid") or [0])[0] * ((nf[1].get("grid") or [1, 1])[1]))


def judge_perf(spec: dict, model: dict | None, copy_baseline: dict | None = None) -> str | None:
  """Why a perf result fails the gate: a rule broken, or a target missed by the model's
  pessimistic (high-latency) estimate. Sanity specs fail when the model contradicts what is
  known (XLA's copy under ``COPY_SANITY`` of the bandwidth)."""
  if model is None:
    return "no estimate (kernel not found in the compile)"
  if spec["purpose"] == "perf_baseline":
    return None
  if spec["purpose"] == "perf_rule_check":
    missed = [e for e in spec["expect"] if not any(e in r for r in model["rules"])]
    return f"the variant {spec['variant']} should break the {missed} rule(s) but does not" if missed else None
  if spec["purpose"] == "perf_sanity":
    if spec["kernel"] == "xla_copy" and model["fraction"][0] < COPY_SANITY:
      return (f"the model rates XLA's copy at {model['fraction'][0]:.0%} of the bandwidth (< {COPY_SANITY:.0%}): "
              "the model is wrong")
    return None
  if model["rules"]:
    return "; ".join(model["rules"])
  target = TARGETS[spec["kernel"]]
  if spec["kernel"] == "copy_blocks":
    if copy_baseline is None:
      return None
    ratio = copy_baseline["high_us"] / model["high_us"]
    model["vs_plain_copy"] = round(ratio, 3)
    if ratio < target:
      return f"{ratio:.0%} of XLA's copy of the same bytes by the model (target {target:.0%})"
    return None
  if not model.get("memory_bound", True):
    # Compute-bound: no kernel reaches the data-sheet peak; judged against the MMA's best.
    if model["attainable_fraction"] < target:
      return (f"compute-bound at {model['attainable_fraction']:.0%} of what its MMA attains by the model "
              f"(target {target:.0%})")
    return None
  if model["fraction"][0] < target:
    return f"{model['fraction'][0]:.0%} of the roofline by the model (target {target:.0%})"
  return None


@dataclasses.dataclass(frozen=True)
class StepSum:
  """A whole decode step by the model: its kernels' estimates, launch gaps, and roofline."""

  low_s: float
  high_s: float
  roofline_s: float
  parts: dict

  def as_dict(self) -> dict:
    return {"low_ms": round(self.low_s * 1e3, 3), "high_ms": round(self.high_s * 1e3, 3),
            "roofline_ms": round(self.roofline_s * 1e3, 3),
            "fraction": [round(self.roofline_s / self.high_s, 3), round(self.roofline_s / self.low_s, 3)],
            "parts_ms": {k: [round(v[0] * 1e3, 3), round(v[1] * 1e3, 3)] for k, v in self.parts.items()}}


def library_gemm(m: int, k: int, n: int, gpu: perf_model.Gpu, itemsize: int = 2) -> tuple[float, float]:
  """(low, high) seconds of a tuned library GEMM (cuBLAS or XLA's autotuned Triton GEMM on a GPU):
  ``gpu.gemm_efficiency`` of the bandwidth or of the dense peak, whichever binds. An assumption,
  not a compile fact: without a GPU XLA cannot autotune its GEMMs (``xla_gemm`` sanity rows)."""
  nbytes = (m * k + k * n + m * n) * itemsize
  lo, hi = gpu.gemm_efficiency
  t = max(nbytes / gpu.bandwidth, 2 * m * k * n / gpu.dense_flops)
  return t / hi, t / lo


def decode_step(model: str, batch: int, context: int, layout: str, estimates: dict, launches: int,
                gpu: perf_model.Gpu) -> StepSum:
  """A decode step of ``model`` (every layer) at ``batch`` sequences of ``context`` tokens in one
  of the two single-GPU layouts: "stacked" (the scan, projections by ``layer_matmul``: their
  estimates at M = batch from ``estimates``) or "per_layer" (unrolled, XLA's GEMMs:
  ``library_gemm``). Attention is the decode kernel's estimate at (batch, context); the LM head
  is a library GEMM in both; ``launches`` kernels add a launch gap each."""
  c = MODELS[model]
  parts = {}
  proj = [0.0, 0.0]
  for name, k, n, _ in projections(model):
    if layout == "stacked":
      e = estimates[("layer_matmul", model, name, batch)]
      t = (e["low_us"] * 1e-6, e["high_us"] * 1e-6)
    else:
      t = library_gemm(batch, k, n, gpu)
    proj[0] += t[0] * c["layers"]
    proj[1] += t[1] * c["layers"]
  parts["projections"] = tuple(proj)
  a = estimates[("decode", batch, context)]
  parts["attention"] = (a["low_us"] * 1e-6 * c["layers"], a["high_us"] * 1e-6 * c["layers"])
  parts["lm_head"] = library_gemm(batch, c["d"], c["vocab"], gpu)
  parts["launch_gaps"] = (launches * gpu.launch_s[0], launches * gpu.launch_s[1])
  low = sum(p[0] for p in parts.values())
  high = sum(p[1] for p in parts.values())
  weights = c["layers"] * sum(k * n for _, k, n, _ in projections(model)) * 2 + c["d"] * c["vocab"] * 2
  kv = c["layers"] * batch * context * c["kv_heads"] * c["head_dim"] * 2 * 2
  return StepSum(low, high, (weights + kv) / gpu.bandwidth, parts)


def perf_groups() -> list[list[dict]]:
  """Work units for the gate's workers: one per kernel kind (the sanity checks apart)."""
  groups: dict[str, list[dict]] = {}
  for s in perf_specs():
    groups.setdefault(s["kernel"], []).append(s)
  return sorted(groups.values(), key=len, reverse=True)


def copy_baseline(spec: dict, results: list[dict]) -> dict | None:
  """The model's estimate of XLA's own copy of the bytes a ``copy_blocks`` spec moves (None for
  other specs, or when that sanity row did not compile)."""
  if spec["kernel"] != "copy_blocks":
    return None
  nbytes = spec["copies"] * copy_block_bytes(spec["model"], spec["layers"])
  for r in results:
    s = r["spec"]
    if s["kernel"] == "xla_copy" and s["bytes"] == nbytes and r.get("model"):
      return r["model"]
  return None


# The single-GPU layouts the engines can run (``paged_kv.models.layer_layout.layout_for_impl``), and the
# one they pick today with the Pallas kernels; the gate fails when the model says the other is
# faster at a named decode shape.
LAYOUTS = ("stacked", "per_layer")
ENGINE_LAYOUT_ON_ONE_GPU = "stacked"
LAYOUT_SHAPES = ((64, 4096), (256, 1024), (1, 32_768))


def layout_decision(perf_results: list[dict], program_results: list[dict]) -> dict:
  """Both single-GPU layouts of the 8B decode step at ``LAYOUT_SHAPES`` by the model, the faster
  one and its margin, and each layout's whole program as compiled (kernels per step, compile
  seconds) where the gate compiled it."""
  est = _estimates(perf_results)
  progs = {r["program"]: r for r in program_results if r.get("status") == "compiled"}
  compiled = {}
  for layout, name in (("stacked", "serving_step_decode"), ("per_layer", "serving_step_decode_per_layer")):
    r = progs.get(name)
    if r:
      compiled[layout] = {"program": name, "compile_s": r.get("compile_s"),
                          "kernels_per_step": r["per_step"]["least"]["kernels"]}
  gpu = perf_model.GPUS["sm_90"]
  shapes = []
  for batch, context in LAYOUT_SHAPES:
    sums = {}
    for layout in LAYOUTS:
      launches = compiled.get(layout, compiled.get("stacked", {})).get("kernels_per_step", 0)
      try:
        sums[layout] = decode_step("llama3.1-8b", batch, context, layout, est, launches, gpu)
      except KeyError:
        sums = {}
        break
    if not sums:
      continue
    mid = {k: (v.low_s + v.high_s) / 2 for k, v in sums.items()}
    faster = min(mid, key=mid.get)
    other = next(k for k in LAYOUTS if k != faster)
    shapes.append({"batch": batch, "context": context, "faster": faster,
                   "margin": round(mid[other] / mid[faster], 3),
                   **{k: v.as_dict() for k, v in sums.items()}})
  # Over the named shapes together: the geometric mean of each layout's time relative to the
  # other (one engine layout serves every shape; a per-shape margin is in each row).
  faster, margin = None, None
  if shapes:
    ratio = 1.0
    for x in shapes:
      r = x["margin"] if x["faster"] == "stacked" else 1 / x["margin"]
      ratio *= r ** (1 / len(shapes))
    faster, margin = ("stacked", ratio) if ratio >= 1 else ("per_layer", 1 / ratio)
  return {"model": "llama3.1-8b", "engine_layout": ENGINE_LAYOUT_ON_ONE_GPU, "shapes": shapes,
          "compiled": compiled, "faster": faster, "margin": None if margin is None else round(margin, 3),
          "agrees": faster == ENGINE_LAYOUT_ON_ONE_GPU}


# The whole programs the gate compiles at Llama 3.1 8B shapes, with the layout each runs and the
# decode shape of one of its steps (64 sequences at the 4k context; generate's 16 prompts x 4
# samples are 64 rows too).
PROGRAM_SHAPES = {"serving_step_decode": ("stacked", 64, 4096), "generate_loop": ("stacked", 64, 4096),
                  "serving_step_decode_per_layer": ("per_layer", 64, 4096)}


def program_sums(perf_results: list[dict], program_results: list[dict]) -> dict:
  """Per compiled decode program: one step by the model (``decode_step``: its kernels'
  estimates, plus a launch gap for each kernel the compiled step runs) against the step's
  roofline (every weight and the K/V read once, over the bandwidth)."""
  est = _estimates(perf_results)
  gpu = perf_model.GPUS["sm_90"]
  out = {}
  for r in program_results:
    if r.get("status") != "compiled" or r.get("layers") != 32 or r["program"] not in PROGRAM_SHAPES:
      continue
    layout, batch, context = PROGRAM_SHAPES[r["program"]]
    kernels = r["per_step"]["least"]["kernels"]
    try:
      step = decode_step("llama3.1-8b", batch, context, layout, est, kernels, gpu)
    except KeyError:
      continue
    out[r["program"]] = dict(layout=layout, batch=batch, context=context, kernels_per_step=kernels, **step.as_dict())
  return out


def _estimates(perf_results: list[dict]) -> dict:
  est = {}
  for r in perf_results:
    s, m = r["spec"], r.get("model")
    if not m or s["purpose"] != "perf":
      continue
    if s["kernel"] == "layer_matmul":
      est[("layer_matmul", s["model"], s["proj"], s["m"])] = m
    elif s["kernel"] == "decode" and not s.get("window") and not s.get("kv_dtype"):
      # the Llama steps attend over everything, on bf16 pages
      est[("decode", s["batch"], s["context"])] = m
  return est
