"""Quantized KV pages (int8, float8_e4m3fn with per-token scales): quantize/dequantize, every
kernel on ``QuantPages`` (reference and interpret mode) against float64 attention, the checks, and
the refusal of e4m3 on a target that cannot compute it. Tolerances: ``tests/tolerances.py``
(:func:`quant_error_bound`, :func:`quantized_kernel_atol`, :func:`quantized_attention_atol`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.pallas_kernels import quant, testing as kt
from paged_kv.pallas_kernels.jax_compat import cuda_lowering
from tests import tolerances as tol

KV_DTYPES = [jnp.int8, jnp.float8_e4m3fn]


def _rows(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
  """Random rows [..., D] of magnitudes spread over three decades (so a scale shared by several
  rows would be far too coarse for the small ones), one all-zero row."""
  x = rng.standard_normal(shape).astype(np.float32)
  x *= (10.0 ** rng.uniform(-2, 1, shape[:-1]))[..., None].astype(np.float32)
  x.reshape(-1, shape[-1])[1] = 0.0
  return x


def _assert_within(got, want, bound, what: str) -> None:
  """``|got - want| <= bound`` elementwise (float64)."""
  err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
  worst = np.unravel_index(np.argmax(err - bound), err.shape)
  assert np.all(err <= bound), f"{what}: |error| {err[worst]:.4g} > bound {bound[worst]:.4g} at {worst}"


def _dequant64(pages: quant.QuantPages) -> np.ndarray:
  """Explicit dequantization in float64 NumPy: values * scales (e4m3 bits through XLA's own fp8
  conversion, not the kernels' bit arithmetic)."""
  values = np.asarray(quant.stored_as(pages.values, jnp.float32), np.float64)
  return values * np.asarray(pages.scales, np.float64)[..., None]


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=["int8", "e4m3"])
def test_quantize_bound_and_zero_rows(dtype):
  rng = np.random.default_rng(1)
  x = _rows(rng, (6, 3, 32))
  x[4, 2] = 0.0
  q, s = quant.quantize(jnp.asarray(x), dtype)
  assert q.dtype == jnp.dtype(dtype) and s.dtype == jnp.float32 and s.shape == x.shape[:-1]
  back = np.asarray(quant.dequantize(q, s), np.float64)
  assert np.all(np.isfinite(back)) and np.all(np.isfinite(np.asarray(s)))
  _assert_within(back, x, tol.quant_error_bound(x, dtype), "per-element bound")
  # The scale rule: max|x| / qmax per row (XLA may divide as a product by 1/qmax: two roundings).
  np.testing.assert_allclose(np.asarray(s), np.abs(x).max(-1) / np.float32(quant.QMAX[jnp.dtype(dtype)]),
                             rtol=2 * tol.eps(jnp.float32), atol=0)
  for idx in ((0, 1), (4, 2)):  # zero rows: scale 0, values 0, exactly 0 back
    assert float(s[idx]) == 0.0 and not np.any(np.asarray(q[idx].astype(jnp.float32)))
    assert np.all(back[idx] == 0.0)


def test_e4m3_bits_read_exactly():
  """Pages keep e4m3 as uint8 bits; the XLA paths read them with integer arithmetic
  (``bits_to_float32``), which must equal the fp8 conversion on every finite pattern, -0 and the
  subnormals included."""
  bits = jnp.arange(256, dtype=jnp.uint8)
  want = np.asarray(jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32))
  got = np.asarray(quant.bits_to_float32(bits))
  finite = np.isfinite(want)
  assert finite.sum() == 254
  np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
  np.testing.assert_array_equal(np.asarray(quant.stored_as(bits, jnp.float32))[finite], want[finite])
  pages = quant.QuantPages.zeros((1, 2, 1, 2, 4, 8), jnp.float8_e4m3fn)
  assert pages.values.dtype == jnp.uint8 and pages.dtype == jnp.dtype(jnp.float8_e4m3fn)
  ints = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
  np.testing.assert_array_equal(np.asarray(quant.bits_to_float32(ints)), np.arange(-128, 128, dtype=np.float32))


def _quant_case(rng, dtype, lengths, block_size, head_dim, num_kv_heads=2):
  """A paged case with float32 pages of spread row magnitudes, and their quantization."""
  case = kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=head_dim, num_kv_heads=num_kv_heads)
  pages = jnp.asarray(_rows(rng, tuple(case.pages.shape)))
  return case, pages, quant.quantize_pages(pages, dtype)


# (storage dtype, block_size, head_dim, group, window, knobs, compute dtype): GQA and MHA, block
# sizes 4 and 16, a window smaller than a block, one spanning several, the score knobs, a bfloat16
# query; each storage dtype in most of them (not the full product: interpret mode is slow).
ATTN_CASES = [
    (jnp.int8, 4, 16, 2, None, False, jnp.float32),
    (jnp.float8_e4m3fn, 4, 16, 2, None, False, jnp.float32),
    (jnp.int8, 16, 32, 1, 5, False, jnp.float32),
    (jnp.float8_e4m3fn, 16, 32, 1, 5, False, jnp.float32),
    (jnp.float8_e4m3fn, 4, 16, 4, 9, True, jnp.float32),
    (jnp.int8, 16, 16, 2, None, False, jnp.bfloat16),
]


@pytest.mark.parametrize("impl", ["reference", "interpret"])
@pytest.mark.parametrize("dtype,block_size,head_dim,group,window,knobs,cdtype", ATTN_CASES,
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_quantized_attention(impl, dtype, block_size, head_dim, group, window, knobs, cdtype):
  rng = np.random.default_rng(block_size * 7 + head_dim + group)
  lengths = [1, block_size + 3, 3 * block_size - 1, 0]  # odd lengths, an empty slot
  case, pages, qp = _quant_case(rng, dtype, lengths, block_size, head_dim)
  hq, layer, scale = 2 * group, case.layer, head_dim ** -0.5
  kw = dict(soft_cap=8.0, alibi_slopes=jnp.asarray(rng.uniform(0.01, 0.2, hq), jnp.float32)) if knobs else {}
  deq = _dequant64(qp)
  bt, ln = case.block_tables, jnp.asarray(case.lengths)
  q = kt.random_queries(rng, (len(lengths), hq, head_dim), cdtype)
  # bfloat16: the kernel rounds the weights before P V and the output (as for plain pages).
  roundings = 2 if cdtype == jnp.bfloat16 else 0
  ctx = max(lengths)
  k_err = tol.quant_error_bound(np.asarray(pages[layer, 0]), dtype)
  v_err = tol.quant_error_bound(np.asarray(pages[layer, 1]), dtype)

  def check(got, q_rows, want_hat, want_float, what):
    atol = tol.quantized_kernel_atol(q_rows, deq, layer, scale, ctx, roundings=roundings, **kw)
    tol.assert_close(got, want_hat, atol, f"{what}: vs float64 over the dequantized pages")
    qatol = tol.quantized_attention_atol(q_rows, pages[layer, 1], k_err, v_err, scale, atol)
    tol.assert_close(got, want_float, qatol, f"{what}: vs float64 over the unquantized pages")

  # Decode: one query per sequence at lengths - 1.
  got = pk.paged_decode_attention(q, qp, layer, bt, ln, impl=impl, window=window, **kw)
  assert got.shape == q.shape and got.dtype == q.dtype
  slopes = kw.get("alibi_slopes")
  want_hat = np.stack([kt.dense_attention(q[b], deq, layer, bt[b], int(n), scale, soft_cap=kw.get("soft_cap"),
                                          alibi_slopes=slopes, window=window) for b, n in enumerate(lengths)])
  want_float = np.stack([kt.dense_attention(q[b], pages, layer, bt[b], int(n), scale, soft_cap=kw.get("soft_cap"),
                                            alibi_slopes=slopes, window=window) for b, n in enumerate(lengths)])
  check(got, q, want_hat, want_float, "decode")
  assert np.all(np.asarray(got[3], np.float32) == 0)
  # The explicit-dequantize jnp path (plain float32 pages through the reference) agrees closely:
  # folding the scales into the logits and probabilities is the same attention.
  plain = pk.paged_decode_attention(q.astype(jnp.float32), jnp.asarray(deq, jnp.float32), layer, bt, ln,
                                    impl="reference", window=window, **kw)
  atol = tol.quantized_kernel_atol(q, deq, layer, scale, ctx, roundings=roundings + 1, **kw)
  tol.assert_close(got, plain, atol, "decode vs the explicit-dequantize jnp path")

  # Prefill: a chunk of 3 queries per sequence after a cached prefix.
  t = 3
  qs = jnp.asarray([max(n - t, 0) for n in lengths], jnp.int32)
  ql = jnp.asarray([min(n, t) for n in lengths], jnp.int32)
  qpre = kt.random_queries(rng, (len(lengths), t, hq, head_dim), cdtype)
  got = pk.paged_prefill_attention(qpre, qp, layer, bt, qs, ql, impl=impl, window=window, **kw)
  want_hat, want_float = np.zeros(got.shape), np.zeros(got.shape)
  for b in range(len(lengths)):
    for i in range(int(ql[b])):
      visible = int(qs[b]) + i + 1
      args = dict(soft_cap=kw.get("soft_cap"), alibi_slopes=slopes, window=window)
      want_hat[b, i] = kt.dense_attention(qpre[b, i], deq, layer, bt[b], visible, scale, **args)
      want_float[b, i] = kt.dense_attention(qpre[b, i], pages, layer, bt[b], visible, scale, **args)
  check(got, qpre, want_hat, want_float, "prefill")


@pytest.mark.parametrize("impl", ["reference", "interpret"])
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=["int8", "e4m3"])
def test_write_then_read_round_trip(impl, dtype):
  rng = np.random.default_rng(3)
  shape = (2, 2, 3, 5, 4, 16)  # [L, 2, Hkv, NB, bs, D]
  pages = quant.QuantPages.zeros(shape, dtype)
  assert pages.shape == shape and pages.dtype == jnp.dtype(dtype)
  assert pages.num_blocks == 5 and pages.block_size == 4
  k, v = _rows(rng, (5, 3, 16)), _rows(rng, (5, 3, 16))
  v[3] = 0.0  # a whole token's V zero: stays exactly zero
  slots = jnp.asarray([4, 9, 13, 18, 7], jnp.int32)
  out = pk.write_kv(pages, 1, jnp.asarray(k), jnp.asarray(v), slots, impl=impl)
  assert isinstance(out, quant.QuantPages) and out.scales.shape == shape[:-1]
  deq = _dequant64(out)
  s = np.asarray(slots)
  got_k = deq[1, 0][:, s // 4, s % 4].transpose(1, 0, 2)  # [N, Hkv, D]
  got_v = deq[1, 1][:, s // 4, s % 4].transpose(1, 0, 2)
  for got, want, what in ((got_k, k, "K"), (got_v, v, "V")):
    _assert_within(got, want, tol.quant_error_bound(want, dtype), what)
  assert np.all(got_v[3] == 0.0) and np.all(np.asarray(out.scales)[1, 1][:, s[3] // 4, s[3] % 4] == 0)
  # Nothing else written: layer 0 and the untouched slots are still zero.
  mask = np.zeros(shape[3:5], bool)
  mask[s // 4, s % 4] = True
  assert not deq[0].any() and not deq[1][:, :, ~mask].any()
  ref = pk.write_kv(pages, 1, jnp.asarray(k), jnp.asarray(v), slots, impl="reference")
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):  # the kernel writes what the reference writes
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("impl", ["reference", "interpret"])
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=["int8", "e4m3"])
def test_copy_blocks_copies_scales(impl, dtype):
  rng = np.random.default_rng(4)
  pages = quant.quantize_pages(jnp.asarray(_rows(rng, (2, 2, 2, 8, 4, 16))), dtype)
  src, dst = jnp.asarray([2, 2, 5, 0], jnp.int32), jnp.asarray([6, 7, 3, 0], jnp.int32)
  out = pk.copy_blocks(pages, src, dst, impl=impl)
  before, after = _dequant64(pages), _dequant64(out)
  for s_, d_ in ((2, 6), (2, 7), (5, 3)):  # a copy then a read equals the source, exactly
    np.testing.assert_array_equal(after[:, :, :, d_], before[:, :, :, s_])
    np.testing.assert_array_equal(np.asarray(out.scales[:, :, :, d_]), np.asarray(pages.scales[:, :, :, s_]))
  untouched = [b for b in range(8) if b not in (3, 6, 7)]
  np.testing.assert_array_equal(after[:, :, :, untouched], before[:, :, :, untouched])


def test_checks_name_the_bad_value():
  rng = np.random.default_rng(5)
  _, _, qp = _quant_case(rng, jnp.int8, [5, 3], 4, 16)
  q = kt.random_queries(rng, (2, 2, 16))
  bt, ln = jnp.zeros((2, 3), jnp.int32), jnp.asarray([5, 3], jnp.int32)
  bad = [
      (quant.QuantPages(qp.values, qp.scales[..., :2]), q, "scales must have shape"),
      (quant.QuantPages(qp.values, qp.scales.astype(jnp.bfloat16)), q, "scales must be float32"),
      (quant.QuantPages(qp.values.astype(jnp.int16), qp.scales), q, "int16"),
      (quant.QuantPages(qp.values.astype(jnp.float8_e4m3fn), qp.scales), q, "stored as their uint8 bits"),
      (qp, q.astype(jnp.int8), "q dtype must be one of float32/bfloat16/float16 with int8 pages"),
  ]
  for pages, qq, msg in bad:
    with pytest.raises(ValueError, match=msg):
      pk.paged_decode_attention(qq, pages, 1, bt, ln, impl="reference")
  with pytest.raises(ValueError, match="batch_invariant"):
    pk.paged_decode_attention(q, qp, 1, bt, ln, impl="reference", batch_invariant=True)
  with pytest.raises(ValueError, match="batch_invariant"):
    pk.paged_prefill_attention(q[:, None], qp, 1, bt, ln, ln, impl="interpret", batch_invariant=True)
  kv = jnp.zeros((1, 2, 16), jnp.int8)
  with pytest.raises(ValueError, match="k dtype must be one of float32"):
    pk.write_kv(qp, 0, kv, kv, jnp.zeros((1,), jnp.int32), impl="reference")
  with pytest.raises(ValueError, match="KV dtype must be one of"):
    quant.QuantPages.zeros((1, 2, 1, 2, 4, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="KV dtype must be one of"):
    quant.quantize(q, jnp.float16)


def test_fp8_refused_before_tracing_on_sm80():
  # One line naming the dtype and the target, for the lead's own check and inside the dispatch.
  with pytest.raises(ValueError, match=r"float8_e4m3fn .* target is sm_80") as e:
    quant.check_kv_dtype(jnp.float8_e4m3fn, "sm_80")
  assert "\n" not in str(e.value)
  assert quant.check_kv_dtype(jnp.float8_e4m3fn, "sm_90a") == jnp.dtype(jnp.float8_e4m3fn)
  assert quant.check_kv_dtype(jnp.int8, "sm_80") == jnp.dtype(jnp.int8)
  assert quant.check_kv_dtype(jnp.float8_e4m3fn, None) == jnp.dtype(jnp.float8_e4m3fn)  # a CPU
  rng = np.random.default_rng(6)
  _, _, qp = _quant_case(rng, jnp.float8_e4m3fn, [5, 3], 4, 16)
  q = kt.random_queries(rng, (2, 2, 16))
  bt, ln = jnp.zeros((2, 3), jnp.int32), jnp.asarray([5, 3], jnp.int32)
  with cuda_lowering("NVIDIA A100-SXM4-80GB"):  # a deviceless sm_80 lowering (the gate's)
    for call in (lambda: pk.paged_decode_attention(q, qp, 1, bt, ln, impl="pallas"),
                 lambda: pk.copy_blocks(qp, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32), impl="pallas")):
      with pytest.raises(ValueError, match="float8_e4m3fn .* sm_80"):
        jax.jit(call).trace()


def test_quantized_kernels_lower_for_cuda():
  """Every Pallas kernel on e4m3 and int8 pages lowers to Triton for sm_90 (no GPU needed): the
  tile conversions, the scale gathers and the aliased scale outputs are legal Triton."""
  from paged_kv.pallas_kernels.jax_compat import export_cuda
  S, i32 = jax.ShapeDtypeStruct, jnp.int32
  for dtype in KV_DTYPES:
    pages = quant.QuantPages(values=S((2, 2, 2, 9, 16, 64), quant.storage_dtype(dtype)),
                             scales=S((2, 2, 2, 9, 16), jnp.float32))
    bt, vec = S((3, 4), i32), S((3,), i32)
    calls = [
        (lambda q, p, t, n: pk.paged_decode_attention(q, p, 1, t, n, impl="pallas", window=20),
         (S((3, 8, 64), jnp.bfloat16), pages, bt, vec)),
        (lambda q, p, t, s, n: pk.paged_prefill_attention(q, p, 1, t, s, n, impl="pallas", soft_cap=30.0),
         (S((3, 4, 8, 64), jnp.bfloat16), pages, bt, vec, vec)),
        (lambda p, k, v, s: pk.write_kv(p, 1, k, v, s, impl="pallas"),
         (pages, S((3, 2, 64), jnp.bfloat16), S((3, 2, 64), jnp.bfloat16), vec)),
        (lambda p, s, t: pk.copy_blocks(p, s, t, impl="pallas"), (pages, vec, vec)),
    ]
    for fn, args in calls:
      text = export_cuda(fn, *args).mlir_module()
      assert "__gpu$xla.gpu.triton" in text
