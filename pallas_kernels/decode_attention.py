"""Paged decode attention as a Pallas (Triton) kernel, split-K ("flash decoding").

One query token per sequence. Grid ``(batch, num_kv_heads, num_splits)``: each program takes
the ``G = num_q_heads // num_kv_heads`` query heads that share one KV head (padded to a power
of two >= 16 rows so the Triton dot has a legal shape), walks its share of the block table
``blocks_per_tile`` blocks at a time (a gather of ``[blocks_per_tile, block_size, head_dim]``
K and V tiles straight from the pages, each block a contiguous, coalesced tile), and keeps an
online softmax in float32: running max ``m``, running sum ``l`` and unnormalised output ``o``.

Split-K: the table is cut into ``num_splits`` contiguous ranges so that short batches still
fill the GPU; every split writes its partial ``(o, m, l)`` and a small XLA epilogue merges them
with the usual log-sum-exp rescaling (``exp(m_s - max_s m_s)``), which is exact and stable.

Work follows each sequence's own length: a program's loop runs only over tiles that hold at
least one position ``< length``, so a split entirely past the end of its sequence does no K/V
reads at all, and a batch of short and long sequences does not pay for the longest one
everywhere. Positions past ``length`` inside the last tile are masked.

The layer is an int32 operand (:func:`layer_operand`), not a constant in the block index maps:
the K/V blocks span every layer of a (K|V, KV head) plane and the kernel indexes their layer
axis, so a model's layers all lower to one byte-identical kernel, which XLA:GPU compiles once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from paged_kv.pallas_kernels import tiling
from paged_kv.pallas_kernels.reference import sanitize_block_tables, score_knobs

# A finite "minus infinity": exp(MASK - m) is 0, and MASK - MASK is 0, never NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def online_softmax_init(rows: int, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(output accumulator, running max, running denominator) before the first key tile."""
  return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def online_softmax_step(carry: tuple[jax.Array, jax.Array, jax.Array], s: jax.Array, v: jax.Array,
                        mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Folds one tile of scores ``s [rows, keys]`` (float32, scaled) and values ``v [keys, D]`` into
  the running softmax ``carry``; masked scores count as absent. Shared by the decode and prefill
  kernels (flash attention's rescaling: old terms are scaled by exp(m_old - m_new))."""
  o, m, l = carry
  s = jnp.where(mask, s, MASK_VALUE)
  m_new = jnp.maximum(m, s.max(axis=1))
  alpha = jnp.exp(m - m_new)
  p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
  l_new = alpha * l + p.sum(axis=1)
  pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                       preferred_element_type=jnp.float32)
  return alpha[:, None] * o + pv, m_new, l_new


# Smallest M, N and K of a Triton dot.
MIN_DOT = tiling.MIN_DOT
next_power_of_two = tiling.next_power_of_two


def _decode_kernel(layer_ref, len_ref, bt_ref, q_ref, k_ref, v_ref, *refs, scale: float,
                   blocks_per_tile: int, tiles_per_split: int, soft_cap: float | None = None,
                   has_bias: bool = False):
  # refs: (ALiBi slopes [rows] when has_bias,) then the outputs o, m, l.
  slope_ref, (o_ref, m_ref, l_ref) = (refs[0], refs[1:]) if has_bias else (None, refs)
  split = pl.program_id(2)
  block_size, head_dim = k_ref.shape[-2:]
  tile_keys = blocks_per_tile * block_size
  rows = q_ref.shape[0]

  layer = layer_ref[0]  # int32 operand, clamped to [0, num_layers) (layer_operand)
  length = len_ref[0]
  num_tiles = pl.cdiv(pl.cdiv(length, block_size), blocks_per_tile)
  first_tile = split * tiles_per_split
  # Tiles of this split that hold at least one position < length (0 when the split lies past
  # the end of the sequence: no K/V is read).
  my_tiles = jnp.clip(num_tiles - first_tile, 0, tiles_per_split)

  q = q_ref[...]
  slope = slope_ref[...][:, None] if has_bias else None  # [rows, 1] float32

  def body(i, carry):
    o, m, l = carry
    tile = first_tile + i
    ids = bt_ref[pl.ds(tile * blocks_per_tile, blocks_per_tile)]
    k = k_ref[layer, ids].reshape(tile_keys, head_dim)
    v = v_ref[layer, ids].reshape(tile_keys, head_dim)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * scale
    pos = tile * tile_keys + lax.broadcasted_iota(jnp.int32, (rows, tile_keys), 1)
    s = score_knobs(s, soft_cap, slope, pos, length - 1)  # the query sits at length - 1
    return online_softmax_step((o, m, l), s, v, pos < length)

  o, m, l = lax.fori_loop(0, my_tiles, body, online_softmax_init(rows, head_dim))
  o_ref[...] = o
  m_ref[...] = m
  l_ref[...] = l


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


def merge_splits(o: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
  """Log-sum-exp merge of split partials: o [..., S, R, D], m and l [..., S, R] -> [..., R, D]."""
  m_max = m.max(axis=-2, keepdims=True)
  w = jnp.exp(m - m_max)  # 0 for empty splits (m = MASK_VALUE) unless all are empty
  l_tot = (w * l).sum(axis=-2)
  o_tot = (w[..., None] * o).sum(axis=-3)
  return jnp.where(l_tot[..., None] > 0, o_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None], 0.0)


def choose_partition(max_blocks: int, block_size: int, batch: int, num_kv_heads: int,
                     blocks_per_tile: int | None = None, num_splits: int | None = None) -> tuple[int, int, int]:
  """Static tiling: (blocks_per_tile, tiles_per_split, num_splits).

  ``blocks_per_tile`` defaults to a 128-key tile (the 2-byte rows of
  :data:`paged_kv.pallas_kernels.tiling.DECODE_TABLE`; the kernel passes its own row's choice): a power
  of two number of blocks, no more than the table needs but at least 16 keys. Splits are added
  until about 512 programs are in flight (enough for a large GPU), never more than there are
  tiles.
  """
  if blocks_per_tile is None:
    blocks_per_tile = tiling.tile_blocks(128, block_size, max_blocks)
  if blocks_per_tile < 1 or blocks_per_tile & (blocks_per_tile - 1):
    raise ValueError(f"blocks_per_tile={blocks_per_tile} must be a power of two")
  num_tiles = pl.cdiv(max_blocks, blocks_per_tile)
  if num_splits is None:
    num_splits = pl.cdiv(512, batch * num_kv_heads)
  num_splits = max(1, min(num_splits, num_tiles))
  tiles_per_split = pl.cdiv(num_tiles, num_splits)
  num_splits = pl.cdiv(num_tiles, tiles_per_split)
  return blocks_per_tile, tiles_per_split, num_splits


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "blocks_per_tile", "num_splits",
                     "num_warps", "num_stages", "soft_cap"))
def paged_decode_attention_pallas(q: jax.Array, pages: jax.Array, layer: int | jax.Array, block_tables: jax.Array,
                                  lengths: jax.Array, *, scale: float, interpret: bool = False,
                                  blocks_per_tile: int | None = None, num_splits: int | None = None,
                                  num_warps: int | None = None, num_stages: int | None = None,
                                  soft_cap: float | None = None, alibi_slopes: jax.Array | None = None) -> jax.Array:
  """Pallas paged decode attention; arguments as :func:`paged_kv.pallas_kernels.paged_decode_attention`.

  ``blocks_per_tile``, ``num_warps``, ``num_stages``: None takes the tiling table's choice
  (:func:`paged_kv.pallas_kernels.tiling.decode_tiling`); explicit values override it (tests, the gate).
  ``soft_cap`` is static (compiled in); ``alibi_slopes`` is an extra kernel input when given.
  ``layer`` is an operand, not compiled in: a Python int or an int32 scalar (traced or not);
  every layer gives the same kernel (see :func:`layer_operand`).
  """
  batch, num_q_heads, head_dim = q.shape
  num_layers, _, num_kv_heads, num_blocks, block_size, _ = pages.shape
  max_blocks = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  tile = tiling.decode_tiling(q.dtype, head_dim, block_size, group, max_blocks,
                              tiling.Knobs.of(soft_cap, alibi_slopes))
  rows = tile.rows_per_tile
  num_warps = tile.num_warps if num_warps is None else num_warps
  num_stages = tile.num_stages if num_stages is None else num_stages
  bpt, tps, splits = choose_partition(
      max_blocks, block_size, batch, num_kv_heads,
      tile.blocks_per_tile if blocks_per_tile is None else blocks_per_tile, num_splits)
  padded_blocks = bpt * tps * splits
  bt = sanitize_block_tables(block_tables, num_blocks)
  bt = jnp.pad(bt, ((0, 0), (0, padded_blocks - max_blocks)))
  lengths = jnp.clip(lengths, 0, max_blocks * block_size).reshape(batch, 1)
  qg = q.reshape(batch, num_kv_heads, group, head_dim)
  qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))

  # ALiBi: one more input, [Hq] -> [Hkv, rows], row g of KV head h is query head h * G + g.
  bias_inputs, bias_specs = [], []
  if alibi_slopes is not None:
    slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
    bias_inputs.append(jnp.pad(slopes, ((0, 0), (0, rows - group))))
    bias_specs.append(pl.BlockSpec((None, rows), lambda b, h, s: (h, 0)))

  kernel = functools.partial(_decode_kernel, scale=scale, blocks_per_tile=bpt,
                             tiles_per_split=tps, soft_cap=soft_cap,
                             has_bias=alibi_slopes is not None)
  # Every layer of one (K|V, KV head) plane; the kernel indexes the layer axis with its operand.
  kv_block = (num_layers, None, None, num_blocks, block_size, head_dim)
  o, m, l = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, splits),
      in_specs=[
          pl.BlockSpec((1,), lambda b, h, s: (0,)),  # layer
          pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),  # lengths
          pl.BlockSpec((None, padded_blocks), lambda b, h, s: (b, 0)),  # block table row
          pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),  # q
          pl.BlockSpec(kv_block, lambda b, h, s: (0, 0, h, 0, 0, 0)),  # K pages, all layers
          pl.BlockSpec(kv_block, lambda b, h, s: (0, 1, h, 0, 0, 0)),  # V pages, all layers
      ] + bias_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
          pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
          pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows, head_dim), jnp.float32),
          jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows), jnp.float32),
          jax.ShapeDtypeStruct((batch, num_kv_heads, splits, rows), jnp.float32),
      ],
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="paged_decode_attention",
  )(layer_operand(layer, num_layers), lengths, bt, qg, pages, pages, *bias_inputs)
  out = merge_splits(o, m, l)[:, :, :group]  # [B, Hkv, G, D]
  return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
