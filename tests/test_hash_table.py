"""The open-addressing hash table against a dict of lists: windowed probing, the probing loop
beyond the window (forced with keys that share a home slot), several blocks per key (in a batch
and across batches; a lookup returns the oldest), tombstones, rebuilds that keep each key's
order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv import hash_table as ht


def _keys(rng, n, size, clustered):
    keys = rng.integers(0, 2**32, (n, 2), dtype=np.uint32)
    if clustered:  # every key starts probing at one of three home slots
        keys[:, 0] = (keys[:, 0] & ~np.uint32(size - 1)) | rng.integers(0, 3, n).astype(np.uint32)
    return keys


def _insert(table, keys, vals, mask, all_keys, all_slots):
    """``claim``, after a rebuild when the table is crowded (as ``prefix_cache.register`` does):
    the table, ``all_slots`` (changed only by a rebuild) and the new entries' slots."""
    size = table.entries.shape[0]
    table, all_slots = jax.lax.cond(ht.needs_rebuild(table, jnp.sum(mask, dtype=jnp.int32)),
                                    lambda a: ht.rebuild(size, all_keys, a[1] >= 0, a[1]), lambda a: a,
                                    (table, all_slots))
    table, slots, _, _ = ht.claim(table, keys, vals, mask)
    return table, all_slots, slots


@pytest.mark.parametrize("clustered", [False, True])
def test_insert_lookup_remove_match_a_dict(clustered):
    size, n_blocks = 512, 400  # block ids are never reused; live entries stay under size / 2, and
    # tombstones push them past it: rebuilds happen
    rng = np.random.default_rng(7 + clustered)
    table = ht.empty_table(size)
    all_keys = np.zeros((n_blocks, 2), np.uint32)
    all_slots = jnp.full((n_blocks,), -1, jnp.int32)
    model: dict[tuple[int, int], list[int]] = {}  # key -> its blocks, oldest first
    insert = jax.jit(_insert)
    lookup = jax.jit(ht.lookup)
    remove = jax.jit(ht.remove)
    next_block = 0
    rebuilds, dead = 0, 0
    for step in range(14):
        k = 24
        fresh = _keys(rng, k, size, clustered)
        fresh[k // 2:] = fresh[: k // 2][rng.permutation(k // 2)]  # duplicates within the batch
        present = list(model)
        if present:  # some keys already in the table
            pick = rng.integers(0, len(present), 6)
            fresh[:6] = np.array([present[i] for i in pick], np.uint32)
        blocks = (next_block + np.arange(k)) % n_blocks
        mask = rng.random(k) < 0.9
        all_keys[blocks] = fresh
        table, all_slots, slots = insert(table, jnp.asarray(fresh), jnp.asarray(blocks, jnp.int32),
                                         jnp.asarray(mask), jnp.asarray(all_keys), all_slots)
        slots = np.asarray(slots)
        rebuilds += int(table.num_dead) < dead
        for i in range(k):
            if mask[i]:
                model.setdefault(tuple(int(x) for x in fresh[i]), []).append(int(blocks[i]))
                assert slots[i] >= 0, (step, i)
            else:
                assert slots[i] == -1, (step, i)
        assert len(set(slots[mask].tolist())) == mask.sum()
        all_slots = all_slots.at[jnp.asarray(blocks)].set(jnp.where(jnp.asarray(slots) >= 0, jnp.asarray(slots),
                                                                    all_slots[jnp.asarray(blocks)]))
        next_block += k
        # Remove a few entries (tombstones): sometimes a key's oldest block, sometimes a younger one.
        vslots = []
        for key in list(model)[:8]:
            blocks_of = model[key]
            b = blocks_of.pop(int(rng.integers(0, len(blocks_of))))
            if not blocks_of:
                del model[key]
            vslots.append(int(all_slots[b]))
            all_slots = all_slots.at[b].set(-1)
        table = remove(table, jnp.asarray(vslots, jnp.int32), jnp.ones(len(vslots), bool))
        dead = int(table.num_dead)
        # Every present key is found with its oldest block; absent ones are not.
        probe = np.concatenate([np.array(list(model), np.uint32).reshape(-1, 2),
                                _keys(rng, 16, size, clustered)])
        found = np.asarray(lookup(table, jnp.asarray(probe), jnp.ones(len(probe), bool)))
        want = [model.get(tuple(int(x) for x in key), [-1])[0] for key in probe]
        np.testing.assert_array_equal(found, want)
    assert int(table.num_live) == sum(map(len, model.values()))
    assert rebuilds >= 1
    assert max(map(len, model.values())) >= 3  # keys with several blocks survived rebuilds



@pytest.mark.parametrize("k,clustered", [(700, False), (3000, False), (500, True)])
def test_first_of_keys_groups_by_key(k, clustered):
    rng = np.random.default_rng(3)
    base = rng.integers(0, 2**32, (k // 14, 2), dtype=np.uint32)
    if clustered:  # distinct keys with one home slot: long probe runs, many claim rounds
        base[:, 0] &= np.uint32(0xFFFF0000)
    keys = base[rng.integers(0, len(base), k)]
    mask = rng.random(k) < 0.7
    got = np.asarray(jax.jit(ht.first_of_keys)(jnp.asarray(keys), jnp.asarray(mask)))
    first: dict = {}
    for i in range(k):
        if mask[i]:
            assert got[i] == first.setdefault(tuple(keys[i]), i)
        else:
            assert got[i] == -1
