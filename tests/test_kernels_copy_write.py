"""copy_blocks and write_kv: Pallas (interpret mode) against the reference and NumPy, and the
in-place aliasing of the pages."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.pallas_kernels import testing as kt
from paged_kv.pallas_kernels.jax_compat import export_cuda


def _pages(rng, dtype, block_size=8, head_dim=64, num_blocks=12, num_layers=3, heads=2):
  shape = (num_layers, 2, heads, num_blocks, block_size, head_dim)
  return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_size,head_dim", [(8, 64), (32, 128)])
def test_copy_blocks_interpret(dtype, block_size, head_dim):
  rng = np.random.default_rng(block_size)
  pages = _pages(rng, dtype, block_size, head_dim)
  src = np.array([3, 5, 11, 0, 0], np.int32)  # padded copy list, padding (0, 0)
  dst = np.array([7, 9, 1, 0, 0], np.int32)
  got = pk.copy_blocks(pages, jnp.asarray(src), jnp.asarray(dst), impl="interpret")
  ref = pk.copy_blocks(pages, jnp.asarray(src), jnp.asarray(dst), impl="reference")
  got, before = np.asarray(got), np.asarray(pages)
  np.testing.assert_array_equal(got, np.asarray(ref))
  for s, d in zip(src, dst):  # every destination equals its source in every layer, K and V
    np.testing.assert_array_equal(got[:, :, :, d], before[:, :, :, s])
  untouched = np.setdiff1d(np.arange(pages.shape[3]), dst[dst != 0])
  np.testing.assert_array_equal(got[:, :, :, untouched], before[:, :, :, untouched])


@pytest.mark.parametrize("impl", ["reference", "interpret"])
@pytest.mark.parametrize("src,dst,match", [
    # A chain: the reference copies old 3 to 4, the kernel may copy the new 3 (old 2).
    ([2, 3, 0], [3, 4, 0], "block 3 is the source at position 1 and the destination at position 0"),
    # A swap: the reference swaps, the kernel may leave both equal.
    ([2, 3], [3, 2], "block 2 is the source at position 0 and the destination at position 1"),
    # A self-copy is a destination that is its own source.
    ([0, 5], [0, 5], "block 5 is the source at position 1 and the destination at position 1"),
    # Two copies into one block; also after clamping (13 is out of range: the null block 0 as a
    # source, but 9 as a destination twice).
    ([3, 4, 0], [9, 9, 0], "block 9 is the destination at positions 0 and 1"),
    ([3, 13], [9, 9], "block 9 is the destination at positions 0 and 1"),
    # A chain through the null block: a copy into it (13 clamps to 0), then a copy out of it.
    ([6, 0, 0], [13, 0, 2],
     "block 0 is the source at position 2 and the destination at position 0"),
])
def test_copy_blocks_rejects_chains_swaps_and_duplicates(impl, src, dst, match):
  pages = _pages(np.random.default_rng(0), jnp.float32)
  with pytest.raises(ValueError, match=match):
    pk.copy_blocks(pages, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32), impl=impl)
  with pytest.raises(ValueError, match=match):  # NumPy lists are checked too
    pk.copy_blocks(pages, np.asarray(src, np.int32), np.asarray(dst, np.int32), impl=impl)


def test_copy_blocks_valid_lists_match_reference():
  """Repeated sources (one shared block copied for several sequences), padding ``(0, 0)`` in any
  number (also out-of-range ids clamped to it), the null block as a source, or else one copy into
  the null block, are allowed; the kernel then equals the reference (and NumPy) on every block
  that holds data."""
  rng = np.random.default_rng(1)
  pages = _pages(rng, jnp.float32)
  before, num_blocks = np.asarray(pages), pages.shape[3]
  cases = [
      ([3, 0, 3, 3, -1, 0, num_blocks + 2, 4, 0], [7, 0, 8, 9, -1, 0, 0, 1, 2],
       [(3, 7), (3, 8), (3, 9), (4, 1), (0, 2)]),
      ([6, 0, 0, 5], [0, 0, 0, 3], [(5, 3)]),  # 6 -> 0 writes the null block only
  ]
  for src, dst, copies in cases:
    src, dst = jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
    got = np.asarray(pk.copy_blocks(pages, src, dst, impl="interpret"))
    ref = np.asarray(pk.copy_blocks(pages, src, dst, impl="reference"))
    want = before.copy()
    for s, d in copies:
      want[:, :, :, d] = before[:, :, :, s]
    # Blocks 1.. hold data; block 0's contents are unspecified after a copy into it.
    np.testing.assert_array_equal(got[:, :, :, 1:], ref[:, :, :, 1:])
    np.testing.assert_array_equal(got[:, :, :, 1:], want[:, :, :, 1:])


def test_copy_blocks_traced_lists_are_not_checked():
  """Under jit the lists are tracers: nothing is checked (the block manager's append guarantees
  the contract) and the reference reads every source before writing."""
  pages = _pages(np.random.default_rng(2), jnp.float32)
  step = jax.jit(lambda p, s, d: pk.copy_blocks(p, s, d, impl="reference"))
  out = np.asarray(step(pages, jnp.array([2, 3], jnp.int32), jnp.array([3, 4], jnp.int32)))
  before = np.asarray(pages)
  np.testing.assert_array_equal(out[:, :, :, 4], before[:, :, :, 3])
  np.testing.assert_array_equal(out[:, :, :, 3], before[:, :, :, 2])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_size,head_dim,heads", [(8, 64, 2), (16, 128, 3)])
def test_write_kv_interpret(dtype, block_size, head_dim, heads):
  rng = np.random.default_rng(head_dim)
  pages = _pages(rng, dtype, block_size, head_dim, heads=heads)
  n = 6
  k = kt.random_queries(rng, (n, heads, head_dim), dtype)
  v = kt.random_queries(rng, (n, heads, head_dim), dtype)
  # Real rows at scattered slots (mid-block, block start, last slot); padding rows in block 0.
  slots = np.array([block_size * 5 + 3, block_size * 2, block_size * 12 - 1, 1, 0, 2], np.int32)
  got = np.asarray(pk.write_kv(pages, 2, k, v, jnp.asarray(slots), impl="interpret"))
  ref = np.asarray(pk.write_kv(pages, 2, k, v, jnp.asarray(slots), impl="reference"))
  np.testing.assert_array_equal(got, ref)
  want = np.asarray(pages).copy()
  for i, s in enumerate(slots):
    want[2, 0, :, s // block_size, s % block_size] = np.asarray(k[i])
    want[2, 1, :, s // block_size, s % block_size] = np.asarray(v[i])
  np.testing.assert_array_equal(got, want)


def test_pallas_copy_and_write_alias_pages_in_lowering():
  pages = jax.ShapeDtypeStruct((2, 2, 8, 16, 16, 128), jnp.bfloat16)
  idx = jax.ShapeDtypeStruct((4,), jnp.int32)
  kv = jax.ShapeDtypeStruct((4, 8, 128), jnp.bfloat16)
  for fn, args in [
      (lambda p, s, d: pk.copy_blocks(p, s, d, impl="pallas"), (pages, idx, idx)),
      (lambda p, k, v, s: pk.write_kv(p, 1, k, v, s, impl="pallas"), (pages, kv, kv, idx)),
  ]:
    text = export_cuda(fn, *args, donate_argnums=(0,)).mlir_module()
    # The Triton custom call writes its output into its pages operand...
    assert re.search(r"xla\.gpu\.triton.*output_operand_aliases", text)
    # ...and the jitted function's output reuses the donated pages buffer.
    assert "tf.aliasing_output = 0" in text


def test_donated_pages_are_consumed_on_cpu():
  rng = np.random.default_rng(0)
  pages = _pages(rng, jnp.float32)
  src, dst = jnp.array([3, 0], jnp.int32), jnp.array([7, 0], jnp.int32)
  expected = np.asarray(pages).copy()
  expected[:, :, :, 7] = expected[:, :, :, 3]
  step = jax.jit(lambda p, s, d: pk.copy_blocks(p, s, d, impl="interpret"), donate_argnums=0)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # "Some donated buffers were not usable" would fail here
    out = step(pages, src, dst)
  assert pages.is_deleted()
  np.testing.assert_array_equal(np.asarray(out), expected)
