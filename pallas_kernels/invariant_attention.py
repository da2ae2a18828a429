"""Batch-invariant paged attention as one Pallas (Triton) kernel, for prefill and decode alike.

The default kernels choose their tiles from the call's shape (rows per tile from the chunk
length, keys per step from the table width, split-K for decode from the batch), so a token's
output bits change with its batchmates, its chunk and whether it was prefilled or decoded. This
kernel fixes everything a query row's arithmetic depends on:

* **Rows**: the query heads of one KV head are folded into the row axis (row ``r = t * G + g``,
  ``G = num_q_heads // num_kv_heads``) and cut into tiles of ``ROW_TILE`` rows, whatever the
  number of tokens. A decode step is the same call with one token per sequence
  (:func:`paged_decode_invariant_pallas`), so its ``G`` rows sit in one tile of the same shape.
  Within a tile every row runs the same dot and the same row reductions, so a row's bits do not
  depend on its place in the tile or the other rows.
* **Keys**: steps of :func:`key_step` keys (from the head dim and dtype: 64 keys of a 128-wide
  bfloat16 head, 16 to 64 in all, or one block when blocks are larger) from position 0,
  independent of the batch, the chunk and the context; no split-K.
  A program walks the steps up to the last position its tile's valid rows see; a step that is
  entirely masked for a row (past its position, or before its sliding window) leaves that row's
  running max, sum and output bit for bit unchanged (its weights are exactly 0 and its rescale
  factor exactly 1), so how many steps a tile runs does not matter to any row.

Online softmax in float32 (:func:`paged_kv.pallas_kernels.decode_attention.online_softmax_step`),
``soft_cap`` and ALiBi slopes as in the other kernels (:func:`paged_kv.pallas_kernels.score_rules.score_knobs`),
and an optional sliding ``window``: query at position ``p`` sees keys ``p - window < k <= p``.

Bits are equal within this kernel (any batch, row, chunk split, prefill or decode), not to the
reference's invariant path (``paged_kv.pallas_kernels.invariant``, other tiles, other backend):
bits across backends need not agree. Grid ``(batch, num_kv_heads, row_tiles)``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from paged_kv.pallas_kernels.decode_attention import layer_operand, online_softmax_init, online_softmax_step
from paged_kv.pallas_kernels.reference import sanitize_block_tables
from paged_kv.pallas_kernels.score_rules import score_knobs, window_start

ROW_TILE = 16
"""Query rows (token x query head of one KV head) per program: Triton's smallest dot edge."""

KEY_STEP_BYTES = 16_384
"""A key step's K tile (keys x head_dim x itemsize) is at most this, 16 to 64 keys: with its V tile
and the 16-row accumulators it stays in registers (the GPU gate checks for spills)."""

NUM_WARPS = 4
NUM_STAGES = 2


def key_step(block_size: int, head_dim: int, itemsize: int) -> int:
  """Keys per step for pages of ``block_size`` (a power of two), ``head_dim`` and ``itemsize``
  bytes: ``KEY_STEP_BYTES / (head_dim x itemsize)`` clamped to 16..64, or one block when blocks
  are larger. A function of the cache's layout only, never of the batch, chunk or context."""
  keys = min(64, max(16, KEY_STEP_BYTES // (head_dim * itemsize)))
  return max(keys, block_size)


def window_operand(window: int | jax.Array | None) -> jax.Array:
  """The sliding window as the kernel's int32 ``[1]`` operand; 0 (or less) means full attention."""
  if window is None:
    return jnp.zeros((1,), jnp.int32)
  return jnp.asarray(window, jnp.int32).reshape(1)


def _kernel(layer_ref: Any, window_ref: Any, start_ref: Any, qlen_ref: Any, bt_ref: Any, q_ref: Any, k_ref: Any,
            v_ref: Any, *refs: Any, scale: float, group: int, blocks_per_step: int, max_positions: int,
            soft_cap: float | None, has_bias: bool) -> None:
  """One program: KV head ``h`` of sequence ``b``, query rows ``[r * ROW_TILE, (r + 1) * ROW_TILE)``
  (Pallas refs: the scalars, the block-table row, q ``[ROW_TILE, D]``, every layer's K and V plane,
  the ALiBi slopes of the rows when ``has_bias``, then the output ``[ROW_TILE, D]``)."""
  slope_ref, o_ref = refs if has_bias else (None, refs[0])
  block_size, head_dim = k_ref.shape[-2:]
  keys = blocks_per_step * block_size
  rows = q_ref.shape[0]
  layer = layer_ref[0]  # clamped by layer_operand
  window = window_ref[0]
  q_start = start_ref[0]
  q_len = qlen_ref[0]
  first_row = pl.program_id(2) * rows
  t = (first_row + lax.broadcasted_iota(jnp.int32, (rows, keys), 0)) // group
  q_pos = q_start + t
  valid = t < q_len

  # Steps up to the last position a valid row of this tile sees (none when the tile has none).
  last_t = jnp.minimum((first_row + rows - 1) // group, q_len - 1)
  kv_len = jnp.where(first_row // group < q_len, q_start + last_t + 1, 0)
  steps = pl.cdiv(jnp.clip(kv_len, 0, max_positions), keys)
  # With a window, steps before the first row's window are all masked for every row: skipped
  # (skipping a fully masked step is exact, see the module docstring).
  first = window_start(q_start + first_row // group, window) // keys
  first = jnp.minimum(first, steps)
  first_pos = window_start(q_pos, window)  # [rows, keys], once: the kind's rule divides for a chunk

  q = q_ref[...]
  slope = slope_ref[...][:, None] if has_bias else None  # [rows, 1] float32

  def body(step, carry):
    ids = bt_ref[pl.ds(step * blocks_per_step, blocks_per_step)]
    k = k_ref[layer, ids].reshape(keys, head_dim)
    v = v_ref[layer, ids].reshape(keys, head_dim)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    pos = step * keys + lax.broadcasted_iota(jnp.int32, (rows, keys), 1)
    s = score_knobs(s, soft_cap, slope, pos, q_pos)
    mask = (pos <= q_pos) & valid & (pos >= first_pos)
    return online_softmax_step(carry, s, v, mask)

  o, _, denom = lax.fori_loop(first, steps, body, online_softmax_init(rows, head_dim))
  o_ref[...] = jnp.where(denom[:, None] > 0, o / jnp.where(denom > 0, denom, 1.0)[:, None], 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "soft_cap"))
def paged_invariant_attention_pallas(q: jax.Array, pages: jax.Array, layer: int | jax.Array,
                                     block_tables: jax.Array, q_start: jax.Array, q_lens: jax.Array, *,
                                     scale: float, interpret: bool = False, soft_cap: float | None = None,
                                     alibi_slopes: jax.Array | None = None,
                                     window: int | jax.Array | None = None) -> jax.Array:
  """Causal paged attention with fixed tiles (module docstring): arguments as
  :func:`paged_kv.pallas_kernels.paged_prefill_attention`.

  q ``[B, T, Hq, D]`` in the pages' dtype; pages ``[L, 2, Hkv, num_blocks, block_size, D]``;
  block_tables int32 ``[B, max_blocks]``; q_start, q_lens int32 ``[B]``; alibi_slopes None or
  float ``[Hq]``; window None, a Python int >= 1 or an int32 scalar (<= 0: full attention).
  Returns ``[B, T, Hq, D]`` in q's dtype; invalid query rows give zeros."""
  batch, num_tokens, num_q_heads, head_dim = q.shape
  num_layers, _, num_kv_heads, num_blocks, block_size, _ = pages.shape
  max_blocks = block_tables.shape[1]
  group = num_q_heads // num_kv_heads
  total_rows = num_tokens * group
  row_tiles = pl.cdiv(total_rows, ROW_TILE)
  padded_rows = row_tiles * ROW_TILE
  blocks_per_step = key_step(block_size, head_dim, jnp.dtype(pages.dtype).itemsize) // block_size
  padded_blocks = pl.cdiv(max_blocks, blocks_per_step) * blocks_per_step

  bt = jnp.pad(sanitize_block_tables(block_tables, num_blocks), ((0, 0), (0, padded_blocks - max_blocks)))
  starts = jnp.maximum(q_start, 0).astype(jnp.int32).reshape(batch, 1)
  qlens = jnp.clip(q_lens, 0, num_tokens).astype(jnp.int32).reshape(batch, 1)
  # [B, T, Hkv, G, D] -> [B, Hkv, T * G, D] (row r = t * G + g), padded to whole row tiles.
  qr = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
  qr = jnp.pad(qr.reshape(batch, num_kv_heads, total_rows, head_dim),
               ((0, 0), (0, 0), (0, padded_rows - total_rows), (0, 0)))

  bias_inputs, bias_specs = [], []
  if alibi_slopes is not None:  # [Hq] -> [Hkv, padded_rows]: row r of KV head h is head h * G + r % G
    slopes = alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group)
    bias_inputs.append(slopes[:, jnp.arange(padded_rows) % group])
    bias_specs.append(pl.BlockSpec((None, ROW_TILE), lambda b, h, r: (h, r)))

  kernel = functools.partial(_kernel, scale=scale, group=group, blocks_per_step=blocks_per_step,
                             max_positions=max_blocks * block_size, soft_cap=soft_cap,
                             has_bias=alibi_slopes is not None)
  kv_block = (num_layers, None, None, num_blocks, block_size, head_dim)  # every layer of one plane
  rows_spec = pl.BlockSpec((None, None, ROW_TILE, head_dim), lambda b, h, r: (b, h, r, 0))
  out = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads, row_tiles),
      in_specs=[
          pl.BlockSpec((1,), lambda b, h, r: (0,)),  # layer
          pl.BlockSpec((1,), lambda b, h, r: (0,)),  # window
          pl.BlockSpec((None, 1), lambda b, h, r: (b, 0)),  # q_start
          pl.BlockSpec((None, 1), lambda b, h, r: (b, 0)),  # q_lens
          pl.BlockSpec((None, padded_blocks), lambda b, h, r: (b, 0)),  # block table row
          rows_spec,
          pl.BlockSpec(kv_block, lambda b, h, r: (0, 0, h, 0, 0, 0)),  # K pages
          pl.BlockSpec(kv_block, lambda b, h, r: (0, 1, h, 0, 0, 0)),  # V pages
      ] + bias_specs,
      out_specs=rows_spec,
      out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, padded_rows, head_dim), q.dtype),
      compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
      interpret=interpret,
      name="paged_invariant_attention",
  )(layer_operand(layer, num_layers), window_operand(window), starts, qlens, bt, qr, pages, pages, *bias_inputs)
  out = out[:, :, :total_rows].reshape(batch, num_kv_heads, num_tokens, group, head_dim)
  return out.transpose(0, 2, 1, 3, 4).reshape(batch, num_tokens, num_q_heads, head_dim)


def paged_decode_invariant_pallas(q: jax.Array, pages: jax.Array, layer: int | jax.Array, block_tables: jax.Array,
                                  lengths: jax.Array, *, scale: float, interpret: bool = False,
                                  soft_cap: float | None = None, alibi_slopes: jax.Array | None = None,
                                  window: int | jax.Array | None = None) -> jax.Array:
  """Decode through the same kernel: q ``[B, Hq, D]`` is one query token per sequence at
  position ``lengths - 1`` (a length of 0: zeros). Returns ``[B, Hq, D]`` in q's dtype, the same
  bits as :func:`paged_invariant_attention_pallas` gives that token in any prefill chunk."""
  lengths = lengths.astype(jnp.int32)
  out = paged_invariant_attention_pallas(
      q[:, None], pages, layer, block_tables, jnp.maximum(lengths - 1, 0), (lengths > 0).astype(jnp.int32),
      scale=scale, interpret=interpret, soft_cap=soft_cap, alibi_slopes=alibi_slopes, window=window)
  return out[:, 0]
