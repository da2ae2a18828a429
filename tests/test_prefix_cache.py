"""Prefix caching: the issue's worked examples, eviction order, salts, verified hits, statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv as pk
from paged_kv import block_hash, scan
from paged_kv.invariants import check_invariants

BS = 16
CFG = pk.ManagerConfig(num_blocks=64, block_size=BS, max_seqs=8, max_blocks_per_seq=16)


def prompt(n_tokens, start=1000):
    return list(range(start, start + n_tokens))


@pytest.fixture
def bm():
    return pk.BlockManager(CFG)


def test_second_request_hits_three_full_blocks_and_gets_one_fresh(bm):
    p = prompt(3 * BS + 7)
    first = bm.admit([0], [p])
    assert (first.cached_tokens[0], first.shared_tokens[0]) == (0, 0)
    second = bm.admit([1], [p])
    assert second.cached_tokens[0] == 3 * BS
    t0, t1 = bm.table(0), bm.table(1)
    assert t1[:3] == t0[:3] and t1[3] != t0[3]
    assert [bm.ref_count(b) for b in t1] == [2, 2, 2, 1]
    check_invariants(CFG, bm.state)
    # After both finish, a third request finds the same physical blocks in the free queue.
    bm.free([0, 1])
    third = bm.admit([2], [p])
    assert third.cached_tokens[0] == 3 * BS and bm.table(2)[:3] == t0[:3]
    assert [bm.ref_count(b) for b in bm.table(2)[:3]] == [1, 1, 1]
    assert not set(t0[:3]) & set(bm.free_queue())
    check_invariants(CFG, bm.state)


def test_fully_cached_prompt_still_computes_its_last_block(bm):
    p = prompt(4 * BS)
    bm.admit([0], [p])
    again = bm.admit([1], [p])
    assert again.cached_tokens[0] == 3 * BS  # not 4: the last token's logits are needed
    assert bm.table(1)[:3] == bm.table(0)[:3] and bm.table(1)[3] != bm.table(0)[3]
    one_more = bm.admit([2], [p + [7]])  # 4 full blocks + 1 token: all 4 hit
    assert one_more.cached_tokens[0] == 4 * BS


def test_eviction_takes_least_recently_freed_first_and_tail_before_root():
    cfg = pk.ManagerConfig(num_blocks=9, block_size=BS, max_seqs=4, max_blocks_per_seq=8)
    bm = pk.BlockManager(cfg)
    a, b = prompt(4 * BS, 0), prompt(4 * BS, 500)
    bm.admit([0], [a + [1]])  # 4 full cached blocks + a partly full one
    bm.admit([1], [b[:2 * BS]])  # 2 full blocks
    ta, tb = bm.table(0), bm.table(1)
    bm.free([0])
    bm.free([1])
    # a's partly full tail is not cached: front. Then a's blocks tail first, then b's.
    assert bm.free_queue() == [ta[4], 8, ta[3], ta[2], ta[1], ta[0], tb[1], tb[0]]
    # Allocating 3 fresh blocks (unrelated prompt) takes the uncached block, free block 8, then
    # a's deepest block: a's root survives while its tail is evicted.
    bm.admit([2], [prompt(3 * BS, 9000)])
    assert bm.table(2) == [ta[4], 8, ta[3]]
    assert bm.cache_stats()["evictions"] == 1
    again = bm.admit([3], [a + [1]])
    assert again.cached_tokens[0] == 3 * BS  # a's first 3 blocks still hit; the 4th was evicted
    assert bm.table(3)[:3] == ta[:3]
    check_invariants(cfg, bm.state)


def test_evicted_block_hash_no_longer_hits():
    cfg = pk.ManagerConfig(num_blocks=4, block_size=BS, max_seqs=4, max_blocks_per_seq=4)
    bm = pk.BlockManager(cfg)
    p = prompt(BS + 1)
    bm.admit([0], [p])
    root = bm.table(0)[0]
    bm.free([0])
    bm.admit([1], [prompt(3 * BS, 7000)])  # takes every free block, root included
    assert root in bm.table(1)
    bm.free([1])
    assert bm.admit([2], [p]).cached_tokens[0] == 0
    check_invariants(cfg, bm.state)


def test_salts_separate_tenants(bm):
    p = prompt(2 * BS + 3)
    bm.admit([0], [p], salts=[1])
    assert bm.admit([1], [p], salts=[2]).cached_tokens[0] == 0
    assert not set(bm.table(0)) & set(bm.table(1))
    assert bm.admit([2], [p], salts=[1]).cached_tokens[0] == 2 * BS
    assert bm.table(2)[:2] == bm.table(0)[:2]


def test_requests_of_one_call_share_common_prefix_blocks(bm):
    system = prompt(2 * BS, 0)
    r = bm.admit([0, 1, 2], [system + [1, 2, 3], system + [4, 5], prompt(BS + 1, 300)])
    assert r.status.tolist() == [0, 0, 0]
    assert r.shared_tokens.tolist() == [0, 2 * BS, 0] and r.cached_tokens.tolist() == [0, 0, 0]
    assert bm.table(1)[:2] == bm.table(0)[:2]
    assert [bm.ref_count(b) for b in bm.table(0)[:2]] == [2, 2]
    assert bm.cache_stats()["hit_tokens"] == 2 * BS
    check_invariants(CFG, bm.state)


def test_blocks_filled_while_decoding_are_cached(bm):
    # Prompts of 33 to 64 tokens, as in the tests above: the admission compiled for them is reused.
    p = prompt(3 * BS - 2)
    bm.admit([0], [p])
    assert bm.cache_stats()["cached_blocks"] == 2  # the prompt's two full blocks
    generated = [7, 8, 9]
    for t in generated:
        bm.append([0], [t])
    assert bm.cache_stats()["cached_blocks"] == 3  # the third block filled at token 48
    later = bm.admit([1], [p + generated])
    assert later.cached_tokens[0] == 3 * BS and bm.table(1)[:3] == bm.table(0)[:3]
    check_invariants(CFG, bm.state)


def test_forced_collision_never_reuses_other_tokens(monkeypatch):
    """With a key that maps every block to the same value, only a block whose stored tokens,
    salt and parent match can be reused."""
    monkeypatch.setattr(block_hash, "key_of", lambda chain: jnp.zeros_like(chain))
    cfg = pk.ManagerConfig(num_blocks=40, block_size=4, max_seqs=6, max_blocks_per_seq=8)
    bm = pk.BlockManager(cfg)
    bm.admit([0], [[1, 2, 3, 4, 5, 6, 7, 8, 9]])
    other = bm.admit([1], [[1, 2, 3, 5, 5, 6, 7, 8, 9]])  # differs in block 0
    assert other.cached_tokens[0] == 0 and not set(bm.table(0)) & set(bm.table(1))
    deeper = bm.admit([2], [[5, 6, 7, 8, 1, 2, 3, 4, 0]])  # block 1 of seq 0 as a first block
    assert deeper.cached_tokens[0] == 0 and not set(bm.table(2)) & set(bm.table(0))
    same = bm.admit([3], [[1, 2, 3, 4, 9]])  # a real hit on the one cached key
    assert same.cached_tokens[0] == 4 and bm.table(3)[0] == bm.table(0)[0]
    batch = bm.admit([4, 5], [[4, 4, 4, 4, 4, 1], [4, 4, 4, 5, 4, 1]])
    assert batch.shared_tokens.tolist() == [0, 0]
    assert not set(bm.table(4)) & set(bm.table(5))
    check_invariants(cfg, bm.state)


def test_reset_prefix_cache_drops_only_idle_blocks(bm):
    bm.admit([0, 1], [prompt(2 * BS + 1, 0), prompt(3 * BS + 1, 100)])
    bm.free([1])
    assert bm.cache_stats()["cached_blocks"] == 5
    assert bm.reset_prefix_cache() == 3
    assert bm.cache_stats()["cached_blocks"] == 2
    assert bm.admit([2], [prompt(3 * BS + 1, 100)]).cached_tokens[0] == 0
    assert bm.admit([3], [prompt(2 * BS + 1, 0)]).cached_tokens[0] == 2 * BS
    check_invariants(CFG, bm.state)


def test_statistics(bm):
    p = prompt(2 * BS + 4)
    bm.admit([0], [p])
    bm.admit([1], [p])
    st = bm.cache_stats()
    assert (st["lookups"], st["query_tokens"], st["hit_tokens"]) == (2, 2 * len(p), 2 * BS)
    assert st["hit_rate"] == pytest.approx(2 * BS / (2 * len(p)))


def test_caching_off_behaves_like_the_plain_manager():
    cfg = pk.ManagerConfig(num_blocks=16, block_size=4, max_seqs=4, max_blocks_per_seq=4,
                           prefix_caching=False)
    bm = pk.BlockManager(cfg)
    bm.admit([0], [[1] * 9])
    assert bm.admit([1], [[1] * 9]).cached_tokens[0] == 0
    bm.append([0, 1])  # token ids are optional without caching
    table = bm.table(0)
    bm.free([0])
    assert bm.free_queue()[-3:] == table[::-1]  # every freed block to the back, tail first
    assert bm.reset_prefix_cache() == 0


def test_hash_is_deterministic_and_chained():
    tokens = jnp.arange(64, dtype=jnp.int32).reshape(2, 32)
    a = block_hash.key_of(block_hash.chain_states(jnp.array([0, 0], jnp.uint32), tokens, 16))
    b = jax.jit(lambda t: block_hash.key_of(
        block_hash.chain_states(jnp.array([0, 0], jnp.uint32), t, 16)))(tokens)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == jnp.uint32 and a.shape == (2, 2, 2)
    # Same second block after a different first block: different key.
    t2 = tokens.at[1, :16].set(tokens[0, :16])
    c = block_hash.key_of(block_hash.chain_states(jnp.array([0, 0], jnp.uint32), t2, 16))
    assert (c[1, 0] == a[0, 0]).all() and not (c[1, 1] == a[1, 1]).all()
    # Pinned values: a change to the hash function changes cache keys everywhere; do it on purpose.
    assert a[0, 0].tolist() == [3278217875, 4154983832]


@pytest.mark.parametrize("b,c", [(1, 36), (3, 5), (256, 36)])  # matrix, matrix, scan
def test_chain_states_match_the_sequential_recurrence(b, c):
    rng = np.random.default_rng(b + c)
    tokens = jnp.asarray(rng.integers(0, 32_000, (b, c * 16)), jnp.int32)
    salt = jnp.asarray(rng.integers(0, 2**32, b, dtype=np.uint32))
    got = np.asarray(jax.jit(block_hash.chain_states, static_argnums=2)(salt, tokens, 16))
    contents = np.asarray(block_hash.block_contents(tokens.reshape(b, c, 16)))
    x, want = np.asarray(block_hash.root_state(salt)), []
    with np.errstate(over="ignore"):
        for j in range(c):
            x = x * block_hash._CHAIN_MULT + contents[:, j]
            want.append(x)
    np.testing.assert_array_equal(got, np.stack(want, axis=1))
    assert (b * c * c <= block_hash.MATRIX_MAX) == (b < 256)


def _first_same_key_np(keys, member):
    """Reference: for each member entry, the first member entry with the same key."""
    out = np.full(len(member), -1)
    first = {}
    for i, (k, m) in enumerate(zip(map(tuple, keys), member)):
        if m:
            out[i] = first.setdefault(k, i)
    return out


@pytest.mark.parametrize("e", [37, 512, 513, 3000])
def test_in_call_grouping_matches_reference_on_both_paths(e):
    """``_representatives`` switches from an [E, E] comparison to a scratch hash table above
    ``PAIRWISE_MAX`` entries; both must give the first member with the same key."""
    from paged_kv.admission import _first_claims, _representatives

    rng = np.random.default_rng(e)
    pool = rng.integers(0, 2**32, (max(4, e // 5), 2), dtype=np.uint32)
    keys = pool[rng.integers(0, len(pool), e)]
    keys[: e // 10, 1] = pool[0, 1]  # some keys equal in one lane only
    member = rng.random(e) < 0.8
    rep = np.asarray(jax.jit(_representatives)(jnp.asarray(keys), jnp.asarray(member)))
    want = _first_same_key_np(keys, member)
    np.testing.assert_array_equal(rep[member], want[member])

    ids = rng.integers(1, 50, e).astype(np.int32)
    first = jax.jit(_first_claims)(jnp.asarray(ids), jnp.asarray(member))
    want_first = _first_same_key_np(ids[:, None], member) == np.arange(e)
    np.testing.assert_array_equal(np.asarray(first), want_first & member)


@pytest.mark.parametrize("k", [1, 36, scan.TRIANGLE_MAX, scan.TRIANGLE_MAX + 1, 3000])
def test_prefix_sum_and_leading_count_match_numpy(k):
    rng = np.random.default_rng(k)
    x = rng.integers(0, 2, (3, k)).astype(bool)
    x[1] = True
    np.testing.assert_array_equal(jax.jit(scan.prefix_sum)(jnp.asarray(x)), np.cumsum(x, axis=-1))
    counts = rng.integers(0, 5, k).astype(np.int32)
    np.testing.assert_array_equal(scan.prefix_sum(jnp.asarray(counts)), np.cumsum(counts))
    leading = np.arange(k) < np.asarray(jax.jit(scan.leading_count)(jnp.asarray(x)))[:, None]
    np.testing.assert_array_equal(leading, np.cumprod(x, axis=-1).astype(bool))


T = list(range(1, BS + 1))  # two distinct 16-token blocks
U = list(range(21, 21 + BS))


def test_duplicate_full_block_never_hides_a_cached_prefix():
    """Issue 14's repro. Request 1's block T is a duplicate of request 0's (a prompt's last token
    is always computed), and request 1 then fills U behind it. Both copies of T are cached, and
    U links to T's contents, not to one physical copy: T+U+y hits 32 tokens, as vLLM 0.33's
    KVCacheManager does (same tables, id for id)."""
    bm = pk.BlockManager(pk.ManagerConfig(num_blocks=11, block_size=BS, max_seqs=4, max_blocks_per_seq=8))
    bm.admit([0], [T + [90, 91]])
    bm.admit([1], [T])
    assert (bm.table(0), bm.table(1)) == ([1, 2], [3])
    assert np.asarray(pk.is_cached(bm.config, bm.state))[[1, 3]].all()  # the duplicate is cached too
    for tok in U:
        assert bm.append([1], [tok]).status[0] == pk.Status.OK
    res = bm.admit([2], [T + U + [77, 78]])
    assert res.cached_tokens[0] == 2 * BS
    assert bm.table(2) == [1, 4, 5]  # the oldest T, then request 1's U
    check_invariants(bm.config, bm.state)


def test_duplicate_outlives_the_evicted_original():
    """Admit T+x and T; free request 0; 48 unrelated tokens evict the original T; T+z still hits
    request 1's copy (vLLM 0.33: hit 16, table [3, 1]; queue after each free as in vLLM)."""
    bm = pk.BlockManager(pk.ManagerConfig(num_blocks=5, block_size=BS, max_seqs=4, max_blocks_per_seq=8))
    bm.admit([0], [T + [90, 91]])
    bm.admit([1], [T])
    bm.free([0])
    assert bm.free_queue() == [2, 4, 1]  # the partly full block to the front, T0 to the back
    assert bm.admit([2], [list(range(101, 149))]).cached_tokens[0] == 0
    assert bm.table(2) == [2, 4, 1]  # the original T is evicted
    bm.free([2])
    assert bm.free_queue() == [1, 4, 2]
    res = bm.admit([3], [T + [60, 61, 62]])
    assert res.cached_tokens[0] == BS and bm.table(3) == [3, 1]
    check_invariants(bm.config, bm.state)
