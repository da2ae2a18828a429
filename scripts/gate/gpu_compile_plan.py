"""The GPU compile gate's plan and verdicts (``scripts/gate/gpu_compile.py`` runs it): the target GPUs,
the kernel configurations to compile, how identical kernels are recognised, and what fails.

Plain Python (no JAX import at module level), so ``tests/test_gpu_report.py`` checks it on any
machine; the tiling table is read from :mod:`paged_kv.pallas_kernels.tiling`.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from typing import TYPE_CHECKING

from scripts.gate import perf_model

if TYPE_CHECKING:  # annotations only: the module imports no JAX (module docstring)
  from paged_kv.pallas_kernels import tiling

# ------------------------------------------------------------------------------ targets
_TARGET = """gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: {smem_optin}
  shared_memory_per_core: {smem_core}
  threads_per_core_limit: 2048
  core_count: {sms}
  fpus_per_core: {fpus}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {bandwidth}
  l2_cache_size: {l2}
  clock_rate_ghz: {clock}
  device_memory_size: {memory}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability {{
    major: {major}
    minor: 0
  }}
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 8
}}
runtime_version {{
  major: 12
  minor: 9
}}
device_description_str: "{name}"
"""

# Public figures: H200 (sm_90, 132 SMs, 141 GB HBM3e at 4.8 TB/s, 227 KiB opt-in shared memory
# per block; stated once in pallas_kernels/gpu_figures.py) and A100 80 GB (sm_80, 108 SMs,
# 2.0 TB/s, 163 KiB opt-in).
_H200 = perf_model.FIGURES
TARGETS = {
    "sm_90": dict(name=_H200.H200_NAME, major=9, smem_optin=_H200.H200_SMEM_OPTIN, smem_core=_H200.H200_SMEM_PER_SM,
                  sms=_H200.H200_SMS, fpus=_H200.H200_FP32_PER_SM, bandwidth=int(_H200.H200_BANDWIDTH),
                  l2=_H200.H200_L2_BYTES, clock=_H200.H200_CLOCK_GHZ, memory=_H200.H200_MEMORY_BYTES),
    "sm_80": dict(name="NVIDIA A100-SXM4-80GB", major=8, smem_optin=166_912, smem_core=167_936,
                  sms=108, fpus=64, bandwidth=2_039_000_000_000, l2=41_943_040, clock=1.41,
                  memory=85_899_345_920),
}
H200_BANDWIDTH = TARGETS["sm_90"]["bandwidth"]


def target_config(target: str) -> str:
  return _TARGET.format(**TARGETS[target])


_GRID_ATTR = re.compile(r"grid_[xyz] = \d+ : i32,?\s*")


def triton_key(lowered_text: str) -> str:
  """Hash of every Triton call's kernel (IR, name, warps, stages) without its grid: two
  programs with the same key run the same compiled kernels, only on different grids."""
  calls = re.findall(r"custom_call @__gpu\$xla\.gpu\.triton\([^)]*\)\s*\{[^\n]*?mhlo\.backend_config = "
                     r"(\{[^\n]*?\})\s*[,}]", lowered_text)
  h = hashlib.sha256()
  for c in calls:
    h.update(_GRID_ATTR.sub("", c).encode())
  return h.hexdigest()[:16]


SIZES = {
    # name: (batch, context tokens, prefill tokens, write/copy rows)
    "small": (1, 256, 16, 1),
    "large": (64, 4096, 2048, 256),
}
KV_HEADS = 8


# ------------------------------------------------------------------------------ the matrix
DTYPES = ("bfloat16", "float16", "float32")
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32)
GROUPS = (1, 4, 8)
KERNELS = ("decode", "prefill", "write_kv", "copy_blocks")


def kernel_specs(quick: bool) -> list[dict]:
  """Every kernel configuration the gate lowers, each with its ``purpose``: the sm_90 matrix,
  the smaller sm_80 matrix, the tiling table's rows (at their largest accepted block, a whole
  tile, at its smallest accepted block and at block size 16; decode at its largest accepted GQA
  group, prefill at GQA 8; on both targets) and the refusals the table promises (twice the
  largest block; for decode also twice the largest group)."""
  from paged_kv.pallas_kernels import tiling
  sizes = ("large",) if quick else ("small", "large")
  specs = [dict(target="sm_90", kernel=k, dtype=dt, head_dim=d, block_size=bs, group=g, size=s, purpose="matrix")
           for k, dt, d, bs, g, s in itertools.product(KERNELS, DTYPES, HEAD_DIMS, BLOCK_SIZES, GROUPS, sizes)]
  specs += [dict(target="sm_80", kernel=k, dtype=dt, head_dim=d, block_size=16, group=8, size="large",
                 purpose="sm_80")
            for k, dt, d in itertools.product(KERNELS, DTYPES, HEAD_DIMS)]
  for kernel, dt, d, row in tiling.all_rows():
    # Decode: the largest accepted GQA group (a whole group per program); prefill folds any
    # group into its rows.
    g = row.rows_per_tile if kernel == "decode" else 8
    for target in ("sm_90", "sm_80"):
      for bs in sorted({row.min_block_size, 16, row.keys_per_tile}):
        specs.append(dict(target=target, kernel=kernel, dtype=dt, head_dim=d, block_size=bs, group=g,
                          size="large", purpose="table_row"))
    specs.append(dict(target="sm_90", kernel=kernel, dtype=dt, head_dim=d, block_size=2 * row.keys_per_tile,
                      group=8, size="small", purpose="table_refusal"))
    if kernel == "decode":
      specs.append(dict(target="sm_90", kernel=kernel, dtype=dt, head_dim=d, block_size=16, group=2 * g,
                        size="small", purpose="table_refusal"))
    if row.min_block_size > 1:
      specs.append(dict(target="sm_90", kernel=kernel, dtype=dt, head_dim=d, block_size=row.min_block_size // 2,
                        group=8, size="small", purpose="table_refusal"))
  specs += knob_specs()
  specs += matmul_specs(quick)
  specs += invariant_specs()
  specs += quant_specs()
  specs += plan_refusal_specs()
  return specs


# ------------------------------------------------------------------------------ the execution plan
# The gate compiles what the execution plan (paged_kv.pallas_kernels.plan) runs on a GPU: every
# combination of its switches the attention kernels see (target, KV dtype, batch-invariant mode,
# attention kind) that the plan accepts has configurations above of the kernel family the plan
# names (tests/test_gpu_report.py checks it), and every combination the plan refuses has one
# configuration that must be refused before tracing (purpose plan_refusal / quant_refusal), which
# costs no compilation.
PLAN_TARGETS = ("sm_90", "sm_80")
PLAN_KV_DTYPES = (None, "int8", "float8_e4m3fn")
PLAN_KINDS = ("full", "window")


def spec_switches(spec: dict) -> dict:
  """The execution plan's switches of a kernel configuration (``plan.make_plan``'s arguments)."""
  knob = KNOBS.get(spec.get("knob"), {}) if spec.get("knob") else {}
  return dict(target=spec["target"], batch_invariant=spec["kernel"] == "invariant_attention" or bool(
      spec.get("invariant")), kv_dtype=spec.get("kv_dtype"), kinds=("window",) if knob.get("window") else ("full",),
      head_dim=spec.get("head_dim"), block_size=spec.get("block_size"))


def plan_refusal(spec: dict) -> tuple[str, str] | None:
  """``(row, message)`` when the execution plan refuses a configuration (``impl="pallas"``), else None."""
  from paged_kv.pallas_kernels import plan
  return plan.refusal("pallas", **spec_switches(spec))


def plan_combinations() -> list[dict]:
  """Every combination of the plan's switches the attention kernels see, with the plan's verdict:
  ``row`` (the deciding row), ``attention`` ("paged" / "invariant", or None when refused)."""
  from paged_kv.pallas_kernels import plan
  out = []
  for target, kv, inv, kind in itertools.product(PLAN_TARGETS, PLAN_KV_DTYPES, (False, True), PLAN_KINDS):
    sw = dict(target=target, kv_dtype=kv, batch_invariant=inv, kinds=(kind,))
    refused = plan.refusal("pallas", **sw)
    attention = None if refused else plan.make_plan("pallas", **sw).attention
    out.append(dict(sw, row=refused[0] if refused else plan.make_plan("pallas", **sw).row, attention=attention))
  return out


def plan_refusal_specs() -> list[dict]:
  """One configuration per combination the plan refuses that no other list already checks: the
  batch-invariant kernel on quantized pages (both targets, both kinds)."""
  specs = []
  for c in plan_combinations():
    if c["attention"] is None and c["batch_invariant"]:
      specs.append(dict(target=c["target"], kernel="invariant_attention", dtype="bfloat16", kv_dtype=c["kv_dtype"],
                        head_dim=128, block_size=16, group=4, size="small", form="prefill",
                        purpose="plan_refusal", **({"knob": "window"} if c["kinds"] == ("window",) else {})))
  return specs


# Quantized KV pages (issue 32, paged_kv.pallas_kernels.quant): int8 / float8_e4m3fn values with a
# float32 scale per token and KV head, read by the attention kernels (each tile converted to the
# compute dtype for the dots, the scales two more [keys] gathers per tile), written by write_kv
# (values and scales aliased) and copied by copy_blocks (scales beside the values). What can
# change the compiled kernel: the storage dtype, the compute dtype, head_dim, block size, the knobs
# (which add score operations next to the K scale), the target. sm_90: both storage dtypes, every
# kernel, every head dim at block 16 in bfloat16, the tiling rows' block extremes (8, 32) at head
# dim 128, float16 and float32 compute once, soft_cap+window (Gemma 2's pair) on the attention
# kernels. sm_80: int8 on every kernel and head dim; float8_e4m3fn there is refused before tracing
# (Triton converts e4m3 only from compute capability 8.9), which costs no compilation.
QUANT_KV_DTYPES = ("int8", "float8_e4m3fn")
QUANT_HEAD_DIMS = (64, 128, 256)


def quant_specs() -> list[dict]:
  """The quantized-page configurations (comment above): ``kv_dtype`` is the pages' storage dtype,
  ``dtype`` the compute dtype (q, and k/v before ``write_kv`` quantizes them); purpose ``quant``,
  and ``quant_refusal`` for float8_e4m3fn on sm_80."""
  base = dict(purpose="quant", size="large", group=8)
  specs = [dict(base, target="sm_90", kernel=k, dtype="bfloat16", kv_dtype=kv, head_dim=d, block_size=16)
           for k, kv, d in itertools.product(KERNELS, QUANT_KV_DTYPES, QUANT_HEAD_DIMS)]
  specs += [dict(base, target="sm_90", kernel=k, dtype="bfloat16", kv_dtype=kv, head_dim=128, block_size=bs)
            for k, kv, bs in itertools.product(("decode", "prefill"), QUANT_KV_DTYPES, (8, 32))]
  specs += [dict(base, target="sm_90", kernel=k, dtype=dt, kv_dtype=kv, head_dim=128, block_size=16)
            for k, dt, kv in itertools.product(("decode", "prefill"), ("float16", "float32"), QUANT_KV_DTYPES)]
  specs += [dict(base, target="sm_90", kernel=k, dtype="bfloat16", kv_dtype=kv, head_dim=d, block_size=16,
                 knob="soft_cap+window")
            for k, kv, d in itertools.product(("decode", "prefill"), QUANT_KV_DTYPES, (128, 256))]
  specs += [dict(base, target="sm_80", kernel=k, dtype="bfloat16", kv_dtype="int8", head_dim=d, block_size=16)
            for k, d in itertools.product(KERNELS, QUANT_HEAD_DIMS)]
  specs += [dict(base, target="sm_80", kernel=k, dtype="bfloat16", kv_dtype=kv, head_dim=128, block_size=16,
                 knob="soft_cap+window") for k, kv in itertools.product(("decode", "prefill"), QUANT_KV_DTYPES)]
  # float8_e4m3fn on sm_80: what the execution plan says (its fp8_target row: refused before tracing).
  specs += [dict(base, target="sm_80", kernel=k, dtype="bfloat16", kv_dtype="float8_e4m3fn", head_dim=128,
                 block_size=16) for k in KERNELS]
  for spec in specs:
    if plan_refusal(spec) is not None:
      spec["purpose"] = "quant_refusal"
  return specs


# Batch-invariant mode (docs/batch_invariance.md): one attention kernel for prefill and decode
# (paged_kv.pallas_kernels.invariant_attention: 16 query rows, a key step from head_dim and
# dtype) and layer_matmul's fixed plan (64 rows, no split). What can change the compiled kernel:
# dtype, head_dim, block size (above the key step), the knobs, the target; for the matmul the
# plan (from K and N only), the prologue/epilogue and the target. Not the batch, the tokens or M
# (the grid): the decode and prefill forms of one configuration must compile to the same kernel.
INVARIANT_HEAD_DIMS = (64, 128, 256)


def invariant_specs() -> list[dict]:
  """``invariant_attention`` on sm_90 (every dtype x head dim, block size 16, decode and prefill
  forms; bfloat16 at block sizes 8 and 32 and with soft_cap+alibi) and sm_80 (bfloat16, every
  head dim, plain and soft_cap+alibi); ``layer_matmul`` with ``batch_invariant`` on the 8B and 1B
  shapes and groups (sm_90 bfloat16, one shape per other dtype; sm_80 bfloat16 1B)."""
  base = dict(kernel="invariant_attention", purpose="invariant", size="large", group=4)
  specs = []
  for dt, d in itertools.product(DTYPES, INVARIANT_HEAD_DIMS):
    specs += [dict(base, target="sm_90", dtype=dt, head_dim=d, block_size=16, form=f) for f in ("decode", "prefill")]
  for d in INVARIANT_HEAD_DIMS:
    specs += [dict(base, target="sm_90", dtype="bfloat16", head_dim=d, block_size=16, form="prefill",
                   knob="soft_cap+alibi")]
    specs += [dict(base, target="sm_80", dtype="bfloat16", head_dim=d, block_size=16, form="prefill", knob=knob)
              for knob in (None, "soft_cap+alibi")]
  specs += [dict(base, target="sm_90", dtype="bfloat16", head_dim=128, block_size=bs, form="decode")
            for bs in (8, 32)]
  # A sliding window (the plan's "window" kind; an int32 operand of the same kernel) on both targets.
  specs += [dict(base, target=t, dtype="bfloat16", head_dim=128, block_size=16, form="prefill", knob="window")
            for t in PLAN_TARGETS]
  mm = dict(kernel="layer_matmul", purpose="invariant", invariant=True)
  specs += [dict(mm, target="sm_90", dtype="bfloat16", m=m, k=k, n=n, extras="scale" if k in (4096, 2048) else "none")
            for (k, n), m in itertools.product(MATMUL_SHAPES + MATMUL_SHAPES_1B, (1, 64))]
  specs += [dict(mm, target="sm_90", dtype="bfloat16", m=8, k=k, n=sum(ns), group=list(ns), extras="scale")
            for k, ns in MATMUL_GROUPS + MATMUL_GROUPS_1B]
  specs += [dict(mm, target="sm_90", dtype=dt, m=8, k=4096, n=4096, extras="scale+bias") for dt in DTYPES]
  specs += [dict(mm, target="sm_80", dtype="bfloat16", m=8, k=k, n=n, extras="scale" if k == 2048 else "none")
            for k, n in MATMUL_SHAPES_1B]
  return specs


# The stacked-weight matmul the scan over layers runs on one GPU (paged_kv.pallas_kernels.layer_matmul):
# Llama 3.1 8B's projections as (K, N) (q/o, k/v, gate/up, down) at a decode step's rows (1, 8
# and the whole programs' 64), a prefill chunk's (256, 512), with the input norm's weight in the
# prologue where the model puts it (K = d: q/k/v and gate/up) and a bias epilogue once; Llama
# 3.2 1B's (d 2048, k/v 512, intermediate 8192) in bfloat16. What can change the kernel: dtype,
# the plan (tiles, split of K, pipeline depth: from M, K, N), the prologue/epilogue, the target;
# not L.
MATMUL_SHAPES = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))
MATMUL_SHAPES_1B = ((2048, 2048), (2048, 512), (2048, 8192), (8192, 2048))
# The groups the model launches as one kernel each on the in-place path, as (K, widths): q|k|v
# and gate|up.
MATMUL_GROUPS = ((4096, (4096, 1024, 1024)), (4096, (14336, 14336)))
MATMUL_GROUPS_1B = ((2048, (2048, 512, 512)), (2048, (8192, 8192)))
MATMUL_ROWS = (1, 8, 64, 256, 512)
MATMUL_LAYERS = 32


def matmul_specs(quick: bool) -> list[dict]:
  """``layer_matmul`` configurations: sm_90 every dtype x 8B shape x rows (only 64 rows when
  ``quick``) and the 1B shapes in bfloat16, the bias epilogue, sm_80 in bfloat16 at 64 rows, and
  the refusal of a K that is not a multiple of 16. The grouped launches the model runs (q|k|v,
  gate|up: a ``group`` of widths, ``n`` their sum) likewise: sm_90 every dtype x 8B group x rows
  and the 1B groups in bfloat16, a bias per weight, sm_80 in bfloat16 at 64 rows."""
  rows = (64,) if quick else MATMUL_ROWS
  base = dict(kernel="layer_matmul", purpose="matmul")

  def extras(k):
    return "scale" if k in (4096, 2048) else "none"

  def group(k, ns):
    return dict(k=k, n=sum(ns), group=list(ns), extras="scale")
  specs = [dict(base, target="sm_90", dtype=dt, m=m, k=k, n=n, extras=extras(k))
           for dt, (k, n), m in itertools.product(DTYPES, MATMUL_SHAPES, rows)]
  specs += [dict(base, target="sm_90", dtype="bfloat16", m=m, k=k, n=n, extras=extras(k))
            for (k, n), m in itertools.product(MATMUL_SHAPES_1B, rows)]
  specs += [dict(base, target="sm_90", dtype=dt, m=64, k=4096, n=4096, extras="scale+bias") for dt in DTYPES]
  specs += [dict(base, target="sm_80", dtype="bfloat16", m=64, k=k, n=n, extras=extras(k))
            for k, n in MATMUL_SHAPES + MATMUL_SHAPES_1B]
  specs += [dict(base, target="sm_90", dtype=dt, m=m, **group(k, ns))
            for dt, (k, ns), m in itertools.product(DTYPES, MATMUL_GROUPS, rows)]
  specs += [dict(base, target="sm_90", dtype="bfloat16", m=m, **group(k, ns))
            for (k, ns), m in itertools.product(MATMUL_GROUPS_1B, rows)]
  specs += [dict(base, target="sm_90", dtype=dt, m=64, **dict(group(*MATMUL_GROUPS[0]), extras="scale+bias"))
            for dt in DTYPES]
  specs += [dict(base, target="sm_80", dtype="bfloat16", m=64, **group(k, ns))
            for k, ns in MATMUL_GROUPS + MATMUL_GROUPS_1B]
  specs.append(dict(base, target="sm_90", dtype="bfloat16", m=1, k=4100, n=4096, extras="none",
                    purpose="table_refusal"))
  return specs


# The attention knobs (issue 18) add code to the score path: soft-capping a tanh per score,
# ALiBi one more kernel input and a multiply-add per score. Both can add registers to tiles that
# already sit at the 255-register limit, so the gate compiles them on the tiling table's rows.
# What can change the compiled kernel: the knob (the cap's value is a constant folded into the
# same code; the slopes are an input), dtype, head_dim, the row's tile (its smallest accepted
# block, the widest gather; block size 16; its largest block, a whole tile), the decode group
# (the row's largest, which sets the rows per program), the target. Not the batch or context
# (the grid), so one (large) size; not head_dim 16/32 (the smallest accumulators, far below the
# register limit). The refusals of the knob's row are checked too (the input checks must see
# the knobs), which costs no compilation. A sliding window (issue 31) is one more int32 operand,
# a second loop bound and a lower bound in the mask; its value is an operand, so one window (the
# split rule sizes the decode launch for a static one) stands for all, and Gemma 2 puts it beside
# the soft cap.
KNOBS = {"soft_cap": dict(soft_cap=50.0), "alibi": dict(alibi=True),
         "soft_cap+alibi": dict(soft_cap=50.0, alibi=True), "window": dict(window=1024),
         "soft_cap+window": dict(soft_cap=50.0, window=1024)}
KNOB_HEAD_DIMS = (64, 128, 256)


def knob_specs() -> list[dict]:
  """Decode and prefill with each knob set on the table rows at ``KNOB_HEAD_DIMS``, both targets."""
  from paged_kv.pallas_kernels import tiling
  specs = []
  for kernel, dt, d, _row in tiling.all_rows():
    if d not in KNOB_HEAD_DIMS:
      continue
    for knob in KNOBS:
      # The row for this knob (tiles may shrink when a knob is on).
      row_k = tiling.table_row(kernel, dt, d, knobs=knob_facts(knob))
      g = row_k.rows_per_tile if kernel == "decode" else 8
      for target in ("sm_90", "sm_80"):
        for bs in sorted({row_k.min_block_size, 16, row_k.keys_per_tile}):
          specs.append(dict(target=target, kernel=kernel, dtype=dt, head_dim=d, block_size=bs, group=g,
                            size="large", purpose="knob_row", knob=knob))
      refuse = [2 * row_k.keys_per_tile] + ([row_k.min_block_size // 2] if row_k.min_block_size > 1 else [])
      specs += [dict(target="sm_90", kernel=kernel, dtype=dt, head_dim=d, block_size=bs, group=8, size="small",
                     purpose="table_refusal", knob=knob) for bs in refuse]
      if kernel == "decode":
        specs.append(dict(target="sm_90", kernel=kernel, dtype=dt, head_dim=d, block_size=16, group=2 * g,
                          size="small", purpose="table_refusal", knob=knob))
  return specs


def knob_facts(knob: str | None) -> tiling.Knobs:
  """The tiling table's view of a knob name (``KNOBS`` key or None)."""
  from paged_kv.pallas_kernels import tiling
  kw = KNOBS.get(knob, {}) if knob else {}
  return tiling.Knobs(soft_cap=kw.get("soft_cap") is not None, alibi=bool(kw.get("alibi")),
                      window=kw.get("window") is not None)


def kernel_groups(quick: bool, knobs: list[str] | None = None) -> list[list[dict]]:
  """Work units for the workers: the configurations of one (target, kernel, dtype, head_dim,
  block size; for ``layer_matmul`` one (target, dtype)), so configurations that may share a
  kernel (other GQA groups, sizes, purposes) meet in one worker, which compiles each distinct
  kernel once. Largest groups first. ``knobs``: only the configurations with one of these
  ``KNOBS`` names (a partial run, e.g. after a change to one knob's code)."""
  groups: dict[tuple, list[dict]] = {}
  for s in kernel_specs(quick):
    if knobs is not None and s.get("knob") not in knobs:
      continue
    groups.setdefault((s["target"], s["kernel"], s["dtype"], s.get("head_dim"), s.get("block_size")), []).append(s)
  order = {"prefill": 0, "decode": 1, "invariant_attention": 2, "layer_matmul": 3, "copy_blocks": 4, "write_kv": 5}
  return sorted(groups.values(), key=lambda g: (order[g[0]["kernel"]], -len(g)))


PROGRAMS = [("sm_90", "tp1", n) for n in ("serving_step_decode", "serving_step_decode_per_layer",
                                          "serving_step_prefill", "generate_loop",
                                          "beam_search_loop", "admit", "append", "free",
                                          "serving_manager_share")] + [
    ("sm_90", "tp2", "serving_step_decode_tp2")]


# The names the project's Pallas kernels compile to (their ``pallas_call`` names); every other
# kernel in a compiled program is one of XLA's own fusions.
PALLAS_KERNELS = ("paged_decode_attention", "paged_prefill_attention", "paged_invariant_attention", "write_kv",
                  "copy_blocks", "layer_matmul")  # also write_kv_quant, copy_blocks_quant (prefixes)


def is_pallas_kernel(name: str) -> bool:
  return name.startswith(PALLAS_KERNELS)


def xla_fusion_spills(res: dict) -> dict[str, int]:
  """Spill bytes in XLA's own fusions of a compiled result: reported, not failed (their code is
  XLA's emitters', not a tile the project chose)."""
  return {k: v for k, v in (res.get("spills") or {}).items() if v and not is_pallas_kernel(k)}


def judge(res: dict) -> str | None:
  """Why a result fails the gate, or None."""
  spec = res.get("spec", {})
  purpose = spec.get("purpose")
  status = res.get("status")
  if purpose in ("table_refusal", "quant_refusal", "plan_refusal"):
    return None if status == "refused" else f"expected a ValueError refusal, got {status}"
  if status in ("same_kernel_as",):
    return None
  if status == "refused":
    return f"refused by the input checks: {res.get('error')}"
  if status != "compiled":
    return f"{status}: {res.get('error', '')[:300]}"
  own = {k: v for k, v in (res.get("spills") or {}).items() if v and is_pallas_kernel(k)}
  if own:
    return f"register spills {own}"
  if res.get("weight_or_page_copies"):
    return f"copies of weights or pages every step: {res['weight_or_page_copies'][:3]}"
  if not res.get("deviceless"):
    return "XLA did not report a deviceless compilation"
  return None
