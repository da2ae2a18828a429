"""The two forms of every manager operation (``ManagerConfig.target``: ``"cpu"``, skips and loops
that run only when needed; ``"gpu"``, straight-line code behind one predicate per call) give the
same state and outputs, bit for bit. Both are traced and run here on a CPU.

The random operation sequences of ``test_block_manager_properties`` run with every ``append``,
``fork``, ``select`` and ``free`` called for both targets on the same state; tiny pools and tables
make the rare paths (free-queue compaction, stale entries in ``take_front``'s window, a hash-table
rebuild, probes past the window, evictions) happen, and the directed tests below force each one.
"""

import dataclasses
import functools

import chex
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis.stateful import rule

import paged_kv as pk
from paged_kv import allocate, free_queue, fused, hash_table, prefix_cache
from tests import test_block_manager_properties as props


def assert_same(a, b):
    """Same tree structure, and every leaf equal bit for bit with the same shape and dtype."""
    chex.assert_trees_all_equal(a, b, strict=True)


@functools.cache
def _jit(fn):
    return jax.jit(fn, static_argnums=0)


def both_targets(fn, config, *args):
    """``fn(config, *args)`` jitted for target ``"cpu"`` and ``"gpu"``: asserts the two agree and
    returns the result (nothing is donated, so the same input feeds both)."""
    want = _jit(fn)(dataclasses.replace(config, target="cpu"), *args)
    assert_same(_jit(fn)(dataclasses.replace(config, target="gpu"), *args), want)
    return want


class BothTargets:
    """Mixin: while a machine runs, its operations run for both targets, and the fused calls
    match the operations one by one."""

    @rule(frees=props.ids, dsts=props.ids, parents=st.lists(props.seq_id, min_size=props.BATCH,
                                                            max_size=props.BATCH))
    def free_then_select(self, frees, dsts, parents):
        parents = parents[: len(dsts)]
        out = both_targets(fused.free_then_select, self.config, self.state, props.pad(frees), props.pad(dsts),
                           props.pad(parents))
        self.free(frees)
        self._select(dsts, parents)
        assert_same(out[0], self.state)

    @rule(frees=props.ids, dsts=props.ids, parents=st.lists(props.seq_id, min_size=props.BATCH,
                                                            max_size=props.BATCH),
          sids=props.ids, tokens=st.lists(props.token, min_size=props.BATCH, max_size=props.BATCH),
          rows=props.ids)
    def free_select_append(self, frees, dsts, parents, sids, tokens, rows):
        """The serving step's fused call against the three calls one by one (each checked
        against the reference by the machine)."""
        parents, tokens = parents[: len(dsts)], tokens[: len(sids)]
        out = both_targets(fused.free_select_append, self.config, self.state, props.pad(frees), props.pad(dsts),
                           props.pad(parents), props.pad(sids), props.pad(tokens, 0), props.pad(rows))
        self.free(frees)
        self._select(dsts, parents)
        r = jnp.asarray(props.pad(rows))
        tables = jnp.where((r >= 0)[:, None], self.state.block_tables[jnp.clip(r, 0, self.config.max_seqs - 1)],
                           pk.NULL_BLOCK)
        assert_same(out[4], tables)
        self._append(sids, tokens)
        assert_same(out[0], self.state)

    def __init__(self):
        super().__init__()
        self._saved = {name: getattr(props, name) for name in ("APPEND", "FORK", "SELECT", "FREE")}
        for name, fn in zip(self._saved, (pk.append, pk.fork, pk.select, pk.free)):
            setattr(props, name, functools.partial(both_targets, fn))

    def teardown(self):
        try:
            super().teardown()
        finally:
            for name, op in self._saved.items():
                setattr(props, name, op)


def _machine(base, examples):
    machine = type(base.__name__.replace("Machine", "BothTargets"), (BothTargets, base), {})
    machine.TestCase.settings = props.settings(props.SETTINGS, max_examples=examples)
    return machine.TestCase


TestCachingBothTargets = _machine(props.CachingMachine, 6)
TestPlainBothTargets = _machine(props.PlainMachine, 4)
TestDuplicatesBothTargets = _machine(props.DuplicatesMachine, 5)
TestWideBothTargets = _machine(props.WideTableMachine, 3)


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


@pytest.mark.parametrize("target", ["cpu", "gpu"])
@pytest.mark.parametrize("back,front", [(2, 1), (3, 0), (0, 3), (1, 1)])
def test_push_back_then_front_compacts_like_two_pushes(back, front, target):
    # Capacity 8, 6 entries in use, 2 of them live: pushing 3 overflows (a compaction), 2 fits.
    q = _queue(8, 8, [-1, 5, -1, -1, 6, -1], head=5)
    ids = jnp.array([1, 2, 3, 4], jnp.int32)
    back_m = jnp.arange(4) < back
    front_m = (jnp.arange(4) >= back) & (jnp.arange(4) < back + front)
    out = jax.jit(functools.partial(free_queue.push_back_then_front, target=target))(q, ids, back_m, front_m)
    assert_same(out, free_queue.push_front(free_queue.push_back(q, ids, back_m), ids, front_m))
    compacted = 6 + back + front > 8
    assert (int(out.size) == 2 + back + front) == compacted


def test_take_front_window_reports_stale_entries():
    # Three stale entries before the live ones: a 2-wide window cannot take 2 blocks.
    q = _queue(16, 8, [-1, -1, -1, 3, 4, 5])
    _, _, more = free_queue.take_front(q, jnp.int32(2), 2, straight=True)
    assert bool(more)
    q2, out = free_queue.take_front(q, jnp.int32(2), 2)
    assert np.asarray(out).tolist() == [3, 4]
    _, _, more = free_queue.take_front(q2, jnp.int32(2), 2, straight=True)
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


def _record(values: list, flag):
    """``flag`` (a traced bool) unchanged; its value is appended to ``values`` each time the
    program runs (which way a GPU form went)."""
    jax.debug.callback(lambda v: values.append(bool(v)), flag)
    return flag


def _recording(monkeypatch, module, name, values):
    inner = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: _record(values, inner(*args)))


def test_append_paths_agree_through_fills_evictions_and_rebuilds(monkeypatch):
    """Decode with one-token appends until the pool turns over several times: blocks fill (so
    they are cached), taken blocks are cached ones (evictions), tombstones pile up (rebuilds),
    and both targets stay identical throughout; the GPU form's check goes both ways."""
    slow = []
    _recording(monkeypatch, allocate, "_needs_loops", slow)
    append = lambda *args: pk.append(*args)  # a fresh function: a fresh trace, patched
    config = pk.ManagerConfig(num_blocks=12, block_size=2, max_seqs=4, max_blocks_per_seq=6)
    state = pk.init_state(config)
    rng = np.random.default_rng(0)
    rows = jnp.arange(config.max_seqs, dtype=jnp.int32)
    for step in range(60):
        if step % 10 == 0:
            state, _ = _jit(pk.free)(config, state, rows)
            prompts = rng.integers(0, 3, (config.max_seqs, 4)).astype(np.int32)
            state, _ = _jit(pk.admit)(config, state, rows, jnp.full((config.max_seqs,), 3, jnp.int32),
                                      jnp.asarray(prompts), jnp.zeros((config.max_seqs,), jnp.uint32))
        toks = jnp.asarray(rng.integers(0, 3, config.max_seqs).astype(np.int32))
        state, _ = both_targets(append, config, state, rows, toks)
    assert set(slow) == {True, False}, slow
    assert int(state.cache.stats.evictions) > 0


def test_evict_and_register_without_skips_are_identity_when_nothing_to_do():
    cache = pk.init_state(pk.ManagerConfig(num_blocks=12, block_size=2, max_seqs=4, max_blocks_per_seq=6)).cache
    taken = jnp.array([1, 2, 3], jnp.int32)
    none = jnp.zeros((3,), bool)
    assert_same(prefix_cache.evict(cache, taken, none, target="gpu"),
                prefix_cache.evict(cache, taken, none, target="cpu"))
    chains = jnp.ones((3, 2), jnp.uint32)
    parent = jnp.zeros((3, 2), jnp.int32)
    salts = jnp.zeros((3,), jnp.uint32)
    assert_same(prefix_cache.register(cache, taken, chains, salts, parent, none, straight=True),
                prefix_cache.register(cache, taken, chains, salts, parent, none))


def test_free_select_append_agrees_through_crowded_rings_and_slow_appends(monkeypatch):
    """The serving step's fused call over many steps of a tiny pool: beams reselect (releasing
    blocks, so stale entries and crowded rings come), rows are freed and readmitted, blocks fill
    and are evicted; both targets agree, and the GPU form's one check goes both ways, through
    each rare path (crowded ring, slow append)."""
    seen, crowded = [], []
    inner = fused.repair
    monkeypatch.setattr(fused, "repair", lambda slow, *args: inner(_record(seen, slow), *args))
    _recording(monkeypatch, fused, "_crowded", crowded)
    free_select_append = lambda *args: fused.free_select_append(*args)  # a fresh trace
    config = pk.ManagerConfig(num_blocks=14, block_size=2, max_seqs=4, max_blocks_per_seq=6, prefix_caching=True)
    state = pk.init_state(config)
    rng = np.random.default_rng(1)
    rows = jnp.arange(config.max_seqs, dtype=jnp.int32)
    none = jnp.full((config.max_seqs,), -1, jnp.int32)
    for step in range(48):
        if step % 8 == 0:
            state, _ = _jit(pk.free)(config, state, rows)
            prompts = rng.integers(0, 3, (config.max_seqs, 4)).astype(np.int32)
            lens = jnp.asarray(rng.integers(1, 5, config.max_seqs).astype(np.int32))
            state, _ = _jit(pk.admit)(config, state, rows, lens, jnp.asarray(prompts),
                                      jnp.zeros((config.max_seqs,), jnp.uint32))
        parents = jnp.asarray(rng.integers(0, config.max_seqs, config.max_seqs).astype(np.int32))
        dst = rows if step % 3 else none
        frees = jnp.asarray(np.where(rng.random(config.max_seqs) < 0.15, np.arange(config.max_seqs), -1)
                            .astype(np.int32))
        toks = jnp.asarray(rng.integers(0, 3, config.max_seqs).astype(np.int32))
        state = both_targets(free_select_append, config, state, frees, dst, parents, rows, toks,
                             jnp.array([0, 2], jnp.int32))[0]
    assert set(seen) == {True, False}, seen
    assert True in crowded and seen.count(True) > crowded.count(True), (seen, crowded)  # both rare paths


def test_target_is_validated():
    with pytest.raises(ValueError, match="target must be one of .*'auto', 'cpu', 'gpu'.*got 'tpu'"):
        pk.ManagerConfig(num_blocks=8, target="tpu")
