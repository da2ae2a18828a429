"""The worked examples of docs/design.md, each as a test, through the host wrapper and the
pure functions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv as pk
from paged_kv.invariants import check_invariants
from tests.helpers import state_from_tables

# A fast check of this area on every supported JAX (CI runs it on the oldest pair too).
pytestmark = pytest.mark.smoke

CFG = pk.ManagerConfig(num_blocks=128, block_size=16, max_seqs=8, max_blocks_per_seq=80)


def tok(ids):
    """Token ids to append: any will do for allocation; distinct per row so blocks differ."""
    return [100 + i for i in range(len(ids))]


@pytest.fixture
def bm():
    return pk.BlockManager(CFG)


def test_40_token_prompt_gets_3_blocks(bm):
    assert bm.admit([0], [list(range(40))]).status.tolist() == [pk.Status.OK]
    assert len(bm.table(0)) == 3
    assert bm.usage()["used"] == 3
    check_invariants(CFG, bm.state)


def test_40_plus_1000_tokens_end_at_65_blocks_with_62_lazy_allocations(bm):
    bm.admit([0], [list(range(40))])
    lazy = 0
    for step in range(1000):
        before = len(bm.table(0))
        result = bm.append([0], tok([0]))
        assert result.status.tolist() == [pk.Status.OK]
        grew = len(bm.table(0)) - before
        lazy += grew
        # A block only when the last one is full: token 40 + step lands at offset (40+step) % 16.
        assert grew == int((40 + step) % 16 == 0)
        assert result.num_copies == 0
    assert bm.num_tokens(0) == 1040
    assert len(bm.table(0)) == 65 and lazy == 62
    check_invariants(CFG, bm.state)


def test_two_samples_share_then_copy_on_first_write(bm):
    bm.admit([0], [list(range(20))])
    bm.fork(0, [1])
    shared = bm.table(0)
    assert bm.table(1) == shared and len(shared) == 2
    assert [bm.ref_count(b) for b in shared] == [2, 2]

    first = bm.append([0], tok([0]))  # sample 1 writes token 21 into the shared, partly full block
    assert first.num_copies == 1
    assert (first.copy_src[0], first.copy_dst[0]) == (shared[1], bm.table(0)[1])
    assert bm.table(0)[0] == shared[0] and bm.table(0)[1] != shared[1]
    assert bm.ref_count(shared[1]) == 1 and bm.ref_count(shared[0]) == 2
    assert first.slots[0] == bm.table(0)[1] * 16 + 4

    second = bm.append([1], tok([1]))  # sample 2 is now the only holder: in place, no copy
    assert second.num_copies == 0 and bm.table(1) == shared
    assert second.slots[0] == shared[1] * 16 + 4
    check_invariants(CFG, bm.state)


def test_full_last_block_is_never_copied(bm):
    bm.admit([0], [list(range(32))])
    bm.fork(0, [1, 2])
    result = bm.append([0, 1, 2], tok([0, 1, 2]))
    assert result.num_copies == 0
    assert [len(bm.table(s)) for s in range(3)] == [3, 3, 3]
    assert [bm.ref_count(b) for b in bm.table(0)[:2]] == [3, 3]
    check_invariants(CFG, bm.state)


@pytest.mark.parametrize("writers, copies", [(4, 3), (3, 3), (2, 2), (1, 1)])
def test_w_writers_of_a_block_with_count_r(bm, writers, copies):
    """r = 4 tables share a partly full block; w write in one step: w - 1 copies if w == r else w."""
    bm.admit([0], [list(range(20))])
    bm.fork(0, [1, 2, 3])
    block = bm.table(0)[1]
    result = bm.append(list(range(writers)), tok(list(range(writers))))
    assert result.num_copies == copies
    assert bm.ref_count(block) == 4 - copies
    srcs = result.copy_src[result.copy_dst != pk.NULL_BLOCK]
    assert (srcs == block).all() and len(set(result.copy_dst.tolist()) - {0}) == copies
    if writers == 4:  # the last writer in batch order keeps the original
        assert bm.table(3)[1] == block
    check_invariants(CFG, bm.state)


def test_beam_root_count_4_then_2_after_two_drop_out(bm):
    bm.admit([0], [list(range(20))])
    bm.fork(0, [1, 2, 3])
    root = bm.table(0)[0]
    assert bm.ref_count(root) == 4
    bm.append([0, 1, 2, 3], tok([0, 1, 2, 3]))  # candidates diverge: 3 copies, one keeps the original
    assert bm.ref_count(root) == 4
    bm.free([2, 3])
    assert bm.ref_count(root) == 2
    check_invariants(CFG, bm.state)


def test_select_drops_paths_no_candidate_keeps(bm):
    bm.admit([0], [list(range(20))])
    bm.fork(0, [1, 2, 3])
    bm.append([0, 1, 2, 3], tok([0, 1, 2, 3]))
    tails = [bm.table(s)[1] for s in range(4)]
    assert len(set(tails)) == 4
    free_before = bm.usage()["free"]
    # Candidates 2 and 3 drop out; 0 and 1 each have two children.
    status = bm.select([0, 1, 2, 3], [0, 0, 1, 1])
    assert (status == pk.Status.OK).all()
    assert bm.table(1) == bm.table(0) and bm.table(3) == bm.table(2)
    assert bm.ref_count(tails[0]) == 2 and bm.ref_count(tails[1]) == 2
    assert bm.ref_count(tails[2]) == 0 and bm.ref_count(tails[3]) == 0
    assert bm.usage()["free"] == free_before + 2
    # The dropped tails are partly full, so never cached: they go to the front, reused first.
    assert bm.free_queue()[:2] == [tails[2], tails[3]]
    check_invariants(CFG, bm.state)


def test_select_can_swap_parents():
    bm = pk.BlockManager(CFG)
    bm.admit([0, 1], [list(range(17)), list(range(33))])
    t0, t1 = bm.table(0), bm.table(1)
    bm.select([0, 1], [1, 0])
    assert bm.table(0) == t1 and bm.table(1) == t0
    assert bm.num_tokens(0) == 33 and bm.num_tokens(1) == 17
    check_invariants(CFG, bm.state)


def test_free_is_tail_first_to_the_back_and_allocation_takes_the_front():
    """Without prefix caching every freed block joins the back (with it, see test_prefix_cache)."""
    cfg = pk.ManagerConfig(num_blocks=40, block_size=16, max_seqs=4, max_blocks_per_seq=40,
                           prefix_caching=False)
    # Row 0 finishes with table [22, 8, 31, 14]; block 8 is also held by row 1.
    state = state_from_tables(cfg, {0: ([22, 8, 31, 14], 60), 1: ([8], 10)})
    check_invariants(cfg, state)
    front = pk.invariants.free_queue_order(state)[0]
    # The functional operations, jitted as a jitted caller runs them (op by op, a few hundred
    # small programs compile).
    free, admit = (jax.jit(op, static_argnums=0) for op in (pk.free, pk.admit))
    state, status = free(cfg, state, jnp.array([0], jnp.int32))
    assert status.tolist() == [pk.Status.OK]
    order = pk.invariants.free_queue_order(state)
    assert order[-3:] == [14, 31, 22]
    assert int(state.ref_count[8]) == 1 and 8 not in order
    # The next allocation takes the front block: least recently freed first.
    state, result = admit(cfg, state, jnp.array([2], jnp.int32), jnp.array([1], jnp.int32))
    assert result.status.tolist() == [pk.Status.OK]
    assert state.block_tables[2, 0] == front
    check_invariants(cfg, state)
    # Once the older free blocks are used up, the freed tail (14) is overwritten before the root.
    rest = len(order) - 4
    state, _ = admit(cfg, state, jnp.array([3], jnp.int32), jnp.array([rest * 16], jnp.int32))
    assert pk.invariants.free_queue_order(state) == [14, 31, 22]


SMALL = pk.ManagerConfig(num_blocks=5, block_size=4, max_seqs=4, max_blocks_per_seq=8)  # 4 usable blocks


def test_out_of_blocks_leaves_the_sequence_untouched_and_says_so():
    cfg = SMALL
    bm = pk.BlockManager(cfg)
    assert bm.admit([0, 1], [[1] * 8, [2] * 8]).status.tolist() == [0, 0]  # 4 blocks: pool is empty
    before = pk.invariants.free_queue_order(bm.state), bm.table(0), bm.table(1)
    result = bm.append([0, 1], tok([0, 1]))
    assert result.status.tolist() == [pk.Status.NO_FREE_BLOCKS] * 2
    assert (result.slots == 0).all() and result.num_copies == 0
    assert (pk.invariants.free_queue_order(bm.state), bm.table(0), bm.table(1)) == before
    assert bm.num_tokens(0) == 8
    # Admission is all or nothing per request and first come, first served within a call.
    bm.free([1])
    assert bm.admit([2, 3], [[3] * 9, [1] * 4]).status.tolist() == [pk.Status.NO_FREE_BLOCKS] * 2
    check_invariants(cfg, bm.state)


def test_copy_whose_co_writer_starves_does_not_write_in_place():
    """w == r == 2 writers, one free block: the first writer gets the copy, so the keeper
    writes in place. With no free block, both fail: neither writes into the shared block."""
    cfg = SMALL  # the pool of the test above: its programs are compiled already
    bm = pk.BlockManager(cfg)
    assert bm.admit([0, 2], [[1, 2, 3, 4, 5], [6] * 8]).status.tolist() == [0, 0]  # 2 + 2 blocks
    assert pk.invariants.free_queue_order(bm.state) == []  # pool now empty
    bm.fork(0, [1])
    result = bm.append([0, 1], tok([0, 1]))
    assert result.status.tolist() == [pk.Status.NO_FREE_BLOCKS] * 2
    assert bm.num_tokens(0) == bm.num_tokens(1) == 5
    check_invariants(cfg, bm.state)


def test_table_full_is_reported():
    cfg = pk.ManagerConfig(num_blocks=16, block_size=4, max_seqs=2, max_blocks_per_seq=2)
    bm = pk.BlockManager(cfg)
    bm.admit([0], [[0] * 8])
    assert bm.append([0], tok([0])).status.tolist() == [pk.Status.TABLE_FULL]
    assert bm.num_tokens(0) == 8


def test_in_jit_bad_rows_report_status_and_change_nothing():
    cfg = pk.ManagerConfig(num_blocks=16, block_size=4, max_seqs=4, max_blocks_per_seq=4)
    state = pk.init_state(cfg)
    admit = jax.jit(pk.admit, static_argnums=0)
    tokens = jnp.ones((6, 16), jnp.int32)
    state, result = admit(cfg, state, jnp.array([0, -1, 9, 0, 1, 2]), jnp.array([5, 3, 3, 3, 0, 17]),
                          tokens)
    assert result.status.tolist() == [
        pk.Status.OK, pk.Status.PADDING, pk.Status.BAD_SEQUENCE, pk.Status.BAD_SEQUENCE,
        pk.Status.BAD_LENGTH, pk.Status.BAD_LENGTH,
    ]
    assert np.asarray(state.active).tolist() == [True, False, False, False]
    state, result = jax.jit(pk.append, static_argnums=0)(cfg, state, jnp.array([3, 0, -1]),
                                                         jnp.array([1, 2, 3]))
    assert result.status.tolist() == [pk.Status.BAD_SEQUENCE, pk.Status.OK, pk.Status.PADDING]
    state, status = jax.jit(pk.fork, static_argnums=0)(cfg, state, jnp.array([0, 1]), jnp.array([0, 2]))
    assert status.tolist() == [pk.Status.BAD_SEQUENCE, pk.Status.BAD_SEQUENCE]
    check_invariants(cfg, state)
