"""Tile parameters of the Pallas (Triton) kernels, chosen from the configuration by one table.

Why a table: a Triton program of the attention kernels holds, for one loop iteration, a K and a
V tile of ``keys_per_tile x head_dim`` elements in shared memory and a float32 accumulator of
``rows x head_dim`` (plus the scores ``rows x keys_per_tile``) in registers. Both grow with the
element size and ``head_dim``, so one fixed tile cannot serve every dtype and head size: on an
H100/H200 (232,448 B of opt-in shared memory per block, 255 registers per thread) a 128-key
float32 tile at head_dim 256 asks for 286,720 B and does not compile, and a 64-row float32
prefill tile at head_dim 128 spills registers. The table gives, per (kernel, dtype, head_dim),
the largest tile that compiled without spills for every block size and GQA group the gate
checks (``scripts/gate/gpu_compile.py`` compiles every row for sm_90 and sm_80; the rows are what
it measured, see ``results/gpu_compile_summary.json``).

A row says how many keys one K/V tile holds; the kernels turn it into ``blocks_per_tile =
keys_per_tile // block_size``. A block larger than the row's tile would make the tile a whole
block, bigger than what was checked, so such a block size is refused
(:func:`check_attention_fits`), as is any dtype or head_dim without a row. Both are
``ValueError``s raised by :mod:`paged_kv.pallas_kernels.validate` before anything is traced.

Everything here is static Python (hashable dataclasses, ints): it runs at trace time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

# Shared memory limits the rows were checked against (opt-in bytes per thread block).
SMEM_LIMITS = {"sm_90": 232_448, "sm_80": 166_912}
MAX_REGISTERS_PER_THREAD = 255

# Triton's dot needs every dimension >= 16 (rows, keys and head_dim).
MIN_DOT = 16

HEAD_DIMS = (16, 32, 64, 128, 256)
"""head_dims with a table row: the Pallas kernels refuse others (the XLA reference serves any)."""


def next_power_of_two(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class AttentionTile:
  """One table row: the largest checked tile for a (kernel, dtype, head_dim).

  Attributes:
    keys_per_tile: keys in one K (and one V) tile, a power of two >= 16.
    rows_per_tile: query rows per program. Prefill: ``t * G + g`` rows, at most this many per
      program. Decode: the largest checked GQA group padded to a power of two (one program holds
      a whole group; larger groups are refused).
    num_warps, num_stages: Triton launch parameters.
    min_block_size: the smallest block size checked (a tile of many tiny blocks is a wider
      gather; one configuration spilled there).
    ctas_per_sm: programs one sm_90 SM holds at this tile (registers and shared memory as
      ptxas reported them at block size 16; the decode split rule fills whole waves of them).
  """

  keys_per_tile: int
  rows_per_tile: int
  num_warps: int = 4
  num_stages: int = 2
  min_block_size: int = 1
  ctas_per_sm: int = 1


@dataclasses.dataclass(frozen=True)
class Knobs:
  """The attention knobs as the tiling sees them: whether the kernel carries them, not their
  values (a soft cap's value is a constant in the same code; ALiBi slopes and the sliding window
  are inputs). Each adds per-score work and live values to the score path (the window also a
  second loop bound), so a tile checked without them may not fit with them (:data:`KNOB_TABLES`)."""

  soft_cap: bool = False
  alibi: bool = False
  window: bool = False

  @classmethod
  def of(cls, soft_cap: float | None = None, alibi_slopes: jax.Array | None = None,
         window: int | jax.Array | None = None) -> Knobs:
    """From a kernel call's arguments (``soft_cap`` a float or None, ``alibi_slopes`` an array or
    None, ``window`` an int, an int32 scalar array or None)."""
    return cls(soft_cap=soft_cap is not None, alibi=alibi_slopes is not None, window=window is not None)

  def describe(self) -> str:
    on = [n for n, v in (("soft_cap", self.soft_cap), ("alibi_slopes", self.alibi), ("window", self.window))
          if v]
    return " with " + " and ".join(on) if on else ""


NO_KNOBS = Knobs()


@dataclasses.dataclass(frozen=True)
class Tiling:
  """What a kernel launch uses (all static Python ints)."""

  blocks_per_tile: int
  rows_per_tile: int
  num_warps: int
  num_stages: int
  ctas_per_sm: int = 1


def _dtype_name(dtype) -> str:
  return jnp.dtype(dtype).name


def _row(keys, rows, warps=4, stages=2, min_block=1, ctas=1):
  return AttentionTile(keys_per_tile=keys, rows_per_tile=rows, num_warps=warps, num_stages=stages,
                       min_block_size=min_block, ctas_per_sm=ctas)


# Decode: one query token per sequence, the GQA group padded to a power of two >= 16 rows; a
# row's ``rows_per_tile`` is the largest padded group checked: 32 query heads per KV head for
# 2-byte types at head_dim 16, 64 and 128, 16 elsewhere (32-row tiles spilled: 164 B in bf16 at
# head_dim 256, 20 B in float32 at 256, 12 B in float32 at head_dim 32 with 128-token blocks on
# sm_80, and with JAX 0.12's Triton 12 B in 2-byte types at head_dim 32, on both targets).
# 64 keys per tile (the prefill rows' tile, so no block size either kernel accepts is refused
# here), 32 for float32 at head_dim 256. Five Triton stages: the K/V gather's address is itself a
# load (the block table), and Triton's pipeliner splits its stages between the two loads
# (``(num_stages - 1) // 2`` each), so 5 stages keep two K/V tiles in flight
# (``cp.async.wait_group 3`` with 3 commit groups per iteration) while the current one is
# computed; 2-4 stages left one buffer and ``wait_group 0``. Eight warps: at four, the 64-key
# bf16 tile spilled 4 B at 72 registers.
DECODE_TABLE: dict[tuple[str, int], AttentionTile] = {
    **{(dt, d): _row(64, rows, warps=8, stages=5, ctas=ctas) for dt in ("bfloat16", "float16")
       for d, rows, ctas in ((16, 32, 2), (32, 16, 4), (64, 32, 4), (128, 32, 3), (256, 16, 1))},
    ("float32", 16): _row(64, 16, warps=4, stages=5, ctas=4),  # 8 warps spilled 4 B at 1-token blocks
    ("float32", 32): _row(64, 16, warps=8, stages=5, ctas=3),
    ("float32", 64): _row(64, 16, warps=8, stages=5, ctas=3),
    ("float32", 128): _row(64, 16, warps=8, stages=5, ctas=1),
    ("float32", 256): _row(32, 16, warps=8, stages=5, ctas=1),
}

# Prefill: query heads folded into rows, up to 64 rows x 64 keys per program. 2-byte types at
# head_dim <= 128 and float32 at 64 keep today's 64 x 64 tile on 4 warps. Larger accumulators
# (rows x head_dim float32 spread over the threads) spilled at 255 registers with 4 warps:
# float32 head_dim 128 and 2-byte head_dim 256 go to 8 warps (same tile, half the registers
# per thread: 242 and 230 registers). float32 head_dim 256 still spilled 372 B on 8 warps at
# 64 x 32; 32 rows x 32 keys on 8 warps uses 152-158 registers and 102,400 B. (32 x 64 also fits
# an H100, 172,032 B, but not an A100's 166,912 B: one table serves both.) 2-byte types at
# head_dim 16 take blocks of at least 4 tokens: JAX 0.12 lowers the Triton kernel for sm_80 itself
# (0.10 lowered every target as sm_90), and there tiles of 1- and 2-token blocks spilled 28 B at
# 96 registers (a local array for the gather, not register pressure). One table serves every
# supported JAX release.
PREFILL_TABLE: dict[tuple[str, int], AttentionTile] = {
    **{(dt, d): _row(64, 64) for dt in ("bfloat16", "float16", "float32") for d in HEAD_DIMS},
    ("float32", 128): _row(64, 64, warps=8),
    ("bfloat16", 256): _row(64, 64, warps=8),
    ("float16", 256): _row(64, 64, warps=8),
    ("float32", 256): _row(32, 32, warps=8),
    ("bfloat16", 16): _row(64, 64, min_block=4),
    ("float16", 16): _row(64, 64, min_block=4),
}

TABLES = {"decode": DECODE_TABLE, "prefill": PREFILL_TABLE}

# Rows that differ when a knob is on, keyed (kernel, dtype, head_dim, Knobs); a configuration
# without an entry here uses its no-knob row (the gate compiles every knob on every row at
# head_dim 64/128/256 and fails on a spill, so a missing entry is a checked one).
# Prefill, float32 at head_dim 256 with a soft cap and a window: the 32 x 32 tile spilled 8 B at
# 128 registers on sm_80 once the window became the attention kind's rule (a chunk's start is a
# division by a traced size); 16 rows x 32 keys halve the accumulator per thread.
KNOB_TABLES: dict[tuple[str, str, int, Knobs], AttentionTile] = {
    ("prefill", "float32", 256, Knobs(soft_cap=True, window=True)): _row(32, 16, warps=8),
}


def table_row(kernel: str, dtype: DTypeLike, head_dim: int, knobs: Knobs = NO_KNOBS) -> AttentionTile:
  """The row for ``kernel`` ("decode" or "prefill") with ``knobs``; ``ValueError`` naming the
  limit if none."""
  table = TABLES[kernel]
  key = (_dtype_name(dtype), int(head_dim))
  if (kernel, *key, knobs) in KNOB_TABLES:
    return KNOB_TABLES[(kernel, *key, knobs)]
  if key not in table:
    raise ValueError(
        f"{kernel} attention: no Pallas tiling for dtype {key[0]} with head_dim={head_dim}; the "
        f"tiling table (pallas_kernels/tiling.py) covers head_dim in {HEAD_DIMS} for "
        "float32/bfloat16/float16, the sizes checked to fit "
        f"{SMEM_LIMITS['sm_80']:,} B (sm_80) / {SMEM_LIMITS['sm_90']:,} B (sm_90) of shared "
        f"memory and {MAX_REGISTERS_PER_THREAD} registers per thread; use impl='reference'")
  return table[key]


def check_attention_fits(kernel: str, dtype: DTypeLike, head_dim: int, block_size: int, group: int = 1,
                         knobs: Knobs = NO_KNOBS) -> AttentionTile:
  """Raises ``ValueError`` when no checked tile serves this configuration; returns the row.

  A tile holds whole blocks, so a block holding more keys than the row's tile would need a
  tile beyond what was checked against the shared-memory limit; a decode program holds a whole
  GQA group (``group = num_q_heads // num_kv_heads``), so a group padded past the row's rows
  would need more registers than were checked."""
  row = table_row(kernel, dtype, head_dim, knobs)
  what = f"{_dtype_name(dtype)} head_dim={head_dim}{knobs.describe()}"
  limits = (f"shared memory limit {SMEM_LIMITS['sm_80']:,} B on sm_80, {SMEM_LIMITS['sm_90']:,} B "
            f"on sm_90, {MAX_REGISTERS_PER_THREAD} registers per thread; pallas_kernels/tiling.py")
  if block_size > row.keys_per_tile:
    raise ValueError(
        f"{kernel} attention: block_size={block_size} exceeds the {row.keys_per_tile}-key tile "
        f"that fits for {what} ({limits}); use block_size <= "
        f"{row.keys_per_tile} or impl='reference'")
  if block_size < row.min_block_size:
    raise ValueError(
        f"{kernel} attention: block_size={block_size} is below {row.min_block_size}, the smallest "
        f"checked for {what} ({limits}); use impl='reference'")
  if kernel == "decode" and max(MIN_DOT, next_power_of_two(group)) > row.rows_per_tile:
    raise ValueError(
        f"decode attention: a GQA group of {group} query heads per KV head exceeds the "
        f"{row.rows_per_tile} rows checked for {what} ({limits}); "
        "use impl='reference'")
  return row


def tile_blocks(keys_per_tile: int, block_size: int, max_blocks: int) -> int:
  """Blocks gathered per K/V tile for a tile of ``keys_per_tile`` keys."""
  # A power of two number of blocks, no more than the (padded) table needs, and at least 16
  # keys (Triton's dot minimum: short tables are padded with masked null-block entries).
  bpt = min(max(1, keys_per_tile // block_size), next_power_of_two(max_blocks))
  return max(bpt, MIN_DOT // block_size)


def decode_tiling(dtype: DTypeLike, head_dim: int, block_size: int, group: int, max_blocks: int,
                  knobs: Knobs = NO_KNOBS) -> Tiling:
  """Tile of the decode kernel for one configuration (``group = num_q_heads // num_kv_heads``)."""
  row = table_row("decode", dtype, head_dim, knobs)
  rows = max(MIN_DOT, next_power_of_two(group))
  return Tiling(blocks_per_tile=tile_blocks(row.keys_per_tile, block_size, max_blocks),
                rows_per_tile=rows, num_warps=row.num_warps, num_stages=row.num_stages,
                ctas_per_sm=row.ctas_per_sm)


def prefill_tiling(dtype: DTypeLike, head_dim: int, block_size: int, group: int, num_tokens: int,
                   max_blocks: int, knobs: Knobs = NO_KNOBS) -> Tiling:
  """Tile of the prefill kernel: ``num_tokens * group`` query rows, at most the row's tile."""
  row = table_row("prefill", dtype, head_dim, knobs)
  rows = min(row.rows_per_tile, max(MIN_DOT, next_power_of_two(num_tokens * group)))
  return Tiling(blocks_per_tile=tile_blocks(row.keys_per_tile, block_size, max_blocks),
                rows_per_tile=rows, num_warps=row.num_warps, num_stages=row.num_stages)


def all_rows() -> Iterator[tuple[str, str, int, AttentionTile]]:
  """(kernel, dtype name, head_dim, row) for every table row: what the gate compiles."""
  for kernel, table in TABLES.items():
    for (dt, d), row in sorted(table.items()):
      yield kernel, dt, d, row
