"""Lazy allocation during decoding: a KV slot per new token, a fresh block only when the last one
is full, and copy-on-write of a shared, partly full last block.

Blocks come from the front of the free queue (least recently freed first). A row that cannot get
the block it needs is left untouched and reported with ``Status.NO_FREE_BLOCKS``; rows are served
first come, first served (once a row does not fit, no later row of the call takes a block).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from numpy.typing import ArrayLike

from paged_kv import block_hash, free_queue, groups, hash_table, inputs, prefix_cache
from paged_kv.batch import check_rows, first_come_first_served, refuse_spans
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.results import AppendResult
from paged_kv.scan import per_platform, prefix_sum, repair
from paged_kv.state import NO_PARENT, BlockManagerState
from paged_kv.status import Status


def append(
    config: ManagerConfig,
    state: BlockManagerState,
    seq_ids: jax.Array,
    token_ids: jax.Array | None = None,
) -> tuple[BlockManagerState, AppendResult]:
    """Gives each running sequence in the batch a KV slot for one more token.

    Per row, with ``n`` tokens already held:
    - ``n % block_size == 0`` (last block full, or none): a fresh block from the queue front
      (lazy allocation), unless the table is full (``TABLE_FULL``).
    - otherwise the token goes into the partly full last block. If that block is shared
      (count ``r > 1``) it is copied first (copy-on-write). When ``w`` rows of this batch write
      into the same shared block, the batch behaves as if the rows ran one at a time: all ``w``
      copy if ``w < r``; if ``w == r`` the last of them in batch order finds itself the only
      holder and writes in place, so ``w - 1`` copies.

    A row that needs a block and gets none fails with ``NO_FREE_BLOCKS``; so does the in-place
    writer of a shared block when one of its co-writers failed to get its copy (otherwise it would
    write into a block the failed row still reads).

    With prefix caching, the new token's id is stored with its block, and a block that the token
    fills is cached under its chain key (after every block taken in this call lost its hash).

    Args:
      seq_ids: int32 ``[B]`` running sequences (< 0: padding).
      token_ids: int32 ``[B]`` the tokens being appended (required with prefix caching).

    With ``config.grouped`` (KV-cache groups, ``paged_kv.groups``): window groups first reclaim
    the blocks that left their window, then every group gets its slot; ``slots``, ``copy_src``
    and ``copy_dst`` are then int32 ``[B, G]``.

    Returns:
      The new state and an ``AppendResult``.
    """
    seq_ids, token_ids = check_inputs(config, seq_ids, token_ids)
    if config.grouped:
        return groups.append(config, state, seq_ids, token_ids)

    def one_check(state):
        # The rare path reuses the decisions made on the input (the loop's state is the input).
        d = _decide(config, state, seq_ids)
        slow, masked = _unless_slow(config, state, d, token_ids, False)
        return repair(slow, _write(config, state, masked, token_ids, straight=True),
                      lambda state: _write(config, state, d, token_ids, straight=False))

    return per_platform(config.target, state, cpu=lambda s: append_general(config, s, seq_ids, token_ids),
                        default=one_check)


def check_inputs(config: ManagerConfig, seq_ids: ArrayLike,
                 token_ids: ArrayLike | None) -> tuple[jax.Array, jax.Array | None]:
    """``append``'s arguments checked and converted: int32 ``[B]`` ids and tokens (or None)."""
    seq_ids, b = inputs.batch_ids("append", "seq_ids", seq_ids)
    if token_ids is not None:
        token_ids = inputs.int_array("append", "token_ids", token_ids, ndim=1, batch=b)
    if config.prefix_caching and token_ids is None:
        raise ValueError("append: token_ids (int32 [B]) are required with prefix_caching=True")
    return seq_ids, token_ids


def append_general(config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array,
                   token_ids: jax.Array | None) -> tuple[BlockManagerState, AppendResult]:
    """``append`` on checked inputs in the form with its skips and loops: the CPU form, and the
    GPU form's rare path. With groups, the grouped form (``groups.append``)."""
    if config.grouped:
        return groups.append(config, state, seq_ids, token_ids)
    return _write(config, state, _decide(config, state, seq_ids), token_ids, straight=False)


def append_straight(config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array,
                    token_ids: jax.Array | None, slow: jax.Array | bool = False
                    ) -> tuple[BlockManagerState, AppendResult, jax.Array]:
    """``append`` on checked inputs in straight-line code (no ``cond`` or loop): the GPU form's
    common path. Returns ``(state, AppendResult, slow)``: ``slow`` (bool scalar) holds when a
    rare path is needed (``_needs_loops``, read before anything is written) or the caller's
    ``slow`` does; then every write is masked off, the state comes back bit for bit, and the
    caller redoes the call with ``append_general`` (``scan.repair``)."""
    slow, masked = _unless_slow(config, state, _decide(config, state, seq_ids), token_ids, slow)
    return *_write(config, state, masked, token_ids, straight=True), slow


class _Decision(NamedTuple):
    """What ``append`` decides from the state before any write: ``status`` (int32 ``[B]``), the
    clipped row ids ``sid``, the rows that take effect (``ok``), take a block (``takes``) or copy
    their last block (``copies``) (bool ``[B]`` each), and each row's table column, offset in
    its block and last block (int32 ``[B]`` each)."""

    status: jax.Array
    sid: jax.Array
    ok: jax.Array
    takes: jax.Array
    copies: jax.Array
    col: jax.Array
    offset: jax.Array
    last_block: jax.Array


def _decide(config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array) -> _Decision:
    bs, m = config.block_size, config.max_blocks_per_seq
    status, sid = check_rows(config, state, seq_ids, must_be_active=True)
    status = refuse_spans(state, status, sid)
    ok = status == Status.OK

    n = state.num_tokens[sid]
    col, offset = n // bs, n % bs
    needs_fresh = ok & (offset == 0)
    table_full = needs_fresh & (col >= m)
    status = jnp.where(table_full, Status.TABLE_FULL, status)
    needs_fresh = needs_fresh & ~table_full
    col = jnp.minimum(col, m - 1)

    last_block = state.block_tables[sid, col]
    writes_last = ok & (offset > 0)
    refs = state.ref_count[last_block]
    shared = writes_last & (refs > 1)

    # Group the writers by block with a [B, B] comparison: O(B^2) booleans, which for decode
    # batches (up to a few hundred rows) is cheaper on CPU and GPU than a sort, and touches no
    # pool-sized array (an in-place trick on the ref counts made XLA copy them).
    same = writes_last[:, None] & writes_last[None, :] & (last_block[:, None] == last_block[None, :])
    writers = jnp.sum(same, axis=1, dtype=jnp.int32)
    later_writer = jnp.any(jnp.triu(same, k=1), axis=1)
    # All holders write this step (w == r): the last writer in batch order keeps the block.
    keeps = shared & (writers == refs) & ~later_writer
    copies = shared & ~keeps

    need = (needs_fresh | copies).astype(jnp.int32)
    fits = first_come_first_served(need, state.queue.num_free)
    starved = (need > 0) & ~fits
    # A keeper must not write in place while a co-writer that failed to get its copy still reads
    # the block.
    keeper_starved = keeps & jnp.any(same & (starved & copies)[None, :], axis=1)

    status = jnp.where(starved | keeper_starved, Status.NO_FREE_BLOCKS, status)
    ok = status == Status.OK
    takes = ok & (need > 0)
    copies = copies & ok
    return _Decision(status, sid, ok, takes, copies, col, offset, last_block)


def _unless_slow(config, state, d: _Decision, token_ids, slow):
    """``(slow, d masked)``: ``slow`` or'ed with ``_needs_loops``, and ``d`` with every row off
    where it holds, so that ``_write(straight=True)`` then writes nothing."""
    slow = slow | _needs_loops(config, state, d, token_ids)
    keep = ~slow
    return slow, d._replace(ok=d.ok & keep, takes=d.takes & keep, copies=d.copies & keep)


def _write(config, state, d: _Decision, token_ids, *, straight):
    """``append``'s writes for decisions ``d``. ``straight``: the GPU's common path, valid when
    ``_needs_loops`` is False: the first window of the free queue, no skipped evictions, a
    registration without rebuild check or probe loop. Every write is a scatter at indices masked
    by ``ok``, ``takes`` or ``copies``, so with all three False (``take_front`` then takes
    nothing) the state comes back as it was."""
    bs, n_blocks = config.block_size, config.num_blocks
    status, sid, ok, takes, copies, col, offset, last_block = d
    b = sid.shape[0]
    if straight:
        queue, taken, _ = free_queue.take_front(state.queue, jnp.sum(takes, dtype=jnp.int32), b, straight=True)
    else:
        queue, taken = free_queue.take_front(state.queue, jnp.sum(takes, dtype=jnp.int32), b)
    fresh = jnp.where(takes, taken[prefix_sum(takes) - 1], NULL_BLOCK)
    block = jnp.where(takes, fresh, last_block)
    slots = jnp.where(ok, block * bs + offset, NULL_BLOCK * bs)

    ref_count = state.ref_count.at[jnp.where(copies, last_block, n_blocks)].add(-1, mode="drop")
    ref_count = ref_count.at[jnp.where(takes, fresh, n_blocks)].set(1, mode="drop")
    if config.prefix_caching:
        state = _cache_appended(config, state, sid, ok, takes, copies, fresh, last_block, block,
                                col, offset, taken, token_ids, straight)
    row = jnp.where(takes, sid, config.max_seqs)
    state = state.replace(
        queue=queue,
        ref_count=ref_count,
        block_tables=state.block_tables.at[row, col].set(fresh, mode="drop"),
        num_tokens=state.num_tokens.at[jnp.where(ok, sid, config.max_seqs)].add(1, mode="drop"),
    )
    result = AppendResult(
        status=status,
        slots=slots,
        copy_src=jnp.where(copies, last_block, NULL_BLOCK),
        copy_dst=jnp.where(copies, fresh, NULL_BLOCK),
        num_copies=jnp.sum(copies, dtype=jnp.int32),
    )
    return state, result


def _needs_loops(config, state, d: _Decision, token_ids):
    """bool scalar: whether this ``append`` needs any of its rare paths: stale entries among the
    first ``count`` of the free queue (``take_front``'s loop), a rebuild of the hash table, or an
    insertion probing past its window. Reads only (O(B) gathers and an O(B^2) comparison), so on
    a GPU one ``cond`` on it picks the form with those paths or the straight-line one: one host
    sync per call instead of one per skip or loop."""
    sid, ok, takes, offset, last_block = d.sid, d.ok, d.takes, d.offset, d.last_block
    b = sid.shape[0]
    _, _, slow = free_queue.take_front(state.queue, jnp.sum(takes, dtype=jnp.int32), b, straight=True)
    if config.prefix_caching:
        bs = config.block_size
        fills = ok & (offset == bs - 1)
        table = state.cache.table
        slow |= hash_table.needs_rebuild(table, jnp.sum(fills, dtype=jnp.int32))
        # A block this token fills holds what its last block held (itself, or the block a
        # copy-on-write copies) plus the new token, at offset bs - 1; evicting taken blocks
        # tombstones entries, which does not change where the claims land.
        contents = state.cache.tokens[last_block].at[:, bs - 1].set(token_ids.astype(jnp.int32))
        chain = block_hash.extend(state.seq_chain[sid], block_hash.block_contents(contents))
        slow |= hash_table.claims_past_window(table, block_hash.key_of(chain), fills)
    return slow


def _cache_appended(config, state, sid, ok, takes, copies, fresh, last_block, block, col, offset,
                    taken, token_ids, straight=False):
    """Prefix-cache side of ``append``: evict taken blocks, store the tokens (copy-on-write copies
    them too), and cache blocks that this token fills."""
    n, bs = config.num_blocks, config.block_size
    b = sid.shape[0]
    # The straight-line form runs only in the GPU form: there ``evict`` runs masked, no skip.
    cache = prefix_cache.evict(state.cache, taken, jnp.arange(b) < jnp.sum(takes),
                               target="gpu" if straight else config.target)
    tokens = cache.tokens.at[jnp.where(copies, fresh, n)].set(cache.tokens[last_block], mode="drop")
    tokens = tokens.at[jnp.where(ok, block, n), offset].set(token_ids.astype(jnp.int32), mode="drop")
    fills = ok & (offset == bs - 1)
    chain = block_hash.extend(state.seq_chain[sid], block_hash.block_contents(tokens[block]))
    # The block before it is full, so cached (every full block in a table is): its class is the
    # new block's parent class.
    parent = state.block_tables[sid, jnp.maximum(col - 1, 0)]
    parent_class = jnp.where(
        (col > 0)[:, None], prefix_cache.class_of(cache, parent), jnp.array([NO_PARENT, 0], jnp.int32)
    )
    cache = prefix_cache.register(
        cache.replace(tokens=tokens), block, chain, state.seq_salt[sid], parent_class, fills, straight=straight
    )
    seq_chain = state.seq_chain.at[jnp.where(fills, sid, config.max_seqs)].set(chain, mode="drop")
    return state.replace(cache=cache, seq_chain=seq_chain)
