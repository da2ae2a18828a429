"""Beam search on the device (paged_kv.engine.beam_search) against a straightforward host beam
search over the contiguous cache: same hypotheses, same scores; blocks shared through `select`
while it runs and all released at the end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_kv as pk
from paged_kv import engine
from paged_kv.engine import BeamParams
from paged_kv.models import allocate_pages, contiguous_step, init_contiguous_cache, init_model, page_spec, tiny
from tests import tolerances as tol

BS = 8


def reference_beam_search(model, prompt, k, max_new, length_penalty, eos_ids):
    """Beam search written out plainly: each step recomputes every beam's sequence from scratch
    over a fresh contiguous cache. Returns [(score, sum_logprobs, tokens)] best first."""
    graphdef, state = nnx.split(model)
    width = len(prompt) + max_new
    beams = [(0.0 if j == 0 else -np.inf, []) for j in range(k)]
    pool = []  # (score, sum, tokens), best first
    c = k * (1 + max(len(eos_ids), 1))

    def merge(pool, entries):
        merged = pool + entries  # stable: earlier entries win ties
        order = sorted(range(len(merged)), key=lambda i: -merged[i][0])
        return [merged[i] for i in order[:k]]

    for step in range(max_new):
        seqs = np.zeros((k, width), np.int32)
        for j, (_, toks) in enumerate(beams):
            seqs[j, :len(prompt) + len(toks)] = prompt + toks
        q_lens = np.full(k, len(prompt) + step, np.int32)
        logits, _ = contiguous_step(graphdef, state, init_contiguous_cache(model, k, width), jnp.asarray(seqs),
                                    jnp.zeros(k, jnp.int32), jnp.asarray(q_lens), last_only=True)
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        scores = np.array([s for s, _ in beams], np.float32)
        cand = (scores[:, None] + logp).reshape(-1)
        top = np.argsort(-cand, kind="stable")[:c]
        v = logp.shape[1]
        length = step + 1
        norm = lambda s, length=length: float(s) / length ** length_penalty
        finished = [(norm(cand[i]), float(cand[i]), beams[i // v][1] + [int(i % v)])
                    for r, i in enumerate(top) if i % v in eos_ids and r < k]
        pool = merge(pool, finished)
        beams = [(cand[i], beams[i // v][1] + [int(i % v)]) for i in top if i % v not in eos_ids][:k]
        if step == max_new - 1:
            pool = merge(pool, [(norm(s), float(s), t) for s, t in beams])
        if len(pool) == k or step == max_new - 1:
            return pool


@pytest.fixture(scope="module")
def model():
    return init_model(tiny(), seed=5, init_std=0.2)


def test_beam_search_equals_reference_and_releases_every_block(model):
    k, max_new, penalty = 3, 7, 0.7
    rs = np.random.RandomState(1)
    prompts = [rs.randint(0, 256, n).tolist() for n in (11, 16, 4)]
    # An EOS id that a reference hypothesis produces mid-way, so early finishes are exercised.
    plain = reference_beam_search(model, prompts[0], k, max_new, penalty, ())
    eos = (plain[1][2][3],)
    refs = [reference_beam_search(model, p, k, max_new, penalty, eos) for p in prompts]

    mgr = pk.ManagerConfig(num_blocks=64, block_size=BS, max_seqs=10, max_blocks_per_seq=4)
    pages = allocate_pages(page_spec(model.config, mgr.num_blocks, mgr.block_size))
    toks, lens = engine.pad_prompts(prompts, width=16)
    out, pages, state = engine.beam_search(model, pages, toks, lens, BeamParams(k, max_new, penalty, eos),
                                           manager=mgr, impl="reference", chunk_size=BS)
    some_eos = False
    for b, ref in enumerate(refs):
        assert len(ref) == k
        for j, (score, total, tokens) in enumerate(ref):
            n = len(tokens)
            some_eos |= tokens[-1] in eos
            assert int(out.lengths[b, j]) == n, (b, j)
            np.testing.assert_array_equal(np.asarray(out.tokens[b, j, :n]), tokens)
            assert (np.asarray(out.tokens[b, j, n:]) == -1).all()
            np.testing.assert_allclose(float(out.scores[b, j]), score, rtol=0,
                                       atol=tol.beam_score_atol(model, 16 + max_new, n, score))
            np.testing.assert_allclose(float(out.sum_logprobs[b, j]), total, rtol=0,
                                       atol=tol.beam_score_atol(model, 16 + max_new, n, total))
    assert some_eos
    assert not np.asarray(out.out_of_blocks).any()
    # Candidates shared blocks while running (the prompts' blocks at least), and nothing is left.
    assert int(out.stats.shared[1]) >= sum(lens.tolist()) // BS
    assert int(jnp.max(out.stats.copies)) > 0
    u = pk.usage(mgr, state)
    assert int(u.used) == 0 and int(u.shared) == 0 and int(u.running) == 0 and int(u.table_entries) == 0
    assert int(jnp.sum(state.ref_count)) == 0 and int(u.free) == mgr.num_blocks - 1


def test_per_prompt_budgets_match_separate_beam_searches(model):
    """``max_new_tokens`` per prompt: each prompt's hypotheses are those of a beam search run with
    its own budget; the outputs keep the overall width, -1 beyond."""
    k, penalty, budgets = 2, 1.0, [2, 5, 3]
    rs = np.random.RandomState(4)
    prompts = [rs.randint(0, 256, n).tolist() for n in (9, 5, 12)]
    mgr = pk.ManagerConfig(num_blocks=48, block_size=BS, max_seqs=6, max_blocks_per_seq=4)
    pages = allocate_pages(page_spec(model.config, mgr.num_blocks, mgr.block_size))
    toks, lens = engine.pad_prompts(prompts, width=16)
    out, _, state = engine.beam_search(model, pages, toks, lens, BeamParams(k, 6, penalty), manager=mgr,
                                       max_new_tokens=np.array(budgets, np.int32), impl="reference", chunk_size=BS)
    assert out.tokens.shape == (3, k, 6)
    for b, (prompt, budget) in enumerate(zip(prompts, budgets)):
        ref = reference_beam_search(model, prompt, k, budget, penalty, ())
        for j, (score, _, tokens) in enumerate(ref):
            assert len(tokens) == budget and int(out.lengths[b, j]) == budget
            np.testing.assert_array_equal(np.asarray(out.tokens[b, j, :budget]), tokens)
            assert (np.asarray(out.tokens[b, j, budget:]) == -1).all()
            np.testing.assert_allclose(float(out.scores[b, j]), score, rtol=0,
                                       atol=tol.beam_score_atol(model, 16 + budget, budget, score))
    assert int(jnp.sum(state.ref_count)) == 0
    with pytest.raises(ValueError, match="max_new_tokens per prompt must be >= 1, got 0"):
        engine.beam_search(model, pages, toks, lens, BeamParams(k, 6, penalty), manager=mgr,
                           max_new_tokens=np.array([1, 0, 2], np.int32))


@pytest.mark.parametrize("kwargs, match", [
    (dict(beam_width=0), "beam_width=0 must be an int >= 1"),
    (dict(max_new_tokens=-2), "max_new_tokens=-2 must be an int >= 1"),
    (dict(length_penalty=float("nan")), "length_penalty=nan must be a finite float"),
])
def test_bad_beam_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamParams(**kwargs)


def test_too_many_beams_raise_before_compiling(model):
    mgr = pk.ManagerConfig(num_blocks=16, block_size=BS, max_seqs=6, max_blocks_per_seq=4)
    pages = allocate_pages(page_spec(model.config, mgr.num_blocks, mgr.block_size))
    toks, lens = engine.pad_prompts([[1, 2, 3], [4]])
    before = engine.beam_search_jit._cache_size()
    with pytest.raises(ValueError, match=r"2 prompts x 4 \(beam_width\) = 8 sequences; the manager holds max_seqs=6"):
        engine.beam_search(model, pages, toks, lens, BeamParams(beam_width=4), manager=mgr)
    with pytest.raises(ValueError, match="needs 300 candidate tokens per step; vocab_size=256"):
        engine.beam_search(model, pages, toks[:1], lens[:1], BeamParams(beam_width=150), manager=mgr.__class__(
            num_blocks=16, block_size=BS, max_seqs=200, max_blocks_per_seq=4))
    assert engine.beam_search_jit._cache_size() == before


def test_beam_search_takes_the_models_eos_by_default(model, monkeypatch):
    """``BeamParams()`` leaves ``eos_token_ids`` None: ``beam_search`` fills in the model's ids on
    the host, before the loop is traced (the loop receives them as static parameters); explicit ids
    and ``ignore_eos=True`` are passed on as given."""
    import dataclasses
    import importlib

    seen = []
    module = importlib.import_module("paged_kv.engine.beam_search")  # the module, not the function
    monkeypatch.setattr(module, "beam_search_jit", lambda *a, params, **kw: seen.append(params))
    with_eos = nnx.merge(*nnx.split(model))
    with_eos.config = dataclasses.replace(model.config, eos_token_ids=(3, 9))
    mgr = pk.ManagerConfig(num_blocks=16, block_size=BS, max_seqs=4, max_blocks_per_seq=4)
    pages = allocate_pages(page_spec(model.config, mgr.num_blocks, mgr.block_size))
    toks, lens = engine.pad_prompts([[1, 2, 3]])
    for params in (BeamParams(beam_width=2), BeamParams(beam_width=2, eos_token_ids=4),
                   BeamParams(beam_width=2, ignore_eos=True)):
        engine.beam_search(with_eos, pages, toks, lens, params, manager=mgr, impl="reference")
    assert [p.eos_token_ids for p in seen] == [(3, 9), (4,), ()]


def test_beam_search_out_of_blocks(model):
    """3 allocatable blocks: the 30-token prompt (4 blocks) is not admitted; the 8-token prompt's
    two beams fit until both need a third block at position 16, where the prompt stops with its
    beams as hypotheses of 9 tokens, the same as a 9-token beam search. Every block comes back."""
    k, penalty = 2, 1.0
    prompts = [list(range(10, 18)), list(range(30))]
    mgr = pk.ManagerConfig(num_blocks=4, block_size=BS, max_seqs=4, max_blocks_per_seq=8)
    pages = allocate_pages(page_spec(model.config, mgr.num_blocks, mgr.block_size))
    toks, lens = engine.pad_prompts(prompts)
    out, _, state = engine.beam_search(model, pages, toks, lens, BeamParams(k, 12, penalty), manager=mgr,
                                       impl="reference")
    assert out.out_of_blocks.tolist() == [True, True]
    assert out.lengths.tolist() == [[9, 9], [0, 0]]
    assert np.isneginf(np.asarray(out.scores[1])).all() and (np.asarray(out.tokens[1]) == -1).all()
    ref = reference_beam_search(model, prompts[0], k, 9, penalty, ())
    for j, (score, _, tokens) in enumerate(ref):
        np.testing.assert_array_equal(np.asarray(out.tokens[0, j, :9]), tokens)
        np.testing.assert_allclose(float(out.scores[0, j]), score, rtol=0,
                                   atol=tol.beam_score_atol(model, 8 + 9, 9, score))
    assert int(out.stats.used.max()) == 3
    u = pk.usage(mgr, state)
    assert int(u.used) == 0 and int(u.running) == 0 and int(jnp.sum(state.ref_count)) == 0
