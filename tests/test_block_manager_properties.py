"""Long random operation sequences through the jitted manager and the plain-Python reference.

After every step the two must agree on every output (statuses, slots, copy lists) and on the whole
state (tables, counts, free-queue order), and DESIGN.md's invariants must hold. The pool is tiny so
that running out of blocks, copy-on-write groups and table-full rows happen often. Rows include
padding, out-of-range, repeated and not-running ids, which the jitted functions must reject with a
status while leaving the state alone.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import paged_kv as pk
from paged_kv.invariants import check_invariants
from paged_kv.reference import ReferenceBlockManager
from tests.helpers import reference_snapshot, snapshot

CFG = pk.ManagerConfig(num_blocks=14, block_size=4, max_seqs=6, max_blocks_per_seq=5)
BATCH = 6  # every call is padded to this many rows: one compilation per operation

_jit = functools.partial(jax.jit, static_argnums=0)
ADMIT, APPEND, FORK, SELECT, FREE = map(_jit, (pk.admit, pk.append, pk.fork, pk.select, pk.free))

seq_id = st.integers(-1, CFG.max_seqs)  # -1 padding, max_seqs out of range
ids = st.lists(seq_id, min_size=1, max_size=BATCH)


def pad(values, fill=-1):
    out = np.full((BATCH,), fill, np.int32)
    out[: len(values)] = values
    return jnp.asarray(out)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.state = pk.init_state(CFG)
        self.ref = ReferenceBlockManager(CFG)

    def running(self):
        return sorted(self.ref.tables)

    def check_status(self, got, expected):
        assert np.asarray(got)[: len(expected)].tolist() == [int(s) for s in expected]
        assert (np.asarray(got)[len(expected):] == pk.Status.PADDING).all()

    @rule(rows=st.lists(st.tuples(seq_id, st.integers(0, 22)), min_size=1, max_size=BATCH))
    def admit(self, rows):
        sids, lens = [r[0] for r in rows], [r[1] for r in rows]
        self.state, status = ADMIT(CFG, self.state, pad(sids), pad(lens, 0))
        self.check_status(status, self.ref.admit(sids, lens))

    @rule(sids=ids)
    def append_some(self, sids):
        self._append(sids)

    @rule(data=st.data())
    def append_all_running(self, data):
        running = self.running()
        if running:
            self._append(data.draw(st.permutations(running)))

    def _append(self, sids):
        self.state, result = APPEND(CFG, self.state, pad(sids))
        statuses, slots, src, dst = self.ref.append(sids)
        self.check_status(result.status, statuses)
        k = len(sids)
        assert np.asarray(result.slots)[:k].tolist() == slots
        assert np.asarray(result.copy_src)[:k].tolist() == src
        assert np.asarray(result.copy_dst)[:k].tolist() == dst
        assert int(result.num_copies) == sum(d != pk.NULL_BLOCK for d in dst)

    @rule(src=seq_id, dsts=ids)
    def fork(self, src, dsts):
        srcs = [src] * len(dsts)
        self.state, status = FORK(CFG, self.state, pad(srcs), pad(dsts))
        self.check_status(status, self.ref.fork(srcs, dsts))

    @rule(data=st.data())
    def beam_select(self, data):
        """Every running row takes a random running parent (some paths die)."""
        running = self.running()
        if running:
            parents = data.draw(st.lists(st.sampled_from(running), min_size=len(running),
                                         max_size=len(running)))
            self._select(running, parents)

    @rule(dsts=ids, parents=st.lists(seq_id, min_size=BATCH, max_size=BATCH))
    def select_any(self, dsts, parents):
        self._select(dsts, parents[: len(dsts)])

    def _select(self, dsts, parents):
        self.state, status = SELECT(CFG, self.state, pad(dsts), pad(parents))
        self.check_status(status, self.ref.select(dsts, parents))

    @rule(sids=ids)
    def free(self, sids):
        self.state, status = FREE(CFG, self.state, pad(sids))
        self.check_status(status, self.ref.free(sids))

    @invariant()
    def agrees_with_reference_and_invariants_hold(self):
        assert snapshot(CFG, self.state) == reference_snapshot(self.ref)
        check_invariants(CFG, self.state)

    def teardown(self):
        # No leak: once everything is freed, every block but the null block is free.
        self.state, _ = FREE(CFG, self.state, pad(self.running()))
        check_invariants(CFG, self.state)
        assert int(self.state.queue.num_free) == CFG.num_blocks - 1
        assert not np.asarray(self.state.ref_count).any()


ManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerMachine = ManagerMachine.TestCase
