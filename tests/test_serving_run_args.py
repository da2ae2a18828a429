"""``ServingEngine.run`` checks its arguments when called, before any step, with one-line
``ValueError``s naming the bad value; a rejected call leaves the engine untouched."""

import numpy as np
import pytest

import paged_kv as pk
from paged_kv.engine import SamplingParams
from paged_kv.engine.serving import Request, ServingConfig, ServingEngine
from paged_kv.models import load_hf_checkpoint

CFG = ServingConfig(pk.ManagerConfig(num_blocks=8, block_size=16, max_seqs=4, max_blocks_per_seq=4),
                    chunk_size=16, max_prefill_rows=2, impl="reference")
REQ = Request((257, 65, 66), SamplingParams(max_new_tokens=2))


@pytest.fixture(scope="module")
def engine():
    return ServingEngine(load_hf_checkpoint("checkpoints/tiny-llama"), CFG)


def _never(_):
    raise AssertionError("no step may run")


@pytest.mark.parametrize("args, kwargs, match", [
    (([None],), {}, r"run: requests\[0\] is None, not a Request"),
    (([REQ, "abc"],), {}, r"run: requests\[1\] is str 'abc', not a Request"),
    ((REQ,), {}, "run: requests must be a sequence of Request objects, got Request"),
    ((None,), {}, "run: requests must be a sequence of Request objects, got None"),
    ((5,), {}, "run: requests must be a sequence of Request objects, got int 5"),
    (("ab",), {}, "run: requests must be a sequence of Request objects, got str 'ab'"),
    (([REQ], [0, 1]), {}, "run: 2 arrival steps for 1 requests"),
    (([REQ], []), {}, "run: 0 arrival steps for 1 requests"),
    (([REQ], 3), {}, "run: arrivals must be a sequence of ints >= 0 .*got int 3"),
    (([REQ], [-1]), {}, r"run: arrivals\[0\] is int -1; arrival steps are ints >= 0"),
    (([REQ], [1.5]), {}, r"run: arrivals\[0\] is float 1.5"),
    (([REQ], [True]), {}, r"run: arrivals\[0\] is bool True"),
    (([REQ], [None]), {}, r"run: arrivals\[0\] is None"),
    (([REQ], np.array([2.0])), {}, r"run: arrivals\[0\] is float64"),
    (([REQ], np.array(2)), {}, "run: arrivals must be a sequence of ints >= 0"),
    (([REQ],), {"max_steps": 0}, "run: max_steps is int 0; it must be None or an int >= 1"),
    (([REQ],), {"max_steps": -3}, "run: max_steps is int -3"),
    (([REQ],), {"max_steps": 2.0}, "run: max_steps is float 2.0"),
    (([REQ],), {"max_steps": True}, "run: max_steps is bool True"),
    (([REQ],), {"max_steps": "5"}, "run: max_steps is str '5'"),
    (([REQ],), {"on_step": 3}, "run: on_step is int 3; it must be None or a callable"),
])
def test_bad_run_arguments_raise_before_any_step(engine, args, kwargs, match):
    kwargs = {"on_step": _never, **kwargs}
    with pytest.raises(ValueError, match=match):
        engine.run(*args, **kwargs)  # raises at the call, not at the first next()
    assert engine.step_count == 0 and engine.idle and engine.stats().steps == 0


def test_good_arguments_of_other_kinds_are_accepted(engine):
    # a tuple of requests, numpy arrival steps, numpy max_steps: accepted (nothing runs until iterated)
    it = engine.run((REQ, REQ), np.array([0, 3]), max_steps=np.int64(5), on_step=print)
    assert engine.step_count == 0 and engine.idle
    del it
