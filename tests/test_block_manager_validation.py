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


# -- fuzzing every public method with malformed arguments --------------------------------------------

# Values that are wrong as a list of ids, a prompt, a list of prompts, a scalar id, a token id, ...
BAD = [
    [], 0, 3, True, False, 1.5, -1, 10**9, 2**32 - 1, 2**63, np.int64(1), np.float32(1.0), np.array(1),
    np.array([1.0]), np.array([[1]]), np.array([True]), [[0]], [[[0]]], "0", "ab", b"1", None, {0: 1}, {0},
    [None], [1.5], [True], [-1], [2**32 - 1], [np.float64(0)], ["a"], [0, 0], object(),
]

# (name, call with one argument replaced): the other arguments are valid for the fixture (sequence 0
# running with 5 tokens; sequences 1..3 free).
CALLS = {
    "admit.seq_ids": lambda bm, v: bm.admit(v, [[1, 2]]),
    "admit.prompts": lambda bm, v: bm.admit([1], v),
    "admit.prompt": lambda bm, v: bm.admit([1], [v]),
    "admit.salts": lambda bm, v: bm.admit([1], [[1, 2]], salts=v),
    "append.seq_ids": lambda bm, v: bm.append(v, [7]),
    "append.token_ids": lambda bm, v: bm.append([0], v),
    "fork.src": lambda bm, v: bm.fork(v, [1]),
    "fork.dst_ids": lambda bm, v: bm.fork(0, v),
    "select.dst_ids": lambda bm, v: bm.select(v, [0]),
    "select.parent_ids": lambda bm, v: bm.select([1], v),
    "free.seq_ids": lambda bm, v: bm.free(v),
    "table": lambda bm, v: bm.table(v),
    "num_tokens": lambda bm, v: bm.num_tokens(v),
    "ref_count": lambda bm, v: bm.ref_count(v),
}

# Raw Python / NumPy / JAX messages that must never reach the caller.
RAW = ("object is not iterable", "empty sequence", "unhashable", "not subscriptable", "has no len",
       "index", "NoneType", "could not convert", "invalid literal", "only integer", "Traceback")


def _bad_id(v) -> str:
    """A test id that is the same in every process (pytest-xdist workers must collect the same
    ids): an object's repr carries its address."""
    text = "object()" if type(v) is object else repr(v)
    return f"{type(v).__name__}:{text}"[:40]


@pytest.mark.parametrize("value", BAD, ids=_bad_id)
@pytest.mark.parametrize("name", list(CALLS))
def test_fuzz_bad_argument_is_clear_and_changes_nothing(name, value):
    bm = pk.BlockManager(CFG)
    bm.admit([0], [[1, 2, 3, 4, 5]])
    before = _frozen(bm)
    try:
        CALLS[name](bm, value)
    except (ValueError, TypeError, KeyError) as e:
        msg = str(e)
        assert msg and "\n" not in msg, msg
        assert not any(raw in msg for raw in RAW), msg
        for a, b in zip(before, _frozen(bm)):
            np.testing.assert_array_equal(a, b)
    # a call that works is fine (e.g. admit([1], [[0]]), ref_count(3), an empty batch)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda bm: bm.admit([], [[1]]), "0 sequence ids but 1 prompts"),
        (lambda bm: bm.admit(1, [[1]]), "admit: seq_ids must be a sequence of sequence ids, got int 1"),
        (lambda bm: bm.admit([1], 5), "admit: prompts must be a sequence of prompts .* got int 5"),
        (lambda bm: bm.admit([1], [5]), "prompt of sequence 1 must be a sequence of token ids, got int 5"),
        (lambda bm: bm.admit([1], ["abc"]), "prompt of sequence 1 must be a sequence of token ids, got str 'abc'"),
        (lambda bm: bm.admit([1], [np.array([1.0, 2.0])]), r"invalid token id np.float64\(1.0\) at position 0"),
        (lambda bm: bm.admit([1], [[[1]]]), r"invalid token id \[1\] at position 0"),
        (lambda bm: bm.admit([1], [[2**32 - 1]]), r"invalid token id 4294967295 .* ints in \[0, 2\*\*31\)"),
        (lambda bm: bm.admit([True], [[1]]), "sequence id True is not an int"),
        (lambda bm: bm.admit(None, [[1]]), "seq_ids must be a sequence of sequence ids, got None$"),
        (lambda bm: bm.admit(np.array([[1]]), [[1]]), r"got a 2-D array of shape \(1, 1\)"),
        (lambda bm: bm.admit([1], [[1]], salts=5), "salts must be a sequence of ints in .*got int 5"),
        (lambda bm: bm.admit([1], [[1]], salts=[2**32]), r"salt 4294967296 of sequence 1 is not an int"),
        (lambda bm: bm.append(0, [1]), "append: seq_ids must be a sequence of sequence ids, got int 0"),
        (lambda bm: bm.append([0], 7), "append: token_ids must be a sequence of token ids, got int 7"),
        (lambda bm: bm.append([0], [True]), "invalid token id True for sequence 0"),
        (lambda bm: bm.fork([0], [1]), r"fork source: sequence id \[0\] is not an int"),
        (lambda bm: bm.fork(0, 1), "fork: dst_ids must be a sequence of sequence ids, got int 1"),
        (lambda bm: bm.select([1], 0), "select: parent_ids must be a sequence of sequence ids, got int 0"),
        (lambda bm: bm.select([1], [1.0]), "select parent: sequence id 1.0 is not an int"),
        (lambda bm: bm.free("0"), "free: seq_ids must be a sequence of sequence ids, got str '0'"),
        (lambda bm: bm.free([2**32 - 1]), r"sequence id 4294967295 out of range \[0, 4\)"),
        (lambda bm: bm.table(None), "table: sequence id None is not an int"),
        (lambda bm: bm.num_tokens(-1), r"num_tokens: sequence id -1 out of range \[0, 4\)"),
        (lambda bm: bm.free([0, 1, 2, 3, 0]), "free: 5 sequence ids in one call; max_seqs is 4"),
        (lambda bm: bm.ref_count(1.5), "ref_count: block 1.5 is not an int"),
        (lambda bm: bm.ref_count(True), "ref_count: block True is not an int"),
        (lambda bm: bm.ref_count(-1), r"ref_count: block -1 out of range \[0, 32\)"),
        (lambda bm: bm.ref_count(np.array([1])), r"ref_count: block array\(\[1\]\) is not an int"),
    ],
)
def test_bad_argument_message(bm, call, match):
    before = _frozen(bm)
    with pytest.raises(ValueError, match=match):
        call(bm)
    for a, b in zip(before, _frozen(bm)):
        np.testing.assert_array_equal(a, b)


def test_empty_batches_do_nothing(bm):
    before = _frozen(bm)
    for result in (bm.admit([], []), bm.append([], []), bm.fork(0, []), bm.select([], []), bm.free([])):
        arrays = [result] if isinstance(result, np.ndarray) else [getattr(result, f) for f in ("status",)]
        assert all(a.shape == (0,) for a in arrays)
    assert bm.append([], []).num_copies == 0
    for a, b in zip(before, _frozen(bm)):
        np.testing.assert_array_equal(a, b)


def test_numpy_and_tuple_inputs_work(bm):
    r = bm.admit(np.array([1, 2]), np.array([[1, 2, 3], [1, 2, 3]]), salts=np.array([0, 0], np.uint32))
    assert r.status.tolist() == [0, 0]
    assert bm.append((1, 2), np.array([4, 4], np.int64)).status.tolist() == [0, 0]
    assert bm.num_tokens(np.int64(1)) == 4 and bm.ref_count(np.int32(0)) >= 0
    assert bm.free(range(1, 3)).tolist() == [0, 0]
