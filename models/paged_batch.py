"""The batch metadata of one step over the paged cache: block tables, query spans and KV slots.

The slot of the token at position p of a sequence is `table[p // bs] * bs + p % bs`; padding
tokens (and positions past the table) get a slot in the null block (block 0), which is never read
as data.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.typing import ArrayLike

from paged_kv.pallas_kernels import NULL_BLOCK


@struct.dataclass
class PagedBatch:
    """Per-step batch metadata (all int32; B sequences, T tokens per sequence this step).

    Attributes:
      block_tables: int32[B, M] physical block ids of each sequence, in logical order; unused
        entries hold NULL_BLOCK (0).
      q_start: int32[B] position of the first token of this step (= tokens already cached).
      q_lens: int32[B] valid tokens this step, in [0, T]; 0 marks a padding row.
      slots: int32[B, T] flat KV slot of each token (block_id * block_size + offset); tokens with
        t >= q_lens[b] point into the null block.
      lengths: int32[B] tokens with K/V after this step (q_start + q_lens); 0 for padding rows.

    With KV-cache groups (a grouped manager: `KVGroupLayout`), `block_tables` is int32[G, B, M]
    and `slots` int32[G, B, T]: every group's table and slots (`grouped`); the forward then maps
    each layer to its group's.
    """

    block_tables: jax.Array
    q_start: jax.Array
    q_lens: jax.Array
    slots: jax.Array
    lengths: jax.Array

    @property
    def grouped(self) -> bool:
        """Whether the batch holds one table per KV-cache group (`block_tables` [G, B, M])."""
        return self.block_tables.ndim == 3

    @property
    def positions(self) -> jax.Array:
        """int32[B, T] position of each token (meaningful where t < q_lens)."""
        t = self.slots.shape[-1]
        return self.q_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def compute_slots(block_tables: jax.Array, positions: jax.Array, valid: jax.Array, block_size: int) -> jax.Array:
    """slot = table[pos // bs] * bs + pos % bs where `valid`, else a slot in the null block.

    block_tables int32[B, M], positions int32[B, T], valid bool[B, T] -> int32[B, T]. Positions past
    the table (pos // bs >= M) are treated as invalid (null block) instead of wrapping.
    """
    m = block_tables.shape[1]
    logical = positions // block_size
    ok = valid & (logical < m) & (positions >= 0)
    block = jnp.take_along_axis(block_tables, jnp.clip(logical, 0, m - 1), axis=1)
    slots = block * block_size + positions % block_size
    return jnp.where(ok, slots, NULL_BLOCK * block_size + (positions % block_size)).astype(jnp.int32)


def make_paged_batch(block_tables: ArrayLike, q_start: ArrayLike, q_lens: ArrayLike, num_tokens: int,
                     block_size: int) -> PagedBatch:
    """Build the metadata for a step of `num_tokens` tokens per sequence (T; 1 for decode).
    `block_tables` int32[B, M], or int32[G, B, M] with KV-cache groups (slots then [G, B, T])."""
    block_tables = jnp.asarray(block_tables, jnp.int32)
    q_start = jnp.asarray(q_start, jnp.int32)
    q_lens = jnp.asarray(q_lens, jnp.int32)
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    positions = q_start[:, None] + t
    valid = t < q_lens[:, None]
    if block_tables.ndim == 3:
        slots = jax.vmap(lambda tables: compute_slots(tables, positions, valid, block_size))(block_tables)
    else:
        slots = compute_slots(block_tables, positions, valid, block_size)
    return PagedBatch(
        block_tables=block_tables, q_start=q_start, q_lens=q_lens, slots=slots,
        lengths=jnp.where(q_lens > 0, q_start + q_lens, 0).astype(jnp.int32))

