"""Test utilities for the block manager: hand-built states and state snapshots."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from paged_kv import BlockManagerState, ManagerConfig, init_state
from paged_kv.config import NULL_BLOCK
from paged_kv.invariants import free_queue_order


def state_from_tables(config: ManagerConfig, tables: dict[int, tuple[list[int], int]]) -> BlockManagerState:
    """A state where row ``s`` holds ``tables[s] = (blocks, num_tokens)``; every other block is
    free, in id order."""
    state = init_state(config)
    n, cap = config.num_blocks, config.queue_capacity
    ref = np.zeros(n, np.int32)
    rows = np.zeros((config.max_seqs, config.max_blocks_per_seq), np.int32)
    tokens = np.zeros(config.max_seqs, np.int32)
    active = np.zeros(config.max_seqs, bool)
    for s, (blocks, num) in tables.items():
        assert len(blocks) == config.blocks_for(num)
        rows[s, : len(blocks)] = blocks
        tokens[s], active[s] = num, True
        for b in blocks:
            ref[b] += 1
    free = [b for b in range(n) if b != NULL_BLOCK and ref[b] == 0]
    ring = np.zeros(cap, np.int32)
    ring[: len(free)] = free
    slot = np.full(n, -1, np.int32)
    slot[free] = np.arange(len(free))
    queue = state.queue.replace(
        ring=jnp.asarray(ring),
        slot=jnp.asarray(slot),
        head=jnp.int32(0),
        size=jnp.int32(len(free)),
        num_free=jnp.int32(len(free)),
    )
    return state.replace(
        ref_count=jnp.asarray(ref),
        block_tables=jnp.asarray(rows),
        num_tokens=jnp.asarray(tokens),
        active=jnp.asarray(active),
        queue=queue,
    )


def snapshot(config: ManagerConfig, state: BlockManagerState) -> dict:
    """Everything observable about a state, as plain Python, for comparing with the reference."""
    tokens = np.asarray(state.num_tokens)
    active = np.asarray(state.active)
    tables = np.asarray(state.block_tables)
    running = {
        int(s): (tables[s, : config.blocks_for(int(tokens[s]))].tolist(), int(tokens[s]))
        for s in np.flatnonzero(active)
    }
    spans = np.asarray(state.spans)
    out = {
        "running": running,
        # Spans: (uncommitted tokens, reserved blocks) per running row.
        "spans": {int(s): (int(spans[s, 0]), tables[s, config.blocks_for(int(tokens[s])):][: spans[s, 1]].tolist())
                  for s in np.flatnonzero(active)},
        "ref_count": np.asarray(state.ref_count).tolist(),
        "free_queue": free_queue_order(state),
    }
    if config.prefix_caching:
        st = state.cache.stats
        out["cached"] = set(np.flatnonzero(np.asarray(state.cache.slot) >= 0).tolist())
        out["stats"] = {k: int(getattr(st, k)) for k in ("lookups", "query_tokens", "hit_tokens", "evictions")}
    return out


def reference_snapshot(ref) -> dict:
    out = {
        "running": {s: (list(t), ref.num_tokens[s]) for s, t in ref.tables.items()},
        "spans": {s: ref.span_of(s) for s in ref.tables},
        "ref_count": list(ref.ref_count),
        "free_queue": ref.queue_order(),
    }
    if ref.config.prefix_caching:
        out["cached"] = ref.cached_blocks()
        out["stats"] = dict(ref.stats)
    return out
