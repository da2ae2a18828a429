"""Reclaim: ending sequences. Their blocks are released (``refcount.release``: a reference
dropped each, blocks whose count reaches zero returned to the free queue).

A freed block keeps its contents: it joins the *back* of the free queue, so it is overwritten only
after every block freed before it, and until then a later request can reuse it. A sequence's
blocks are released tail first, so a sequence's root outlives its tail in the queue.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_kv import groups, inputs
from paged_kv.batch import by_width, check_rows, held_columns, tail_first
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.refcount import cache_slots, release
from paged_kv.state import BlockManagerState
from paged_kv.status import Status


def free(
    config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array, *, straight: bool = False
) -> tuple[BlockManagerState, jax.Array]:
    """Ends sequences: releases their blocks tail first and clears their rows.

    Args:
      seq_ids: int32 ``[B]`` sequences to free (< 0: padding).
      straight: static, see ``refcount.release``.

    Returns:
      The new state and status int32 ``[B]`` (BAD_SEQUENCE for a row that is not running).
    """
    seq_ids, _ = inputs.batch_ids("free", "seq_ids", seq_ids)
    if config.grouped:
        return groups.free(config, state, seq_ids)
    status, sid = check_rows(config, state, seq_ids, must_be_active=True)
    ok = status == Status.OK
    rows = state.block_tables[sid]
    held = jnp.where(ok, held_columns(config, state, sid), 0)
    slots = cache_slots(config, state)

    def drop(width, ref_count, queue):
        blocks, valid = tail_first(rows[:, :width], held, ok)
        return release(ref_count, queue, blocks, valid, slots, target=config.target, straight=straight)

    ref_count, queue = by_width(config, jnp.max(held), drop, state.ref_count, state.queue)
    s = config.max_seqs
    target = jnp.where(ok, sid, s)
    state = state.replace(
        ref_count=ref_count,
        queue=queue,
        block_tables=state.block_tables.at[target].set(NULL_BLOCK, mode="drop"),
        num_tokens=state.num_tokens.at[target].set(0, mode="drop"),
        active=state.active.at[target].set(False, mode="drop"),
        spans=state.spans.at[target].set(0, mode="drop"),
    )
    return state, status


def release_bound(config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array) -> jax.Array:
    """int32 scalar: an upper bound on the blocks that dropping the rows ``seq_ids`` (int32
    ``[B]``; out-of-range ids count nothing, repeated ones count again) can return to the free
    queue: the blocks those running rows hold."""
    ids = seq_ids.astype(jnp.int32)
    sid = jnp.clip(ids, 0, config.max_seqs - 1)
    named = (ids >= 0) & (ids < config.max_seqs) & state.active[sid]
    return jnp.sum(jnp.where(named, held_columns(config, state, sid), 0), dtype=jnp.int32)
