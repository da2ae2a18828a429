"""Sharing through reference counts: parallel sampling (``fork``) and beam search (``select``).

No block is copied here: the new table points at the same physical blocks and their counts go up.
Copies happen later, in ``append``, and only for a shared, partly full last block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_kv import groups, inputs
from paged_kv.batch import blocks_held, by_width, held_columns, start_rows, tail_first, take_status
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.refcount import cache_slots, release
from paged_kv.state import BlockManagerState
from paged_kv.status import Status


def _take_tables(
    config: ManagerConfig,
    state: BlockManagerState,
    dst_ids: jax.Array,
    src_ids: jax.Array,
    *,
    dst_must_be_free: bool,
    straight: bool = False,
) -> tuple[BlockManagerState, jax.Array]:
    if config.grouped:
        return groups.take_tables(config, state, dst_ids, src_ids, dst_must_be_free=dst_must_be_free)
    s, n = config.max_seqs, config.num_blocks
    dst, src, status = take_status(config, state, dst_ids, src_ids, dst_must_be_free)
    ok = status == Status.OK

    # Everything reads the state before the call: a row can be a source and a destination at once.
    src_tokens = state.num_tokens[src]
    # A source's reserved blocks (``spans``) stay its own: a destination takes its tokens' blocks.
    src_cols = blocks_held(config, src_tokens)
    src_rows = jnp.where(jnp.arange(config.max_blocks_per_seq)[None, :] < src_cols[:, None],
                         state.block_tables[src], NULL_BLOCK)
    src_held = jnp.where(ok, src_cols, 0)
    dropping = ok & state.active[dst]
    dst_rows = state.block_tables[dst]
    dst_held = jnp.where(dropping, held_columns(config, state, dst), 0)
    slots = cache_slots(config, state)

    def recount(width, ref_count, queue):
        j = jnp.arange(width, dtype=jnp.int32)[None, :]
        gained = j < src_held[:, None]
        ref_count = ref_count.at[jnp.where(gained, src_rows[:, :width], n)].add(1, mode="drop")
        if dst_must_be_free:
            # fork: a destination is never running, so nothing is dropped (a release of no
            # entries would leave the counts and the queue as they are).
            return ref_count, queue
        blocks, valid = tail_first(dst_rows[:, :width], dst_held, dropping)
        return release(ref_count, queue, blocks, valid, slots, target=config.target, straight=straight)

    needed = jnp.maximum(jnp.max(src_held), jnp.max(dst_held))
    ref_count, queue = by_width(config, needed, recount, state.ref_count, state.queue)

    target = jnp.where(ok, dst, s)
    state = start_rows(state.replace(ref_count=ref_count, queue=queue), target, src_rows, src_tokens,
                       state.seq_chain[src], state.seq_salt[src])
    state = state.replace(spans=state.spans.at[target].set(0, mode="drop"))
    return state, status


def fork(
    config: ManagerConfig, state: BlockManagerState, src_ids: jax.Array, dst_ids: jax.Array
) -> tuple[BlockManagerState, jax.Array]:
    """Starts each ``dst`` as a copy of running ``src``'s table (parallel sampling).

    Every block of the source gains one reference per child; no K/V moves.

    Args:
      src_ids: int32 ``[B]`` running sequences (may repeat: one prompt, several samples).
      dst_ids: int32 ``[B]`` free rows (< 0: padding), distinct.

    Returns:
      The new state and status int32 ``[B]``.
    """
    dst_ids, b = inputs.batch_ids("fork", "dst_ids", dst_ids)
    src_ids = inputs.int_array("fork", "src_ids", src_ids, ndim=1, batch=b)
    return _take_tables(config, state, dst_ids, src_ids, dst_must_be_free=True)


def select(
    config: ManagerConfig, state: BlockManagerState, dst_ids: jax.Array, parent_ids: jax.Array, *,
    straight: bool = False,
) -> tuple[BlockManagerState, jax.Array]:
    """Beam-search reselection: row ``dst_ids[i]`` takes the table of ``parent_ids[i]``.

    All rows switch at once, reading the tables as they were before the call, so candidates can
    swap parents freely. A destination that was running drops every reference on its old path
    (tail first); blocks that no surviving candidate holds go back to the free queue. A candidate
    that drops out of the beam is simply a row no destination names as parent: pass its row as a
    destination of a surviving parent, or ``free`` it.

    Args:
      dst_ids: int32 ``[B]`` distinct rows (running or free; < 0: padding).
      parent_ids: int32 ``[B]`` running rows (may repeat).
      straight: static, see ``refcount.release``.

    Returns:
      The new state and status int32 ``[B]``.
    """
    dst_ids, b = inputs.batch_ids("select", "dst_ids", dst_ids)
    parent_ids = inputs.int_array("select", "parent_ids", parent_ids, ndim=1, batch=b)
    return _take_tables(config, state, dst_ids, parent_ids, dst_must_be_free=False, straight=straight)
