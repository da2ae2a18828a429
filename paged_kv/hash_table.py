"""An open-addressing hash table from 64-bit block keys to block ids, with vectorised probing.

Linear probing over a power-of-two table. Every batch of lookups or insertions advances all its
probes together inside one ``lax.while_loop``, so a call costs O(batch x longest probe), never
O(table). Deletion leaves a tombstone (probes walk over it; insertions do not reuse it, which keeps
"is this key already present?" a single probe walk); when live entries plus tombstones exceed half
the table, the next insertion rebuilds it first, at most once per ``size / 4`` deletions.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

EMPTY = -1
TOMBSTONE = -2


@flax.struct.dataclass
class HashTable:
    """Attributes:
    keys: uint32 ``[size, 2]``.
    vals: int32 ``[size]``: a block id, ``EMPTY`` or ``TOMBSTONE``.
    num_live: int32 scalar.
    num_dead: int32 scalar, tombstones.
    """

    keys: jax.Array
    vals: jax.Array
    num_live: jax.Array
    num_dead: jax.Array


def empty_table(size: int) -> HashTable:
    assert size & (size - 1) == 0, size
    return HashTable(
        keys=jnp.zeros((size, 2), jnp.uint32),
        vals=jnp.full((size,), EMPTY, jnp.int32),
        num_live=jnp.int32(0),
        num_dead=jnp.int32(0),
    )


def _home(keys: jax.Array, size: int) -> jax.Array:
    return (keys[..., 0] & jnp.uint32(size - 1)).astype(jnp.int32)


def _same(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.all(a == b, axis=-1)


def lookup(table: HashTable, keys: jax.Array, mask: jax.Array) -> jax.Array:
    """int32 ``[K]``: the block stored under each key, -1 if absent or not masked.

    Args:
      keys: uint32 ``[K, 2]``; mask: bool ``[K]``.
    """
    size = table.vals.shape[0]
    home = _home(keys, size)

    def body(carry):
        probe, pending, found = carry
        pos = (home + probe) & (size - 1)
        val = table.vals[pos]
        hit = pending & (val >= 0) & _same(table.keys[pos], keys)
        found = jnp.where(hit, val, found)
        pending = pending & ~hit & (val != EMPTY)
        return probe + 1, pending, found

    init = (jnp.int32(0), mask, jnp.full(mask.shape, -1, jnp.int32))
    _, _, found = lax.while_loop(lambda c: jnp.any(c[1]) & (c[0] < size), body, init)
    return found


def _claim(table: HashTable, keys: jax.Array, vals: jax.Array, mask: jax.Array):
    """Inserts absent keys; returns the table and int32 ``[K]`` slots (-1: not inserted because
    the key was present, or repeated earlier in this batch, or not masked)."""
    size = table.vals.shape[0]
    home = _home(keys, size)
    k = keys.shape[0]
    # Claim markers, all below TOMBSTONE; the earliest entry has the smallest.
    code = jnp.arange(k, dtype=jnp.int32) - (3 + k)

    def body(carry):
        probe, pending, slots, t = carry
        pos = (home + probe) & (size - 1)
        val = t.vals[pos]
        present = pending & (val >= 0) & _same(t.keys[pos], keys)
        empty = pending & (val == EMPTY) & ~present
        # Several entries may reach one empty slot: the earliest entry (smallest marker) wins.
        # Equal keys probe in lockstep, so the losers of a slot won by their own key stop there.
        claimed = t.vals.at[jnp.where(empty, pos, size)].min(code, mode="drop")
        won = empty & (claimed[pos] == code)
        target = jnp.where(won, pos, size)
        t = t.replace(
            vals=claimed.at[target].set(vals, mode="drop"),
            keys=t.keys.at[target].set(keys, mode="drop"),
        )
        lost_to_twin = empty & ~won & _same(t.keys[pos], keys)
        slots = jnp.where(won, pos, slots)
        pending = pending & ~present & ~won & ~lost_to_twin
        return probe + 1, pending, slots, t

    init = (jnp.int32(0), mask, jnp.full(mask.shape, -1, jnp.int32), table)
    _, _, slots, table = lax.while_loop(lambda c: jnp.any(c[1]) & (c[0] < size), body, init)
    inserted = jnp.sum(slots >= 0, dtype=jnp.int32)
    return table.replace(num_live=table.num_live + inserted), slots


def insert(
    table: HashTable,
    keys: jax.Array,
    vals: jax.Array,
    mask: jax.Array,
    all_keys: jax.Array,
    all_slots: jax.Array,
) -> tuple[HashTable, jax.Array, jax.Array]:
    """Inserts ``keys[mask] -> vals[mask]`` where the key is not present yet.

    Args:
      keys: uint32 ``[K, 2]``; vals: int32 ``[K]`` (block ids); mask: bool ``[K]``.
      all_keys: uint32 ``[N, 2]`` the key of every block; all_slots: int32 ``[N]`` each block's
        slot or -1: what a rebuild re-inserts.

    Returns:
      The table, ``all_slots`` (changed only by a rebuild) and int32 ``[K]`` slots of the new
      entries (-1 where not inserted).
    """
    size = table.vals.shape[0]
    count = jnp.sum(mask, dtype=jnp.int32)
    crowded = table.num_live + table.num_dead + count > size // 2

    def rebuild(args):
        table, all_slots = args
        n = all_slots.shape[0]
        fresh, slots = _claim(
            empty_table(size), all_keys, jnp.arange(n, dtype=jnp.int32), all_slots >= 0
        )
        return fresh, slots

    table, all_slots = lax.cond(crowded, rebuild, lambda args: args, (table, all_slots))
    table, slots = _claim(table, keys, vals, mask)
    return table, all_slots, slots


def remove(table: HashTable, slots: jax.Array, mask: jax.Array) -> HashTable:
    """Tombstones the entries at ``slots[mask]`` (distinct, live)."""
    size = table.vals.shape[0]
    count = jnp.sum(mask, dtype=jnp.int32)
    vals = table.vals.at[jnp.where(mask, slots, size)].set(TOMBSTONE, mode="drop")
    return table.replace(vals=vals, num_live=table.num_live - count, num_dead=table.num_dead + count)
