"""Bad configs and bad inputs to the host wrapper raise clear errors and change nothing."""

import jax
import numpy as np
import pytest

import paged_kv as pk


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_blocks=1), "num_blocks must be >= 2, got 1"),
        (dict(num_blocks=64, block_size=12), "block_size must be a power of two, got 12"),
        (dict(num_blocks=64, block_size=0), "block_size must be >= 1, got 0"),
        (dict(num_blocks=64, max_seqs=0), "max_seqs must be >= 1, got 0"),
        (dict(num_blocks=64, max_blocks_per_seq=-3), "max_blocks_per_seq must be >= 1, got -3"),
        (dict(num_blocks=64.0), "num_blocks must be a Python int, got 64.0"),
        (dict(num_blocks=True), "num_blocks must be a Python int"),
        (dict(num_blocks=2**28, block_size=16), "overflows int32 slot indices"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pk.ManagerConfig(**kwargs)


CFG = pk.ManagerConfig(num_blocks=32, block_size=4, max_seqs=4, max_blocks_per_seq=4)


@pytest.fixture
def bm():
    bm = pk.BlockManager(CFG)
    bm.admit([0], [[1, 2, 3, 4, 5]])
    return bm


def _frozen(bm):
    return [np.asarray(x).copy() for x in jax.tree.leaves(bm.state)]


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda bm: bm.admit([0], [[1]]), ValueError, "sequence 0 is already running"),
        (lambda bm: bm.admit([4], [[1]]), ValueError, r"sequence id 4 out of range \[0, 4\)"),
        (lambda bm: bm.admit([-1], [[1]]), ValueError, "sequence id -1 out of range"),
        (lambda bm: bm.admit([1, 1], [[1], [2]]), ValueError, "sequence id 1 appears more than once"),
        (lambda bm: bm.admit([1], [[]]), ValueError, "prompt of sequence 1 is empty"),
        (lambda bm: bm.admit([1], [[0] * 17]), ValueError,
         "prompt of sequence 1 has 17 tokens; a sequence holds at most 16"),
        (lambda bm: bm.admit([1], [[3, -5]]), ValueError, "invalid token id -5 at position 1"),
        (lambda bm: bm.admit([1], [[3, 1.5]]), ValueError, "invalid token id 1.5 at position 1"),
        (lambda bm: bm.admit([1, 2], [[3]]), ValueError, "2 sequence ids but 1 prompts"),
        (lambda bm: bm.admit(["a"], [[3]]), ValueError, "sequence id 'a' is not an int"),
        (lambda bm: bm.append([0, 2], [1, 1]), KeyError, "append: sequence 2 is not running"),
        (lambda bm: bm.append([0, 0], [1, 1]), ValueError, "sequence id 0 appears more than once"),
        (lambda bm: bm.append([0]), ValueError, "token_ids are required with prefix_caching=True"),
        (lambda bm: bm.append([0], [1, 2]), ValueError, "1 sequence ids but 2 token ids"),
        (lambda bm: bm.append([0], [-3]), ValueError, "invalid token id -3 for sequence 0"),
        (lambda bm: bm.admit([1], [[3]], salts=[-1]), ValueError,
         r"salt -1 of sequence 1 is not an int in \[0, 2\*\*32\)"),
        (lambda bm: bm.admit([1], [[3]], salts=[1, 2]), ValueError, "1 sequence ids but 2 salts"),
        (lambda bm: bm.free([3]), KeyError, "free: sequence 3 is not running"),
        (lambda bm: bm.fork(1, [2]), KeyError, "fork source: sequence 1 is not running"),
        (lambda bm: bm.fork(0, [0]), ValueError, "fork: sequence 0 is already running"),
        (lambda bm: bm.fork(0, [5]), ValueError, r"sequence id 5 out of range \[0, 4\)"),
        (lambda bm: bm.select([1], [2]), KeyError, "select parent: sequence 2 is not running"),
        (lambda bm: bm.select([1, 2], [0]), ValueError, "2 destinations but 1 parents"),
        (lambda bm: bm.table(2), KeyError, "table: sequence 2 is not running"),
        (lambda bm: bm.ref_count(99), ValueError, r"block 99 out of range \[0, 32\)"),
    ],
)
def test_bad_input_raises_and_changes_nothing(bm, call, error, match):
    before = _frozen(bm)
    with pytest.raises(error, match=match):
        call(bm)
    for a, b in zip(before, _frozen(bm)):
        np.testing.assert_array_equal(a, b)


def test_manager_needs_a_config():
    with pytest.raises(ValueError, match="config must be a ManagerConfig"):
        pk.BlockManager({"num_blocks": 4})
