"""Admission: blocks for new prompts, reusing cached prefix blocks when prefix caching is on.

A request's prompt gets ``ceil(len / block_size)`` table entries. With prefix caching, the longest
prefix of full blocks found in the cache is reused (count + 1; a hit on a free block pulls it out of
the free queue), then the longest further prefix that an earlier request of the same call is about
to compute, and only the rest is allocated. The block holding the last prompt token is never taken
from the cache: that token must be computed for its logits.

Semantics of one call, which the reference manager implements row by row:
1. Every request looks up the cache as it was when the call started, plus the full blocks that
   earlier requests of the call will own.
2. Requests are served first come, first served: a request whose fresh blocks plus pulled free
   hits do not fit fails with ``NO_FREE_BLOCKS`` and so does every later one.
3. Hit blocks leave the free queue before fresh blocks are taken from its front (so a request
   never evicts a block the same call reuses); taken blocks that were cached lose their hash.
4. Fresh full blocks are cached, in batch order, duplicates of cached blocks too (a lookup
   finds the oldest block of a key; see ``state.PrefixCache`` for how hits are verified).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from paged_kv import block_hash, free_queue, groups, hash_table, inputs, prefix_cache
from paged_kv.batch import check_lengths, first_come_first_served, start_rows
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.results import AdmitResult
from paged_kv.scan import leading_count, prefix_sum
from paged_kv.state import (
    CLASS,
    CLASS_GENERATION,
    NO_PARENT,
    PARENT_CLASS,
    PARENT_CLASS_GENERATION,
    SALT,
    BlockManagerState,
    add_stats,
)
from paged_kv.status import Status


def admit(
    config: ManagerConfig,
    state: BlockManagerState,
    seq_ids: jax.Array,
    prompt_lens: jax.Array,
    prompt_tokens: jax.Array | None = None,
    salts: jax.Array | None = None,
    *,
    chunk: jax.Array | None = None,
) -> tuple[BlockManagerState, AdmitResult]:
    """Starts sequences with their prompts.

    Chunked admission (``chunk`` given): the prefix cache is looked up over the whole prompt, but
    a row takes blocks only for its hit and the rest of the chunk that holds its first uncomputed
    token, the prompt being cut at the multiples of ``chunk[b]`` (the serving engine's prefill
    pieces): ``min(len, (hit // chunk + 1) * chunk)`` tokens, ``hit`` in tokens (vLLM's
    scheduler also allocates a prefill chunk at a time). The rest of the prompt then comes chunk
    by chunk through ``spans.extend(..., commit=True)``, whose window reclaim keeps a window group
    at a window's worth of blocks. Implemented for grouped configurations
    (``ManagerConfig.grouped``) and without prefix caching.

    Args:
      seq_ids: int32 ``[B]`` free rows to start (< 0: padding).
      prompt_lens: int32 ``[B]`` prompt lengths; every prompt token gets a KV slot now.
      prompt_tokens: int32 ``[B, L]`` prompt token ids, padded (needed with prefix caching;
        ``L <= max_tokens_per_seq``, and each length must be ``<= L``).
      salts: uint32/int32 ``[B]`` cache salts: requests share cached blocks only with equal salts
        (default all 0).
      chunk: int32 ``[B]``, optional: the prefill chunk (``>= 1``, else ``BAD_LENGTH``); a row
        then holds ``num_tokens = min(len, (hit // chunk + 1) * chunk)`` tokens, all committed.
        None: the whole prompt.

    Returns:
      The new state and an ``AdmitResult``.
    """
    seq_ids, b = inputs.batch_ids("admit", "seq_ids", seq_ids)
    prompt_lens = inputs.int_array("admit", "prompt_lens", prompt_lens, ndim=1, batch=b)
    if prompt_tokens is not None:
        prompt_tokens = inputs.int_array("admit", "prompt_tokens", prompt_tokens, ndim=2, batch=b)
    if salts is not None:
        salts = inputs.int_array("admit", "salts", salts, ndim=1, batch=b, unsigned_ok=True)
    if chunk is not None:
        chunk = inputs.int_array("admit", "chunk", chunk, ndim=1, batch=b)
        if config.prefix_caching and not config.grouped:
            raise ValueError("admit: chunk is implemented for grouped configurations (ManagerConfig.grouped) "
                             "and without prefix caching; this configuration has one full group with prefix "
                             "caching")
    if config.grouped and not config.prefix_caching:
        return groups.admit(config, state, seq_ids, prompt_lens, None, salts, chunk)
    if not config.prefix_caching:
        state, status = _admit_fresh(config, state, seq_ids, prompt_lens, chunk)
        zero = jnp.zeros_like(status)
        return state, AdmitResult(status=status, cached_tokens=zero, shared_tokens=zero)
    if prompt_tokens is None:
        raise ValueError("admit: prompt_tokens (int32 [B, L]) are required with prefix_caching=True")
    if prompt_tokens.ndim != 2 or prompt_tokens.shape[0] != seq_ids.shape[0]:
        raise ValueError(
            f"admit: prompt_tokens must be [B, L] with B={seq_ids.shape[0]}, got {prompt_tokens.shape}"
        )
    if prompt_tokens.shape[1] > config.max_tokens_per_seq:
        raise ValueError(
            f"admit: prompt_tokens has {prompt_tokens.shape[1]} columns; a sequence holds at most "
            f"{config.max_tokens_per_seq} tokens"
        )
    if salts is None:
        salts = jnp.zeros(seq_ids.shape, jnp.uint32)
    if config.grouped:
        return groups.admit(config, state, seq_ids, prompt_lens, prompt_tokens, salts, chunk)
    return _admit_cached(config, state, seq_ids, prompt_lens, prompt_tokens, salts)


def _admit_fresh(config, state, seq_ids, prompt_lens, chunk=None):
    """Admission without the cache: every block fresh from the queue front (with ``chunk``, for
    the first ``min(len, chunk)`` tokens)."""
    bs, m = config.block_size, config.max_blocks_per_seq
    status, sid, lens = check_lengths(config, state, seq_ids, prompt_lens, config.max_tokens_per_seq)
    if chunk is not None:
        chunk = jnp.asarray(chunk).astype(jnp.int32)
        status = jnp.where((status == Status.OK) & (chunk < 1), Status.BAD_LENGTH, status)
        lens = jnp.minimum(lens, jnp.maximum(chunk, 1))  # no hit: the first chunk
    need = jnp.where(status == Status.OK, (lens + bs - 1) // bs, 0)
    fits = first_come_first_served(need, state.queue.num_free)
    status = jnp.where((status == Status.OK) & ~fits, Status.NO_FREE_BLOCKS, status)
    ok = status == Status.OK
    need = jnp.where(ok, need, 0)

    b = seq_ids.shape[0]
    queue, taken = free_queue.take_front(state.queue, jnp.sum(need), b * m)
    # Row i's blocks are taken[start_i : start_i + need_i].
    start = prefix_sum(need) - need
    j = jnp.arange(m, dtype=jnp.int32)[None, :]
    has = j < need[:, None]
    rows = jnp.where(has, taken[jnp.where(has, start[:, None] + j, 0)], NULL_BLOCK)

    target = jnp.where(ok, sid, config.max_seqs)
    n = config.num_blocks
    state = state.replace(queue=queue, ref_count=state.ref_count.at[jnp.where(has, rows, n)].set(1, mode="drop"))
    return start_rows(state, target, rows, lens), status


def _representatives(keys: jax.Array, member: jax.Array) -> jax.Array:
    """int32 ``[E]``: for each member entry, the first member entry (in index order) with the same
    key (non-members: anything; callers mask them).

    Small calls (``E <= PAIRWISE_MAX``, e.g. one request) compare all pairs; large ones group the
    keys through a scratch open-addressing table (``hash_table.first_of_keys``), O(E) expected
    instead of the O(E log E) sort, which on XLA:CPU was most of a 256-request admission.
    """
    e = member.shape[0]
    if e <= PAIRWISE_MAX:
        same = member[None, :] & jnp.all(keys[:, None, :] == keys[None, :, :], axis=-1)
        return jnp.argmax(same, axis=1).astype(jnp.int32)  # the first True; i itself if member
    return hash_table.first_of_keys(keys, member)


PAIRWISE_MAX = 512
"""Up to this many table entries per call, entries are grouped by an ``[E, E]`` comparison."""


def _first_claims(ids: jax.Array, mask: jax.Array) -> jax.Array:
    """bool ``[E]``: the masked entries that are the first (lowest index) to name their block.

    ``ids[mask]`` are free blocks (count 0); several requests of one call may hit the same one,
    and only the first pulls it out of the free queue. Grouped like keys (``_representatives``),
    never through the pool-sized reference counts: stamps scattered into those made XLA:CPU copy
    the whole array two or three times per call."""
    keys = jnp.stack([ids.astype(jnp.uint32), jnp.zeros_like(ids, jnp.uint32)], axis=1)
    return mask & (_representatives(keys, mask) == jnp.arange(ids.shape[0], dtype=jnp.int32))


def _shared_with_earlier(n, keys, block_tokens, salts, ok0, n_full, cacheable, cand, n_cached):
    """Step 2 of a call of several requests: after its cached prefix, the longest further prefix
    of a request's blocks that an earlier request of the call computes.

    Args (B requests, C blocks each): n, the pool size; keys uint32 ``[B, C, 2]``; block_tokens
    int32 ``[B, C, block_size]``; salts uint32 ``[B]``; ok0 bool ``[B]``; n_full int32 ``[B]``;
    cacheable bool ``[B, C]``; cand int32 ``[B, C]`` the cached candidates; n_cached int32
    ``[B]`` the length of each request's verified cached prefix.

    Returns int32 ``[B]`` hit blocks (cached, then shared) per request, and int32 ``[B, C]`` the
    flat entry each block is shared from (``rep``, meaningful where shared).
    """
    b, c, bs = block_tokens.shape
    e = b * c
    j = jnp.arange(c, dtype=jnp.int32)[None, :]
    flat = jnp.arange(e, dtype=jnp.int32).reshape(b, c)
    cached_hit = j < n_cached[:, None]
    owns_full = ok0[:, None] & (j < n_full[:, None]) & ~cached_hit
    rep = _representatives(keys.reshape(e, 2), owns_full.reshape(e)).reshape(b, c)
    rep_row, rep_col = rep // c, rep % c
    # Gathered as flat rows: the [row, column] form made XLA:CPU copy the prompts first.
    rep_tokens = block_tokens.reshape(e, bs)[rep.reshape(e)].reshape(b, c, bs)
    same = (
        (rep != flat) & (rep_col == j)
        & jnp.all(rep_tokens == block_tokens, axis=-1)
        & (salts[rep_row] == salts[:, None])
    )
    n_hit = leading_count(cached_hit | (cacheable & same))
    shared = (j < n_hit[:, None]) & ~cached_hit
    # A shared block must also follow the same block as its representative. With an honest hash
    # that always holds; after a collision the whole call falls back to no sharing (still safe).
    ref = jnp.where(cached_hit, cand, n + jnp.where(shared, rep, flat))
    prev_ref = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), ref[:, :-1]], axis=1)
    rep_prev_ref = jnp.where(j == 0, -1, ref.reshape(e)[jnp.maximum(rep - 1, 0)])
    consistent = jnp.all(~shared | (prev_ref == rep_prev_ref))
    return jnp.where(consistent, n_hit, n_cached), rep


def _admit_cached(config, state, seq_ids, prompt_lens, prompt_tokens, salts):
    bs, n, s = config.block_size, config.num_blocks, config.max_seqs
    b, length = prompt_tokens.shape
    c = -(-length // bs)
    e = b * c
    tokens = jnp.pad(prompt_tokens.astype(jnp.int32), ((0, 0), (0, c * bs - length)))
    block_tokens = tokens.reshape(b, c, bs)
    salts = salts.astype(jnp.uint32)
    cache = state.cache

    status, sid, lens = check_lengths(config, state, seq_ids, prompt_lens, length)
    ok0 = status == Status.OK
    n_blocks = jnp.where(ok0, (lens + bs - 1) // bs, 0)
    n_full = lens // bs
    n_cacheable = (lens - 1) // bs  # the block with the last token is always computed
    j = jnp.arange(c, dtype=jnp.int32)[None, :]
    flat = jnp.arange(e, dtype=jnp.int32).reshape(b, c)

    chains = block_hash.chain_states(salts, tokens, bs)  # [b, c, 2]
    keys = block_hash.key_of(chains)

    # 1. The longest prefix of verified cached blocks.
    cacheable = ok0[:, None] & (j < n_cacheable[:, None])
    cand = hash_table.lookup(cache.table, keys.reshape(e, 2), cacheable.reshape(e)).reshape(b, c)
    cand_c = jnp.maximum(cand, 0)
    meta = cache.meta[cand_c]  # [b, c, META_COLUMNS]: every fact a hit is checked against
    # A hit's parent class must be the class of the hit before it (or none, for a first block).
    hit_class = meta[..., CLASS:CLASS_GENERATION + 1]
    no_parent = jnp.broadcast_to(jnp.array([NO_PARENT, 0], jnp.int32), (b, 1, 2))
    prev_class = jnp.concatenate([no_parent, hit_class[:, :-1]], axis=1)
    linked = jnp.all(meta[..., PARENT_CLASS:PARENT_CLASS_GENERATION + 1] == prev_class, axis=-1)
    verified = (
        cacheable & (cand >= 0) & linked
        & (meta[..., SALT] == lax.bitcast_convert_type(salts, jnp.int32)[:, None])
    )
    n_cached = leading_count(verified & jnp.all(cache.tokens[cand_c] == block_tokens, axis=-1))

    # 2. Then the longest prefix of blocks an earlier request of this call computes (a single
    #    request has no earlier one: skipped, with its all-pairs key comparison).
    if b == 1:
        n_hit, rep = n_cached, flat
    else:
        n_hit, rep = _shared_with_earlier(
            n, keys, block_tokens, salts, ok0, n_full, cacheable, cand, n_cached
        )
    # Hits are a prefix of each table and every other block of it is fresh, so counts and ranks
    # follow from the prefix lengths without reductions over the blocks.
    cached_hit = j < n_cached[:, None]
    free_hit = cached_hit & (state.ref_count[cand_c] == 0)

    # 3. Cost and first come, first served. The first request to hit a free cached block pulls it
    #    out of the queue (``_first_claims``); one request's hits are distinct blocks.
    pulls = free_hit if b == 1 else _first_claims(cand_c.reshape(e), free_hit.reshape(e)).reshape(b, c)
    n_pulls = jnp.sum(pulls, axis=1, dtype=jnp.int32)
    n_fresh = jnp.where(ok0, n_blocks - n_hit, 0)
    fits = first_come_first_served(n_fresh + n_pulls, state.queue.num_free)
    status = jnp.where(ok0 & ~fits, Status.NO_FREE_BLOCKS, status)
    ok = status == Status.OK
    n_cached, n_hit = jnp.where(ok, n_cached, 0), jnp.where(ok, n_hit, 0)
    n_fresh, n_pulls = jnp.where(ok, n_fresh, 0), jnp.where(ok, n_pulls, 0)
    in_table = ok[:, None] & (j < n_blocks[:, None])
    cached_hit = j < n_cached[:, None]
    shared = ~cached_hit & (j < n_hit[:, None])
    fresh = in_table & ~(j < n_hit[:, None])

    # 4. Pull hits out of the queue, then take fresh blocks from its front: request r's fresh
    #    blocks are taken[start_r : start_r + n_fresh_r], in table order.
    queue = free_queue.remove(state.queue, cand_c.reshape(e), (pulls & ok[:, None]).reshape(e),
                              count=jnp.sum(n_pulls))
    count = jnp.sum(n_fresh)
    queue, taken = free_queue.take_front(queue, count, e)
    cache = prefix_cache.evict(cache, taken, jnp.arange(e) < count, target=config.target)
    start = prefix_sum(n_fresh) - n_fresh
    fresh_id = jnp.where(fresh, taken[jnp.clip(start[:, None] + j - n_hit[:, None], 0, e - 1)], NULL_BLOCK)
    block = jnp.where(cached_hit, cand, jnp.where(shared, fresh_id.reshape(e)[rep], fresh_id))
    block = jnp.where(in_table, block, NULL_BLOCK)

    # 5. Counts, tables, stored tokens, and the new full blocks into the cache.
    ref_count = state.ref_count.at[jnp.where(in_table, block, n)].add(1, mode="drop")
    rows = jnp.pad(block, ((0, 0), (0, config.max_blocks_per_seq - c)))
    cache = cache.replace(
        tokens=cache.tokens.at[jnp.where(fresh, block, n).reshape(e)].set(
            block_tokens.reshape(e, bs), mode="drop"
        )
    )
    # Each block's class: a hit's own, and for a fresh or shared block the one it founds (only a
    # prompt's last block, always computed, can be equal to an older cached block: it may join
    # that block's class, and it is the parent of no block of this call).
    block_class = jnp.where(cached_hit[..., None], hit_class, prefix_cache.own_class(cache, block))
    parent_class = jnp.concatenate([no_parent, block_class[:, :-1]], axis=1)
    cache = prefix_cache.register(
        cache,
        block.reshape(e),
        chains.reshape(e, 2),
        jnp.broadcast_to(salts[:, None], (b, c)).reshape(e),
        parent_class.reshape(e, 2),
        (fresh & (j < n_full[:, None])).reshape(e),
        count=jnp.sum(jnp.maximum(jnp.where(ok, n_full, 0) - n_hit, 0)),
        may_join=jnp.arange(b, dtype=jnp.int32) * c + jnp.maximum(n_blocks - 1, 0),
        distinct_keys=b == 1,  # one prompt's blocks have distinct prefixes
    )
    last_full = jnp.take_along_axis(chains, jnp.maximum(n_full - 1, 0)[:, None, None], axis=1)[:, 0]
    seq_chain = jnp.where((n_full > 0)[:, None], last_full, block_hash.root_state(salts))

    cache = cache.replace(stats=add_stats(
        cache.stats,
        lookups=jnp.sum(ok, dtype=jnp.int32),
        query_tokens=jnp.sum(jnp.where(ok, lens, 0), dtype=jnp.int32),
        hit_tokens=jnp.sum(n_hit, dtype=jnp.int32) * bs,
    ))
    target = jnp.where(ok, sid, s)
    state = start_rows(state.replace(queue=queue, ref_count=ref_count, cache=cache), target, rows, lens,
                       seq_chain, salts)
    return state, AdmitResult(
        status=status, cached_tokens=n_cached * bs, shared_tokens=(n_hit - n_cached) * bs
    )
