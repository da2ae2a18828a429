"""The ring-buffer free queue on its own: lazy deletion, stale entries, push to either end,
compaction when the ring fills."""

import jax
import jax.numpy as jnp
import numpy as np

import paged_kv as pk
from paged_kv import free_queue as fq
from paged_kv.invariants import free_queue_order

CFG = pk.ManagerConfig(num_blocks=9, block_size=4, max_seqs=2, max_blocks_per_seq=2)


def order(q):
    return free_queue_order(pk.init_state(CFG).replace(queue=q))


def arr(*v):
    return jnp.array(v, jnp.int32)


def test_take_front_skips_entries_removed_from_the_middle():
    q = pk.init_state(CFG).queue
    assert order(q) == [1, 2, 3, 4, 5, 6, 7, 8]
    q = fq.remove(q, arr(2, 3, 5), jnp.ones(3, bool))
    assert order(q) == [1, 4, 6, 7, 8] and int(q.num_free) == 5
    q, taken = jax.jit(fq.take_front, static_argnums=2)(q, jnp.int32(3), 4)
    assert taken.tolist() == [1, 4, 6, 0]
    assert order(q) == [7, 8]
    # A window narrower than the stale run still finds the live blocks (several iterations).
    q = pk.init_state(CFG).queue
    q = fq.remove(q, arr(1, 2, 3, 4, 5), jnp.ones(5, bool))
    q, taken = fq.take_front(q, jnp.int32(2), 2)
    assert taken.tolist() == [6, 7] and order(q) == [8]


def test_push_front_and_back():
    q = pk.init_state(CFG).queue
    q, taken = fq.take_front(q, jnp.int32(4), 4)
    q = fq.push_back(q, arr(3, 1, 0), jnp.array([True, True, False]))
    q = fq.push_front(q, arr(4, 2), jnp.ones(2, bool))
    assert order(q) == [4, 2, 5, 6, 7, 8, 3, 1]
    assert int(q.num_free) == 8


def test_compaction_when_stale_entries_fill_the_ring():
    q = pk.init_state(CFG).queue
    cap = CFG.queue_capacity
    # Repeatedly pull block 8 out of the middle and free it again: each round leaves a stale
    # entry, so the ring must compact to keep accepting pushes.
    @jax.jit
    def cycle(q):
        q = fq.remove(q, arr(8), jnp.ones(1, bool))
        return fq.push_back(q, arr(8), jnp.ones(1, bool))

    for _ in range(3 * cap):
        q = cycle(q)
        assert int(q.size) <= cap
    assert order(q) == [1, 2, 3, 4, 5, 6, 7, 8]
    q2 = fq.compact(q)
    assert order(q2) == order(q) and int(q2.size) == 8 and int(q2.head) == 0
    np.testing.assert_array_equal(np.asarray(q2.ring[:8]), np.arange(1, 9))
