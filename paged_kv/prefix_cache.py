"""Prefix-cache bookkeeping shared by the operations: caching full blocks, dropping them when
allocation reuses their memory, and clearing the cache.

Costs are O(blocks touched) (plus the hash table's amortised rebuild), except
``reset_prefix_cache``, which scans the pool and is meant for between experiments.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from paged_kv import block_hash, hash_table
from paged_kv.config import ManagerConfig
from paged_kv.scan import any_true, per_platform
from paged_kv.state import (
    CLASS,
    CLASS_GENERATION,
    GENERATION,
    KEY0,
    META_COLUMNS,
    PARENT_CLASS,
    PARENT_CLASS_GENERATION,
    SALT,
    SLOT,
    UNLINKED,
    BlockManagerState,
    PrefixCache,
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


def evict(cache: PrefixCache, taken: jax.Array, mask: jax.Array, *, target: str = "auto") -> PrefixCache:
    """Blocks just taken from the free queue are about to get new contents: each one's
    generation moves on (so a cached child that named it as parent no longer links to it, even if
    it was never cached itself), and cached ones lose their hashes. ``target``
    (``ManagerConfig.target``): the CPU form leaves out the hash-dropping scatters, behind a
    ``cond``, when no taken block is cached; the GPU form runs them masked (the same result)."""
    n = cache.meta.shape[0]
    cache = cache.replace(
        meta=cache.meta.at[jnp.where(mask, taken, n), GENERATION].add(1, mode="drop")
    )

    def drop(cache):
        cache, dropped = uncache(cache, taken, mask, bump=False)
        return cache.replace(stats=add_stats(cache.stats, evictions=dropped))

    def skipping(cache):
        # Skipped (one gather) when no taken block is cached, the usual case while the pool has
        # room.
        return lax.cond(any_true(mask & (cache.meta[taken, SLOT] >= 0)), drop, lambda cache: cache, cache)

    # On a GPU the skip's predicate would be a host sync (``admit``'s, per call), the masked
    # scatters over the taken blocks cost less.
    return per_platform(target, cache, cpu=skipping, default=drop)


def class_of(cache: PrefixCache, blocks: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """int32 ``[..., 2]``: the class of each block of ``blocks`` (int32 ``[...]``) that is cached,
    ``(UNLINKED, 0)`` for the others: the parent class a block cached after them records.

    ``rows``: ``cache.meta[blocks]``, if the caller gathered it already."""
    rows = cache.meta[blocks] if rows is None else rows
    cached = (rows[..., SLOT] >= 0)[..., None]
    return jnp.where(cached, rows[..., CLASS:CLASS_GENERATION + 1], jnp.array([UNLINKED, 0], jnp.int32))


def own_class(cache: PrefixCache, blocks: jax.Array) -> jax.Array:
    """int32 ``[..., 2]``: ``(block, generation)``, the class a block founds when it is cached and
    no older cached block holds the same prefix."""
    return jnp.stack([blocks, cache.meta[blocks, GENERATION]], axis=-1)


def register(
    cache: PrefixCache,
    blocks: jax.Array,
    chains: jax.Array,
    salts: jax.Array,
    parent_class: jax.Array,
    mask: jax.Array,
    count: jax.Array | None = None,
    may_join: jax.Array | None = None,
    distinct_keys: bool = False,
    straight: bool = False,
) -> PrefixCache:
    """Caches full blocks under the key of their chain state, duplicates included.

    Each block joins the class of the oldest cached block with its key (one cached before this
    call, or an earlier entry of this call) if that block's tokens, salt and parent class are its
    own; otherwise it founds its own class.

    Args:
      blocks: int32 ``[K]`` distinct blocks that just became full (tokens already stored).
      chains: uint32 ``[K, 2]`` their chain states.
      salts: uint32 ``[K]``.
      parent_class: int32 ``[K, 2]`` the class of the block before each (``class_of`` it, or
        ``own_class`` for one cached in this same call), ``(NO_PARENT, 0)`` for a first block.
      mask: bool ``[K]``.
      count: int32 scalar ``sum(mask)``, if the caller knows it (saves a reduction).
      may_join: int32 ``[J]`` indices of the entries that can join an existing class (default:
        all). A caller passes fewer when it knows the others cannot: admission knows that a
        block after a cache miss has no equal older block, so only a prompt's last block (always
        computed, even when cached elsewhere) is checked.
      distinct_keys: the caller knows no two entries share a key (one request's blocks), so no
        entry can follow a twin of this call (static; skips looking for them).
      straight: static; the caller knows that the table needs no rebuild (``needs_rebuild``) and
        that no entry probes past the window (``hash_table.claims_past_window``): then the
        insertion is straight-line code, with no ``cond`` or loop (nothing is skipped either
        when ``count`` is 0: every scatter is masked), for a GPU.
    """
    count = jnp.sum(mask, dtype=jnp.int32) if count is None else count
    if may_join is None:
        may_join = jnp.arange(blocks.shape[0], dtype=jnp.int32)
    if straight:
        return _register(cache, blocks, chains, salts, parent_class, mask, count, may_join,
                         find_twins=not distinct_keys, straight=True)
    return lax.cond(
        count > 0, functools.partial(_register, find_twins=not distinct_keys), lambda cache, *_: cache,
        cache, blocks, chains, salts, parent_class, mask, count, may_join,
    )


def _bits(x: jax.Array) -> jax.Array:
    """uint32 values as the int32 with the same bits (how ``meta`` stores keys and salts)."""
    return lax.bitcast_convert_type(x.astype(jnp.uint32), jnp.int32)


def _rebuild_table(cache: PrefixCache) -> PrefixCache:
    size = cache.table.entries.shape[0]
    table, slots = hash_table.rebuild(size, cache.key, cache.slot >= 0, cache.slot)
    return cache.replace(table=table, meta=cache.meta.at[:, SLOT].set(slots))


def _register(cache, blocks, chains, salts, parent_class, mask, count, may_join, *, find_twins=True,
              straight=False):
    n = cache.meta.shape[0]
    keys = block_hash.key_of(chains)
    if not straight:
        # The rebuild lives here, inside ``register``'s ``cond``, so that the common branch
        # passes ``meta`` through untouched (a column written back would cost O(pool) per call).
        crowded = hash_table.needs_rebuild(cache.table, count)
        cache = lax.cond(crowded, _rebuild_table, lambda cache: cache, cache)
    meta, tokens = cache.meta, cache.tokens
    # The insertion, which also finds, for each entry, the oldest block cached under its key
    # before this call and its first twin (an earlier entry of this call with the same key).
    jb = blocks[may_join]
    table, slots, twin, older = hash_table.claim(cache.table, keys, blocks, mask, find_twins=find_twins,
                                                 straight=straight)
    older = older[may_join]
    k = blocks.shape[0]
    facts = meta[jnp.concatenate([blocks, jnp.maximum(older, 0)])]  # one gather from meta
    generation, theirs = facts[:k, GENERATION], facts[k:]
    own = jnp.stack([blocks, generation], axis=1)

    # A block joins the class of the oldest equal block: one cached before (its facts in
    # ``meta``), else its first twin of this call (its facts in this call's arrays; its class is
    # its own, as nothing older holds its key). Every fact is gathered before the one scatter into
    # ``meta`` below: reading ``meta`` after writing it and then writing it again made XLA copy
    # the whole array on every call.
    tw = jnp.maximum(twin[may_join], 0)
    pc = parent_class[may_join]
    # One gather for every block's tokens compared here (each gather from a pool-sized array is a
    # kernel XLA:CPU splits across threads).
    cmp = tokens[jnp.concatenate([jb, jnp.maximum(older, 0)] + ([blocks[tw]] if find_twins else []))]
    j = jb.shape[0]
    mine_tokens = cmp[:j]
    join_old = (
        mask[may_join] & (older >= 0)
        & (theirs[:, SALT] == _bits(salts[may_join]))
        & jnp.all(theirs[:, PARENT_CLASS:PARENT_CLASS_GENERATION + 1] == pc, axis=1)
        & jnp.all(cmp[j:2 * j] == mine_tokens, axis=1)
    )
    joined = jnp.where(join_old[:, None], theirs[:, CLASS:CLASS_GENERATION + 1], own[may_join])
    if find_twins:
        join_twin = (
            mask[may_join] & ~join_old & (twin[may_join] >= 0)
            & (salts[tw] == salts[may_join])
            & jnp.all(parent_class[tw] == pc, axis=1)
            & jnp.all(cmp[2 * j:] == mine_tokens, axis=1)
        )
        joined = jnp.where(join_twin[:, None], own[tw], joined)
    klass = own.at[may_join].set(joined)

    # Whole new rows in one row scatter (a [row, column] scatter became one scatter per element
    # on XLA:CPU); a block keeps its generation.
    rows = jnp.concatenate(
        [_bits(keys), slots[:, None], _bits(salts)[:, None], klass, parent_class, generation[:, None]],
        axis=1,
    )
    assert rows.shape[1] == META_COLUMNS and (KEY0, CLASS, PARENT_CLASS, GENERATION) == (0, 4, 6, 8)
    meta = meta.at[jnp.where(mask, blocks, n)].set(rows, mode="drop")
    return cache.replace(table=table, meta=meta)


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
