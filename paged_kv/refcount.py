"""Reference counts going down: one reference dropped per entry, and blocks whose count reaches
zero returned to the free queue.

A freed block keeps its contents: it joins the *back* of the free queue, so it is overwritten only
after every block freed before it, and until then a later request can reuse it. ``free`` (module
``reclaim``), ``fork`` / ``select`` (``share``) and the grouped forms (``groups``) all release
through ``release``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_kv import free_queue
from paged_kv.config import ManagerConfig
from paged_kv.state import BlockManagerState, FreeQueue


def release(
    ref_count: jax.Array,
    queue: FreeQueue,
    blocks: jax.Array,
    valid: jax.Array,
    cache_slot: jax.Array | None = None,
    *,
    target: str = "auto",
    straight: bool = False,
    runs: int = 1,
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
      runs: static; the entries are this many equal runs (a grouped manager's groups, in
        order), released as by one call per run: the back pushes in array order, the front ones
        run by run, each run's in front of the runs before it (so ``E`` must divide by ``runs``).
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
    front, front_ids = last & ~cached, None
    if runs > 1:  # the last run's front pushes first: its blocks end up nearest the front
        front, front_ids = (x.reshape(runs, e // runs)[::-1].reshape(e) for x in (front, blocks))
    if straight:
        return rc, free_queue.push_unchecked(queue, blocks, last & cached, front, front_ids)
    return rc, free_queue.push_back_then_front(queue, blocks, last & cached, front, front_ids=front_ids,
                                               target=target)


def cache_slots(config: ManagerConfig, state: BlockManagerState) -> jax.Array | None:
    """The ``cache_slot`` argument of ``release`` for this config."""
    return state.cache.slot if config.prefix_caching and config.uncached_to_front else None
