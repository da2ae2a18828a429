"""Paged prefill (chunked) attention as a Pallas (Triton) kernel.

Several query tokens per sequence, causal over the paged cache: query ``t`` of sequence ``b``
sits at position ``q_start[b] + t`` and sees cached positions ``0 .. q_start[b] + t``. This is
what a prompt chunk, or the uncached suffix after a prefix-cache hit, needs: the cached prefix
is read from the pages, never recomputed.

Layout inside the kernel: the query heads of one KV head are folded into the row axis, row
``r = t * G + g`` (``G = num_q_heads // num_kv_heads``), so one program handles a
``[rows_per_tile, head_dim]`` tile of queries against ``[blocks_per_tile * block_size,
head_dim]`` K/V tiles gathered through the block table. Grid ``(batch, num_kv_heads,
num_row_tiles)``. Each program only visits K/V tiles up to the last position its own valid
queries can see (causal skipping), so early query tiles and short sequences do less work.
The online softmax runs in float32; rows with no visible position (padding queries) give zeros.
The layer is an int32 operand indexing the K/V blocks' layer axis, as in the decode kernel
(:func:`paged_kv.pallas_kernels.decode_attention.layer_operand`): one kernel for every layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from paged_kv.pallas_kernels import quant, tiling
from paged_kv.pallas_kernels.decode_attention import layer_operand, online_softmax_init, online_softmax_step
from paged_kv.pallas_kernels.reference import PagesLike, sanitize_block_tables
from paged_kv.pallas_kernels.score_rules import score_knobs, window_start


def _prefill_kernel(layer_ref, start_ref, qlen_ref, bt_ref, q_ref, k_ref, v_ref, *refs, scale: float,
                    group: int, blocks_per_tile: int, max_positions: int,
                    soft_cap: float | None = None, has_bias: bool = False, has_window: bool = False,
                    has_scales: bool = False):
  # refs: (ALiBi slope of each row [rows] when has_bias,) (the window [1] when has_window,) (K's
  # and V's per-token scales [L, NB, bs] when has_scales: quantized pages,) then the output.
  slope_ref, refs = (refs[0], refs[1:]) if has_bias else (None, refs)
  window_ref, refs = (refs[0], refs[1:]) if has_window else (None, refs)
  (ks_ref, vs_ref), refs = (refs[:2], refs[2:]) if has_scales else ((None, None), refs)
  o_ref = refs[0]
  row_tile = pl.program_id(2)
  block_size, head_dim = k_ref.shape[-2:]
  tile_keys = blocks_per_tile * block_size
  rows = q_ref.shape[0]

  layer = layer_ref[0]  # int32 operand, clamped to [0, num_layers) (layer_operand)
  q_start = start_ref[0]
  q_len = qlen_ref[0]
  first_row = row_tile * rows
  t = (first_row + lax.broadcasted_iota(jnp.int32, (rows, tile_keys), 0)) // group
  q_pos = q_start + t
  valid = t < q_len

  # Positions this tile's valid queries can see: 0 .. q_start + min(last t, q_len - 1).
  last_t = jnp.minimum((first_row + rows - 1) // group, q_len - 1)
  kv_len = jnp.where(first_row // group < q_len, q_start + last_t + 1, 0)
  kv_len = jnp.clip(kv_len, 0, max_positions)
  num_tiles = pl.cdiv(pl.cdiv(kv_len, block_size), blocks_per_tile)
  first_tile = 0
  if has_window:
    # Sliding window or local chunk (the attention code, `window_start`): row r sees positions
    # >= first_pos. The loop starts at the tile holding the first position the tile's earliest
    # query sees (the rule never decreases with the position), so tiles wholly before every
    # row's range (and the null blocks a local-attention manager puts there) are never read. A
    # code of 0 is full attention.
    # The first position depends on the row only: one column, not a [rows, keys] tile, kept live
    # across the key loop (a tile of it spilled registers on sm_80 with soft_cap).
    window = window_ref[0]
    row_pos = q_start + (first_row + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)) // group
    first_pos = window_start(row_pos, window)  # [rows, 1]
    earliest = window_start(q_start + first_row // group, window)
    first_tile = earliest // tile_keys

  q = q_ref[...]
  slope = slope_ref[...][:, None] if has_bias else None  # [rows, 1] float32

  def body(tile, carry):
    o, m, l = carry
    ids = bt_ref[pl.ds(tile * blocks_per_tile, blocks_per_tile)]
    k = k_ref[layer, ids].reshape(tile_keys, head_dim)
    v = v_ref[layer, ids].reshape(tile_keys, head_dim)
    v_scale = None
    if has_scales:
      # Quantized pages: int8/e4m3 -> q's dtype is exact (registers only, for the dots); each
      # tile's scales are one [keys] gather per plane.
      k, v = quant.stored_as(k, q.dtype), quant.stored_as(v, q.dtype)
      v_scale = vs_ref[layer, ids].reshape(tile_keys)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if has_scales:  # K's per-token scale multiplies its logits column
      s = s * ks_ref[layer, ids].reshape(tile_keys)[None, :]
    s = s * scale
    pos = tile * tile_keys + lax.broadcasted_iota(jnp.int32, (rows, tile_keys), 1)
    s = score_knobs(s, soft_cap, slope, pos, q_pos)
    mask = (pos <= q_pos) & valid
    if has_window:  # keys of a partly covered tile before a row's window: read, weight 0
      mask = mask & (pos >= first_pos)
    return online_softmax_step((o, m, l), s, v, mask, v_scale)

  o, m, l = lax.fori_loop(first_tile, num_tiles, body, online_softmax_init(rows, head_dim))
  out = jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
  o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "rows_per_tile", "blocks_per_tile",
                     "num_warps", "num_stages", "soft_cap"))
def paged_prefill_attention_pallas(q: jax.Array, pages: PagesLike, layer: int | jax.Array, block_tables: jax.Array,
                                   q_start: jax.Array, q_lens: jax.Array, *, scale: float, interpret: bool = False,
                                   rows_per_tile: int | None = None, blocks_per_tile: int | None = None,
                                   num_warps: int | None = None, num_stages: int | None = None,
                                   soft_cap: float | None = None, alibi_slopes: jax.Array | None = None,
                                   window: int | jax.Array | None = None) -> jax.Array:
  """Pallas paged prefill attention; arguments as :func:`paged_kv.pallas_kernels.paged_prefill_attention`.

  Tile parameters left None take the tiling table's choice
  (:func:`paged_kv.pallas_kernels.tiling.prefill_tiling`); explicit values override it.
  ``soft_cap`` is static (compiled in); ``alibi_slopes`` is an extra kernel input when given, and
  so is ``window`` (an int32 operand: one kernel for every window; <= 0 is full attention).
  Quantized ``pages`` (:class:`paged_kv.pallas_kernels.quant.QuantPages`): the K and V scale planes
  of the program's KV head are two more inputs; the tiling row is q's dtype's (the compute dtype).
  """
  scales = None
  if quant.is_quant(pages):
    pages, scales = pages.values, pages.scales
  batch, num_tokens, num_q_heads, head_dim = q.shape
  num_layers, _, num_kv_heads, num_blocks, block_size, _ = pages.shape
  max_blocks = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  total_rows = num_tokens * group
  tile = tiling.prefill_tiling(q.dtype, head_dim, block_size, group, num_tokens, max_blocks,
                               tiling.Knobs.of(soft_cap, alibi_slopes, window))
  rows_per_tile = tile.rows_per_tile if rows_per_tile is None else rows_per_tile
  blocks_per_tile = tile.blocks_per_tile if blocks_per_tile is None else blocks_per_tile
  num_warps = tile.num_warps if num_warps is None else num_warps
  num_stages = tile.num_stages if num_stages is None else num_stages
  for name, val in (("rows_per_tile", rows_per_tile), ("blocks_per_tile", blocks_per_tile)):
    if val < 1 or val & (val - 1):
      raise ValueError(f"{name}={val} must be a power of two")
  row_tiles = pl.cdiv(total_rows, rows_per_tile)
  padded_rows = row_tiles * rows_per_tile
  padded_blocks = pl.cdiv(max_blocks, blocks_per_tile) * blocks_per_tile

  bt = sanitize_block_tables(block_tables, num_blocks)
  bt = jnp.pad(bt, ((0, 0), (0, padded_blocks - max_blocks)))
  starts = jnp.maximum(q_start, 0).reshape(batch, 1)
  qlens = jnp.clip(q_lens, 0, num_tokens).reshape(batch, 1)
  # [B, T, Hkv, G, D] -> [B, Hkv, T * G, D], row r = t * G + g.
  qr = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
  qr = qr.reshape(batch, num_kv_heads, total_rows, head_dim)
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, padded_rows - total_rows), (0, 0)))

  # ALiBi: one more input, [Hq] -> [Hkv, padded_rows], row r of KV head h is head h * G + r % G.
  bias_inputs, bias_specs = [], []
  if alibi_slopes is not None:
    slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
    bias_inputs.append(slopes[:, jnp.arange(padded_rows) % group])
    bias_specs.append(pl.BlockSpec((None, rows_per_tile), lambda b, h, r: (h, r)))
  if window is not None:  # an int32 [1] operand, like the layer
    bias_inputs.append(jnp.asarray(window, jnp.int32).reshape(1))
    bias_specs.append(pl.BlockSpec((1,), lambda b, h, r: (0,)))

  kernel = functools.partial(_prefill_kernel, scale=scale, group=group,
                             blocks_per_tile=blocks_per_tile,
                             max_positions=max_blocks * block_size, soft_cap=soft_cap,
                             has_bias=alibi_slopes is not None, has_window=window is not None,
                             **({} if scales is None else {"has_scales": True}))
  # Every layer of one (K|V, KV head) plane; the kernel indexes the layer axis with its operand.
  kv_block = (num_layers, None, None, num_blocks, block_size, head_dim)
  if scales is not None:  # the scale planes [L, NB, bs] of the program's KV head, K then V
    scale_block = (num_layers, None, None, num_blocks, block_size)
    bias_inputs += [scales, scales]
    bias_specs += [pl.BlockSpec(scale_block, lambda b, h, r: (0, 0, h, 0, 0)),
                   pl.BlockSpec(scale_block, lambda b, h, r: (0, 1, h, 0, 0))]
  out = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, row_tiles),
      in_specs=[
          pl.BlockSpec((1,), lambda b, h, r: (0,)),  # layer
          pl.BlockSpec((None, 1), lambda b, h, r: (b, 0)),  # q_start
          pl.BlockSpec((None, 1), lambda b, h, r: (b, 0)),  # q_lens
          pl.BlockSpec((None, padded_blocks), lambda b, h, r: (b, 0)),  # block table row
          pl.BlockSpec((None, None, rows_per_tile, head_dim), lambda b, h, r: (b, h, r, 0)),
          pl.BlockSpec(kv_block, lambda b, h, r: (0, 0, h, 0, 0, 0)),  # K pages, all layers
          pl.BlockSpec(kv_block, lambda b, h, r: (0, 1, h, 0, 0, 0)),  # V pages, all layers
      ] + bias_specs,
      out_specs=pl.BlockSpec((None, None, rows_per_tile, head_dim), lambda b, h, r: (b, h, r, 0)),
      out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, padded_rows, head_dim), q.dtype),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="paged_prefill_attention",
  )(layer_operand(layer, num_layers), starts, qlens, bt, qr, pages, pages, *bias_inputs)
  out = out[:, :, :total_rows].reshape(batch, num_kv_heads, num_tokens, group, head_dim)
  return out.transpose(0, 2, 1, 3, 4).reshape(batch, num_tokens, num_q_heads, head_dim)
