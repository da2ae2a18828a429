"""Block-manager state: an immutable pytree of fixed-shape int32/bool arrays.

Every operation takes a ``BlockManagerState`` and returns a new one; nothing is mutated in place
(under ``jit`` with the state donated, XLA reuses the buffers). Shapes depend only on the static
``ManagerConfig``, so a decode loop never retraces as sequences come and go.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.hash_table import HashTable, empty_table


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
      head: int32 scalar, ring index of the front entry.
      size: int32 scalar, entries in use (live and stale).
      num_free: int32 scalar, live entries = free blocks.
    """

    ring: jax.Array
    slot: jax.Array
    head: jax.Array
    size: jax.Array
    num_free: jax.Array


@flax.struct.dataclass
class CacheStats:
    """Prefix-cache counters since the state was created, int32 scalars (they wrap after 2**31).

    Attributes:
      lookups: admitted requests (each walks its prompt's chain once).
      query_tokens: prompt tokens of those requests.
      hit_tokens: prompt tokens whose K/V came from a cached block or from a block another request
        of the same call computes (``admit`` reports the two apart per request).
      evictions: cached blocks whose hash was dropped because allocation took them from the queue.
    """

    lookups: jax.Array
    query_tokens: jax.Array
    hit_tokens: jax.Array
    evictions: jax.Array


@flax.struct.dataclass
class PrefixCache:
    """What the prefix cache knows about each block (``[1, ...]`` placeholders when it is off).

    A block is *cached* when the hash table holds its key. A hit is trusted only after checking
    the block's stored tokens and salt, and that it was cached as the child of the block that
    matched just before it (same id, same generation): a hash collision can never hand a request
    K/V computed for other tokens.

    Attributes:
      tokens: int32 ``[num_blocks, block_size]``, the tokens whose K/V each block holds.
      key: uint32 ``[num_blocks, 2]``, a cached block's key (what a table rebuild re-inserts).
      slot: int32 ``[num_blocks]``, a cached block's hash-table slot; -1 when not cached.
      salt: uint32 ``[num_blocks]``, the salt of the request that cached the block.
      parent: int32 ``[num_blocks]``, the block before it in its chain; -1 for a first block.
      parent_generation: int32 ``[num_blocks]``, ``generation[parent]`` when it was cached.
      generation: int32 ``[num_blocks]``, bumped whenever a block stops being cached, so that
        children cached under its old contents no longer link to it.
      table: the hash table from keys to block ids.
      stats: counters.
    """

    tokens: jax.Array
    key: jax.Array
    slot: jax.Array
    salt: jax.Array
    parent: jax.Array
    parent_generation: jax.Array
    generation: jax.Array
    table: HashTable
    stats: CacheStats


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
    def zero():  # a buffer each: donated states must not alias
        return jnp.zeros((), jnp.int32)

    return PrefixCache(
        tokens=jnp.zeros((n, config.block_size), jnp.int32),
        key=jnp.zeros((n, 2), jnp.uint32),
        slot=jnp.full((n,), -1, jnp.int32),
        salt=jnp.zeros((n,), jnp.uint32),
        parent=jnp.full((n,), -1, jnp.int32),
        parent_generation=jnp.zeros((n,), jnp.int32),
        generation=jnp.zeros((n,), jnp.int32),
        table=empty_table(size),
        stats=CacheStats(lookups=zero(), query_tokens=zero(), hit_tokens=zero(), evictions=zero()),
    )


def init_state(config: ManagerConfig) -> BlockManagerState:
    """A pool with every block free, in id order (block 1 at the front), and no sequences."""
    n, cap = config.num_blocks, config.queue_capacity
    ids = jnp.arange(n, dtype=jnp.int32)
    ring = jnp.zeros((cap,), jnp.int32).at[: n - 1].set(ids[1:])
    slot = jnp.where(ids == NULL_BLOCK, -1, ids - 1).astype(jnp.int32)
    queue = FreeQueue(
        ring=ring,
        slot=slot,
        head=jnp.int32(0),
        size=jnp.int32(n - 1),
        num_free=jnp.int32(n - 1),
    )
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
