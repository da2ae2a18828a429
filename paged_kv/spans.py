"""Spans: room for several tokens at once, committed later or rolled back (speculative decoding,
prompt chunks).

A row's tokens are a committed prefix followed by ``BlockManagerState.num_uncommitted`` tokens
that hold slots (their K/V may be written) but are not final: drafts. A block is registered in the
prefix cache only once every token in it is committed, so a draft never becomes a prefix hit.

- ``extend`` gives rows room for ``num_new[b]`` more tokens (uncommitted, or committed at once
  with ``commit=True``), reusing the row's reserved blocks first.
- ``commit`` commits the next tokens of rows and registers the blocks that become wholly
  committed (the hash chain advances, as ``append``'s registration).
- ``truncate`` rolls rows back to a length no shorter than their committed prefix, releasing the
  blocks past it or keeping them as reserved room for the next span.

``append`` is ``extend(1, commit=True)`` for a row with no uncommitted token and no reserved block
(it refuses other rows with ``BAD_LENGTH``). ``extend`` and ``commit`` run one row at a time
(``lax.scan`` over the rows, each row's work vectorised over its tokens, new blocks and groups),
as ``paged_kv.groups`` does, for every configuration and both ``ManagerConfig.target`` forms (one
form, the same program everywhere): a row sees the state the rows before it left, so batches are
first come, first served and shared blocks are copied as if the rows ran in turn. ``truncate`` is
vectorised over its rows, as ``free``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpy.typing import ArrayLike

from paged_kv import block_hash, free_queue, inputs, prefix_cache
from paged_kv.batch import blocks_held, check_rows, tail_first
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.groups import group_chains, skipped_blocks
from paged_kv.refcount import cache_slots, release
from paged_kv.results import ExtendResult
from paged_kv.scan import prefix_sum
from paged_kv.state import NO_PARENT, RESERVED, UNCOMMITTED, BlockManagerState
from paged_kv.status import Status


def _tokens_arg(op: str, token_ids: ArrayLike | None, b: int) -> jax.Array | None:
    if token_ids is None:
        return None
    return jnp.asarray(inputs.int_array(op, "token_ids", token_ids, ndim=2, batch=b)).astype(jnp.int32)


def extend(
    config: ManagerConfig,
    state: BlockManagerState,
    seq_ids: ArrayLike,
    num_new: ArrayLike,
    token_ids: ArrayLike | None = None,
    *,
    commit: bool = False,
    max_new: int | None = None,
    prompt_lens: ArrayLike | None = None,
) -> tuple[BlockManagerState, ExtendResult]:
    """Gives each running row room for ``num_new[b]`` more tokens in every group, in one call.

    Per row, with ``n`` tokens held (``c`` of them committed) and ``k = num_new[b]``:
    - window groups first release the blocks no query from position ``c`` on reads (as
      ``append`` does at ``c == n``; measured from ``c`` because a ``truncate`` may bring the row
      back there);
    - a shared, partly full last block is copied (copy-on-write), as in ``append``;
    - columns ``ceil(n / bs) .. ceil((n + k) / bs) - 1`` get blocks: the row's reserved blocks
      first (one a ``fork`` shares loses a reference and is replaced), then fresh ones from the
      front of the free queue (per group: the copy first, then the columns in order);
    - the ``k`` tokens become uncommitted (``commit=True``: then committed, as ``commit`` would).
    All or nothing per row: ``BAD_LENGTH`` (``k < 0`` or ``k > K``), ``TABLE_FULL`` (more than
    ``max_blocks_per_seq`` columns), ``NO_FREE_BLOCKS`` (first come, first served in batch order:
    once a row lacks blocks, no later row takes one) leave the row as it was, except for its
    window reclaim (as ``append``).

    Args:
      seq_ids: int32 ``[B]`` running rows (< 0: padding).
      num_new: int32 ``[B]`` tokens to make room for, ``0 <= num_new <= K``.
      token_ids: int32 ``[B, K]``, the span's tokens (``[b, i]`` at position ``n + i``), stored
        with their blocks; optional (``commit`` stores the committed ones), required with
        ``commit=True`` and prefix caching.
      commit: static; commit the span at once (prompt chunks).
      max_new: static ``K`` when ``token_ids`` is None.
      prompt_lens: int32 ``[B]``, optional, with ``commit=True``: the span is a chunk of a prompt
        of this many tokens (chunked admission, ``admit(..., chunk=)``); a sparse window group
        (``ManagerConfig.sparse``) then registers the committed blocks within its reach of the
        prompt boundary, as a whole-prompt admission would have (``groups.reachable``'s boundary
        part). None: it registers none, as for ``append``.

    Returns:
      The new state and an ``ExtendResult``: ``slots`` int32 ``[B, K]`` (``[B, K, G]`` with
      groups), the null block's slot 0 past ``num_new`` and for rows that did not take effect;
      ``copy_src``/``copy_dst`` int32 ``[B]`` (``[B, G]``).
    """
    seq_ids, b = inputs.batch_ids("extend", "seq_ids", seq_ids)
    num_new = jnp.asarray(inputs.int_array("extend", "num_new", num_new, ndim=1, batch=b)).astype(jnp.int32)
    token_ids = _tokens_arg("extend", token_ids, b)
    if token_ids is None:
        if max_new is None or not inputs.is_int(max_new) or max_new < 1:
            raise ValueError(f"extend: without token_ids, max_new (K >= 1) is required, got {max_new!r}")
        k_max = int(max_new)
    else:
        k_max = token_ids.shape[1]
        if k_max < 1:
            raise ValueError(f"extend: token_ids must have K >= 1 columns, got shape {tuple(token_ids.shape)}")
    if commit and config.prefix_caching and token_ids is None:
        raise ValueError("extend: commit=True with prefix_caching=True needs token_ids (int32 [B, K])")
    if prompt_lens is not None:
        if not commit:
            raise ValueError("extend: prompt_lens (a prompt chunk's prompt length) needs commit=True")
        prompt_lens = jnp.asarray(inputs.int_array("extend", "prompt_lens", prompt_lens, ndim=1, batch=b))
        prompt_lens = prompt_lens.astype(jnp.int32)
    status0, sid = check_rows(config, state, seq_ids, must_be_active=True)
    bad = (num_new < 0) | (num_new > k_max)
    status0 = jnp.where((status0 == Status.OK) & bad, Status.BAD_LENGTH, status0)
    tokens = jnp.zeros((b, k_max), jnp.int32) if token_ids is None else token_ids

    def row(carry, x):
        return _extend_row(config, k_max, token_ids is not None, *carry, *x)

    (state, tables, _), out = lax.scan(row, (state, state.tables, jnp.bool_(False)),
                                       (status0, sid, num_new, tokens))
    state = state.with_tables(tables)
    status, slots, src, dst, copies = out
    if not config.grouped:
        slots, src, dst = slots[..., 0], src[:, 0], dst[:, 0]
    result = ExtendResult(status=status, slots=slots, copy_src=src, copy_dst=dst,
                          num_copies=jnp.sum(copies, dtype=jnp.int32))
    if commit:
        state, _ = _commit(config, state, seq_ids, jnp.where(status == Status.OK, num_new, 0), tokens,
                           prompt_lens=prompt_lens)
    return state, result


def _extend_row(config: ManagerConfig, k_max: int, store: bool, state: BlockManagerState, tables: jax.Array,
                blocked: jax.Array, status: jax.Array, s: jax.Array, k: jax.Array, tok: jax.Array):
    """One row of ``extend``: ``((state, tables [G, S, M], blocked), (status, slots [K, G],
    copy_src [G], copy_dst [G], copies bool [G]))``."""
    bs, m, nb = config.block_size, config.max_blocks_per_seq, config.num_blocks
    g_count = config.num_groups
    j_max = -(-k_max // bs)  # most new columns a span of K tokens needs
    valid = status == Status.OK
    n, unc, res = state.num_tokens[s], state.spans[s, UNCOMMITTED], state.spans[s, RESERVED]
    held = blocks_held(config, n)
    ref_count, queue = state.ref_count, state.queue
    groups = jnp.arange(g_count, dtype=jnp.int32)

    # 1. Window reclaim, measured from the committed prefix (positions from there on may still be
    # queried after a truncate).
    null_prefix = state.null_prefix
    if config.grouped:
        slots = cache_slots(config, state)
        j = jnp.arange(m, dtype=jnp.int32)
        for g, group in enumerate(config.groups):
            if group.is_full:
                continue
            lo = null_prefix[g, s]
            hi = jnp.where(valid, jnp.clip(skipped_blocks(group, n - unc, bs), lo, held), lo)
            blocks, mask = tail_first(tables[g, s][None], hi[None], valid[None], lo[None])
            ref_count, queue = release(ref_count, queue, blocks, mask, slots, target=config.target)
            tables = tables.at[g, s].set(jnp.where((j >= lo) & (j < hi), NULL_BLOCK, tables[g, s]))
            null_prefix = null_prefix.at[g, s].set(hi)

    # 2. Decide: the copy, the reserved blocks reused, the fresh blocks.
    new_held = blocks_held(config, n + k)
    status = jnp.where(valid & (new_held > m), Status.TABLE_FULL, status)
    ok = status == Status.OK
    offset = n % bs
    col_last = jnp.minimum(n // bs, m - 1)
    last = tables[groups, s, col_last]  # [G]
    cow = ok & (k > 0) & (offset > 0) & (ref_count[last] > 1)
    jj = jnp.arange(j_max, dtype=jnp.int32)
    cols = jnp.minimum(held + jj, m - 1)
    newcol = ok & (jj < new_held - held)  # [J]
    reserved = newcol & (jj < res)
    old = tables[:, s, cols]  # [G, J]
    reuse = reserved[None] & (ref_count[old] == 1)
    unshare = reserved[None] & ~reuse  # a reserved block a fork shares: drop a reference
    fresh = newcol[None] & ~reuse
    takes = jnp.concatenate([cow[:, None], fresh], axis=1)  # [G, 1 + J], taken in this order
    need = jnp.sum(takes, dtype=jnp.int32)
    starved = ok & (need > 0) & (blocked | (need > queue.num_free))
    status = jnp.where(starved, Status.NO_FREE_BLOCKS, status)
    blocked = blocked | starved
    ok = status == Status.OK
    takes, cow, reuse, unshare, newcol = takes & ok, cow & ok, reuse & ok, unshare & ok, newcol & ok
    count = jnp.where(ok, need, 0)

    # 3. Take blocks, counts, tables, lengths.
    width = g_count * (1 + j_max)
    queue, taken = free_queue.take_front(queue, count, width)
    flat = takes.reshape(-1)
    got = jnp.where(flat, taken[jnp.maximum(prefix_sum(flat) - 1, 0)], NULL_BLOCK).reshape(g_count, 1 + j_max)
    cow_dst = got[:, 0]
    new_blocks = jnp.where(reuse, old, got[:, 1:])  # [G, J]
    ref_count = ref_count.at[jnp.where(cow, last, nb)].add(-1, mode="drop")
    ref_count = ref_count.at[jnp.where(unshare, old, nb)].add(-1, mode="drop")
    ref_count = ref_count.at[jnp.where(takes, got, nb)].set(1, mode="drop")
    last_now = jnp.where(cow, cow_dst, last)
    tables = tables.at[groups, s, col_last].set(last_now)
    tables = tables.at[groups[:, None], s, jnp.where(newcol, cols, m)[None, :]].set(new_blocks, mode="drop")
    grow = jnp.where(ok, new_held - held, 0)
    spans = state.spans.at[s].set(jnp.where(ok, jnp.stack([unc + k, jnp.maximum(res - grow, 0)]), state.spans[s]))
    state = state.replace(ref_count=ref_count, queue=queue, null_prefix=null_prefix, spans=spans,
                          num_tokens=state.num_tokens.at[s].add(jnp.where(ok, k, 0)))
    if config.grouped:
        state = state.replace(block_group=state.block_group.at[jnp.where(takes, got, nb)].set(
            jnp.broadcast_to(groups[:, None], takes.shape), mode="drop"))

    # 4. Prefix cache: taken and reused blocks get new contents (they lose any hash); the copy
    # takes the last block's tokens; the span's tokens are stored with their blocks.
    i = jnp.arange(k_max, dtype=jnp.int32)
    pos = n + i
    in_span = ok & (i < k)
    pcol = jnp.clip(pos // bs, 0, m - 1)
    block_at = tables[:, s, pcol].T  # [K, G]
    if config.prefix_caching:
        cache = prefix_cache.evict(state.cache, taken, jnp.arange(width) < count, target=config.target)
        cache = prefix_cache.evict(cache, old.reshape(-1), reuse.reshape(-1), target=config.target)
        tokens = cache.tokens.at[jnp.where(cow, cow_dst, nb)].set(cache.tokens[last], mode="drop")
        if store:
            tokens = tokens.at[jnp.where(in_span[:, None], block_at, nb), (pos % bs)[:, None]].set(
                tok[:, None], mode="drop")
        state = state.replace(cache=cache.replace(tokens=tokens))
    slot_out = jnp.where(in_span[:, None], block_at * bs + (pos % bs)[:, None], NULL_BLOCK * bs)
    out = (status, slot_out, jnp.where(cow, last, NULL_BLOCK), jnp.where(cow, cow_dst, NULL_BLOCK), cow)
    return (state, tables, blocked), out


def commit(
    config: ManagerConfig,
    state: BlockManagerState,
    seq_ids: ArrayLike,
    num_tokens: ArrayLike,
    token_ids: ArrayLike | None = None,
) -> tuple[BlockManagerState, jax.Array]:
    """Commits the next ``num_tokens[b]`` uncommitted tokens of each row.

    Their ids are stored with their blocks (the K/V in their slots must be theirs), and every
    block that becomes wholly committed is registered in the prefix cache under the row's chain,
    in column order, as ``append`` registers the block a token fills (a sparse window group
    registers none, as for ``append``).

    Args:
      seq_ids: int32 ``[B]`` running rows (< 0: padding).
      num_tokens: int32 ``[B]``, ``0 <= num_tokens[b] <= min(K, num_uncommitted)``, else
        ``BAD_LENGTH``.
      token_ids: int32 ``[B, K]``: ``[b, i]`` is the token at position ``num_committed + i``
        (required with prefix caching; without it, any ``K >= 1`` works).

    Returns:
      The new state and status int32 ``[B]``.
    """
    seq_ids, b = inputs.batch_ids("commit", "seq_ids", seq_ids)
    count = jnp.asarray(inputs.int_array("commit", "num_tokens", num_tokens, ndim=1, batch=b)).astype(jnp.int32)
    token_ids = _tokens_arg("commit", token_ids, b)
    if token_ids is None:
        if config.prefix_caching:
            raise ValueError("commit: token_ids (int32 [B, K]) are required with prefix_caching=True")
        token_ids = jnp.zeros((b, 1), jnp.int32)
        count_limit = config.max_tokens_per_seq
    else:
        count_limit = token_ids.shape[1]
    return _commit(config, state, seq_ids, count, token_ids, count_limit)


def _commit(config, state, seq_ids, count, token_ids, count_limit=None, prompt_lens=None):
    k_max = token_ids.shape[1]
    count_limit = k_max if count_limit is None else count_limit
    status, sid = check_rows(config, state, seq_ids, must_be_active=True)
    bad = (count < 0) | (count > count_limit) | (count > state.spans[sid, UNCOMMITTED])
    status = jnp.where((status == Status.OK) & bad, Status.BAD_LENGTH, status).astype(jnp.int32)
    ok = status == Status.OK
    state = state.replace(spans=state.spans.at[jnp.where(ok, sid, config.max_seqs), UNCOMMITTED].add(
        -count, mode="drop"))
    if not config.prefix_caching:
        return state, status
    committed = state.num_committed[sid] - jnp.where(ok, count, 0)  # before this call
    tables = state.tables

    def row(state, x):
        return _commit_row(config, k_max, tables, state, *x), None

    xs = (ok, sid, jnp.where(ok, count, 0), committed, token_ids)
    state, _ = lax.scan(row, state, xs if prompt_lens is None else (*xs, prompt_lens))
    return state, status


def _commit_row(config: ManagerConfig, k_max: int, tables: jax.Array, state: BlockManagerState, ok: jax.Array,
                s: jax.Array, k: jax.Array, c: jax.Array, tok: jax.Array,
                prompt_len: jax.Array | None = None) -> BlockManagerState:
    """One row of ``commit`` with prefix caching: store the tokens, register the blocks that
    become wholly committed (a ``lax.scan`` over at most ``K // bs + 1`` of them: each one's
    parent class is the one the block before it just got). ``prompt_len`` (a prompt chunk's):
    a sparse window group also registers those within its reach of the prompt boundary."""
    bs, m, nb, g_count = config.block_size, config.max_blocks_per_seq, config.num_blocks, config.num_groups
    groups = jnp.arange(g_count, dtype=jnp.int32)
    i = jnp.arange(k_max, dtype=jnp.int32)
    pos = c + i
    block_at = tables[:, s, jnp.clip(pos // bs, 0, m - 1)]  # [G, K]
    mine = ok & (i < k)
    cache = state.cache
    tokens = cache.tokens.at[jnp.where(mine[None] & (block_at != NULL_BLOCK), block_at, nb),
                             (pos % bs)[None, :]].set(tok[None, :], mode="drop")
    state = state.replace(cache=cache.replace(tokens=tokens))
    first, end = c // bs, (c + k) // bs  # columns [first, end) become wholly committed
    caching = jnp.asarray(np.array([g.caches_blocks and not config.sparse(g) for g in config.groups]))
    sparse = np.array([g.caches_blocks and config.sparse(g) for g in config.groups])
    reach = jnp.asarray(np.array([g.reach_blocks(bs) for g in config.groups], np.int32))

    def fill(state, f):
        j = first + f
        on = ok & (j < end)
        col = jnp.clip(j, 0, m - 1)
        block = tables[:, s, col]  # [G]
        cache = state.cache
        chain = block_hash.extend(state.seq_chain[s], block_hash.block_contents(cache.tokens[block[0]]))
        parent = tables[:, s, jnp.clip(j - 1, 0, m - 1)]  # NULL_BLOCK (class UNLINKED) if reclaimed
        parent_class = jnp.where(j > 0, prefix_cache.class_of(cache, parent), jnp.array([NO_PARENT, 0], jnp.int32))
        chains = jnp.stack([group_chains(chain, g) for g in range(g_count)])
        mask = on & caching
        if prompt_len is not None and sparse.any():  # the prompt boundary's reach (``groups.reachable``)
            boundary = (prompt_len - 1) // bs
            mask |= on & jnp.asarray(sparse) & (j >= boundary - reach) & (j < boundary)
        cache = prefix_cache.register(cache, block, chains, jnp.broadcast_to(state.seq_salt[s], (g_count,)),
                                      parent_class, mask, count=jnp.sum(mask, dtype=jnp.int32), distinct_keys=True)
        seq_chain = state.seq_chain.at[jnp.where(on, s, config.max_seqs)].set(chain, mode="drop")
        return state.replace(cache=cache, seq_chain=seq_chain), None

    del groups
    state, _ = lax.scan(fill, state, jnp.arange(k_max // bs + 1, dtype=jnp.int32))
    return state


def truncate(
    config: ManagerConfig,
    state: BlockManagerState,
    seq_ids: ArrayLike,
    new_lens: ArrayLike,
    *,
    keep_reserved: bool,
) -> tuple[BlockManagerState, jax.Array]:
    """Rolls rows back to ``new_lens[b]`` tokens, dropping uncommitted ones.

    ``keep_reserved=True``: every block stays in the row's tables; those wholly past the new
    length become reserved room that the next ``extend`` reuses (vLLM rewinds only
    ``num_computed_tokens`` for rejected drafts). ``keep_reserved=False``: the blocks wholly past
    the new length, reserved ones included, are released tail first, group by group, each row in
    batch order (as ``free``: a block nobody else holds joins the free queue, at the front when
    it is not cached, at the back when it is (a ``fork`` sibling committed it); a shared one only
    loses a reference).

    A row can only drop uncommitted tokens: ``new_lens[b]`` below ``num_committed`` (whose
    blocks may be cached and whose chain ``seq_chain`` has passed) or above ``num_tokens`` is
    ``BAD_LENGTH``, and the row is left as it was.

    Args:
      seq_ids: int32 ``[B]`` running rows (< 0: padding).
      new_lens: int32 ``[B]``.
      keep_reserved: static.

    Returns:
      The new state and status int32 ``[B]``.
    """
    seq_ids, b = inputs.batch_ids("truncate", "seq_ids", seq_ids)
    new_lens = jnp.asarray(inputs.int_array("truncate", "new_lens", new_lens, ndim=1, batch=b)).astype(jnp.int32)
    status, sid = check_rows(config, state, seq_ids, must_be_active=True)
    n = state.num_tokens[sid]
    bad = (new_lens < state.num_committed[sid]) | (new_lens > n)
    status = jnp.where((status == Status.OK) & bad, Status.BAD_LENGTH, status).astype(jnp.int32)
    ok = status == Status.OK
    held, res = blocks_held(config, n), state.spans[sid, RESERVED]
    new_held = blocks_held(config, new_lens)
    if keep_reserved:
        new_res = res + held - new_held
    else:
        new_res = jnp.zeros_like(res)
        tables = state.tables
        slots = cache_slots(config, state)
        ref_count, queue = state.ref_count, state.queue
        end = jnp.where(ok, held + res, 0)
        for g in range(config.num_groups):
            blocks, valid = tail_first(tables[g][sid], end, ok, new_held)
            ref_count, queue = release(ref_count, queue, blocks, valid, slots, target=config.target)
        j = jnp.arange(config.max_blocks_per_seq, dtype=jnp.int32)[None, None, :]
        target = jnp.where(ok, sid, config.max_seqs)
        rows = jnp.where(j >= new_held[None, :, None], NULL_BLOCK, tables[:, sid])
        state = state.with_tables(tables.at[:, target].set(rows, mode="drop"))
        state = state.replace(ref_count=ref_count, queue=queue)
    target = jnp.where(ok, sid, config.max_seqs)
    spans = jnp.stack([new_lens - state.num_committed[sid], new_res], axis=1)
    state = state.replace(
        num_tokens=state.num_tokens.at[target].set(new_lens, mode="drop"),
        spans=state.spans.at[target].set(spans, mode="drop"),
    )
    return state, status
