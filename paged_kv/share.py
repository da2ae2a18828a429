"""Sharing through reference counts: parallel sampling (``fork``) and beam search (``select``).

No block is copied here: the new table points at the same physical blocks and their counts go up.
Copies happen later, in ``append``, and only for a shared, partly full last block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from paged_kv import allocate, inputs
from paged_kv.batch import blocks_held, by_width, first_occurrence, start_rows, tail_first
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.reclaim import cache_slots, free, release, release_bound
from paged_kv.scan import per_platform, straight_or_repair
from paged_kv.state import BlockManagerState
from paged_kv.status import Status


def _take_tables(
    config: ManagerConfig,
    state: BlockManagerState,
    dst_ids: jax.Array,
    src_ids: jax.Array,
    *,
    dst_must_be_free: bool,
    room_known: bool = False,
) -> tuple[BlockManagerState, jax.Array]:
    s, n = config.max_seqs, config.num_blocks
    dst_ids = dst_ids.astype(jnp.int32)
    src_ids = src_ids.astype(jnp.int32)
    dst, src = jnp.clip(dst_ids, 0, s - 1), jnp.clip(src_ids, 0, s - 1)
    # Destinations are distinct rows (fork: not running); sources may repeat but must be running.
    bad_dst = (dst_ids >= s) | ~first_occurrence(dst_ids, s)
    if dst_must_be_free:
        bad_dst |= state.active[dst]
    bad_src = (src_ids < 0) | (src_ids >= s) | ~state.active[src]
    status = jnp.where(
        dst_ids < 0, Status.PADDING, jnp.where(bad_dst | bad_src, Status.BAD_SEQUENCE, Status.OK)
    ).astype(jnp.int32)
    ok = status == Status.OK

    # Everything reads the state before the call: a row can be a source and a destination at once.
    src_rows = state.block_tables[src]
    src_tokens = state.num_tokens[src]
    src_held = jnp.where(ok, blocks_held(config, src_tokens), 0)
    dropping = ok & state.active[dst]
    dst_rows = state.block_tables[dst]
    dst_held = jnp.where(dropping, blocks_held(config, state.num_tokens[dst]), 0)
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
        return release(ref_count, queue, blocks, valid, slots, room_known)

    needed = jnp.maximum(jnp.max(src_held), jnp.max(dst_held))
    ref_count, queue = by_width(needed, config.max_blocks_per_seq, recount, state.ref_count, state.queue)

    target = jnp.where(ok, dst, s)
    state = start_rows(state.replace(ref_count=ref_count, queue=queue), target, src_rows, src_tokens,
                       state.seq_chain[src], state.seq_salt[src])
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
    room_known: bool = False,
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

    Returns:
      The new state and status int32 ``[B]``.
    """
    dst_ids, b = inputs.batch_ids("select", "dst_ids", dst_ids)
    parent_ids = inputs.int_array("select", "parent_ids", parent_ids, ndim=1, batch=b)
    return _take_tables(config, state, dst_ids, parent_ids, dst_must_be_free=False, room_known=room_known)


def free_then_select(
    config: ManagerConfig, state: BlockManagerState, free_ids: jax.Array, dst_ids: jax.Array,
    parent_ids: jax.Array, *, checked: bool = False,
) -> tuple[BlockManagerState, jax.Array, jax.Array]:
    """``free(free_ids)`` then ``select(dst_ids, parent_ids)``, as a serving step runs them; the
    same state and statuses.

    On a GPU, one check for both instead of one room check each: the blocks the two can return
    to the free queue are at most those the named running rows hold (``release_bound``, read
    from the state before either), so when the ring has room for that many, neither can need a
    compaction and both push unchecked, straight-line; otherwise (rows masked off there) both
    run as usual in a one-trip loop (``scan.straight_or_repair``).

    ``checked`` (static): the two calls as they are, each with its own room check, on every
    platform (the rare form of ``free_select_append``).

    Returns:
      The new state, the status of ``free`` and the status of ``select`` (int32 ``[B]`` each).
    """

    def separate(state):
        state, freed = free(config, state, free_ids)
        state, selected = select(config, state, dst_ids, parent_ids)
        return state, freed, selected

    def one_check(state):
        crowded = _crowded(config, state, free_ids, dst_ids)

        def straight(state, keep):
            on = lambda ids: jnp.where(keep, ids, -1)  # noqa: E731  (all padding: nothing changes)
            state, freed, selected = _unchecked_free_then_select(config, state, on(free_ids), on(dst_ids), parent_ids)
            return state, (freed, selected)

        def general(state):
            state, freed, selected = separate(state)
            return state, (freed, selected)

        state, (freed, selected) = straight_or_repair(crowded, state, straight, general)
        return state, freed, selected

    if checked:
        return separate(state)
    return per_platform(state, cpu=separate, default=one_check)


def free_select_append(
    config: ManagerConfig, state: BlockManagerState, free_ids: jax.Array, dst_ids: jax.Array,
    parent_ids: jax.Array, seq_ids: jax.Array, token_ids: jax.Array | None = None,
    table_rows: jax.Array | None = None,
) -> tuple[BlockManagerState, jax.Array, jax.Array, allocate.AppendResult, jax.Array]:
    """``free(free_ids)``, ``select(dst_ids, parent_ids)``, then ``append(seq_ids, token_ids)``:
    the manager's share of a serving step before its forward passes; the same state and outputs.

    On a GPU, one host sync for the three on the common path instead of one per call: the
    predicate is the free queue's room check (``free_then_select``'s, read from the state before
    the call) or ``append``'s rare paths (read from the state after free and select, which is
    computed first with every row masked off when the ring is crowded, so that state is then the
    input itself). All of it runs straight-line (``scan.straight_or_repair``); when the predicate
    holds, the three are redone in the CPU form, free and select only if the ring was crowded.

    Args:
      free_ids, dst_ids, parent_ids: int32 ``[B]``, as ``free`` and ``select`` take them.
      seq_ids, token_ids: int32 ``[B2]``, as ``append`` takes them.
      table_rows: int32 ``[P]`` rows (< 0: padding) whose block tables to read between select
        and append (a prefill chunk's, which the serving step feeds after all three); default
        none.

    Returns:
      The new state, the status of ``free`` and of ``select`` (int32 ``[B]`` each), the
      ``AppendResult``, and int32 ``[P, max_blocks_per_seq]`` those tables (``NULL_BLOCK`` rows
      for padding).
    """
    seq_ids, b = inputs.batch_ids("append", "seq_ids", seq_ids)
    if token_ids is not None:
        token_ids = inputs.int_array("append", "token_ids", token_ids, ndim=1, batch=b)
    if config.prefix_caching and token_ids is None:
        raise ValueError("append: token_ids (int32 [B]) are required with prefix_caching=True")
    rows = jnp.zeros((0,), jnp.int32) if table_rows is None else jnp.asarray(table_rows, jnp.int32)

    def tables_of(state):
        r = config.max_seqs
        return jnp.where((rows >= 0)[:, None], state.block_tables[jnp.clip(rows, 0, r - 1)], NULL_BLOCK)

    def cpu(state):
        state, freed, selected = free_then_select(config, state, free_ids, dst_ids, parent_ids)
        tables = tables_of(state)
        state, res = allocate.append(config, state, seq_ids, token_ids)
        return state, (freed, selected, res, tables)

    def one_check(state):
        crowded = _crowded(config, state, free_ids, dst_ids)
        # Crowded: free and select do nothing here (all rows padding), so ``after`` is ``state``
        # and the rare form below starts from the input.
        off = lambda ids: jnp.where(crowded, -1, ids)  # noqa: E731
        after, freed, selected = _unchecked_free_then_select(config, state, off(free_ids), off(dst_ids), parent_ids)
        tables = tables_of(after)
        p = allocate.plan(config, after, seq_ids, token_ids)

        def straight(state, keep):
            state, res = p.run_straight(state, keep)
            return state, (freed, selected, res, tables)

        def general(state):
            # Not crowded: ``state`` is already past free and select; ``on`` pads them off.
            on = lambda ids: jnp.where(crowded, ids, -1)  # noqa: E731
            state, fr, se = free_then_select(config, state, on(free_ids), on(dst_ids), parent_ids, checked=True)
            tabs = jnp.where(crowded, tables_of(state), tables)
            state, res = allocate.plan(config, state, seq_ids, token_ids).run(state)
            return state, (jnp.where(crowded, fr, freed), jnp.where(crowded, se, selected), res, tabs)

        return straight_or_repair(crowded | p.slow(), after, straight, general)

    state, (freed, selected, res, tables) = per_platform(state, cpu=cpu, default=one_check)
    return state, freed, selected, res, tables


def _crowded(config, state, free_ids, dst_ids):
    """bool scalar: the free queue's ring may lack room for what freeing ``free_ids`` and
    dropping the old tables of ``dst_ids`` can return (``release_bound``), so a push may need a
    compaction."""
    bound = release_bound(config, state, free_ids) + release_bound(config, state, dst_ids)
    return state.queue.size + bound > state.queue.ring.shape[0]


def _unchecked_free_then_select(config, state, free_ids, dst_ids, parent_ids):
    """``free`` then ``select`` pushing without a room check: valid only when the ring has room
    for ``release_bound`` of both (or every row is padding)."""
    state, freed = free(config, state, free_ids, room_known=True)
    # See ``free_then_select``: keeps XLA:GPU from fusing the two releases into a kernel that
    # spilled registers.
    state = lax.optimization_barrier(state)
    state, selected = select(config, state, dst_ids, parent_ids, room_known=True)
    return state, freed, selected
