"""`paged_kv.pallas_kernels.layer_matmul`: one layer's projection read out of a stacked `[L, K, N]` weight
(the scan over layers on a GPU). The Pallas kernel (interpret mode) against the XLA reference
on fresh random inputs: odd row counts (a partial last row block), one row, more rows than a
block, K and N that are multiples of 16 but not of the largest tiles, the norm-weight prologue
and the bias epilogue, float32 and bfloat16, every layer (each holds its own random weights, so
reading the wrong one misses the tolerance), a traced layer id (the same bits as the Python
int), the clamp of an out-of-range traced id, and the input checks."""

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
  for layer in range(LAYERS):
    got = pk.layer_matmul(x, w, layer, scale=s, bias=b, impl="interpret")
    want = pk.layer_matmul(x, w, layer, scale=s, bias=b, impl="reference")
    assert got.shape == (m, n) and got.dtype == x.dtype
    tol.assert_close(got, want, tol.layer_matmul_atol(x, w, s, b, layer), f"layer {layer}")
    # Reading another layer's weights is far outside the bound.
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


def test_tiles():
  """The tile choice: bm covers a decode step's rows in one block (at most 64), bk and bn divide
  K and N, and bn shrinks (not below 32) while the grid would leave an H200's SMs idle."""
  assert stacked_matmul.tiles(8, 4096, 14336) == (16, 64, 32)
  assert stacked_matmul.tiles(512, 14336, 4096) == (64, 64, 64)
  assert stacked_matmul.tiles(70, 48, 32) == (64, 16, 32)
  assert stacked_matmul.tiles(1, 160, 80) == (16, 32, 16)
  for m, k, n in [(1, 64, 96), (5, 4096, 1024), (300, 256, 768)]:
    bm, bk, bn = stacked_matmul.tiles(m, k, n)
    assert k % bk == 0 and n % bn == 0 and bm <= 64


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
