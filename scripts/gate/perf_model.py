"""A static performance model of the GPU kernels, read from their deviceless compile.

No GPU is needed to see most of what makes a memory-bound kernel slow: how many CTAs the grid
launches against the SMs that could hold them, and how many bytes each CTA keeps in flight while
it waits on DRAM. This module turns those compile facts (the grid, registers and shared memory
from ``ptxas`` and the thunk sequence, the pipeline depth from the PTX) and the bytes and FLOPs a
kernel must move at a given shape into an *estimated* time, with a low and a high bound, and the
fraction of the roofline it implies. Every figure it produces is an estimate under the
assumptions of :class:`Gpu` (written down once, here), not a measurement:
``scripts/gpu_check.sh`` measures the same figures on a GPU when one is lent.

The model (Little's law, ``../shared/GPU_PERF_MODEL.md`` has the method):

* **Residency**: CTAs per SM are limited by registers (65,536 per SM, allocated per warp in
  units of 256), shared memory (the per-SM capacity, with 1 KB reserved per CTA), threads
  (2,048 per SM) and 32 CTAs per SM. ``slots = SMs x resident``.
* **Memory in flight per CTA** = ``stages x bytes per stage``. ``stages`` comes from the PTX of
  the main loop: with ``cp.async``, ``wait_group N`` at the loop top and ``g`` commit groups per
  iteration keep ``N / g + 1`` stages in flight (``N = 0``: one tile, and no load overlaps the
  compute). A loop of plain ``ld.global`` whose data is used in the same iteration keeps one.
  ``bytes per stage`` is the tile the CTA streams per step (from the shape and the tiles).
* **Per-CTA time** = ``steps x step time``. Step time, when the next stage is issued before
  the current one is waited for (``N > 0``): ``max(latency / stages, compute per step)``;
  otherwise ``latency + compute per step`` (the round trip and the math do not overlap).
* **Waves**: CTAs run ``slots`` at a time. A wave of ``k`` CTAs takes
  ``max(k x bytes per CTA / achievable bandwidth, per-CTA time)``; the kernel is the sum over
  its full waves and its tail, and never less than ``FLOPs / (peak x efficiency of its MMA)``.
* **Roofline** = ``max(bytes that must move / peak bandwidth, FLOPs / dense peak)``. The bytes
  that must move exclude partial results a kernel writes and reads back (a split's partials)
  and re-reads: those cost time, not roofline.
* **Attainable** = ``max(bytes / achievable bandwidth, FLOPs / (dense peak x the MMA's best
  efficiency))``: the best any kernel with that MMA family could do under these assumptions. A
  compute-bound kernel (the FLOPs term of the attainable time the larger) is
  judged by its fraction of this, since no Triton kernel reaches the data-sheet peak; a kernel is
  memory-bound when the bytes term of the attainable time is the larger.
* **Low / high** are the two ends of the DRAM round-trip range (and of the MMA efficiency).

Plain Python (no JAX import), so ``tests/test_perf_model.py`` checks it on any machine.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
from pathlib import Path


# ------------------------------------------------------------------------------ assumptions
@dataclasses.dataclass(frozen=True)
class Gpu:
  """Every assumption of the model, for one GPU. Public figures, not measurements here.

  Attributes:
    name: what the figures describe.
    sms: streaming multiprocessors.
    bandwidth: peak HBM bandwidth, bytes/s (the roofline's).
    achievable: the fraction of ``bandwidth`` a streaming kernel sustains at best (STREAM-like
      copies on H100/A100 reach about 90-93 % of the data-sheet figure).
    latency_s: DRAM round trip under load, low and high (public microbenchmarks quote about
      0.3-0.6 us unloaded on H100; loaded latency is higher).
    regs_per_sm, smem_per_sm, threads_per_sm, max_ctas_per_sm: the residency limits.
    smem_reserved_per_cta: shared memory the driver reserves per CTA (1 KB on sm_80+).
    dense_flops: tensor-core peak for 2-byte inputs (bf16/fp16, dense), FLOP/s: the roofline's.
    mma_efficiency: the fraction of ``dense_flops`` a kernel reaches with each MMA family,
      (low, high): ``wgmma`` (Hopper warpgroup MMA), ``mma.sync`` (Ampere-style warp MMA; on
      Hopper about 2/3 of what wgmma reaches), None (no tensor cores: FMA pipes).
    launch_s: the gap one more kernel adds to a program, (low, high): inside a CUDA graph about
      1-2 us, a host launch more; used only by whole-program sums.
    gemm_efficiency: the fraction of the bandwidth (memory-bound shapes) or of the dense peak
      (compute-bound ones) a tuned library GEMM reaches, (low, high): cuBLAS-class GEMMs, or XLA's
      Triton GEMMs after autotuning on a GPU, usually reach 75-85 %. An assumption: used for
      XLA's GEMMs, whose tiles a compile without a GPU cannot autotune.
  """

  name: str
  sms: int
  bandwidth: float
  achievable: float
  latency_s: tuple[float, float]
  regs_per_sm: int
  smem_per_sm: int
  threads_per_sm: int
  max_ctas_per_sm: int
  smem_reserved_per_cta: int
  dense_flops: float
  mma_efficiency: dict
  launch_s: tuple[float, float]
  gemm_efficiency: tuple[float, float] = (0.75, 0.85)

  def describe(self) -> dict:
    """The assumptions as a JSON-able dict (what each estimate names)."""
    d = dataclasses.asdict(self)
    d["mma_efficiency"] = {str(k): v for k, v in self.mma_efficiency.items()}
    return d


def _library_figures():
  """``pallas_kernels/gpu_figures.py``, where the H200's figures are stated once (the kernels' plans
  read them too), loaded from its file: importing it as ``paged_kv.pallas_kernels.gpu_figures``
  would run the package's ``__init__`` and import JAX."""
  path = Path(__file__).resolve().parents[2] / "pallas_kernels" / "gpu_figures.py"
  spec = importlib.util.spec_from_file_location("_paged_kv_gpu_figures", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


FIGURES = _library_figures()
H200 = Gpu(name=f"{FIGURES.H200_NAME} (sm_90)", sms=FIGURES.H200_SMS, bandwidth=FIGURES.H200_BANDWIDTH,
           achievable=FIGURES.H200_ACHIEVABLE, latency_s=FIGURES.H200_LATENCY_S,
           regs_per_sm=65_536, smem_per_sm=FIGURES.H200_SMEM_PER_SM, threads_per_sm=2048, max_ctas_per_sm=32,
           smem_reserved_per_cta=1024, dense_flops=FIGURES.H200_DENSE_FLOPS,
           mma_efficiency={"wgmma": (0.70, 0.80), "mma.sync": (0.45, 0.55), None: (0.05, 0.07)},
           launch_s=(1.5e-6, 3e-6))
A100 = Gpu(name="NVIDIA A100 80 GB (sm_80)", sms=108, bandwidth=2.039e12, achievable=0.92,
           latency_s=(0.5e-6, 0.8e-6), regs_per_sm=65_536, smem_per_sm=167_936, threads_per_sm=2048,
           max_ctas_per_sm=32, smem_reserved_per_cta=1024, dense_flops=312e12,
           mma_efficiency={"mma.sync": (0.70, 0.80), None: (0.05, 0.07)}, launch_s=(2e-6, 4e-6))
GPUS = {"sm_90": H200, "sm_80": A100}

# The gate's rules (``scripts/gate/gpu_compile_plan.judge``): a memory-bound kernel must keep
# enough bytes in flight per SM to reach this fraction of the bandwidth at the high latency, and
# its grid must occupy at least this fraction of the SMs.
INFLIGHT_TARGET = 0.80
MIN_SM_FRACTION = 0.5


# ------------------------------------------------------------------------------ residency
def resident_ctas(gpu: Gpu, threads: int, registers: int, smem_bytes: int) -> tuple[int, str]:
  """(CTAs one SM holds, the limit that binds: "registers", "shared memory", "threads" or
  "CTA limit")."""
  warps = -(-threads // 32)
  regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
  limits = {
      "registers": (gpu.regs_per_sm // regs_per_warp) // warps,
      "threads": gpu.threads_per_sm // threads,
      "CTA limit": gpu.max_ctas_per_sm,
  }
  if smem_bytes:
    limits["shared memory"] = gpu.smem_per_sm // (smem_bytes + gpu.smem_reserved_per_cta)
  why = min(limits, key=limits.get)
  return max(limits[why], 0), why


# ------------------------------------------------------------------------------ PTX facts
_LABEL = re.compile(r"^(\$L__BB\d+_\d+):", re.M)
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
_CP_ASYNC = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\S*\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)")
_LD_GLOBAL = re.compile(r"\bld\.global(?:\.[a-zA-Z0-9:_]+)*?(?:\.v(\d))?\.(?:b|u|s|f|bf)(\d+)\b")
_COMMIT = re.compile(r"\bcp\.async\.commit_group\b")
_WAIT = re.compile(r"\bcp\.async\.wait_group\s+(\d+)")
_TMA = re.compile(r"\bcp\.async\.bulk\.tensor\b")


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """The main loop of a kernel as its PTX shows it (per thread, per iteration).

  Attributes:
    loop: whether the kernel has a loop that loads from global memory (else its loads are issued
      once, all together).
    cp_async_bytes, ld_global_bytes: bytes one thread asks for per iteration of the main loop
      (predicated instructions counted as issued: an upper bound).
    commit_groups: ``cp.async.commit_group`` per iteration.
    wait_group: the smallest ``cp.async.wait_group N`` in the loop (None without one).
    tma: ``cp.async.bulk.tensor`` instructions in the loop (Mosaic GPU kernels).
    stages: stages of the loop in flight while a CTA waits (``N / commit_groups + 1``).
    overlapped: whether the next stage is in flight while the current one is computed.
  """

  loop: bool
  cp_async_bytes: int
  ld_global_bytes: int
  commit_groups: int
  wait_group: int | None
  tma: int
  stages: int
  overlapped: bool


def entry_text(ptx: str, entry: str) -> str:
  """The PTX of one ``.entry`` (up to the next one)."""
  m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\(", ptx)
  if not m:
    return ""
  nxt = re.search(r"\.entry\s+\w+\s*\(", ptx[m.end():])
  return ptx[m.start(): m.end() + nxt.start() if nxt else len(ptx)]


def _loads(text: str) -> tuple[int, int]:
  cp = sum(int(s, 0) for s in _CP_ASYNC.findall(text))
  ld = sum(int(v or 1) * int(bits) // 8 for v, bits in _LD_GLOBAL.findall(text))
  return cp, ld


def pipeline(ptx_entry: str) -> Pipeline:
  """The main loop's pipeline facts of one kernel's PTX (``entry_text``).

  Loops are the spans from a label to a later branch back to it; the main loop is the one that
  loads the most bytes per iteration (the shortest such span when loops nest)."""
  labels = {m.group(1): m.start() for m in _LABEL.finditer(ptx_entry)}
  spans = []
  for m in _BRANCH.finditer(ptx_entry):
    start = labels.get(m.group(1))
    if start is not None and start < m.start():
      spans.append((start, m.end()))
  best = None
  for s, e in spans:
    cp, ld = _loads(ptx_entry[s:e])
    key = (cp + ld, -(e - s))
    if cp + ld and (best is None or key > best[0]):
      best = (key, s, e)
  if best is None:
    cp, ld = _loads(ptx_entry)
    return Pipeline(loop=False, cp_async_bytes=cp, ld_global_bytes=ld, commit_groups=len(_COMMIT.findall(ptx_entry)),
                    wait_group=None, tma=len(_TMA.findall(ptx_entry)), stages=1, overlapped=False)
  body = ptx_entry[best[1]:best[2]]
  cp, ld = _loads(body)
  commits = len(_COMMIT.findall(body))
  waits = [int(n) for n in _WAIT.findall(body)]
  wait = min(waits) if waits else None
  stages = (wait // commits + 1) if (cp and commits and wait is not None) else 1
  return Pipeline(loop=True, cp_async_bytes=cp, ld_global_bytes=ld, commit_groups=commits, wait_group=wait,
                  tma=len(_TMA.findall(body)), stages=stages, overlapped=stages > 1)


# ------------------------------------------------------------------------------ the work
@dataclasses.dataclass(frozen=True)
class Work:
  """What a kernel must do at one shape (from the shape and the kernel's tiles, not the PTX).

  Attributes:
    bytes: bytes that must move between HBM and the SMs (the roofline's).
    extra_bytes: bytes it moves beyond those (partials written and read back; re-reads that L2
      does not absorb).
    flops: floating-point operations (2 per multiply-add of its dots).
    step_bytes: bytes one CTA streams per main-loop step (its tile).
    steps: main-loop steps of the busiest CTA.
    step_flops: FLOPs one CTA computes per step (dots at their padded tile shapes).
    read_fraction: the share of ``bytes`` that are reads (the loads kept in flight); a copy's
      writes (half its bytes) are posted stores that need no round trip.
  """

  bytes: int
  flops: int
  step_bytes: int
  steps: int
  step_flops: int = 0
  extra_bytes: int = 0
  read_fraction: float = 1.0


@dataclasses.dataclass(frozen=True)
class Estimate:
  """The model's verdict on one kernel at one shape (times in seconds; an estimate)."""

  low_s: float
  high_s: float
  roofline_s: float
  fraction: tuple[float, float]  # roofline_s / high_s, roofline_s / low_s
  bound: str
  memory_bound: bool
  ctas: int
  resident: int
  resident_limit: str
  slots: int
  waves: float
  stages: int
  inflight_per_cta: int
  inflight_per_sm: float
  inflight_needed_per_sm: float
  sm_fraction: float
  all_at_once: bool = False
  attainable_s: float = 0.0
  attainable_fraction: float = 0.0

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    for k in ("low_s", "high_s", "roofline_s"):
      d[k.replace("_s", "_us")] = round(d.pop(k) * 1e6, 3)
    d["fraction"] = [round(f, 3) for f in self.fraction]
    d["inflight_per_sm"] = round(self.inflight_per_sm)
    d["inflight_needed_per_sm"] = round(self.inflight_needed_per_sm)
    d["waves"] = round(self.waves, 3)
    d["sm_fraction"] = round(self.sm_fraction, 3)
    d["attainable_us"] = round(d.pop("attainable_s") * 1e6, 3)
    d["attainable_fraction"] = round(self.attainable_fraction, 3)
    return d


def estimate(gpu: Gpu, ctas: int, threads: int, registers: int, smem_bytes: int, pipe: Pipeline, work: Work,
             mma: str | None) -> Estimate:
  """The model's time for one kernel launch (see the module docstring)."""
  resident, why = resident_ctas(gpu, threads, registers, smem_bytes)
  resident = max(resident, 1)
  slots = gpu.sms * resident
  stages = max(pipe.stages, 1)
  inflight_cta = stages * work.step_bytes
  sm_peak = gpu.dense_flops / gpu.sms
  eff = gpu.mma_efficiency.get(mma, gpu.mma_efficiency[None])
  per_cta_bytes = (work.bytes + work.extra_bytes) / max(ctas, 1)
  times, limits = [], []
  for latency, e in ((gpu.latency_s[0], eff[1]), (gpu.latency_s[1], eff[0])):
    compute = work.step_flops / (sm_peak * e)
    step = max(latency / stages, compute) if pipe.overlapped else latency + compute
    t_cta = work.steps * step
    full, rem = divmod(ctas, slots)
    total, by_bandwidth = 0.0, 0.0
    for k, n in ((slots, full), (rem, 1 if rem else 0)):
      if n:
        t_bw = k * per_cta_bytes / (gpu.bandwidth * gpu.achievable)
        total += n * max(t_bw, t_cta)
        by_bandwidth += n * t_bw
    t_flops = work.flops / (gpu.dense_flops * e)
    limits.append("compute" if t_flops >= total else "bandwidth" if by_bandwidth >= 0.9 * total else None)
    times.append(max(total, t_flops))
  roofline = max(work.bytes / gpu.bandwidth, work.flops / gpu.dense_flops)
  # The best any kernel with this MMA family could do under these assumptions: the achievable
  # bandwidth, and the MMA's best efficiency. Compute-bound kernels are judged against it.
  by_bytes = work.bytes / (gpu.bandwidth * gpu.achievable)
  attainable = max(by_bytes, work.flops / (gpu.dense_flops * eff[1]))
  # Memory-bound: even the best kernel with this MMA would wait on HBM, not on the math.
  memory_bound = by_bytes >= work.flops / (gpu.dense_flops * eff[1])
  busy = min(ctas, slots)
  inflight_sm = busy * inflight_cta / gpu.sms
  needed = INFLIGHT_TARGET * gpu.bandwidth * gpu.latency_s[1] * work.read_fraction / gpu.sms
  # A launch that reads less than that in all is in flight at once when every CTA is resident
  # and issues its loads in one step: no kernel could keep more in flight, so it needs no more.
  all_at_once = work.steps == 1 and ctas <= slots
  reads_per_sm = work.bytes * work.read_fraction / gpu.sms
  if all_at_once:
    needed = min(needed, reads_per_sm)
  low, high = times
  # What binds at the high latency: the FLOPs, the bandwidth, or else the per-CTA chain of
  # round trips, because the grid is short of SMs ("grid") or too little is in flight ("latency").
  bound = limits[1] or ("grid" if ctas < gpu.sms else "latency")
  return Estimate(low_s=low, high_s=high, roofline_s=roofline, fraction=(roofline / high, roofline / low),
                  bound=bound, memory_bound=memory_bound, ctas=ctas, resident=resident, resident_limit=why,
                  slots=slots, waves=ctas / slots, stages=stages, inflight_per_cta=inflight_cta,
                  inflight_per_sm=inflight_sm, inflight_needed_per_sm=needed,
                  sm_fraction=min(ctas, gpu.sms) / gpu.sms, all_at_once=all_at_once, attainable_s=attainable,
                  attainable_fraction=attainable / high)


def rule_violations(est: Estimate) -> list[str]:
  """The gate's two performance rules on one estimate (empty when both hold):

  * a memory-bound kernel keeps at least ``INFLIGHT_TARGET`` of the bandwidth's worth of bytes
    in flight per SM at the high latency (Little's law);
  * its grid occupies at least ``MIN_SM_FRACTION`` of the SMs.

  A launch whose CTAs are all resident and issue all their loads in one step (``all_at_once``)
  has everything in flight already: it needs no more than its own reads in flight, and more CTAs
  would not shorten its one round trip, so the grid rule does not apply to it."""
  out = []
  if est.memory_bound and est.inflight_per_sm < est.inflight_needed_per_sm:
    out.append(f"keeps {est.inflight_per_sm:,.0f} B in flight per SM ({est.stages} stage(s) x "
               f"{est.inflight_per_cta:,} B per CTA, {min(est.ctas, est.slots)} CTAs busy); "
               f"{est.inflight_needed_per_sm:,.0f} B are needed for {INFLIGHT_TARGET:.0%} of the bandwidth")
  if est.sm_fraction < MIN_SM_FRACTION and not est.all_at_once:
    out.append(f"grid of {est.ctas} CTAs leaves {1 - est.sm_fraction:.0%} of the SMs idle")
  return out


def program_sum(kernel_times: list[tuple[float, float]], launches: int, gpu: Gpu) -> tuple[float, float]:
  """(low, high) seconds of a program: its kernels' estimates plus a launch gap per kernel."""
  low = sum(t[0] for t in kernel_times) + launches * gpu.launch_s[0]
  high = sum(t[1] for t in kernel_times) + launches * gpu.launch_s[1]
  return low, high


def ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def log2(n: int) -> int:
  return int(math.log2(n))
