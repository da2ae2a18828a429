"""Read-only views of the state, for schedulers, statistics and tests.

Like every operation they take ``(config, state, ...)``. ``usage`` scans the pool
(O(num_blocks)): call it for reports, not inside every decode step.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from paged_kv.batch import blocks_held
from paged_kv.config import ManagerConfig
from paged_kv.state import BlockManagerState


@flax.struct.dataclass
class Usage:
    """Pool occupancy, int32 scalars.

    Attributes:
      used: blocks held by at least one table.
      free: blocks in the free queue (their contents may still be reusable).
      shared: blocks held by two or more tables.
      table_entries: block-table entries in use (with groups: non-null entries of every group's
        table); ``table_entries - used`` blocks are saved by sharing, compared with giving every
        sequence its own copy.
      running: running sequences.
    """

    used: jax.Array
    free: jax.Array
    shared: jax.Array
    table_entries: jax.Array
    running: jax.Array


def usage(config: ManagerConfig, state: BlockManagerState) -> Usage:
    held = blocks_held(config, state.num_tokens) + state.num_reserved
    if config.grouped:  # every group's table, less its null prefix
        held = jnp.sum(held[None, :] - state.null_prefix, axis=0)
    return Usage(
        used=jnp.sum(state.ref_count > 0, dtype=jnp.int32),
        free=state.queue.num_free,
        shared=jnp.sum(state.ref_count > 1, dtype=jnp.int32),
        table_entries=jnp.sum(jnp.where(state.active, held, 0), dtype=jnp.int32),
        running=jnp.sum(state.active, dtype=jnp.int32),
    )


def num_free_blocks(config: ManagerConfig, state: BlockManagerState) -> jax.Array:
    """int32 scalar, O(1): blocks a scheduler can still allocate."""
    return state.queue.num_free


def shared_blocks(config: ManagerConfig, state: BlockManagerState) -> jax.Array:
    """bool ``[num_blocks]``: blocks held by two or more tables."""
    return state.ref_count > 1


def slots_for(config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array,
              positions: jax.Array) -> jax.Array:
    """int32 ``[B, T]`` KV slots of token ``positions[b, t]`` of sequence ``seq_ids[b]``.

    For writing a prompt's K/V after ``admit``. Positions outside the sequence's held blocks
    (padding) map to the null block's first slot.
    """
    bs, m = config.block_size, config.max_blocks_per_seq
    sid = jnp.clip(seq_ids, 0, config.max_seqs - 1)
    held = blocks_held(config, state.num_tokens[sid])
    col = positions // bs
    valid = (seq_ids[:, None] >= 0) & (positions >= 0) & (col < held[:, None])
    block = jnp.take_along_axis(state.block_tables[sid], jnp.clip(col, 0, m - 1), axis=1)
    return jnp.where(valid, block * bs + positions % bs, 0).astype(jnp.int32)
