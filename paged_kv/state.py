"""Block-manager state: an immutable pytree of fixed-shape int32/bool arrays.

Every operation takes a ``BlockManagerState`` and returns a new one; nothing is mutated in place
(under ``jit`` with the state donated, XLA reuses the buffers). Shapes depend only on the static
``ManagerConfig``, so a decode loop never retraces as sequences come and go.
"""

from __future__ import annotations


import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.hash_table import HashTable, empty_table
from paged_kv.packed import with_packed_scalars


@flax.struct.dataclass
class FreeQueue:
    """Free blocks in least-recently-freed order: a ring buffer (deque) with lazy deletion.

    Allocation takes from the front, reclaim appends to the back. A block can leave the middle of
    the queue (a prefix-cache hit on a free block) without moving anything: its ``slot`` is set to
    -1, which turns its ring entry stale; taking from the front skips stale entries. So every
    operation costs O(blocks moved), never O(pool).

    Attributes:
      ring: int32 ``[queue_capacity]``; entries ``head .. head + size - 1`` (mod capacity) are in
        use, live or stale.
      slot: int32 ``[num_blocks]``; the ring index of a free block's live entry, -1 for a block
        that is not free. An entry ``ring[i] = b`` is live iff ``slot[b] == i``.
      counts: int32 ``[3]``, read as the properties ``head`` (ring index of the front entry),
        ``size`` (entries in use, live and stale) and ``num_free`` (live entries = free blocks);
        ``replace`` takes them as keywords.
    """

    ring: jax.Array
    slot: jax.Array
    counts: jax.Array


with_packed_scalars(FreeQueue, "counts", ("head", "size", "num_free"))


@flax.struct.dataclass
class CacheStats:
    """Prefix-cache counters since the state was created (they wrap after 2**31).

    Attributes:
      counts: int32 ``[4]``, read as the properties
        - ``lookups``: admitted requests (each walks its prompt's chain once);
        - ``query_tokens``: prompt tokens of those requests;
        - ``hit_tokens``: prompt tokens whose K/V came from a cached block or from a block another
          request of the same call computes (``admit`` reports the two apart per request);
        - ``evictions``: cached blocks whose hash was dropped because allocation took them from
          the queue.
    """

    counts: jax.Array


STAT_NAMES = ("lookups", "query_tokens", "hit_tokens", "evictions")
with_packed_scalars(CacheStats, "counts", STAT_NAMES)


def add_stats(stats: CacheStats, **increments) -> CacheStats:
    """``stats`` with int32 scalar ``increments`` added to the named counters (one vector add)."""
    delta = jnp.stack([jnp.asarray(increments.pop(k, 0), jnp.int32) for k in STAT_NAMES])
    if increments:
        raise TypeError(f"unknown counters {sorted(increments)}; known: {STAT_NAMES}")
    return stats.replace(counts=stats.counts + delta)


# Columns of ``PrefixCache.meta``: one row per block, so the per-block facts a hit is checked
# against come back in one gather, and a newly cached block is written with one scatter.
KEY0, KEY1, SLOT, SALT, PARENT, PARENT_GENERATION, GENERATION = range(7)
META_COLUMNS = 7


def _as_u32(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


@flax.struct.dataclass
class PrefixCache:
    """What the prefix cache knows about each block (``[1, ...]`` placeholders when it is off).

    A block is *cached* when the hash table holds its key. A hit is trusted only after checking
    the block's stored tokens and salt, and that it was cached as the child of the block that
    matched just before it (same id, same generation): a hash collision can never hand a request
    K/V computed for other tokens.

    Attributes:
      tokens: int32 ``[num_blocks, block_size]``, the tokens whose K/V each block holds.
      meta: int32 ``[num_blocks, META_COLUMNS]``, per block (uint32 values stored bit for bit),
        read through the properties:
        - ``key`` (uint32 ``[num_blocks, 2]``): a cached block's key (what a rebuild re-inserts);
        - ``slot``: a cached block's hash-table slot; -1 when not cached;
        - ``salt`` (uint32): the salt of the request that cached the block;
        - ``parent``: the block before it in its chain; -1 for a first block;
        - ``parent_generation``: ``generation[parent]`` when it was cached;
        - ``generation``: bumped whenever a block stops being cached, so that children cached
          under its old contents no longer link to it.
      table: the hash table from keys to block ids.
      stats: counters.
    """

    tokens: jax.Array
    meta: jax.Array
    table: HashTable
    stats: CacheStats

    @property
    def key(self) -> jax.Array:
        return _as_u32(self.meta[:, KEY0:KEY1 + 1])

    @property
    def slot(self) -> jax.Array:
        return self.meta[:, SLOT]

    @property
    def salt(self) -> jax.Array:
        return _as_u32(self.meta[:, SALT])

    @property
    def parent(self) -> jax.Array:
        return self.meta[:, PARENT]

    @property
    def parent_generation(self) -> jax.Array:
        return self.meta[:, PARENT_GENERATION]

    @property
    def generation(self) -> jax.Array:
        return self.meta[:, GENERATION]


@flax.struct.dataclass
class BlockManagerState:
    """Everything the block manager knows, as device arrays.

    Attributes:
      ref_count: int32 ``[num_blocks]``; how many block-table entries hold each block (0 for the
        null block, which is never counted).
      block_tables: int32 ``[max_seqs, max_blocks_per_seq]``; physical block ids, ``NULL_BLOCK``
        where unused. Row ``s`` holds exactly ``ceil(num_tokens[s] / block_size)`` blocks.
      num_tokens: int32 ``[max_seqs]``; tokens of each sequence that have a KV slot.
      active: bool ``[max_seqs]``; which rows hold a running sequence.
      queue: the free queue.
      seq_chain: uint32 ``[max_seqs, 2]``; each sequence's hash-chain state after its last full
        block (the parent of the next block to fill).
      seq_salt: uint32 ``[max_seqs]``; each sequence's cache salt.
      cache: the prefix cache.
    """

    ref_count: jax.Array
    block_tables: jax.Array
    num_tokens: jax.Array
    active: jax.Array
    queue: FreeQueue
    seq_chain: jax.Array
    seq_salt: jax.Array
    cache: PrefixCache


def init_cache(config: ManagerConfig) -> PrefixCache:
    n = config.num_blocks if config.prefix_caching else 1
    size = config.hash_table_size if config.prefix_caching else 1
    meta = jnp.zeros((n, META_COLUMNS), jnp.int32).at[:, jnp.array([SLOT, PARENT])].set(-1)
    return PrefixCache(
        tokens=jnp.zeros((n, config.block_size), jnp.int32),
        meta=meta,
        table=empty_table(size),
        stats=CacheStats(counts=jnp.zeros((len(STAT_NAMES),), jnp.int32)),
    )


def init_state(config: ManagerConfig) -> BlockManagerState:
    """A pool with every block free, in id order (block 1 at the front), and no sequences."""
    n, cap = config.num_blocks, config.queue_capacity
    ids = jnp.arange(n, dtype=jnp.int32)
    ring = jnp.zeros((cap,), jnp.int32).at[: n - 1].set(ids[1:])
    slot = jnp.where(ids == NULL_BLOCK, -1, ids - 1).astype(jnp.int32)
    queue = FreeQueue(ring=ring, slot=slot, counts=jnp.array([0, n - 1, n - 1], jnp.int32))
    return BlockManagerState(
        ref_count=jnp.zeros((n,), jnp.int32),
        block_tables=jnp.full((config.max_seqs, config.max_blocks_per_seq), NULL_BLOCK, jnp.int32),
        num_tokens=jnp.zeros((config.max_seqs,), jnp.int32),
        active=jnp.zeros((config.max_seqs,), bool),
        queue=queue,
        seq_chain=jnp.zeros((config.max_seqs, 2), jnp.uint32),
        seq_salt=jnp.zeros((config.max_seqs,), jnp.uint32),
        cache=init_cache(config),
    )
