"""The manager's share of a serving step as fused calls: ``free`` then ``select``, and ``free``,
``select`` then ``append``, with the same states and outputs as the calls one after another.

They exist for the GPU form (``ManagerConfig.target``): each call there is one host sync on the
common path instead of one per operation. The blocks the two releases can return to the free
queue are at most those the named running rows hold (``reclaim.release_bound``, read from the
state before either), so when the ring has room for that many, neither can need a compaction and
both push unchecked, straight-line; ``append`` adds its own predicate (``allocate.append_straight``).
When a predicate holds, every write of the straight-line form is masked off and the calls are
redone in the general form in a one-trip loop (``scan.repair``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from paged_kv import allocate
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.reclaim import free, release_bound
from paged_kv.scan import per_platform, repair
from paged_kv.share import select
from paged_kv.state import BlockManagerState
from paged_kv.status import Status


def free_then_select(
    config: ManagerConfig, state: BlockManagerState, free_ids: jax.Array, dst_ids: jax.Array,
    parent_ids: jax.Array,
) -> tuple[BlockManagerState, jax.Array, jax.Array]:
    """``free(free_ids)`` then ``select(dst_ids, parent_ids)``; on a GPU one room check for both.

    Returns:
      The new state, the status of ``free`` and the status of ``select`` (int32 ``[B]`` each).
    """

    if config.grouped:  # the grouped forms have no straight-line variant: the calls in turn
        state, (freed, selected) = _separate(config, state, free_ids, dst_ids, parent_ids)
        return state, freed, selected

    def one_check(state):
        crowded = _crowded(config, state, free_ids, dst_ids)
        off = lambda ids: jnp.where(crowded, -1, ids)  # all padding: nothing changes
        state, freed, selected = _unchecked_free_then_select(config, state, off(free_ids), off(dst_ids), parent_ids)
        general = lambda s: _separate(config, s, free_ids, dst_ids, parent_ids)
        return repair(crowded, (state, (freed, selected)), general)

    state, (freed, selected) = per_platform(
        config.target, state, cpu=lambda s: _separate(config, s, free_ids, dst_ids, parent_ids), default=one_check)
    return state, freed, selected


def free_select_append(
    config: ManagerConfig, state: BlockManagerState, free_ids: jax.Array, dst_ids: jax.Array,
    parent_ids: jax.Array, seq_ids: jax.Array, token_ids: jax.Array | None = None,
    table_rows: jax.Array | None = None,
) -> tuple[BlockManagerState, jax.Array, jax.Array, allocate.AppendResult, jax.Array]:
    """``free(free_ids)``, ``select(dst_ids, parent_ids)``, then ``append(seq_ids, token_ids)``:
    the manager's share of a serving step before its forward passes, on every platform.

    The CPU form runs the three in turn, each of ``free`` and ``select`` skipped behind a ``cond``
    when its rows are all padding (most steps free and select nothing; XLA:CPU runs only the
    branch taken). The GPU form's predicate is the ring's room check (read from the state before
    the call) or ``append``'s rare paths (read from the state after free and select, which are
    computed first with every row masked off when the ring is crowded, so that state is then the
    input itself); on the rare path the three are redone, free and select only if the ring was
    crowded.

    Args:
      free_ids, dst_ids, parent_ids: int32 ``[B]``, as ``free`` and ``select`` take them.
      seq_ids, token_ids: int32 ``[B2]``, as ``append`` takes them.
      table_rows: int32 ``[P]`` rows (< 0: padding) whose block tables to read between select
        and append (a prefill chunk's, which the serving step feeds after all three); default
        none.

    Returns:
      The new state, the status of ``free`` and of ``select`` (int32 ``[B]`` each), the
      ``AppendResult``, and int32 ``[P, max_blocks_per_seq]`` those tables (``NULL_BLOCK`` rows
      for padding); with groups every group's, int32 ``[G, P, max_blocks_per_seq]``.
    """
    seq_ids, token_ids = allocate.check_inputs(config, seq_ids, token_ids)
    rows = jnp.zeros((0,), jnp.int32) if table_rows is None else jnp.asarray(table_rows, jnp.int32)

    def tables_of(state):
        r = config.max_seqs
        if config.grouped:
            return jnp.where((rows >= 0)[None, :, None], state.tables[:, jnp.clip(rows, 0, r - 1)], NULL_BLOCK)
        return jnp.where((rows >= 0)[:, None], state.block_tables[jnp.clip(rows, 0, r - 1)], NULL_BLOCK)

    def cpu(state):
        state, freed = _unless_padding(free_ids, lambda s: free(config, s, free_ids), state)
        state, selected = _unless_padding(dst_ids, lambda s: select(config, s, dst_ids, parent_ids), state)
        tables = tables_of(state)
        state, res = allocate.append_general(config, state, seq_ids, token_ids)
        return state, (freed, selected, res, tables)

    if config.grouped:  # every platform runs the calls in turn (no straight-line grouped form)
        state, (freed, selected, res, tables) = cpu(state)
        return state, freed, selected, res, tables

    def one_check(state):
        crowded = _crowded(config, state, free_ids, dst_ids)
        # Crowded: free and select do nothing here (all rows padding), so ``after`` is ``state``
        # and the rare form below starts from the input.
        off = lambda ids: jnp.where(crowded, -1, ids)
        after, freed, selected = _unchecked_free_then_select(config, state, off(free_ids), off(dst_ids), parent_ids)
        tables = tables_of(after)
        after, res, slow = allocate.append_straight(config, after, seq_ids, token_ids, crowded)

        def general(state):
            # Not crowded: ``state`` is already past free and select; ``on`` pads them off.
            on = lambda ids: jnp.where(crowded, ids, -1)
            state, (fr, se) = _separate(config, state, on(free_ids), on(dst_ids), parent_ids)
            tabs = jnp.where(crowded, tables_of(state), tables)
            state, res = allocate.append_general(config, state, seq_ids, token_ids)
            return state, (jnp.where(crowded, fr, freed), jnp.where(crowded, se, selected), res, tabs)

        return repair(slow, (after, (freed, selected, res, tables)), general)

    state, (freed, selected, res, tables) = per_platform(config.target, state, cpu=cpu, default=one_check)
    return state, freed, selected, res, tables


def _unless_padding(ids, op, state):
    """``op(state)`` (``(state, status)``) when some row of ``ids`` (int32 ``[B]``) is not
    padding; else ``state`` as is and every status ``PADDING``, which is what ``op`` gives then."""
    def skipped(state):
        return state, jnp.full(ids.shape, Status.PADDING, jnp.int32)
    return lax.cond(jnp.any(ids >= 0), op, skipped, state)


def _separate(config, state, free_ids, dst_ids, parent_ids):
    """``free`` then ``select``, each with its own room check."""
    state, freed = free(config, state, free_ids)
    state, selected = select(config, state, dst_ids, parent_ids)
    return state, (freed, selected)


def _crowded(config, state, free_ids, dst_ids):
    """bool scalar: the free queue's ring may lack room for what freeing ``free_ids`` and
    dropping the old tables of ``dst_ids`` can return (``release_bound``), so a push may need a
    compaction."""
    bound = release_bound(config, state, free_ids) + release_bound(config, state, dst_ids)
    return state.queue.size + bound > state.queue.ring.shape[0]


def _unchecked_free_then_select(config, state, free_ids, dst_ids, parent_ids):
    """``free`` then ``select`` pushing without a room check: valid only when the ring has room
    for ``release_bound`` of both (or every row is padding)."""
    state, freed = free(config, state, free_ids, straight=True)
    # Keeps XLA:GPU from fusing the two releases into a kernel that spills registers.
    state = lax.optimization_barrier(state)
    state, selected = select(config, state, dst_ids, parent_ids, straight=True)
    return state, freed, selected
