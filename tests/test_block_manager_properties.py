"""Long random operation sequences through the jitted manager and the plain-Python reference.

After every step the two must agree on every output (statuses, slots, copy lists, cached and
shared prompt tokens) and on the whole state (tables, counts, free-queue order, which blocks are
cached, cache statistics), and the invariants of docs/design.md must hold. The pool is tiny so that running
out of blocks, copy-on-write groups, evictions and table-full rows happen often, and the token
vocabulary is tiny so that prompts share prefixes. Rows include padding, out-of-range, repeated and
not-running ids, which the jitted functions must reject with a status while leaving the state
alone. The reference keys its cache by exact prefixes, so agreement also shows that the hashed
cache behaves as an exact one.
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

BATCH = 6  # every call is padded to this many rows: one compilation per operation
WIDTH = 24  # prompt token array width
MAX_SEQS = 6

_jit = functools.partial(jax.jit, static_argnums=0)
ADMIT, APPEND, FORK, SELECT, FREE, RESET, COMMIT = map(
    _jit, (pk.admit, pk.append, pk.fork, pk.select, pk.free, pk.reset_prefix_cache, pk.commit)
)
EXTEND = jax.jit(pk.extend, static_argnums=0, static_argnames=("commit", "max_new"))
TRUNCATE = jax.jit(pk.truncate, static_argnums=0, static_argnames="keep_reserved")
SPAN = 5  # K: the token width of extend / commit calls

seq_id = st.integers(-1, MAX_SEQS)  # -1 padding, MAX_SEQS out of range
ids = st.lists(seq_id, min_size=1, max_size=BATCH)
token = st.integers(0, 2)
prompt = st.one_of(
    st.lists(token, min_size=0, max_size=WIDTH),
    # Long shared prefixes, so that cached and in-call sharing chains are deep.
    st.tuples(st.integers(0, WIDTH), st.lists(token, max_size=6)).map(
        lambda t: ([1, 2, 0, 1] * 6)[: t[0]] + t[1]
    ),
)


def pad(values, fill=-1):
    out = np.full((BATCH,), fill, np.int32)
    out[: len(values)] = values
    return jnp.asarray(out)


class ManagerMachine(RuleBasedStateMachine):
    config: pk.ManagerConfig

    def __init__(self):
        super().__init__()
        self.state = pk.init_state(self.config)
        self.ref = ReferenceBlockManager(self.config)

    def running(self):
        return sorted(self.ref.tables)

    def check_status(self, got, expected):
        assert np.asarray(got)[: len(expected)].tolist() == [int(s) for s in expected]
        assert (np.asarray(got)[len(expected):] == pk.Status.PADDING).all()

    @rule(rows=st.lists(st.tuples(seq_id, prompt, st.integers(0, 1)), min_size=1, max_size=BATCH))
    def admit(self, rows):
        sids = [r[0] for r in rows]
        prompts = [r[1][:WIDTH] for r in rows]
        salts = [r[2] for r in rows]
        tokens = np.zeros((BATCH, WIDTH), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        lens = [len(p) for p in prompts]
        self.state, result = ADMIT(self.config, self.state, pad(sids), pad(lens, 0),
                                   jnp.asarray(tokens), pad(salts, 0).astype(jnp.uint32))
        expected = self.ref.admit(sids, prompts, salts, max_len=WIDTH)
        self.check_status(result.status, [e[0] for e in expected])
        k = len(rows)
        assert np.asarray(result.cached_tokens)[:k].tolist() == [e[1] for e in expected]
        assert np.asarray(result.shared_tokens)[:k].tolist() == [e[2] for e in expected]

    @rule(row=st.tuples(seq_id, prompt, st.integers(0, 1)))
    def admit_one(self, row):
        """A call of exactly one request: the path that skips in-call sharing (shapes [1])."""
        self._admit_one(row)

    def _admit_one(self, row) -> int:
        """``admit_one``; returns the cached tokens."""
        sid, p, salt = row[0], row[1][:WIDTH], row[2]
        tokens = np.zeros((1, WIDTH), np.int32)
        tokens[0, : len(p)] = p
        self.state, result = ADMIT(self.config, self.state, jnp.array([sid], jnp.int32),
                                   jnp.array([len(p)], jnp.int32), jnp.asarray(tokens),
                                   jnp.array([salt], jnp.uint32))
        (status, cached, shared), = self.ref.admit([sid], [p], [salt], max_len=WIDTH)
        assert int(result.status[0]) == int(status)
        assert (int(result.cached_tokens[0]), int(result.shared_tokens[0])) == (cached, shared)
        return cached

    @rule(sids=ids, tokens=st.lists(token, min_size=BATCH, max_size=BATCH))
    def append_some(self, sids, tokens):
        self._append(sids, tokens[: len(sids)])

    @rule(data=st.data())
    def append_all_running(self, data):
        running = self.running()
        if running:
            order = data.draw(st.permutations(running))
            self._append(order, data.draw(st.lists(token, min_size=len(order), max_size=len(order))))

    def _append(self, sids, tokens):
        self.state, result = APPEND(self.config, self.state, pad(sids), pad(tokens, 0))
        statuses, slots, src, dst = self.ref.append(sids, tokens)
        self.check_status(result.status, statuses)
        k = len(sids)
        assert np.asarray(result.slots)[:k].tolist() == slots
        assert np.asarray(result.copy_src)[:k].tolist() == src
        assert np.asarray(result.copy_dst)[:k].tolist() == dst
        assert int(result.num_copies) == sum(d != pk.NULL_BLOCK for d in dst)
        # The copy list never chains: copy_blocks may run its copies in any order.
        copies = [(a, b) for a, b in zip(np.asarray(result.copy_src).tolist(), np.asarray(result.copy_dst).tolist())
                  if b != pk.NULL_BLOCK]
        dsts = [b for _, b in copies]
        assert len(set(dsts)) == len(dsts), f"a block is copied into twice: {copies}"
        assert not set(dsts) & {a for a, _ in copies}, f"a copy destination is also a source: {copies}"

    @rule(src=seq_id, dsts=ids)
    def fork(self, src, dsts):
        srcs = [src] * len(dsts)
        self.state, status = FORK(self.config, self.state, pad(srcs), pad(dsts))
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
        self.state, status = SELECT(self.config, self.state, pad(dsts), pad(parents))
        self.check_status(status, self.ref.select(dsts, parents))

    # -- spans: extend / commit / truncate, mixed with every other operation ------------------

    def _span_counts(self, data, sids, limit):
        """Per row a count: mostly within ``[0, limit(sid)]``, sometimes out of range."""
        return [data.draw(st.one_of(st.integers(0, max(0, limit(s))), st.sampled_from([-1, SPAN + 1])))
                for s in sids]

    @rule(data=st.data(), sids=ids, commit=st.booleans())
    def extend(self, data, sids, commit):
        counts = self._span_counts(data, sids, lambda s: SPAN)
        tokens = data.draw(st.lists(st.lists(token, min_size=SPAN, max_size=SPAN), min_size=BATCH, max_size=BATCH))
        self.state, result = EXTEND(self.config, self.state, pad(sids), pad(counts, 0), jnp.asarray(tokens, jnp.int32),
                                    commit=commit)
        statuses, slots, src, dst = self.ref.extend(sids, counts, tokens, SPAN, commit=commit)
        self.check_status(result.status, statuses)
        k = len(sids)
        assert np.asarray(result.slots)[:k].tolist() == slots
        assert np.asarray(result.copy_src)[:k].tolist() == src
        assert np.asarray(result.copy_dst)[:k].tolist() == dst

    @rule(data=st.data(), sids=ids)
    def commit(self, data, sids):
        counts = self._span_counts(data, sids, lambda s: self.ref.uncommitted.get(s, 0))
        tokens = data.draw(st.lists(st.lists(token, min_size=SPAN, max_size=SPAN), min_size=BATCH, max_size=BATCH))
        self.state, status = COMMIT(self.config, self.state, pad(sids), pad(counts, 0), jnp.asarray(tokens, jnp.int32))
        self.check_status(status, self.ref.commit(sids, counts, tokens, SPAN))

    @rule(data=st.data(), sids=ids, keep=st.booleans())
    def truncate(self, data, sids, keep):
        def length(s):
            n = self.ref.num_tokens.get(s, 1)
            c = n - self.ref.uncommitted.get(s, 0)
            return data.draw(st.one_of(st.integers(c, n), st.just(c), st.sampled_from([c - 1, n + 1])))

        lens = [length(s) for s in sids]
        self.state, status = TRUNCATE(self.config, self.state, pad(sids), pad(lens, 0), keep_reserved=keep)
        self.check_status(status, self.ref.truncate(sids, lens, keep))

    @rule(data=st.data())
    def admit_drafts_as_prompt(self, data):
        """A prompt equal to a running row's tokens, drafts included: its hit never reaches a
        block that holds a draft (the reference, keyed by committed prefixes, agrees too)."""
        running, free = self.running(), [s for s in range(MAX_SEQS) if s not in self.ref.tables]
        if not running or not free or not self.config.prefix_caching:
            return
        s = data.draw(st.sampled_from(running))
        bs, n = self.config.block_size, self.ref.num_tokens[s]
        table = np.asarray(self.state.block_tables[s])
        stored = np.asarray(self.state.cache.tokens)
        toks = [int(stored[table[p // bs], p % bs]) for p in range(n)] + [0]
        if len(toks) > WIDTH:
            return
        drafts = set()
        for r in running:
            c = self.ref.num_tokens[r] - self.ref.uncommitted.get(r, 0)
            first = c // bs if self.ref.uncommitted.get(r, 0) else len(self.ref.tables[r])
            drafts |= set(self.ref.tables[r][first:]) | set(self.ref.span_of(r)[1])
        cached = self._admit_one((free[0], toks, 0))
        if free[0] in self.ref.tables:
            hit = np.asarray(self.state.block_tables[free[0]])[: cached // bs]
            assert not set(hit.tolist()) & drafts, f"a prefix hit on a block holding a draft: {hit} {drafts}"

    @rule(sids=ids)
    def free(self, sids):
        self.state, status = FREE(self.config, self.state, pad(sids))
        self.check_status(status, self.ref.free(sids))

    @rule()
    def reset_prefix_cache(self):
        self.state, dropped = RESET(self.config, self.state)
        expected = self.ref.reset_prefix_cache() if self.config.prefix_caching else 0
        assert int(dropped) == expected

    @invariant()
    def agrees_with_reference_and_invariants_hold(self):
        assert snapshot(self.config, self.state) == reference_snapshot(self.ref)
        check_invariants(self.config, self.state)

    def teardown(self):
        # No leak: once everything is freed, every block but the null block is free.
        self.state, _ = FREE(self.config, self.state, pad(self.running()))
        check_invariants(self.config, self.state)
        assert int(self.state.queue.num_free) == self.config.num_blocks - 1
        assert not np.asarray(self.state.ref_count).any()


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class CachingMachine(ManagerMachine):
    config = pk.ManagerConfig(num_blocks=14, block_size=4, max_seqs=MAX_SEQS, max_blocks_per_seq=7)


class PlainMachine(ManagerMachine):
    config = pk.ManagerConfig(num_blocks=14, block_size=4, max_seqs=MAX_SEQS, max_blocks_per_seq=7,
                              prefix_caching=False)


class WideTableMachine(ManagerMachine):
    """One-token blocks and 24-column tables: fork, select and free switch between restricting
    themselves to 16 columns and using all 24."""

    config = pk.ManagerConfig(num_blocks=40, block_size=1, max_seqs=MAX_SEQS, max_blocks_per_seq=24)


PATTERN = [1, 2, 0, 1, 2, 2, 0, 1] * 4
"""Every prompt of the duplicates machine is a prefix of this, so full blocks repeat."""


class DuplicatesMachine(CachingMachine):
    """Streams full of duplicate full blocks: short repeated prompts, prompts exactly one block
    long, and appends that complete a block another sequence holds (each sequence continues the
    same pattern). Every full block is cached, duplicates too, and a lookup finds the oldest, as
    in vLLM; the reference keys its cache by exact prefix, so agreement shows that no duplicate
    hides a cached prefix."""

    config = pk.ManagerConfig(num_blocks=16, block_size=4, max_seqs=MAX_SEQS, max_blocks_per_seq=7,
                              uncached_to_front=False)

    @rule(rows=st.lists(st.tuples(seq_id, st.sampled_from([4, 4, 8, 8, 5, 9, 12, 3]), st.integers(0, 1)),
                        min_size=1, max_size=3))
    def admit_pattern(self, rows):
        self.admit([(sid, PATTERN[:n], salt) for sid, n, salt in rows])

    @rule(row=st.tuples(seq_id, st.sampled_from([4, 8, 5, 12])))
    def admit_one_pattern(self, row):
        self.admit_one((row[0], PATTERN[:row[1]], 0))

    @rule(data=st.data())
    def append_pattern(self, data):
        """Running sequences continue the pattern, so the blocks they fill equal other ones."""
        running = self.running()
        if running:
            order = data.draw(st.permutations(running))
            nxt = [PATTERN[len(self.ref.seq_tokens[s]) % len(PATTERN)] for s in order]
            self._append(order, nxt)


CachingMachine.TestCase.settings = SETTINGS
PlainMachine.TestCase.settings = settings(SETTINGS, max_examples=40)
WideTableMachine.TestCase.settings = settings(SETTINGS, max_examples=30)
DuplicatesMachine.TestCase.settings = settings(SETTINGS, max_examples=40)
TestPrefixCachingManager = CachingMachine.TestCase
TestDuplicateBlocks = DuplicatesMachine.TestCase
TestPlainManager = PlainMachine.TestCase
TestWideTableManager = WideTableMachine.TestCase
