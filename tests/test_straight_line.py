"""The GPU forms of the manager's operations (``scan.per_platform``'s ``default``: one ``cond`` per
call around the rare paths, straight-line code otherwise) give the same state, bit for bit, and
the same outputs as the CPU forms. Traced here on a CPU under ``scan.straight_line_on_cpu()``.

The random operation sequences of ``test_block_manager_properties`` run with every ``append``,
``fork``, ``select`` and ``free`` called in both forms on the same state; tiny pools and tables
make the rare paths (free-queue compaction, stale entries in ``take_front``'s window, a hash-table
rebuild, probes past the window, evictions) happen, and the directed tests below force each one.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import hypothesis.strategies as st
import pytest
from hypothesis.stateful import rule

import paged_kv as pk
from paged_kv import allocate, free_queue, hash_table, prefix_cache, share
from paged_kv.scan import straight_line_on_cpu
from tests import test_block_manager_properties as props


def _gpu_jit(fn):
    """``fn`` jitted in its GPU form (a fresh function, so no trace of the CPU form is reused)."""
    jitted = jax.jit(lambda config, *args: fn(config, *args), static_argnums=0)

    def call(*args):
        with straight_line_on_cpu():
            return jitted(*args)
    return call


def assert_same(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y), (x, y)


def _both(cpu, gpu):
    def call(*args):
        # The CPU form donates nothing here, so the same input state feeds both.
        want = cpu(*args)
        got = gpu(*args)
        assert_same(got, want)
        return want
    return call


_OPS = {name: (getattr(props, name), _gpu_jit(fn)) for name, fn in
        (("APPEND", pk.append), ("FORK", pk.fork), ("SELECT", pk.select), ("FREE", pk.free))}


_FREE_THEN_SELECT = _gpu_jit(share.free_then_select)
_FREE_SELECT_APPEND = _gpu_jit(share.free_select_append)
_FREE_SELECT_APPEND_CPU = jax.jit(share.free_select_append, static_argnums=0)


class BothForms:
    """Mixin: while a machine runs, its module's jitted operations run in both forms, and
    ``free_then_select`` in its GPU form matches ``free`` then ``select``."""

    @rule(frees=props.ids, dsts=props.ids, parents=st.lists(props.seq_id, min_size=props.BATCH,
                                                            max_size=props.BATCH))
    def free_then_select(self, frees, dsts, parents):
        parents = parents[: len(dsts)]
        fused = _FREE_THEN_SELECT(self.config, self.state, props.pad(frees), props.pad(dsts), props.pad(parents))
        self.free(frees)
        self._select(dsts, parents)
        assert_same(fused[0], self.state)

    @rule(frees=props.ids, dsts=props.ids, parents=st.lists(props.seq_id, min_size=props.BATCH,
                                                            max_size=props.BATCH),
          sids=props.ids, tokens=st.lists(props.token, min_size=props.BATCH, max_size=props.BATCH),
          rows=props.ids)
    def free_select_append(self, frees, dsts, parents, sids, tokens, rows):
        """The serving step's fused call, in its GPU form, against the three calls one by one
        (each checked against the reference by the machine); its CPU form is the same three."""
        parents, tokens = parents[: len(dsts)], tokens[: len(sids)]
        args = (self.config, self.state, props.pad(frees), props.pad(dsts), props.pad(parents), props.pad(sids),
                props.pad(tokens, 0), props.pad(rows))
        fused = _FREE_SELECT_APPEND(*args)
        assert_same(fused, _FREE_SELECT_APPEND_CPU(*args))
        self.free(frees)
        self._select(dsts, parents)
        r = jnp.asarray(props.pad(rows))
        tables = jnp.where((r >= 0)[:, None], self.state.block_tables[jnp.clip(r, 0, self.config.max_seqs - 1)],
                           pk.NULL_BLOCK)
        assert_same(fused[4], tables)
        self._append(sids, tokens)
        assert_same(fused[0], self.state)

    def __init__(self):
        super().__init__()
        self._saved = {name: getattr(props, name) for name in _OPS}
        for name, (cpu, gpu) in _OPS.items():
            setattr(props, name, _both(cpu, gpu))

    def teardown(self):
        try:
            super().teardown()
        finally:
            for name, op in self._saved.items():
                setattr(props, name, op)


class CachingBoth(BothForms, props.CachingMachine):
    pass


class PlainBoth(BothForms, props.PlainMachine):
    pass


class DuplicatesBoth(BothForms, props.DuplicatesMachine):
    pass


class WideBoth(BothForms, props.WideTableMachine):
    pass


CachingBoth.TestCase.settings = props.settings(props.SETTINGS, max_examples=12)
PlainBoth.TestCase.settings = props.settings(props.SETTINGS, max_examples=8)
DuplicatesBoth.TestCase.settings = props.settings(props.SETTINGS, max_examples=10)
WideBoth.TestCase.settings = props.settings(props.SETTINGS, max_examples=5)
TestCachingBothForms = CachingBoth.TestCase
TestPlainBothForms = PlainBoth.TestCase
TestDuplicatesBothForms = DuplicatesBoth.TestCase
TestWideBothForms = WideBoth.TestCase


# ------------------------------------------------------------------ each rare path, forced


def _queue(cap, n, entries, head=0, num_free=None):
    """A free queue of capacity ``cap`` over ``n`` blocks whose ring holds ``entries`` from
    ``head`` on; -1 entries are stale (they name block 0, whose slot is never theirs)."""
    ring = np.zeros(cap, np.int32)
    slot = np.full(n, -1, np.int32)
    for i, b in enumerate(entries):
        pos = (head + i) % cap
        ring[pos] = max(b, 0)
        if b > 0:
            slot[b] = pos
    live = sum(b > 0 for b in entries)
    return pk.FreeQueue(ring=jnp.asarray(ring), slot=jnp.asarray(slot),
                        counts=jnp.array([head, len(entries), live if num_free is None else num_free], jnp.int32))


def _both_forms(fn, *args):
    cpu = jax.jit(lambda *a: fn(*a))(*args)
    with straight_line_on_cpu():
        gpu = jax.jit(lambda *a: fn(*a))(*args)
    assert_same(gpu, cpu)
    return cpu


@pytest.mark.parametrize("back,front", [(2, 1), (3, 0), (0, 3), (1, 1)])
def test_push_back_then_front_compacts_like_two_pushes(back, front):
    # Capacity 8, 6 entries in use, 2 of them live: pushing 3 overflows (a compaction), 2 fits.
    q = _queue(8, 8, [-1, 5, -1, -1, 6, -1], head=5)
    ids = jnp.array([1, 2, 3, 4], jnp.int32)
    back_m = jnp.arange(4) < back
    front_m = (jnp.arange(4) >= back) & (jnp.arange(4) < back + front)
    out = _both_forms(free_queue.push_back_then_front, q, ids, back_m, front_m)
    want = free_queue.push_front(free_queue.push_back(q, ids, back_m), ids, front_m)
    assert_same(out, want)
    compacted = 6 + back + front > 8
    assert (int(out.size) == 2 + back + front) == compacted


def test_take_front_window_reports_stale_entries():
    # Three stale entries before the live ones: a 2-wide window cannot take 2 blocks.
    q = _queue(16, 8, [-1, -1, -1, 3, 4, 5])
    _, _, more = free_queue.take_front(q, jnp.int32(2), 2, loop=False)
    assert bool(more)
    q2, out = free_queue.take_front(q, jnp.int32(2), 2)
    assert np.asarray(out).tolist() == [3, 4]
    _, _, more = free_queue.take_front(q2, jnp.int32(2), 2, loop=False)
    assert not bool(more)


def test_claims_past_window_matches_claim():
    size = 16
    table = hash_table.empty_table(size)
    # Fill home slots 3..10 of keys whose home is 3 so that the next one probes past the window.
    keys = jnp.stack([jnp.full((9,), 3, jnp.uint32), jnp.arange(9, dtype=jnp.uint32)], axis=1)
    mask = jnp.ones((9,), bool)
    assert bool(hash_table.claims_past_window(table, keys, mask))  # 9 equal homes, window of 8
    assert not bool(hash_table.claims_past_window(table, keys[:1], mask[:1]))
    # Two different keys, same home: the second loses the slot to the first.
    assert bool(hash_table.claims_past_window(table, keys[:2], mask[:2]))
    assert not bool(hash_table.claims_past_window(table, keys[:2], jnp.array([True, False])))
    table, _, _, _ = hash_table.claim(table, keys[:8], jnp.arange(8, dtype=jnp.int32), mask[:8])
    assert bool(hash_table.claims_past_window(table, keys[8:], mask[8:]))
    other = jnp.array([[5 + 8, 0]], jnp.uint32)  # home 13: empty
    assert not bool(hash_table.claims_past_window(table, other, mask[:1]))


def _decode_config(num_blocks=12, block_size=2, seqs=4, width=6):
    return pk.ManagerConfig(num_blocks=num_blocks, block_size=block_size, max_seqs=seqs,
                            max_blocks_per_seq=width)


def _record(values: list, flag):
    """``flag`` (a traced bool) unchanged; its value is appended to ``values`` each time the
    program runs (which branch a GPU form took)."""
    jax.debug.callback(lambda v: values.append(bool(v)), flag)
    return flag


def test_append_paths_agree_through_fills_evictions_and_rebuilds(monkeypatch):
    """Decode with one-token appends until the pool turns over several times: blocks fill (so
    they are cached), taken blocks are cached ones (evictions), tombstones pile up (rebuilds),
    and both forms stay identical throughout; the GPU form's ``cond`` takes both branches."""
    taken = []
    needs_loops = allocate._needs_loops

    def recorded(*args):
        return _record(taken, needs_loops(*args))

    monkeypatch.setattr(allocate, "_needs_loops", recorded)
    config = _decode_config()
    admit = jax.jit(functools.partial(pk.admit, config))
    free = jax.jit(functools.partial(pk.free, config))
    append_gpu = _gpu_jit(pk.append)
    append_cpu = jax.jit(pk.append, static_argnums=0)
    state = pk.init_state(config)
    rng = np.random.default_rng(0)
    rows = jnp.arange(config.max_seqs, dtype=jnp.int32)
    for step in range(60):
        if step % 10 == 0:
            state, _ = free(state, rows)
            prompts = rng.integers(0, 3, (config.max_seqs, 4)).astype(np.int32)
            state, _ = admit(state, rows, jnp.full((config.max_seqs,), 3, jnp.int32), jnp.asarray(prompts),
                             jnp.zeros((config.max_seqs,), jnp.uint32))
        toks = jnp.asarray(rng.integers(0, 3, config.max_seqs).astype(np.int32))
        want = append_cpu(config, state, rows, toks)
        got = append_gpu(config, state, rows, toks)
        assert_same(got, want)
        state = want[0]
    assert set(taken) == {True, False}, taken  # the cond took both branches
    assert int(state.cache.stats.evictions) > 0


def test_evict_and_register_without_skips_are_identity_when_nothing_to_do():
    config = _decode_config()
    cache = pk.init_state(config).cache
    taken = jnp.array([1, 2, 3], jnp.int32)
    none = jnp.zeros((3,), bool)
    assert_same(prefix_cache.evict(cache, taken, none, skip=False), prefix_cache.evict(cache, taken, none))
    chains = jnp.ones((3, 2), jnp.uint32)
    parent = jnp.zeros((3, 2), jnp.int32)
    salts = jnp.zeros((3,), jnp.uint32)
    assert_same(prefix_cache.register(cache, taken, chains, salts, parent, none, straight=True),
                prefix_cache.register(cache, taken, chains, salts, parent, none))


def test_free_select_append_agrees_through_crowded_rings_and_slow_appends(monkeypatch):
    """The serving step's fused call over many steps of a tiny pool: beams reselect (releasing
    blocks, so stale entries and crowded rings come), rows are freed and readmitted, blocks fill
    and are evicted; the GPU form equals free, select, append one by one, and its one check
    takes both ways, through each rare path (crowded ring, slow append)."""
    seen = []
    inner = share.straight_or_repair

    def recorded(slow, *args):
        return inner(_record(seen, slow), *args)

    crowded = []
    is_crowded = share._crowded

    def recorded_crowded(*args):
        return _record(crowded, is_crowded(*args))

    monkeypatch.setattr(share, "straight_or_repair", recorded)
    monkeypatch.setattr(share, "_crowded", recorded_crowded)
    config = pk.ManagerConfig(num_blocks=14, block_size=2, max_seqs=4, max_blocks_per_seq=6, prefix_caching=True)
    admit = jax.jit(functools.partial(pk.admit, config))
    free = jax.jit(functools.partial(pk.free, config))
    fused_gpu = _gpu_jit(share.free_select_append)
    fused_cpu = jax.jit(share.free_select_append, static_argnums=0)
    state = pk.init_state(config)
    rng = np.random.default_rng(1)
    rows = jnp.arange(config.max_seqs, dtype=jnp.int32)
    none = jnp.full((config.max_seqs,), -1, jnp.int32)
    for step in range(48):
        if step % 8 == 0:
            state, _ = free(state, rows)
            prompts = rng.integers(0, 3, (config.max_seqs, 4)).astype(np.int32)
            state, _ = admit(state, rows, jnp.asarray(rng.integers(1, 5, config.max_seqs).astype(np.int32)),
                             jnp.asarray(prompts), jnp.zeros((config.max_seqs,), jnp.uint32))
        parents = jnp.asarray(rng.integers(0, config.max_seqs, config.max_seqs).astype(np.int32))
        dst = rows if step % 3 else none
        frees = jnp.asarray(np.where(rng.random(config.max_seqs) < 0.15, np.arange(config.max_seqs), -1).astype(np.int32))
        toks = jnp.asarray(rng.integers(0, 3, config.max_seqs).astype(np.int32))
        args = (config, state, frees, dst, parents, rows, toks, jnp.array([0, 2], jnp.int32))
        want = fused_cpu(*args)
        got = fused_gpu(*args)
        assert_same(got, want)
        state = want[0]
    assert set(seen) == {True, False}, seen
    assert True in crowded and seen.count(True) > crowded.count(True), (seen, crowded)  # both rare paths
