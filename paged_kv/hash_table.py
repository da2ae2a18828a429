"""An open-addressing hash table from 64-bit block keys to block ids, several blocks per key,
with vectorised probing.

Linear probing over a power-of-two table. Every batch of lookups or insertions advances all its
probes together inside one ``lax.while_loop``, so a call costs O(batch x longest probe), never
O(table). A key may be stored several times (several full blocks with the same contents, as in
vLLM): an insertion always takes the first EMPTY slot of the key's probe sequence, so the entries
of one key lie along that sequence in insertion order, and a lookup, which stops at the first
match, returns the *oldest* live block of the key. Deletion leaves a tombstone (probes walk over
it; insertions never reuse it, which is what keeps that order); when live entries plus tombstones
exceed half the table, the next insertion rebuilds it first, at most once per ``size / 4``
deletions, keeping each key's order.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from paged_kv.packed import with_packed_scalars
from paged_kv.scan import any_true, while_needed

EMPTY = -1
TOMBSTONE = -2


@flax.struct.dataclass
class HashTable:
    """Attributes:
    entries: int32 ``[size, 3]``: a slot's key (two uint32 lanes, stored bit for bit) and its
      value (a block id, ``EMPTY`` or ``TOMBSTONE``), side by side so one gather reads both; read
      as the properties ``keys`` (uint32 ``[size, 2]``) and ``vals`` (int32 ``[size]``).
    counts: int32 ``[2]``, read as ``num_live`` and ``num_dead`` (tombstones).
    """

    entries: jax.Array
    counts: jax.Array

    @property
    def keys(self) -> jax.Array:
        return lax.bitcast_convert_type(self.entries[:, :2], jnp.uint32)

    @property
    def vals(self) -> jax.Array:
        return self.entries[:, VAL]



with_packed_scalars(HashTable, "counts", ("num_live", "num_dead"))

VAL = 2
"""Column of ``HashTable.entries`` holding the value."""


def empty_table(size: int) -> HashTable:
    assert size & (size - 1) == 0, size
    return HashTable(
        entries=jnp.zeros((size, 3), jnp.int32).at[:, VAL].set(EMPTY),
        counts=jnp.zeros((2,), jnp.int32),
    )


def _rows(keys: jax.Array, vals: jax.Array) -> jax.Array:
    """int32 ``[K, 3]`` table rows for uint32 ``[K, 2]`` keys and int32 ``[K]`` values."""
    return jnp.concatenate([lax.bitcast_convert_type(keys, jnp.int32), vals[:, None]], axis=1)


def _split(rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint32 ``[..., 2]`` keys and int32 ``[...]`` values of table rows ``[..., 3]``."""
    return lax.bitcast_convert_type(rows[..., :2], jnp.uint32), rows[..., VAL]


def _home(keys: jax.Array, size: int) -> jax.Array:
    return (keys[..., 0] & jnp.uint32(size - 1)).astype(jnp.int32)


def _same(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.all(a == b, axis=-1)


PROBE_WINDOW = 8
"""Slots every lookup or insertion examines at once before any loop. At the table's load (at
most 1/2, usually far less) nearly every probe sequence ends inside the first window, so the
``while_loop`` that continues linear probing usually runs zero iterations: on XLA:CPU each loop
iteration costs several small kernels, enough for the loops to dominate a one-request admission."""

WIDE_BATCH = 1024
"""From this many keys on, the window is a single slot (plain probing by the loop): for thousands
of keys, gathering 8 slots each costs more than the loop iterations it saves (a 256-request
admission hashes 9,216 keys)."""


def _window_size(num_keys: int) -> int:
    return PROBE_WINDOW if num_keys < WIDE_BATCH else 1


def _window(
    table: HashTable, home: jax.Array, keys: jax.Array, *, stop_at_key: bool = True
) -> tuple[jax.Array, jax.Array]:
    """The first ``W = _window_size(K)`` probe positions of each key, examined at once.

    Returns int32 ``[K]`` the offset of the first slot that ends the probe sequence (the key, for a
    lookup, or an EMPTY slot; ``W`` if none) and int32 ``[K]`` the block stored there if it is the
    key (else -1). With ``stop_at_key=False`` (an insertion) only an EMPTY slot ends it. Found by
    one two-output reduction over the window that picks the lowest stopping offset, so the gather,
    the comparisons and the choice are a single kernel, which XLA:CPU does not split across threads
    (a plain gather from the table it does, costing a hand-off per call).
    """
    size = table.entries.shape[0]
    w = _window_size(keys.shape[0])
    offsets = jnp.arange(w, dtype=jnp.int32)
    pos = (home[:, None] + offsets[None, :]) & (size - 1)
    # Gathers of flat index vectors: XLA:CPU turns the 2-D-indexed form into a slow fusion.
    stored, vals = _split(table.entries[pos.reshape(-1)].reshape(*pos.shape, 3))
    has_key = (vals >= 0) & _same(stored, keys[:, None, :])
    stop = (has_key | (vals == EMPTY)) if stop_at_key else (vals == EMPTY)
    # Non-stopping offsets rank after every stopping one, and all ranks are distinct, so keeping
    # the lower-ranked pair is associative and commutative.
    rank = jnp.where(stop, offsets[None, :], w + offsets[None, :])
    block = jnp.where(has_key, vals, -1) if stop_at_key else jnp.full_like(vals, -1)

    def lower(a, b):
        keep_a = a[0] < b[0]
        return jnp.where(keep_a, a[0], b[0]), jnp.where(keep_a, a[1], b[1])

    first, found = lax.reduce((rank, block), (jnp.int32(2 * w), jnp.int32(-1)), lower, (1,))
    return jnp.minimum(first, w), found


def lookup(table: HashTable, keys: jax.Array, mask: jax.Array) -> jax.Array:
    """int32 ``[K]``: the oldest live block stored under each key, -1 if absent or not masked.

    Args:
      keys: uint32 ``[K, 2]``; mask: bool ``[K]``.
    """
    size = table.entries.shape[0]
    home = _home(keys, size)
    first, found = _window(table, home, keys)
    w = _window_size(keys.shape[0])
    found = jnp.where(mask, found, -1)

    def body(carry):
        probe, pending, found = carry
        pos = (home + probe) & (size - 1)
        stored, val = _split(table.entries[pos])
        hit = pending & (val >= 0) & _same(stored, keys)
        found = jnp.where(hit, val, found)
        pending = pending & ~hit & (val != EMPTY)
        return probe + 1, pending, found

    # Only probe sequences longer than the window continue, from where the window ended.
    init = (jnp.int32(w), mask & (first == w), found)
    _, _, found = while_needed(lambda c: any_true(c[1]) & (c[0] < size), body, init)
    return found


def _claim_window(table: HashTable, home: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For an insertion, the first ``W`` probe positions of each key at once: int32 ``[K]`` the
    offset of the first EMPTY slot (``W`` if none), and int32 ``[K]`` the oldest block already
    stored under the key if it lies before that slot (else -1). One gather and one three-output
    reduction (kept whole by XLA:CPU, like ``_window``'s)."""
    size = table.entries.shape[0]
    w = _window_size(keys.shape[0])
    offsets = jnp.arange(w, dtype=jnp.int32)
    pos = (home[:, None] + offsets[None, :]) & (size - 1)
    stored, vals = _split(table.entries[pos.reshape(-1)].reshape(*pos.shape, 3))
    late = w + offsets[None, :]
    empty_rank = jnp.where(vals == EMPTY, offsets[None, :], late)
    has_key = (vals >= 0) & _same(stored, keys[:, None, :])
    key_rank = jnp.where(has_key, offsets[None, :], late)

    def lower(a, b):
        keep_a = a[1] < b[1]
        return jnp.minimum(a[0], b[0]), jnp.where(keep_a, a[1], b[1]), jnp.where(keep_a, a[2], b[2])

    init = (jnp.int32(2 * w), jnp.int32(2 * w), jnp.int32(-1))
    first_empty, first_key, block = lax.reduce((empty_rank, key_rank, vals), init, lower, (1,))
    first_empty = jnp.minimum(first_empty, w)
    return first_empty, jnp.where(first_key < first_empty, block, -1)


def claim(
    table: HashTable, keys: jax.Array, vals: jax.Array, mask: jax.Array, *, order: jax.Array | None = None,
    find_twins: bool = True, straight: bool = False,
) -> tuple[HashTable, jax.Array, jax.Array, jax.Array]:
    """Inserts every masked entry, whether or not its key is present.

    Each entry takes the first EMPTY slot of its key's probe sequence, so equal keys line up along
    that sequence in the order they were inserted: within one batch, in ``order`` (int32 ``[K]``,
    a permutation of ``0..K-1``; default the batch order), where the lower value goes first.

    Args:
      keys: uint32 ``[K, 2]``; vals: int32 ``[K]`` (block ids); mask: bool ``[K]``.
      straight: static; True leaves out the loop that probes past the window and the contention
        between entries, for a caller that knows (``claims_past_window``) that no entry needs
        them: then every masked entry takes the first EMPTY slot of its window.

    Returns:
      - the table;
      - int32 ``[K]`` slots (-1 where not masked);
      - int32 ``[K]`` twins: the ``order`` value of the first entry of this batch with the same key,
        for a masked entry that has such an earlier twin (-1 otherwise; all -1 without
        ``find_twins``, for a caller that knows its keys are distinct);
      - int32 ``[K]`` the oldest block stored under the key before this call (-1 if none, or not
        masked).
      Both found on the way, with no second probe: the walk to the first EMPTY slot passes the
      key's older entries, and equal keys walk their probe sequence in lockstep, so an entry and
      its first twin contend for the slot the twin wins. (A lookup after the insertion would make
      XLA copy the whole table on every call.)
    """
    size = table.entries.shape[0]
    home = _home(keys, size)
    k = keys.shape[0]
    # Claim markers, all below TOMBSTONE and distinct; the first in order has the smallest.
    offset = 3 + k
    code = (jnp.arange(k, dtype=jnp.int32) if order is None else order.astype(jnp.int32)) - offset

    def attempt(t, pos, pending, empty, slots, twin):
        """Entries at an EMPTY slot ``pos`` try to claim it: the first in order (smallest marker)
        wins each slot; the others walk on, and one that lost to an equal key notes its twin."""
        claimed = t.entries.at[jnp.where(empty, pos, size), VAL].min(code, mode="drop")
        winner = claimed[pos, VAL]
        won = empty & (winner == code)
        target = jnp.where(won, pos, size)
        entries = claimed.at[target].set(_rows(keys, vals), mode="drop")
        if find_twins:
            behind_twin = empty & ~won & _same(_split(entries[pos])[0], keys)
            twin = jnp.where((twin < 0) & behind_twin, winner + offset, twin)
        slots = jnp.where(won, pos, slots)
        return t.replace(entries=entries), pending & ~won, slots, twin

    # First, the whole window at once: claim its first EMPTY slot. Where the window holds an
    # EMPTY slot, the key's older entries (if any) lie before it: ``older`` is settled.
    first, older = _claim_window(table, home, keys)
    w = _window_size(k)
    settled = first < w
    empty = mask & settled
    pos = (home + jnp.minimum(first, w - 1)) & (size - 1)
    none = jnp.full(mask.shape, -1, jnp.int32)
    if not straight:
        table, pending, slots, twin = attempt(table, pos, mask, empty, none, none)
    else:
        # No entry contends for its slot nor lacks one in the window (the caller's promise, see
        # ``claims_past_window``; or every entry masked off), so each wins the slot it aims at:
        # one scatter of whole rows. ``attempt``'s marker scatter and the read of it that follows
        # make XLA:GPU copy the whole table on every call (the read fuses into the next scatter).
        table = table.replace(entries=table.entries.at[jnp.where(empty, pos, size)].set(_rows(keys, vals), mode="drop"))
        slots, twin = jnp.where(empty, pos, -1), none

    def body(carry):
        probe, pending, slots, twin, older, t = carry
        pos = (home + probe) & (size - 1)
        stored, val = _split(t.entries[pos])
        # An unsettled entry meets its key's older entries before any slot its twins claim (they
        # claim in lockstep with it, at EMPTY slots): the first one met is the oldest.
        older = jnp.where(pending & ~settled & (older < 0) & (val >= 0) & _same(stored, keys), val, older)
        empty = pending & (val == EMPTY)
        t, pending, slots, twin = attempt(t, pos, pending, empty, slots, twin)
        return probe + 1, pending, slots, twin, older, t

    # The rest (a lost claim, or no EMPTY slot inside the window) walk again from home, one slot
    # per iteration, in lockstep (so equal keys keep their order); rare, so the loop usually runs
    # zero iterations.
    if not straight:
        init = (jnp.int32(0), pending, slots, twin, older, table)
        _, _, slots, twin, older, table = while_needed(lambda c: any_true(c[1]) & (c[0] < size), body, init)
    inserted = jnp.sum(slots >= 0, dtype=jnp.int32)
    return table.replace(counts=table.counts.at[0].add(inserted)), slots, twin, jnp.where(mask, older, -1)


def claims_past_window(table: HashTable, keys: jax.Array, mask: jax.Array) -> jax.Array:
    """bool scalar: whether ``claim(table, keys, _, mask)`` (batch order) would probe past its
    first window, i.e. some masked entry finds no EMPTY slot in its window or loses the slot to
    an earlier entry. Reads only: the contention is an O(K^2) comparison of the entries' slots
    instead of ``claim``'s scatter into the table. Tombstoning live entries (``remove``) does not
    change the answer, as it makes no slot EMPTY or not EMPTY."""
    size = table.entries.shape[0]
    k = keys.shape[0]
    home = _home(keys, size)
    first, _ = _claim_window(table, home, keys)
    w = _window_size(k)
    empty = mask & (first < w)
    pos = (home + jnp.minimum(first, w - 1)) & (size - 1)
    earlier = jnp.arange(k)[None, :] < jnp.arange(k)[:, None]
    beaten = jnp.any(earlier & empty[None, :] & (pos[None, :] == pos[:, None]), axis=1)
    return any_true(mask & ~(empty & ~beaten))


def needs_rebuild(table: HashTable, count: jax.Array) -> jax.Array:
    """bool scalar: inserting ``count`` more keys would push live entries plus tombstones past
    half the table, so it must be rebuilt first (at most once per ``size / 4`` deletions)."""
    return table.num_live + table.num_dead + count > table.entries.shape[0] // 2


def rebuild(
    size: int, all_keys: jax.Array, cached: jax.Array, old_slots: jax.Array
) -> tuple[HashTable, jax.Array]:
    """A fresh table holding ``all_keys[cached] -> index``, without tombstones. Entries of one
    key keep their order (oldest first): they are re-inserted by their distance from home in the
    old table. O(N log N + size); rare (see ``needs_rebuild``).

    Args:
      all_keys: uint32 ``[N, 2]`` the key of every block; cached: bool ``[N]``; old_slots: int32
        ``[N]`` each cached block's slot in the old table (same size).

    Returns:
      The table and int32 ``[N]``: each cached block's new slot (-1 for the others).
    """
    n = cached.shape[0]
    distance = (old_slots - _home(all_keys, size)) & (size - 1)
    order = jnp.argsort(jnp.where(cached, distance, size), stable=True)
    rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    table, slots, _, _ = claim(empty_table(size), all_keys, jnp.arange(n, dtype=jnp.int32), cached, order=rank,
                               find_twins=False)
    return table, slots


_UNCLAIMED = jnp.iinfo(jnp.int32).max
"""An empty scratch slot in ``first_of_keys``: above every entry index, so a scatter-min claim
always replaces it."""


def first_of_keys(keys: jax.Array, mask: jax.Array, slots_per_key: int = 2) -> jax.Array:
    """int32 ``[K]``: for each masked entry, the index of the first masked entry with the same key
    (unmasked entries: -1).

    Groups a batch by key in O(K) expected work without a sort, through a scratch open-addressing
    table of entry indices alone (``slots_per_key * K`` int32 slots, rounded up to a power of two;
    the keys are read from ``keys`` itself, so only the index array is filled per call). Each round,
    every unresolved entry looks at its next probe slot: a slot holding an entry with its key
    resolves it; an EMPTY slot is claimed with a scatter-min of indices, and the entry that wins it
    resolves to itself. Equal keys share their probe sequence and so move in lockstep: the earliest
    of them is the one that claims, and the others find it in that same round.

    Args:
      keys: uint32 ``[K, 2]``; mask: bool ``[K]``.
      slots_per_key: scratch slots per entry (static).
    """
    k = keys.shape[0]
    size = 1 << max(4, (slots_per_key * k - 1).bit_length())
    home = _home(keys, size)
    index = jnp.arange(k, dtype=jnp.int32)

    def round_(carry):
        probe, pending, rep, slots = carry
        pos = (home + probe) & (size - 1)
        held = slots[pos]
        empty = pending & (held == _UNCLAIMED)
        found = pending & ~empty & _same(keys[jnp.minimum(held, k - 1)], keys)
        slots = slots.at[jnp.where(empty, pos, size)].min(index, mode="drop")
        winner = slots[pos]
        won = empty & (winner == index)
        # Losers of this round's claim whose winner has their key resolve to it now.
        twin = empty & ~won & _same(keys[jnp.minimum(winner, k - 1)], keys)
        rep = jnp.where(found, held, jnp.where(won, index, jnp.where(twin, winner, rep)))
        return probe + 1, pending & ~found & ~won & ~twin, rep, slots

    slots = jnp.full((size,), _UNCLAIMED, jnp.int32)
    init = (jnp.int32(0), mask, jnp.full((k,), -1, jnp.int32), slots)
    _, _, rep, _ = lax.while_loop(lambda c: any_true(c[1]) & (c[0] < size), round_, init)
    return rep


def remove(table: HashTable, slots: jax.Array, mask: jax.Array) -> HashTable:
    """Tombstones the entries at ``slots[mask]`` (distinct, live)."""
    size = table.entries.shape[0]
    count = jnp.sum(mask, dtype=jnp.int32)
    entries = table.entries.at[jnp.where(mask, slots, size), VAL].set(TOMBSTONE, mode="drop")
    return table.replace(entries=entries, counts=table.counts + jnp.stack([-count, count]))
