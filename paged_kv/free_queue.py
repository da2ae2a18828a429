"""Operations on the free queue (see ``state.FreeQueue``).

All functions are pure and jittable; their cost is O(entries touched), plus, for ``take_front``,
O(stale entries skipped), and for ``push_*`` an occasional O(capacity) compaction that can only
happen after at least ``num_blocks`` stale entries piled up (amortised O(1) per entry).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from paged_kv.config import NULL_BLOCK
from paged_kv.scan import per_platform, prefix_sum, while_needed
from paged_kv.state import FreeQueue


def _live(q: FreeQueue, positions: jax.Array, in_use: jax.Array) -> tuple[jax.Array, jax.Array]:
    ids = q.ring[positions]
    return ids, in_use & (q.slot[ids] == positions)


def take_front(q: FreeQueue, count: jax.Array, max_take: int, *, straight: bool = False
               ) -> tuple[FreeQueue, jax.Array] | tuple[FreeQueue, jax.Array, jax.Array]:
    """Removes the ``count`` front (least recently freed) blocks.

    Args:
      q: the queue.
      count: int32 scalar, how many blocks to take; the caller guarantees ``count <= q.num_free``
        and ``count <= max_take``.
      max_take: static bound on ``count``; the window scanned per iteration.

      straight: static; True scans the first window only and also returns a bool scalar, True
        when that was not enough (stale entries among the first ``count``): then the queue and
        blocks returned are incomplete and the caller must take the looping form instead (the
        straight-line form of ``allocate.append`` on a GPU).

    Returns:
      The new queue and int32 ``[max_take]``: the taken blocks in queue order, then
      ``NULL_BLOCK`` padding.
    """
    cap = q.ring.shape[0]
    lanes = jnp.arange(max_take, dtype=jnp.int32)

    def scan_window(carry):
        q, got, out = carry
        positions = (q.head + lanes) % cap
        ids, live = _live(q, positions, lanes < q.size)
        before = prefix_sum(live)  # live entries up to and including each lane
        n_taken = jnp.minimum(count - got, before[-1])
        take = live & (before <= n_taken)
        rank = got + before - 1
        out = out.at[jnp.where(take, rank, max_take)].set(ids, mode="drop")
        slot = q.slot.at[jnp.where(take, ids, q.slot.shape[0])].set(-1, mode="drop")
        done = got + n_taken >= count
        # Consume up to the last entry taken (the first lane whose count reaches n_taken; an
        # argmax, one kernel); stale entries before it are dropped on the way.
        last = jnp.where(n_taken > 0, jnp.argmax(before >= n_taken), -1)
        consumed = jnp.where(done, last + 1, jnp.minimum(max_take, q.size))
        q = q.replace(
            slot=slot,
            head=(q.head + consumed) % cap,
            size=q.size - consumed,
            num_free=q.num_free - n_taken,
        )
        return q, got + n_taken, out

    out0 = jnp.full((max_take,), NULL_BLOCK, jnp.int32)
    # One window suffices unless stale entries (blocks a prefix-cache hit pulled out of the
    # middle) sit among the first ``count``; only then does the loop run at all.
    carry = scan_window((q, jnp.int32(0), out0))
    more = lambda c: (c[1] < count) & (c[0].size > 0)
    if straight:
        return carry[0], carry[2], more(carry)
    q, _, out = while_needed(more, scan_window, carry)
    return q, out


def compact(q: FreeQueue) -> FreeQueue:
    """Drops stale entries: live entries move, in order, to ring indices 0 .. num_free - 1."""
    cap = q.ring.shape[0]
    lanes = jnp.arange(cap, dtype=jnp.int32)
    positions = (q.head + lanes) % cap
    ids, live = _live(q, positions, lanes < q.size)
    rank = prefix_sum(live) - 1
    ring = jnp.zeros_like(q.ring).at[jnp.where(live, rank, cap)].set(ids, mode="drop")
    slot = q.slot.at[jnp.where(live, ids, q.slot.shape[0])].set(rank, mode="drop")
    return q.replace(ring=ring, slot=slot, head=jnp.int32(0), size=q.num_free)


def _make_room(q: FreeQueue, count: jax.Array) -> FreeQueue:
    cap = q.ring.shape[0]
    return lax.cond(q.size + count > cap, compact, lambda q: q, q)


def push_back(q: FreeQueue, ids: jax.Array, mask: jax.Array) -> FreeQueue:
    """Appends ``ids[mask]`` to the back, in array order (the first ends up nearest the front).

    Args:
      ids: int32 ``[E]`` block ids; the masked ones must not be free already and be distinct.
      mask: bool ``[E]``.
    """
    count = jnp.sum(mask, dtype=jnp.int32)
    return _push_back(_make_room(q, count), ids, mask, count)


def _push_back(q: FreeQueue, ids: jax.Array, mask: jax.Array, count: jax.Array) -> FreeQueue:
    cap = q.ring.shape[0]
    rank = prefix_sum(mask) - 1
    positions = (q.head + q.size + rank) % cap
    return _write(q, ids, mask, positions).replace(size=q.size + count, num_free=q.num_free + count)


def push_front(q: FreeQueue, ids: jax.Array, mask: jax.Array) -> FreeQueue:
    """Puts ``ids[mask]`` at the front, in array order (the first becomes the new front)."""
    count = jnp.sum(mask, dtype=jnp.int32)
    return _push_front(_make_room(q, count), ids, mask, count)


def _push_front(q: FreeQueue, ids: jax.Array, mask: jax.Array, count: jax.Array) -> FreeQueue:
    cap = q.ring.shape[0]
    rank = prefix_sum(mask) - 1
    head = (q.head - count) % cap
    positions = (head + rank) % cap
    return _write(q, ids, mask, positions).replace(
        head=head, size=q.size + count, num_free=q.num_free + count
    )


def push_unchecked(q: FreeQueue, ids: jax.Array, back: jax.Array, front: jax.Array | None,
                   front_ids: jax.Array | None = None) -> FreeQueue:
    """``push_back_then_front`` (``push_back`` alone when ``front`` is None) for a caller that knows
    the ring has room for both: no compaction check."""
    q = _push_back(q, ids, back, jnp.sum(back, dtype=jnp.int32))
    if front is None:
        return q
    return _push_front(q, ids if front_ids is None else front_ids, front, jnp.sum(front, dtype=jnp.int32))


def push_back_then_front(q: FreeQueue, ids: jax.Array, back: jax.Array, front: jax.Array, *,
                         front_ids: jax.Array | None = None, target: str = "auto") -> FreeQueue:
    """``push_front(push_back(q, ids, back), front_ids, front)`` (``front_ids`` default ``ids``:
    the front pushes may come in another order than the back ones), with one room check instead
    of two on a GPU: either push compacts iff ``size + both counts > capacity`` (the first iff
    ``size + count_back`` is; if it does not, the second sees ``size + count_back``), so one
    ``cond`` picks the checked pair or the two pushes with no check. Same result everywhere.
    ``target``: ``ManagerConfig.target``."""
    fids = ids if front_ids is None else front_ids

    def checked(q):
        return push_front(push_back(q, ids, back), fids, front)

    def one_check(q):
        cb, cf = jnp.sum(back, dtype=jnp.int32), jnp.sum(front, dtype=jnp.int32)
        unchecked = lambda q: _push_front(_push_back(q, ids, back, cb), fids, front, cf)
        return lax.cond(q.size + cb + cf > q.ring.shape[0], checked, unchecked, q)

    return per_platform(target, q, cpu=checked, default=one_check)


def _write(q: FreeQueue, ids: jax.Array, mask: jax.Array, positions: jax.Array) -> FreeQueue:
    cap, n = q.ring.shape[0], q.slot.shape[0]
    ring = q.ring.at[jnp.where(mask, positions, cap)].set(ids, mode="drop")
    slot = q.slot.at[jnp.where(mask, ids, n)].set(positions, mode="drop")
    return q.replace(ring=ring, slot=slot)


def remove(q: FreeQueue, ids: jax.Array, mask: jax.Array, count: jax.Array | None = None) -> FreeQueue:
    """Takes ``ids[mask]`` (free, distinct blocks) out of the queue wherever they are, in O(E):
    their entries turn stale and ``take_front`` skips them later. ``count``: ``sum(mask)`` if the
    caller knows it (saves a reduction)."""
    n = q.slot.shape[0]
    slot = q.slot.at[jnp.where(mask, ids, n)].set(-1, mode="drop")
    count = jnp.sum(mask, dtype=jnp.int32) if count is None else count
    return q.replace(slot=slot, num_free=q.num_free - count)


def live_entries(q: FreeQueue) -> jax.Array:
    """Debug/test view, O(capacity): int32 ``[capacity]`` of free blocks front to back, padded
    with -1. Not for hot paths."""
    cap = q.ring.shape[0]
    lanes = jnp.arange(cap, dtype=jnp.int32)
    positions = (q.head + lanes) % cap
    ids, live = _live(q, positions, lanes < q.size)
    rank = prefix_sum(live) - 1
    return jnp.full((cap,), -1, jnp.int32).at[jnp.where(live, rank, cap)].set(ids, mode="drop")
