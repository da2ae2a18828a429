"""KV-cache groups: one block table per group, sliding-window reclaim, and prefix hits per group,
with vLLM 0.33's hybrid rules (``KVCacheManager`` with several ``KVCacheGroupSpec``).

The operations here run when ``ManagerConfig.grouped`` holds (more than one group, or a window
group); ``admit``, ``append``, ``free``, ``fork`` and ``select`` dispatch to them, so callers keep
one API. The default single full group never reaches this module: its programs stay the ones of
``admission`` / ``allocate`` / ``reclaim`` / ``share``.

Rules (``docs/design.md``, section "KV-cache groups"):

- Every group has a table row per sequence with ``ceil(num_tokens / block_size)`` columns. A
  window group's leading columns may be ``NULL_BLOCK``: ``null_prefix[g, s]`` of them, blocks
  that left the window.
- ``append`` first reclaims, for each window group in group order, every held block whose tokens
  all lie before ``num_tokens - window + 1`` (the tokens computed before the new one): released
  tail first (``refcount.release``: back of the queue, contents and hash kept, so still a prefix
  hit until allocation takes it from the front), its entry set to ``NULL_BLOCK``. This happens
  for every running row of the call, also one that then fails for lack of blocks (as vLLM's
  ``allocate_slots`` does: the blocks are out of the window either way). Then every group takes
  a fresh block (last block full) or copies its shared, partly full last block, groups in order.
- Admission: the hit length ``h`` (blocks) is the largest ``h <= (len - 1) // block_size`` that
  every group accepts: a full group, if its verified leading run of cached blocks is ``>= h``; a
  window group, if blocks ``[max(0, h - c), h)`` are cached, ``c = max(1, cdiv(window - 1,
  block_size))`` (the fixed point of vLLM's ``HybridKVCacheCoordinator``). A window group then
  holds hit blocks ``[skip, h)`` with ``skip = max(0, h * bs - window + 1) // bs`` and
  ``NULL_BLOCK`` before; every group takes fresh blocks for ``[h, ceil(len / bs))``, group 0
  first. (A window of 1 token caches no block, as in vLLM 0.33: ``Group.caches_blocks``.)
- Retention (``ManagerConfig.prefix_cache_retention_interval``): a full group hashes every full
  block; a window group under ``0`` (sparse, the default) only the ``reach_blocks`` blocks before
  the prompt boundary and before a shared-prefix junction (``reachable``), none that ``append``
  fills; under ``None`` (dense) every full block. A block without a hash goes to the front of
  the free queue when released.
- ``free``, ``fork``, ``select`` act group by group (releases group by group, each table tail
  first), never touching a table's null prefix: forks and beams that share a reclaimed prefix
  share only its nulls.

What a hit trusts. Every hit block is checked against the request: its tokens, its salt and
its group (``block_group``). A full group also checks that each hit's parent class is the class
of the hit before it (``state.PrefixCache``), so the whole prefix is verified. A window group's
hit run starts after blocks that may be gone (reclaimed and evicted): there, what precedes the
run is trusted on the run's 64-bit chain keys, as vLLM trusts its block hashes. In a hybrid
configuration the full group's verified run covers the same ``h`` blocks of the same prompt.

Batches run one row at a time (``lax.scan`` over the rows, the row's work vectorised over its
blocks and groups), as if the rows were separate calls in batch order, with first come, first
served: once a row lacks blocks, no later row of the call takes one. In an admission, a hit on a
block that an earlier row of the same call takes fresh is reported as shared, not cached.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from paged_kv import block_hash, free_queue, hash_table, prefix_cache
from paged_kv.batch import blocks_held, check_lengths, check_rows, held_columns, refuse_spans, tail_first, take_status
from paged_kv.config import NULL_BLOCK, Group, ManagerConfig
from paged_kv.refcount import cache_slots, release
from paged_kv.results import AdmitResult, AppendResult
from paged_kv.scan import leading_count, prefix_sum
from paged_kv.state import (
    CLASS,
    CLASS_GENERATION,
    NO_PARENT,
    PARENT_CLASS,
    PARENT_CLASS_GENERATION,
    SALT,
    UNLINKED,
    BlockManagerState,
    add_stats,
)
from paged_kv.status import Status

_TWEAK = np.array([0x9E3779B9, 0x85EBCA6B], np.uint32)


def group_chains(chains: jax.Array, g: int) -> jax.Array:
    """uint32 ``[..., 2]``: the chain states under which group ``g`` caches blocks. Group 0's are
    the chains themselves (so its keys are those of a manager without groups); group ``g > 0``
    xors a per-group constant in, so each group's blocks live under keys of their own (vLLM keys
    its cache by ``(block hash, group id)``)."""
    if g == 0:
        return chains
    with np.errstate(over="ignore"):
        tweak = (_TWEAK * np.uint32(g)).astype(np.uint32)
    return chains ^ jnp.asarray(tweak)


def skipped_blocks(group: Group, computed: jax.Array, block_size: int) -> jax.Array:
    """int32 ``[...]``: leading blocks of a table that no query after ``computed`` (int32
    ``[...]``) tokens reads (``group.spec.skipped_blocks``: a window's before ``computed - window
    + 1``, a chunk's before the current chunk); 0 for a full group."""
    if group.is_full:
        return jnp.zeros_like(computed)
    return jnp.asarray(group.spec.skipped_blocks(computed, block_size), jnp.int32)


def _salt_bits(salt: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(salt.astype(jnp.uint32), jnp.int32)


# -- free, fork, select ----------------------------------------------------------------------


def free(config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array
         ) -> tuple[BlockManagerState, jax.Array]:
    """``reclaim.free`` with groups: per group (in order), the rows' held blocks (past the null
    prefix) are released, row by row, each tail first. Returns the state and int32 ``[B]``
    statuses."""
    status, sid = check_rows(config, state, seq_ids, must_be_active=True)
    ok = status == Status.OK
    held = jnp.where(ok, held_columns(config, state, sid), 0)
    tables = state.tables
    slots = cache_slots(config, state)
    # One release over the [G, B] rows flattened group-major, a run per group (as one release
    # per group, vLLM's one ``free_blocks`` per group): group by group, row by row, tail first.
    g_count, b = config.num_groups, sid.shape[0]
    blocks, valid = tail_first(tables[:, sid].reshape(g_count * b, -1), jnp.tile(held, g_count),
                               jnp.tile(ok, g_count), state.null_prefix[:, sid].reshape(-1))
    ref_count, queue = release(state.ref_count, state.queue, blocks, valid, slots, target=config.target,
                               runs=g_count)
    target = jnp.where(ok, sid, config.max_seqs)
    state = state.with_tables(tables.at[:, target].set(NULL_BLOCK, mode="drop"))
    state = state.replace(
        ref_count=ref_count,
        queue=queue,
        null_prefix=state.null_prefix.at[:, target].set(0, mode="drop"),
        num_tokens=state.num_tokens.at[target].set(0, mode="drop"),
        active=state.active.at[target].set(False, mode="drop"),
        spans=state.spans.at[target].set(0, mode="drop"),
    )
    return state, status


def take_tables(config: ManagerConfig, state: BlockManagerState, dst_ids: jax.Array,
                src_ids: jax.Array, *, dst_must_be_free: bool) -> tuple[BlockManagerState, jax.Array]:
    """``share.fork`` / ``share.select`` with groups: every destination takes every group's
    table and null prefix of its source, read before the call. Counts rise for all groups first;
    then (select) each group's old destination tables are released, group by group. Returns
    the state and int32 ``[B]`` statuses."""
    s, n, m = config.max_seqs, config.num_blocks, config.max_blocks_per_seq
    dst, src, status = take_status(config, state, dst_ids, src_ids, dst_must_be_free)
    ok = status == Status.OK

    tables = state.tables
    src_tokens = state.num_tokens[src]
    src_held = jnp.where(ok, blocks_held(config, src_tokens), 0)
    j = jnp.arange(m, dtype=jnp.int32)[None, None, :]
    # A source's reserved blocks (``spans``) stay its own: a destination takes its tokens' blocks.
    src_rows = jnp.where(j < blocks_held(config, src_tokens)[None, :, None], tables[:, src], NULL_BLOCK)
    src_null = state.null_prefix[:, src]  # [G, B]
    dropping = ok & state.active[dst]
    dst_rows, dst_null = tables[:, dst], state.null_prefix[:, dst]
    dst_held = jnp.where(dropping, held_columns(config, state, dst), 0)
    slots = cache_slots(config, state)

    gained = (j >= src_null[..., None]) & (j < src_held[None, :, None])
    ref_count = state.ref_count.at[jnp.where(gained, src_rows, n)].add(1, mode="drop")
    queue = state.queue
    if not dst_must_be_free:  # one release, a run per group, row by row, each tail first (``free``)
        g_count, b = config.num_groups, dst.shape[0]
        blocks, valid = tail_first(dst_rows.reshape(g_count * b, m), jnp.tile(dst_held, g_count),
                                   jnp.tile(dropping, g_count), dst_null.reshape(-1))
        ref_count, queue = release(ref_count, queue, blocks, valid, slots, target=config.target, runs=g_count)

    target = jnp.where(ok, dst, s)
    state = state.with_tables(tables.at[:, target].set(src_rows, mode="drop"))
    state = state.replace(
        ref_count=ref_count,
        queue=queue,
        null_prefix=state.null_prefix.at[:, target].set(src_null, mode="drop"),
        num_tokens=state.num_tokens.at[target].set(src_tokens, mode="drop"),
        active=state.active.at[target].set(True, mode="drop"),
        seq_chain=state.seq_chain.at[target].set(state.seq_chain[src], mode="drop"),
        seq_salt=state.seq_salt.at[target].set(state.seq_salt[src], mode="drop"),
        spans=state.spans.at[target].set(0, mode="drop"),
    )
    return state, status


# -- append ----------------------------------------------------------------------------------


def append(config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array,
           token_ids: jax.Array | None) -> tuple[BlockManagerState, AppendResult]:
    """``allocate.append`` with groups (checked inputs: int32 ``[B]`` ids, tokens or None).

    Returns the state and an ``allocate.AppendResult`` whose ``slots``, ``copy_src`` and
    ``copy_dst`` are int32 ``[B, G]`` (one slot and one copy-list entry per group)."""
    status0, sid = check_rows(config, state, seq_ids, must_be_active=True)
    status0 = refuse_spans(state, status0, sid)
    tokens = jnp.zeros_like(sid) if token_ids is None else token_ids.astype(jnp.int32)
    tables = state.tables

    def row(carry, x):
        return _append_row(config, *carry, *x)

    (state, tables, _), out = lax.scan(row, (state, tables, jnp.bool_(False)), (status0, sid, tokens))
    status, slots, src, dst, copies = out
    result = AppendResult(status=status, slots=slots, copy_src=src, copy_dst=dst,
                          num_copies=jnp.sum(copies, dtype=jnp.int32))
    return state.with_tables(tables), result


def _append_row(config: ManagerConfig, state: BlockManagerState, tables: jax.Array, blocked: jax.Array,
                status: jax.Array, s: jax.Array, token: jax.Array):
    """One row of ``append``: ``((state, tables [G, S, M], blocked), (status, slots [G],
    copy_src [G], copy_dst [G], copies bool [G]))``."""
    bs, m, n_blocks = config.block_size, config.max_blocks_per_seq, config.num_blocks
    g_count = config.num_groups
    valid = status == Status.OK
    n = state.num_tokens[s]
    held = blocks_held(config, n)
    j = jnp.arange(m, dtype=jnp.int32)
    ref_count, queue, null_prefix = state.ref_count, state.queue, state.null_prefix

    # 1. Reclaim what left each local group's reach (computed = the n tokens held): one release
    # over the local groups' rows, a run per group, each tail first.
    local = np.array([g for g, group in enumerate(config.groups) if not group.is_full], np.int32)
    if local.size:
        slots = cache_slots(config, state)
        lo = null_prefix[local, s]  # [L]
        skipped = jnp.stack([skipped_blocks(config.groups[g], n, bs) for g in local])
        hi = jnp.where(valid, jnp.clip(skipped, lo, held), lo)
        rows = tables[local, s]  # [L, M]
        blocks, mask = tail_first(rows, hi, jnp.broadcast_to(valid, lo.shape), lo)
        ref_count, queue = release(ref_count, queue, blocks, mask, slots, target=config.target, runs=local.size)
        gone = (j[None] >= lo[:, None]) & (j[None] < hi[:, None])
        tables = tables.at[local, s].set(jnp.where(gone, NULL_BLOCK, rows))
        null_prefix = null_prefix.at[local, s].set(hi)

    # 2. Decide: a fresh block per group, or a copy of each shared, partly full last block.
    col, offset = n // bs, n % bs
    needs_fresh = valid & (offset == 0)
    table_full = needs_fresh & (col >= m)
    status = jnp.where(table_full, Status.TABLE_FULL, status)
    needs_fresh = needs_fresh & ~table_full
    col = jnp.minimum(col, m - 1)
    groups = jnp.arange(g_count, dtype=jnp.int32)
    last = tables[groups, s, col]  # [G]
    shared = valid & (offset > 0) & (ref_count[last] > 1)
    takes = needs_fresh | shared
    need = jnp.sum(takes, dtype=jnp.int32)
    starved = (need > 0) & (blocked | (need > queue.num_free))
    status = jnp.where(starved, Status.NO_FREE_BLOCKS, status)
    blocked = blocked | starved
    ok = status == Status.OK
    takes, copies = takes & ok, shared & ok
    count = jnp.sum(takes, dtype=jnp.int32)

    # 3. Take blocks (group order), counts, tables.
    queue, taken = free_queue.take_front(queue, count, g_count)
    fresh = jnp.where(takes, taken[jnp.maximum(prefix_sum(takes) - 1, 0)], NULL_BLOCK)
    block = jnp.where(takes, fresh, last)
    slot_out = jnp.where(ok, block * bs + offset, NULL_BLOCK * bs)
    ref_count = ref_count.at[jnp.where(copies, last, n_blocks)].add(-1, mode="drop")
    ref_count = ref_count.at[jnp.where(takes, fresh, n_blocks)].set(1, mode="drop")
    tables = tables.at[groups, s, col].set(block)
    block_group = state.block_group.at[jnp.where(takes, fresh, n_blocks)].set(groups, mode="drop")
    state = state.replace(
        ref_count=ref_count, queue=queue, null_prefix=null_prefix, block_group=block_group,
        num_tokens=state.num_tokens.at[s].add(ok.astype(jnp.int32)),
    )

    # 4. Prefix cache: evict taken blocks, store the token, cache the blocks it fills.
    if config.prefix_caching:
        cache = prefix_cache.evict(state.cache, taken, groups < count, target=config.target)
        tok = cache.tokens.at[jnp.where(copies, fresh, n_blocks)].set(cache.tokens[last], mode="drop")
        tok = tok.at[jnp.where(ok, block, n_blocks), offset].set(token, mode="drop")
        fills = ok & (offset == bs - 1)
        chain = block_hash.extend(state.seq_chain[s], block_hash.block_contents(tok[block[0]]))
        parent = tables[groups, s, jnp.maximum(col - 1, 0)]  # NULL_BLOCK (class UNLINKED) if reclaimed
        parent_class = jnp.where(col > 0, prefix_cache.class_of(cache, parent),
                                 jnp.array([NO_PARENT, 0], jnp.int32))
        chains = jnp.stack([group_chains(chain, g) for g in range(g_count)])
        # A block an append fills lies past the prompt boundary: a sparse window group never
        # reaches it (``reachable``).
        caching = np.array([group.caches_blocks and not config.sparse(group) for group in config.groups])
        cache = prefix_cache.register(
            cache.replace(tokens=tok), block, chains, jnp.broadcast_to(state.seq_salt[s], (g_count,)),
            parent_class, fills & jnp.asarray(caching),
            count=jnp.where(fills, int(caching.sum()), 0).astype(jnp.int32), distinct_keys=True,
        )
        seq_chain = state.seq_chain.at[jnp.where(fills, s, config.max_seqs)].set(chain, mode="drop")
        state = state.replace(cache=cache, seq_chain=seq_chain)
    out = (status, slot_out, jnp.where(copies, last, NULL_BLOCK), jnp.where(copies, fresh, NULL_BLOCK), copies)
    return (state, tables, blocked), out


# -- admit -----------------------------------------------------------------------------------


def admit(config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array, prompt_lens: jax.Array,
          prompt_tokens: jax.Array | None, salts: jax.Array | None, chunk: jax.Array | None = None
          ) -> tuple[BlockManagerState, AdmitResult]:
    """``admission.admit`` with groups (checked inputs; ``prompt_tokens`` int32 ``[B, L]`` and
    ``salts`` uint32 ``[B]`` required with prefix caching; ``chunk`` int32 ``[B]`` or None: a
    row takes blocks for ``min(len, (h * block_size // chunk + 1) * chunk)`` tokens). Returns the state and an
    ``admission.AdmitResult``."""
    bs = config.block_size
    b = seq_ids.shape[0]
    if salts is None:
        salts = jnp.zeros((b,), jnp.uint32)
    salts = salts.astype(jnp.uint32)
    if config.prefix_caching:
        length = prompt_tokens.shape[1]
        c = -(-length // bs)
        tokens = jnp.pad(prompt_tokens.astype(jnp.int32), ((0, 0), (0, c * bs - length)))
        chains = block_hash.chain_states(salts, tokens, bs)  # [B, C, 2]
    else:  # tokens unused: placeholders as wide as any prompt
        length, c = config.max_tokens_per_seq, config.max_blocks_per_seq
        tokens = jnp.zeros((b, c * bs), jnp.int32)
        chains = jnp.zeros((b, c, 2), jnp.uint32)
    status0, sid, lens = check_lengths(config, state, seq_ids, prompt_lens, length)
    xs = (status0, sid, lens, tokens.reshape(b, c, bs), salts, chains)
    if chunk is not None:  # a scan input only when given: the default program stays as it was
        chunk = jnp.asarray(chunk).astype(jnp.int32)
        xs = (jnp.where((status0 == Status.OK) & (chunk < 1), Status.BAD_LENGTH, status0), *xs[1:], chunk)
    tables = state.tables
    pending = jnp.zeros((config.num_blocks,), bool)

    def row(carry, x):
        return _admit_row(config, c, *carry, *x)

    carry = (state, tables, jnp.bool_(False), pending)
    (state, tables, _, _), (status, cached, shared) = lax.scan(row, carry, xs)
    return state.with_tables(tables), AdmitResult(status=status, cached_tokens=cached, shared_tokens=shared)


def _hit_length(config: ManagerConfig, state: BlockManagerState, c: int, ok0: jax.Array, n_cacheable: jax.Array,
                block_tokens: jax.Array, salt: jax.Array, chains: jax.Array):
    """The hybrid hit of one prompt: ``(h, lead, cands int32 [G, C], verified bool [G, C],
    hit_class int32 [G, C, 2])``: ``h`` (int32) the largest block count every group accepts;
    ``lead`` (int32, ``>= h``) the largest that the lead groups accept (``ManagerConfig.lead_groups``:
    vLLM's ``longest_hit_length``, where a sparse window group's shared-prefix junction lies);
    ``verified``: a full group's verified leading run of cached blocks (which may be longer than
    ``h``), a window group's blocks that hold the prompt's tokens and salt."""

    cache = state.cache
    g_count = config.num_groups
    j = jnp.arange(c, dtype=jnp.int32)
    hh = jnp.arange(c + 1, dtype=jnp.int32)
    cacheable = ok0 & (j < n_cacheable)
    within = hh <= jnp.where(ok0, n_cacheable, 0)
    # Every group's candidates in one lookup and one gather of each per-block fact: [G, C].
    keys = block_hash.key_of(jnp.stack([group_chains(chains, g) for g in range(g_count)]))
    cands = hash_table.lookup(cache.table, keys.reshape(g_count * c, 2), jnp.tile(cacheable, g_count))
    cands = cands.reshape(g_count, c)
    cc = jnp.maximum(cands, 0)
    meta = cache.meta[cc]  # [G, C, META_COLUMNS]
    good = (
        cacheable & (cands >= 0) & (meta[..., SALT] == _salt_bits(salt))
        & (state.block_group[cc] == jnp.arange(g_count, dtype=jnp.int32)[:, None])
        & jnp.all(cache.tokens[cc] == block_tokens, axis=-1)
    )
    classes = meta[..., CLASS:CLASS_GENERATION + 1]  # [G, C, 2]
    accepts, verified = [], []
    root = jnp.array([[NO_PARENT, 0]], jnp.int32)
    for g, group in enumerate(config.groups):
        if not group.is_full:
            # All of blocks [hit_start(h), h) cached (a window's last max(1, c_g), a chunk's
            # current chunk); the prefix before is trusted on the keys.
            counts = jnp.concatenate([jnp.zeros((1,), jnp.int32), prefix_sum(good[g])])
            lo = group.hit_start(hh, config.block_size)
            accepts.append(within & ((counts[hh] - counts[lo]) == (hh - lo)))
            verified.append(good[g])
        else:
            prev = jnp.concatenate([root, classes[g, :-1]], axis=0)
            run = good[g] & jnp.all(meta[g, :, PARENT_CLASS:PARENT_CLASS_GENERATION + 1] == prev, axis=-1)
            accepts.append(within & (hh <= leading_count(run)))
            verified.append(run)
    accepts = jnp.stack(accepts)  # [G, C + 1]
    h = jnp.max(jnp.where(jnp.all(accepts, axis=0), hh, 0))
    lead = jnp.max(jnp.where(jnp.all(accepts[np.array(config.lead_groups)], axis=0), hh, 0))
    return h, lead, cands, jnp.stack(verified), classes


def reachable(config: ManagerConfig, group: Group, j: jax.Array, n_prompt: jax.Array, h: jax.Array,
              lead: jax.Array) -> jax.Array:
    """bool ``[C]``: which positions ``j`` (int32 ``[C]``) of a prompt of ``n_prompt`` tokens,
    admitted with hit ``h`` and lead hit ``lead`` (int32 scalars), a sparse window ``group``
    (``ManagerConfig.sparse``) hashes when full: the ``reach_blocks``
    positions before the prompt boundary ``(n_prompt - 1) // bs`` and before the shared-prefix
    junction ``lead`` when ``lead > h`` (vLLM's ``SlidingWindowManager.reachable_block_mask``
    for ``prefix_cache_retention_interval == 0``). Plain-Python form:
    ``GroupedReference._caches``."""
    need = group.reach_blocks(config.block_size)
    end = (n_prompt - 1) // config.block_size
    return ((j >= end - need) & (j < end)) | ((lead > h) & (j >= lead - need) & (j < lead))


def _joined_classes(cache: prefix_cache.PrefixCache, g: int, h: jax.Array, chains: jax.Array,
                    block_tokens: jax.Array, salt: jax.Array, block_group: jax.Array, block_class: jax.Array,
                    registered: jax.Array) -> jax.Array:
    """int32 ``[C, 2]``: ``block_class`` (one full group's, hits then fresh blocks' own) with the
    fresh blocks that ``register`` will put into an existing class given that class.

    Read after this row's evictions, as ``register`` sees the cache: from position ``h`` on, the
    run of fresh blocks (``registered``, bool ``[C]``) whose key's oldest cached block holds the
    same tokens and salt, is of group ``g`` and records as parent the class of the block before
    (the hit at ``h - 1``, or the block of the run before it) joins those blocks' classes. The
    run stops at the first other block: the next one records that block's own class, which no
    older block has, so it cannot join."""
    c = block_class.shape[0]
    j = jnp.arange(c, dtype=jnp.int32)
    keys = block_hash.key_of(group_chains(chains, g))
    cand = hash_table.lookup(cache.table, keys, registered)
    cc = jnp.maximum(cand, 0)
    meta = cache.meta[cc]
    klass = meta[:, CLASS:CLASS_GENERATION + 1]
    before_h = jnp.where(h > 0, block_class[jnp.maximum(h - 1, 0)], jnp.array([NO_PARENT, 0], jnp.int32))
    expected = jnp.where((j == h)[:, None], before_h[None, :], jnp.concatenate([klass[:1], klass[:-1]], axis=0))
    joins = (
        registered & (cand >= 0) & (block_group[cc] == g) & (meta[:, SALT] == _salt_bits(salt))
        & jnp.all(cache.tokens[cc] == block_tokens, axis=-1)
        & jnp.all(meta[:, PARENT_CLASS:PARENT_CLASS_GENERATION + 1] == expected, axis=-1)
    )
    run = leading_count(joins | (j < h))
    return jnp.where(((j >= h) & (j < run))[:, None], klass, block_class)


def _admit_row(config: ManagerConfig, c: int, state: BlockManagerState, tables: jax.Array, blocked: jax.Array,
               pending: jax.Array, status: jax.Array, s: jax.Array, length: jax.Array, block_tokens: jax.Array,
               salt: jax.Array, chains: jax.Array, chunk: jax.Array | None = None):
    """One row of ``admit``: ``((state, tables, blocked, pending), (status, cached_tokens,
    shared_tokens))``; ``pending`` (bool ``[num_blocks]``) marks the blocks rows of this call
    took fresh. The hit is looked up over the prompt's ``length`` tokens; the row then holds
    ``min(length, (h * bs // chunk + 1) * chunk)`` of them, to the end of the chunk its first
    uncomputed token lies in (``held``; all without ``chunk``)."""
    bs, n, m = config.block_size, config.num_blocks, config.max_blocks_per_seq
    g_count = config.num_groups
    ok0 = status == Status.OK
    j = jnp.arange(c, dtype=jnp.int32)
    n_cacheable = (length - 1) // bs
    if config.prefix_caching:
        h, lead, cands, verified, classes = _hit_length(
            config, state, c, ok0, n_cacheable, block_tokens, salt, chains)
    else:
        h = jnp.int32(0)
        cands = jnp.full((g_count, c), -1, jnp.int32)
    held = length if chunk is None else jnp.minimum(length, (h * bs // jnp.maximum(chunk, 1) + 1) * chunk)
    n_blocks = jnp.where(ok0, (held + bs - 1) // bs, 0)
    n_full = held // bs
    cc = jnp.maximum(cands, 0)
    skip = jnp.stack([skipped_blocks(group, h * bs, bs) for group in config.groups])  # [G]
    hit = (j[None] >= skip[:, None]) & (j[None] < h)  # [G, C] hit blocks the row holds
    pulls = hit & (state.ref_count[cc] == 0)
    n_fresh = n_blocks - h
    cost = g_count * n_fresh + jnp.sum(pulls, dtype=jnp.int32)
    starved = ok0 & (blocked | (cost > state.queue.num_free))
    status = jnp.where(starved, Status.NO_FREE_BLOCKS, status)
    blocked = blocked | starved
    ok = status == Status.OK
    h, n_fresh = jnp.where(ok, h, 0), jnp.where(ok, n_fresh, 0)
    hit, pulls = hit & ok, pulls & ok

    queue = free_queue.remove(state.queue, cc.reshape(-1), pulls.reshape(-1))
    count = g_count * n_fresh
    queue, taken = free_queue.take_front(queue, count, g_count * c)
    groups = jnp.arange(g_count, dtype=jnp.int32)[:, None]
    fresh_at = jnp.clip(groups * n_fresh + j[None] - h, 0, g_count * c - 1)
    fresh = ok & (j[None] >= h) & (j[None] < n_blocks)  # [G, C]
    block = jnp.where(fresh, taken[fresh_at], jnp.where(hit, cands, NULL_BLOCK))
    in_table = fresh | hit
    ref_count = state.ref_count.at[jnp.where(in_table, block, n)].add(1, mode="drop")
    block_group = state.block_group.at[jnp.where(fresh, block, n)].set(
        jnp.broadcast_to(groups, (g_count, c)), mode="drop")

    # Cached vs shared: a hit on a block an earlier row of this call took fresh is shared.
    pend = hit & pending[cc]
    first_pend = jnp.where(jnp.any(pend, axis=1), jnp.argmax(pend, axis=1).astype(jnp.int32), h)
    n_cached = jnp.min(first_pend)
    pending = pending.at[jnp.where(fresh, block, n)].set(True, mode="drop")

    state = state.replace(ref_count=ref_count, queue=queue, block_group=block_group)
    target = jnp.where(ok, s, config.max_seqs)
    if config.prefix_caching:
        cache = prefix_cache.evict(state.cache, taken, jnp.arange(g_count * c) < count, target=config.target)
        cache = cache.replace(tokens=cache.tokens.at[jnp.where(fresh, block, n).reshape(-1)].set(
            jnp.broadcast_to(block_tokens, (g_count, c, bs)).reshape(-1, bs), mode="drop"))
        unlinked = jnp.array([UNLINKED, 0], jnp.int32)
        root = jnp.broadcast_to(jnp.array([NO_PARENT, 0], jnp.int32), (g_count, 1, 2))
        own = prefix_cache.own_class(cache, block)
        # A block's class, which the block after it records as its parent class: a hit's own
        # (a window group's unverified hit: UNLINKED; its parent classes are never checked),
        # a fresh block's own, or, in a full group, the class of the older block with its
        # prefix that it joins (``register``): any fresh block may hold a cached prefix, as the
        # hybrid hit can stop short of the group's own run.
        hit_class = jnp.where(verified[..., None], classes, unlinked)
        block_class = jnp.where((j[None] < h)[..., None], hit_class, own)
        registered = fresh & (j[None] < n_full)
        for g, group in enumerate(config.groups):
            if group.is_full:
                block_class = block_class.at[g].set(_joined_classes(
                    cache, g, h, chains, block_tokens, salt, state.block_group, block_class[g], registered[g]))
        parent_class = jnp.concatenate([root, block_class[:, :-1]], axis=1)
        # One registration for every caching group's fresh full blocks, group-major: the groups'
        # keys differ (``group_chains``), so no entry's key is another's, in any group.
        caching = [g for g, group in enumerate(config.groups) if group.caches_blocks]
        if caching:
            masks, count = [], jnp.int32(0)
            for g in caching:
                caches = fresh[g] & (j < n_full)
                if config.sparse(config.groups[g]):
                    caches &= reachable(config, config.groups[g], j, length, h, lead)
                    count += jnp.sum(caches, dtype=jnp.int32)
                else:
                    count += jnp.where(ok, jnp.maximum(n_full - h, 0), 0)
                masks.append(caches)
            k = len(caching)
            rows = np.array(caching)
            cache = prefix_cache.register(
                cache, block[rows].reshape(k * c),
                jnp.stack([group_chains(chains, g) for g in caching]).reshape(k * c, 2),
                jnp.broadcast_to(salt, (k * c,)), parent_class[rows].reshape(k * c, 2),
                jnp.stack(masks).reshape(k * c), count=count,
                # Any fresh block may equal an older cached one: the hybrid hit can stop short of
                # a group's own cached run (another group missed), unlike one group's admission.
                distinct_keys=True,
            )
        cache = cache.replace(stats=add_stats(
            cache.stats, lookups=ok.astype(jnp.int32), query_tokens=jnp.where(ok, length, 0),
            hit_tokens=h * bs,
        ))
        last_full = chains[jnp.maximum(n_full - 1, 0)]
        chain = jnp.where(n_full > 0, last_full, block_hash.root_state(salt))
        state = state.replace(
            cache=cache,
            seq_chain=state.seq_chain.at[target].set(chain, mode="drop"),
            seq_salt=state.seq_salt.at[target].set(salt, mode="drop"),
        )
    rows = jnp.pad(jnp.where(in_table, block, NULL_BLOCK), ((0, 0), (0, m - c)))
    tables = tables.at[:, target].set(rows, mode="drop")
    state = state.replace(
        null_prefix=state.null_prefix.at[:, target].set(jnp.where(ok, skip, 0), mode="drop"),
        num_tokens=state.num_tokens.at[target].set(held, mode="drop"),
        active=state.active.at[target].set(True, mode="drop"),
    )
    n_cached = jnp.where(ok, n_cached, 0)
    return (state, tables, blocked, pending), (status, n_cached * bs, (h - n_cached) * bs)
