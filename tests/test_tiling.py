"""The kernels' tiling table (``pallas_kernels/tiling.py``) and the refusals it implies.

Whether each row really fits (shared memory, registers) is what ``scripts/gate/gpu_compile.py`` checks
by compiling every row for sm_90 and sm_80; here: the choice is Triton-legal, keeps today's bf16
tiles, follows the table, and configurations without a checked tile are refused before tracing."""

import jax
import jax.numpy as jnp
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.pallas_kernels import tiling

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("kernel,dtype,head_dim,row", list(tiling.all_rows()))
def test_rows_are_triton_legal(kernel, dtype, head_dim, row):
  for n in (row.keys_per_tile, row.rows_per_tile):
    assert n >= tiling.MIN_DOT and n & (n - 1) == 0
  assert row.num_warps in (1, 2, 4, 8) and row.num_stages >= 1


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 4, 8, 32])
@pytest.mark.parametrize("max_blocks", [1, 3, 256])
def test_choice_follows_the_row(block_size, group, max_blocks):
  for dt in ("bfloat16", "float16", "float32"):
    for d in (64, 128, 256):
      row = tiling.table_row("decode", dt, d)
      t = tiling.decode_tiling(jnp.dtype(dt), d, block_size, group, max_blocks)
      keys = t.blocks_per_tile * block_size
      assert t.blocks_per_tile & (t.blocks_per_tile - 1) == 0
      assert tiling.MIN_DOT <= keys <= max(row.keys_per_tile, tiling.MIN_DOT)
      # The largest tile of the row unless the table is shorter than it.
      assert keys == row.keys_per_tile or t.blocks_per_tile >= max_blocks or keys == tiling.MIN_DOT
      assert t.rows_per_tile == max(16, 1 << (group - 1).bit_length())
      assert (t.num_warps, t.num_stages) == (row.num_warps, row.num_stages)
      p = tiling.prefill_tiling(jnp.dtype(dt), d, block_size, group, 512, max_blocks)
      prow = tiling.table_row("prefill", dt, d)
      assert p.rows_per_tile == prow.rows_per_tile
      assert p.blocks_per_tile * block_size <= max(prow.keys_per_tile, tiling.MIN_DOT)
      short = tiling.prefill_tiling(jnp.dtype(dt), d, block_size, group, 1, max_blocks)
      assert short.rows_per_tile == min(prow.rows_per_tile, max(16, 1 << (group - 1).bit_length()))


def test_clean_bf16_tiles_are_unchanged():
  """Today's bf16 head_dim 64/128 prefill tiles compiled without spills at 168/184 registers: keep
  them. The decode rows are 64-key tiles on 8 warps with 5 Triton stages (two K/V tiles in
  flight behind the block-table load; 64-80 registers, 3-4 programs per SM on sm_90)."""
  for d in (64, 128):
    assert tiling.table_row("prefill", jnp.bfloat16, d) == tiling.AttentionTile(64, 64, 4, 2)
    row = tiling.table_row("decode", jnp.bfloat16, d)
    assert (row.keys_per_tile, row.rows_per_tile, row.num_warps, row.num_stages) == (64, 32, 8, 5)
  t = tiling.decode_tiling(jnp.bfloat16, 128, 16, 4, 256)
  assert (t.blocks_per_tile, t.num_warps, t.num_stages, t.ctas_per_sm) == (4, 8, 5, 3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("head_dim", tiling.HEAD_DIMS)
def test_decode_rows_refuse_no_block_size_prefill_accepts(dtype, head_dim):
  """A model runs both kernels on one page layout: the decode row's tile is never smaller than
  the prefill row's, nor its smallest block larger, so decode refuses no block size that prefill
  serves. Every decode row pipelines (at least 5 stages: two K/V tiles in flight behind the
  block-table load) and names the programs an SM holds, which the split rule fills."""
  dec, pre = tiling.table_row("decode", dtype, head_dim), tiling.table_row("prefill", dtype, head_dim)
  assert dec.keys_per_tile >= pre.keys_per_tile and dec.min_block_size <= pre.min_block_size
  assert dec.num_stages >= 5 and dec.ctas_per_sm >= 1


def _decode_args(dtype, head_dim, block_size, heads=2, q_heads=4):
  pages = S((1, 2, heads, 8, block_size, head_dim), dtype)
  return (S((2, q_heads, head_dim), dtype), pages, 0, S((2, 3), jnp.int32), S((2,), jnp.int32))


def _prefill_args(dtype, head_dim, block_size):
  pages = S((1, 2, 2, 8, block_size, head_dim), dtype)
  return (S((2, 5, 4, head_dim), dtype), pages, 0, S((2, 3), jnp.int32), S((2,), jnp.int32),
          S((2,), jnp.int32))


@pytest.mark.parametrize("impl", ["pallas", "interpret"])
def test_head_dim_without_a_row_is_refused(impl):
  with pytest.raises(ValueError, match=r"head_dim=512.*shared\s+memory"):
    pk.paged_decode_attention(*_decode_args(jnp.float32, 512, 16), impl=impl)
  with pytest.raises(ValueError, match=r"head_dim=512.*shared\s+memory"):
    pk.paged_prefill_attention(*_prefill_args(jnp.bfloat16, 512, 16), impl=impl)


def test_block_larger_than_the_checked_tile_is_refused():
  row = tiling.table_row("decode", jnp.float32, 256)
  with pytest.raises(ValueError, match=rf"block_size={2 * row.keys_per_tile} exceeds.*232,448"):
    pk.paged_decode_attention(*_decode_args(jnp.float32, 256, 2 * row.keys_per_tile), impl="pallas")
  prow = tiling.table_row("prefill", jnp.float32, 256)
  with pytest.raises(ValueError, match=rf"block_size={2 * prow.keys_per_tile} exceeds"):
    pk.paged_prefill_attention(*_prefill_args(jnp.float32, 256, 2 * prow.keys_per_tile), impl="pallas")


def test_group_larger_than_the_checked_rows_is_refused():
  """A decode program holds a whole GQA group: 32 query heads per KV head spilled at head_dim
  256, so such a group is refused there and accepted at head_dim 128."""
  with pytest.raises(ValueError, match=r"GQA group of 32 query heads.*16 rows"):
    pk.paged_decode_attention(*_decode_args(jnp.bfloat16, 256, 16, heads=1, q_heads=32), impl="pallas")
  jax.eval_shape(lambda q, p, t, n: pk.paged_decode_attention(q, p, 0, t, n, impl="pallas"),
                 *[a for i, a in enumerate(_decode_args(jnp.bfloat16, 128, 16, heads=1, q_heads=32)) if i != 2])
  with pytest.raises(ValueError, match=r"GQA group of 64"):
    pk.paged_decode_attention(*_decode_args(jnp.bfloat16, 128, 16, heads=1, q_heads=64), impl="interpret")
  # Prefill folds any group into its rows.
  tiling.check_attention_fits("prefill", jnp.bfloat16, 256, 16, group=64)


def test_block_smaller_than_the_checked_ones_is_refused():
  row = tiling.table_row("prefill", jnp.bfloat16, 16)
  assert row.min_block_size == 4
  with pytest.raises(ValueError, match=r"block_size=2 is below 4"):
    tiling.check_attention_fits("prefill", jnp.bfloat16, 16, 2, group=4)
  # Every decode row was checked down to one-token blocks (float32 at head_dim 256 too, since
  # its tile shrank to 32 keys).
  for dt in ("bfloat16", "float16", "float32"):
    for d in tiling.HEAD_DIMS:
      assert tiling.table_row("decode", dt, d).min_block_size == 1
  tiling.check_attention_fits("decode", jnp.float32, 256, 1, group=4)


def test_reference_and_cpu_auto_are_not_limited_by_the_table():
  """The XLA reference has no tiles: it serves what the Pallas kernels refuse (and "auto" on a
  CPU resolves to it)."""
  assert jax.default_backend() == "cpu"
  for impl in ("reference", "auto"):
    out = jax.eval_shape(lambda q, p, t, n, impl=impl: pk.paged_decode_attention(q, p, 0, t, n, impl=impl),
                         *[a for i, a in enumerate(_decode_args(jnp.float32, 512, 16)) if i != 2])
    assert out.shape == (2, 4, 512)


def test_largest_accepted_block_is_accepted():
  for kernel, dt, d, row in tiling.all_rows():
    group = row.rows_per_tile if kernel == "decode" else 64
    assert tiling.check_attention_fits(kernel, dt, d, row.keys_per_tile, group) == row
    assert tiling.check_attention_fits(kernel, dt, d, row.min_block_size, group) == row


def test_knob_facts_of_a_call():
  assert tiling.Knobs.of() == tiling.NO_KNOBS
  assert tiling.Knobs.of(soft_cap=30.0) == tiling.Knobs(soft_cap=True)
  assert tiling.Knobs.of(alibi_slopes=jnp.ones(4)) == tiling.Knobs(alibi=True)
  assert tiling.Knobs(True, True).describe() == " with soft_cap and alibi_slopes"
  assert tiling.NO_KNOBS.describe() == ""


def test_a_knob_row_is_used_and_enforced_only_with_that_knob(monkeypatch):
  """A row in KNOB_TABLES replaces the no-knob row for calls with exactly those knobs: the tile
  choice follows it and the input checks refuse what it does not serve, naming the knob."""
  base = tiling.table_row("decode", jnp.bfloat16, 128)
  small = tiling.AttentionTile(keys_per_tile=32, rows_per_tile=16, num_warps=8)
  cap = tiling.Knobs(soft_cap=True)
  monkeypatch.setitem(tiling.KNOB_TABLES, ("decode", "bfloat16", 128, cap), small)
  assert tiling.table_row("decode", jnp.bfloat16, 128, cap) == small
  assert tiling.table_row("decode", jnp.bfloat16, 128) == base
  assert tiling.table_row("decode", jnp.bfloat16, 128, tiling.Knobs(soft_cap=True, alibi=True)) == base
  t = tiling.decode_tiling(jnp.bfloat16, 128, 16, 4, 256, cap)
  assert (t.blocks_per_tile, t.num_warps) == (2, 8)
  assert tiling.decode_tiling(jnp.bfloat16, 128, 16, 4, 256).blocks_per_tile == 4
  args = _decode_args(jnp.bfloat16, 128, 64)
  with pytest.raises(ValueError, match=r"block_size=64 exceeds the 32-key tile .*bfloat16 head_dim=128 with soft_cap"):
    pk.paged_decode_attention(*args, impl="pallas", soft_cap=30.0)
  with pytest.raises(ValueError, match=r"GQA group of 32 .*16 rows .* with soft_cap"):
    pk.paged_decode_attention(*_decode_args(jnp.bfloat16, 128, 16, heads=1, q_heads=32), impl="pallas",
                              soft_cap=30.0)
  # Without the knob the same configurations are served by the 64-key, 32-row row.
  jax.eval_shape(lambda q, p, b, n: pk.paged_decode_attention(q, p, 0, b, n, impl="pallas"),
                 *[a for i, a in enumerate(args) if i != 2])
  assert tiling.check_attention_fits("decode", jnp.bfloat16, 128, 64, 32, tiling.Knobs(alibi=True)) == base
