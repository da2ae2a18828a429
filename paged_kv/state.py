"""Block-manager state: an immutable pytree of fixed-shape int32/bool arrays.

Every operation takes a ``BlockManagerState`` and returns a new one; nothing is mutated in place
(under ``jit`` with the state donated, XLA reuses the buffers). Shapes depend only on the static
``ManagerConfig``, so a decode loop never retraces as sequences come and go.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.hash_table import EMPTY as HASH_EMPTY, VAL as HASH_VAL, HashTable
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

    def as_dict(self) -> dict[str, int | float | None]:
        """The counters as Python ints, and ``hit_rate`` (hit / query tokens; None before any
        query). Reads the device (not under ``jit``)."""
        out = dict(zip(STAT_NAMES, (int(v) for v in np.asarray(self.counts))))
        out["hit_rate"] = out["hit_tokens"] / out["query_tokens"] if out["query_tokens"] else None
        return out

    def __repr__(self) -> str:
        try:
            if np.shape(self.counts) != (len(STAT_NAMES),):
                raise ValueError("a batch of counters")
            d = self.as_dict()
        except Exception:  # under jit (a tracer), or a batch of them: the plain form
            return f"CacheStats(counts={self.counts!r})"
        rate = "–" if d["hit_rate"] is None else f"{100 * d['hit_rate']:.1f} %"
        return (f"CacheStats(lookups={d['lookups']}, query_tokens={d['query_tokens']}, "
                f"hit_tokens={d['hit_tokens']} (hit rate {rate}), evictions={d['evictions']})")

    __str__ = __repr__


STAT_NAMES = ("lookups", "query_tokens", "hit_tokens", "evictions")
with_packed_scalars(CacheStats, "counts", STAT_NAMES)


def add_stats(stats: CacheStats, **increments: ArrayLike) -> CacheStats:
    """``stats`` with int32 scalar ``increments`` added to the named counters (one vector add)."""
    delta = jnp.stack([jnp.asarray(increments.pop(k, 0), jnp.int32) for k in STAT_NAMES])
    if increments:
        raise TypeError(f"unknown counters {sorted(increments)}; known: {STAT_NAMES}")
    return stats.replace(counts=stats.counts + delta)


# Columns of ``PrefixCache.meta``: one row per block, so the per-block facts a hit is checked
# against come back in one gather, and a newly cached block is written with one scatter.
KEY0, KEY1, SLOT, SALT, CLASS, CLASS_GENERATION, PARENT_CLASS, PARENT_CLASS_GENERATION, GENERATION = range(9)
META_COLUMNS = 9
NO_PARENT = -1
"""``PARENT_CLASS`` of a first block."""
UNLINKED = -2
"""``PARENT_CLASS`` of a block whose parent was not cached when it was: no block has that class,
so nothing can hit it as a child (a safe default that a correct caller never needs)."""


UNCOMMITTED, RESERVED = 0, 1
"""Columns of ``BlockManagerState.spans``."""


def _as_u32(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


@flax.struct.dataclass
class PrefixCache:
    """What the prefix cache knows about each block (``[1, ...]`` placeholders when it is off).

    A block is *cached* when the hash table holds its key; every full block in a block table is
    cached, duplicates too (several blocks with equal contents share a key, and a lookup returns
    the oldest, as vLLM's ``BlockPool`` does).

    A hit is never trusted on the key alone. Every cached block carries a *class*: a label shared
    by the cached blocks that hold the same whole prefix (salt and every token up to the block's
    end), and it records the class of the block before it (its *parent class*). A new block joins
    the class of the oldest cached block with its key only after checking that block's tokens,
    salt and parent class; otherwise it founds a class of its own, labelled ``(its id, its
    generation)``, a pair never used before. A lookup trusts a hit at position ``j`` only if the
    block's tokens and salt equal the request's and its parent class is the class of the hit at
    ``j - 1``. So a hash collision can never hand a request K/V computed for other tokens, and a
    duplicate never hides a prefix: a child links to its parent's *contents*, not to one
    physical copy of them. (While a cached block is live, some block of its parent class is too:
    a holder of the child holds one, and freeing tail first queues the child ahead of it.)

    Attributes:
      tokens: int32 ``[num_blocks, block_size]``, the tokens whose K/V each block holds.
      meta: int32 ``[num_blocks, META_COLUMNS]``, per block (uint32 values stored bit for bit),
        read through the properties:
        - ``key`` (uint32 ``[num_blocks, 2]``): a cached block's key (what a rebuild re-inserts);
        - ``slot``: a cached block's hash-table slot; -1 when not cached;
        - ``salt`` (uint32): the salt of the request that cached the block;
        - ``klass`` (int32 ``[num_blocks, 2]``): a cached block's class label ``(block, generation)``;
        - ``parent_class`` (int32 ``[num_blocks, 2]``): the class of the block before it when it
          was cached; ``(NO_PARENT, 0)`` for a first block;
        - ``generation``: bumped whenever a block gets new contents or stops being cached, so that
          a class label, once its founder is reused, is never handed out again.
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
    def klass(self) -> jax.Array:
        return self.meta[:, CLASS:CLASS_GENERATION + 1]

    @property
    def parent_class(self) -> jax.Array:
        return self.meta[:, PARENT_CLASS:PARENT_CLASS_GENERATION + 1]

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
        where unused. Row ``s`` holds exactly ``ceil(num_tokens[s] / block_size) + num_reserved[s]``
        blocks.
      num_tokens: int32 ``[max_seqs]``; tokens of each sequence that have a KV slot.
      active: bool ``[max_seqs]``; which rows hold a running sequence.
      queue: the free queue.
      seq_chain: uint32 ``[max_seqs, 2]``; each sequence's hash-chain state after its last full
        block (the parent of the next block to fill).
      seq_salt: uint32 ``[max_seqs]``; each sequence's cache salt.
      cache: the prefix cache.
      group_tables: with ``config.grouped``, int32 ``[G - 1, max_seqs, max_blocks_per_seq]``,
        the tables of groups ``1 .. G - 1`` (``block_tables`` is group 0's); None otherwise, so
        the default configuration's programs are the same as before groups existed.
      null_prefix: with ``config.grouped``, int32 ``[G, max_seqs]``: per group and sequence, the
        first table column that holds a block. Columns before it are ``NULL_BLOCK``: a window
        group's blocks reclaimed as they left the window (always 0 for a full group). None
        otherwise.
      block_group: with ``config.grouped``, int32 ``[num_blocks]``: the group whose K/V a block
        holds (set when it is taken from the queue, kept while it is free), so a prefix hit is
        checked to be of the group that asks. None otherwise.
      spans: int32 ``[max_seqs, 2]``, per row (``paged_kv.spans``): column ``UNCOMMITTED``, how
        many of its last tokens are not committed yet (drafts: they hold slots and K/V but no
        block holding one is ever cached); column ``RESERVED``, how many blocks the row holds
        past ``ceil(num_tokens / block_size)`` in every group (room kept by
        ``truncate(keep_reserved=True)`` for the next span), at table columns ``ceil(num_tokens
        / block_size) ..`` (exclusively held unless a ``fork`` shared them). Both 0 for a row
        that only ``admit`` and ``append`` touched, and for every row that is not running.
    """

    ref_count: jax.Array
    block_tables: jax.Array
    num_tokens: jax.Array
    active: jax.Array
    queue: FreeQueue
    seq_chain: jax.Array
    seq_salt: jax.Array
    cache: PrefixCache
    group_tables: jax.Array | None = None
    null_prefix: jax.Array | None = None
    block_group: jax.Array | None = None
    spans: jax.Array | None = None

    @property
    def num_uncommitted(self) -> jax.Array:
        """int32 ``[max_seqs]``: tokens per row that hold a slot but are not committed."""
        return self.spans[:, UNCOMMITTED]

    @property
    def num_committed(self) -> jax.Array:
        """int32 ``[max_seqs]``: committed tokens per row (a prefix of its ``num_tokens``)."""
        return self.num_tokens - self.spans[:, UNCOMMITTED]

    @property
    def num_reserved(self) -> jax.Array:
        """int32 ``[max_seqs]``: blocks per row (in each group) held past its tokens' blocks."""
        return self.spans[:, RESERVED]

    @property
    def tables(self) -> jax.Array:
        """int32 ``[G, max_seqs, max_blocks_per_seq]``: every group's block tables (``[1, ...]``,
        ``block_tables`` itself, without groups)."""
        if self.group_tables is None:
            return self.block_tables[None]
        return jnp.concatenate([self.block_tables[None], self.group_tables], axis=0)

    def with_tables(self, tables: jax.Array) -> BlockManagerState:
        """The state with every group's tables replaced by ``tables`` (int32 ``[G, S, M]``)."""
        if self.group_tables is None:
            return self.replace(block_tables=tables[0])
        return self.replace(block_tables=tables[0], group_tables=tables[1:])


def init_cache(config: ManagerConfig) -> PrefixCache:
    """An empty prefix cache (built on the host, see ``init_state``)."""
    n = config.num_blocks if config.prefix_caching else 1
    size = config.hash_table_size if config.prefix_caching else 1
    meta = np.zeros((n, META_COLUMNS), np.int32)
    meta[:, SLOT] = -1
    meta[:, [CLASS, PARENT_CLASS]] = UNLINKED
    entries = np.zeros((size, 3), np.int32)
    entries[:, HASH_VAL] = HASH_EMPTY
    cache = PrefixCache(
        tokens=np.zeros((n, config.block_size), np.int32),
        meta=meta,
        table=HashTable(entries=entries, counts=np.zeros((2,), np.int32)),
        stats=CacheStats(counts=np.zeros((len(STAT_NAMES),), np.int32)),
    )
    return jax.tree.map(jnp.asarray, cache)


def init_state(config: ManagerConfig) -> BlockManagerState:
    """A pool with every block free, in id order (block 1 at the front), and no sequences.

    Built with numpy and moved to the device in one transfer per array: as eager ``jnp`` ops it
    would be about twenty tiny programs, each compiled (or loaded from the compilation cache) on
    first use, a noticeable part of a warm start."""
    n, cap = config.num_blocks, config.queue_capacity
    ids = np.arange(n, dtype=np.int32)
    ring = np.zeros((cap,), np.int32)
    ring[: n - 1] = ids[1:]
    slot = np.where(ids == NULL_BLOCK, -1, ids - 1).astype(np.int32)
    queue = FreeQueue(ring=ring, slot=slot, counts=np.array([0, n - 1, n - 1], np.int32))
    state = BlockManagerState(
        ref_count=np.zeros((n,), np.int32),
        block_tables=np.full((config.max_seqs, config.max_blocks_per_seq), NULL_BLOCK, np.int32),
        num_tokens=np.zeros((config.max_seqs,), np.int32),
        active=np.zeros((config.max_seqs,), bool),
        queue=queue,
        seq_chain=np.zeros((config.max_seqs, 2), np.uint32),
        seq_salt=np.zeros((config.max_seqs,), np.uint32),
        cache=None,
        spans=np.zeros((config.max_seqs, 2), np.int32),
    )
    if config.grouped:
        g, s = config.num_groups, config.max_seqs
        state = state.replace(
            group_tables=np.full((g - 1, s, config.max_blocks_per_seq), NULL_BLOCK, np.int32),
            null_prefix=np.zeros((g, s), np.int32),
            block_group=np.zeros((n,), np.int32),
        )
    return jax.tree.map(jnp.asarray, state).replace(cache=init_cache(config))
