"""Sliding-window attention (``window=``): the Pallas kernels (interpret mode) and the jnp reference
against a float64 NumPy reference, traced per-layer windows in a scan, the null block a
sliding-window manager leaves before the window, and the contiguous attends.

A query at position ``p`` sees key ``k`` iff ``p - window < k <= p``; a traced window <= 0 is full
attention. Shapes are tiny (interpret mode is slow): head_dim 16, block sizes 4 and 8.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.attention_spec import ChunkedLocal, as_spec
from paged_kv.pallas_kernels import decode_attention, invariant, prefill_attention, testing as kt, tiling, validate
from tests import tolerances as tol

IMPLS = ["interpret", "reference"]
# Roundings to bfloat16 along one computation (tests/tolerances.py): the kernel rounds the softmax
# weights before P V and the output, the reference only the output; float64 rounds nothing.
ROUNDINGS = {"interpret": 2, "reference": 1}
D = 16


def _visible(window):
  """The float64 reference's kind for a traced code (0: None, full attention; -C: a chunk of C)."""
  return None if window is None or window == 0 else window


def _decode_want(q, case, lengths, scale, window, **knobs):
  return np.stack([kt.dense_attention(q[b], case.pages, case.layer, case.block_tables[b], int(lengths[b]), scale,
                                      window=window, **knobs) for b in range(len(lengths))])


def _prefill_want(q, case, q_start, q_lens, scale, window, **knobs):
  want = np.zeros(q.shape, np.float64)
  for b in range(q.shape[0]):
    for t in range(int(q_lens[b])):
      want[b, t] = kt.dense_attention(q[b, t], case.pages, case.layer, case.block_tables[b],
                                      int(q_start[b]) + t + 1, scale, window=window, **knobs)
  return want


def _atol(q, case, scale, context, window, impl, **knobs):
  """Against the exact float64 result: the bound between two computations over the keys one query
  sums (at most ``window`` of them), a factor 2 to spare (tests/tolerances.py)."""
  keys = context if window is None or as_spec(window).is_full else min(as_spec(window).span, context)
  return tol.paged_attention_atol(q, case.pages, case.layer, scale, keys, roundings=ROUNDINGS[impl], **knobs)


# (dtype, block_size, group, knobs, windows): odd windows, smaller than a block, not a multiple of the
# block size, a multiple, and larger than every context (the same as no window).
DECODE_CASES = [
    (jnp.float32, 4, 1, "none", (1, 3, 6, 8, 500)),
    (jnp.float32, 8, 4, "cap", (5, 13, 16)),  # GQA group 4, soft cap + window
    (jnp.bfloat16, 4, 2, "alibi", (7, 10)),
]


def _knobs(which, num_q_heads):
  slopes = jnp.linspace(0.05, 0.4, num_q_heads, dtype=jnp.float32)
  return {"none": {}, "cap": {"soft_cap": 1.5}, "alibi": {"alibi_slopes": slopes}}[which]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,block_size,group,which,windows", DECODE_CASES)
def test_decode_window_matches_float64(impl, dtype, block_size, group, which, windows):
  """Static (Python int) and array windows; lengths 0, 1, mid-block and long; one split and (Pallas)
  split-K over the window's tiles."""
  rng = np.random.default_rng(block_size * 10 + group)
  lengths = np.array([1, block_size + 3, 0, 21 * block_size - 5, 9 * block_size], np.int32)
  case = kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=D, num_kv_heads=2, dtype=dtype)
  q = kt.random_queries(rng, (len(lengths), 2 * group, D), dtype)
  ln = jnp.asarray(lengths)
  knobs = _knobs(which, 2 * group)
  scale = 0.4
  for i, w in enumerate(windows):
    # The first a static int (the split rule sized for it), the others int32 arrays (the traced form,
    # one compiled kernel for all).
    window = w if i == 0 else jnp.int32(w)
    got = pk.paged_decode_attention(q, case.pages, case.layer, case.block_tables, ln, scale=scale, impl=impl,
                                    window=window, **knobs)
    assert got.shape == q.shape and got.dtype == q.dtype
    want = _decode_want(q, case, lengths, scale, w, **knobs)
    atol = _atol(q, case, scale, int(lengths.max()), w, impl, **knobs)
    tol.assert_close(got, want, atol, f"{impl} window={w}")
    assert np.all(np.asarray(got[2]) == 0)  # length 0
  if impl == "interpret":  # split-K: several splits share each sequence's window tiles
    w = windows[1] if len(windows) > 1 else windows[0]
    split = decode_attention.paged_decode_attention_pallas(
        q, case.pages, case.layer, case.block_tables, ln, scale=scale, interpret=True, blocks_per_tile=1,
        num_splits=3, window=jnp.int32(w), **knobs)
    tol.assert_close(split, _decode_want(q, case, lengths, scale, w, **knobs),
                     _atol(q, case, scale, int(lengths.max()), w, impl, **knobs), f"split window={w}")


# (block_size, group, chunks): chunks smaller than a block, equal, not a multiple, several blocks,
# larger than every context.
CHUNK_CASES = [(4, 1, (1, 3, 4, 6, 13, 500)), (8, 3, (5, 16, 20))]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size,group,chunks", CHUNK_CASES)
def test_chunked_local_matches_float64(impl, block_size, group, chunks):
  """ChunkedLocal(C) (a query at p sees keys of p's chunk up to p), decode and prefill, static (the
  spec) and traced (its code -C), against the float64 reference; (Pallas) split-K decode and small
  prefill tiles."""
  rng = np.random.default_rng(block_size * 7 + group)
  lengths = np.array([1, block_size + 3, 0, 21 * block_size - 5, 9 * block_size], np.int32)
  case = kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=D, num_kv_heads=2)
  q = kt.random_queries(rng, (len(lengths), 2 * group, D))
  ln = jnp.asarray(lengths)
  q_lens = np.array([1, 5, 0, 7, 3], np.int32)
  q_start = lengths - q_lens
  qp = kt.random_queries(rng, (len(lengths), 7, 2 * group, D))
  pargs = (qp, case.pages, case.layer, case.block_tables, jnp.asarray(q_start), jnp.asarray(q_lens))
  scale, ctx = 0.4, int(lengths.max())
  for c in chunks:
    spec = ChunkedLocal(c)
    for window in (spec, jnp.int32(-c)):
      got = pk.paged_decode_attention(q, case.pages, case.layer, case.block_tables, ln, scale=scale, impl=impl,
                                      window=window)
      tol.assert_close(got, _decode_want(q, case, lengths, scale, spec), _atol(q, case, scale, ctx, spec, impl),
                       f"{impl} decode chunk={c}")
      got = pk.paged_prefill_attention(*pargs, scale=scale, impl=impl, window=window)
      tol.assert_close(got, _prefill_want(qp, case, q_start, q_lens, scale, spec),
                       _atol(qp, case, scale, ctx, spec, impl), f"{impl} prefill chunk={c}")
    if impl == "interpret":
      split = decode_attention.paged_decode_attention_pallas(
          q, case.pages, case.layer, case.block_tables, ln, scale=scale, interpret=True, blocks_per_tile=1,
          num_splits=3, window=jnp.int32(-c))
      tol.assert_close(split, _decode_want(q, case, lengths, scale, spec), _atol(q, case, scale, ctx, spec, impl),
                       f"split chunk={c}")
      small = prefill_attention.paged_prefill_attention_pallas(*pargs, scale=scale, interpret=True, rows_per_tile=16,
                                                               blocks_per_tile=1, window=jnp.int32(-c))
      tol.assert_close(small, _prefill_want(qp, case, q_start, q_lens, scale, spec),
                       _atol(qp, case, scale, ctx, spec, impl), f"small tiles chunk={c}")


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_local_batch_invariant_matches_float64(impl):
  """The batch-invariant kernels (Pallas fixed tiles, the invariant jnp steps) with a chunk of 5
  (blocks of 4), static and traced, decode and prefill."""
  rng = np.random.default_rng(11)
  lengths = np.array([3, 23, 41], np.int32)
  case = kt.make_paged_case(rng, lengths, block_size=4, head_dim=D, num_kv_heads=2)
  q = kt.random_queries(rng, (3, 4, D))
  q_lens = np.array([3, 6, 5], np.int32)
  q_start = lengths - q_lens
  qp = kt.random_queries(rng, (3, 6, 4, D))
  spec, scale, ctx = ChunkedLocal(5), 0.4, int(lengths.max())
  for window in (spec, jnp.int32(-5)):
    got = pk.paged_decode_attention(q, case.pages, case.layer, case.block_tables, jnp.asarray(lengths), scale=scale,
                                    impl=impl, batch_invariant=True, window=window)
    tol.assert_close(got, _decode_want(q, case, lengths, scale, spec), _atol(q, case, scale, ctx, spec, impl),
                     f"{impl} invariant decode")
    got = pk.paged_prefill_attention(qp, case.pages, case.layer, case.block_tables, jnp.asarray(q_start),
                                     jnp.asarray(q_lens), scale=scale, impl=impl, batch_invariant=True, window=window)
    tol.assert_close(got, _prefill_want(qp, case, q_start, q_lens, scale, spec),
                     _atol(qp, case, scale, ctx, spec, impl), f"{impl} invariant prefill")


PREFILL_CASES = [
    (jnp.float32, 4, 1, "none", (1, 3, 6, 500)),
    (jnp.float32, 8, 3, "cap", (5, 13)),  # GQA group 3 (rows of a token straddle row tiles), soft cap
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,block_size,group,which,windows", PREFILL_CASES)
def test_prefill_window_matches_float64(impl, dtype, block_size, group, which, windows):
  """Chunks from 0, after a prefix, mid-block, one token far in, and all padding."""
  rng = np.random.default_rng(block_size * 10 + group + 1)
  num_tokens = 7
  q_start = np.array([0, 2 * block_size, block_size + 3, 17 * block_size - 2, 4], np.int32)
  q_lens = np.array([num_tokens, num_tokens - 2, 3, 1, 0], np.int32)
  case = kt.make_paged_case(rng, q_start + q_lens, block_size=block_size, head_dim=D, num_kv_heads=2,
                            dtype=dtype)
  q = kt.random_queries(rng, (len(q_start), num_tokens, 2 * group, D), dtype)
  knobs = _knobs(which, 2 * group)
  scale = 0.4
  args = (q, case.pages, case.layer, case.block_tables, jnp.asarray(q_start), jnp.asarray(q_lens))
  for i, w in enumerate(windows):
    window = w if i == 0 else jnp.int32(w)
    got = pk.paged_prefill_attention(*args, scale=scale, impl=impl, window=window, **knobs)
    want = _prefill_want(q, case, q_start, q_lens, scale, w, **knobs)
    tol.assert_close(got, want, _atol(q, case, scale, int((q_start + q_lens).max()), w, impl, **knobs),
                     f"{impl} window={w}")
  if impl == "interpret":  # 16-row tiles (a token's heads split across tiles), one block per K/V tile
    w = windows[1]
    got = prefill_attention.paged_prefill_attention_pallas(*args, scale=scale, interpret=True, rows_per_tile=16,
                                                           blocks_per_tile=1, window=jnp.int32(w), **knobs)
    tol.assert_close(got, _prefill_want(q, case, q_start, q_lens, scale, w, **knobs),
                     _atol(q, case, scale, int((q_start + q_lens).max()), w, impl, **knobs), f"small tiles window={w}")


@pytest.mark.parametrize("impl", IMPLS)
def test_traced_per_layer_window_in_scan(impl):
  """One jitted scan over layers with a per-layer code array (0: a global layer, -2: a chunk of 2),
  decode and prefill: each layer's output equals the float64 reference with that layer's kind."""
  rng = np.random.default_rng(5)
  block_size, num_layers = 4, 4
  windows = np.array([3, 0, 9, -2], np.int32)
  lengths = np.array([30, 7, 19], np.int32)
  case = kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=D, num_kv_heads=1, num_layers=num_layers)
  qd = kt.random_queries(rng, (len(lengths), 2, D))
  q_start, q_lens = lengths - 5, np.array([5, 5, 2], np.int32)
  qp = kt.random_queries(rng, (len(lengths), 5, 2, D))

  @jax.jit
  def run(pages, tables, ln, qs, ql, wins):
    def layer(carry, xs):
      i, w = xs
      dec = pk.paged_decode_attention(qd, pages, i, tables, ln, impl=impl, window=w)
      pre = pk.paged_prefill_attention(qp, pages, i, tables, qs, ql, impl=impl, window=w)
      return carry, (dec, pre)
    return jax.lax.scan(layer, 0, (jnp.arange(num_layers, dtype=jnp.int32), wins))[1]

  dec, pre = run(case.pages, case.block_tables, jnp.asarray(lengths), jnp.asarray(q_start), jnp.asarray(q_lens),
                 jnp.asarray(windows))
  scale = D ** -0.5
  for i, w in enumerate(windows):
    lcase = kt.PagedCase(case.pages, case.block_tables, case.lengths, i)
    w = _visible(int(w))
    tol.assert_close(dec[i], _decode_want(qd, lcase, lengths, scale, w),
                     _atol(qd, lcase, scale, int(lengths.max()), w, impl), f"decode layer {i}")
    tol.assert_close(pre[i], _prefill_want(qp, lcase, q_start, q_lens, scale, w),
                     _atol(qp, lcase, scale, int(lengths.max()), w, impl), f"prefill layer {i}")


def _reclaimed(tables, lengths, window, block_size, limit=None):
  """The tables a sliding-window manager leaves: every block whose positions all lie before the
  window (``< length - window``, and ``< limit`` when given) becomes the null block 0."""
  tables = np.array(tables)
  for b, n in enumerate(lengths):
    first = max(int(n) - window, 0) if limit is None else min(max(int(n) - window, 0), limit)
    tables[b, :first // block_size] = 0
  return jnp.asarray(tables)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("garbage", ["nan", "large"])
def test_null_block_before_window_is_never_read(impl, garbage):
  """The null block, whose entries a sliding-window manager writes before the window, holds garbage.

  "nan": the null entries fill whole tiles and chunks before every window (the first 128 positions:
  a Pallas tile is 64 keys here, a reference chunk 128) and the contexts end on a chunk boundary
  (positions past a length in a sequence's last tile are read and masked, as without a window, so
  the null block must be finite there): a finite, exact result proves those tiles are never read.
  "large" (1e4, finite): every block wholly before the window is nulled, so the window's first
  tile reads some of them; they are masked and weigh nothing."""
  rng = np.random.default_rng(9)
  block_size, window = 4, 12
  lengths = np.array([256, 256] if garbage == "nan" else [150, 141], np.int32)
  limit, value = (128, jnp.nan) if garbage == "nan" else (None, 1e4)
  case = kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=D, num_kv_heads=1, share=False)
  q = kt.random_queries(rng, (2, 2, D))
  q_lens = np.array([4, 1], np.int32)
  q_start = lengths - q_lens
  qp = kt.random_queries(rng, (2, 4, 2, D))
  scale = 0.5
  pages = case.pages.at[:, :, :, 0].set(value)
  dec = pk.paged_decode_attention(q, pages, case.layer, _reclaimed(case.block_tables, lengths, window, block_size,
                                                                    limit), jnp.asarray(lengths),
                                  scale=scale, impl=impl, window=window)
  # Prefill: a manager has reclaimed only what the chunk's earliest query no longer sees.
  pre = pk.paged_prefill_attention(qp, pages, case.layer, _reclaimed(case.block_tables, q_start + 1, window,
                                                                     block_size, limit),
                                   jnp.asarray(q_start), jnp.asarray(q_lens), scale=scale, impl=impl, window=window)
  assert np.isfinite(np.asarray(dec)).all() and np.isfinite(np.asarray(pre)).all()
  context = int(lengths.max())
  tol.assert_close(dec, _decode_want(q, case, lengths, scale, window), _atol(q, case, scale, context, window, impl),
                   f"decode, null block {garbage}")
  tol.assert_close(pre, _prefill_want(qp, case, q_start, q_lens, scale, window),
                   _atol(qp, case, scale, context, window, impl), f"prefill, null block {garbage}")


def test_contiguous_attends_take_window():
  """The contiguous cache's attend and the batch-invariant ``contiguous_attention`` (plain_forward's)
  honour ``window`` (int and traced), and the latter gives the paged invariant reference's bits."""
  from paged_kv.models.contiguous import _make_attend

  rng = np.random.default_rng(3)
  b, t, hq, hkv = 2, 40, 2, 1
  q = jnp.asarray(rng.standard_normal((b, t, hq, D)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((b, t, hkv, D)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, t, hkv, D)), jnp.float32)
  scale = 0.3
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  k64, v64, q64 = (np.asarray(x, np.float64) for x in (k, v, q))
  contiguous = jax.jit(functools.partial(invariant.contiguous_attention, scale=scale))
  for w in (5, 0):  # 0 as a traced window: full attention
    vis = _visible(w) or t
    want = np.zeros((b, t, hq, D))
    for bi in range(b):
      for ti in range(t):
        lo = max(ti - vis + 1, 0)
        s = k64[bi, lo:ti + 1, 0] @ q64[bi, ti].T * scale  # [keys, hq]
        p = np.exp(s - s.max(0))
        want[bi, ti] = (p / p.sum(0)).T @ v64[bi, lo:ti + 1, 0]
    atol = tol.attention_atol(jnp.float32, D, min(vis, t), tol.score_magnitude(q, k, scale),
                              float(np.abs(v64).max()))
    window = jnp.int32(w) if w == 0 else w
    cache = jnp.zeros((1, 2, b, t, hkv, D), jnp.float32)
    attend = _make_attend(jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32))
    got, _ = attend(0, q, k, v, cache, scale=scale, window=window)
    tol.assert_close(got, want, atol, f"contiguous attend window={w}")
    inv = contiguous(q, k, v, pos, jnp.ones((b, t), bool), window=jnp.int32(w))
    tol.assert_close(inv, want, atol, f"contiguous_attention window={w}")
  # The paged invariant reference over the same K/V (block 4, the cache in table order) gives the
  # same bits for the last query as contiguous_attention (same key tiles, same steps).
  bs = 4
  nb = t // bs
  pages = np.zeros((1, 2, 1, 1 + b * nb, bs, D), np.float32)
  for bi in range(b):
    for j in range(nb):
      pages[0, :, 0, 1 + bi * nb + j] = np.stack([k[bi, j * bs:(j + 1) * bs, 0], v[bi, j * bs:(j + 1) * bs, 0]])
  pages = jnp.asarray(pages)
  tables = jnp.asarray(1 + np.arange(b * nb, dtype=np.int32).reshape(b, nb))
  paged = pk.paged_decode_attention(q[:, -1], pages, 0, tables, jnp.full((b,), t, jnp.int32), scale=scale,
                                    impl="reference", batch_invariant=True, window=5)
  inv = contiguous(q, k, v, pos, jnp.ones((b, t), bool), window=jnp.int32(5))
  assert np.array_equal(np.asarray(paged), np.asarray(inv[:, -1]))


@pytest.mark.parametrize("bad", [0, 2.5, True, "4", np.int32(0), jnp.zeros((2,), jnp.int32),
                                 jnp.float32(3.0)])
def test_check_window_refuses(bad):
  with pytest.raises(ValueError, match="window"):
    validate.check_window(bad)


def test_window_knob_and_partition():
  assert validate.check_window(None) is None
  assert validate.check_window(np.int64(7)) == 7 and isinstance(validate.check_window(7), int)
  assert validate.check_window(jnp.int16(-1)).dtype == jnp.int32  # a traced-style code: -1 a chunk of 1
  assert validate.check_window(ChunkedLocal(3)) == validate.check_window(-3) == -3  # a chunk's code
  assert tiling.Knobs.of(window=jnp.int32(0)) == tiling.Knobs(window=True)
  assert tiling.Knobs.of(soft_cap=1.0, window=4).describe() == " with soft_cap and window"
  # A static window: the split rule sizes the launch for the window's tiles, not the whole table.
  full = decode_attention.decode_partition(1, 8, 1, 128, 16, 2048, jnp.bfloat16)
  win = decode_attention.decode_partition(1, 8, 1, 128, 16, 2048, jnp.bfloat16, window=4096)
  assert decode_attention.window_blocks(4096, 4, 16, 2048) == 260  # 65 tiles of 64 keys
  covered = win.tiles_per_split * win.num_splits
  assert 65 <= covered < full.tiles_per_split * full.num_splits
