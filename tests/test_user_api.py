"""What a new user meets first: the views take ``(config, state)`` like the operations, status and
finish-reason codes have names (also for arrays returned from ``jit``), ``BlockManager`` statuses
and the prefix-cache counters print readably, and a mesh wider than the devices says how to get
CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv as pk
from paged_kv.engine import FinishReason

CFG = pk.ManagerConfig(num_blocks=16, block_size=4, max_seqs=4, max_blocks_per_seq=4)


def test_views_take_config_and_state_like_the_operations():
    state = pk.init_state(CFG)
    state, _ = jax.jit(pk.admit, static_argnums=0)(CFG, state, jnp.array([0]), jnp.array([6]),
                                                   jnp.arange(6, dtype=jnp.int32)[None])
    assert int(pk.num_free_blocks(CFG, state)) == CFG.num_blocks - 1 - 2
    assert pk.shared_blocks(CFG, state).shape == (CFG.num_blocks,)
    assert int(jax.jit(pk.num_free_blocks, static_argnums=0)(CFG, state)) == 13
    assert int(pk.usage(CFG, state).used) == 2
    with pytest.raises(TypeError):
        pk.num_free_blocks(state)  # the old one-argument form


def test_status_codes_have_names_also_from_jit():
    assert pk.Status.names(jnp.array([0, 1, 5], jnp.int32)) == ["OK", "NO_FREE_BLOCKS", "PADDING"]
    assert pk.Status.names(np.array([[0, 2], [3, 4]])) == [["OK", "TABLE_FULL"], ["BAD_SEQUENCE", "BAD_LENGTH"]]
    assert pk.Status.names(jnp.int32(1)) == "NO_FREE_BLOCKS" and pk.Status.names([9]) == ["9"]
    assert FinishReason.names(jnp.array([[1, 2], [5, 0]])) == [["EOS", "LENGTH"], ["BAD_TOKEN", "0"]]
    from paged_kv.engine import GenerateOutput

    out = GenerateOutput(tokens=None, logprobs=None, lengths=None, finish_reason=jnp.array([[1, 3]]), stats=None,
                         steps=None)
    assert out.finish_reason_names() == [["EOS", "NO_BLOCKS"]]


def test_block_manager_statuses_print_their_names():
    bm = pk.BlockManager(CFG)  # 15 allocatable blocks: the fourth 16-token prompt does not fit
    status = bm.admit([0, 1, 2, 3], [list(range(16 * i, 16 * i + 16)) for i in range(4)]).status
    assert repr(status) == "StatusArray([OK, OK, OK, NO_FREE_BLOCKS])"
    assert str(status) == "[OK OK OK NO_FREE_BLOCKS]" and status.names[3] == "NO_FREE_BLOCKS"
    # Still int32 numpy: compares, indexes and converts as before.
    assert status.dtype == np.int32 and status.tolist() == [0, 0, 0, 1] and status[3] == pk.Status.NO_FREE_BLOCKS
    assert (status == pk.Status.OK).tolist() == [True, True, True, False] and type(status == 0) is np.ndarray
    assert bm.free([0, 1, 2]).names == ["OK"] * 3
    bm.admit([0], [[1, 2, 3]])
    assert repr(bm.append([0], [4]).status) == "StatusArray([OK])"
    assert bm.fork(0, [2, 3]).names == ["OK", "OK"]


def test_cache_stats_print_as_counters():
    bm = pk.BlockManager(CFG)
    bm.admit([0], [list(range(8))])
    bm.free([0])
    bm.admit([1], [list(range(8))])
    stats = bm.state.cache.stats
    assert repr(stats) == str(stats) == ("CacheStats(lookups=2, query_tokens=16, hit_tokens=4 (hit rate 25.0 %), "
                                         "evictions=0)")
    assert stats.as_dict() == {"lookups": 2, "query_tokens": 16, "hit_tokens": 4, "evictions": 0, "hit_rate": 0.25}
    assert repr(pk.init_state(CFG).cache.stats).endswith("hit_tokens=0 (hit rate –), evictions=0)")
    seen = []
    jax.jit(lambda s: seen.append(repr(s)) or s.counts)(stats)  # a traced one prints its array, without failing
    assert seen[0].startswith("CacheStats(counts=") and "int32[4]" in seen[0]


def test_a_mesh_wider_than_the_devices_says_how_to_get_cpu_devices():
    from paged_kv.models import sharding

    n = len(jax.devices()) + 1
    with pytest.raises(ValueError, match=rf"tp={n} needs {n} devices; JAX has {n - 1} .*"
                                         rf"jax.config.update\(\"jax_num_cpu_devices\", {n}\)"):
        sharding.make_mesh(n)


def test_block_manager_compiles_once_per_padded_size():
    """What ``BlockManager``'s docstring says of compiling: ``admit`` compiles on the first call of
    a padded size (sequence ids to a power of two from 8, the longest prompt likewise), and later
    calls that pad to the same sizes, from any ``BlockManager`` of the config, reuse the program."""
    from paged_kv import manager

    cfg = pk.ManagerConfig(num_blocks=29, block_size=4, max_seqs=8, max_blocks_per_seq=8)  # this test's own
    assert "compiled on its first call" in " ".join(pk.BlockManager.__doc__.split())
    bm = pk.BlockManager(cfg)
    bm.admit([0], [[1, 2, 3]])
    compiled = manager._admit._cache_size()
    bm.admit([1, 2], [[4, 5], [6, 7, 8, 9, 10]])  # 2 ids and 5 tokens pad to 8 and 8: same program
    pk.BlockManager(cfg).admit([3], [[1] * 8])
    assert manager._admit._cache_size() == compiled
    bm.admit([4], [[2] * 9])  # 9 tokens pad to 16: a new program
    assert manager._admit._cache_size() == compiled + 1
