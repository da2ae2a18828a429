"""Batch-invariant building blocks: every output row's bits depend on that row's inputs only.

XLA:CPU picks a dot's kernel, and a reduction's vectorisation, from the whole operand shape, so a
row's float32 result changes with the number of rows M beside it (measured on JAX 0.12, XLA:CPU,
scripts/bench_batch_invariant.py --probe): ``x @ W`` gives row 0 different bits at M = 1, at M in
2..33 and at M >= 64 (K = 256..8192); ``x.sum(-1)`` and RMSNorm's ``mean(x * x)`` over d = 128 change
at M >= 32 (d = 259, 384: M >= 16; d = 2048: M >= 2); the multiply-reduce ``(x[:, :, None] *
W).sum(1)`` at M >= 64. The formulations here fix the order of every sum per row by construction:

* ``tree_sum``: a pairwise sum over one axis as explicit slices and element-wise adds (the axis
  zero-padded to a power of two), so the order is the tree, whatever the other axes' sizes.
  Element-wise ops compute each element alone (XLA does not reassociate float adds).
* ``matmul``: ``x[M, K] @ w[K, N]`` as a loop over tiles of ``ROW_TILE`` rows (M zero-padded),
  each tile one dot of the one shape ``[ROW_TILE, K] @ [K, N]``: the same kernel for every tile,
  and within it every row computed alike (measured: a row's bits do not depend on its tile, its
  place in the tile or the other rows, for M 1..300 and K, N of the built-in model and 1B widths).
* ``attention_chunk``: one step of the online softmax over a tile of ``KEY_TILE`` keys, scores,
  the weights' sum and the weighted values all ``tree_sum``s; the same code for a token whether
  it is prefilled (many queries) or decoded (one), over paged or contiguous K/V.

Used by the models' ``batch_invariant`` mode (``paged_kv.models.llama``, the reference attention in
``paged_kv.pallas_kernels.reference``, ``paged_kv.models.contiguous.score_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from paged_kv.pallas_kernels.score_rules import score_knobs, window_start

ROW_TILE = 16
"""Rows per dot in ``matmul``: decode batches of up to 16 rows run one dot; larger ones loop."""

PARTS = 2
"""Parts of a split ``matmul`` (its ``split``): the largest tensor-parallel degree whose bits equal
one device's."""

KEY_TILE = 128
"""Keys per online-softmax step in the invariant attention (paged or contiguous)."""


def tree_sum(x: jax.Array, axis: int = -1) -> jax.Array:
  """Sum over ``axis`` in a fixed pairwise order (halves added element-wise, repeatedly), so each
  result depends only on its own slice of ``x``. The axis is zero-padded to a power of two."""
  axis = axis % x.ndim
  n = x.shape[axis]
  size = 1 << max(0, (n - 1).bit_length())
  if size != n:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - n)
    x = jnp.pad(x, pad)
  while x.shape[axis] > 1:
    half = x.shape[axis] // 2
    x = jax.lax.slice_in_dim(x, 0, half, axis=axis) + jax.lax.slice_in_dim(x, half, 2 * half, axis=axis)
  return jax.lax.squeeze(x, (axis,))


def matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, split: str | None = None) -> jax.Array:
  """``x[M, K] @ w[K, N]`` (``w[N, K]`` with ``transpose_w``) -> ``[M, N]`` in float32, each row's
  bits independent of M and of the other rows: ``ROW_TILE``-row tiles, one dot shape (see the
  module docstring).

  ``split`` makes the bits independent of the tensor-parallel degree too (1 or ``PARTS``), by
  always computing the product in ``PARTS`` parts, as one dot batched over the parts, whether or
  not the weight is sharded: ``"k"`` (row-parallel projections: o_proj, down, whose K GSPMD
  shards) cuts K into ``PARTS`` ranges whose ``[M, N]`` partials are added (two terms: the same
  bits in either order, so an all-reduce over 2 devices adds them as one device does); ``"n"``
  (column-parallel: q/k/v, gate/up, a vocab-parallel head) cuts N into ``PARTS`` column ranges. On
  ``PARTS`` devices GSPMD gives each device one part of the batched dot, the same dot shape and
  operands as on one device. None (or a dimension ``PARTS`` does not divide): one dot."""
  m, k = x.shape
  n = w.shape[0 if transpose_w else 1]
  tiles = -(-m // ROW_TILE)
  xp = jnp.pad(x, ((0, tiles * ROW_TILE - m), (0, 0))).reshape(tiles, ROW_TILE, k)
  dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
  if split not in (None, "k", "n"):
    raise ValueError(f"split must be None, 'k' or 'n', got {split!r}")
  if split == "k" and k % PARTS == 0:
    # w [PARTS, K / PARTS, N]; each tile [PARTS, ROW_TILE, K / PARTS]; partials summed.
    wp = w.reshape(n, PARTS, k // PARTS).transpose(1, 2, 0) if transpose_w else w.reshape(PARTS, k // PARTS, n)

    def tile(a):
      ap = a.reshape(ROW_TILE, PARTS, k // PARTS).transpose(1, 0, 2)
      y = jax.lax.dot_general(ap, wp, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
      return y[0] + y[1]
  elif split == "n" and n % PARTS == 0:
    # w [PARTS, K, N / PARTS]; x broadcast over the parts; the parts' columns side by side.
    wp = (w.reshape(PARTS, n // PARTS, k).transpose(0, 2, 1) if transpose_w
          else w.reshape(k, PARTS, n // PARTS).transpose(1, 0, 2))

    def tile(a):
      ab = jnp.broadcast_to(a[None], (PARTS, ROW_TILE, k))
      y = jax.lax.dot_general(ab, wp, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
      return y.transpose(1, 0, 2).reshape(ROW_TILE, n)
  else:
    def tile(a):
      return jax.lax.dot_general(a, w, dims, preferred_element_type=jnp.float32)

  out = tile(xp[0])[None] if tiles == 1 else jax.lax.map(tile, xp)
  return out.reshape(tiles * ROW_TILE, -1)[:m]


def row_tiles(fn: Callable[..., jax.Array], *xs: jax.Array) -> jax.Array:
  """``fn`` applied to arrays ``xs`` (each ``[M, ...]``) in tiles of ``ROW_TILE`` rows (M
  zero-padded), one call shape for every tile: ``[M, *fn's trailing shape]``. For element-wise
  work whose bits XLA:CPU lets depend on the whole shape (RoPE's products of cos and sin: a
  position got other bits in a one-token decode step than in a chunk); ``fn`` must map each row
  alone."""
  m = xs[0].shape[0]
  tiles = -(-m // ROW_TILE)
  tiled = tuple(jnp.pad(x, [(0, tiles * ROW_TILE - m)] + [(0, 0)] * (x.ndim - 1)).reshape(
      tiles, ROW_TILE, *x.shape[1:]) for x in xs)
  out = fn(*(x[0] for x in tiled))[None] if tiles == 1 else jax.lax.map(lambda a: fn(*a), tiled)
  return out.reshape(tiles * ROW_TILE, *out.shape[2:])[:m]


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """``x / sqrt(mean(x^2) + eps)`` over the last axis in float32 (result in x's dtype), the mean a
  ``tree_sum``."""
  x32 = x.astype(jnp.float32)
  mean = tree_sum(x32 * x32, -1)[..., None] / x.shape[-1]
  return (x32 * jax.lax.rsqrt(mean + eps)).astype(x.dtype)


def log_softmax(logits: jax.Array) -> jax.Array:
  """``log_softmax`` over the last axis with the normaliser a ``tree_sum`` (max is exact in any
  order)."""
  x = logits.astype(jnp.float32)
  m = jnp.max(x, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  shifted = x - m
  return shifted - jnp.log(tree_sum(jnp.exp(shifted), -1))[..., None]


Carry = tuple[jax.Array, jax.Array, jax.Array]


def attention_chunk(carry: Carry, qk: jax.Array, k: jax.Array, v: jax.Array, key_pos: jax.Array,
                    last_pos: jax.Array, valid: jax.Array, scale: float, soft_cap: float | None = None,
                    slopes: jax.Array | None = None, first_pos: jax.Array | None = None) -> Carry:
  """One online-softmax step over ``KEY_TILE`` keys, identical per query row whatever the batch.

  carry ``(o [H, B, T, G, D], m [H, B, T, G], l [H, B, T, G])`` float32; qk ``[H, B, T * G, D]``
  (queries grouped by KV head ``H``); k, v ``[H, B, keys, D]``; key_pos int32 ``[keys]``; last_pos
  int32 and valid bool ``[B, T]`` (query ``(b, t)`` sees key positions ``<= last_pos``, nothing
  when not valid); slopes None or float32 ``[H, 1, 1, G, 1]``; first_pos None or int32 ``[B, T]``
  (a sliding window: query ``(b, t)`` sees no key before ``first_pos``). Returns the new carry."""
  o, m, denom = carry
  h, b, t, g, d = o.shape
  keys = k.shape[2]
  s = tree_sum(qk.astype(jnp.float32)[:, :, :, None, :] * k.astype(jnp.float32)[:, :, None], -1)
  s = s.reshape(h, b, t, g, keys) * scale
  s = score_knobs(s, soft_cap, slopes, key_pos, last_pos[None, :, :, None, None])
  m_new, alpha, p = softmax_update(s, m, key_pos, last_pos, valid, first_pos)
  pv = tree_sum(p.reshape(h, b, t * g, keys)[..., None] * v.astype(jnp.float32)[:, :, None], -2)
  return alpha[..., None] * o + pv.reshape(h, b, t, g, d), m_new, alpha * denom + tree_sum(p, -1)


def softmax_update(s: jax.Array, m: jax.Array, key_pos: jax.Array, last_pos: jax.Array, valid: jax.Array,
                   first_pos: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One key tile's online-softmax update, shared by the reference attention and
  :func:`attention_chunk`: scores ``s [H, B, T, G, keys]`` float32 (scaled, knobs applied), the
  running max ``m [H, B, T, G]``, key positions ``[keys]``, each query's ``last_pos`` and
  ``valid`` ``[B, T]``, and with a sliding window each query's first visible position ``first_pos``
  int32 ``[B, T]`` (None: no lower bound, the same program as before). Returns ``(new max,
  alpha = exp(old - new max), weights p)``, masked keys weighing 0 and a row with no key yet
  keeping a max of -inf. Element-wise and a max: exact, whatever the batch."""
  mask = (key_pos[None, None, :] <= last_pos[:, :, None]) & valid[:, :, None]
  if first_pos is not None:
    mask = mask & (key_pos[None, None, :] >= first_pos[:, :, None])
  mask = mask[None, :, :, None, :]
  s = jnp.where(mask, s, -jnp.inf)
  m_new = jnp.maximum(m, s.max(axis=-1))
  m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  alpha = jnp.exp(m - m_safe)
  p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
  return m_new, alpha, p


def attention_init(h: int, b: int, t: int, g: int, d: int) -> Carry:
  """The empty carry of ``attention_chunk``."""
  return (jnp.zeros((h, b, t, g, d), jnp.float32), jnp.full((h, b, t, g), -jnp.inf, jnp.float32),
          jnp.zeros((h, b, t, g), jnp.float32))


def attention_finish(carry: Carry) -> jax.Array:
  """``o / denom`` of a finished carry (zeros where nothing was seen): ``[H, B, T, G, D]`` float32."""
  o, _, denom = carry
  return jnp.where(denom[..., None] > 0, o / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)


def contiguous_attention(q: jax.Array, k: jax.Array, v: jax.Array, last_pos: jax.Array, valid: jax.Array,
                         scale: float, soft_cap: float | None = None, slopes: jax.Array | None = None,
                         window: int | jax.Array | None = None) -> jax.Array:
  """Causal attention over contiguous K/V with the invariant steps: q ``[B, T, QH, D]``, k, v
  ``[B, S, KVH, D]`` (key ``s`` at position ``s``), last_pos/valid ``[B, T]``; slopes None or
  float ``[QH]``; window None, an attention code (an int or int32 scalar: W a window, -C a chunk, 0
  none) or an ``AttentionSpec``, as
  :func:`paged_kv.pallas_kernels.score_rules.window_start`. Returns ``[B, T, QH, D]`` in q's dtype;
  the same bits per query as the paged reference in invariant mode (same key tiles, same steps;
  tiles wholly before every query's window are skipped, which leaves a carry's bits unchanged)."""
  b, t, hq, d = q.shape
  s_len, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  n = -(-s_len // KEY_TILE)
  pad = ((0, 0), (0, n * KEY_TILE - s_len), (0, 0), (0, 0))
  kt = jnp.pad(k, pad).transpose(2, 0, 1, 3)  # [H, B, S', D]
  vt = jnp.pad(v, pad).transpose(2, 0, 1, 3)
  qk = q.reshape(b, t, hkv, g, d).transpose(2, 0, 1, 3, 4).reshape(hkv, b, t * g, d)
  if slopes is not None:
    slopes = slopes.astype(jnp.float32).reshape(hkv, 1, 1, g, 1)

  def step(c, carry):
    kc = jax.lax.dynamic_slice_in_dim(kt, c * KEY_TILE, KEY_TILE, axis=2)
    vc = jax.lax.dynamic_slice_in_dim(vt, c * KEY_TILE, KEY_TILE, axis=2)
    pos = c * KEY_TILE + jnp.arange(KEY_TILE, dtype=jnp.int32)
    return attention_chunk(carry, qk, kc, vc, pos, last_pos, valid, scale, soft_cap, slopes, first_pos)

  first_pos, lo = None, 0
  if window is not None:
    first_pos = window_start(last_pos, window)
    lo = jnp.min(jnp.where(valid, first_pos, s_len)) // KEY_TILE
  out = attention_finish(jax.lax.fori_loop(lo, n, step, attention_init(hkv, b, t, g, d)))
  return out.transpose(1, 2, 0, 3, 4).reshape(b, t, hq, d).astype(q.dtype)
