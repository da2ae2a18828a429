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


def _random_copies(rng, num_blocks, real, padding):
  """A fresh valid copy list: ``real`` distinct destinations, sources drawn (with repeats) from
  the blocks that are not destinations, and ``padding`` ``(0, 0)`` entries, in random order."""
  blocks = rng.permutation(np.arange(1, num_blocks))
  dst, pool = blocks[:real], blocks[real:]
  src = rng.choice(pool, size=real)
  order = rng.permutation(real + padding)
  src = np.concatenate([src, np.zeros(padding, np.int64)])[order].astype(np.int32)
  dst = np.concatenate([dst, np.zeros(padding, np.int64)])[order].astype(np.int32)
  return src, dst


def _expected_copy(before, src, dst):
  want = before.copy()
  for s, d in zip(src, dst):
    if s != d:
      want[:, :, :, d] = before[:, :, :, s]
  return want


@pytest.mark.parametrize("num_copies,rows,block_size,head_dim,itemsize,plan", [
    # Llama 3.1 8B pages (32 layers x K|V x 8 heads = 512 rows of 16 x 128), bf16: one block is
    # split over 256 programs of one 8 KB slab; 16 blocks over 1024 programs of 4 steps; 256
    # blocks over 1024 programs of 64 steps.
    (1, 512, 16, 128, 2, (2, 2)),
    (16, 512, 16, 128, 2, (2, 8)),
    (256, 512, 16, 128, 2, (2, 128)),
    # Llama 3.2 1B per-layer pages (1 layer x K|V x 8 heads = 16 rows of 16 x 64), bf16: few
    # copies take one 2 KB tile per program, 256 copies one 8 KB slab, 512 copies two slabs.
    (1, 16, 16, 64, 2, (1, 1)),
    (16, 16, 16, 64, 2, (1, 1)),
    (256, 16, 16, 64, 2, (4, 4)),
    (512, 16, 16, 64, 2, (4, 8)),
    # Rows that are not a power of two: slabs and groups divide them (18 = 2 x 9).
    (4, 18, 8, 64, 4, (1, 1)),
    (4096, 18, 8, 64, 4, (2, 2)),
    # A tile larger than a slab's budget (32 x 256 x 4 B = 32 KB): one tile per step.
    (64, 512, 32, 256, 4, (1, 32)),
])
def test_copy_plan(num_copies, rows, block_size, head_dim, itemsize, plan):
  from paged_kv.pallas_kernels import block_copy as bc
  slab_rows, head_rows = bc.copy_plan(num_copies, rows, block_size, head_dim, itemsize)
  assert (slab_rows, head_rows) == plan
  # Triton block shapes are powers of two; a program's rows and a step's rows tile the rows.
  for n in (slab_rows, head_rows):
    assert n & (n - 1) == 0
  assert rows % head_rows == 0 and head_rows % slab_rows == 0
  tile = block_size * head_dim * itemsize
  assert slab_rows == 1 or slab_rows * tile <= bc._SLAB_BYTES
  programs = num_copies * rows // head_rows
  # Enough programs to cover the SMs unless one tile per program is already all there is, and
  # no more than the cap unless every program already holds all the rows of a block.
  assert programs >= bc._MIN_PROGRAMS or slab_rows == 1 or head_rows > slab_rows
  assert programs <= 2 * bc._MAX_PROGRAMS or head_rows == rows or rows // head_rows % 2


def _pallas_grid(fn, *args):
  """The grid of the one ``pallas_call`` in ``fn``'s jaxpr (traced only: nothing runs)."""
  def find(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        return eqn.params["grid_mapping"].grid
      for v in eqn.params.values():
        inner = getattr(v, "jaxpr", None)
        if inner is not None and (g := find(inner)) is not None:
          return g
    return None
  return find(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("num_copies", [1, 16, 256])
@pytest.mark.parametrize("num_layers,heads,head_dim", [(32, 8, 128), (1, 8, 64)])
def test_copy_work_matches_the_kernel_grid(num_copies, num_layers, heads, head_dim):
  """``scripts/gate/perf_work_copy.copy_work`` (what the performance model is told) describes
  the grid the kernel launches: its programs move every byte once each way, one slab per step."""
  from paged_kv.pallas_kernels import block_copy as bc
  from scripts.gate import perf_work_copy
  rows, bs, itemsize = num_layers * 2 * heads, 16, 2
  work = perf_work_copy.copy_work(num_copies, rows, bs, head_dim, itemsize)
  tile = bs * head_dim * itemsize
  assert work.bytes == 2 * num_copies * rows * tile
  pages = jax.ShapeDtypeStruct((num_layers, 2, heads, 64, bs, head_dim), jnp.bfloat16)
  lst = jax.ShapeDtypeStruct((num_copies,), jnp.int32)
  grid = _pallas_grid(lambda p, s, d: bc.copy_blocks_pallas(p, s, d), pages, lst, lst)
  programs = grid[0] * grid[1]
  assert grid[0] == num_copies
  assert programs * work.steps * work.step_bytes == num_copies * rows * tile
  # The old kernel's plan (one tile per step, 16 rows per program) as the "before" row.
  old = perf_work_copy.copy_work(num_copies, rows, bs, head_dim, itemsize,
                                 head_rows=perf_work_copy.old_plan(rows)[1], slab_rows=1)
  assert (old.step_bytes, old.steps) == (tile, 16)


# (num_layers, heads, block_size, head_dim, head_rows, slab_rows): explicit plans (one tile per
# step, several steps of several tiles, a whole block in one program) and the default plan, on
# 3-layer test pages (12 rows), Llama 3.2 1B-like per-layer pages (1 layer, 8 heads: 16 rows of
# 16 x 64) and a 2-layer, 8-head page (32 rows).
_PLANS = [
    (3, 2, 8, 64, None, None),
    (3, 2, 8, 64, 1, 1),
    (3, 2, 8, 64, 4, 2),
    (3, 2, 8, 64, 12, 4),
    (1, 8, 16, 64, None, None),
    (1, 8, 16, 64, 1, 1),
    (1, 8, 16, 64, 8, 2),
    (1, 8, 16, 64, 16, 4),
    (1, 8, 16, 64, 16, 16),
    (2, 8, 16, 128, 32, 8),
    (2, 8, 16, 128, 4, 4),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_layers,heads,block_size,head_dim,head_rows,slab_rows", _PLANS)
def test_copy_blocks_plans_interpret(dtype, num_layers, heads, block_size, head_dim, head_rows, slab_rows):
  """Every plan copies each destination from its source in every layer, K and V, and leaves
  every other block (block 0 included: only padding touches it) bit-identical; fresh random
  pages and copy lists per case."""
  from paged_kv.pallas_kernels import block_copy as bc
  seed = [num_layers, heads, block_size, head_dim, head_rows or 0, slab_rows or 0, jnp.dtype(dtype).itemsize]
  rng = np.random.default_rng(seed)
  num_blocks = 24
  pages = _pages(rng, dtype, block_size, head_dim, num_blocks=num_blocks, num_layers=num_layers, heads=heads)
  src, dst = _random_copies(rng, num_blocks, real=int(rng.integers(1, 9)), padding=int(rng.integers(0, 4)))
  got = bc.copy_blocks_pallas(pages, jnp.asarray(src), jnp.asarray(dst), interpret=True,
                              head_rows=head_rows, slab_rows=slab_rows)
  before = np.asarray(pages)
  got = np.asarray(got)
  np.testing.assert_array_equal(got, _expected_copy(before, src, dst))
  np.testing.assert_array_equal(got, np.asarray(pk.copy_blocks(pages, src, dst, impl="reference")))


def test_copy_blocks_default_plan_with_steps_interpret():
  """512 copies of Llama 3.2 1B-like per-layer pages (bf16): the default plan has programs of
  two steps of a 4-row slab (``copy_plan`` -> (4, 8)); all 512 copies land, nothing else moves."""
  from paged_kv.pallas_kernels import block_copy as bc
  rng = np.random.default_rng(512)
  num_blocks = 1100
  pages = _pages(rng, jnp.bfloat16, 16, 64, num_blocks=num_blocks, num_layers=1, heads=8)
  assert bc.copy_plan(512, 16, 16, 64, 2) == (4, 8)
  src, dst = _random_copies(rng, num_blocks, real=500, padding=12)
  got = np.asarray(pk.copy_blocks(pages, jnp.asarray(src), jnp.asarray(dst), impl="interpret"))
  np.testing.assert_array_equal(got, _expected_copy(np.asarray(pages), src, dst))


def test_copy_blocks_kernel_skips_self_copies_under_jit():
  """Under jit nothing checks the list; a self-copy (and padding) is then skipped by the kernel,
  so those blocks stay as they were."""
  from paged_kv.pallas_kernels import block_copy as bc
  rng = np.random.default_rng(7)
  pages = _pages(rng, jnp.float32, num_blocks=16)
  src = np.array([4, 9, 0, 6], np.int32)
  dst = np.array([4, 11, 0, 13], np.int32)  # 4 -> 4 is a self-copy
  step = jax.jit(lambda p, s, d: bc.copy_blocks_pallas(p, s, d, interpret=True, head_rows=4, slab_rows=2))
  got = np.asarray(step(pages, jnp.asarray(src), jnp.asarray(dst)))
  np.testing.assert_array_equal(got, _expected_copy(np.asarray(pages), src, dst))


def test_copy_resolve_plan_defaults():
  """Neither given: the plan; ``head_rows`` alone: one tile per step (the kernel before slab
  loads, which the gate's rule-breaking variant ``head_rows=16`` reproduces); ``slab_rows``
  alone: one step per program."""
  from paged_kv.pallas_kernels import block_copy as bc
  assert bc.resolve_plan(1, 512, 16, 128, 2) == bc.copy_plan(1, 512, 16, 128, 2)
  assert bc.resolve_plan(1, 512, 16, 128, 2, head_rows=16) == (1, 16)
  assert bc.resolve_plan(1, 512, 16, 128, 2, slab_rows=4) == (4, 4)
  assert bc.resolve_plan(1, 512, 16, 128, 2, head_rows=16, slab_rows=4) == (4, 16)


@pytest.mark.parametrize("head_rows,slab_rows", [(5, 1), (4, 3), (2, 4)])
def test_copy_blocks_rejects_plans_that_do_not_tile_the_rows(head_rows, slab_rows):
  from paged_kv.pallas_kernels import block_copy as bc
  pages = _pages(np.random.default_rng(0), jnp.float32)  # 3 layers x 2 x 2 heads = 12 rows
  idx = jnp.array([1], jnp.int32)
  with pytest.raises(ValueError, match="must divide"):
    bc.copy_blocks_pallas(pages, idx, idx + 1, interpret=True, head_rows=head_rows, slab_rows=slab_rows)


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
