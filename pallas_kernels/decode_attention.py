"""Paged decode attention as a Pallas (Triton) kernel, split-K ("flash decoding").

One query token per sequence. Grid ``(batch, num_kv_heads, num_splits)``: each program takes
the ``G = num_q_heads // num_kv_heads`` query heads that share one KV head (padded to a power
of two >= 16 rows so the Triton dot has a legal shape; the padding rows are read and written
through masked loads and stores, never materialised), walks its share of the block table
``blocks_per_tile`` blocks at a time (one gather of ``[keys, head_dim]`` K and V rows by slot
straight from the pages, each block a contiguous run of rows), and keeps an online softmax in
float32: running max ``m``, running sum ``l`` and unnormalised output ``o``.

Pipelining: the K/V gather's addresses come from a load of the block table, and Triton's
software pipeliner shares its stages between the two loads, so the tiling table's 5 stages
keep two K/V tiles in flight (``cp.async.wait_group 3``) while the current one is computed.

Split-K: when ``batch x num_kv_heads`` programs alone would leave the GPU's resident slots
badly filled (a partial wave, idle SMs), the table is cut into ``num_splits`` contiguous ranges
(:func:`choose_partition`); every split writes its normalised partial output and log-sum-exp
for the group's real rows, and one XLA kernel merges them with the usual log-sum-exp rescaling
(:func:`merge_splits`), which is exact and stable. With one split the kernel writes the
normalised output itself and there is no merge.

Nothing is prepared around the kernel per call (nor per layer): it clamps the layer, clips the
lengths and maps bad block ids to the null block itself (a few scalar and per-tile integer
operations), where an XLA prologue of four small kernels ran before every call.

Work follows each sequence's own length: a program's loop runs only over tiles that hold at
least one position ``< length``, so a split entirely past the end of its sequence does no K/V
reads at all, and a batch of short and long sequences does not pay for the longest one
everywhere. Positions past ``length`` inside the last tile are masked.

The layer is an int32 operand (:func:`layer_operand`), not a constant in the block index maps:
the K/V blocks span every layer of a (K|V, KV head) plane and the kernel indexes their layer
axis, so a model's layers all lower to one byte-identical kernel, which XLA:GPU compiles once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.typing import DTypeLike

from paged_kv.pallas_kernels import gpu_figures, quant, tiling
from paged_kv.pallas_kernels.reference import NULL_BLOCK, PagesLike
from paged_kv.pallas_kernels.score_rules import score_knobs, window_start

# A finite "minus infinity": exp(MASK - m) is 0, and MASK - MASK is 0, never NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def online_softmax_init(rows: int, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(output accumulator, running max, running denominator) before the first key tile."""
  return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def online_softmax_step(carry: tuple[jax.Array, jax.Array, jax.Array], s: jax.Array, v: jax.Array,
                        mask: jax.Array, v_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Folds one tile of scores ``s [rows, keys]`` (float32, scaled) and values ``v [keys, D]`` into
  the running softmax ``carry``; masked scores count as absent. Shared by the decode and prefill
  kernels (flash attention's rescaling: old terms are scaled by exp(m_old - m_new)).

  ``v_scale`` (quantized pages): float32 ``[keys]``, each value row's scale; it multiplies the
  probabilities that weigh ``v`` (the quantized rows, in the compute dtype) in ``P V``, not the
  denominator, so the tile is never dequantized."""
  o, m, l = carry
  s = jnp.where(mask, s, MASK_VALUE)
  m_new = jnp.maximum(m, s.max(axis=1))
  alpha = jnp.exp(m - m_new)
  p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
  l_new = alpha * l + p.sum(axis=1)
  weights = p if v_scale is None else p * v_scale[None, :]
  pv = lax.dot_general(weights.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                       preferred_element_type=jnp.float32)
  return alpha[:, None] * o + pv, m_new, l_new


# Smallest M, N and K of a Triton dot.
MIN_DOT = tiling.MIN_DOT
next_power_of_two = tiling.next_power_of_two


def _decode_kernel(layer_ref, len_ref, bt_ref, q_ref, k_ref, v_ref, *refs, scale: float, group: int,
                   max_blocks: int, block_size: int, blocks_per_tile: int, tiles_per_split: int,
                   soft_cap: float | None = None, has_bias: bool = False, has_window: bool = False,
                   has_scales: bool = False):
  # refs: (ALiBi slopes [rows] when has_bias,) (the window [1] when has_window,) (K's and V's
  # per-token scales [L, slots] when has_scales: quantized pages,) then the output
  # [rows, D] (one split) or the split partials o [rows, D] and lse [rows, D] (several). Rows past
  # the GQA group, table columns past ``max_blocks`` and the group's partial rows lie outside
  # their arrays: Pallas masks those loads and stores (its blocks are larger than the arrays
  # there), so the wrapper pads nothing.
  slope_ref, refs = (refs[0], refs[1:]) if has_bias else (None, refs)
  window_ref, refs = (refs[0], refs[1:]) if has_window else (None, refs)
  (ks_ref, vs_ref), outs = (refs[:2], refs[2:]) if has_scales else ((None, None), refs)
  split = pl.program_id(2)
  num_layers, num_slots, head_dim = k_ref.shape
  num_blocks = num_slots // block_size
  tile_keys = blocks_per_tile * block_size
  rows = q_ref.shape[0]

  # The bound checks an XLA prologue used to do before every call, here per program (scalars): a traced
  # layer is clamped to [0, num_layers), a length to the table's capacity.
  layer = jnp.clip(layer_ref[0], 0, num_layers - 1)
  length = jnp.clip(len_ref[0], 0, max_blocks * block_size)
  num_tiles = pl.cdiv(pl.cdiv(length, block_size), blocks_per_tile)
  if has_window:
    # Sliding window or local chunk (the attention code, `window_start`): the query (at
    # length - 1) sees positions >= first_pos. The tiles from the one holding first_pos to the
    # last are cut among the splits (not the whole table): tiles wholly before it, and the null
    # blocks a local-attention manager puts there, are never read. A code of 0 is full attention.
    first_pos = window_start(length - 1, window_ref[0])
    window_tile = first_pos // tile_keys
    per_split = pl.cdiv(num_tiles - window_tile, pl.num_programs(2))
    first_tile = window_tile + split * per_split
    my_tiles = jnp.clip(num_tiles - first_tile, 0, per_split)
  else:
    first_tile = split * tiles_per_split
    # Tiles of this split that hold at least one position < length (0 when the split lies past
    # the end of the sequence: no K/V is read).
    my_tiles = jnp.clip(num_tiles - first_tile, 0, tiles_per_split)

  # Rows past the group were read from outside q (undefined): zero them so they stay finite.
  q = jnp.where(lax.broadcasted_iota(jnp.int32, (rows, head_dim), 0) < group, q_ref[...], 0).astype(q_ref.dtype)
  slope = slope_ref[...][:, None] if has_bias else None  # [rows, 1] float32

  def body(i, carry):
    tile = first_tile + i
    key = lax.broadcasted_iota(jnp.int32, (tile_keys,), 0)
    col = tile * blocks_per_tile + key // block_size  # the table column of each key
    ids = bt_ref[col]
    # Columns past the table (read masked, undefined) and ids outside [0, num_blocks) read the
    # null block, never another sequence's memory (sanitize_block_tables, per tile).
    ids = jnp.where((col < max_blocks) & (ids >= 0) & (ids < num_blocks), ids, NULL_BLOCK)
    slot = ids * block_size + key % block_size
    k = k_ref[layer, slot]  # [keys, D]: one 2-D gather the Triton pipeliner can buffer
    v = v_ref[layer, slot]
    v_scale = None
    if has_scales:
      # Quantized pages: the int8/e4m3 tiles convert to q's dtype exactly (in registers, for the
      # dot); the scales ride along as one [keys] gather per tile.
      k, v = quant.stored_as(k, q.dtype), quant.stored_as(v, q.dtype)
      v_scale = vs_ref[layer, slot]
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if has_scales:  # K's per-token scale multiplies its logits column
      s = s * ks_ref[layer, slot][None, :]
    s = s * scale
    pos = tile * tile_keys + lax.broadcasted_iota(jnp.int32, (rows, tile_keys), 1)
    s = score_knobs(s, soft_cap, slope, pos, length - 1)  # the query sits at length - 1
    # Keys of the window's first tile before the window (read, weight 0) are masked too.
    mask = (pos < length) & (pos >= first_pos) if has_window else pos < length
    return online_softmax_step(carry, s, v, mask, v_scale)

  o, m, l = lax.fori_loop(0, my_tiles, body, online_softmax_init(rows, head_dim))
  if len(outs) == 1:
    # One split: the normalised output in q's dtype, no merge (length 0 gives zeros).
    outs[0][...] = jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0).astype(outs[0].dtype)
  else:
    # Several splits: the normalised partial and its log-sum-exp, broadcast over head_dim so
    # that the merge is one elementwise XLA kernel (merge_splits). An empty split (l = 0) gives
    # 0 and MASK_VALUE, which weigh nothing in the merge.
    o_ref, lse_ref = outs
    o_ref[...] = jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), MASK_VALUE)
    lse_ref[...] = jnp.broadcast_to(lse[:, None], (rows, head_dim))


def layer_operand(layer: int | jax.Array, num_layers: int) -> jax.Array:
  """The layer id as the kernels' int32 ``[1]`` operand, clamped to ``[0, num_layers)``.

  ``layer`` is a Python int or an integer scalar array (traced, e.g. inside a scan over layers).
  The kernels take the layer as an operand rather than compiling it into their BlockSpec index
  maps, so every layer of a model calls the same kernel: the Triton IR in each custom call's
  backend config is byte-identical across layers, and XLA:GPU compiles it once (its kernel
  reuse cache) instead of once per layer. The Triton lowering of Pallas has no scalar prefetch,
  so a traced value cannot reach an index map at all; the kernels instead take every layer of
  their (K|V, KV head) plane as the block and index its layer axis with this operand.

  The clamp is the bound check a traced id cannot get before tracing (a Python int is
  range-checked by :func:`paged_kv.pallas_kernels.validate.check_layer` and passes through unchanged):
  an id outside ``[0, num_layers)`` reads (or writes) the nearest layer, never memory outside
  the pages."""
  if isinstance(layer, jax.Array):
    return jnp.clip(layer.astype(jnp.int32), 0, num_layers - 1).reshape(1)
  return jnp.full((1,), min(max(int(layer), 0), num_layers - 1), jnp.int32)


def merge_splits(o: jax.Array, lse: jax.Array) -> jax.Array:
  """Log-sum-exp merge of split partials -> [..., R, D] float32.

  ``o`` [..., S, R, D]: each split's normalised output; ``lse`` [..., S, R, D]: its log-sum-exp
  (``m + log l``, broadcast over head_dim; ``MASK_VALUE`` for an empty split, whose ``o`` is 0).
  The splits are folded in one at a time (each pair rescaled to their common maximum) as
  elementwise operations over the ``S`` (static) slices, every one at the output's shape: XLA:GPU
  emits the merge, the division and the caller's cast as one loop kernel. (Reductions over the
  split axis became two kernels, and so did per-row ``m``, ``l`` broadcast here: XLA computed
  the rows' chain in a kernel of its own.) All splits empty gives zeros."""
  lse_tot, w_tot, o_tot = lse[..., 0, :, :], jnp.ones_like(o[..., 0, :, :]), o[..., 0, :, :]
  for s in range(1, o.shape[-3]):
    lse_s = lse[..., s, :, :]
    new = jnp.maximum(lse_tot, lse_s)
    a, b = jnp.exp(lse_tot - new), jnp.exp(lse_s - new)
    lse_tot, w_tot, o_tot = new, a * w_tot + b, a * o_tot + b * o[..., s, :, :]
  return o_tot / w_tot


# The split rule's picture of the GPU: an H100/H200 (what the tiles were tuned on), the figures of
# gpu_figures.py. They only rank split counts against each other; on an A100 (108 SMs, 2 TB/s) the
# same choice is close (the waves are shorter by a fifth).
SMS = gpu_figures.H200_SMS
BANDWIDTH = gpu_figures.H200_SUSTAINED_BANDWIDTH  # HBM bytes/s a streaming kernel sustains
LATENCY_S = gpu_figures.H200_LATENCY_S[1]  # DRAM round trip under load (the high end)
MERGE_S = 3e-6  # the merge kernel's launch gap (the high end) when there are splits


def split_time(programs: int, num_tiles: int, splits: int, *, tile_bytes: int, stages: int, ctas_per_sm: int,
               partial_bytes: int) -> float:
  """Estimated seconds of a decode launch cutting ``num_tiles`` tiles per program into ``splits``
  ranges, every sequence at full length (Little's law, as scripts/gate/perf_model.py).

  Programs run in waves of ``SMS x ctas_per_sm`` (the resident slots). A wave lasts as long as
  its most loaded SM, ``ceil(k / SMS)`` programs streaming at one SM's share of the bandwidth,
  and at least one program's serial chain (a round trip per ``stages`` tiles in flight): a wave
  that leaves SMs idle or loads some twice is charged for it. Splits add their partials
  (``partial_bytes`` per program, written and read) and the merge's fixed cost."""
  tiles_per_split = -(-num_tiles // splits)
  ctas = programs * splits
  slots = SMS * ctas_per_sm
  cta_bytes = tiles_per_split * tile_bytes
  chain = tiles_per_split * LATENCY_S / max(stages, 1)
  total = 0.0
  full, rem = divmod(ctas, slots)
  for k, n in ((slots, full), (rem, 1 if rem else 0)):
    if n:
      total += n * max(-(-k // SMS) * SMS * cta_bytes / BANDWIDTH, chain)
  if splits > 1:
    total += ctas * partial_bytes / BANDWIDTH + MERGE_S
  return total


def choose_partition(max_blocks: int, block_size: int, batch: int, num_kv_heads: int,
                     blocks_per_tile: int | None = None, num_splits: int | None = None, *,
                     tile_bytes: int | None = None, stages: int = 1, ctas_per_sm: int = 1,
                     partial_bytes: int = 0) -> tuple[int, int, int]:
  """Static tiling: (blocks_per_tile, tiles_per_split, num_splits).

  ``blocks_per_tile`` defaults to a 64-key tile (the kernel passes its own row's choice): a power
  of two number of blocks, no more than the table needs but at least 16 keys. ``num_splits``
  (default) is the count that minimises :func:`split_time` for ``batch x num_kv_heads``
  programs (``tile_bytes``: one K and one V tile, default 2-byte elements at head_dim 128;
  ``stages``: tiles in flight per program; ``ctas_per_sm``: resident programs per SM;
  ``partial_bytes``: one split's partials, written and read): whole waves of the resident slots,
  every SM busy, the fewest splits (no merge at all with one) unless more are faster by over
  1 %. Never more splits than tiles; no split is entirely padding.
  """
  if blocks_per_tile is None:
    blocks_per_tile = tiling.tile_blocks(64, block_size, max_blocks)
  if blocks_per_tile < 1 or blocks_per_tile & (blocks_per_tile - 1):
    raise ValueError(f"blocks_per_tile={blocks_per_tile} must be a power of two")
  num_tiles = -(-max_blocks // blocks_per_tile)
  programs = batch * num_kv_heads
  if num_splits is None:
    if tile_bytes is None:
      tile_bytes = 2 * blocks_per_tile * block_size * 128 * 2
    cost = functools.partial(split_time, programs, num_tiles, tile_bytes=tile_bytes, stages=stages,
                             ctas_per_sm=ctas_per_sm, partial_bytes=partial_bytes)
    num_splits, best = 1, cost(1)
    for s in range(2, num_tiles + 1):
      t = cost(s)
      if t < best * 0.99:
        num_splits, best = s, t
  num_splits = max(1, min(num_splits, num_tiles))
  tiles_per_split = -(-num_tiles // num_splits)
  num_splits = -(-num_tiles // tiles_per_split)
  return blocks_per_tile, tiles_per_split, num_splits


@dataclasses.dataclass(frozen=True)
class Partition:
  """A decode launch (static Python ints): grid ``(batch, num_kv_heads, num_splits)``, each program
  ``rows`` query rows (the GQA group padded) over ``tiles_per_split`` tiles of ``blocks_per_tile``
  blocks, on ``num_warps`` warps with ``num_stages`` Triton pipeline stages."""

  blocks_per_tile: int
  tiles_per_split: int
  num_splits: int
  rows: int
  num_warps: int
  num_stages: int


def window_blocks(window: int, blocks_per_tile: int, block_size: int, max_blocks: int) -> int:
  """Table columns a decode program reads under a static sliding ``window`` (an int >= 1): the
  whole tiles that can hold its ``window`` positions, wherever the window starts in its first
  tile (``ceil((window - 1) / tile_keys) + 1`` tiles), at most the table's ``max_blocks``."""
  tile_keys = blocks_per_tile * block_size
  return min(max_blocks, (-(-(window - 1) // tile_keys) + 1) * blocks_per_tile)


def decode_partition(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                     max_blocks: int, dtype: DTypeLike, knobs: tiling.Knobs = tiling.NO_KNOBS, *,
                     blocks_per_tile: int | None = None, num_splits: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     window: int | None = None, kv_dtype: DTypeLike | None = None) -> Partition:
  """The launch of :func:`paged_decode_attention_pallas` for one configuration (``dtype`` of q and
  the pages): the tiling table's row (:func:`paged_kv.pallas_kernels.tiling.decode_tiling`) and the
  split rule (:func:`choose_partition`); explicit values override them. Plain Python, also what
  ``scripts/gate/perf_work_decode.py`` describes to the performance model.

  ``window``: a static sliding window (an int >= 1, or None): the split rule then sees only the
  tiles a window covers (:func:`window_blocks`), which is what each program reads, and
  ``tiles_per_split`` counts a split's share of those (the kernel cuts each sequence's window
  among the splits at run time).

  ``kv_dtype``: the pages' storage dtype when it differs from ``dtype`` (quantized pages, int8 or
  e4m3: one byte per element plus a float32 scale per key); the split rule then counts the bytes
  a tile really moves. The tiling row stays the compute dtype's."""
  group = num_q_heads // num_kv_heads
  tile = tiling.decode_tiling(dtype, head_dim, block_size, group, max_blocks, knobs)
  warps = tile.num_warps if num_warps is None else num_warps
  stages = tile.num_stages if num_stages is None else num_stages
  bpt = tile.blocks_per_tile if blocks_per_tile is None else blocks_per_tile
  itemsize = jnp.dtype(dtype).itemsize
  row_bytes = head_dim * itemsize
  if kv_dtype is not None:  # a quantized key: its values and its float32 scale
    row_bytes = head_dim * jnp.dtype(kv_dtype).itemsize + 4
  if window is not None:
    max_blocks = window_blocks(window, bpt, block_size, max_blocks)
  bpt, tps, splits = choose_partition(
      max_blocks, block_size, batch, num_kv_heads, bpt, num_splits,
      tile_bytes=2 * bpt * block_size * row_bytes, stages=max(stages - 1, 1),
      ctas_per_sm=tile.ctas_per_sm, partial_bytes=2 * 2 * group * head_dim * 4)
  return Partition(blocks_per_tile=bpt, tiles_per_split=tps, num_splits=splits, rows=tile.rows_per_tile,
                   num_warps=warps, num_stages=stages)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "blocks_per_tile", "num_splits",
                     "num_warps", "num_stages", "soft_cap", "window_bound"))
def paged_decode_attention_pallas(q: jax.Array, pages: PagesLike, layer: int | jax.Array, block_tables: jax.Array,
                                  lengths: jax.Array, *, scale: float, interpret: bool = False,
                                  blocks_per_tile: int | None = None, num_splits: int | None = None,
                                  num_warps: int | None = None, num_stages: int | None = None,
                                  soft_cap: float | None = None, alibi_slopes: jax.Array | None = None,
                                  window: int | jax.Array | None = None,
                                  window_bound: int | None = None) -> jax.Array:
  """Pallas paged decode attention; arguments as :func:`paged_kv.pallas_kernels.paged_decode_attention`.

  ``blocks_per_tile``, ``num_splits``, ``num_warps``, ``num_stages``: None takes the tiling
  table's choice and the split rule (:func:`decode_partition`); explicit values override them
  (tests, the gate). ``soft_cap`` is static (compiled in); ``alibi_slopes`` is an extra kernel
  input when given. ``layer`` is an operand, not compiled in: a Python int or an int32 scalar
  (traced or not); every layer gives the same kernel (see :func:`layer_operand`). ``window`` is
  an int32 operand too (one kernel for every window; <= 0 is full attention); ``window_bound``
  (static, optional) is the largest window the call can have, which the split rule then sizes
  for (:func:`decode_partition`; the dispatcher passes a Python int window as its own bound).

  Nothing is prepared around the kernel: ``q``, ``block_tables`` and ``lengths`` go in as they
  are (reshapes only, which XLA does not copy) and the kernel clamps the layer, clips the
  lengths, maps bad block ids to the null block and reads the GQA group's rows and the table's
  columns through masked loads. With one split the kernel writes the output in q's dtype;
  with several, one XLA merge follows (:func:`merge_splits`).

  Quantized ``pages`` (:class:`paged_kv.pallas_kernels.quant.QuantPages`): the K and V scale planes
  ``[L, slots]`` of the program's KV head are two more inputs, gathered by the same slots as the
  tiles; each tile converts to q's dtype for the dots (module docstring of ``quant``).
  """
  scales = None
  if quant.is_quant(pages):
    pages, scales = pages.values, pages.scales
  batch, num_q_heads, head_dim = q.shape
  num_layers, _, num_kv_heads, num_blocks, block_size, _ = pages.shape
  max_blocks = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  part = decode_partition(batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, q.dtype,
                          tiling.Knobs.of(soft_cap, alibi_slopes, window), blocks_per_tile=blocks_per_tile,
                          num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                          window=None if window is None else window_bound,
                          **({} if scales is None else {"kv_dtype": pages.dtype}))
  rows, bpt, tps, splits = part.rows, part.blocks_per_tile, part.tiles_per_split, part.num_splits
  padded_blocks = bpt * tps * splits
  if window is not None:  # the splits share the window's tiles: each may reach any table column
    padded_blocks = max(padded_blocks, pl.cdiv(max_blocks, bpt) * bpt)
  layer_op = (layer.astype(jnp.int32).reshape(1) if isinstance(layer, jax.Array)
              else layer_operand(layer, num_layers))
  lengths = lengths.astype(jnp.int32).reshape(batch, 1)
  block_tables = block_tables.astype(jnp.int32)
  qg = q.reshape(batch, num_kv_heads, group, head_dim)

  # ALiBi: one more input, [Hq] -> [Hkv, G] (rows past G read masked), row g of KV head h is
  # query head h * G + g.
  bias_inputs, bias_specs = [], []
  if alibi_slopes is not None:
    bias_inputs.append(alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group))
    bias_specs.append(pl.BlockSpec((None, rows), lambda b, h, s: (h, 0)))
  if window is not None:  # an int32 [1] operand, like the layer
    bias_inputs.append(jnp.asarray(window, jnp.int32).reshape(1))
    bias_specs.append(pl.BlockSpec((1,), lambda b, h, s: (0,)))

  if splits == 1:
    out_specs = [pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((batch, num_kv_heads, group, head_dim), q.dtype)]
  else:
    spec = pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0))
    out_specs = [spec, spec]
    out_shape = [jax.ShapeDtypeStruct((batch, num_kv_heads, splits, group, head_dim), jnp.float32)] * 2
  kernel = functools.partial(_decode_kernel, scale=scale, group=group, max_blocks=max_blocks, block_size=block_size,
                             blocks_per_tile=bpt, tiles_per_split=tps, soft_cap=soft_cap,
                             has_bias=alibi_slopes is not None, has_window=window is not None,
                             **({} if scales is None else {"has_scales": True}))
  # Every layer of one (K|V, KV head) plane; the kernel indexes the layer axis with its operand.
  # Pages seen as [L, 2, Hkv, slots, D] (a reshape XLA does not copy): a tile is one gather of
  # ``keys`` rows by slot.
  kv_block = (num_layers, None, None, num_blocks * block_size, head_dim)
  flat = pages.reshape(num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim)
  if scales is not None:  # the scale planes [L, slots] of the program's KV head, K then V
    flat_scales = scales.reshape(num_layers, 2, num_kv_heads, num_blocks * block_size)
    scale_block = (num_layers, None, None, num_blocks * block_size)
    bias_inputs += [flat_scales, flat_scales]
    bias_specs += [pl.BlockSpec(scale_block, lambda b, h, s: (0, 0, h, 0)),
                   pl.BlockSpec(scale_block, lambda b, h, s: (0, 1, h, 0))]
  outs = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, splits),
      in_specs=[
          pl.BlockSpec((1,), lambda b, h, s: (0,)),  # layer
          pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),  # lengths
          pl.BlockSpec((None, padded_blocks), lambda b, h, s: (b, 0)),  # block table row
          pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),  # q
          pl.BlockSpec(kv_block, lambda b, h, s: (0, 0, h, 0, 0)),  # K pages, all layers
          pl.BlockSpec(kv_block, lambda b, h, s: (0, 1, h, 0, 0)),  # V pages, all layers
      ] + bias_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=part.num_warps, num_stages=part.num_stages),
      interpret=interpret,
      name="paged_decode_attention",
  )(layer_op, lengths, block_tables, qg, flat, flat, *bias_inputs)
  out = outs[0] if splits == 1 else merge_splits(*outs).astype(q.dtype)  # [B, Hkv, G, D]
  return out.reshape(batch, num_q_heads, head_dim)
