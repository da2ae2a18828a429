"""`paged_kv.pallas_kernels.layer_matmul`: one layer's projection read out of a stacked `[L, K, N]` weight
(the scan over layers on a GPU). The Pallas kernel (interpret mode) against the XLA reference
on fresh random inputs: odd row counts (a partial last row block), one row, more rows than a
block, K and N that are multiples of 16 but not of the largest tiles, the norm-weight prologue
and the bias epilogue, float32 and bfloat16, every layer (each holds its own random weights, so
reading the wrong one misses the tolerance), a traced layer id (the same bits as the Python
int), the clamp of an out-of-range traced id, and the input checks. The split-K path (float32
partials summed outside the kernel) on forced plans: odd M, K steps that do not divide among the
splits, the norm weight and the bias, its determinism; and the plan's own choices. The grouped
form (several weights of the same x in one launch) against each weight's reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.pallas_kernels import stacked_matmul
from tests import tolerances as tol

LAYERS = 3
CASES = [  # (M, K, N, dtype, scale, bias)
    (1, 64, 96, jnp.float32, False, False),
    (5, 64, 96, jnp.float32, True, False),
    (8, 256, 768, jnp.float32, True, True),
    (70, 48, 32, jnp.float32, False, True),  # M > bm = 64: a second, partial row block; K = 3 * 16
    (3, 128, 48, jnp.bfloat16, True, True),
    (40, 160, 80, jnp.bfloat16, True, False),  # K = 160 = 2 * 64 + 32, N = 80 = 5 * 16
]


def _inputs(seed, m, k, n, dtype, scale, bias):
  rs = np.random.RandomState(seed)
  x = jnp.asarray(rs.randn(m, k), dtype)
  w = jnp.asarray(rs.randn(LAYERS, k, n) / np.sqrt(k), dtype)
  s = jnp.asarray(1 + 0.5 * rs.randn(LAYERS, k), dtype) if scale else None
  b = jnp.asarray(rs.randn(LAYERS, n), dtype) if bias else None
  return x, w, s, b


@pytest.mark.parametrize("m,k,n,dtype,scale,bias", CASES)
def test_interpret_kernel_matches_reference_at_every_layer(m, k, n, dtype, scale, bias):
  x, w, s, b = _inputs(m * 7 + k, m, k, n, dtype, scale, bias)
  _assert_reference_at_every_layer(lambda layer: pk.layer_matmul(x, w, layer, scale=s, bias=b, impl="interpret"),
                                   x, w, s, b)


def _assert_reference_at_every_layer(kernel, x, w, s, b):
  """``kernel(layer)`` (the Pallas kernel in interpret mode) matches the XLA reference within the
  derived bound at every layer, and reading another layer's weights would be far outside it."""
  m, n = x.shape[0], w.shape[2]
  for layer in range(LAYERS):
    got = kernel(layer)
    want = pk.layer_matmul(x, w, layer, scale=s, bias=b, impl="reference")
    assert got.shape == (m, n) and got.dtype == x.dtype
    tol.assert_close(got, want, tol.layer_matmul_atol(x, w, s, b, layer), f"layer {layer}")
    other = pk.layer_matmul(x, w, (layer + 1) % LAYERS, scale=s, bias=b, impl="reference")
    assert float(np.abs(np.asarray(other, np.float64) - np.asarray(want, np.float64)).max()) > \
        10 * tol.layer_matmul_atol(x, w, s, b, layer)


def test_reference_is_the_models_arithmetic():
  """The reference is `(scale * x) @ w[layer]` accumulated in float32, rounded, then `+ bias`:
  what the model computes from its norm's normalized input (checked in float64)."""
  x, w, s, b = _inputs(3, 6, 64, 32, jnp.float32, True, True)
  want = (np.asarray(s[2], np.float64) * np.asarray(x, np.float64)) @ np.asarray(w[2], np.float64) + \
      np.asarray(b[2], np.float64)
  got = pk.layer_matmul(x, w, 2, scale=s, bias=b, impl="reference")
  tol.assert_close(got, want, 2 * tol.layer_matmul_atol(x, w, s, b, 2), "reference vs float64")


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_traced_layer_gives_the_python_ints_bits(impl):
  x, w, s, b = _inputs(11, 9, 64, 48, jnp.float32, True, True)
  run = jax.jit(lambda layer: pk.layer_matmul(x, w, layer, scale=s, bias=b, impl=impl))
  for layer in range(LAYERS):
    want = pk.layer_matmul(x, w, layer, scale=s, bias=b, impl=impl)
    np.testing.assert_array_equal(np.asarray(run(jnp.int32(layer))), np.asarray(want))


def test_traced_layer_out_of_range_is_clamped_by_the_kernel():
  """A traced id cannot be range-checked before tracing: the kernel reads the nearest layer
  (never memory outside the weights), as the attention kernels do."""
  x, w, _, _ = _inputs(5, 4, 32, 32, jnp.float32, False, False)
  run = jax.jit(lambda layer: pk.layer_matmul(x, w, layer, impl="interpret"))
  np.testing.assert_array_equal(np.asarray(run(jnp.int32(-4))), np.asarray(run(jnp.int32(0))))
  np.testing.assert_array_equal(np.asarray(run(jnp.int32(LAYERS + 2))), np.asarray(run(jnp.int32(LAYERS - 1))))


def test_plan():
  """The plan: bm covers a decode step's rows in one block (at most 64), bk and bn divide K and N
  with weight rows of 64 or 128 bytes where N allows, a split leaves no part empty and is long
  enough to pipeline, and the float32 partials stay within a quarter of the bytes that must move."""
  shapes = [(m, k, n) for m in (1, 8, 64, 256) for k, n in (
      (4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096),  # Llama 3.1 8B
      (2048, 2048), (2048, 512), (2048, 8192), (8192, 2048))]  # Llama 3.2 1B
  for m, k, n in shapes + [(70, 48, 32), (1, 160, 80), (300, 256, 768)]:
    for itemsize in (2, 4):
      p = stacked_matmul.plan(m, k, n, itemsize)
      # bm: the rows in one block of at most 64, or a half or a quarter of that (more row blocks).
      top = min(64, max(16, 1 << (m - 1).bit_length()))
      assert k % p.bk == 0 and n % p.bn == 0 and p.bm in (top, max(16, top // 2), max(16, top // 4)), (m, k, n, p)
      if (m, k, n) in shapes:
        assert p.bn * itemsize in (64, 128) and 3 <= p.num_stages <= 5, (m, k, n, p)
      total = k // p.bk
      steps = -(-total // p.splits)
      assert -(-total // steps) == p.splits  # no empty split
      if p.splits > 1:
        assert steps >= p.num_stages - 1
        assert 2 * 4 * p.splits * m * n <= (k * n + m * k + m * n) * itemsize // 4
      # bf16 tiles of every stage fit an A100's shared memory.
      assert p.num_stages * (p.bm * p.bk + p.bk * p.bn) * itemsize <= 166_912 - 2048
  # A decode step's narrow projections split K (the grid would leave most SMs idle otherwise);
  # a prefill chunk's wide one does not (its partials would cost more than they save).
  assert stacked_matmul.plan(1, 4096, 1024).splits > 1
  assert stacked_matmul.plan(256, 4096, 14336).splits == 1
  assert stacked_matmul.plan(256, 4096, 4096).bm == 64  # a warpgroup's wgmma rows
  # 64 rows against a narrow projection: four row blocks rather than a split K (no partials).
  p = stacked_matmul.plan(64, 2048, 2048)
  assert p.splits == 1 and p.bm < 64
  # A group: the column tile divides every weight's width; the plan sees the total width.
  for m in (1, 8, 64, 256):
    for ns in ((2048, 512, 512), (4096, 1024, 1024), (14336, 14336), (96, 32, 48)):
      p = stacked_matmul.plan(m, 2048, ns)
      assert all(n % p.bn == 0 for n in ns), (m, ns, p)


# Forced plans: the split-K path on small shapes (odd M, a partial row block, K steps that do not
# divide among the splits, the norm weight and the bias), against the reference. The tolerance is
# the unsplit kernel's: each split sums its K range in float32 and the partials are added in
# float32, one more blocking of the same K products, which ``K eps32 sum|a_i w_i|`` bounds in any
# order; the result is still rounded once to x's dtype and the bias added once after it.
SPLIT_CASES = [  # (M, K, N, dtype, scale, bias, plan)
    (1, 64, 96, jnp.float32, False, False, stacked_matmul.Plan(16, 16, 32, splits=2, num_stages=3)),
    (5, 160, 48, jnp.float32, True, True, stacked_matmul.Plan(16, 16, 16, splits=3, num_stages=4)),  # 10 steps: 4+4+2
    (70, 48, 32, jnp.float32, True, False, stacked_matmul.Plan(64, 16, 32, splits=2)),  # 3 steps: 2+1, 2 row blocks
    (3, 256, 80, jnp.bfloat16, True, True, stacked_matmul.Plan(16, 32, 16, splits=3, num_stages=3)),  # 8 steps: 3+3+2
    (17, 128, 64, jnp.bfloat16, False, True, stacked_matmul.Plan(32, 32, 32, splits=4, num_stages=5)),  # even split
    (8, 96, 32, jnp.float16, True, True, stacked_matmul.Plan(16, 16, 16, splits=6)),  # one step per split
]


def _pallas(x, w, layer, s, b, config):
  return stacked_matmul.layer_matmul_pallas(x, w, layer, s, b, interpret=True, config=config)


@pytest.mark.parametrize("m,k,n,dtype,scale,bias,config", SPLIT_CASES)
def test_split_k_matches_reference_at_every_layer(m, k, n, dtype, scale, bias, config):
  x, w, s, b = _inputs(m * 13 + k + n, m, k, n, dtype, scale, bias)
  _assert_reference_at_every_layer(lambda layer: _pallas(x, w, layer, s, b, config), x, w, s, b)


def test_split_k_is_deterministic_and_takes_a_traced_layer():
  """The partials are summed in a fixed order: the same bits on every call, for a Python int
  and a traced layer id (whose bias row is the kernel's clamped layer's)."""
  config = SPLIT_CASES[1][-1]
  x, w, s, b = _inputs(21, 5, 160, 48, jnp.float32, True, True)
  run = jax.jit(lambda layer: _pallas(x, w, layer, s, b, config))
  for layer in range(LAYERS):
    want = np.asarray(_pallas(x, w, layer, s, b, config))
    np.testing.assert_array_equal(np.asarray(_pallas(x, w, layer, s, b, config)), want)
    np.testing.assert_array_equal(np.asarray(run(jnp.int32(layer))), want)
  np.testing.assert_array_equal(np.asarray(run(jnp.int32(-4))), np.asarray(run(jnp.int32(0))))
  np.testing.assert_array_equal(np.asarray(run(jnp.int32(LAYERS + 2))), np.asarray(run(jnp.int32(LAYERS - 1))))


def test_the_plans_split_runs_through_layer_matmul():
  """A shape whose own plan splits K (a decode row against a narrow projection) goes through the
  split path from the public entry point."""
  m, k, n = 1, 2048, 64
  assert stacked_matmul.plan(m, k, n, 4).splits > 1
  x, w, s, b = _inputs(5, m, k, n, jnp.float32, True, True)
  got = pk.layer_matmul(x, w, 1, scale=s, bias=b, impl="interpret")
  want = pk.layer_matmul(x, w, 1, scale=s, bias=b, impl="reference")
  tol.assert_close(got, want, tol.layer_matmul_atol(x, w, s, b, 1), "plan's split")


def test_input_checks_name_the_bad_value():
  x, w, s, b = _inputs(1, 4, 32, 32, jnp.float32, True, True)
  with pytest.raises(ValueError, match="multiples of 16.*K=40"):
    pk.layer_matmul(jnp.zeros((4, 40)), jnp.zeros((2, 40, 32)), 0, impl="interpret")
  with pytest.raises(ValueError, match="x's K=32 must equal w's K=64"):
    pk.layer_matmul(x, jnp.zeros((2, 64, 32)), 0, impl="reference")
  with pytest.raises(ValueError, match="share a float dtype"):
    pk.layer_matmul(x, w.astype(jnp.bfloat16), 0, impl="reference")
  with pytest.raises(ValueError, match=r"scale must be float32\[3, 32\]"):
    pk.layer_matmul(x, w, 0, scale=s[0], impl="reference")
  with pytest.raises(ValueError, match=r"bias must be float32\[3, 32\]"):
    pk.layer_matmul(x, w, 0, bias=b[:, :16], impl="reference")
  with pytest.raises(ValueError, match=r"layer=3 out of range \[0, 3\)"):
    pk.layer_matmul(x, w, 3, impl="reference")
  with pytest.raises(ValueError, match="impl must be one of"):
    pk.layer_matmul(x, w, 0, impl="triton")
  assert not stacked_matmul.supported(40, 32) and stacked_matmul.supported(48, 32)


# The grouped form: several stacked weights [L, K, N_i] of the same x in one launch, the column
# tiles of every weight side by side (q|k|v, gate|up), each output [M, N_i] against the
# reference of its own weight, with the bound of a single product (each output is one, computed
# by its own programs). Unequal widths, a bias on some weights only, the shared norm weight, odd
# M (a partial row block), and forced plans: split K, several row blocks, the narrowest tile.
GROUP_CASES = [  # (M, K, widths, dtype, scale, biases (per weight), plan or None)
    (5, 64, (96, 32, 32), jnp.float32, True, (True, False, True), None),
    (1, 128, (64, 64), jnp.float32, False, (False, False), None),
    (3, 128, (48, 16, 16), jnp.bfloat16, True, (True, True, True), None),
    (70, 48, (32, 64), jnp.float32, True, (True, True), None),  # two row blocks
    (7, 160, (64, 32, 32), jnp.float32, True, (True, False, True),
     stacked_matmul.Plan(16, 16, 16, splits=3, num_stages=4)),  # 10 steps: 4+4+2
    (17, 256, (32, 96), jnp.bfloat16, True, (True, True),
     stacked_matmul.Plan(16, 32, 32, splits=2, num_stages=3)),  # split, two row blocks
    (33, 64, (16, 48, 16), jnp.float16, False, (False, True, False),
     stacked_matmul.Plan(16, 16, 16, splits=1, num_stages=3)),  # three row blocks, 16-wide tiles
]


def _group_inputs(seed, m, k, widths, dtype, scale, biases):
  rs = np.random.RandomState(seed)
  x = jnp.asarray(rs.randn(m, k), dtype)
  ws = tuple(jnp.asarray(rs.randn(LAYERS, k, n) / np.sqrt(k), dtype) for n in widths)
  s = jnp.asarray(1 + 0.5 * rs.randn(LAYERS, k), dtype) if scale else None
  bs = tuple(jnp.asarray(rs.randn(LAYERS, n), dtype) if has else None for n, has in zip(widths, biases))
  return x, ws, s, bs


@pytest.mark.parametrize("m,k,widths,dtype,scale,biases,config", GROUP_CASES)
def test_group_matches_each_weights_reference_at_every_layer(m, k, widths, dtype, scale, biases, config):
  x, ws, s, bs = _group_inputs(m * 5 + k + sum(widths), m, k, widths, dtype, scale, biases)
  for layer in range(LAYERS):
    if config is None:
      got = pk.layer_matmul(x, ws, layer, scale=s, bias=bs, impl="interpret")
    else:
      got = stacked_matmul.layer_matmul_pallas(x, ws, layer, s, bs, interpret=True, config=config)
    assert isinstance(got, tuple) and len(got) == len(ws)
    for i, (w, b) in enumerate(zip(ws, bs)):
      want = pk.layer_matmul(x, w, layer, scale=s, bias=b, impl="reference")
      assert got[i].shape == (m, w.shape[2]) and got[i].dtype == x.dtype
      atol = tol.layer_matmul_atol(x, w, s, b, layer)
      tol.assert_close(got[i], want, atol, f"layer {layer}, weight {i}")
      # Another weight's columns or another layer's are far outside the bound.
      other = pk.layer_matmul(x, w, (layer + 1) % LAYERS, scale=s, bias=b, impl="reference")
      assert float(np.abs(np.asarray(other, np.float64) - np.asarray(want, np.float64)).max()) > 10 * atol


def test_group_reference_is_each_weights_reference():
  x, ws, s, bs = _group_inputs(4, 6, 64, (32, 16), jnp.float32, True, (True, False))
  got = pk.layer_matmul(x, ws, 2, scale=s, bias=bs, impl="reference")
  for w, b, g in zip(ws, bs, got):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(pk.layer_matmul(x, w, 2, scale=s, bias=b,
                                                                            impl="reference")))
  assert all(a.shape == (6, w.shape[2]) for a, w in zip(pk.layer_matmul(x, ws, 0, impl="reference"), ws))


def test_group_takes_a_traced_layer_and_clamps_it():
  x, ws, s, bs = _group_inputs(8, 9, 64, (48, 16, 16), jnp.float32, True, (True, True, True))
  run = jax.jit(lambda layer: pk.layer_matmul(x, ws, layer, scale=s, bias=bs, impl="interpret"))
  for layer in range(LAYERS):
    want = pk.layer_matmul(x, ws, layer, scale=s, bias=bs, impl="interpret")
    for a, b in zip(run(jnp.int32(layer)), want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(run(jnp.int32(LAYERS + 2)), run(jnp.int32(LAYERS - 1))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_group_input_checks():
  x, ws, s, bs = _group_inputs(1, 4, 32, (32, 16), jnp.float32, True, (True, True))
  with pytest.raises(ValueError, match="share L and K"):
    pk.layer_matmul(x, (ws[0], jnp.zeros((3, 48, 16))), 0, impl="reference")
  with pytest.raises(ValueError, match="one entry per weight"):
    pk.layer_matmul(x, ws, 0, bias=bs[:1], impl="reference")
  with pytest.raises(ValueError, match="one entry per weight"):
    pk.layer_matmul(x, ws, 0, bias=bs[0], impl="reference")
  with pytest.raises(ValueError, match=r"bias must be float32\[3, 16\]"):
    pk.layer_matmul(x, ws, 0, bias=(bs[0], bs[0]), impl="reference")
  with pytest.raises(ValueError, match="multiples of 16.*N=40"):
    pk.layer_matmul(x, (ws[0], jnp.zeros((3, 32, 40))), 0, impl="interpret")
  with pytest.raises(ValueError, match="at least one weight"):
    pk.layer_matmul(x, (), 0, impl="reference")
