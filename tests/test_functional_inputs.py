"""The functional operations refuse, at trace time, arrays whose dtype or shape would silently
change their meaning: float ids and lengths (4.7 -> 4), bools, unsigned ids (2**32 - 1 -> -1,
padding), 64-bit values that would wrap at the jit boundary, and shapes that would broadcast."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv as pk

CFG = pk.ManagerConfig(num_blocks=16, block_size=4, max_seqs=4, max_blocks_per_seq=4)
i32 = lambda *v: jnp.asarray(v, jnp.int32)


def _ops():
    s = pk.init_state(CFG)
    toks = jnp.zeros((2, 8), jnp.int32)
    return {
        "admit": lambda **kw: pk.admit(CFG, s, kw.get("seq_ids", i32(0, 1)), kw.get("prompt_lens", i32(3, 5)),
                                       kw.get("prompt_tokens", toks), kw.get("salts", None)),
        "append": lambda **kw: pk.append(CFG, s, kw.get("seq_ids", i32(0, 1)), kw.get("token_ids", i32(3, 4))),
        "fork": lambda **kw: pk.fork(CFG, s, kw.get("src_ids", i32(0, 0)), kw.get("dst_ids", i32(1, 2))),
        "select": lambda **kw: pk.select(CFG, s, kw.get("dst_ids", i32(0, 1)), kw.get("parent_ids", i32(0, 0))),
        "free": lambda **kw: pk.free(CFG, s, kw.get("seq_ids", i32(0, 1))),
    }


BAD = [
    ("admit", "seq_ids", jnp.asarray([0.0, 1.7]), "signed integer"),
    ("admit", "seq_ids", jnp.asarray([True, False]), "signed integer"),
    ("admit", "seq_ids", jnp.asarray([2**32 - 1, 0], jnp.uint32), "signed integer"),
    ("admit", "seq_ids", jnp.asarray([[0, 1]], jnp.int32), "1 dimension"),
    ("admit", "prompt_lens", jnp.asarray([4.7, 3.0]), "signed integer"),
    ("admit", "prompt_lens", i32(3), "1 rows"),
    ("admit", "prompt_tokens", jnp.zeros((1, 8), jnp.int32), "1 rows"),
    ("admit", "prompt_tokens", jnp.zeros((2, 8), jnp.float32), "signed integer"),
    ("admit", "prompt_tokens", jnp.zeros((16,), jnp.int32), "2 dimension"),
    ("admit", "salts", jnp.asarray([0.5, 1.0]), "integer dtype"),
    ("admit", "salts", i32(0, 1, 2), "3 rows"),
    ("admit", "seq_ids", np.asarray([2**32, 1], np.int64), "outside the int32 range"),
    ("append", "token_ids", i32(3), "1 rows"),
    ("append", "token_ids", jnp.asarray([1.5, 2.0]), "signed integer"),
    ("append", "seq_ids", None, "is None"),
    ("fork", "src_ids", jnp.asarray([0.0, 0.0]), "signed integer"),
    ("fork", "src_ids", i32(0), "1 rows"),
    ("select", "parent_ids", i32(0, 0, 0), "3 rows"),
    ("free", "seq_ids", jnp.asarray([1.0]), "signed integer"),
    ("free", "seq_ids", "01", "signed integer"),
]


@pytest.mark.parametrize("op,arg,value,message", BAD, ids=[f"{o}-{a}-{i}" for i, (o, a, _, _) in enumerate(BAD)])
def test_bad_arrays_are_refused_before_tracing(op, arg, value, message):
    with pytest.raises(ValueError, match=message):
        _ops()[op](**{arg: value})


def test_checks_run_at_trace_time_under_jit():
    s = pk.init_state(CFG)
    step = jax.jit(pk.append, static_argnums=0)
    with pytest.raises(ValueError, match="token_ids has 1 rows but the batch"):
        step(CFG, s, i32(0, 1), i32(3))


def test_good_arrays_still_work():
    s, res = pk.admit(CFG, pk.init_state(CFG), np.asarray([0, -1]), [3, 0], np.zeros((2, 4), np.int64),
                      np.asarray([7, 0], np.uint32))
    assert np.asarray(res.status).tolist() == [pk.Status.OK, pk.Status.PADDING]
    s, out = pk.append(CFG, s, i32(0), i32(5))
    assert int(out.status[0]) == pk.Status.OK
