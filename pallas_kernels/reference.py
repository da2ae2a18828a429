"""Pure-``jnp`` references for every kernel, also the XLA implementation used off-GPU.

These take already-validated arguments (see :mod:`pallas_kernels.validate`) and follow exactly
the semantics documented in :mod:`pallas_kernels`:

* Out-of-range block-table entries (negative or >= num_blocks) are redirected to the null
  block 0 (:func:`sanitize_block_tables`); out-of-range slots go to slot 0, inside the null
  block (:func:`sanitize_slots`). Nothing ever reads or writes another sequence's block
  because of a bad index, and nothing wraps around like negative NumPy indices would.
* Positions beyond ``max_blocks_per_seq * block_size`` do not exist: a length larger than
  the table covers attends to the whole table.

The attention references gather each sequence's blocks into a contiguous
``[num_kv_heads, batch, max_blocks * block_size, head_dim]`` array, which costs memory
proportional to the *table* size, not to the sequence lengths. That is fine on a CPU and at
test sizes; the Pallas kernels read blocks in place instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NULL_BLOCK = 0


def sanitize_block_tables(block_tables: jax.Array, num_blocks: int) -> jax.Array:
  """Maps entries outside [0, num_blocks) to the null block 0."""
  ok = (block_tables >= 0) & (block_tables < num_blocks)
  return jnp.where(ok, block_tables, NULL_BLOCK).astype(jnp.int32)


def sanitize_slots(slots: jax.Array, num_slots: int) -> jax.Array:
  """Maps slots outside [0, num_blocks * block_size) to slot 0 (inside the null block)."""
  ok = (slots >= 0) & (slots < num_slots)
  return jnp.where(ok, slots, NULL_BLOCK).astype(jnp.int32)


def _gather_kv(pages, layer, block_tables):
  """Returns K, V as [num_kv_heads, B, max_blocks * block_size, head_dim]."""
  _, _, num_kv_heads, num_blocks, block_size, head_dim = pages.shape
  bt = sanitize_block_tables(block_tables, num_blocks)
  b, m = bt.shape
  kv = pages[layer][:, :, bt]  # [2, Hkv, B, M, bs, D]
  kv = kv.reshape(2, num_kv_heads, b, m * block_size, head_dim)
  return kv[0], kv[1]


def _attend(q, k, v, mask, scale):
  """q [B, T, Hkv, G, D]; k, v [Hkv, B, S, D]; mask [B, T, S] -> [B, T, Hkv, G, D] float32."""
  logits = jnp.einsum("btkgd,kbsd->btkgs", q, k, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)
  logits = logits * scale
  mask = mask[:, :, None, None, :]
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  out = jnp.einsum("btkgs,kbsd->btkgd", p, v.astype(jnp.float32),
                   preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
  return jnp.where(l > 0, out / jnp.where(l > 0, l, 1.0), 0.0)


@functools.partial(jax.jit, static_argnames=("layer", "scale"))
def paged_decode_attention_reference(q, pages, layer, block_tables, lengths, *, scale):
  """q [B, Hq, D] -> [B, Hq, D]; attends to positions [0, lengths[b])."""
  b, hq, d = q.shape
  hkv = pages.shape[2]
  k, v = _gather_kv(pages, layer, block_tables)
  s = k.shape[2]
  mask = jnp.arange(s)[None, None, :] < lengths[:, None, None]  # [B, 1, S]
  out = _attend(q.reshape(b, 1, hkv, hq // hkv, d), k, v, mask, scale)
  return out.reshape(b, hq, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("layer", "scale"))
def paged_prefill_attention_reference(q, pages, layer, block_tables, q_start, q_lens, *, scale):
  """q [B, T, Hq, D] -> [B, T, Hq, D]; query t attends to positions [0, q_start + t]."""
  b, t, hq, d = q.shape
  hkv = pages.shape[2]
  k, v = _gather_kv(pages, layer, block_tables)
  s = k.shape[2]
  tpos = jnp.arange(t)
  qpos = jnp.maximum(q_start, 0)[:, None] + tpos[None, :]  # [B, T]; negative starts clamp to 0
  valid = tpos[None, :] < q_lens[:, None]  # [B, T]
  mask = (jnp.arange(s)[None, None, :] <= qpos[:, :, None]) & valid[:, :, None]
  out = _attend(q.reshape(b, t, hkv, hq // hkv, d), k, v, mask, scale)
  return out.reshape(b, t, hq, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("layer",))
def write_kv_reference(pages, layer, k, v, slots):
  """pages[layer, 0|1, h, slot // bs, slot % bs] = k|v[n, h] for every row n."""
  num_layers, _, hkv, num_blocks, block_size, d = pages.shape
  slots = sanitize_slots(slots, num_blocks * block_size)
  flat = pages.reshape(num_layers, 2, hkv, num_blocks * block_size, d)
  # Advanced indices (layer, slots) separated by slices put the N axis first: [N, 2, Hkv, D].
  flat = flat.at[layer, :, :, slots].set(jnp.stack([k, v], axis=1))
  return flat.reshape(pages.shape)


@jax.jit
def copy_blocks_reference(pages, src, dst):
  """pages[:, :, :, dst[i]] = pages[:, :, :, src[i]] (all sources read before any write)."""
  num_blocks = pages.shape[3]
  src = sanitize_block_tables(src, num_blocks)
  dst = sanitize_block_tables(dst, num_blocks)
  return pages.at[:, :, :, dst].set(pages[:, :, :, src])
