"""Pallas paged decode attention (interpret mode) against the reference and against JAX's own
Pallas paged attention on the same inputs."""

import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.pallas_kernels import decode_attention, testing as kt
from paged_kv.pallas_kernels.jax_compat import jax_paged_attention
from tests import tolerances as tol

CASES = kt.KERNEL_CASES
# Roundings to bfloat16 (tests/tolerances.py): our kernel rounds the softmax weights before P V
# and the output, the reference only the output; JAX's kernel also rounds its unnormalised split
# partials, the split correction, their product and sum, the denominator and the quotient.
OURS, REFERENCE, JAX_KERNEL = 2, 1, 7


def _lengths(block_size):
  # length 1, ending mid-block, a long one next to short ones, an empty slot, a full block.
  return [1, block_size + 3, 6 * block_size - 5, 0, block_size]


@pytest.mark.parametrize("dtype,block_size,head_dim,group", CASES)
def test_decode_interpret_matches_reference(dtype, block_size, head_dim, group):
  rng = np.random.default_rng(block_size + head_dim + group)
  lengths = _lengths(block_size)
  case = kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=head_dim,
                            num_kv_heads=2, dtype=dtype)
  q = kt.random_queries(rng, (len(lengths), 2 * group, head_dim), dtype)
  ln = jnp.asarray(case.lengths)
  want = pk.paged_decode_attention(q, case.pages, 1, case.block_tables, ln, impl="reference")
  got = pk.paged_decode_attention(q, case.pages, 1, case.block_tables, ln, impl="interpret")
  assert got.shape == q.shape and got.dtype == q.dtype
  atol = tol.paged_attention_atol(q, case.pages, 1, head_dim ** -0.5, max(lengths),
                                  roundings=OURS + REFERENCE)
  tol.assert_close(got, want, atol, "kernel")
  assert np.all(np.asarray(got[3]) == 0)
  # Split-K with several splits and one block per tile: the log-sum-exp merge is exercised.
  split = decode_attention.paged_decode_attention_pallas(
      q, case.pages, 1, case.block_tables, ln, scale=head_dim ** -0.5, interpret=True,
      blocks_per_tile=1, num_splits=3)
  tol.assert_close(split, want, atol, "split kernel")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.smoke
def test_decode_interpret_matches_jax_paged_attention(dtype):
  rng = np.random.default_rng(7)
  block_size, head_dim, group = 16, 64, 4
  lengths = [1, 19, 7 * block_size - 3, 0]
  case = kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=head_dim,
                            num_kv_heads=2, dtype=dtype, extra_columns=1)
  q = kt.random_queries(rng, (len(lengths), 2 * group, head_dim), dtype)
  ln = jnp.asarray(case.lengths)
  # JAX's kernel applies no softmax scale.
  ours = pk.paged_decode_attention(q, case.pages, 1, case.block_tables, ln, scale=1.0,
                                   impl="interpret")
  max_blocks = case.block_tables.shape[1]
  theirs = jax_paged_attention().paged_attention(
      q, case.pages[1, 0], case.pages[1, 1], case.block_tables, ln, k_splits=2,
      pages_per_compute_block=max_blocks // 2, interpret=True)
  atol = tol.paged_attention_atol(q, case.pages, 1, 1.0, max(lengths), roundings=OURS + JAX_KERNEL)
  tol.assert_close(ours, theirs, atol, "ours vs JAX")


def test_decode_skips_work_past_each_length():
  """Garbage (NaN) in blocks a sequence does not own past its length must not leak in."""
  rng = np.random.default_rng(8)
  case = kt.make_paged_case(rng, [3, 70], block_size=8, head_dim=64, num_kv_heads=1)
  # Sequence 0's unused table columns point at a NaN block instead of the null block.
  nan_block = int(case.block_tables[1, 5])
  pages = case.pages.at[:, :, :, nan_block].set(jnp.nan)
  tables = case.block_tables.at[0, 1:].set(nan_block)
  q = kt.random_queries(rng, (2, 2, 64))
  ln = jnp.array([3, 40], jnp.int32)
  got = decode_attention.paged_decode_attention_pallas(
      q, pages, 1, tables, ln, scale=0.125, interpret=True, blocks_per_tile=1, num_splits=4)
  want = pk.paged_decode_attention(q, case.pages, 1, case.block_tables, ln, impl="reference")
  assert np.isfinite(np.asarray(got)).all()
  tol.assert_close(got, want, tol.paged_attention_atol(q, case.pages, 1, 0.125, 40), "kernel")


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("max_blocks", [1, 3, 64, 2048])
@pytest.mark.parametrize("batch", [1, 256])
def test_partition_is_triton_legal_and_covers_table(block_size, max_blocks, batch):
  bpt, tps, splits = decode_attention.choose_partition(max_blocks, block_size, batch, 8)
  assert bpt & (bpt - 1) == 0 and bpt * block_size >= 16
  assert bpt * tps * splits >= max_blocks  # every table column is visited by some split
  assert bpt * tps * (splits - 1) < max_blocks  # and no split is entirely padding


KNOB_CASES = [(jnp.float32, 8, 32, 4, "cap"), (jnp.float32, 16, 32, 2, "both"),
              (jnp.bfloat16, 8, 32, 4, "alibi"), (jnp.bfloat16, 16, 32, 1, "both")]


def knobs_for(rng, num_q_heads, which):
  slopes = jnp.asarray(rng.uniform(0.02, 0.5, num_q_heads), jnp.float32)
  return {"cap": {"soft_cap": 2.0}, "alibi": {"alibi_slopes": slopes},
          "both": {"soft_cap": 1.5, "alibi_slopes": slopes}}[which]


@pytest.mark.parametrize("dtype,block_size,head_dim,group,which", KNOB_CASES)
def test_decode_knobs_interpret_match_reference(dtype, block_size, head_dim, group, which):
  """Soft-capping and ALiBi in the kernel (one tile and split-K) against the reference; lengths
  end mid-block, GQA groups of 1, 2 and 4."""
  rng = np.random.default_rng(block_size + group)
  lengths = [1, block_size + 3, 5 * block_size - 5, 0]
  case = kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=head_dim,
                            num_kv_heads=2, dtype=dtype)
  q = kt.random_queries(rng, (len(lengths), 2 * group, head_dim), dtype)
  ln = jnp.asarray(case.lengths)
  knobs = knobs_for(rng, 2 * group, which)
  want = pk.paged_decode_attention(q, case.pages, 1, case.block_tables, ln, scale=0.3,
                                   impl="reference", **knobs)
  got = pk.paged_decode_attention(q, case.pages, 1, case.block_tables, ln, scale=0.3,
                                  impl="interpret", **knobs)
  atol = tol.paged_attention_atol(q, case.pages, 1, 0.3, max(lengths), roundings=OURS + REFERENCE,
                                  **knobs)
  tol.assert_close(got, want, atol, f"kernel with {which}")
  assert np.all(np.asarray(got[3]) == 0)
  split = decode_attention.paged_decode_attention_pallas(
      q, case.pages, 1, case.block_tables, ln, scale=0.3, interpret=True, blocks_per_tile=2,
      num_splits=2, **knobs)
  tol.assert_close(split, want, atol, f"split kernel with {which}")
