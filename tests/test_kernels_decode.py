"""Pallas paged decode attention (interpret mode) against the reference and against JAX's own
Pallas paged attention on the same inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.pallas_kernels import decode_attention, testing as kt
from paged_kv.pallas_kernels.jax_compat import export_cuda, jax_paged_attention
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


# ------------------------------------------------------------------------------ the launch
S = jax.ShapeDtypeStruct
LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


def _llama_export(batch, context):
  """The exported (StableHLO) program of one Llama 3.1 8B decode call with a traced layer."""
  mb = context // LLAMA["block_size"]
  pages = S((4, 2, 8, batch * mb + 1, 16, 128), jnp.bfloat16)
  return export_cuda(lambda q, p, layer, bt, ln: pk.paged_decode_attention(q, p, layer, bt, ln, impl="pallas"),
                     S((batch, 32, 128), jnp.bfloat16), pages, S((), jnp.int32), S((batch, mb), jnp.int32),
                     S((batch,), jnp.int32)).mlir_module()


def test_one_split_is_the_kernel_alone():
  """64 sequences x 4,096 tokens fill the GPU with one split: the program is the Triton call and
  reshapes, with no prologue (q pad, table sanitise and pad, length clip, layer clamp) and no
  merge; the kernel writes the output in q's dtype."""
  part = decode_attention.decode_partition(64, 32, 8, 128, 16, 256, jnp.bfloat16)
  assert part.num_splits == 1
  text = _llama_export(64, 4096)
  assert text.count("stablehlo.custom_call") == 1
  for op in ("stablehlo.pad", "stablehlo.select", "stablehlo.clamp", "stablehlo.reduce", "stablehlo.exponential",
             "stablehlo.convert", "stablehlo.maximum", "stablehlo.minimum"):
    assert op not in text, op
  assert "tensor<64x8x4x128xbf16>" in text  # the kernel's own output, [B, Hkv, G, D]


def test_several_splits_write_the_group_rows_and_merge_once():
  """One sequence of 32,768 tokens needs splits to reach every SM: one Triton call writes float32
  partials for the group's 4 rows (not the 16 padded rows of the dot) and one merge follows."""
  part = decode_attention.decode_partition(1, 32, 8, 128, 16, 2048, jnp.bfloat16)
  assert part.num_splits > 1
  text = _llama_export(1, 32768)
  assert text.count("stablehlo.custom_call") == 1
  assert f"tensor<1x8x{part.num_splits}x4x128xf32>" in text
  assert "stablehlo.pad" not in text and "stablehlo.clamp" not in text


@pytest.mark.parametrize("batch,context,splits", [(64, 4096, 1), (256, 1024, 1), (1, 32768, 16), (4, 8192, 4)])
def test_split_rule_at_the_llama_shapes(batch, context, splits):
  """Whole waves of the resident slots (3 programs per SM at this tile, 132 SMs): 512 and 2,048
  programs need no split; 8 and 32 programs are split to 128 programs, one per SM, each walking
  an equal share of the table (a 129th program would load some SM twice)."""
  part = decode_attention.decode_partition(batch, 32, 8, 128, 16, context // 16, jnp.bfloat16)
  assert part.num_splits == splits
  tiles = context // 16 // part.blocks_per_tile
  assert part.tiles_per_split * splits == tiles


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 16, 40, 49, 50, 64, 100, 256])
@pytest.mark.parametrize("max_blocks", [1, 7, 64, 300, 2048, 8192])
@pytest.mark.parametrize("ctas_per_sm", [1, 3])
def test_split_rule_is_the_fastest_by_its_model(batch, max_blocks, ctas_per_sm):
  """The chosen split count is within 1 % of the best of every count by split_time, and it
  never leaves most SMs idle when the table has the tiles to fill them."""
  kw = dict(tile_bytes=32768, stages=2, ctas_per_sm=ctas_per_sm, partial_bytes=2 * 4 * 130 * 4)
  bpt, tps, splits = decode_attention.choose_partition(max_blocks, 16, batch, 8, 4, **kw)
  tiles = -(-max_blocks // bpt)
  assert tps * splits >= tiles and tps * (splits - 1) < tiles
  cost = functools.partial(decode_attention.split_time, batch * 8, tiles, **kw)
  assert cost(splits) <= 1.01 * min(cost(s) for s in range(1, tiles + 1))
  if batch * 8 * tiles >= decode_attention.SMS and max_blocks >= 64:
    assert batch * 8 * splits >= decode_attention.SMS // 2


# ------------------------------------------------------------------------------ new tiles, fresh inputs
TILE_CASES = [
    # dtype, block size, head_dim, group, lengths (several 64-key tiles; mid-block ends)
    (jnp.bfloat16, 16, 128, 4, [300, 1, 129, 64, 0, 257]),
    (jnp.float16, 8, 64, 16, [200, 75, 9]),  # 16 rows: the group fills the dot, no padding rows
    (jnp.bfloat16, 64, 32, 8, [130, 64, 65]),  # a block is a whole tile
    (jnp.float32, 1, 256, 2, [70, 33, 1]),  # float32 head_dim 256: 32-key tile of one-token blocks
]


@pytest.mark.parametrize("dtype,block_size,head_dim,group,lengths", TILE_CASES)
def test_decode_tiles_one_and_several_splits(dtype, block_size, head_dim, group, lengths):
  """The table's tiles (64 keys; 32 for float32 at head_dim 256) over several tiles per program,
  with the split rule's choice, one split (the kernel normalises, no merge) and an uneven three
  (merge, a split past some sequences' ends), against the reference on fresh random inputs."""
  rng = np.random.default_rng(1000 + block_size * head_dim + group)
  case = kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=head_dim, num_kv_heads=2,
                            dtype=dtype, extra_columns=3)
  q = kt.random_queries(rng, (len(lengths), 2 * group, head_dim), dtype)
  ln = jnp.asarray(case.lengths)
  scale = head_dim ** -0.5
  want = pk.paged_decode_attention(q, case.pages, 1, case.block_tables, ln, impl="reference")
  atol = tol.paged_attention_atol(q, case.pages, 1, scale, max(lengths), roundings=OURS + REFERENCE)
  for splits in (None, 1, 3):
    got = decode_attention.paged_decode_attention_pallas(q, case.pages, 1, case.block_tables, ln, scale=scale,
                                                         interpret=True, num_splits=splits)
    assert got.shape == q.shape and got.dtype == q.dtype
    tol.assert_close(got, want, atol, f"kernel, splits={splits}")
    for b, n in enumerate(lengths):
      if n == 0:
        assert np.all(np.asarray(got[b]) == 0)


def test_decode_checks_its_inputs_in_the_kernel():
  """What the XLA prologue used to do per call, the kernel does: block ids outside
  [0, num_blocks) read the null block (as the reference's sanitising), lengths past the table's
  capacity are clipped and negative ones give zeros, a traced layer past the last is clamped."""
  rng = np.random.default_rng(77)
  block_size, head_dim, lengths = 8, 64, [40, 23, 17]
  case = kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=head_dim, num_kv_heads=2,
                            dtype=jnp.bfloat16, extra_columns=0)
  num_blocks = case.pages.shape[3]
  tables = case.block_tables.at[1, 1].set(-3).at[2, 0].set(num_blocks + 5)
  ln = jnp.asarray([40, 10_000, -4], jnp.int32)  # 10,000 > capacity: every column of the table
  q = kt.random_queries(rng, (3, 8, head_dim), jnp.bfloat16)
  # Positions past the table's capacity do not exist (paged_decode_attention's contract); the
  # reference pads the table to its chunks, so it is given the clipped lengths.
  capacity = tables.shape[1] * block_size
  want = pk.paged_decode_attention(q, case.pages, 1, tables, jnp.clip(ln, 0, capacity), impl="reference")
  atol = tol.paged_attention_atol(q, case.pages, 1, head_dim ** -0.5, capacity,
                                  roundings=OURS + REFERENCE)
  fn = jax.jit(lambda layer: pk.paged_decode_attention(q, case.pages, layer, tables, ln, impl="interpret"))
  for splits in (None, 2):
    got = (fn(jnp.int32(7)) if splits is None else decode_attention.paged_decode_attention_pallas(
        q, case.pages, jnp.int32(7), tables, ln, scale=head_dim ** -0.5, interpret=True, num_splits=splits))
    tol.assert_close(got, want, atol, f"kernel, splits={splits}")
    assert np.all(np.asarray(got[2]) == 0)


# ------------------------------------------------------------------------------ the model's work
@pytest.mark.parametrize("batch,context", [(64, 4096), (256, 1024), (1, 32768), (4, 8192)])
def test_decode_work_follows_the_launch(batch, context):
  """scripts/gate/perf_work_decode.py describes the launch the kernel makes: every K/V byte once
  plus q and the output, the partials (written and read) as extra bytes only with splits, the
  busiest split's tiles as steps; and with the facts the deviceless sm_90 compile reports for
  the bf16 head_dim 128 row at these shapes (64 registers, 256 threads, 72,192 B of shared
  memory, ``cp.async.wait_group 3`` with 3 commit groups: two K/V tiles in flight), the model
  puts the call at >= 85 % of the roofline."""
  from scripts.gate import perf_model, perf_work_decode

  launch = perf_work_decode.decode_launch(batch, context, **LLAMA)
  part = decode_attention.decode_partition(batch, 32, 8, 128, 16, context // 16, jnp.bfloat16)
  assert launch == part  # the kernel's own partition
  work = perf_work_decode.decode_work(batch, context, 32, 8, 128, 16, 2)
  kv = batch * context * 8 * 128 * 2 * 2
  assert work.bytes == kv + 2 * batch * 32 * 128 * 2
  assert work.extra_bytes == (0 if part.num_splits == 1 else 2 * 2 * batch * 8 * part.num_splits * 4 * 128 * 4)
  assert work.steps == part.tiles_per_split and work.step_bytes == 2 * 64 * 128 * 2
  pipe = perf_model.Pipeline(loop=True, cp_async_bytes=0, ld_global_bytes=0, commit_groups=3, wait_group=3, tma=0,
                             stages=2, overlapped=True)
  est = perf_model.estimate(perf_model.H200, perf_work_decode.ctas(batch, LLAMA["num_kv_heads"], launch), 256, 64,
                            72_192, pipe, work, "mma.sync")
  assert est.fraction[0] >= 0.85 and not perf_model.rule_violations(est)
