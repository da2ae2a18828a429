"""Spans (``paged_kv.spans``): extend / commit / truncate, worked examples.

The random mixes with every other operation, against the plain-Python reference, are rules of the
machines in ``tests/test_block_manager_properties.py``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv as pk
from paged_kv.invariants import check_invariants, free_queue_order

EXTEND = jax.jit(pk.extend, static_argnums=0, static_argnames=("commit", "max_new"))
COMMIT = jax.jit(pk.commit, static_argnums=0)
TRUNCATE = jax.jit(pk.truncate, static_argnums=0, static_argnames="keep_reserved")
_jit = functools.partial(jax.jit, static_argnums=0)
ADMIT, APPEND, FORK, FREE = map(_jit, (pk.admit, pk.append, pk.fork, pk.free))

OK, NO_FREE, BAD_SEQ, BAD_LEN = pk.Status.OK, pk.Status.NO_FREE_BLOCKS, pk.Status.BAD_SEQUENCE, pk.Status.BAD_LENGTH


def ids(*xs):
    return jnp.asarray(xs, jnp.int32)


def admit(config, state, sid, prompt):
    state, r = ADMIT(config, state, ids(sid), ids(len(prompt)), jnp.asarray([prompt], jnp.int32))
    assert int(r.status[0]) == OK
    return state, r


def extend(config, state, sid, tokens, k=None, commit=False):
    k = len(tokens) if k is None else k
    return EXTEND(config, state, ids(sid), ids(k), jnp.asarray([tokens], jnp.int32), commit=commit)


def cached(state):
    return set(np.flatnonzero(np.asarray(state.cache.slot) >= 0).tolist())


CFG = pk.ManagerConfig(num_blocks=32, block_size=4, max_seqs=4, max_blocks_per_seq=16)


def test_prompt_drafts_commit_truncate():
    """40-token prompt (10 full blocks), 5 drafts (2 new blocks), commit 2, truncate the rest."""
    prompt = list(range(40))
    state, _ = admit(CFG, pk.init_state(CFG), 0, prompt)
    row = np.asarray(state.block_tables[0])[:10].tolist()
    assert cached(state) == set(row)
    state, r = extend(CFG, state, 0, [100, 101, 102, 103, 104])
    assert int(r.status[0]) == OK and int(r.num_copies) == 0
    table = np.asarray(state.block_tables[0])
    assert table[12] == 0 and table[10] != 0 and table[11] != 0
    assert np.asarray(r.slots[0]).tolist() == [table[10] * 4, table[10] * 4 + 1, table[10] * 4 + 2,
                                               table[10] * 4 + 3, table[11] * 4]
    assert (int(state.num_tokens[0]), int(state.num_committed[0]), int(state.num_uncommitted[0])) == (45, 40, 5)
    assert cached(state) == set(row), "a block holding drafts was cached"
    check_invariants(CFG, state)

    # A prompt equal to the row with its drafts hits only the committed blocks.
    probe, hit = admit(CFG, state, 1, prompt + [100, 101, 102, 103, 104, 7])
    assert int(hit.cached_tokens[0]) == 40

    state, status = COMMIT(CFG, state, ids(0), ids(2), jnp.asarray([[100, 101, 0, 0, 0]], jnp.int32))
    assert int(status[0]) == OK and int(state.num_committed[0]) == 42
    assert cached(state) == set(row), "block 10 holds drafts 102, 103: not cached yet"
    free_before = int(state.queue.num_free)
    state, status = TRUNCATE(CFG, state, ids(0), ids(42), keep_reserved=False)
    assert int(status[0]) == OK and int(state.num_tokens[0]) == 42
    assert int(state.queue.num_free) == free_before + 1
    assert free_queue_order(state)[0] == table[11], "a draft-only block goes to the front"
    assert np.asarray(state.block_tables[0])[11] == 0
    check_invariants(CFG, state)

    # Commit the accepted token through extend: block 10 fills with committed tokens only.
    state, r = extend(CFG, state, 0, [55, 56], commit=True)
    assert int(r.status[0]) == OK and int(state.num_uncommitted[0]) == 0
    assert table[10] in cached(state)
    assert np.asarray(state.cache.tokens)[table[10]].tolist() == [100, 101, 55, 56]
    check_invariants(CFG, state)
    # The row has no span left: append works again.
    state, a = APPEND(CFG, state, ids(0), ids(9))
    assert int(a.status[0]) == OK


def test_extend_copies_a_shared_last_block():
    state, _ = admit(CFG, pk.init_state(CFG), 0, [1, 2, 3, 4, 5, 6])
    state, status = FORK(CFG, state, ids(0), ids(1))
    assert int(status[0]) == OK
    old = int(state.block_tables[0, 1])
    state, r = extend(CFG, state, 0, [7, 8, 9])
    assert int(r.status[0]) == OK and int(r.num_copies) == 1
    new = int(state.block_tables[0, 1])
    assert (int(r.copy_src[0]), int(r.copy_dst[0])) == (old, new) and new != old
    assert int(state.block_tables[1, 1]) == old and int(state.ref_count[old]) == 1
    third = int(state.block_tables[0, 2])
    assert np.asarray(r.slots[0]).tolist() == [new * 4 + 2, new * 4 + 3, third * 4]
    assert np.asarray(state.cache.tokens)[new].tolist() == [5, 6, 7, 8]
    check_invariants(CFG, state)
    # The sibling extends into the block it now holds alone: in place, no copy.
    state, r = extend(CFG, state, 1, [10])
    assert int(r.num_copies) == 0 and int(r.slots[0, 0]) == old * 4 + 2


def test_keep_reserved_blocks_are_reused():
    state, _ = admit(CFG, pk.init_state(CFG), 0, [1, 2, 3, 4])
    state, r = extend(CFG, state, 0, [5, 6, 7, 8, 9, 10, 11, 12, 13])  # 3 new blocks
    span_blocks = np.asarray(state.block_tables[0])[1:4].tolist()
    state, status = TRUNCATE(CFG, state, ids(0), ids(4), keep_reserved=True)
    assert int(status[0]) == OK
    assert (int(state.num_tokens[0]), int(state.num_reserved[0])) == (4, 3)
    assert np.asarray(state.block_tables[0])[1:4].tolist() == span_blocks
    check_invariants(CFG, state)
    # append refuses a row with reserved blocks; extend reuses them, in column order.
    state, a = APPEND(CFG, state, ids(0), ids(1))
    assert int(a.status[0]) == BAD_LEN
    free_before = int(state.queue.num_free)
    state, r = extend(CFG, state, 0, [20, 21, 22, 23, 24])
    assert int(r.status[0]) == OK and int(state.queue.num_free) == free_before
    assert np.asarray(state.block_tables[0])[1:3].tolist() == span_blocks[:2]
    assert int(state.num_reserved[0]) == 1
    check_invariants(CFG, state)
    # free releases the reserved block too: everything comes back.
    state, _ = FREE(CFG, state, ids(0))
    check_invariants(CFG, state)
    assert int(state.queue.num_free) == CFG.num_blocks - 1


def test_truncate_never_goes_below_committed_and_fork_refuses_drafts():
    state, _ = admit(CFG, pk.init_state(CFG), 0, [1, 2, 3, 4, 5])
    state, _ = extend(CFG, state, 0, [6, 7])
    before = state
    state, status = TRUNCATE(CFG, state, ids(0, 0), ids(4, 5), keep_reserved=False)
    assert np.asarray(status).tolist() == [BAD_LEN, BAD_SEQ]
    state, status = TRUNCATE(CFG, state, ids(0), ids(8), keep_reserved=False)
    assert int(status[0]) == BAD_LEN
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), before, state))
    state, status = FORK(CFG, state, ids(0), ids(1))
    assert int(status[0]) == BAD_SEQ
    state, status = COMMIT(CFG, state, ids(0), ids(3), jnp.zeros((1, 3), jnp.int32))
    assert int(status[0]) == BAD_LEN, "only 2 tokens are uncommitted"


def test_all_or_nothing_first_come_first_served():
    cfg = pk.ManagerConfig(num_blocks=6, block_size=4, max_seqs=4, max_blocks_per_seq=8)
    state = pk.init_state(cfg)
    state, _ = ADMIT(cfg, state, ids(0, 1, 2), ids(4, 4, 4), jnp.asarray([[1] * 4, [2] * 4, [3] * 4], jnp.int32))
    assert int(state.queue.num_free) == 2
    tokens = jnp.zeros((3, 12), jnp.int32)
    # Row 0 needs 3 blocks (fails), row 1 needs 1 (fits, but must not overtake), row 2 needs 0.
    before = state
    state, r = EXTEND(cfg, state, ids(0, 1, 2), ids(9, 1, 0), tokens)
    assert np.asarray(r.status).tolist() == [NO_FREE, NO_FREE, OK]
    assert int(state.queue.num_free) == 2 and int(state.num_tokens[0]) == 4
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), before, state))
    state, r = EXTEND(cfg, state, ids(0, 1), ids(8, 1), tokens[:2])
    assert np.asarray(r.status).tolist() == [OK, NO_FREE]
    check_invariants(cfg, state)


@pytest.mark.parametrize("groups", [pk.ManagerConfig(num_blocks=2).groups,
                                    (pk.Group("full"), pk.Group("window", 5))])
def test_append_equals_extend_one_committed(groups):
    """``append`` and ``extend(1, commit=True)`` give the same tables, counts, queue and cache."""
    cfg = pk.ManagerConfig(num_blocks=24, block_size=2, max_seqs=4, max_blocks_per_seq=12, groups=groups)
    state, _ = ADMIT(cfg, pk.init_state(cfg), ids(0, 1), ids(3, 2), jnp.asarray([[1, 2, 1], [1, 2, 0]], jnp.int32))
    state, _ = FORK(cfg, state, ids(0), ids(2))
    a = e = state
    rng = np.random.default_rng(0)
    for _ in range(6):
        toks = rng.integers(0, 3, size=3).astype(np.int32)
        a, ra = APPEND(cfg, a, ids(0, 2, 1), jnp.asarray(toks))
        e, re = EXTEND(cfg, e, ids(0, 2, 1), ids(1, 1, 1), jnp.asarray(toks)[:, None], commit=True)
        assert np.asarray(ra.status).tolist() == np.asarray(re.status).tolist()
        assert np.asarray(ra.slots).tolist() == np.asarray(re.slots)[:, 0].tolist()
        assert np.asarray(ra.copy_dst).tolist() == np.asarray(re.copy_dst).tolist()
        for name in ("ref_count", "block_tables", "num_tokens", "spans", "seq_chain"):
            assert (np.asarray(getattr(a, name)) == np.asarray(getattr(e, name))).all(), name
        assert free_queue_order(a) == free_queue_order(e)
        assert cached(a) == cached(e)
        check_invariants(cfg, e)


def test_window_group_reclaims_what_the_span_no_longer_sees():
    cfg = pk.ManagerConfig(num_blocks=32, block_size=2, max_seqs=2, max_blocks_per_seq=12,
                           groups=(pk.Group("full"), pk.Group("window", 4)))
    state, _ = admit(cfg, pk.init_state(cfg), 0, [1, 2, 3, 4, 5, 6, 7, 8])
    window_blocks = np.asarray(state.tables[1, 0])[:4].tolist()
    state, r = extend(cfg, state, 0, [9, 10, 11])
    assert int(r.status[0]) == OK and np.asarray(r.slots).shape == (1, 3, 2)
    # The first new token (position 8) sees positions 5..8: blocks 0 and 1 (positions 0..3) go.
    assert np.asarray(state.null_prefix)[1, 0] == 2
    assert np.asarray(state.tables[1, 0])[:2].tolist() == [0, 0]
    assert not set(window_blocks[:2]) & set(np.asarray(state.tables[1, 0]).tolist())
    check_invariants(cfg, state)
    # Drafts do not move the window: truncating back to the committed 8 tokens keeps it valid.
    state, status = TRUNCATE(cfg, state, ids(0), ids(8), keep_reserved=True)
    assert int(status[0]) == OK and int(state.num_reserved[0]) == 2
    check_invariants(cfg, state)
    state, r = extend(cfg, state, 0, [9, 10, 11, 12], commit=True)
    assert int(r.status[0]) == OK and int(state.num_reserved[0]) == 0
    check_invariants(cfg, state)


def test_chunked_group_reclaims_closed_chunks_on_extend():
    """A chunk of 4 tokens, blocks of 2: a query at position p reads only p's chunk, so once the span's
    first new token (position 8) opens chunk 2, chunks 0 and 1 (blocks 0..3) are read no more."""
    cfg = pk.ManagerConfig(num_blocks=32, block_size=2, max_seqs=2, max_blocks_per_seq=12,
                           groups=(pk.Group("full"), pk.Group.of(pk.ChunkedLocal(4))))
    state, _ = admit(cfg, pk.init_state(cfg), 0, [1, 2, 3, 4, 5, 6, 7, 8])
    state, r = extend(cfg, state, 0, [9, 10, 11])
    assert int(r.status[0]) == OK
    assert np.asarray(state.null_prefix)[1, 0] == 4
    assert np.asarray(state.tables[1, 0])[:4].tolist() == [0, 0, 0, 0]
    check_invariants(cfg, state)


def test_targets_give_the_same_bits():
    out = []
    for target in ("cpu", "gpu"):
        cfg = pk.ManagerConfig(num_blocks=16, block_size=4, max_seqs=2, max_blocks_per_seq=8, target=target)
        state, _ = admit(cfg, pk.init_state(cfg), 0, [1, 2, 3, 4, 5])
        state, r = extend(cfg, state, 0, [6, 7, 8, 9, 10])
        state, _ = COMMIT(cfg, state, ids(0), ids(3), jnp.asarray([[6, 7, 8]], jnp.int32))
        state, _ = TRUNCATE(cfg, state, ids(0), ids(9), keep_reserved=True)
        out.append(jax.tree.leaves((state, r)))
    assert all((np.asarray(x) == np.asarray(y)).all() for x, y in zip(*out))


def test_extend_checks_its_arguments():
    state = pk.init_state(CFG)
    with pytest.raises(ValueError, match="max_new"):
        pk.extend(CFG, state, ids(0), ids(1))
    with pytest.raises(ValueError, match="token_ids"):
        pk.extend(CFG, state, ids(0), ids(1), commit=True, max_new=2)
    with pytest.raises(ValueError, match="num_new"):
        pk.extend(CFG, state, ids(0), jnp.asarray([1.0]), max_new=2)
    with pytest.raises(ValueError, match="token_ids"):
        pk.commit(CFG, state, ids(0), ids(1))


def test_block_manager_spans():
    bm = pk.BlockManager(CFG)
    bm.admit([0], [list(range(6))])
    r = bm.extend([0], [[6, 7, 8]])
    assert r.status.tolist() == [OK] and r.slots.shape == (1, 3)
    assert (bm.num_tokens(0), bm.num_committed(0)) == (9, 6)
    assert bm.commit([0], [[6]]).tolist() == [OK]
    assert bm.truncate([0], [6], keep_reserved=True).tolist() == [BAD_LEN]
    assert bm.truncate([0], [7], keep_reserved=True).tolist() == [OK]
    assert bm.append([0], [1]).status.tolist() == [BAD_LEN]  # a reserved block: extend instead
    r = bm.extend([0], [[1]], commit=True)
    assert r.status.tolist() == [OK] and bm.num_committed(0) == 8
    with pytest.raises(ValueError, match="token lists"):
        bm.extend([0], [[1], [2]])
    with pytest.raises(KeyError):
        bm.commit([1], [[1]])
    check_invariants(CFG, bm.state)
