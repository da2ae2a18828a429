"""One layer's matmul read straight out of a stacked weight, as a Pallas (Triton) kernel.

``out[M, N] = ((scale[layer] * x) @ w[layer] + bias[layer])``, with ``w: [L, K, N]`` the weights
of every layer stacked on axis 0 and ``layer`` an int32 operand (traced inside a scan over
layers). Why a kernel: inside a scan over layers XLA:GPU turns ``w[layer]`` into a copy of the
layer's slice before each matmul, every step (its GEMM fusions and cuBLAS calls take whole
buffers), so a scanned decode step copied every decoder weight once per token. This kernel gets
the whole stacked buffer (a loop invariant of the scan: never copied) and indexes its layer axis
with the operand, as the attention kernels index the pages' layer axis.

``scale`` (optional ``[L, K]``) is the RMSNorm weight that precedes the projection: it
multiplies the ``x`` tile in ``x.dtype`` before the dot, the same product the norm itself would
form, so the norm's weight needs no slice either. ``bias`` (optional ``[L, N]``) is added to the
result after the cast to ``x.dtype``, as the model adds its biases.

Grid ``(M / bm, N / bn, splits)``; program ``(i, j, s)`` loops over its part of ``K`` in ``bk``
steps (Triton's pipeliner keeps ``num_stages - 1`` tiles in flight), accumulating in float32
(``preferred_element_type``). Unsplit (``splits == 1``), it writes its ``[bm, bn]`` tile cast to
``x.dtype`` plus the bias. Split (a decode step's few rows against a narrow projection would
otherwise leave most SMs idle, each program walking all of ``K``), it writes a float32 partial
into ``[splits, M, N]``, and XLA adds the partials in a fixed order, casts once and adds the bias
once (a small elementwise fusion, which the projection's consumer can absorb). :func:`plan`
chooses the tiles, the split and the pipeline depth from the shape.

A group (``w`` a tuple of ``[L, K, N_i]`` sharing ``x``, ``K`` and ``scale``; a bias each or
none): one launch whose column axis spans the weights side by side, ``sum(N_i) / bn`` column
tiles (``bn`` divides every ``N_i``, so no tile straddles two weights). Program column ``j``
finds its weight from the static tile boundaries: one ``pl.when`` branch per weight, each with
its own K loop (Triton pipelines each), writing that weight's own output ``[M, N_i]`` (or its
partials); the other weights' block index maps are clamped into range and never loaded. The
model's q|k|v and gate|up go this way: k and v alone (a 2 MB weight at Llama 3.2 1B) are too
small to keep HBM busy through a round trip, the group is not, and no weight is concatenated
(no copy, no checkpoint change). A split applies to the group as a whole; :func:`plan` sees
the total width.

The last row block's rows past ``M`` are masked (not padded: a pad and the slice after it
would be an extra copy per projection). ``K`` and ``N`` must be multiples of 16 (Triton's
smallest dot); :func:`supported` says whether a shape qualifies.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from paged_kv.pallas_kernels import gpu_figures
from paged_kv.pallas_kernels.decode_attention import layer_operand
from paged_kv.pallas_kernels.reference import Projections, StackedBiases, StackedWeights

MIN_DIM = 16  # tl.dot's smallest tile edge


def supported(k: int, n: int) -> bool:
  """True when a ``[K, N]`` weight can go through the kernel (both multiples of 16)."""
  return k % MIN_DIM == 0 and n % MIN_DIM == 0 and k > 0 and n > 0


def _largest_pow2_divisor(n: int, cap: int) -> int:
  b = MIN_DIM
  while b * 2 <= cap and n % (b * 2) == 0:
    b *= 2
  return b


@dataclasses.dataclass(frozen=True)
class Plan:
  """How :func:`layer_matmul_pallas` tiles one ``[M, K] @ [K, N]`` product.

  Attributes:
    bm, bk, bn: the tile (rows of x, the K step, columns of w).
    splits: K ranges run by separate programs (split-K), each writing a float32 partial.
    num_warps, num_stages: Triton's launch and software-pipeline parameters.
  """

  bm: int
  bk: int
  bn: int
  splits: int = 1
  num_warps: int = 4
  num_stages: int = 2


# The GPU the plan is sized for: an H100/H200-class part (gpu_figures.py: 132 SMs, ~4.4 TB/s
# sustained, a DRAM round trip of up to ~0.7 us under load, ~227 KB of shared memory per SM,
# ~990 TFLOP/s of bfloat16 MMA, of which a kernel reaches ~70 % with wgmma and ~45 % with mma.sync). A decode
# step's projection is a stream of the weight, so the plan is about keeping that stream full:
# enough programs to occupy every SM, and a per-program chain of K steps (each a round trip
# divided by the stages in flight, or its MMA time if longer) that does not outlast the stream
# (Little's law; scripts/gate/perf_model.py has the full model the gate applies).
_SMS = gpu_figures.H200_SMS
_BANDWIDTH = gpu_figures.H200_SUSTAINED_BANDWIDTH  # bytes/s a streaming kernel sustains
_LATENCY = gpu_figures.H200_LATENCY_S[1]  # s, the high end of the loaded DRAM round trip
_PEAK_FLOPS = gpu_figures.H200_DENSE_FLOPS
_MMA_EFFICIENCY = {True: 0.70, False: 0.45}  # bm >= 64 (wgmma on sm_90) / below (mma.sync)
_SMEM_PER_SM = gpu_figures.H200_SMEM_OPTIN
_SMEM_PER_BLOCK = 166_912 - 2048  # A100's opt-in limit (the smaller target), less the scale's tiles
_MAX_RESIDENT = 4  # 4 warps at ~128 registers: 4 programs per SM
_STAGES = (3, 4, 5)  # Triton's num_stages: 2-4 tiles in flight while one is computed
_STEP_BYTES = 16_384  # the largest weight tile per K step (bk x bn x itemsize)
_ROW_BYTES = 128  # a weight tile's row: one 128-byte line
_MAX_SPLITS = 64
_PARTIAL_ITEMSIZE = 4  # float32 partials


def _pow2_at_most(n: int, cap: int) -> int:
  """The largest power of two <= cap dividing n (at least MIN_DIM; n is a multiple of it)."""
  return _largest_pow2_divisor(n, max(cap, MIN_DIM))


def _splits_options(total: int) -> list[int]:
  """Split counts of ``total`` K steps that leave no split empty (``ceil(total / ceil(total / s)) == s``)."""
  return [s for s in range(1, min(total, _MAX_SPLITS) + 1) if s == -(-total // -(-total // s))]


def plan(m: int, k: int, n: int | tuple[int, ...], itemsize: int = 2, has_scale: bool = False) -> Plan:
  """The tiles, split and pipeline depth of an ``[m, k] @ [k, n]`` product in a dtype of
  ``itemsize`` bytes (plain Python: the performance model reads the same choice). ``n`` may be
  a group's widths ``(N_1, N_2, ...)``: one launch over ``sum(N_i)`` columns whose column tile
  divides every ``N_i`` (a tile never straddles two weights).

  * ``bm``: the smallest power of two >= m, from 16 (the smallest dot) to 64 (one warpgroup's
    ``wgmma`` rows on sm_90; more rows run as further row blocks, launched side by side, that
    read the same weight tile from L2), or a half or a quarter of it (more row blocks: more
    programs without a split's partials).
  * ``bn``: a 128-byte weight row (64 bfloat16 columns) or a 64-byte one, dividing ``n``.
  * ``bk``: a weight tile of at most 16 KB per K step (128 rows of 128 bytes) or half that,
    dividing ``k``; ``num_stages`` 3-5, the tiles of every stage within an A100's shared memory.
  * ``splits``: the K range cut in parts run by separate programs, each writing a float32
    partial ``[m, n]`` that XLA sums; the partials written and read back stay within a quarter
    of the bytes that must move.

  Among those candidates the plan takes the shortest by the estimate ``max((must + partials) /
  (bandwidth x busy), flops / (peak x efficiency x busy), waves x max(steps, stages - 1) x
  max(latency / (stages - 1), step flops / SM peak))``, with ``busy`` the fraction of the SMs the
  grid occupies; ties (within 2 %) go to fewer splits, the larger ``bm``, fewer stages, the
  larger ``bn``, then the larger ``bk``.

  Not tuned on a GPU (none was at hand): sized by the estimate for an H100/H200-class part."""
  ns = n if isinstance(n, tuple) else (n,)
  n = sum(ns)
  width = functools.reduce(math.gcd, ns)  # every column tile divides each weight's width
  top = MIN_DIM
  while top < min(m, 64):
    top *= 2
  must = (k * n + m * k + m * n) * itemsize
  best = None
  bn_max = _pow2_at_most(width, _ROW_BYTES // itemsize)
  for bm in sorted({top, max(MIN_DIM, top // 2), max(MIN_DIM, top // 4)}, reverse=True):
    rows = -(-m // bm)
    eff = _MMA_EFFICIENCY[bm >= 64]
    for bn in sorted({bn_max, max(MIN_DIM, bn_max // 2)}, reverse=True):
      cols = n // bn
      bk_max = _pow2_at_most(k, _STEP_BYTES // (bn * itemsize))
      for bk in sorted({bk_max, max(MIN_DIM, bk_max // 2)}, reverse=True):
        total = k // bk
        for stages in _STAGES:
          # Shared memory as Triton lays it out (the compiled figures, which set how many
          # programs an SM holds): without the norm's scale, num_stages buffers of the x and w
          # tiles (64 x 256 x 32 bf16 tiles at 3 stages: 147,456 B = 3 x 48 KB); with it,
          # num_stages - 1 buffers and the float32 output tile (64 x 128 x 64 at 4 stages:
          # 114,944 B = 3 x 32 KB + 16 KB + the scale's tile).
          tiles = (bm * bk + bk * bn) * itemsize
          smem = (stages - 1) * tiles + bm * bn * 4 if has_scale else stages * tiles
          if smem > _SMEM_PER_BLOCK:
            continue
          resident = min(_MAX_RESIDENT, max(1, _SMEM_PER_SM // (smem + 1024)))
          step = max(_LATENCY / (stages - 1), 2 * bm * bk * bn / (_PEAK_FLOPS / _SMS * eff))
          for splits in _splits_options(total):
            steps = -(-total // splits)
            if splits > 1 and steps < stages - 1:  # Triton pipelines no loop shorter than its stages
              break
            ctas = rows * cols * splits
            busy = min(1.0, ctas / _SMS)
            partials = 2 * _PARTIAL_ITEMSIZE * splits * m * n if splits > 1 else 0
            if partials > must // 4:  # more partials than a quarter of the stream: never worth it
              break
            # A chain shorter than the pipeline still waits one whole round trip.
            chain = -(-ctas // (_SMS * resident)) * max(steps, stages - 1) * step
            t = max((must + partials) / (_BANDWIDTH * busy), 2 * m * k * n / (_PEAK_FLOPS * eff * busy), chain)
            key = (splits, -bm, stages, -bn, -bk)
            if best is None or t < best[0] * 0.98 or (t <= best[0] * 1.02 and key < best[1]):
              best = (t, key, Plan(bm, bk, bn, splits, num_warps=4, num_stages=stages))
  if best is None:  # a shape whose smallest tiles overflow shared memory: one buffer, no split
    return Plan(top, MIN_DIM, _pow2_at_most(width, _ROW_BYTES // itemsize), 1, num_warps=4, num_stages=2)
  return best[2]


INVARIANT_ROWS = 64
"""Rows per program of the batch-invariant plan, whatever M: a row's tile is always this shape."""


def invariant_plan(k: int, n: int | tuple[int, ...], itemsize: int = 2, has_scale: bool = False) -> Plan:
  """The batch-invariant plan of a ``[M, k] @ [k, n]`` product: the same for every M, so a row's
  bits do not depend on the rows beside it (docs/batch_invariance.md).

  ``bm = INVARIANT_ROWS`` (rows past M are masked: zeros in, nothing out), ``bn`` a 128-byte
  weight row dividing every width (as :func:`plan`), ``bk`` a weight tile of at most 16 KB per K
  step (a function of K and ``bn`` only), no split-K (a split's count follows M in :func:`plan`,
  and its partials would add in another order). Every row runs the one ``[bm, bk] @ [bk, bn]``
  dot per K step, in K order, whatever M and whichever row tile it falls in. ``num_stages`` (the
  pipeline depth, which changes no arithmetic) is the deepest of 3..2 whose tiles fit an A100's
  shared memory."""
  ns = n if isinstance(n, tuple) else (n,)
  width = functools.reduce(math.gcd, ns)
  bn = _pow2_at_most(width, _ROW_BYTES // itemsize)
  bk = _pow2_at_most(k, _STEP_BYTES // (bn * itemsize))
  tiles = (INVARIANT_ROWS * bk + bk * bn) * itemsize
  for stages in (3, 2):
    smem = (stages - 1) * tiles + INVARIANT_ROWS * bn * 4 if has_scale else stages * tiles
    if smem <= _SMEM_PER_BLOCK:
      break
  return Plan(INVARIANT_ROWS, bk, bn, 1, num_warps=4, num_stages=stages)


def _columns(ns: tuple[int, ...], bn: int) -> tuple[tuple[int, int], ...]:
  """Each weight's column tiles ``[start, end)`` on the grid's column axis (the group's weights
  side by side, in order)."""
  out, start = [], 0
  for n in ns:
    out.append((start, start + n // bn))
    start += n // bn
  return tuple(out)


def _kernel(layer_ref, x_ref, *rest, m: int, bk: int, steps: int, total_steps: int, split: bool,
            cols: tuple[tuple[int, int], ...], has_scale: bool, has_bias: tuple[bool, ...]):
  g = len(cols)
  rest = list(rest)
  w_refs = [rest.pop(0) for _ in range(g)]
  scale_ref = rest.pop(0) if has_scale else None
  bias_refs = [rest.pop(0) if hb else None for hb in has_bias]
  o_refs = rest
  layer = layer_ref[0]
  bm, bn = o_refs[0].shape
  # The last row block may run past M: Triton's Pallas lowering does not mask a block that
  # overhangs its array, so these rows are masked by hand (never read, never written).
  rows = (pl.program_id(0) * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < m
  # Split s covers K steps [s * steps, min((s + 1) * steps, total_steps)); without a split the
  # one program covers them all.
  first = pl.program_id(2) * steps if split else 0
  count = steps if total_steps % steps == 0 else jnp.minimum(steps, total_steps - first)

  def project(w_ref, bias_ref, o_ref):
    def body(t, acc):
      kk = first + t
      a = pltriton.load(x_ref.at[:, pl.ds(kk * bk, bk)], mask=rows, other=0)
      if scale_ref is not None:
        a = scale_ref[layer, pl.ds(kk * bk, bk)][None, :] * a
      b = w_ref[layer, pl.ds(kk * bk, bk), :]
      return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, count, body, jnp.zeros((bm, bn), jnp.float32))
    if split:  # a float32 partial: the splits are summed (and the bias added) outside
      pltriton.store(o_ref, acc, mask=rows)
      return
    out = acc.astype(o_ref.dtype)
    if bias_ref is not None:
      out = out + bias_ref[layer, :][None, :]
    pltriton.store(o_ref, out, mask=rows)

  if g == 1:
    project(w_refs[0], bias_refs[0], o_refs[0])
    return
  # A group: column tile j belongs to the weight whose [start, end) holds it. Each weight's
  # branch has its own K loop (Triton pipelines each); the other weights' blocks this program
  # sees (their clamped index maps) are never loaded nor stored.
  j = pl.program_id(1)
  for (start, end), w_ref, bias_ref, o_ref in zip(cols, w_refs, bias_refs, o_refs):
    pl.when((j >= start) & (j < end))(functools.partial(project, w_ref, bias_ref, o_ref))


def _as_tuple(a) -> tuple:
  return tuple(a) if isinstance(a, (tuple, list)) else (a,)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "num_stages", "config", "batch_invariant"))
def layer_matmul_pallas(x: jax.Array, w: StackedWeights, layer: int | jax.Array, scale: jax.Array | None = None,
                        bias: StackedBiases = None, *, interpret: bool = False, num_warps: int | None = None,
                        num_stages: int | None = None, config: Plan | None = None,
                        batch_invariant: bool = False) -> Projections:
  """Pallas version of :func:`paged_kv.pallas_kernels.layer_matmul` (same arguments).

  ``w`` is one stacked weight ``[L, K, N]`` (result ``[M, N]``) or a group: a tuple of them
  ``[L, K, N_i]`` sharing ``x`` and ``scale``, with ``bias`` None or a tuple of ``[L, N_i]`` or
  None per weight (result: a tuple of ``[M, N_i]``), run as one launch whose column tiles span
  the weights side by side. ``config`` overrides :func:`plan`'s choice (tests force splits on
  small shapes with it); ``num_warps`` / ``num_stages`` override the plan's. ``batch_invariant``:
  :func:`invariant_plan` instead of :func:`plan` (a row's bits independent of M)."""
  grouped = isinstance(w, (tuple, list))
  ws = _as_tuple(w)
  biases = (None,) * len(ws) if bias is None else _as_tuple(bias)
  m, k = x.shape
  num_layers = ws[0].shape[0]
  ns = tuple(int(a.shape[2]) for a in ws)
  choose = invariant_plan if batch_invariant else functools.partial(plan, m)
  p = config or choose(k, ns if grouped else ns[0], jnp.dtype(x.dtype).itemsize, scale is not None)
  bm, bk, bn = p.bm, p.bk, p.bn
  if k % bk or any(n % bn for n in ns):  # a forced config's tile must divide K and every width
    raise ValueError(f"tile bk={bk}, bn={bn} must divide K={k} and every N of {ns}")
  cols = _columns(ns, bn)
  total_steps = k // bk
  steps = -(-total_steps // p.splits)
  splits = -(-total_steps // steps)  # no empty split
  split = splits > 1
  grid = (pl.cdiv(m, bm), cols[-1][1], splits)

  def col(start, end, where):
    """The index map of a block of one weight (its column block of program column ``j``,
    clamped into the weight for the programs of the others: see ``_kernel``); ``where(i, j, s,
    c)`` places column block ``c`` in the block index."""
    if len(ws) == 1:
      return lambda i, j, s: where(i, j, s, j)
    return lambda i, j, s: where(i, j, s, jnp.minimum(jnp.maximum(j - start, 0), end - start - 1))

  in_specs = [pl.BlockSpec((1,), lambda i, j, s: (0,)),
              pl.BlockSpec((bm, k), lambda i, j, s: (i, 0))]
  # Every layer of each weight: the layer is indexed in the kernel.
  in_specs += [pl.BlockSpec((num_layers, k, bn), col(*c, lambda i, j, s, c: (0, 0, c))) for c in cols]
  layer_op = layer_operand(layer, num_layers)
  operands = [layer_op, x, *ws]
  if scale is not None:
    in_specs.append(pl.BlockSpec((num_layers, k), lambda i, j, s: (0, 0)))
    operands.append(scale)
  has_bias = tuple(b is not None and not split for b in biases)
  for c, b, hb in zip(cols, biases, has_bias):
    if hb:
      in_specs.append(pl.BlockSpec((num_layers, bn), col(*c, lambda i, j, s, c: (0, c))))
      operands.append(b)
  if split:
    out_specs = [pl.BlockSpec((None, bm, bn), col(*c, lambda i, j, s, c: (s, i, c))) for c in cols]
    out_shape = [jax.ShapeDtypeStruct((splits, m, n), jnp.float32) for n in ns]
  else:
    out_specs = [pl.BlockSpec((bm, bn), col(*c, lambda i, j, s, c: (i, c))) for c in cols]
    out_shape = [jax.ShapeDtypeStruct((m, n), x.dtype) for n in ns]
  outs = pl.pallas_call(
      functools.partial(_kernel, m=m, bk=bk, steps=steps, total_steps=total_steps, split=split, cols=cols,
                        has_scale=scale is not None, has_bias=has_bias),
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps or p.num_warps,
                                              num_stages=num_stages or p.num_stages),
      interpret=interpret,
      name="layer_matmul",
  )(*operands)
  if split:
    outs = [_sum_partials(o, b, layer_op, x.dtype) for o, b in zip(outs, biases)]
  return tuple(outs) if grouped else outs[0]


def _sum_partials(out: jax.Array, bias: jax.Array | None, layer_op: jax.Array, dtype) -> jax.Array:
  """The split's float32 partials ``[splits, M, N]`` in a fixed order (a chain of adds XLA does
  not reassociate: the same bits on every run), one rounding to ``dtype``, then the bias as the
  unsplit kernel adds it."""
  acc = out[0]
  for s in range(1, out.shape[0]):
    acc = acc + out[s]
  acc = acc.astype(dtype)
  if bias is not None:
    acc = acc + lax.dynamic_index_in_dim(bias, layer_op[0], keepdims=False)[None, :]
  return acc
