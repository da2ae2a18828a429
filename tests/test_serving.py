"""Serving loop (paged_kv.engine.serving): outputs independent of memory pressure (greedy, sampled,
beam), preemption and re-admission with prefix-cache hits, shared system prompts, rejection of
requests that can never fit, streaming order and statistics, per-row sampling filters.

Every run uses one ``ServingConfig`` (a 24-block pool: 23 usable blocks of 16 tokens) so the step
compiles once for the whole module; "ample blocks" means each request running alone."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv as pk
from paged_kv.engine import BeamParams, SamplingParams, filter_logits
from paged_kv.engine.sampling import filter_rows, sample_rows
from paged_kv.engine.serving import Request, ServingConfig, ServingEngine
from paged_kv.models import load_hf_checkpoint
from paged_kv.models.tokenizer import ByteTokenizer
from tests import tolerances as tol

TOK = ByteTokenizer()
MGR = pk.ManagerConfig(num_blocks=24, block_size=16, max_seqs=16, max_blocks_per_seq=16)
CFG = ServingConfig(MGR, chunk_size=32, max_prefill_rows=4, top_candidates=8, impl="reference")
SYSTEM = "Q: What does the cow say? A: The cow says moo. "


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint("checkpoints/tiny-llama")


def _workload(spread: int):
    """Greedy requests (two sharing a 48-token system prompt), an n=3 sampled request and a
    width-3 beam request. ``spread`` = steps between arrivals (0: all at once)."""
    prompts = ["The cow says", "Let us count: 12, 13,", SYSTEM + "Q: What do bees make? A:",
               SYSTEM + "Q: Where do fish live? A:", "Once upon a time"]
    reqs = [Request(TOK.encode(p), SamplingParams(max_new_tokens=60), arrival=i * spread, request_id=i)
            for i, p in enumerate(prompts)]
    reqs.append(Request(TOK.encode("The dog says"), SamplingParams(max_new_tokens=40, n=3, temperature=0.8),
                        arrival=5 * spread, request_id="n3"))
    reqs.append(Request(TOK.encode("The cat says"), BeamParams(beam_width=3, max_new_tokens=30),
                        arrival=6 * spread, request_id="beam"))
    return reqs


def _run(model, reqs, seed=0, config=CFG):
    eng = ServingEngine(model, config, seed=seed)
    outs = list(eng.run(reqs))
    return eng, outs


@pytest.fixture(scope="module")
def pressured(model):
    return _run(model, _workload(0))


@pytest.fixture(scope="module")
def alone(model):
    return _run(model, _workload(200))


def test_outputs_independent_of_memory_pressure(model, pressured, alone):
    """All requests at once in 23 blocks preempt repeatedly; each request alone never does. Greedy
    tokens, sampled tokens (same seed) and beam hypotheses are identical."""
    eng_p, outs_p = pressured
    eng_a, outs_a = alone
    assert eng_p.stats().preemptions >= 2
    assert eng_a.stats().preemptions == 0
    assert sum(o.stats.preemptions for o in outs_p) == eng_p.stats().preemptions
    a = {o.request_id: o for o in outs_a}
    for o in outs_p:
        assert o.ok
        assert o.tokens == a[o.request_id].tokens, o.request_id
        if o.scores is not None:  # same tokens, computed in other batches and chunks: rounding only
            for toks, got, want in zip(o.tokens, o.scores, a[o.request_id].scores):
                atol = tol.beam_score_atol(model, len(o.request.prompt) + len(toks), len(toks), want)
                np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    # Every block is free again at the end.
    assert int(pk.num_free_blocks(MGR, eng_p.state)) == MGR.num_blocks - 1
    assert not bool(jnp.any(eng_p.state.active))


def test_gpu_form_of_the_step_runs_the_same(model, pressured, monkeypatch):
    """The serving step and admission traced in their GPU forms (``ManagerConfig.target="gpu"``:
    the manager straight-line) run the pressured workload exactly as the CPU forms do: the same
    tokens, scores and statistics, the same final state."""
    from paged_kv.engine import serving_step as ss
    traced = []
    inner = ss.free_select_append
    monkeypatch.setattr(ss, "free_select_append", lambda mgr, *args: traced.append(mgr.target) or inner(mgr, *args))
    gpu = dataclasses.replace(CFG, manager=dataclasses.replace(MGR, target="gpu"))
    eng, outs = _run(model, _workload(0), config=gpu)
    assert traced == ["gpu"]  # the step was traced once, in its GPU form
    eng_p, outs_p = pressured
    counts = lambda st: {k: v for k, v in vars(st).items() if not k.endswith("_s")}  # every timing is *_s
    assert counts(eng.stats()) == counts(eng_p.stats())
    want = {o.request_id: o for o in outs_p}
    for o in outs:
        assert o.tokens == want[o.request_id].tokens, o.request_id
        assert o.scores == want[o.request_id].scores, o.request_id
    chex.assert_trees_all_equal(eng.state, eng_p.state, strict=True)


def test_outputs_continue_prompts(alone):
    _, outs = alone
    text = {o.request_id: [TOK.decode(t) for t in o.tokens] for o in outs}
    assert text[0][0].startswith(" moo.")
    assert text[1][0].startswith(" 14, 15, 16")
    assert len(text["n3"]) == 3 and len(set(text["n3"])) > 1  # temperature 0.8: samples differ
    assert len(text["beam"]) == 3 and len(set(text["beam"])) == 3


def test_streaming_order_and_stats(alone, pressured):
    for eng, outs in (alone, pressured):
        steps = [o.stats.finish_step for o in outs]
        assert steps == sorted(steps)  # streamed as they finish
        for o in outs:
            st = o.stats
            assert st.arrival_step <= st.first_token_step <= st.finish_step
            assert st.time_to_first_token_s is not None and 0 <= st.time_to_first_token_s <= st.latency_s
            assert st.generated_tokens == sum(len(t) for t in o.tokens)
            assert st.admissions == 1 + st.preemptions
            assert st.prompt_tokens == len(o.request.prompt)
        st = eng.stats()
        assert st.finished == len(outs) and st.rejected == 0
        assert 0 < st.peak_blocks_used <= MGR.num_blocks - 1
        assert st.tokens_per_s > 0
    # In the spread run, the request arriving at step 0 with 60 tokens finishes first.
    assert alone[1][0].request_id == 0
    # Parallel samples and beams held fewer blocks than unshared copies would.
    st = pressured[0].stats()
    assert st.sampling_blocks_shared < st.sampling_blocks_unshared
    assert st.beam_blocks_shared < st.beam_blocks_unshared
    snap = pressured[0].snapshot
    assert snap is not None and snap.saved_blocks > 0
    assert any(r > 1 for refs in snap.refs for r in refs)


def test_shared_system_prompt_hits_cache(alone, pressured):
    """Arriving later, the second system-prompt request reuses the first one's 3 full blocks; arriving
    in the same admission, it shares the blocks the first one computes."""
    a = {o.request_id: o for o in alone[1]}
    assert a[3].stats.cached_prompt_tokens == 48
    assert alone[0].stats().cache_hit_tokens >= 48
    p = {o.request_id: o for o in pressured[1]}
    assert p[3].stats.cached_prompt_tokens + p[3].stats.shared_prompt_tokens >= 48


def test_salts_separate_cache_tenants(model):
    """Requests share cached blocks only under the same salt; ``arrivals`` overrides the requests'."""
    prompt = TOK.encode(SYSTEM + "Q: What do bees make? A:")
    reqs = [Request(prompt, SamplingParams(max_new_tokens=4), salt=s, request_id=i) for i, s in enumerate((7, 8, 7))]
    eng, outs = _run_arrivals(model, reqs, [0, 10, 20])
    by = {o.request_id: o for o in outs}
    assert [by[i].stats.cached_prompt_tokens for i in range(3)] == [0, 0, 64]
    assert by[0].tokens == by[1].tokens == by[2].tokens
    with pytest.raises(ValueError, match="2 arrival steps for 3 requests"):
        list(eng.run(reqs, [0, 1]))


def _run_arrivals(model, reqs, arrivals):
    eng = ServingEngine(model, CFG)
    return eng, list(eng.run(reqs, arrivals))


def test_readmission_hits_cache(model):
    """A long request and a newer one outgrow the pool: the newer one is preempted, re-admitted once
    blocks free up, and finds most of its prompt and generated tokens still cached; its tokens are
    those of a run alone."""
    long_prompt = TOK.encode("Once upon a time there was a happy cat named Rosa. Rosa lived near the "
                             "river and liked to")
    # Both run to their budgets (past the model's EOS), so that together they outgrow the pool.
    reqs = [Request(TOK.encode("Let us count: 1, 2,"), SamplingParams(max_new_tokens=230, ignore_eos=True),
                    request_id="x"),
            Request(long_prompt, SamplingParams(max_new_tokens=150, ignore_eos=True), arrival=5, request_id="y")]
    eng, outs = _run(model, reqs)
    y = {o.request_id: o for o in outs}["y"]
    assert y.stats.preemptions >= 1
    assert y.stats.cached_prompt_tokens >= 64
    _, alone = _run(model, [reqs[1]])
    assert alone[0].tokens == y.tokens


def test_requests_stop_at_the_models_eos_by_default(model, alone):
    """Requests whose parameters leave ``eos_token_ids`` None get the checkpoint's EOS id (258, from
    its config.json) at submission: their outputs carry the resolved parameters, and an answer that
    samples it ends there with ``"eos"``, the EOS kept as its last token."""
    eng, outs = alone
    assert model.config.eos_token_ids == (258,) and eng.scheduler.eos_token_ids == (258,)
    for o in outs:
        assert o.request.params.eos_token_ids == (258,), o.request_id
        for toks, why in zip(o.tokens, o.finish_reasons):
            assert (why == "eos") == (toks[-1] == 258), (o.request_id, why)
            assert 258 not in toks[:-1]
    assert any("eos" in o.finish_reasons for o in outs)
    # Greedy, this prompt's answer is " 4, 5, ..., 12." and EOS; ignoring EOS runs past it.
    ignored = Request(TOK.encode("Let us count: 1, 2, 3,"), SamplingParams(max_new_tokens=40, ignore_eos=True))
    [out] = list(ServingEngine(model, CFG).run([ignored]))
    assert out.finish_reasons == ["length"] and len(out.tokens[0]) == 40 and 258 in out.tokens[0]


def test_max_prefill_rows_defaults_to_at_most_max_seqs():
    """``ServingConfig``'s defaults resolve on construction: ``chunk_size`` 16, ``decode_steps``
    16, ``max_prefill_rows`` ``min(manager.max_seqs, 4096 // chunk_size)`` (every row of a burst
    of arrivals in one cohort); an explicit ``max_prefill_rows`` above ``max_seqs`` is refused."""
    small = pk.ManagerConfig(num_blocks=16, block_size=16, max_seqs=4, max_blocks_per_seq=4)
    assert ServingConfig(small).max_prefill_rows == 4
    assert ServingConfig(MGR).max_prefill_rows == MGR.max_seqs
    wide = dataclasses.replace(MGR, max_seqs=512)
    assert ServingConfig(wide).max_prefill_rows == 256 and ServingConfig(wide, chunk_size=64).max_prefill_rows == 64
    cfg = ServingConfig(small)
    assert (cfg.chunk_size, cfg.decode_steps) == (16, 16)
    assert cfg == ServingConfig(small, chunk_size=16, max_prefill_rows=4, decode_steps=16)
    assert ServingConfig(small, max_prefill_rows=2).max_prefill_rows == 2
    assert hash(ServingConfig(small)) == hash(ServingConfig(small, max_prefill_rows=4))
    with pytest.raises(ValueError, match="max_prefill_rows=5 must be <= manager.max_seqs=4"):
        ServingConfig(small, max_prefill_rows=5)


def test_rejects_requests_that_never_fit(model):
    """A prompt longer than a sequence can hold and a beam family larger than the pool are rejected
    with a clear message (streamed at arrival); the other requests finish."""
    eng = ServingEngine(model, CFG)
    too_long = Request([65] * 300, SamplingParams(max_new_tokens=4), request_id="long")
    too_wide = Request(TOK.encode("The cow says"), BeamParams(beam_width=2, max_new_tokens=240), request_id="wide")
    ok = Request(TOK.encode("The cow says"), SamplingParams(max_new_tokens=8), request_id="ok")
    outs = list(eng.run([too_long, ok, too_wide]))
    by = {o.request_id: o for o in outs}
    assert "300 tokens" in by["long"].error and "256" in by["long"].error
    assert "beam_width=2" in by["wide"].error and "23 allocatable blocks" in by["wide"].error
    assert by["ok"].ok and TOK.decode(by["ok"].tokens[0]).startswith(" moo.")
    assert eng.stats().rejected == 2
    with pytest.raises(ValueError, match="300 tokens"):
        eng.submit(too_long)
    with pytest.raises(ValueError, match="top_candidates=8"):
        eng.submit(Request([1, 2], BeamParams(beam_width=3, eos_token_ids=(1, 2))))
    with pytest.raises(ValueError, match="max_prefill_rows=4"):
        eng.submit(Request([1, 2], SamplingParams(n=5)))
    with pytest.raises(ValueError, match="salt"):
        Request([1], salt=-1)
    with pytest.raises(ValueError, match="empty"):
        Request([])


def test_beam_width_one_is_greedy(model):
    """Beam search of width 1 keeps the greedy path; its score is the mean log-probability."""
    p = TOK.encode("Let us count: 12, 13,")
    eng, outs = _run(model, [Request(p, SamplingParams(max_new_tokens=12), request_id="g"),
                             Request(p, BeamParams(beam_width=1, max_new_tokens=12), request_id="b")])
    by = {o.request_id: o for o in outs}
    assert by["b"].tokens[0] == by["g"].tokens[0]
    want = np.mean(by["g"].logprobs[0])
    np.testing.assert_allclose(by["b"].scores[0], want, rtol=0, atol=tol.beam_score_atol(model, len(p) + 12, 12, want))


def test_sampling_seeds(model):
    """Same engine seed: same samples; another seed: different ones."""
    reqs = [Request(TOK.encode("Once upon a time"), SamplingParams(max_new_tokens=24, n=2, temperature=1.5),
                    request_id="s")]
    _, a = _run(model, reqs, seed=1)
    _, b = _run(model, reqs, seed=1)
    _, c = _run(model, reqs, seed=2)
    assert a[0].tokens == b[0].tokens
    assert a[0].tokens != c[0].tokens


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 3, 0.6)])
def test_filter_rows_matches_filter_logits(temperature, top_k, top_p):
    logits = jax.random.normal(jax.random.key(0), (3, 50)) * 3
    r = logits.shape[0]
    got = filter_rows(logits, jnp.full((r,), temperature), jnp.full((r,), top_k, jnp.int32), jnp.full((r,), top_p))
    want = filter_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    # The same elementwise arithmetic (a division by the temperature, masks): a rounding or two each.
    atol = tol.chain_atol(jnp.float32, [2], np.abs(np.where(np.isfinite(want), want, 0)).max())
    np.testing.assert_allclose(np.where(np.isfinite(got), got, 0), np.where(np.isfinite(want), want, 0), rtol=0,
                               atol=atol)
    keys = jax.random.split(jax.random.key(1), r)
    tok, logp = sample_rows(logits, keys, jnp.zeros((r,)), jnp.zeros((r,), jnp.int32), jnp.ones((r,)))
    np.testing.assert_array_equal(tok, jnp.argmax(logits, axis=-1))
    np.testing.assert_allclose(logp, jnp.max(jax.nn.log_softmax(logits), axis=-1), rtol=0,
                               atol=tol.logprob_atol(0.0, logits.shape[-1]))


# The pressured workload on a 2-device "tp" mesh, against one device: tests/test_sharding.py
# (test_tensor_parallel_serving_matches_one_device), in its 2-device worker process.


# ---------------------------------------------------------------------------- streaming
@pytest.mark.smoke
def test_streaming_sends_every_token_once_under_preemption(model, pressured):
    """The pressured workload streamed: every request is preempted or waits, yet each sample's
    deltas join to exactly its output tokens (no token sent twice, none lost), its last delta and
    only it carries the finish reason, all of a request's deltas come before its output, beam
    hypotheses come whole at the end, and streaming changes no token."""
    from paged_kv.engine import TokenDelta

    _, outs_ref = pressured
    eng = ServingEngine(model, CFG, seed=0)
    events = []
    outs = []
    for out in eng.run(_workload(0), on_token=events.append):
        outs.append(out)
        events.append(out)
    assert eng.stats().preemptions >= 2
    preempted = {o.request_id for o in outs if o.stats.preemptions}
    assert preempted, "the workload must preempt some request"
    assert [o.tokens for o in outs] == [o.tokens for o in outs_ref]
    for o in outs:
        mine = [e for e in events if isinstance(e, TokenDelta) and e.request_id == o.request_id]
        assert events.index(o) > max(events.index(e) for e in mine)  # deltas first, then the output
        for j, toks in enumerate(o.tokens):
            per = [e for e in mine if e.index == j]
            assert [t for e in per for t in e.tokens] == toks, (o.request_id, j)
            assert [e.finish_reason for e in per][:-1] == [None] * (len(per) - 1)
            assert per[-1].finish_reason == o.finish_reasons[j]
            if o.request.is_beam:
                assert len(per) == 1  # a hypothesis is sent whole when the search ends
            else:
                assert all(len(e.tokens) <= 1 for e in per)  # one token per step
        assert {e.index for e in mine} == set(range(len(o.tokens)))


def test_streaming_callback_checked_before_any_step(model):
    eng = ServingEngine(model, CFG)
    with pytest.raises(ValueError, match="run: on_token is int 3; it must be None or a callable"):
        eng.run([Request(TOK.encode("hi"))], on_token=3)
    assert eng.step_count == 0 and eng.idle
