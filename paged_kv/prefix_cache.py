"""Prefix-cache bookkeeping shared by the operations: caching full blocks, dropping them when
allocation reuses their memory, and clearing the cache.

Costs are O(blocks touched) (plus the hash table's amortised rebuild), except
``reset_prefix_cache``, which scans the pool and is meant for between experiments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from paged_kv import block_hash, hash_table
from paged_kv.config import ManagerConfig
from paged_kv.scan import any_true
from paged_kv.state import (
    GENERATION, KEY0, META_COLUMNS, PARENT_GENERATION, SLOT, BlockManagerState, PrefixCache,
    add_stats,
)


def uncache(
    cache: PrefixCache, blocks: jax.Array, mask: jax.Array, *, bump: bool = True
) -> tuple[PrefixCache, jax.Array]:
    """Drops the hashes of ``blocks[mask]`` (distinct) that are cached; returns the cache and how
    many were dropped. With ``bump``, their generation moves on, which unlinks children cached
    under them."""
    n = cache.meta.shape[0]
    row = cache.meta[blocks]
    slots = row[:, SLOT]
    drop = mask & (slots >= 0)
    target = jnp.where(drop, blocks, n)
    # One scatter of whole rows: slot -1 and, with ``bump``, the next generation.
    row = row.at[:, SLOT].set(-1)
    if bump:
        row = row.at[:, GENERATION].add(1)
    cache = cache.replace(
        table=hash_table.remove(cache.table, slots, drop),
        meta=cache.meta.at[target].set(row, mode="drop"),
    )
    return cache, jnp.sum(drop, dtype=jnp.int32)


def evict(cache: PrefixCache, taken: jax.Array, mask: jax.Array) -> PrefixCache:
    """Blocks just taken from the free queue are about to get new contents: each one's
    generation moves on (so a cached child that named it as parent no longer links to it, even if
    it was never cached itself), and cached ones lose their hashes."""
    n = cache.meta.shape[0]
    cache = cache.replace(
        meta=cache.meta.at[jnp.where(mask, taken, n), GENERATION].add(1, mode="drop")
    )

    def drop(cache):
        cache, dropped = uncache(cache, taken, mask, bump=False)
        return cache.replace(stats=add_stats(cache.stats, evictions=dropped))

    # Skipped (one gather) when no taken block is cached, the usual case while the pool has room.
    return lax.cond(any_true(mask & (cache.meta[taken, SLOT] >= 0)), drop, lambda cache: cache, cache)


def register(
    cache: PrefixCache,
    blocks: jax.Array,
    chains: jax.Array,
    salts: jax.Array,
    parents: jax.Array,
    mask: jax.Array,
    count: jax.Array | None = None,
) -> PrefixCache:
    """Caches full blocks under the key of their chain state, unless the key is cached already.

    Args:
      blocks: int32 ``[K]`` distinct blocks that just became full (tokens already stored).
      chains: uint32 ``[K, 2]`` their chain states.
      salts: uint32 ``[K]``.
      parents: int32 ``[K]`` the block before each in its table, -1 for a first block.
      mask: bool ``[K]``.
      count: int32 scalar ``sum(mask)``, if the caller knows it (saves a reduction).
    """
    count = jnp.sum(mask, dtype=jnp.int32) if count is None else count
    return lax.cond(
        count > 0, _register, lambda cache, *_: cache, cache, blocks, chains, salts, parents, mask, count
    )


def _bits(x: jax.Array) -> jax.Array:
    """uint32 values as the int32 with the same bits (how ``meta`` stores keys and salts)."""
    return lax.bitcast_convert_type(x.astype(jnp.uint32), jnp.int32)


def _rebuild_table(cache: PrefixCache) -> PrefixCache:
    size = cache.table.entries.shape[0]
    table, slots = hash_table.rebuild(size, cache.key, cache.slot >= 0)
    return cache.replace(table=table, meta=cache.meta.at[:, SLOT].set(slots))


def _register(cache, blocks, chains, salts, parents, mask, count):
    n = cache.meta.shape[0]
    keys = block_hash.key_of(chains)
    # The rebuild lives here rather than in ``hash_table.insert`` so that the common branch
    # passes ``meta`` through untouched (a column written back would cost O(pool) per call).
    crowded = hash_table.needs_rebuild(cache.table, count)
    cache = lax.cond(crowded, _rebuild_table, lambda cache: cache, cache)
    table, slots = hash_table.claim(cache.table, keys, blocks, mask)
    added = slots >= 0
    target = jnp.where(added, blocks, n)
    parent_gen = jnp.where(parents >= 0, cache.meta[jnp.maximum(parents, 0), GENERATION], 0)
    # Whole new rows in one row scatter (a [row, column] scatter became one scatter per element
    # on XLA:CPU); a block keeps its generation.
    rows = jnp.concatenate(
        [_bits(keys), slots[:, None], _bits(salts)[:, None], parents[:, None], parent_gen[:, None],
         cache.meta[blocks, GENERATION][:, None]],
        axis=1,
    )
    assert rows.shape[1] == META_COLUMNS and (KEY0, PARENT_GENERATION, GENERATION) == (0, 5, 6)
    return cache.replace(table=table, meta=cache.meta.at[target].set(rows, mode="drop"))


def reset_prefix_cache(
    config: ManagerConfig, state: BlockManagerState
) -> tuple[BlockManagerState, jax.Array]:
    """Drops the hash of every cached block that no request holds; returns the new state and how
    many hashes were dropped (int32). Blocks held by running requests stay cached. O(pool)."""
    if not config.prefix_caching:
        return state, jnp.int32(0)
    blocks = jnp.arange(config.num_blocks, dtype=jnp.int32)
    cache, dropped = uncache(state.cache, blocks, state.ref_count == 0)
    return state.replace(cache=cache), dropped


def is_cached(config: ManagerConfig, state: BlockManagerState) -> jax.Array:
    """bool ``[num_blocks]``: blocks whose hash the cache holds (all False when caching is off)."""
    if not config.prefix_caching:
        return jnp.zeros((config.num_blocks,), bool)
    return state.cache.slot >= 0
