"""Reclaim: dropping references and returning blocks whose count reaches zero to the free queue.

A freed block keeps its contents: it joins the *back* of the free queue, so it is overwritten only
after every block freed before it, and until then a later request can reuse it. A sequence's
blocks are released tail first, so a sequence's root outlives its tail in the queue.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_kv import free_queue, inputs
from paged_kv.batch import blocks_held, by_width, check_rows, tail_first
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.state import BlockManagerState, FreeQueue
from paged_kv.status import Status


def release(
    ref_count: jax.Array,
    queue: FreeQueue,
    blocks: jax.Array,
    valid: jax.Array,
    cache_slot: jax.Array | None = None,
    *,
    target: str = "auto",
    straight: bool = False,
) -> tuple[jax.Array, FreeQueue]:
    """Drops one reference per valid entry; blocks reaching zero join the free queue.

    Entries are processed as if one at a time in array order: a block held by several entries
    reaches zero at its last one. Blocks go to the back of the queue in that order, except, with
    prefix caching and ``uncached_to_front``, blocks that are not cached (a partly full last
    block): nothing can ever hit them, so they go to the front, to be reused before any cached
    block. Cost O(E).

    Args:
      ref_count: int32 ``[num_blocks]``.
      queue: the free queue.
      blocks: int32 ``[E]`` block ids, in release order.
      valid: bool ``[E]``.
      cache_slot: int32 ``[num_blocks]`` hash-table slot per block (-1: not cached), or None
        when prefix caching is off (everything goes to the back).
      target: ``ManagerConfig.target``.
      straight: static; the caller knows the ring has room for every block released (no
        compaction can be due), so the pushes skip their room check (the GPU form of
        ``fused.free_then_select``).
    """
    n = ref_count.shape[0]
    e = blocks.shape[0]
    stamp = jnp.arange(1, e + 1, dtype=jnp.int32)
    rc = ref_count.at[jnp.where(valid, blocks, n)].add(-1, mode="drop")
    zero = valid & (rc[blocks] == 0)
    # Find each zeroed block's last entry without an O(pool) scratch array: the zeroed counts are
    # 0, so a scatter-max of 1-based stamps marks the last entry, and a scatter back restores 0.
    zero_idx = jnp.where(zero, blocks, n)
    marked = rc.at[zero_idx].max(stamp, mode="drop")
    last = zero & (marked[blocks] == stamp)
    rc = marked.at[zero_idx].set(0, mode="drop")
    if cache_slot is None:
        if straight:
            return rc, free_queue.push_unchecked(queue, blocks, last, None)
        return rc, free_queue.push_back(queue, blocks, last)
    cached = cache_slot[blocks] >= 0
    if straight:
        return rc, free_queue.push_unchecked(queue, blocks, last & cached, last & ~cached)
    return rc, free_queue.push_back_then_front(queue, blocks, last & cached, last & ~cached, target=target)


def cache_slots(config: ManagerConfig, state: BlockManagerState) -> jax.Array | None:
    """The ``cache_slot`` argument of ``release`` for this config."""
    return state.cache.slot if config.prefix_caching and config.uncached_to_front else None


def free(
    config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array, *, straight: bool = False
) -> tuple[BlockManagerState, jax.Array]:
    """Ends sequences: releases their blocks tail first and clears their rows.

    Args:
      seq_ids: int32 ``[B]`` sequences to free (< 0: padding).
      straight: static, see ``release``.

    Returns:
      The new state and status int32 ``[B]`` (BAD_SEQUENCE for a row that is not running).
    """
    seq_ids, _ = inputs.batch_ids("free", "seq_ids", seq_ids)
    if config.grouped:
        from paged_kv import groups
        return groups.free(config, state, seq_ids)
    status, sid = check_rows(config, state, seq_ids, must_be_active=True)
    ok = status == Status.OK
    rows = state.block_tables[sid]
    held = jnp.where(ok, blocks_held(config, state.num_tokens[sid]), 0)
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
    )
    return state, status


def release_bound(config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array) -> jax.Array:
    """int32 scalar: an upper bound on the blocks that dropping the rows ``seq_ids`` (int32
    ``[B]``; out-of-range ids count nothing, repeated ones count again) can return to the free
    queue: the blocks those running rows hold."""
    ids = seq_ids.astype(jnp.int32)
    sid = jnp.clip(ids, 0, config.max_seqs - 1)
    named = (ids >= 0) & (ids < config.max_seqs) & state.active[sid]
    return jnp.sum(jnp.where(named, blocks_held(config, state.num_tokens[sid]), 0), dtype=jnp.int32)
