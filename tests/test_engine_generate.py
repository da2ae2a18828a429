"""On-device generation (paged_kv.engine.generate): equal to step-by-step greedy decoding over the
contiguous cache, EOS and budgets, block accounting of parallel sampling, PRNG determinism, no
retrace for new prompts of the same padded shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv as pk
from paged_kv import engine
from paged_kv.engine import FinishReason, SamplingParams
from paged_kv.models import allocate_pages, greedy_generate_contiguous, init_model, page_spec, tiny
from tests import tolerances as tol

BS = 8
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def model():
    return init_model(tiny(), seed=3, init_std=0.2)


def _manager(**kw):
    return pk.ManagerConfig(**{**dict(num_blocks=NUM_BLOCKS, block_size=BS, max_seqs=8, max_blocks_per_seq=8), **kw})


def _pages(model, mgr):
    return allocate_pages(page_spec(model.config, mgr.num_blocks, mgr.block_size))


def _blocks(n):
    return -(-n // BS)


def _assert_all_free(mgr, state):
    u = pk.usage(mgr, state)
    assert int(u.used) == 0 and int(u.running) == 0 and int(u.shared) == 0
    assert int(jnp.sum(state.ref_count)) == 0


@pytest.mark.smoke
def test_greedy_loop_equals_contiguous_stepwise(model):
    """A batch of prompts of different lengths (several prefill chunks), one stopping at EOS:
    same tokens as host-driven greedy decoding over the contiguous cache; log-probs of its
    logits; blocks freed the step a sequence finishes; then a second batch with new prompts of
    the same padded shape and per-prompt budgets reuses the compiled loop."""
    rs = np.random.RandomState(0)
    n_new = 12
    prompts = [rs.randint(0, 256, n).tolist() for n in (5, 23, 37)]
    ref, ref_logits = greedy_generate_contiguous(model, prompts, n_new, chunk_size=BS)
    eos = int(ref[1, 4])  # prompt 1 stops at its 5th token (or earlier if it occurs before)
    assert eos not in ref[0].tolist() and eos not in ref[2].tolist()
    stop = ref[1].tolist().index(eos) + 1

    mgr = _manager()
    params = SamplingParams(max_new_tokens=n_new, eos_token_ids=(eos,))
    toks, lens = engine.pad_prompts(prompts, width=40)
    out, pages, state = engine.generate(model, _pages(model, mgr), toks, lens, jax.random.key(0), params,
                                        manager=mgr, impl="reference", chunk_size=BS)
    tokens = np.asarray(out.tokens[:, 0])
    np.testing.assert_array_equal(tokens[[0, 2]], ref[[0, 2]])
    np.testing.assert_array_equal(tokens[1, :stop], ref[1, :stop])
    assert (tokens[1, stop:] == -1).all()
    assert out.lengths[:, 0].tolist() == [n_new, stop, n_new]
    assert out.finish_reason[:, 0].tolist() == [FinishReason.LENGTH, FinishReason.EOS, FinishReason.LENGTH]
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(ref_logits), axis=-1))
    want = np.take_along_axis(logp, ref[:, :, None], axis=-1)[:, :, 0]
    got = np.asarray(out.logprobs[:, 0])
    atol = tol.logprob_atol(tol.model_atol(model.config, 37 + n_new, np.abs(ref_logits).max(),
                                           score_mag=tol.score_bound(model)), model.config.vocab_size)
    np.testing.assert_allclose(got[[0, 2]], want[[0, 2]], rtol=0, atol=atol)
    np.testing.assert_allclose(got[1, :stop], want[1, :stop], rtol=0, atol=atol)
    # Step s holds prompt + s tokens for every sequence still running (no sharing between prompts).
    lens_np, lengths = np.asarray(lens), np.asarray(out.lengths[:, 0])
    want_used = [sum(_blocks(lens_np[i] + s) for i in range(3) if lengths[i] > s) for s in range(n_new)]
    assert out.stats.used.tolist() == want_used
    assert out.stats.copies.tolist() == [0] * n_new and out.stats.shared.tolist() == [0] * n_new
    _assert_all_free(mgr, state)

    # New prompts, same padded shape (and same longest prompt, so the contiguous reference does not
    # recompile either), per-prompt budgets: no retrace.
    compiled = engine.generate_jit._cache_size()
    prompts2 = [rs.randint(0, 256, n).tolist() for n in (37, 9, 30)]
    ref2, _ = greedy_generate_contiguous(model, prompts2, n_new, chunk_size=BS)
    toks2, lens2 = engine.pad_prompts(prompts2, width=40)
    budgets = np.array([3, n_new, 7], np.int32)
    out2, pages, state = engine.generate(model, pages, toks2, lens2, jax.random.key(1), params, manager=mgr,
                                         state=state, max_new_tokens=budgets, impl="reference", chunk_size=BS)
    assert engine.generate_jit._cache_size() == compiled
    for i, b in enumerate(budgets):
        row = ref2[i, :b].tolist()
        end = row.index(eos) + 1 if eos in row else b
        np.testing.assert_array_equal(np.asarray(out2.tokens[i, 0, :end]), ref2[i, :end])
        assert int(out2.lengths[i, 0]) == end
    _assert_all_free(mgr, state)


@pytest.mark.parametrize("prompt_len, copies", [(13, 3), (16, 0)], ids=["mid_block", "block_boundary"])
def test_parallel_samples_share_the_prompt(model, prompt_len, copies):
    """n = 4 samples: the prompt is prefilled once and forked; the first decode step copies the
    shared partly full last block n - 1 times (none on a block boundary) and never again; blocks in
    use = the prompt's full blocks once + each sample's own."""
    n, n_new = 4, 6
    mgr = _manager()
    params = SamplingParams(max_new_tokens=n_new, temperature=1.0, n=n)
    prompt = np.random.RandomState(prompt_len).randint(0, 256, prompt_len).tolist()
    toks, lens = engine.pad_prompts([prompt], width=16)
    key = jax.random.key(7)
    out, pages, state = engine.generate(model, _pages(model, mgr), toks, lens, key, params, manager=mgr,
                                        impl="reference")
    assert out.lengths.tolist() == [[n_new] * n]
    full = prompt_len // BS
    assert out.stats.copies.tolist() == [0, copies] + [0] * (n_new - 2)
    assert int(out.stats.used[0]) == _blocks(prompt_len) and int(out.stats.shared[0]) == _blocks(prompt_len)
    for s in range(1, n_new):
        own = _blocks(prompt_len + s) - full
        assert int(out.stats.used[s]) == full + n * own, s
        assert int(out.stats.shared[s]) == full, s
    tokens = np.asarray(out.tokens[0])
    assert len({tuple(t) for t in tokens.tolist()}) > 1  # the samples differ
    _assert_all_free(mgr, state)

    # Same key: same tokens and log-probs. Another key: other samples.
    again, pages, state = engine.generate(model, pages, toks, lens, key, params, manager=mgr, state=state,
                                          impl="reference")
    np.testing.assert_array_equal(again.tokens, out.tokens)
    np.testing.assert_array_equal(again.logprobs, out.logprobs)
    other, pages, state = engine.generate(model, pages, toks, lens, jax.random.key(8), params, manager=mgr,
                                          state=state, impl="reference")
    assert not np.array_equal(np.asarray(other.tokens), tokens)
    _assert_all_free(mgr, state)


def test_sampler_filters():
    logits = jnp.asarray(np.random.RandomState(0).randn(4, 50).astype(np.float32) * 3)
    greedy = jnp.argmax(logits, axis=-1)
    for params in (SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)):
        tok, _ = jax.jit(engine.sample_tokens, static_argnums=2)(logits, jax.random.key(0), params)
        np.testing.assert_array_equal(tok, greedy)
    filt = jax.jit(engine.filter_logits, static_argnums=1)
    kept = filt(logits, SamplingParams(temperature=1.0, top_k=5))
    assert (jnp.isfinite(kept).sum(-1) == 5).all()
    probs = np.sort(np.asarray(jax.nn.softmax(logits, -1)), axis=-1)[:, ::-1]
    kept = np.isfinite(np.asarray(filt(logits, SamplingParams(temperature=1.0, top_p=0.8))))
    need = (np.cumsum(probs, -1) - probs < 0.8).sum(-1)  # smallest prefix reaching 0.8
    assert kept.sum(-1).tolist() == need.tolist()
    # Samples follow the filtered distribution (top_k=3 draws only the 3 best).
    draws = jax.jit(jax.vmap(lambda k: engine.sample_tokens(logits, k, SamplingParams(temperature=1.0, top_k=3))[0]))(
        jax.random.split(jax.random.key(1), 200))
    top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
    assert all(set(np.asarray(draws[:, i]).tolist()) <= set(top3[i].tolist()) for i in range(4))


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), "temperature=-0.5 must be"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k=-1 must be an int >= 0"),
    (dict(n=0), "n=0 must be an int >= 1"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be an int >= 1"),
    (dict(eos_token_ids=(-3,)), "-3"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_requests_raise_before_compiling(model):
    mgr = _manager()
    pages = _pages(model, mgr)
    toks, lens = engine.pad_prompts([[1, 2, 3], [4, 5]], width=8)
    key = jax.random.key(0)
    before = engine.generate_jit._cache_size()
    cases = [
        (dict(params=SamplingParams(n=5)), r"2 prompts x 5 \(n\) = 10 sequences; the manager holds max_seqs=8"),
        (dict(params=SamplingParams(top_k=300)), "top_k=300 must be <= vocab_size=256"),
        (dict(params=SamplingParams(eos_token_ids=(256,))), "eos token id 256 must be < vocab_size=256"),
        (dict(prompt_tokens=np.zeros((2, 80), np.int32), prompt_lens=np.array([70, 2])),
         "width 80 exceeds the 64 tokens"),
        (dict(prompt_lens=np.array([3, 9])), r"prompt 1 has length 9; lengths must be in \[1, 8\]"),
        (dict(impl="cuda"), "impl='cuda'"),
        (dict(chunk_size=0), "chunk_size=0"),
        (dict(max_new_tokens=np.array([0, 3])), "must be >= 1"),
        (dict(pages=jnp.zeros((1, 2, 3))), "pages have shape"),
        (dict(params=dict(temperature=0.5)), "params must be a SamplingParams"),
    ]
    for over, match in cases:
        kw = dict(model=model, pages=pages, prompt_tokens=toks, prompt_lens=lens, key=key, params=SamplingParams(),
                  manager=mgr, impl="reference")
        kw.update(over)
        with pytest.raises(ValueError, match=match):
            engine.generate(**kw)
    # A prompt longer than the context: the model's positions (32) end before the table's (64).
    short = init_model(tiny(max_position_embeddings=32), seed=0)
    toks, lens = engine.pad_prompts([list(range(40))])
    with pytest.raises(ValueError, match="prompt 0 has 40 tokens, longer than the context of 32 tokens"):
        engine.generate(short, _pages(short, mgr), toks, lens, key, SamplingParams(), manager=mgr)
    # Rows already running in the caller's state.
    state = pk.init_state(mgr)
    state = state.replace(active=state.active.at[1].set(True))
    toks, lens = engine.pad_prompts([[1, 2, 3], [4, 5]], width=8)
    with pytest.raises(ValueError, match=r"rows \[1\] are already running"):
        engine.generate(model, pages, toks, lens, key, SamplingParams(), manager=mgr, state=state)
    assert engine.generate_jit._cache_size() == before


def test_out_of_blocks_rejects_and_cuts_short(model):
    """5 allocatable blocks for three 16-token prompts (2 blocks each): the third is not admitted;
    at the first decode step the one free block goes to the first prompt (first come, first
    served), the second is cut short and freed, and the first finishes with its blocks."""
    n_new = 12
    mgr = _manager(num_blocks=6)
    rs = np.random.RandomState(3)
    prompts = [rs.randint(0, 256, 16).tolist() for _ in range(3)]
    ref, _ = greedy_generate_contiguous(model, prompts[:2], n_new, chunk_size=16)
    toks, lens = engine.pad_prompts(prompts)
    out, _, state = engine.generate(model, _pages(model, mgr), toks, lens, jax.random.key(0),
                                    SamplingParams(max_new_tokens=n_new), manager=mgr, impl="reference")
    assert out.finish_reason[:, 0].tolist() == [FinishReason.LENGTH, FinishReason.NO_BLOCKS, FinishReason.REJECTED]
    assert out.lengths[:, 0].tolist() == [n_new, 1, 0]
    np.testing.assert_array_equal(np.asarray(out.tokens[0, 0]), ref[0])
    assert int(out.tokens[1, 0, 0]) == ref[1, 0] and (np.asarray(out.tokens[2]) == -1).all()
    assert out.stats.used.tolist()[:3] == [4, 5, 3]  # row 1's two blocks are back after one step
    _assert_all_free(mgr, state)


def test_traceable_inside_callers_jit(model):
    """generate and beam_search trace inside the caller's own jit (tracer arguments; only the
    shape checks run). make_jaxpr traces without compiling."""
    from flax import nnx
    graphdef, weights = nnx.split(model)
    mgr = _manager()
    pages = _pages(model, mgr)
    toks, lens = engine.pad_prompts([[1, 2, 3], [4, 5]], width=8)

    def sample(weights, pages, toks, lens, key):
        out, pages, _ = engine.generate((graphdef, weights), pages, toks, lens, key, SamplingParams(n=2),
                                        manager=mgr, impl="reference")
        return out.tokens, pages

    def beams(weights, pages, toks, lens):
        out, pages, _ = engine.beam_search((graphdef, weights), pages, toks, lens, engine.BeamParams(2, 4),
                                           manager=mgr, impl="reference")
        return out.tokens, pages

    jaxpr = jax.make_jaxpr(sample)(weights, pages, toks, lens, jax.random.key(0))
    assert jaxpr.out_avals[0].shape == (2, 2, 16)
    assert "while" in str(jaxpr)
    jaxpr = jax.make_jaxpr(beams)(weights, pages, toks, lens)
    assert jaxpr.out_avals[0].shape == (2, 2, 4)


# ---------------------------------------------------------------------------- EOS by default
def test_stops_at_the_models_eos_by_default(model):
    """``SamplingParams()`` stops at the model's EOS ids (``LlamaConfig.eos_token_ids``), resolved on
    the host before tracing, so it shares one compiled loop with the same ids given explicitly;
    ``ignore_eos=True`` runs to ``max_new_tokens``, as a model without EOS ids does. The parameters
    stay hashable with either form."""
    n_new = 8
    mgr = _manager()
    toks, lens = engine.pad_prompts([np.random.RandomState(11).randint(0, 256, 6).tolist()])

    def run(model, params):
        out, _, _ = engine.generate(model, _pages(model, mgr), toks, lens, 0, params, manager=mgr, impl="reference")
        return out.tokens[0, 0].tolist(), out.finish_reason_names()[0][0]

    row, reason = run(model, SamplingParams(max_new_tokens=n_new))  # tiny() states no EOS ids
    assert reason == "LENGTH" and -1 not in row
    eos = row[3]
    stop = row.index(eos) + 1
    with_eos = init_model(tiny(eos_token_ids=(eos,)), seed=3, init_std=0.2)  # the same weights
    assert hash(SamplingParams()) == hash(SamplingParams()) and SamplingParams().eos_token_ids is None
    tokens, reason = run(with_eos, SamplingParams(max_new_tokens=n_new))
    assert (tokens[:stop], reason) == (row[:stop], "EOS") and set(tokens[stop:]) == {-1}
    compiled = engine.generate_jit._cache_size()
    assert run(with_eos, SamplingParams(max_new_tokens=n_new, eos_token_ids=(eos,))) == (tokens, reason)
    assert engine.generate_jit._cache_size() == compiled  # the default resolved to the same static params
    assert run(with_eos, SamplingParams(max_new_tokens=n_new, ignore_eos=True)) == (row, "LENGTH")
    assert engine.with_model_eos(SamplingParams(), (eos, 7)).eos_token_ids == (eos, 7)
    assert engine.with_model_eos(SamplingParams(eos_token_ids=()), (eos,)).eos_token_ids == ()
    assert engine.with_model_eos(SamplingParams(ignore_eos=True), (eos,)).eos_token_ids == ()
    with pytest.raises(ValueError, match="ignore_eos=True with eos_token_ids=\\(5,\\)"):
        SamplingParams(ignore_eos=True, eos_token_ids=5)
    with pytest.raises(ValueError, match="ignore_eos=1 must be a bool"):
        engine.BeamParams(ignore_eos=1)


# ---------------------------------------------------------------------------- one compile per bucket
def test_pad_prompts_buckets():
    """Widths are powers of two from 16 (``bucket_width``), rounded up to ``multiple``, capped at
    ``max_width``; ``width=`` is taken as given."""
    widths = [engine.pad_prompts([[1] * n])[0].shape[1] for n in (1, 5, 16, 17, 32, 33, 100, 129)]
    assert widths == [16, 16, 16, 32, 32, 64, 128, 256]
    assert engine.pad_prompts([[1] * 20], multiple=24)[0].shape == (1, 48)
    assert engine.pad_prompts([[1] * 70], max_width=100)[0].shape == (1, 100)
    assert engine.pad_prompts([[1] * 5, [2] * 9], width=9)[0].shape == (2, 9)
    with pytest.raises(ValueError, match="a prompt has 101 tokens; max_width=100"):
        engine.pad_prompts([[1] * 101], max_width=100)
    with pytest.raises(ValueError, match="max_width=0 must be an int >= 1"):
        engine.pad_prompts([[1]], max_width=0)


def test_a_sweep_of_prompt_lengths_compiles_once_per_bucket(model):
    """Prompts of 3 to 31 tokens, padded by ``pad_prompts``' default, fall in two buckets (16 and 32
    tokens): ``generate`` compiles its loop at most twice for the whole sweep, not once per longest
    length."""
    lengths = (3, 5, 9, 16, 17, 20, 31)
    mgr = _manager()
    params = SamplingParams(max_new_tokens=2, eos_token_ids=())
    rs = np.random.RandomState(5)
    before = engine.generate_jit._cache_size()
    widths = set()
    for n in lengths:
        toks, lens = engine.pad_prompts([rs.randint(0, 256, n).tolist(), [1, 2]])
        widths.add(toks.shape[1])
        out, _, _ = engine.generate(model, _pages(model, mgr), toks, lens, 0, params, manager=mgr, impl="reference")
        assert out.lengths.tolist() == [[2], [2]]
    assert widths == {16, 32}
    assert engine.generate_jit._cache_size() - before <= len(widths)
