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
    """

    ref_count: jax.Array
    block_tables: jax.Array
    num_tokens: jax.Array
    active: jax.Array
    queue: FreeQueue


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
    )
