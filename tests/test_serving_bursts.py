"""Bursts of decode steps (``ServingConfig.decode_steps = K > 1``): one device call runs up to K
decode steps while nothing needs the host between them. It must give the bits of one call per
step (tokens, log-probs, scores, finish reasons, step counts), stop each row on the device at an
EOS id or its budget, never run past an arrival, a prefill, a beam or a pool too tight for K
more tokens, and update the donated pages in place."""

import jax
import numpy as np
import pytest

import paged_kv as pk
from paged_kv.engine import BeamParams, SamplingParams, serving_step
from paged_kv.engine.serving import Request, ServingConfig, ServingEngine
from paged_kv.models import load_hf_checkpoint
from paged_kv.models.tokenizer import ByteTokenizer
from tests.test_model_scan import page_sized_copies

TOK = ByteTokenizer()
MGR = pk.ManagerConfig(num_blocks=520, block_size=16, max_seqs=8, max_blocks_per_seq=8)


def _cfg(k, manager=MGR, record_tables=True):
    return ServingConfig(manager, chunk_size=16, max_prefill_rows=4, top_candidates=8, impl="reference",
                         decode_steps=k, record_tables=record_tables)


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint("checkpoints/tiny-llama")


def _requests(eos):
    # Arrivals spread over the run (a burst must stop short of each), EOS ids that the tiny model
    # samples (rows stop on the device), budgets that end mid-burst, sampled rows, a family of
    # n = 2 (forked, copy-on-write) and a beam (no bursts while it runs).
    texts = ["The cow says", "Let us count to twenty: 1, 2, 3, 4,", "Once upon a time", "Hello, world"]
    reqs = [Request(TOK.encode(t), SamplingParams(max_new_tokens=9 + 7 * i, temperature=0.8 * (i % 2),
                                                  top_k=4 * (i % 3), eos_token_ids=eos if i % 2 == 0 else ()),
                    arrival=11 * i, request_id=i) for i, t in enumerate(texts)]
    reqs.append(Request(TOK.encode("The cat"), SamplingParams(max_new_tokens=20, n=2, temperature=1.0), arrival=3,
                        request_id="n2"))
    reqs.append(Request(TOK.encode("A bird"), BeamParams(beam_width=2, max_new_tokens=6), arrival=40,
                        request_id="beam"))
    return reqs


def _run(model, cfg, reqs, monkeypatch=None, stream=True):
    calls = []
    orig = serving_step.packed_step_jit

    def counted(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    if monkeypatch is not None:
        monkeypatch.setattr(serving_step, "packed_step_jit", counted)
    eng = ServingEngine(model, cfg, seed=5)
    streamed = {}

    def on_token(d):
        streamed.setdefault((d.request_id, d.index), []).extend(d.tokens)

    outs = {o.request_id: (o.tokens, o.logprobs, o.scores, o.finish_reasons,
                           (o.stats.arrival_step, o.stats.first_token_step, o.stats.finish_step, o.stats.admissions))
            for o in eng.run(reqs, on_token=on_token if stream else None)}
    if monkeypatch is not None:
        monkeypatch.setattr(serving_step, "packed_step_jit", orig)
    return outs, eng.stats(), len(calls), streamed


def _same(a, b):
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid][0] == b[rid][0] and a[rid][3] == b[rid][3], rid
        for x, y in zip(a[rid][1] or [], b[rid][1] or []):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert a[rid][2] == b[rid][2], rid
        assert a[rid][4] == b[rid][4], rid  # admitted, answered and finished at the same steps
    assert list(a) == list(b)  # and finished in the same order


def _eos_the_model_samples(model):
    # A token greedy decoding of the first prompt produces a few steps in: an EOS that ends rows early.
    outs, *_ = _run(model, _cfg(1), [Request(TOK.encode("The cow says"), SamplingParams(max_new_tokens=12),
                                             request_id="probe")])
    toks = outs["probe"][0][0]
    return next((t,) for i, t in enumerate(toks) if i >= 4 and t not in toks[:i])  # a few steps in


def test_a_burst_gives_the_bits_of_one_call_per_step(model, monkeypatch):
    eos = _eos_the_model_samples(model)
    reqs = _requests(eos)
    one, one_stats, one_calls, one_stream = _run(model, _cfg(1), reqs, monkeypatch)
    burst, burst_stats, burst_calls, burst_stream = _run(model, _cfg(8), reqs, monkeypatch)
    _same(burst, one)
    assert any(r == "eos" for o in one.values() for r in o[3])  # some row did stop at an EOS
    assert burst_stats.steps == one_stats.steps
    assert burst_stats.generated_tokens == one_stats.generated_tokens
    assert burst_stats.prefill_steps == one_stats.prefill_steps
    assert burst_stream == one_stream
    assert burst_calls < one_calls  # the bursts ran: fewer device calls for the same steps


@pytest.mark.parametrize("waiting,tables", [(False, True), (False, False), (True, True)])
def test_a_burst_processed_at_once_gives_what_one_step_at_a_time_does(model, monkeypatch, waiting, tables):
    """Without streaming, the host takes a burst's steps at once (``Outcomes.process_burst``):
    the same tokens, log-probs, finish reasons and steps, and the requests finish in the same
    order, with rows that end mid-burst at an EOS or their budget, with requests waiting, and
    (without ``record_tables``, whose sharing statistics need each step) a family of n = 2."""
    from paged_kv.engine.outcomes import Outcomes

    eos = _eos_the_model_samples(model)
    taken = []
    orig = Outcomes.process_burst

    def spy(self, outs):
        taken.append(orig(self, outs))
        return taken[-1]

    if waiting:
        mgr = pk.ManagerConfig(num_blocks=200, block_size=16, max_seqs=4, max_blocks_per_seq=8)
        texts = ["The cow says", "Once upon a time", "Hello, world", "A bird", "Let us count: 1, 2,"]
        reqs = [Request(TOK.encode(t), SamplingParams(max_new_tokens=5 + 6 * (i % 3), temperature=0.7 * (i % 2),
                                                      eos_token_ids=eos if i % 2 == 0 else ()),
                        request_id=i) for i, t in enumerate(texts + texts[::-1])]
    else:
        mgr, reqs = MGR, [r for r in _requests(eos) if r.request_id != "beam"]
    one, one_stats, *_ = _run(model, _cfg(1, mgr, tables), reqs, stream=False)
    monkeypatch.setattr(Outcomes, "process_burst", spy)
    burst, burst_stats, *_ = _run(model, _cfg(8, mgr, tables), reqs, stream=False)
    _same(burst, one)
    assert any(r == "eos" for o in one.values() for r in o[3])
    assert (burst_stats.steps, burst_stats.generated_tokens, burst_stats.finished) == (
        one_stats.steps, one_stats.generated_tokens, one_stats.finished)
    assert any(taken)  # bursts were taken at once


def test_a_tight_pool_runs_single_steps_and_preempts_as_before(model):
    # 12 usable blocks for 4 rows that want up to 3 each and more: appends fail, rows are preempted.
    tight = pk.ManagerConfig(num_blocks=13, block_size=16, max_seqs=4, max_blocks_per_seq=4)
    reqs = [Request(TOK.encode(f"Story {i}: once upon a time"), SamplingParams(max_new_tokens=30, ignore_eos=True),
                    request_id=i) for i in range(4)]  # past EOS: every row wants its blocks
    one, one_stats, *_ = _run(model, _cfg(1, tight), reqs)
    burst, burst_stats, *_ = _run(model, _cfg(8, tight), reqs)
    _same(burst, one)
    assert one_stats.preemptions > 0 and burst_stats.preemptions == one_stats.preemptions


def test_the_burst_program_updates_pages_in_place(model):
    eng = ServingEngine(model, _cfg(8))
    text = eng.device.lower_step(eng.config.max_prefill_rows).compile().as_text()
    layer_elements = int(np.prod(eng.pages.shape[1:]))
    assert layer_elements > 4 * max(int(np.prod(w.shape)) for w in jax.tree.leaves(eng.device.weights))
    assert page_sized_copies(text, layer_elements) == []
    assert "input_output_alias" in text


@pytest.mark.parametrize("bad", [0, -1, 257, True, 2.0])
def test_decode_steps_is_checked(bad):
    with pytest.raises(ValueError, match="decode_steps"):
        ServingConfig(MGR, decode_steps=bad)


def test_a_row_stops_on_the_device_at_its_eos(model):
    """After the burst in which a row sampled an EOS, the device holds exactly the tokens the host
    kept (the prompt and every answer token but the EOS, which is never fed): it decoded no
    further."""
    eos = _eos_the_model_samples(model)
    eng = ServingEngine(model, _cfg(8), seed=5)
    prompt = TOK.encode("The cow says")
    eng.submit(Request(prompt, SamplingParams(max_new_tokens=40, eos_token_ids=eos), request_id="r"))
    done = []
    while not done:
        before = eng.step_count
        done = eng.step()
    out = done[0]
    assert out.finish_reasons == ["eos"] and len(out.tokens[0]) < 12
    assert eng.step_count - before > 1  # it finished inside a burst
    row = 0  # the only request: row 0, not freed before the next call
    assert int(np.asarray(eng.device.state.num_tokens)[row]) == len(prompt) + len(out.tokens[0]) - 1


def test_bursts_with_requests_waiting_admit_them_at_the_same_steps(model, monkeypatch):
    """More requests than rows: requests wait while bursts run, and each burst ends after the
    step in which a row finished, so every waiting request is admitted at the step where one call
    per step admits it."""
    eos = _eos_the_model_samples(model)
    small = pk.ManagerConfig(num_blocks=200, block_size=16, max_seqs=4, max_blocks_per_seq=8)
    texts = ["The cow says", "Once upon a time", "Hello, world", "A bird", "Let us count: 1, 2,", "The cat"]
    reqs = [Request(TOK.encode(t * (1 + i % 2)),
                    SamplingParams(max_new_tokens=6 + 5 * (i % 4), temperature=0.7 * (i % 2),
                                   eos_token_ids=eos if i % 3 == 0 else ()),
                    request_id=i) for i, t in enumerate(texts + texts[::-1])]
    one, one_stats, one_calls, one_stream = _run(model, _cfg(1, small), reqs, monkeypatch)
    burst, burst_stats, burst_calls, burst_stream = _run(model, _cfg(8, small), reqs, monkeypatch)
    _same(burst, one)
    assert burst_stats.steps == one_stats.steps and burst_stream == one_stream
    assert max(o[4][1] for o in one.values()) > 10  # late admissions: requests did wait for rows
    assert burst_calls < one_calls
