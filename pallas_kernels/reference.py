"""Pure-``jnp`` references for every kernel, also the XLA implementation used off-GPU.

These take already-validated arguments (see :mod:`paged_kv.pallas_kernels.validate`) and follow exactly
the semantics documented in :mod:`pallas_kernels`:

* Out-of-range block-table entries (negative or >= num_blocks) are redirected to the null
  block 0 (:func:`sanitize_block_tables`); out-of-range slots go to slot 0, inside the null
  block (:func:`sanitize_slots`). Nothing ever reads or writes another sequence's block
  because of a bad index, and nothing wraps around like negative NumPy indices would.
* Positions beyond ``max_blocks_per_seq * block_size`` do not exist: a length larger than
  the table covers attends to the whole table.

The attention references walk the block table a chunk of blocks at a time with an online
softmax (see :func:`_paged_attention`); they are checked against a float64 dense attention
that gathers each sequence into contiguous K/V (``paged_kv.pallas_kernels.testing``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from paged_kv.pallas_kernels import invariant as invariant_ops, quant
from paged_kv.pallas_kernels.score_rules import score_knobs, window_start

NULL_BLOCK = 0

# ``layer_matmul``'s operands: one stacked weight ``[L, K, N]`` or a group of them ``[L, K, N_i]``
# sharing x (one launch), a bias ``[L, N]`` or one per weight (or None), and the result: ``[M, N]``
# or one ``[M, N_i]`` per weight.
StackedWeights = jax.Array | tuple[jax.Array, ...]
StackedBiases = jax.Array | tuple[jax.Array | None, ...] | None
Projections = jax.Array | tuple[jax.Array, ...]
# The KV pages every kernel takes: a plain float array, or int8 / e4m3 values with their scales.
PagesLike = jax.Array | quant.QuantPages


def sanitize_block_tables(block_tables: jax.Array, num_blocks: int) -> jax.Array:
  """Maps entries outside [0, num_blocks) to the null block 0."""
  ok = (block_tables >= 0) & (block_tables < num_blocks)
  return jnp.where(ok, block_tables, NULL_BLOCK).astype(jnp.int32)


def sanitize_slots(slots: jax.Array, num_slots: int) -> jax.Array:
  """Maps slots outside [0, num_blocks * block_size) to slot 0 (inside the null block)."""
  ok = (slots >= 0) & (slots < num_slots)
  return jnp.where(ok, slots, NULL_BLOCK).astype(jnp.int32)


def _paged_attention(q, pages, layer, block_tables, last_pos, valid, scale, soft_cap=None,
                     slopes=None, invariant=False, window=None):
  """Blockwise paged attention in plain XLA.

  q ``[B, T, Hq, D]``; query ``(b, t)`` sits at position ``last_pos[b, t]`` and sees positions
  ``0 .. last_pos[b, t]`` when ``valid[b, t]``, else nothing (zeros). ``soft_cap`` (static float)
  and ``slopes`` (float ``[Hq]``): see :func:`score_knobs`. ``window`` (None, an int >= 1 or an int32
  scalar, <= 0 meaning none): query ``(b, t)`` also sees nothing before
  :func:`window_start`; the walk then starts at the first chunk any valid query's window reaches,
  so chunks wholly before every window (and the null-block entries a sliding-window manager leaves
  there) are never gathered. Returns ``[B, T, Hq, D]`` in ``q.dtype``.

  The table is walked ``chunk`` blocks (about 128 positions) at a time with an online
  softmax in float32, and only up to the furthest position any valid query sees. Each step
  gathers whole ``[block_size * head_dim]`` rows from a ``[2 * Hkv * num_blocks, ...]`` view
  of the layer, with the KV-head and batch axes leading in both einsums so XLA transposes only
  queries and outputs. On a CPU this runs within about 1-2x of attention over contiguous K/V;
  gathering the whole table first and then attending is several times slower.

  ``invariant`` (static): every step is :func:`paged_kv.pallas_kernels.invariant.attention_chunk` over
  ``KEY_TILE`` keys, for decode and prefill alike, so a query's bits depend only on its own K/V and
  position (not the batch, the chunk of queries around it, or the table's width); the block size
  must divide ``KEY_TILE``.

  ``pages`` may be :class:`paged_kv.pallas_kernels.quant.QuantPages`: each chunk's int8/e4m3 K and V
  are gathered as stored (converted to the compute dtype, exactly), and their per-token scales
  ``[Hkv, B, keys]`` with them; K's scales multiply the score columns, V's the probabilities
  before ``P V`` (the softmax denominator sums the unscaled probabilities). No tile is dequantized.
  """
  scales = None
  if quant.is_quant(pages):
    assert not invariant, "the entry points refuse batch_invariant with quantized pages (validate.check_kv_options)"
    pages, scales = pages.values, pages.scales  # e4m3 stored (and gathered) as bits
  b, t, hq, d = q.shape
  _, _, hkv, num_blocks, block_size, _ = pages.shape
  g = hq // hkv
  chunk = max(1, 128 // block_size)
  if invariant:
    # The entry points refuse this before tracing (the execution plan's invariant_reference_block
    # row); kept for direct callers of the reference.
    if invariant_ops.KEY_TILE % block_size:
      raise ValueError(f"batch-invariant attention needs a block size dividing {invariant_ops.KEY_TILE}, "
                       f"got {block_size}")
    chunk = invariant_ops.KEY_TILE // block_size
  bt = sanitize_block_tables(block_tables, num_blocks)
  num_chunks = -(-bt.shape[1] // chunk)
  bt = jnp.pad(bt, ((0, 0), (0, num_chunks * chunk - bt.shape[1])))
  keys = chunk * block_size
  # Rows of every layer, gathered with the layer folded into the row id: with a traced layer
  # (a scan over layers) `pages[layer]` would be a dynamic slice XLA may copy out, one layer's
  # pages per layer per step; a reshape is free and the gather reads only the rows it needs.
  rows = pages.reshape(-1, block_size * d)
  # Quantized pages: the scales' rows ([block_size] per (layer, K|V, head, block)) share the
  # values' row ids, so one id gathers a block's values and its scales.
  scale_rows = None if scales is None else scales.reshape(-1, block_size)
  # K and V are gathered separately, each straight into the layout its einsum reads: one gather
  # of both planes followed by slicing it into K and V made XLA:CPU copy every chunk twice more
  # (scripts/profile_decode.py measured the slices at ~8% of a batch-32 decode step).
  heads = jnp.arange(hkv, dtype=jnp.int32)[:, None]
  k_plane = ((layer * 2 + 0) * hkv + heads) * num_blocks
  v_plane = ((layer * 2 + 1) * hkv + heads) * num_blocks
  kv_planes = jnp.concatenate([k_plane, v_plane])  # [2 * Hkv, 1]
  qk = q.reshape(b, t, hkv, g, d).transpose(2, 0, 1, 3, 4).reshape(hkv, b, t * g, d)
  hi = jax.lax.Precision.HIGHEST
  # A decode step (one query per sequence, G query rows per KV head) is a batch of [G, D] x [D,
  # keys] products: too thin for a matmul kernel, and a dot needs its gathered operand
  # materialised first. As multiply-reduces XLA:CPU fuses the K/V gathers into the reductions:
  # 1.6x faster per layer at batch 64, 640 positions; 1.05x at batch 32 (CPU, against dots on
  # materialised gathers). Prefill rows (T * G of them) stay matmuls.
  decode = t == 1
  # Sliding window: each query's first visible position, and the first chunk any valid query needs
  # (a Python 0 without a window, so the default program is unchanged).
  first_pos, lo = None, 0
  if window is not None:
    first_pos = window_start(last_pos, window)
    lo = jnp.min(jnp.where(valid, first_pos, num_chunks * keys)) // keys
  if slopes is not None:  # [Hq] -> [Hkv, 1, 1, G, 1], query head h = kv * G + g
    slopes = slopes.astype(jnp.float32).reshape(hkv, 1, 1, g, 1)

  def invariant_step(c, carry):
    ids = jax.lax.dynamic_slice_in_dim(bt, c * chunk, chunk, axis=1).reshape(1, -1)  # [1, B * chunk]
    k = rows.at[k_plane + ids].get(mode="promise_in_bounds").reshape(hkv, b, keys, d)
    v = rows.at[v_plane + ids].get(mode="promise_in_bounds").reshape(hkv, b, keys, d)
    pos = c * keys + jnp.arange(keys, dtype=jnp.int32)
    return invariant_ops.attention_chunk(carry, qk, k, v, pos, last_pos, valid, scale, soft_cap, slopes,
                                         first_pos)

  def step(c, carry):
    o, m, l = carry
    ids = jax.lax.dynamic_slice_in_dim(bt, c * chunk, chunk, axis=1).reshape(1, -1)  # [1, B * chunk]
    k = rows.at[k_plane + ids].get(mode="promise_in_bounds").reshape(hkv, b, keys, d)  # in range
    if scale_rows is not None:  # int8/e4m3 -> float32 is exact (e4m3 from its bits: quant.bits_to_float32)
      k = quant.bits_to_float32(k)
      k = k if decode else k.astype(q.dtype)  # exact as well: int8 and e4m3 values fit bf16 and fp16
    if decode:  # [Hkv, B, G, keys]: one multiply-reduce over head_dim, the gather fused in
      s = jnp.sum(qk.astype(jnp.float32)[:, :, :, None, :] * k.astype(jnp.float32)[:, :, None], axis=-1)
    else:
      s = jnp.einsum("kbrd,kbsd->kbrs", qk, k, preferred_element_type=jnp.float32, precision=hi)
    s = s.reshape(hkv, b, t, g, keys)
    if scale_rows is not None:  # K's per-token scale multiplies its score column
      # K's and V's scales in one gather ([2, Hkv, B, keys]): XLA:CPU pays per op at these sizes.
      kv_scales = scale_rows.at[kv_planes + ids].get(mode="promise_in_bounds").reshape(2, hkv, b, keys)
      s = s * kv_scales[0].reshape(hkv, b, 1, 1, keys)
    s = s * scale
    pos = c * keys + jnp.arange(keys, dtype=jnp.int32)
    s = score_knobs(s, soft_cap, slopes, pos, last_pos[None, :, :, None, None])
    m_new, alpha, p = invariant_ops.softmax_update(s, m, pos, last_pos, valid, first_pos)
    v = rows.at[v_plane + ids].get(mode="promise_in_bounds").reshape(hkv, b, keys, d)
    if scale_rows is not None:
      v = quant.bits_to_float32(v)
    rows_p = p.reshape(hkv, b, t * g, keys)
    if scale_rows is not None:  # V's per-token scale multiplies its probability (l keeps p unscaled)
      rows_p = rows_p * kv_scales[1].reshape(hkv, b, 1, keys)
    if decode:
      pv = jnp.sum(rows_p[..., None] * v.astype(jnp.float32)[:, :, None], axis=-2)
    else:
      pv = jnp.einsum("kbrs,kbsd->kbrd", rows_p, v.astype(jnp.float32), preferred_element_type=jnp.float32,
                      precision=hi)
    pv = pv.reshape(hkv, b, t, g, d)
    return alpha[..., None] * o + pv, m_new, alpha * l + p.sum(axis=-1)

  o = jnp.zeros((hkv, b, t, g, d), jnp.float32)
  m = jnp.full((hkv, b, t, g), -jnp.inf, jnp.float32)
  l = jnp.zeros((hkv, b, t, g), jnp.float32)
  needed = jnp.max(jnp.where(valid, last_pos + 1, 0))
  n = jnp.clip((needed + keys - 1) // keys, 0, num_chunks)
  if invariant:
    out = invariant_ops.attention_finish(jax.lax.fori_loop(lo, n, invariant_step, (o, m, l)))
    return out.transpose(1, 2, 0, 3, 4).reshape(b, t, hq, d).astype(q.dtype)
  o, m, l = jax.lax.fori_loop(lo, n, step, (o, m, l))
  out = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
  return out.transpose(1, 2, 0, 3, 4).reshape(b, t, hq, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "batch_invariant"))
def paged_decode_attention_reference(q: jax.Array, pages: PagesLike, layer: int | jax.Array, block_tables: jax.Array,
                                     lengths: jax.Array, *, scale: float, soft_cap: float | None = None,
                                     alibi_slopes: jax.Array | None = None,
                                     batch_invariant: bool = False,
                                     window: int | jax.Array | None = None) -> jax.Array:
  """q [B, Hq, D] -> [B, Hq, D]; attends to positions [0, lengths[b]) (the query at lengths - 1),
  with a ``window`` only to ``[lengths[b] - window, lengths[b])``."""
  out = _paged_attention(q[:, None], pages, layer, block_tables, (lengths - 1)[:, None],
                         (lengths > 0)[:, None], scale, soft_cap, alibi_slopes, batch_invariant, window)
  return out[:, 0]


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "batch_invariant"))
def paged_prefill_attention_reference(q: jax.Array, pages: PagesLike, layer: int | jax.Array, block_tables: jax.Array,
                                      q_start: jax.Array, q_lens: jax.Array, *, scale: float,
                                      soft_cap: float | None = None,
                                      alibi_slopes: jax.Array | None = None,
                                      batch_invariant: bool = False,
                                      window: int | jax.Array | None = None) -> jax.Array:
  """q [B, T, Hq, D] -> [B, T, Hq, D]; query t attends to positions [0, q_start + t], with a
  ``window`` only to ``(q_start + t - window, q_start + t]``."""
  tpos = jnp.arange(q.shape[1], dtype=jnp.int32)
  last_pos = jnp.maximum(q_start, 0)[:, None] + tpos[None, :]  # negative starts clamp to 0
  valid = tpos[None, :] < q_lens[:, None]
  return _paged_attention(q, pages, layer, block_tables, last_pos, valid, scale, soft_cap,
                          alibi_slopes, batch_invariant, window)


@jax.jit
def write_kv_reference(pages: PagesLike, layer: int | jax.Array, k: jax.Array, v: jax.Array,
                       slots: jax.Array) -> PagesLike:
  """pages[layer, 0|1, h, slot // bs, slot % bs] = k|v[n, h] for every row n. Quantized pages:
  each row is quantized (:func:`paged_kv.pallas_kernels.quant.quantize`, K and V rows in one call)
  and its values and scale written at the same slot."""
  rows = jnp.stack([k, v], axis=1)  # [N, 2, Hkv, D]
  if not quant.is_quant(pages):
    return _scatter_rows(pages, layer, rows, slots)
  values, scales = quant.quantize(rows, pages.dtype)
  # e4m3 as bits; the scales as one-element rows, the same scatter on [L, 2, Hkv, NB, bs, 1].
  return quant.QuantPages(values=_scatter_rows(pages.values, layer, quant.as_bits(values), slots),
                          scales=_scatter_rows(pages.scales[..., None], layer, scales[..., None], slots)[..., 0])


def _scatter_rows(pages: jax.Array, layer: int | jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
  """``pages[layer, :, :, slot n] = rows[n]``: ``pages`` ``[L, 2, Hkv, NB, bs, D]``, ``rows``
  ``[N, 2, Hkv, D]`` in its dtype, ``slots`` int32 ``[N]`` (out of range: the null slot 0)."""
  num_layers, _, hkv, num_blocks, block_size, d = pages.shape
  slots = sanitize_slots(slots, num_blocks * block_size)
  flat = pages.reshape(num_layers, 2, hkv, num_blocks * block_size, d)
  # Advanced indices (layer, slots) separated by slices put the N axis first: [N, 2, Hkv, D].
  return flat.at[layer, :, :, slots].set(rows).reshape(pages.shape)


@jax.jit
def copy_blocks_reference(pages: PagesLike, src: jax.Array, dst: jax.Array) -> PagesLike:
  """pages[:, :, :, dst[i]] = pages[:, :, :, src[i]] (all sources read before any write); for
  quantized pages the values and the scales alike (both have the block axis at 3)."""
  num_blocks = pages.shape[3]
  src = sanitize_block_tables(src, num_blocks)
  dst = sanitize_block_tables(dst, num_blocks)
  def copy(a):
    return a.at[:, :, :, dst].set(a[:, :, :, src])

  return jax.tree.map(copy, pages)


def layer_matmul_reference(x: jax.Array, w: StackedWeights, layer: int | jax.Array, scale: jax.Array | None = None,
                           bias: StackedBiases = None, batch_invariant: bool = False) -> Projections:
  """``(scale[layer] * x) @ w[layer] + bias[layer]`` with XLA ops: x ``[M, K]``, w ``[L, K, N]``,
  scale ``[L, K]``, bias ``[L, N]`` (both optional); float32 accumulation, result in x's dtype
  (the bias added after the cast, as the model adds it). A group (``w`` a tuple of ``[L, K, N_i]``,
  ``bias`` None or a tuple of ``[L, N_i]`` or None): each weight's product on its own, a tuple.
  ``batch_invariant``: the product in fixed row tiles (``invariant.matmul``)."""
  if isinstance(w, (tuple, list)):
    biases = (None,) * len(w) if bias is None else tuple(bias)
    return tuple(layer_matmul_reference(x, wi, layer, scale, bi, batch_invariant) for wi, bi in zip(w, biases))
  a = x if scale is None else scale[layer] * x
  if batch_invariant:
    out = invariant_ops.matmul(a, w[layer]).astype(x.dtype)
  else:
    out = jnp.dot(a, w[layer], preferred_element_type=jnp.float32).astype(x.dtype)
  return out if bias is None else out + bias[layer]
