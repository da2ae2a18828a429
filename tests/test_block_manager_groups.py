"""KV-cache groups (``paged_kv.groups``): worked examples of window reclaim, hit rules, the hybrid
intersection, fork/select over a reclaimed prefix, and a seeded random run against the
plain-Python ``GroupedReference`` with the invariants checked after every call."""

import dataclasses
import random

import chex
import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import paged_kv as pk
from paged_kv.config import Group
from paged_kv.invariants import check_invariants, check_null_prefix_grows
from paged_kv.reference import GroupedReference

BS = 4
HYBRID = (Group("full"), Group("window", 5))


def manager(groups=HYBRID, num_blocks=24, max_seqs=4, retention=None) -> pk.BlockManager:
    """The worked examples of dense retention (``retention=None``: every full window block
    cached) unless told otherwise."""
    return pk.BlockManager(pk.ManagerConfig(num_blocks=num_blocks, block_size=BS, max_seqs=max_seqs,
                                            max_blocks_per_seq=8, groups=groups,
                                            prefix_cache_retention_interval=retention))


def test_group_validation():
    with pytest.raises(ValueError, match="window"):
        Group("window", 0)
    with pytest.raises(ValueError, match="kind"):
        Group("local", 4)
    with pytest.raises(ValueError, match="groups"):
        pk.ManagerConfig(num_blocks=8, groups=())
    assert not pk.ManagerConfig(num_blocks=8).grouped
    assert pk.ManagerConfig(num_blocks=8, groups=[Group("window", 3)]).grouped


def test_retention_validation():
    assert pk.ManagerConfig(num_blocks=8).prefix_cache_retention_interval == 0  # vLLM's engine default
    for bad in (16, -1, True, 0.0, "0"):
        with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
            pk.ManagerConfig(num_blocks=8, prefix_cache_retention_interval=bad)
    cfg = pk.ManagerConfig(num_blocks=8, groups=(Group("full"), Group("window", 9)))
    assert cfg.sparse(cfg.groups[1]) and not cfg.sparse(cfg.groups[0])
    assert not dataclasses.replace(cfg, prefix_cache_retention_interval=None).sparse(cfg.groups[1])
    assert hash(cfg) != hash(dataclasses.replace(cfg, prefix_cache_retention_interval=None))


A64 = list(range(1, 65))


@pytest.mark.parametrize("retention, hit, table, cached", [
    # vLLM 0.33's KVCacheManager (scripts/vllm_groups_driver.py, KVCacheConfig built with the
    # retention) on the same two admissions printed these, id for id.
    (0, 48, [1, 2, 3, 5, 6, 7, 8], [1, 2, 3, 5, 6, 7]),
    (None, 64, [0, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6]),
])
def test_issue_repro_equals_vllm(retention, hit, table, cached):
    """One ``Group("window", 48)``, block 16. ``r0``: 64 tokens ``A``; ``r1``: ``A`` + 41 tokens.
    Sparse retention hashes, of ``r0``'s four full blocks, only the ``cdiv(47, 16) = 3`` before
    its prompt boundary (block ``63 // 16 = 3``), so ``r1``'s hit is 3 blocks; dense hashes all
    four, and ``r1`` hits 4, the first out of its window (null)."""
    bm = pk.BlockManager(pk.ManagerConfig(num_blocks=21, block_size=16, max_seqs=4, max_blocks_per_seq=8,
                                          groups=(Group("window", 48),), prefix_cache_retention_interval=retention))
    bm.admit([0], [A64])
    assert bm.tables(0) == [[1, 2, 3, 4]]
    assert bm.cached_blocks() == ([1, 2, 3] if retention == 0 else [1, 2, 3, 4])
    res = bm.admit([1], [A64 + list(range(100, 141))])
    assert int(res.cached_tokens[0]) == hit
    assert bm.tables(1) == [table]
    assert bm.cached_blocks() == cached
    assert bm.free_queue() == list(range(table[-1] + 1, 21))
    check_invariants(bm.config, bm.state)


def test_sparse_retention_caches_at_a_shared_prefix_junction():
    """Full group and a window of 8, block 4. ``r0`` (32 tokens) hashes, in the window group,
    only blocks 6 and 7's predecessors before its boundary (positions 5, 6: ids 14, 15); ``r1``
    shares 21 tokens with it: the full group's own hit is 5 blocks (the junction) but the window
    group has none of positions 3, 4, so the hybrid hit is 0. Sparse retention then hashes ``r1``'s
    window blocks before the junction (positions 3, 4: ids 22, 23) as well as before its prompt
    boundary (positions 5, 6: ids 24, 25); ``r2``, a third request sharing the same 21 tokens,
    hits 20 tokens through them. Expected lines: vLLM 0.33, retention 0, the same ops."""
    bm = manager(groups=(Group("full"), Group("window", 8)), num_blocks=31, retention=0)
    doc = list(range(1, 33))
    bm.admit([0], [doc])
    assert bm.cached_blocks() == [1, 2, 3, 4, 5, 6, 7, 8, 14, 15]
    bm.free([0])
    assert int(bm.admit([1], [doc[:21] + list(range(80, 90))]).cached_tokens[0]) == 0
    assert bm.tables(1) == [[16, 13, 12, 11, 10, 9, 17, 18], [19, 20, 21, 22, 23, 24, 25, 26]]
    assert bm.cached_blocks() == [*range(1, 18), 22, 23, 24, 25]
    bm.free([1])
    # Hashless window blocks freed go to the front (21, 20, 19, and 26 the partly full one).
    assert bm.free_queue() == [26, 21, 20, 19, 18, 27, 28, 29, 30, 8, 7, 6, 5, 4, 3, 2, 1, 15, 14, 17,
                               9, 10, 11, 12, 13, 16, 25, 24, 23, 22]
    assert int(bm.admit([2], [doc[:21] + [95]]).cached_tokens[0]) == 20
    assert bm.tables(2) == [[1, 2, 3, 4, 5, 26], [0, 0, 0, 22, 23, 21]]
    check_invariants(bm.config, bm.state)


def test_sparse_retention_same_on_both_targets():
    """Groups have one form for every platform; the parts it shares with the single-group path
    (``release``, ``evict``) take ``ManagerConfig.target``. The junction stream above, with
    appends that reclaim hashless blocks to the front, gives the same state bit for bit traced
    for ``"cpu"`` and for ``"gpu"``."""
    doc = list(range(1, 33))
    states = []
    for target in ("cpu", "gpu"):
        cfg = pk.ManagerConfig(num_blocks=31, block_size=BS, max_seqs=4, max_blocks_per_seq=8, target=target,
                               groups=(Group("full"), Group("window", 8)))
        bm = pk.BlockManager(cfg)
        bm.admit([0, 1], [doc[:21] + list(range(80, 90)), doc[:23]])
        for t in range(6):
            bm.append([0, 1], [t, t])
        bm.free([0])
        bm.admit([2], [doc[:21] + [95]])
        states.append(jax.tree.map(np.asarray, bm.state))
    chex.assert_trees_all_equal(*states, strict=True)


@pytest.mark.parametrize("retention", [0, None])
def test_failed_append_still_reclaims_out_of_window_blocks(retention):
    """The documented exception to "a row that did not succeed leaves the state unchanged"
    (docs/design.md, section 4): a grouped ``append`` that returns ``TABLE_FULL`` still frees the
    row's out-of-window blocks, as vLLM's ``allocate_slots`` frees them before it checks capacity.
    Windows 8 and 8 and a full group, block 4, four blocks per table: 16 tokens fill the table;
    the 17th token does not fit, and the blocks of tokens 0..7 leave both windows."""
    groups = (Group("window", 8), Group("window", 8), Group("full"))
    bm = pk.BlockManager(pk.ManagerConfig(num_blocks=16, block_size=BS, max_seqs=2, max_blocks_per_seq=4,
                                          groups=groups, prefix_cache_retention_interval=retention))
    bm.admit([0], [list(range(16))])
    assert bm.tables(0) == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    res = bm.append([0], [16])
    assert int(res.status[0]) == pk.Status.TABLE_FULL
    assert bm.tables(0) == [[0, 0, 3, 4], [0, 0, 7, 8], [9, 10, 11, 12]]
    assert bm.num_tokens(0) == 16  # the token was not added
    # Released tail first, group by group: dense keeps every hash (to the back); sparse hashed
    # only positions 1 and 2 (before the prompt boundary 15 // 4 = 3), so blocks 1 and 5 go to the front.
    assert bm.free_queue() == ([5, 1, 13, 14, 15, 2, 6] if retention == 0 else [13, 14, 15, 2, 1, 6, 5])
    check_invariants(bm.config, bm.state)


def test_reclaim_timing_tail_first_back_of_queue():
    bm = manager()
    bm.admit([0], [list(range(10))])  # 3 blocks per group: [1, 2, 3] full, [4, 5, 6] window
    assert bm.tables(0) == [[1, 2, 3], [4, 5, 6]]
    bm.append([0], [10])  # computed 10: tokens before 10 - 5 + 1 = 6 leave -> block 0 (tokens 0..3)
    assert bm.tables(0) == [[1, 2, 3], [0, 5, 6]]
    assert bm.free_queue()[-1] == 4 and bm.ref_count(4) == 0
    bm.append([0], [11])  # computed 11: before 7, block 1 (tokens 4..7) still read
    assert bm.tables(0)[1] == [0, 5, 6]
    bm.append([0], [12])  # computed 12: before 8, block 1 leaves; a fresh block for token 12
    assert bm.tables(0) == [[1, 2, 3, 7], [0, 0, 6, 8]]
    assert bm.free_queue()[-2:] == [4, 5]
    check_invariants(bm.config, bm.state)


def test_reclaimed_blocks_stay_hits_and_hybrid_intersection():
    bm = manager()
    prompt = list(range(16))
    bm.admit([0], [prompt])
    for t in range(16, 21):
        bm.append([0], [t])
    bm.free([0])
    # The full group holds blocks 0..3 cached; the window group only its last window (c = 1 block
    # for W = 5, bs = 4) -- every reclaimed block is still cached in the queue.
    res = bm.admit([1], [list(range(17))])  # n_cacheable = 4 blocks
    assert int(res.cached_tokens[0]) == 16
    full, window = bm.tables(1)
    assert full[:4] == [1, 2, 3, 4] and window[:3] == [0, 0, 0] and window[3] != 0
    # Hybrid: the window group needs its last block before h; a prompt that differs there
    # from position 8 on hits only what both groups accept.
    res = bm.admit([2], [list(range(8)) + [99] * 9])
    assert int(res.cached_tokens[0]) == 8
    check_invariants(bm.config, bm.state)


def test_window_only_hit_needs_last_window():
    bm = manager(groups=(Group("window", 9),))  # c = 2 blocks
    bm.admit([0], [list(range(24))])
    bm.append([0], [24])  # reclaims blocks 0..3 (tokens before 16)
    bm.free([0])
    res = bm.admit([1], [list(range(24)) + [7]])  # blocks 4, 5 cached: hit 6 blocks
    assert int(res.cached_tokens[0]) == 24
    assert bm.tables(1)[0][:4] == [0, 0, 0, 0]


def test_window_hit_refused_when_only_part_of_the_last_window_is_cached():
    """W = 9, bs = 4: a hit at h needs the two blocks before h (tokens h - 8 .. h - 1). Block 5
    (tokens 16..19) stays cached while everything around it is evicted: a rule that looked at the
    last block alone would hit 20 tokens; the last window is never whole, so nothing hits."""
    bm = manager(groups=(Group("window", 9),), num_blocks=12)
    bm.admit([0], [list(range(24))])
    bm.append([0], [24])  # reclaims tokens 0..15 (blocks 1..4)
    bm.free([0])
    assert bm.free_queue() == [7, 8, 9, 10, 11, 4, 3, 2, 1, 6, 5]
    bm.admit([1, 2], [[100 + i for i in range(20)], [200 + i for i in range(20)]])  # evicts all but 5
    bm.free([1, 2])
    res = bm.admit([3], [list(range(24)) + [7]])
    assert int(res.cached_tokens[0]) == 0
    check_invariants(bm.config, bm.state)


def test_fork_and_select_share_a_reclaimed_prefix():
    bm = manager()
    bm.admit([0], [list(range(12))])
    bm.append([0], [12])
    bm.fork(0, [1])
    assert bm.tables(1) == bm.tables(0)
    nulls = int(np.asarray(bm.state.null_prefix)[1, 0])
    assert nulls == 2
    # Row 0 copies its shared last block in every group; row 1 is then the only holder and
    # writes in place (rows behave as if one at a time).
    res = bm.append([0, 1], [13, 14])
    assert int(res.num_copies) == 2 and (res.copy_src[0] > 0).all() and (res.copy_src[1] == 0).all()
    before = jax.tree.map(np.array, bm.state)  # the manager donates its state
    for t in range(15, 24):
        bm.append([0, 1], [t, t])
    check_null_prefix_grows(bm.config, before, bm.state, [0, 1])
    bm.select([0, 1], [1, 1])
    assert bm.tables(0) == bm.tables(1)
    bm.free([0, 1])
    check_invariants(bm.config, bm.state)
    assert bm.usage()["used"] == 0


def _snapshot(bm: pk.BlockManager) -> tuple:
    spans, tables = np.asarray(bm.state.spans), np.asarray(bm.state.tables)
    held = {s: bm.config.blocks_for(bm.num_tokens(s)) for s in bm.running()}
    reserved = {s: (int(spans[s, 0]), tables[:, s, held[s]: held[s] + spans[s, 1]].tolist()) for s in held}
    return ({s: bm.tables(s) for s in sorted(bm.running())}, bm.free_queue(),
            np.asarray(bm.state.ref_count).tolist(), bm.cached_blocks(), reserved)


def _reference_snapshot(ref: GroupedReference) -> tuple:
    counts = list(ref.ref_count)
    spans = {s: ref.span_of(s) for s in ref.tables}
    return ({s: ref.tables[s] for s in sorted(ref.tables)}, ref.queue_order(), counts, sorted(ref.cached_blocks()),
            spans)


def _admit_both(bm: pk.BlockManager, ref: GroupedReference, ids: list[int], prompts: list[list[int]]) -> None:
    got, want = bm.admit(ids, prompts), ref.admit(ids, prompts)
    assert [tuple(int(x) for x in t) for t in zip(got.status, got.cached_tokens, got.shared_tokens)] == \
        [(int(a), b, c) for a, b, c in want]


def _append_both(bm: pk.BlockManager, ref: GroupedReference, ids: list[int], toks: list[int]) -> None:
    got = bm.append(ids, toks)
    status, slots, src, dst = ref.append(ids, toks)
    assert [int(x) for x in got.status] == [int(x) for x in status]
    assert got.slots.tolist() == slots and got.copy_src.tolist() == src and got.copy_dst.tolist() == dst


@pytest.mark.parametrize("groups, retention", [
    (HYBRID, None), ((Group("full"), Group("window", 2), Group("window", 9)), 0),
    # Chunked local groups (Llama 4): a chunk not a multiple of the block, one of 2 blocks, beside
    # a full and a sparse window group, and alone.
    ((Group("full"), Group("chunked", chunk=6), Group("window", 5)), 0), ((Group("chunked", chunk=8),), 0)])
def test_random_ops_equal_reference(groups, retention):
    cfg = pk.ManagerConfig(num_blocks=20, block_size=BS, max_seqs=4, max_blocks_per_seq=8, groups=groups,
                           prefix_cache_retention_interval=retention)
    bm, ref = pk.BlockManager(cfg), GroupedReference(cfg)
    rng = random.Random(0)
    doc = [rng.randrange(3) for _ in range(32)]
    for _ in range(80):
        running = sorted(ref.tables)
        idle = [s for s in range(4) if s not in ref.tables]
        r = rng.random()
        if idle and (r < 0.3 or not running):
            ids = rng.sample(idle, rng.randrange(1, len(idle) + 1))
            prompts = [doc[: rng.randrange(1, 20)] for _ in ids]
            _admit_both(bm, ref, ids, prompts)
        elif running and r < 0.8:
            ids = rng.sample(running, rng.randrange(1, len(running) + 1))
            toks = [doc[ref.num_tokens[s] % 32] for s in ids]
            _append_both(bm, ref, ids, toks)
        elif running and r < 0.9:
            src = rng.choice(running)
            dst = idle[:1] if idle else []
            assert bm.fork(src, dst).tolist() == [int(x) for x in ref.fork([src] * len(dst), dst)]
        elif running:
            ids = rng.sample(running, rng.randrange(1, len(running) + 1))
            assert bm.free(ids).tolist() == [int(x) for x in ref.free(ids)]
        assert _snapshot(bm) == _reference_snapshot(ref)
        check_invariants(cfg, bm.state)


# ------------------------------------------------------------- hypothesis: long random sequences

DOC = [1, 2, 0, 1] * 8  # prompts are prefixes of this (plus a tail), so blocks and windows repeat


class GroupedMachine(RuleBasedStateMachine):
    """admit / append / fork / beam select / free drawn by hypothesis on a hybrid manager (one
    full group, two window groups, one smaller than a block) with sparse retention (the default);
    after every step the jitted manager equals ``GroupedReference`` (tables per group, free queue
    order, counts, cached blocks), the invariants hold, and no window table's null prefix shrank
    for a row that is still the same sequence. ``DenseGroupedMachine``: the same, dense."""

    config = pk.ManagerConfig(num_blocks=22, block_size=BS, max_seqs=4, max_blocks_per_seq=8,
                              groups=(Group("full"), Group("window", 6), Group("window", 3)))

    def __init__(self):
        super().__init__()
        self.bm, self.ref = pk.BlockManager(self.config), GroupedReference(self.config)
        self.before = jax.tree.map(np.array, self.bm.state)
        self.same = set()  # rows that are the same sequence as in ``before``

    def running(self) -> list[int]:
        return sorted(self.ref.tables)

    def idle(self) -> list[int]:
        return [s for s in range(self.config.max_seqs) if s not in self.ref.tables]

    @staticmethod
    def some(data: st.DataObject, pool: list[int]) -> list[int]:
        """A non-empty subset of ``pool`` in a drawn order (``pool`` is not empty)."""
        return data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=len(pool), unique=True))

    @rule(data=st.data())
    def admit(self, data):
        idle = self.idle()
        if not idle:
            return
        ids = self.some(data, idle)
        prompts = [DOC[: data.draw(st.integers(0, 24))] + data.draw(st.lists(st.integers(0, 2), max_size=3))
                   for _ in ids]
        prompts = [p or [0] for p in prompts]
        _admit_both(self.bm, self.ref, ids, prompts)
        self.same -= set(ids)

    @rule(data=st.data())
    def append(self, data):
        ids = self.pick(data)
        if not ids:
            return
        toks = [DOC[self.ref.num_tokens[s] % len(DOC)] for s in ids]
        _append_both(self.bm, self.ref, ids, toks)

    @rule(data=st.data())
    def fork(self, data):
        running, idle = self.running(), self.idle()
        if not running or not idle:
            return
        src = data.draw(st.sampled_from(running))
        dst = self.some(data, idle)
        assert self.bm.fork(src, dst).tolist() == [int(x) for x in self.ref.fork([src] * len(dst), dst)]
        self.same -= set(dst)

    @rule(data=st.data())
    def beam_select(self, data):
        running = self.running()
        if not running:
            return
        parents = data.draw(st.lists(st.sampled_from(running), min_size=len(running), max_size=len(running)))
        assert self.bm.select(running, parents).tolist() == [int(x) for x in self.ref.select(running, parents)]
        self.same -= {d for d, p in zip(running, parents) if d != p}

    @rule(data=st.data())
    def free(self, data):
        ids = self.pick(data)
        if not ids:
            return
        assert self.bm.free(ids).tolist() == [int(x) for x in self.ref.free(ids)]
        self.same -= set(ids)

    def pick(self, data) -> list[int]:
        """Some running rows (none when nothing runs)."""
        running = self.running()
        return self.some(data, running) if running else []

    # -- spans ---------------------------------------------------------------------------------

    @rule(data=st.data(), commit=st.booleans())
    def extend(self, data, commit):
        ids = self.pick(data)
        if not ids:
            return
        toks = [data.draw(st.lists(st.integers(0, 2), max_size=6)) for _ in ids]
        got = self.bm.extend(ids, toks, commit=commit)
        k = max([len(t) for t in toks] + [1])
        status, slots, src, dst = self.ref.extend(ids, [len(t) for t in toks], toks, k, commit=commit)
        assert got.status.tolist() == [int(x) for x in status]
        assert got.slots.tolist() == slots and got.copy_src.tolist() == src and got.copy_dst.tolist() == dst

    @rule(data=st.data())
    def commit(self, data):
        ids = self.pick(data)
        if not ids:
            return
        toks = [data.draw(st.lists(st.integers(0, 2), max_size=self.ref.uncommitted.get(s, 0) + 1)) for s in ids]
        got = self.bm.commit(ids, toks)
        assert got.tolist() == [int(x) for x in self.ref.commit(ids, [len(t) for t in toks], toks, 1 << 20)]

    @rule(data=st.data(), keep=st.booleans())
    def truncate(self, data, keep):
        ids = self.pick(data)
        if not ids:
            return
        ends = [(self.ref.num_tokens[s] - self.ref.uncommitted.get(s, 0), self.ref.num_tokens[s]) for s in ids]
        lens = [data.draw(st.integers(max(0, c - 1), n + 1)) for c, n in ends]
        got = self.bm.truncate(ids, lens, keep_reserved=keep)
        assert got.tolist() == [int(x) for x in self.ref.truncate(ids, lens, keep)]

    @invariant()
    def agrees_with_reference_and_invariants_hold(self):
        assert _snapshot(self.bm) == _reference_snapshot(self.ref)
        check_invariants(self.config, self.bm.state)
        check_null_prefix_grows(self.config, self.before, self.bm.state, sorted(self.same & set(self.running())))
        self.before = jax.tree.map(np.array, self.bm.state)
        self.same = set(self.running())

    def teardown(self):
        running = self.running()
        if running:
            self.bm.free(running)
        check_invariants(self.config, self.bm.state)
        assert self.bm.usage()["used"] == 0


class DenseGroupedMachine(GroupedMachine):
    config = dataclasses.replace(GroupedMachine.config, prefix_cache_retention_interval=None)


GroupedMachine.TestCase.settings = settings(max_examples=5, stateful_step_count=20, deadline=None,
                                            suppress_health_check=list(HealthCheck))
DenseGroupedMachine.TestCase.settings = settings(GroupedMachine.TestCase.settings, max_examples=3)
TestGroupedManager = GroupedMachine.TestCase
TestDenseGroupedManager = DenseGroupedMachine.TestCase


class ChunkedGroupedMachine(GroupedMachine):
    """The same with a chunked local group (a chunk of 6 tokens, not a multiple of the block) in
    place of the larger window group."""
    config = dataclasses.replace(GroupedMachine.config, groups=(Group("full"), Group("chunked", chunk=6),
                                                                Group("window", 3)))


ChunkedGroupedMachine.TestCase.settings = settings(GroupedMachine.TestCase.settings, max_examples=3)
TestChunkedGroupedManager = ChunkedGroupedMachine.TestCase
