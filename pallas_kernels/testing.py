"""Random paged-cache fixtures and an independent dense attention, for tests and benchmarks.

:func:`make_paged_case` builds pages filled with random values everywhere (the null block
included, so a wrong read shows up), block tables that place each sequence's blocks in random
physical order, unused entries 0, and optionally one block shared by the first two tables.
:func:`dense_attention` recomputes attention in float64 NumPy from a plain Python walk over
the block table: contiguous K/V per sequence, then an ordinary softmax. The tests' tolerances
are derived from the rounding error analysis in ``tests/tolerances.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from numpy.typing import ArrayLike

from paged_kv.attention_spec import AttentionSpec, as_spec

# (dtype, block_size, head_dim, group) shared by the decode and prefill kernel tests: every block
# size, head dim and GQA ratio appears at least once per dtype, without the full product
# (interpret mode is slow on a CPU).
KERNEL_CASES = [
    (jnp.float32, 8, 64, 1),
    (jnp.float32, 16, 128, 4),
    (jnp.float32, 32, 64, 8),
    (jnp.bfloat16, 8, 128, 8),
    (jnp.bfloat16, 16, 64, 1),
    (jnp.bfloat16, 32, 128, 4),
]


@dataclasses.dataclass
class PagedCase:
  pages: jnp.ndarray  # [L, 2, Hkv, NB, bs, D]
  block_tables: jnp.ndarray  # int32 [B, M]
  lengths: np.ndarray  # int32 [B], tokens the table's blocks hold
  layer: int


def make_paged_case(rng: np.random.Generator, lengths: Sequence[int] | np.ndarray, *, block_size: int, head_dim: int,
                    num_kv_heads: int, dtype: DTypeLike = jnp.float32, num_layers: int = 2, layer: int = 1,
                    share: bool = True, extra_columns: int = 1, spare_blocks: int = 2) -> PagedCase:
  """Pages and block tables for sequences of the given lengths (see module docstring).

  With ``share``, the first two sequences (when both have a block) hold the same physical
  block as their first block, as after a fork or a prefix-cache hit.
  """
  lengths = np.asarray(lengths, np.int32)
  need = [-(-int(n) // block_size) for n in lengths]
  max_blocks = max(max(need), 1) + extra_columns
  num_blocks = 1 + sum(need) + spare_blocks
  physical = rng.permutation(np.arange(1, num_blocks))
  tables = np.zeros((len(lengths), max_blocks), np.int32)
  used = 0
  for b, n in enumerate(need):
    tables[b, :n] = physical[used:used + n]
    used += n
  if share and len(need) > 1 and need[0] > 0 and need[1] > 0:
    tables[1, 0] = tables[0, 0]
  shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)
  pages = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  return PagedCase(pages, jnp.asarray(tables), lengths, layer)


def random_queries(rng: np.random.Generator, shape: tuple[int, ...], dtype: DTypeLike = jnp.float32) -> jax.Array:
  return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


def contiguous_kv(pages: ArrayLike, layer: int, table: ArrayLike, length: int
                  ) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
  """K, V of one sequence as float64 [Hkv, length, D], walking the table position by position."""
  pages = np.asarray(pages, np.float64)
  block_size = pages.shape[4]
  table = np.asarray(table)
  rows = [pages[layer, :, :, table[p // block_size], p % block_size] for p in range(length)]
  if not rows:
    return np.zeros((2, pages.shape[2], 0, pages.shape[5]))
  kv = np.stack(rows, axis=2)  # [2, Hkv, length, D]
  return kv[0], kv[1]


def dense_attention(q: ArrayLike, pages: ArrayLike, layer: int, table: ArrayLike, num_visible: int, scale: float, *,
                    soft_cap: float | None = None, alibi_slopes: ArrayLike | None = None,
                    window: int | AttentionSpec | None = None) -> np.ndarray:
  """q [Hq, D] of one query over the first ``num_visible`` positions -> float64 [Hq, D].

  The query sits at position ``num_visible - 1``. ``soft_cap``: scores become ``cap * tanh(s /
  cap)``; ``alibi_slopes`` [Hq]: ``slope[h] * (key_pos - query_pos)`` is added (in that order).
  ``window``: the attention kind, an ``AttentionSpec`` or its int code (None or 0: full; ``W >
  0``: only the last ``W`` positions are visible; ``-C``: only those of the query's chunk of
  ``C``, ``paged_kv.attention_spec.ChunkedLocal``); the others are dropped (whatever their table
  entries hold)."""
  q = np.asarray(q, np.float64)
  num_q_heads, head_dim = q.shape
  if num_visible <= 0:
    return np.zeros((num_q_heads, head_dim))
  k, v = contiguous_kv(pages, layer, table, num_visible)
  first = 0 if window is None else int(as_spec(window).first_visible(num_visible - 1))
  k, v = k[:, first:], v[:, first:]
  group = num_q_heads // k.shape[0]
  out = np.zeros((num_q_heads, head_dim))
  for h in range(num_q_heads):
    logits = k[h // group] @ q[h] * scale
    if soft_cap is not None:
      logits = soft_cap * np.tanh(logits / soft_cap)
    if alibi_slopes is not None:
      logits = logits + float(alibi_slopes[h]) * (np.arange(first, num_visible) - (num_visible - 1))
    w = np.exp(logits - logits.max())
    out[h] = (w / w.sum()) @ v[h // group]
  return out
