"""Chunked admission: ``admit(..., chunk=...)`` takes blocks for the prefix hit and the rest of the
chunk it ends in (the prompt cut at multiples of the chunk, as the serving engine's prefill
pieces), then ``extend(..., commit=True)`` brings in the rest of the prompt chunk by chunk (as vLLM's
scheduler allocates per prefill chunk), so a window group holds a window's worth of blocks at
every chunk instead of the whole prompt's. Checked against ``GroupedReference`` after every call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv as pk
from paged_kv.config import Group
from paged_kv.invariants import check_invariants, free_queue_order
from paged_kv.reference import GroupedReference

BS, WINDOW, CHUNK = 4, 16, 14
GEMMA3 = (Group("window", WINDOW),) * 5 + (Group("full"),)  # 5 windows : 1 full, as Gemma 3
ADMIT = jax.jit(pk.admit, static_argnums=0)
EXTEND = jax.jit(pk.extend, static_argnums=0, static_argnames=("commit", "max_new"))


def config(retention):
    return pk.ManagerConfig(num_blocks=6 * 40 * 2 + 2, block_size=BS, max_seqs=3, max_blocks_per_seq=40,
                            groups=GEMMA3, prefix_caching=True, prefix_cache_retention_interval=retention)


def snapshot(cfg, state, sid):
    held = int(cfg.blocks_for(int(state.num_tokens[sid])))
    cached = sorted(np.flatnonzero(np.asarray(state.cache.slot) >= 0).tolist())
    return (np.asarray(state.tables[:, sid, :held]).tolist(), free_queue_order(state),
            np.asarray(state.ref_count).tolist(), cached)


def reference_snapshot(ref, sid):
    return ref.tables[sid], ref.queue_order(), list(ref.ref_count), sorted(ref.cached_blocks())


def admit_chunked(cfg, state, ref, sid, prompt):
    """Admits ``prompt`` chunk by chunk on both managers; returns the state, the hit tokens and the
    most blocks any window group held after any chunk."""
    state, r = ADMIT(cfg, state, jnp.asarray([sid], jnp.int32), jnp.asarray([len(prompt)], jnp.int32),
                     jnp.asarray([prompt], jnp.int32), chunk=jnp.asarray([CHUNK], jnp.int32))
    want = ref.admit([sid], [prompt], chunk=[CHUNK])
    assert [(int(r.status[0]), int(r.cached_tokens[0]), int(r.shared_tokens[0]))] == \
        [(int(a), b, c) for a, b, c in want]
    assert int(r.status[0]) == pk.Status.OK
    hit = int(r.cached_tokens[0] + r.shared_tokens[0])
    assert int(state.num_tokens[sid]) == min(len(prompt), (hit // CHUNK + 1) * CHUNK)
    most = 0
    while True:
        check_invariants(cfg, state)
        assert snapshot(cfg, state, sid) == reference_snapshot(ref, sid)
        n = int(state.num_tokens[sid])
        tables = np.asarray(state.tables[:, sid, :cfg.blocks_for(n)])
        window_held = [int(np.sum(tables[g] != pk.NULL_BLOCK)) for g, grp in enumerate(GEMMA3) if not grp.is_full]
        most = max(most, *window_held)
        if n == len(prompt):
            return state, hit, most
        k = min((n // CHUNK + 1) * CHUNK, len(prompt)) - n
        toks = prompt[n:n + k] + [0] * (CHUNK - k)
        state, res = EXTEND(cfg, state, jnp.asarray([sid], jnp.int32), jnp.asarray([k], jnp.int32),
                            jnp.asarray([toks], jnp.int32), commit=True,
                            prompt_lens=jnp.asarray([len(prompt)], jnp.int32))
        status, _, _, _ = ref.extend([sid], [k], [toks], CHUNK, commit=True, prompt_lens=[len(prompt)])
        assert int(res.status[0]) == int(status[0]) == pk.Status.OK


@pytest.mark.parametrize("retention", [None, 0])
def test_long_prompt_holds_a_window_per_window_group(retention):
    """A 150-token prompt (38 blocks) in chunks of 14: each window group holds at most the blocks
    from the one the chunk's first token still sees to the chunk's last, ``(WINDOW + CHUNK - 2)
    // BS + 2``, never the prompt's 38; the full group holds them all. A second request with the
    same first 120 tokens then hits the prefix the first one's chunks registered (with dense
    retention; sparse retention hashes a window group's blocks only before the prompt boundary)
    and takes blocks to 126, the end of its chunk. The same prompt again hits 148 tokens under
    both retentions, as after a whole-prompt admission: the last chunk's ``extend`` registered
    the window blocks before the boundary (``prompt_lens``). Identically in the jitted manager
    and the reference."""
    cfg = config(retention)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 50, 150).tolist()
    ref = GroupedReference(cfg)
    state, hit, most = admit_chunked(cfg, pk.init_state(cfg), ref, 0, prompt)
    bound = (WINDOW + CHUNK - 2) // BS + 2
    assert hit == 0 and most <= bound < cfg.blocks_for(len(prompt))
    whole = np.asarray(state.tables[-1, 0, :cfg.blocks_for(len(prompt))])
    assert np.all(whole != pk.NULL_BLOCK)

    second = prompt[:120] + rng.integers(1, 50, 30).tolist()
    state, hit, most = admit_chunked(cfg, state, ref, 1, second)
    assert most <= bound
    if retention is None:
        assert hit == 120
    state, hit, most = admit_chunked(cfg, state, ref, 2, prompt)
    assert hit == 148 and most <= bound


def test_whole_prompt_chunk_equals_plain_admission():
    """A chunk at least as long as the prompt is the plain admission: same tables, counts, queue."""
    cfg = config(0)
    prompt = list(range(1, 60))
    args = (jnp.asarray([0], jnp.int32), jnp.asarray([len(prompt)], jnp.int32), jnp.asarray([prompt], jnp.int32))
    plain, _ = ADMIT(cfg, pk.init_state(cfg), *args)
    chunked, _ = ADMIT(cfg, pk.init_state(cfg), *args, chunk=jnp.asarray([len(prompt)], jnp.int32))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), plain, chunked))


def test_chunk_below_one_is_bad_length():
    cfg = config(0)
    _, r = ADMIT(cfg, pk.init_state(cfg), jnp.asarray([0], jnp.int32), jnp.asarray([8], jnp.int32),
                 jnp.asarray([list(range(8))], jnp.int32), chunk=jnp.asarray([0], jnp.int32))
    assert int(r.status[0]) == pk.Status.BAD_LENGTH


def test_single_group_with_prefix_caching_refuses_chunk():
    cfg = pk.ManagerConfig(num_blocks=8, block_size=BS, max_seqs=1, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="chunk"):
        pk.admit(cfg, pk.init_state(cfg), [0], [4], [[1, 2, 3, 4]], chunk=[2])


def test_single_group_without_prefix_caching_admits_the_first_chunk():
    """Without the cache there is no hit: a row takes blocks for its first ``chunk`` tokens."""
    cfg = pk.ManagerConfig(num_blocks=16, block_size=BS, max_seqs=2, max_blocks_per_seq=8, prefix_caching=False)
    state, r = ADMIT(cfg, pk.init_state(cfg), jnp.asarray([0, 1], jnp.int32), jnp.asarray([20, 5], jnp.int32),
                     None, chunk=jnp.asarray([6, 8], jnp.int32))
    assert np.asarray(r.status).tolist() == [pk.Status.OK] * 2
    assert np.asarray(state.num_tokens[:2]).tolist() == [6, 5]
    assert int(state.queue.num_free) == 15 - 2 - 2
