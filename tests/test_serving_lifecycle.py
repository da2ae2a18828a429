"""Request identity and lifecycle in the serving engine (paged_kv.engine.serving): duplicate ids
refused while the first request is live, ``ServingEngine.abort`` (waiting, prefilling, decoding,
preempted; samples and beams) freeing through the step's jitted ``free`` with the block-manager
invariants held after every step and nothing leaked, the other requests' tokens untouched, and
``max_new_tokens`` past the context clipped with ``length_capped`` in all three engines.

Every serving run uses one ``ServingConfig`` (a 24-block pool: 23 usable blocks of 16 tokens,
so the workload below preempts), so the step compiles once for the module."""

import dataclasses

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import paged_kv as pk
from paged_kv import engine
from paged_kv.engine import BeamParams, SamplingParams
from paged_kv.engine.serving import Request, ServingConfig, ServingEngine
from paged_kv.invariants import check_invariants
from paged_kv.models import allocate_pages, load_hf_checkpoint, page_spec
from paged_kv.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
MGR = pk.ManagerConfig(num_blocks=24, block_size=16, max_seqs=16, max_blocks_per_seq=16)
# One step per call (decode_steps=1): these tests abort and submit at given steps through step()
# (bursts keep their own tests: tests/test_serving_bursts.py).
CFG = ServingConfig(MGR, chunk_size=32, max_prefill_rows=4, top_candidates=8, impl="reference", decode_steps=1)
SYSTEM = "Q: What does the cow say? A: The cow says moo. "
PROMPTS = ["The cow says", "Let us count: 12, 13,", SYSTEM + "Q: What do bees make? A:",
           SYSTEM + "Q: Where do fish live? A:", "Once upon a time", "The dog says", "The cat says",
           SYSTEM * 2 + "Q: What do cows eat? A:"]  # the last: 120 tokens, prefilled over steps in a cohort


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint("checkpoints/tiny-llama")


def _request(i: int, kind: str, rid=None, max_new: int = 40) -> Request:
    """Request ``i`` of PROMPTS' cycle: greedy, n=2 sampled (explicit seed: its tokens do not
    depend on the submission order) or a width-2 beam search."""
    prompt = TOK.encode(PROMPTS[i % len(PROMPTS)])
    rid = i if rid is None else rid
    if kind == "greedy":
        return Request(prompt, SamplingParams(max_new_tokens=max_new), request_id=rid)
    if kind == "sample":
        return Request(prompt, SamplingParams(max_new_tokens=max_new, n=2, temperature=0.8), request_id=rid,
                       seed=1000 + i)
    return Request(prompt, BeamParams(beam_width=2, max_new_tokens=max_new // 2), request_id=rid)


def _all_free(eng: ServingEngine) -> None:
    """Nothing leaked: every block back in the free queue, every count zero, every row inactive
    (and the invariants hold)."""
    check_invariants(eng.manager, eng.state)
    assert int(pk.num_free_blocks(eng.manager, eng.state)) == eng.manager.num_blocks - 1
    assert not np.asarray(eng.state.ref_count).any()
    assert not np.asarray(eng.state.active).any()


def _drive(eng: ServingEngine, schedule: dict, *, steps: int = 400, check: bool = True) -> dict:
    """Runs ``schedule`` (step -> list of ``("submit", Request)`` / ``("abort", id)``, applied
    before that step) to the end; checks the invariants after every step. Returns the outputs by
    id and the abort return values as ``outs["aborts"]``."""
    outs, aborts = {}, []
    for t in range(steps):
        for op, arg in schedule.get(t, ()):
            if op == "submit":
                eng.submit(arg)
            else:
                aborts.append((arg, eng.abort(arg)))
        for o in eng.step():
            assert o.request_id not in outs
            outs[o.request_id] = o
        if check:
            check_invariants(eng.manager, eng.state)
        if eng.idle and t >= max(schedule, default=0):
            for o in eng.step():  # the last frees
                outs[o.request_id] = o
            outs["aborts"] = aborts
            return outs
    raise AssertionError("the engine did not finish")


# ---------------------------------------------------------------------------- duplicate ids
def test_duplicate_ids_refused_while_live_and_reusable_after(model):
    eng = ServingEngine(model, CFG)
    eng.submit(_request(0, "greedy", rid="pet", max_new=4))
    before = (eng.num_waiting, eng.scheduler._submitted)
    with pytest.raises(ValueError, match="request id 'pet' is already in use by a request that has not finished"):
        eng.submit(_request(1, "greedy", rid="pet"))
    assert (eng.num_waiting, eng.scheduler._submitted) == before  # refused before anything changed
    # A request without an id takes its submission number (2 here): an explicit id 2 clashes.
    eng.submit(_request(2, "greedy", rid=2, max_new=4))
    with pytest.raises(ValueError, match=r"request id 2 is already in use.*request_id=None takes the submission"):
        eng.submit(Request(TOK.encode("hi")))
    outs = _drive(eng, {})
    assert set(outs) - {"aborts"} == {"pet", 2}
    # Finished: the id is free again (vLLM refuses only live duplicates).
    eng.submit(_request(1, "greedy", rid="pet", max_new=4))
    assert list(_drive(eng, {})) == ["pet", "aborts"]
    with pytest.raises(ValueError, match="request_id=\\[1\\] must be hashable"):
        Request(TOK.encode("hi"), request_id=[1])


def test_streaming_recipe_with_a_duplicate_id_does_not_mix_answers(model):
    """The streaming recipe of docs/usage.md with two requests of one id: the second is rejected
    with an error naming the id (a rejected output), and the first streams its own tokens only."""
    eng = ServingEngine(model, CFG, seed=0)
    reqs = [Request(TOK.encode("The dog says"), SamplingParams(max_new_tokens=24), request_id="pet"),
            Request(TOK.encode("The cat says"), SamplingParams(max_new_tokens=24), request_id="pet", arrival=2)]
    texts: dict = {}

    def show(delta):
        texts[(delta.request_id, delta.index)] = texts.get((delta.request_id, delta.index), "") + \
            TOK.decode(list(delta.tokens))

    outs = list(eng.run(reqs, on_token=show))
    bad = [o for o in outs if not o.ok]
    good = [o for o in outs if o.ok]
    assert len(bad) == 1 and "request id 'pet' is already in use" in bad[0].error and bad[0].tokens == []
    assert len(good) == 1 and good[0].request.prompt == tuple(TOK.encode("The dog says"))
    assert texts == {("pet", 0): TOK.decode(good[0].tokens[0])}
    # The rejection says so (``rejected``), and comes out when the duplicate arrives, before the
    # live request's own output: keyed by id, the live request's output is the one kept.
    assert bad[0].rejected and bad[0].finish_reasons == [] and not good[0].rejected
    assert outs.index(bad[0]) < outs.index(good[0])
    assert {o.request_id: o for o in outs} == {"pet": good[0]}
    assert {o.request_id: o for o in outs if not o.rejected} == {"pet": good[0]}
    assert eng.stats().rejected == 1


# ---------------------------------------------------------------------------- abort
def _workload() -> list[Request]:
    return [_request(i, kind, max_new=60) for i, kind in enumerate(["greedy", "greedy", "greedy", "greedy", "greedy",
                                                                       "sample", "beam"])]


@pytest.fixture(scope="module")
def without_aborted(model):
    """The workload without requests 1 and 5, everything submitted at step 0."""
    eng = ServingEngine(model, CFG)
    return _drive(eng, {0: [("submit", q) for q in _workload() if q.request_id not in (1, 5)]})


def test_abort_under_preemption_frees_everything_and_leaves_the_others(model, without_aborted):
    """The workload at once in 23 blocks preempts (requests 6 and 5 by step 24). Request 1
    (greedy) is aborted at step 30 while it decodes, request 5 (n=2 samples) at step 40, preempted
    and waiting. Invariants hold after every step; at the end every block is free; the aborted outputs
    say "aborted"; the others' tokens equal those of a run where requests 1 and 5 never existed
    (greedy and seeded tokens do not depend on batchmates), and a replay is identical bit for bit."""
    def schedule():
        return {0: [("submit", q) for q in _workload()], 30: [("abort", 1)], 40: [("abort", 5)],
                41: [("abort", 5), ("abort", "nobody")]}

    eng = ServingEngine(model, CFG)
    outs = _drive(eng, schedule())
    _all_free(eng)
    assert eng.stats().preemptions >= 2
    assert outs.pop("aborts") == [(1, True), (5, True), (5, False), ("nobody", False)]
    assert eng.stats().aborted == 2 and eng.stats().finished == 5
    for rid in (1, 5):
        assert outs[rid].ok and set(outs[rid].finish_reasons) == {"aborted"}, outs[rid].finish_reasons
        assert outs[rid].stats.finish_step == (30 if rid == 1 else 40)
    assert len(outs[1].tokens[0]) > 0 and outs[5].stats.preemptions >= 1
    others = without_aborted
    for rid, o in outs.items():
        if rid in (1, 5):
            continue
        assert o.tokens == others[rid].tokens, rid
    replay = _drive(ServingEngine(model, CFG), schedule(), check=False)
    replay.pop("aborts")
    for rid, o in outs.items():
        assert (o.tokens, o.logprobs, o.scores, o.finish_reasons) == (
            replay[rid].tokens, replay[rid].logprobs, replay[rid].scores, replay[rid].finish_reasons), rid


def test_abort_frees_at_the_next_step_and_keeps_full_blocks_cached(model):
    """Aborting a decoding request frees its row at the next step; its full blocks stay in the
    prefix cache, so the same prompt submitted again finds them."""
    eng = ServingEngine(model, CFG)
    q = _request(2, "greedy", rid="a", max_new=60)  # a 73-token prompt: 4 full blocks
    eng.submit(q)
    for _ in range(8):
        eng.step()
    assert eng.blocks_in_use > 0 and np.asarray(eng.state.active).any()
    assert eng.abort("a") and not eng.abort("a")
    (out,) = eng.step()
    assert out.request_id == "a" and out.finish_reasons == ["aborted"] and len(out.tokens[0]) > 0
    _all_free(eng)  # that step freed it
    eng.submit(dataclasses.replace(q, request_id="again", params=SamplingParams(max_new_tokens=4)))
    outs = _drive(eng, {})
    full = len(q.prompt) // MGR.block_size * MGR.block_size
    assert outs["again"].stats.cached_prompt_tokens == full
    assert outs["again"].tokens[0] == out.tokens[0][:4]  # greedy: the same continuation
    _all_free(eng)


def test_abort_while_prefilling_finishes_the_prefill_then_frees(model):
    """A request aborted in the middle of its prefill (two 150-token prompts share the chunk rows:
    three steps) is returned at the next step, its prompt is prefilled to the end (``admit``
    cached its full blocks before their K/V), then freed; a later request hitting those cached
    blocks gets the tokens of a fresh engine, and so does the other prompt of the cohort. The
    n=2 request aborted there never forks its second sample."""
    aborted = TOK.encode((SYSTEM * 4)[:150])
    other = TOK.encode(("Let us count: " + ", ".join(map(str, range(12, 80))))[:150])
    eng = ServingEngine(model, CFG)
    eng.submit(Request(aborted, SamplingParams(max_new_tokens=8, n=2, temperature=0.8), request_id="long"))
    eng.submit(Request(other, SamplingParams(max_new_tokens=8), request_id="other"))
    eng.step()  # admission and the first chunks
    assert eng.abort("long")
    (out,) = eng.step()
    assert out.request_id == "long" and out.finish_reasons == ["aborted", "aborted"] and out.tokens == [[], []]
    assert eng.scheduler.host.cohort  # both prompts are still being prefilled
    check_invariants(eng.manager, eng.state)
    outs = _drive(eng, {})
    _all_free(eng)
    eng.submit(Request(aborted, SamplingParams(max_new_tokens=8), request_id="hit"))
    hit = _drive(eng, {})["hit"]
    assert hit.stats.cached_prompt_tokens == len(aborted) // MGR.block_size * MGR.block_size
    fresh = _drive(ServingEngine(model, CFG), {0: [("submit", Request(aborted, SamplingParams(max_new_tokens=8),
                                                                      request_id="hit")),
                                                    ("submit", Request(other, SamplingParams(max_new_tokens=8),
                                                                       request_id="other"))]})
    assert hit.tokens == fresh["hit"].tokens
    assert outs["other"].tokens == fresh["other"].tokens


def test_abort_after_its_prefill_while_a_cohort_mate_still_prefills(model):
    """The cohort outlives a short prompt's prefill: aborting that request (decoding already)
    frees its row at the next step, although its cohort is still being prefilled."""
    eng = ServingEngine(model, CFG)
    eng.submit(Request(TOK.encode("The cow says" * 3), SamplingParams(max_new_tokens=20), request_id="short"))
    eng.submit(Request(TOK.encode((SYSTEM * 4)[:150]), SamplingParams(max_new_tokens=8), request_id="long"))
    eng.step()
    host = eng.scheduler.host
    assert host.cohort and not host.live["short"].prefilling and host.live["long"].prefilling
    assert eng.abort("short")
    (out,) = eng.step()
    assert out.finish_reasons == ["aborted"] and len(out.tokens[0]) == 1
    outs = _drive(eng, {})
    assert outs["long"].finish_reasons == ["length"]
    _all_free(eng)


def test_abort_beams_and_waiting_requests_stream_a_last_delta(model):
    """Through ``run`` with streaming: a beam request aborted mid-search returns its live beams as
    "aborted" hypotheses, sent whole, after its other deltas; a waiting request aborted before
    admission ends with an empty "aborted" delta per sample."""
    from paged_kv.engine import TokenDelta

    eng = ServingEngine(model, CFG)
    events = []

    def on_step(e):
        if e.step_count == 4:
            assert e.abort("beam") and not e.abort("beam")

    for o in eng.run([_request(6, "beam", rid="beam", max_new=60)], on_token=events.append, on_step=on_step):
        events.append(o)
    _all_free(eng)
    beam = events[-1]
    assert len(beam.tokens) == 2 and beam.finish_reasons == ["aborted", "aborted"]
    assert beam.stats.finish_step == 4 and all(len(t) == 4 for t in beam.tokens)
    assert [(d.request_id, list(d.tokens), d.finish_reason) for d in events[:-1]] == [
        ("beam", t, "aborted") for t in beam.tokens]
    # Waiting: never admitted.
    eng.scheduler.host.deltas = []  # what run(on_token=...) does
    eng.submit(_request(5, "sample", rid="late"))
    assert eng.num_waiting == 1 and eng.abort("late")
    (out,) = eng.step()
    assert out.tokens == [[], []] and out.finish_reasons == ["aborted", "aborted"]
    assert eng.scheduler.host.deltas == [TokenDelta("late", 0, (), "aborted"), TokenDelta("late", 1, (), "aborted")]
    assert eng.idle
    _all_free(eng)


KINDS = ("greedy", "sample", "beam")


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_submissions_aborts_and_steps(model, data):
    """Random workloads: requests of every kind arrive at random steps, random ones are aborted at
    random steps (waiting, prefilling, decoding or preempted; some twice, some unknown ids). The
    invariants hold after every step, nothing leaks, aborts return True exactly once per live
    request, and a replay of the same schedule gives the same outputs bit for bit."""
    n = data.draw(st.integers(6, 12), label="requests")
    schedule: dict = {}
    for i in range(n):
        kind = data.draw(st.sampled_from(KINDS), label=f"kind {i}")
        at = data.draw(st.integers(0, 10), label=f"arrival {i}")
        schedule.setdefault(at, []).append(("submit", _request(i, kind, max_new=data.draw(st.integers(24, 60)))))
        if data.draw(st.booleans(), label=f"abort {i}?"):
            when = at + data.draw(st.integers(0, 30), label=f"abort {i} after")
            schedule.setdefault(when, []).append(("abort", i))
    schedule.setdefault(data.draw(st.integers(0, 20)), []).append(("abort", "unknown"))
    outs = _drive(ServingEngine(model, CFG), schedule)
    aborts = outs.pop("aborts")
    # The engine was idle at the end: every block back, every count zero.
    eng = ServingEngine(model, CFG)
    replay = _drive(eng, schedule, check=False)
    _all_free(eng)
    assert replay.pop("aborts") == aborts
    assert ("unknown", False) in aborts
    assert set(outs) == set(range(n)) == set(replay)
    for rid, o in outs.items():
        r = replay[rid]
        assert (o.tokens, o.logprobs, o.scores, o.finish_reasons) == (r.tokens, r.logprobs, r.scores,
                                                                       r.finish_reasons), rid
        hit = (rid, True) in aborts
        assert hit or "aborted" not in o.finish_reasons, rid
        if hit and not o.request.is_beam:  # a beam request may have no hypothesis yet
            assert "aborted" in o.finish_reasons, rid
    assert eng.stats().aborted == sum(ok for _, ok in aborts)


# ---------------------------------------------------------------------------- max_new_tokens past the context
SMALL = pk.ManagerConfig(num_blocks=32, block_size=8, max_seqs=4, max_blocks_per_seq=4)  # 32 tokens a sequence


def test_serving_caps_max_new_tokens_at_the_context_with_length_capped(model):
    """The module's engine holds 256 tokens a sequence: a 245-token prompt gets 256 - 245 + 1 = 12
    new tokens. Asking for more ends with "length_capped"; asking for exactly 12, with "length".
    (Beam requests: ``tests/test_scheduler.py``.)"""
    prompt = [65] * 245
    reqs = [Request(prompt, SamplingParams(max_new_tokens=20), request_id="capped"),
            Request(prompt, SamplingParams(max_new_tokens=12), request_id="exact")]
    outs = {o.request_id: o for o in ServingEngine(model, CFG).run(reqs)}
    assert outs["capped"].finish_reasons == ["length_capped"] and len(outs["capped"].tokens[0]) == 12
    assert outs["exact"].finish_reasons == ["length"] and outs["exact"].tokens == outs["capped"].tokens


def test_generate_and_beam_search_flag_length_capped(model):
    pages = allocate_pages(page_spec(model.config, SMALL.num_blocks, SMALL.block_size))
    toks, lens = engine.pad_prompts([[65] * 20, [66] * 5])
    budgets = np.array([13, 20], np.int32)  # prompt 0: exactly what its context holds
    out, pages, state = engine.generate(model, pages, toks, lens, jax.random.key(0),
                                        SamplingParams(max_new_tokens=20), manager=SMALL, impl="reference")
    assert out.finish_reason_names() == [["LENGTH_CAPPED"], ["LENGTH"]]
    assert out.lengths.tolist() == [[13], [20]]
    out, pages, state = engine.generate(model, pages, toks, lens, jax.random.key(0),
                                        SamplingParams(max_new_tokens=20), manager=SMALL, state=state,
                                        max_new_tokens=budgets, impl="reference")
    assert out.finish_reason_names() == [["LENGTH"], ["LENGTH"]]
    beams, pages, state = engine.beam_search(model, pages, toks, lens, BeamParams(beam_width=2, max_new_tokens=20),
                                             manager=SMALL, state=state, impl="reference")
    assert beams.length_capped.tolist() == [True, False]
    assert beams.lengths.tolist() == [[13, 13], [20, 20]]
    beams, pages, state = engine.beam_search(model, pages, toks, lens, BeamParams(beam_width=2, max_new_tokens=20),
                                             manager=SMALL, state=state, max_new_tokens=budgets, impl="reference")
    assert beams.length_capped.tolist() == [False, False]
