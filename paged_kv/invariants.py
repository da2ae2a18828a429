"""Host-side checks of the block-manager invariants (docs/design.md, section 6), for tests and debugging.

``check_invariants`` reads the whole state back to the host (O(pool)); never call it in a hot path.
"""

from __future__ import annotations

import collections

import numpy as np

from paged_kv.batch import blocks_held
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.state import BlockManagerState


def free_queue_order(state: BlockManagerState) -> list[int]:
    """Live free-queue entries, front first, read on the host."""
    q = state.queue
    ring, slot = np.asarray(q.ring), np.asarray(q.slot)
    cap, head, size = ring.shape[0], int(q.head), int(q.size)
    positions = (head + np.arange(size)) % cap
    ids = ring[positions]
    return ids[slot[ids] == positions].tolist()


def check_invariants(config: ManagerConfig, state: BlockManagerState) -> None:
    """Raises ``AssertionError`` naming the first broken invariant.

    With KV-cache groups (``config.grouped``), per group ``g`` and running row ``s``: columns
    before ``null_prefix[g, s]`` hold ``NULL_BLOCK`` and the rest of the ``ceil(tokens / bs)``
    columns hold distinct blocks of group ``g`` (``block_group``); a full group has no null
    prefix; a window group's null prefix never covers a block the window still reads (``<=
    skipped_blocks(tokens)``); and reference counts equal the table entries summed over groups
    and rows. (That a null prefix only grows is a property of a sequence of states:
    ``check_null_prefix_grows``.)

    Spans (``BlockManagerState.spans``): a running row has ``0 <= num_uncommitted < num_tokens``
    (its prompt is committed) and ``num_reserved >= 0`` blocks past its tokens' ones, every group;
    a block holding one of its uncommitted tokens, and a reserved block, is held by that row
    alone and never cached; a row that is not running has both at 0."""
    ref = np.asarray(state.ref_count)
    all_tables = np.asarray(state.tables)  # [G, S, M]
    tokens = np.asarray(state.num_tokens)
    active = np.asarray(state.active)
    spans = np.asarray(state.spans)
    uncommitted, reserved = spans[:, 0], spans[:, 1]
    committed = tokens - uncommitted
    held = np.asarray(blocks_held(config, tokens)) + reserved
    draft_blocks: set[int] = set()
    m = config.max_blocks_per_seq
    nulls = np.asarray(state.null_prefix) if config.grouped else np.zeros((1, config.max_seqs), np.int32)
    owner = np.asarray(state.block_group) if config.grouped else None

    holders: collections.Counter[int] = collections.Counter()
    for g, group in enumerate(config.groups):
        tables = all_tables[g]
        for s in range(config.max_seqs):
            row = tables[s]
            if not active[s]:
                assert tokens[s] == 0 and (row == NULL_BLOCK).all(), f"inactive row {s} not cleared"
                assert nulls[g, s] == 0, f"inactive row {s} has a null prefix in group {g}"
                assert (spans[s] == 0).all(), f"inactive row {s} has spans {spans[s]}"
                continue
            assert 0 <= uncommitted[s] < tokens[s], f"row {s}: {uncommitted[s]} of {tokens[s]} tokens uncommitted"
            assert reserved[s] >= 0, f"row {s}: {reserved[s]} reserved blocks"
            assert 1 <= tokens[s] <= config.max_tokens_per_seq, f"row {s}: {tokens[s]} tokens"
            assert held[s] <= m, f"row {s} holds {held[s]} blocks > max_blocks_per_seq {m}"
            lo = int(nulls[g, s])
            limit = group.skipped_blocks(int(tokens[s]), config.block_size)
            assert 0 <= lo <= limit, (
                f"group {g} row {s}: null prefix {lo} > {limit} blocks out of the window at {tokens[s]} tokens")
            assert (row[:lo] == NULL_BLOCK).all(), f"group {g} row {s}: a block inside the null prefix"
            used, unused = row[lo: held[s]], row[held[s]:]
            # Invariant 3 (lazy): exactly ceil(num_tokens / block_size) blocks plus the reserved
            # ones, none beyond.
            assert (used != NULL_BLOCK).all(), f"row {s} has a null block among its {held[s]} blocks"
            assert (unused == NULL_BLOCK).all(), f"row {s} holds blocks beyond ceil(tokens/bs)"
            assert len(set(used.tolist())) == len(used), f"row {s} holds a block twice: {used}"
            if owner is not None:
                assert (owner[used] == g).all(), f"group {g} row {s} holds blocks of groups {owner[used]}"
            holders.update(used.tolist())
            # Blocks holding an uncommitted token, and reserved blocks (columns from there on).
            first = int(committed[s]) // config.block_size if uncommitted[s] else config.blocks_for(int(tokens[s]))
            draft_blocks.update(row[max(lo, first): held[s]].tolist())

    # Invariant 1: counts equal table references.
    expected = np.zeros_like(ref)
    for block, count in holders.items():
        expected[block] = count
    bad = np.flatnonzero(ref != expected)
    assert bad.size == 0, (
        f"ref_count differs from table references at blocks {bad[:8].tolist()}: "
        f"count {ref[bad[:8]].tolist()} vs references {expected[bad[:8]].tolist()}"
    )
    assert ref[NULL_BLOCK] == 0, "the null block is counted"

    # Invariant 2: the queue holds exactly the blocks at count 0, each once.
    order = free_queue_order(state)
    assert len(order) == len(set(order)), "a block is in the free queue twice"
    zero = set(np.flatnonzero(ref == 0).tolist()) - {NULL_BLOCK}
    assert set(order) == zero, (
        f"free queue and zero-count blocks differ: only queued {sorted(set(order) - zero)[:8]}, "
        f"only zero {sorted(zero - set(order))[:8]}"
    )
    q = state.queue
    assert int(q.num_free) == len(order), f"num_free {int(q.num_free)} != {len(order)} live entries"
    assert 0 <= int(q.size) <= config.queue_capacity and int(q.size) >= len(order)
    slot = np.asarray(q.slot)
    assert (slot[list(zero - set(order))] == -1).all() if zero - set(order) else True
    held_blocks = np.flatnonzero(ref > 0)
    assert (slot[held_blocks] == -1).all(), "a held block has a live queue slot"
    shared_drafts = [b for b in draft_blocks if ref[b] != 1]
    assert not shared_drafts, f"blocks {shared_drafts[:8]} hold drafts or are reserved but are shared"
    if config.prefix_caching:
        cached_drafts = [b for b in draft_blocks if np.asarray(state.cache.slot)[b] >= 0
                         and _has_draft(config, b, all_tables, active, tokens, committed, nulls)]
        assert not cached_drafts, f"blocks {cached_drafts[:8]} hold an uncommitted token but are cached"

    if config.prefix_caching:
        _check_cache(config, state, all_tables, nulls, tokens, active, committed, reserved)


def check_null_prefix_grows(config: ManagerConfig, before: BlockManagerState, after: BlockManagerState,
                            rows: list[int]) -> None:
    """Raises ``AssertionError`` if a window group's null prefix of one of ``rows`` (running in
    both states, the same sequence: not freed, re-admitted or reselected in between) shrank."""
    if not config.grouped:
        return
    a, b = np.asarray(before.null_prefix), np.asarray(after.null_prefix)
    for s in rows:
        assert (b[:, s] >= a[:, s]).all(), f"row {s}: null prefix shrank from {a[:, s]} to {b[:, s]}"


def _has_draft(config, block, tables, active, tokens, committed, nulls) -> bool:
    """Whether ``block`` holds an uncommitted token of a row, or is reserved, in some group."""
    bs = config.block_size
    for g in range(tables.shape[0]):
        for s in np.flatnonzero(active):
            row = tables[g, s]
            for j in np.flatnonzero(row == block):
                if j * bs >= tokens[s] or (committed[s] < tokens[s] and (j + 1) * bs > committed[s]):
                    return True
    return False


def _check_cache(config, state, tables, nulls, tokens, active, committed, reserved) -> None:
    """Invariant 4: every hash entry points at a full block whose stored tokens and chain match,
    every full block in a table is cached, and the classes are consistent (see
    ``state.PrefixCache``): blocks of one class hold one prefix, a block with a parent class has a
    live block of that class (so no cached prefix is unreachable), and equal prefixes share one
    class."""
    import jax.numpy as jnp

    from paged_kv import block_hash
    from paged_kv.hash_table import EMPTY, TOMBSTONE
    from paged_kv.state import NO_PARENT

    cache = state.cache
    slot = np.asarray(cache.slot)
    vals = np.asarray(cache.table.vals)
    keys = np.asarray(cache.table.keys)
    cached = np.flatnonzero(slot >= 0)
    live = np.flatnonzero(vals >= 0)
    assert len(live) == len(cached) == int(cache.table.num_live), "table and block slots disagree"
    assert int(cache.table.num_dead) == int((vals == TOMBSTONE).sum())
    assert (vals[slot[cached]] == cached).all(), "a cached block's slot holds another block"
    assert (keys[slot[cached]] == np.asarray(cache.key)[cached]).all(), "stored key differs"
    assert EMPTY < 0 and TOMBSTONE < 0

    # Full blocks, and only full blocks, of running sequences are cached (none of a group that
    # caches nothing, ``Group.caches_blocks``). A sparse window group (``ManagerConfig.sparse``)
    # caches only some full blocks, all before its prompt boundary, so before position
    # ``(tokens - 1) // bs`` once the whole prompt is in (a prompt admitted in chunks,
    # ``admit(..., chunk=)``, may have registered its last full block while more of the prompt is
    # to come, so the check is only that the block is full); which ones depends on the prompt and
    # the hit at admission, so the exact set is checked against ``GroupedReference``, not here.
    bs = config.block_size
    for g, group in enumerate(config.groups):
        for s in np.flatnonzero(active):
            held = config.blocks_for(int(tokens[s])) + int(reserved[s])
            for j in range(int(nulls[g, s]), held):
                b = tables[g, s, j]
                # Full and wholly committed (a reserved block never is).
                full = (j + 1) * bs <= committed[s] and group.caches_blocks
                hashed = slot[b] >= 0
                if config.sparse(group):
                    assert not hashed or full, f"group {g} row {s}: block {b} (position {j}) cached but not full"
                    continue
                assert hashed == full, (
                    f"group {g} row {s}: block {b} (position {j}) full={full} but cached={hashed}")
    window_blocks = set()
    if config.grouped:  # a window group's parent may be gone: its chain is not checked here
        owner = np.asarray(state.block_group)
        window_blocks = {b for b in cached.tolist() if not config.groups[owner[b]].is_full}

    # Classes: one prefix per class, a live parent class for every child.
    klass = [tuple(x) for x in np.asarray(cache.klass).tolist()]
    parent = [tuple(x) for x in np.asarray(cache.parent_class).tolist()]
    all_keys = np.asarray(cache.key)
    salt = np.asarray(cache.salt)
    block_tokens = np.asarray(cache.tokens)
    members: dict[tuple, list[int]] = collections.defaultdict(list)
    for b in cached.tolist():
        if b not in window_blocks:
            members[klass[b]].append(b)
    for label, group in members.items():
        first = group[0]
        for b in group[1:]:
            assert (all_keys[b] == all_keys[first]).all() and salt[b] == salt[first], f"class {label} mixes keys"
            assert (block_tokens[b] == block_tokens[first]).all(), f"class {label} mixes tokens"
            assert parent[b] == parent[first], f"class {label} mixes parent classes"
    contents = np.asarray(block_hash.block_contents(cache.tokens))  # [N, 2], one call
    roots = np.asarray(block_hash.root_state(cache.salt))
    mult = np.asarray(block_hash._CHAIN_MULT)
    chain: dict[tuple, np.ndarray] = {}

    def chain_of(label: tuple) -> np.ndarray:
        if label not in chain:
            b = members[label][0]
            p = parent[b]
            if p[0] == NO_PARENT:
                prev = roots[b]
            else:
                assert p in members, f"block {b}: no live block of its parent class {p} (unreachable)"
                prev = chain_of(p)
            with np.errstate(over="ignore"):
                chain[label] = prev * mult + contents[b]
        return chain[label]

    labels = list(members)
    if labels:
        from paged_kv.groups import group_chains

        owner = np.asarray(state.block_group) if config.grouped else np.zeros(len(all_keys), np.int32)
        chains = [np.asarray(group_chains(jnp.asarray(chain_of(lb)), int(owner[members[lb][0]]))) for lb in labels]
        keys_now = np.asarray(block_hash.key_of(jnp.asarray(np.stack(chains))))
        bad = [lb for lb, k in zip(labels, keys_now) if (k != all_keys[members[lb][0]]).any()]
        assert not bad, f"classes {bad[:8]}: key does not match their tokens and chain"
    # Equal prefixes (same key, salt, tokens and parent class) share one class.
    seen: dict[tuple, tuple] = {}
    for label in labels:
        b = members[label][0]
        what = (tuple(all_keys[b]), int(salt[b]), tuple(block_tokens[b]), parent[b])
        assert seen.setdefault(what, label) == label, f"classes {seen[what]} and {label} hold one prefix"
