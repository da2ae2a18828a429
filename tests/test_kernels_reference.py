"""The XLA references against an independent dense computation, and input validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.pallas_kernels import testing as kt
from tests import tolerances as tol

# Against the float64 dense attention only the reference rounds: in bfloat16, its output once.
REFERENCE = 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_size,head_dim,group", [(8, 64, 1), (16, 128, 4), (32, 64, 8)])
def test_decode_reference_matches_dense(dtype, block_size, head_dim, group):
  rng = np.random.default_rng(block_size * 7 + group)
  lengths = [1, block_size + 3, 5 * block_size - 1, 0, 2 * block_size]
  case = kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=head_dim,
                            num_kv_heads=2, dtype=dtype)
  q = kt.random_queries(rng, (len(lengths), 2 * group, head_dim), dtype)
  out = pk.paged_decode_attention(q, case.pages, case.layer, case.block_tables,
                                  jnp.asarray(case.lengths), impl="reference")
  assert out.shape == q.shape and out.dtype == q.dtype
  scale = head_dim ** -0.5
  want = np.stack([kt.dense_attention(q[b], case.pages, case.layer, case.block_tables[b], n, scale)
                   for b, n in enumerate(case.lengths)])
  atol = tol.paged_attention_atol(q, case.pages, case.layer, scale, max(lengths),
                                  roundings=REFERENCE)
  tol.assert_close(out, want, atol, "reference vs float64")
  assert np.all(np.asarray(out[3]) == 0)  # length 0 gives zeros


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill_reference_matches_dense(dtype):
  rng = np.random.default_rng(1)
  block_size, head_dim, group, num_tokens = 16, 64, 4, 7
  q_start = np.array([0, 32, 21, 5], np.int32)
  q_lens = np.array([7, 4, 1, 0], np.int32)
  case = kt.make_paged_case(rng, q_start + q_lens, block_size=block_size, head_dim=head_dim,
                            num_kv_heads=2, dtype=dtype)
  q = kt.random_queries(rng, (4, num_tokens, 2 * group, head_dim), dtype)
  out = pk.paged_prefill_attention(q, case.pages, case.layer, case.block_tables,
                                   jnp.asarray(q_start), jnp.asarray(q_lens), scale=0.1,
                                   impl="reference")
  atol = tol.paged_attention_atol(q, case.pages, case.layer, 0.1, int(max(q_start + q_lens)),
                                  roundings=REFERENCE)
  for b in range(4):
    for t in range(num_tokens):
      visible = q_start[b] + t + 1 if t < q_lens[b] else 0
      want = kt.dense_attention(q[b, t], case.pages, case.layer, case.block_tables[b], visible, 0.1)
      if visible:
        tol.assert_close(out[b, t], want, atol, f"reference vs float64 at ({b}, {t})")
      else:
        assert np.all(np.asarray(out[b, t]) == 0)


def test_prefill_last_token_equals_decode():
  rng = np.random.default_rng(2)
  case = kt.make_paged_case(rng, [13, 40], block_size=8, head_dim=64, num_kv_heads=2)
  q = kt.random_queries(rng, (2, 5, 4, 64))
  q_start, q_lens = jnp.array([8, 35], jnp.int32), jnp.array([5, 5], jnp.int32)
  pre = pk.paged_prefill_attention(q, case.pages, 1, case.block_tables, q_start, q_lens,
                                   impl="reference")
  dec = pk.paged_decode_attention(q[:, -1], case.pages, 1, case.block_tables,
                                  q_start + q_lens, impl="reference")
  # The same reference over different query shapes: equal up to summation order.
  atol = tol.paged_attention_atol(q, case.pages, 1, 64 ** -0.5, 40)
  tol.assert_close(pre[:, -1], dec, atol, "prefill vs decode")


def test_write_kv_and_copy_blocks_reference():
  rng = np.random.default_rng(3)
  case = kt.make_paged_case(rng, [20, 9], block_size=8, head_dim=64, num_kv_heads=2, num_layers=3)
  pages = np.asarray(case.pages)
  k = kt.random_queries(rng, (3, 2, 64))
  v = kt.random_queries(rng, (3, 2, 64))
  slots = np.array([17, 2, 5 * 8 + 7], np.int32)
  out = np.asarray(pk.write_kv(case.pages, 2, k, v, jnp.asarray(slots), impl="reference"))
  want = pages.copy()
  for n, s in enumerate(slots):
    want[2, 0, :, s // 8, s % 8] = k[n]
    want[2, 1, :, s // 8, s % 8] = v[n]
  np.testing.assert_array_equal(out, want)

  src, dst = np.array([1, 4, 0], np.int32), np.array([5, 2, 0], np.int32)
  out = np.asarray(pk.copy_blocks(case.pages, jnp.asarray(src), jnp.asarray(dst), impl="reference"))
  want = pages.copy()
  want[:, :, :, 5] = pages[:, :, :, 1]
  want[:, :, :, 2] = pages[:, :, :, 4]
  np.testing.assert_array_equal(out, want)


def test_out_of_range_indices_clamp_to_null_block():
  rng = np.random.default_rng(4)
  case = kt.make_paged_case(rng, [16], block_size=8, head_dim=64, num_kv_heads=1)
  num_blocks = case.pages.shape[3]
  bad = case.block_tables.at[0, 1].set(num_blocks + 5)
  nulled = case.block_tables.at[0, 1].set(0)
  q = kt.random_queries(rng, (1, 2, 64))
  ln = jnp.array([16], jnp.int32)
  np.testing.assert_array_equal(
      pk.paged_decode_attention(q, case.pages, 1, bad, ln, impl="reference"),
      pk.paged_decode_attention(q, case.pages, 1, nulled, ln, impl="reference"))
  neg = case.block_tables.at[0, 1].set(-1)
  np.testing.assert_array_equal(
      pk.paged_decode_attention(q, case.pages, 1, neg, ln, impl="reference"),
      pk.paged_decode_attention(q, case.pages, 1, nulled, ln, impl="reference"))
  # A negative slot must not wrap around to the last block.
  k = kt.random_queries(rng, (1, 1, 64))
  out = pk.write_kv(case.pages, 0, k, k, jnp.array([-1], jnp.int32), impl="reference")
  np.testing.assert_array_equal(out[:, :, :, 1:], case.pages[:, :, :, 1:])


def _args():
  pages = jax.ShapeDtypeStruct((2, 2, 2, 10, 8, 64), jnp.float32)
  q = jax.ShapeDtypeStruct((3, 4, 64), jnp.float32)
  bt = jax.ShapeDtypeStruct((3, 5), jnp.int32)
  ln = jax.ShapeDtypeStruct((3,), jnp.int32)
  return pages, q, bt, ln


def _sds(shape, dtype=jnp.int32):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("change,match", [
    (dict(pages=_sds((2, 2, 10, 8, 64), jnp.float32)), "pages must have rank 6"),
    (dict(pages=_sds((2, 3, 2, 10, 8, 64), jnp.float32)), "axis 1 must have size 2"),
    (dict(pages=_sds((2, 2, 2, 10, 12, 64), jnp.float32)), "block_size .* power of two, got 12"),
    (dict(pages=_sds((2, 2, 2, 10, 8, 64), jnp.int32)), "pages dtype"),
    (dict(q=_sds((3, 3, 64), jnp.float32)), "num_q_heads=3 must be a positive multiple of num_kv_heads=2"),
    (dict(q=_sds((3, 4, 32), jnp.float32)), "q head_dim 32 does not match pages head_dim 64"),
    (dict(q=_sds((3, 4, 64), jnp.bfloat16)), "q dtype bfloat16 must equal pages dtype float32"),
    (dict(q=_sds((3, 64), jnp.float32)), "q must have rank 3"),
    (dict(bt=_sds((4, 5))), "block_tables batch 4 does not match q batch 3"),
    (dict(bt=_sds((3, 5), jnp.int64 if jax.config.x64_enabled else jnp.uint32)), "block_tables must be int32"),
    (dict(ln=_sds((3,), jnp.float32)), "lengths must be int32"),
    (dict(ln=_sds((2,))), r"lengths must have shape \(3,\)"),
    (dict(layer=2), r"layer=2 out of range \[0, 2\)"),
    (dict(layer=1.0), "layer must be a static Python int"),
    (dict(impl="cuda"), "impl must be one of"),
])
def test_decode_rejects_bad_inputs(change, match):
  pages, q, bt, ln = _args()
  a = dict(pages=pages, q=q, bt=bt, ln=ln, layer=1, impl="reference")
  a.update(change)
  with pytest.raises(ValueError, match=match):
    pk.paged_decode_attention(a["q"], a["pages"], a["layer"], a["bt"], a["ln"], impl=a["impl"])


def test_other_entry_points_reject_bad_inputs():
  pages, _, bt, ln = _args()
  q4 = _sds((3, 6, 4, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"q_lens must have shape \(3,\)"):
    pk.paged_prefill_attention(q4, pages, 0, bt, ln, _sds((4,)))
  with pytest.raises(ValueError, match="q_start must be int32"):
    pk.paged_prefill_attention(q4, pages, 0, bt, _sds((3,), jnp.float32), ln)
  kv = _sds((5, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"k must have shape .* \(5, 2, 64\)"):
    pk.write_kv(pages, 0, _sds((5, 4, 64), jnp.float32), kv, _sds((5,)))
  with pytest.raises(ValueError, match="v dtype bfloat16"):
    pk.write_kv(pages, 0, kv, _sds((5, 2, 64), jnp.bfloat16), _sds((5,)))
  with pytest.raises(ValueError, match="slots must be int32"):
    pk.write_kv(pages, 0, kv, kv, _sds((5,), jnp.float32))
  with pytest.raises(ValueError, match=r"dst must have shape \(4,\)"):
    pk.copy_blocks(pages, _sds((4,)), _sds((3,)))
  odd = _sds((2, 2, 2, 10, 8, 48), jnp.float32)
  with pytest.raises(ValueError, match="head_dim=48: the Pallas"):
    pk.copy_blocks(odd, _sds((4,)), _sds((4,)), impl="interpret")
  with pytest.raises(ValueError, match="scale must be a Python float"):
    pk.paged_decode_attention(_sds((3, 4, 64), jnp.float32), pages, 0, bt, ln, scale="x")


def test_auto_dispatch_and_use_under_jit():
  rng = np.random.default_rng(5)
  case = kt.make_paged_case(rng, [9, 30], block_size=8, head_dim=64, num_kv_heads=2)
  q = kt.random_queries(rng, (2, 4, 64))
  ln = jnp.asarray(case.lengths)
  if jax.default_backend() != "gpu":
    assert pk.resolve_impl("auto", 64) == "reference"
  assert pk.resolve_impl("auto", 48) == "reference"
  assert pk.resolve_impl("interpret", 64) == "interpret"

  @jax.jit
  def step(pages, q, tables, lengths, k, slots):
    pages = pk.write_kv(pages, 1, k, k, slots)
    return pk.paged_decode_attention(q, pages, 1, tables, lengths), pages

  k = kt.random_queries(rng, (2, 2, 64))
  # Distinct offsets: the two tables share their first block.
  slots = case.block_tables[:, 0] * 8 + jnp.array([1, 2], jnp.int32)
  out, pages = step(case.pages, q, case.block_tables, ln, k, slots)
  want_pages = pk.write_kv(case.pages, 1, k, k, slots, impl="reference")
  want = pk.paged_decode_attention(q, want_pages, 1, case.block_tables, ln, impl="reference")
  atol = tol.paged_attention_atol(q, want_pages, 1, 64 ** -0.5, 30)
  tol.assert_close(out, want, atol, "jit vs eager")
  np.testing.assert_array_equal(pages, want_pages)


def _knobs(rng, num_q_heads, which):
  """Attention knobs of a case: ``which`` in {"cap", "alibi", "both"}."""
  slopes = jnp.asarray(rng.uniform(0.02, 0.5, num_q_heads), jnp.float32)
  return {"cap": {"soft_cap": 2.0}, "alibi": {"alibi_slopes": slopes},
          "both": {"soft_cap": 1.5, "alibi_slopes": slopes}}[which]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("which", ["cap", "alibi", "both"])
def test_reference_knobs_match_dense(dtype, which):
  """Soft-capping and ALiBi in the decode and prefill references against float64, with partial
  blocks and GQA (group 4)."""
  rng = np.random.default_rng(3)
  block_size, head_dim, group = 8, 32, 4
  lengths = [1, block_size + 3, 4 * block_size - 2, 0]
  case = kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=head_dim,
                            num_kv_heads=2, dtype=dtype)
  knobs = _knobs(rng, 2 * group, which)
  q = kt.random_queries(rng, (len(lengths), 2 * group, head_dim), dtype)
  scale = 0.3  # larger than head_dim ** -0.5, so the cap bites
  out = pk.paged_decode_attention(q, case.pages, case.layer, case.block_tables,
                                  jnp.asarray(case.lengths), scale=scale, impl="reference", **knobs)
  want = np.stack([kt.dense_attention(q[b], case.pages, case.layer, case.block_tables[b], n, scale,
                                      **knobs) for b, n in enumerate(case.lengths)])
  atol = tol.paged_attention_atol(q, case.pages, case.layer, scale, max(lengths),
                                  roundings=REFERENCE, **knobs)
  tol.assert_close(out, want, atol, f"decode reference with {which} vs float64")
  plain = np.stack([kt.dense_attention(q[b], case.pages, case.layer, case.block_tables[b], n, scale)
                    for b, n in enumerate(case.lengths)])
  assert np.abs(plain - want).max() > 10 * atol  # the knob changes the result beyond the tolerance

  q_start = np.array([0, block_size - 2, 2 * block_size + 1], np.int32)
  q_lens = np.array([5, 4, 2], np.int32)
  case = kt.make_paged_case(rng, q_start + q_lens, block_size=block_size, head_dim=head_dim,
                            num_kv_heads=2, dtype=dtype)
  q = kt.random_queries(rng, (3, 5, 2 * group, head_dim), dtype)
  out = pk.paged_prefill_attention(q, case.pages, case.layer, case.block_tables,
                                   jnp.asarray(q_start), jnp.asarray(q_lens), scale=scale,
                                   impl="reference", **knobs)
  atol = tol.paged_attention_atol(q, case.pages, case.layer, scale, int(max(q_start + q_lens)),
                                  roundings=REFERENCE, **knobs)
  for b in range(3):
    for t in range(int(q_lens[b])):
      want = kt.dense_attention(q[b, t], case.pages, case.layer, case.block_tables[b],
                                int(q_start[b]) + t + 1, scale, **knobs)
      tol.assert_close(out[b, t], want, atol, f"prefill reference with {which} at ({b}, {t})")


@pytest.mark.parametrize("knobs,match", [
    ({"soft_cap": 0.0}, "soft_cap=0.0 must be a finite float > 0"),
    ({"soft_cap": float("inf")}, "soft_cap=inf"),
    ({"soft_cap": jnp.float32(2.0)}, "soft_cap must be a Python float"),
    ({"alibi_slopes": jnp.ones((3,))}, r"alibi_slopes must have shape \[num_q_heads\] = \(4,\)"),
    ({"alibi_slopes": jnp.ones((4,), jnp.int32)}, "alibi_slopes must be a float array"),
])
@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_bad_knobs_raise_before_tracing(knobs, match, impl):
  rng = np.random.default_rng(0)
  case = kt.make_paged_case(rng, [5], block_size=8, head_dim=16, num_kv_heads=2)
  q = kt.random_queries(rng, (1, 4, 16))
  with pytest.raises(ValueError, match=match):
    pk.paged_decode_attention(q, case.pages, 1, case.block_tables, jnp.asarray(case.lengths),
                              impl=impl, **knobs)
  with pytest.raises(ValueError, match=match):
    pk.paged_prefill_attention(q[:, None], case.pages, 1, case.block_tables,
                               jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32), impl=impl,
                               **knobs)
