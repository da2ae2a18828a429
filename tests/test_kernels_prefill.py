"""Pallas paged prefill attention (interpret mode) against the reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.pallas_kernels import prefill_attention, testing as kt
from tests import tolerances as tol

CASES = kt.KERNEL_CASES
# Roundings to bfloat16 (tests/tolerances.py): the kernel rounds the softmax weights before P V
# and the output, the reference only the output.
OURS, REFERENCE = 2, 1


def _chunks(block_size, num_tokens):
  """(q_start, q_lens): a whole prompt from 0, a suffix after a block-aligned prefix hit, a
  chunk starting mid-block, one token far into the cache, and an all-padding row."""
  q_start = np.array([0, 2 * block_size, block_size + 3, 5 * block_size - 2, 4], np.int32)
  q_lens = np.array([num_tokens, num_tokens - 2, 3, 1, 0], np.int32)
  return q_start, q_lens


@pytest.mark.parametrize("dtype,block_size,head_dim,group", CASES)
def test_prefill_interpret_matches_reference(dtype, block_size, head_dim, group):
  rng = np.random.default_rng(block_size + head_dim + group)
  num_tokens = 5
  q_start, q_lens = _chunks(block_size, num_tokens)
  case = kt.make_paged_case(rng, q_start + q_lens, block_size=block_size, head_dim=head_dim,
                            num_kv_heads=2, dtype=dtype)
  q = kt.random_queries(rng, (len(q_start), num_tokens, 2 * group, head_dim), dtype)
  args = (q, case.pages, 1, case.block_tables, jnp.asarray(q_start), jnp.asarray(q_lens))
  want = pk.paged_prefill_attention(*args, impl="reference")
  got = pk.paged_prefill_attention(*args, impl="interpret")
  assert got.shape == q.shape and got.dtype == q.dtype
  atol = tol.paged_attention_atol(q, case.pages, 1, head_dim ** -0.5, int(max(q_start + q_lens)),
                                  roundings=OURS + REFERENCE)
  tol.assert_close(got, want, atol, "kernel")
  for b in range(len(q_start)):  # padding query rows are zeros
    assert np.all(np.asarray(got[b, q_lens[b]:]) == 0)


def test_prefill_small_tiles_cross_tile_boundaries():
  """Row tiles that split a token's query heads and single-block K/V tiles."""
  rng = np.random.default_rng(11)
  q_start = np.array([3, 17], np.int32)
  q_lens = np.array([9, 6], np.int32)
  case = kt.make_paged_case(rng, q_start + q_lens, block_size=8, head_dim=64, num_kv_heads=2)
  q = kt.random_queries(rng, (2, 9, 6, 64))  # group 3: tokens straddle 16-row tiles
  args = (q, case.pages, 1, case.block_tables, jnp.asarray(q_start), jnp.asarray(q_lens))
  want = pk.paged_prefill_attention(*args, scale=0.2, impl="reference")
  got = prefill_attention.paged_prefill_attention_pallas(
      *args, scale=0.2, interpret=True, rows_per_tile=16, blocks_per_tile=1)
  tol.assert_close(got, want, tol.paged_attention_atol(q, case.pages, 1, 0.2, 23), "kernel")


@pytest.mark.parametrize("dtype,block_size,head_dim,group,which",
                         [(jnp.float32, 8, 32, 4, "both"), (jnp.bfloat16, 16, 32, 3, "both"),
                          (jnp.float32, 16, 32, 1, "cap"), (jnp.bfloat16, 8, 32, 2, "alibi")])
def test_prefill_knobs_interpret_match_reference(dtype, block_size, head_dim, group, which):
  """Soft-capping and ALiBi in the prefill kernel against the reference: chunks starting
  mid-block, a padding row, GQA groups 1-4 (group 3 with 16-row tiles splits a token's heads)."""
  from tests.test_kernels_decode import knobs_for
  rng = np.random.default_rng(block_size * group)
  num_tokens = 5
  q_start, q_lens = _chunks(block_size, num_tokens)
  case = kt.make_paged_case(rng, q_start + q_lens, block_size=block_size, head_dim=head_dim,
                            num_kv_heads=2, dtype=dtype)
  q = kt.random_queries(rng, (len(q_start), num_tokens, 2 * group, head_dim), dtype)
  knobs = knobs_for(rng, 2 * group, which)
  args = (q, case.pages, 1, case.block_tables, jnp.asarray(q_start), jnp.asarray(q_lens))
  want = pk.paged_prefill_attention(*args, scale=0.3, impl="reference", **knobs)
  got = prefill_attention.paged_prefill_attention_pallas(
      *args, scale=0.3, interpret=True, rows_per_tile=16, **knobs)
  atol = tol.paged_attention_atol(q, case.pages, 1, 0.3, int(max(q_start + q_lens)),
                                  roundings=OURS + REFERENCE, **knobs)
  tol.assert_close(got, want, atol, f"kernel with {which}")
  for b in range(len(q_start)):
    assert np.all(np.asarray(got[b, q_lens[b]:]) == 0)
