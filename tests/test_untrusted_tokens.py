"""Untrusted request values (issue 14, section 2): token ids outside the vocabulary and bad
sampling numbers.

* Host checks (no compilation): every entry point (``Request``, ``ServingEngine.submit``,
  ``pad_prompts``, ``generate``, ``beam_search``) raises ``ValueError`` naming the bad value, its
  position and the limit; nothing is admitted.
* End to end with the tiny checkpoint (vocab 259) and prefix caching on: a request of a valid
  16-token block followed by id 259 is rejected on submit, and a later valid request with the same
  prefix gets exactly (tokens and log-probabilities) its clean-run answer.
* Defence in depth, host checks bypassed: the jitted paths write no NaN into the pages (the model
  looks an out-of-range id up as a safe one), ``generate``/``beam_search`` under ``jit`` skip the
  row and flag it (``FinishReason.BAD_TOKEN``, ``BeamOutput.bad_tokens``), and the good request's
  answer is unchanged.

The serving engine uses the ``ServingConfig`` of ``test_serving`` (its step compiles once when
both modules run together)."""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv as pk
from paged_kv.engine import (
    BeamParams,
    FinishReason,
    SamplingParams,
    beam_search,
    call_setup as req_mod,
    generate,
    pad_prompts,
)
from paged_kv.engine.serving import Request, ServingConfig, ServingEngine
from paged_kv.models import allocate_pages, init_model, load_hf_checkpoint, page_spec, tiny
from paged_kv.models.llama import SAFE_TOKEN, in_vocab, safe_tokens
from paged_kv.models.tokenizer import ByteTokenizer

gen_mod = importlib.import_module("paged_kv.engine.generate")  # the package rebinds the name to the function
beam_mod = importlib.import_module("paged_kv.engine.beam_search")
TOK = ByteTokenizer()
VOCAB = 259  # the tiny checkpoint's vocabulary
MGR = pk.ManagerConfig(num_blocks=24, block_size=16, max_seqs=16, max_blocks_per_seq=16)
CFG = ServingConfig(MGR, chunk_size=32, max_prefill_rows=4, top_candidates=8, impl="reference")
PREFIX = TOK.encode("Q: What do cows ")  # one full 16-token block
GOOD = PREFIX + TOK.encode("say? A:")
BAD = PREFIX + [259]
GEN_MGR = pk.ManagerConfig(num_blocks=16, block_size=16, max_seqs=4, max_blocks_per_seq=4)


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint("checkpoints/tiny-llama")


def test_prefix_is_one_block():
    assert len(PREFIX) == 16 and len(GOOD) > 16


# ---------------------------------------------------------------------------- host checks: token ids
BAD_PROMPTS = [
    (PREFIX + [259], r"token id 259 at position 16 is out of range: ids must be in \[0, vocab_size=259\)"),
    ([1, 300, 2], r"token id 300 at position 1 is out of range: ids must be in \[0, vocab_size=259\)"),
    ([2**31 - 1], r"token id 2147483647 at position 0 is out of range: ids must be in \[0, vocab_size=259\)"),
    ([5, -1], r"token id -1 at position 1 is out of range"),
    ([1, True], r"token True at position 1 is a bool, not an int"),
    ([1, 2, 4.7], r"token 4.7 at position 2 is a float, not an int"),
    (np.array([1.0, 2.0]), r"token ids must be integers, got an array of dtype float64"),
    (np.array([True, False]), r"token ids must be integers, got an array of dtype bool"),
    (None, r"must be a sequence of int token ids, got NoneType"),
    ("hello", r"must be a sequence of int token ids, got str"),
    (7, r"must be a sequence of int token ids, got int"),
    ([[1, 2], [3]], r"token \[1, 2\] at position 0 is a list, not an int"),
    ([1, None], r"token None at position 1 is a NoneType, not an int"),
    (np.zeros((2, 2), np.int32), r"must be a 1-D sequence of token ids, got an array of shape \(2, 2\)"),
    ([], "is empty"),
]


@pytest.mark.parametrize("prompt,match", BAD_PROMPTS)
def test_token_ids_rejects(prompt, match):
    with pytest.raises(ValueError, match=match):
        req_mod.token_ids(prompt, vocab_size=VOCAB)


@pytest.mark.parametrize("prompt,match", [p for p in BAD_PROMPTS if "vocab_size" not in p[1]])
def test_request_rejects_bad_prompts(prompt, match):
    with pytest.raises(ValueError, match=match):
        Request(prompt)


def test_request_accepts_int_arrays_and_bounds_without_vocab():
    assert Request(np.array([1, 2, 258], np.uint16)).prompt == (1, 2, 258)
    assert Request(range(3)).prompt == (0, 1, 2)
    assert type(Request([np.int64(4)]).prompt[0]) is int
    # Without a model the limit is int32; the engine checks the vocabulary.
    with pytest.raises(ValueError,
                       match=r"token id 2147483648 at position 0 is out of range: ids must be in \[0, 2\*\*31\)"):
        Request([2**31])
    with pytest.raises(ValueError, match=r"token id 1180591620717411303424 at position 1 is out of range"):
        Request([1, 2**70])


@pytest.mark.parametrize("prompts,kw,match", [
    ([[1, 2], [3, 300]], dict(vocab_size=VOCAB),
     r"prompt 1 token id 300 at position 1 is out of range: ids must be in \[0, vocab_size=259\)"),
    ([[1, 2], [3, -4]], {}, r"prompt 1 token id -4 at position 1 is out of range: ids must be in \[0, 2\*\*31\)"),
    ([[1], [2.5]], {}, r"prompt 1 token 2.5 at position 0 is a float"),
    ([[True]], {}, r"prompt 0 token True at position 0 is a bool"),
    ([None], {}, r"prompt 0 must be a sequence of int token ids, got NoneType"),
    (None, {}, r"prompts must be a sequence of token-id sequences, got NoneType"),
    ([], {}, "no prompts"),
    ([[1, 2]], dict(width=1.5), r"width=1.5 must be an int >= 1"),
    ([[1, 2]], dict(vocab_size=0), r"vocab_size=0 must be an int >= 1"),
])
def test_pad_prompts_rejects(prompts, kw, match):
    with pytest.raises(ValueError, match=match):
        pad_prompts(prompts, **kw)


def test_pad_prompts_accepts_arrays():
    toks, lens = pad_prompts([np.array([1, 2], np.int64), (3,)], width=4, vocab_size=VOCAB)
    assert toks.dtype == np.int32 and toks.tolist() == [[1, 2, 0, 0], [3, 0, 0, 0]] and lens.tolist() == [2, 1]


# ---------------------------------------------------------------------------- host checks: numbers
@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.5), r"temperature=-0.5 must be a finite float >= 0"),
    (dict(temperature=float("nan")), r"temperature=nan must be a finite float >= 0"),
    (dict(temperature=float("inf")), r"temperature=inf must be a finite float >= 0"),
    (dict(temperature=1e-9), r"temperature=1e-09 must be 0 \(greedy\) or in \[1e-06, 1e\+06\]"),
    (dict(temperature=True), r"temperature=True must be a finite float"),
    (dict(temperature="0.7"), r"temperature='0.7' must be a finite float"),
    (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
    (dict(top_p=-0.1), r"top_p=-0.1 must be in \(0, 1\]"),
    (dict(top_p=1.01), r"top_p=1.01 must be in \(0, 1\]"),
    (dict(top_p=float("nan")), r"top_p=nan must be in \(0, 1\]"),
    (dict(top_k=-1), r"top_k=-1 must be an int >= 0"),
    (dict(top_k=2.5), r"top_k=2.5 must be an int >= 0"),
    (dict(top_k=True), r"top_k=True must be an int >= 0"),
    (dict(n=0), r"n=0 must be an int >= 1"),
    (dict(n=-2), r"n=-2 must be an int >= 1"),
    (dict(n=True), r"n=True must be an int >= 1"),
    (dict(n=2.0), r"n=2.0 must be an int >= 1"),
    (dict(max_new_tokens=0), r"max_new_tokens=0 must be an int >= 1"),
    (dict(max_new_tokens=-3), r"max_new_tokens=-3 must be an int >= 1"),
    (dict(max_new_tokens=False), r"max_new_tokens=False must be an int >= 1"),
    (dict(max_new_tokens=8.0), r"max_new_tokens=8.0 must be an int >= 1"),
    (dict(max_new_tokens=2**31), r"max_new_tokens=2147483648 must be an int in \[1, 2\*\*31\)"),
    (dict(eos_token_ids=(-1,)), r"eos_token_ids: -1 must be an int >= 0"),
    (dict(eos_token_ids=(True,)), r"eos_token_ids: True must be an int >= 0"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(beam_width=0), r"beam_width=0 must be an int >= 1"),
    (dict(beam_width=-1), r"beam_width=-1 must be an int >= 1"),
    (dict(beam_width=True), r"beam_width=True must be an int >= 1"),
    (dict(beam_width=2.0), r"beam_width=2.0 must be an int >= 1"),
    (dict(max_new_tokens=0), r"max_new_tokens=0 must be an int >= 1"),
    (dict(max_new_tokens=-1), r"max_new_tokens=-1 must be an int >= 1"),
    (dict(max_new_tokens=4.5), r"max_new_tokens=4.5 must be an int >= 1"),
    (dict(length_penalty=float("nan")), r"length_penalty=nan must be a finite float"),
    (dict(length_penalty=float("inf")), r"length_penalty=inf must be a finite float"),
])
def test_bad_beam_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamParams(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(seed=-1), r"seed=-1 must be None or an int in \[0, 2\*\*31\)"),
    (dict(seed=2**32 + 1), r"seed=4294967297 must be None or an int in \[0, 2\*\*31\)"),
    (dict(seed=1.5), r"seed=1.5 must be None or an int"),
    (dict(seed=True), r"seed=True must be None or an int"),
    (dict(salt=2**32), r"salt=4294967296 must be an int in \[0, 2\*\*32\)"),
    (dict(arrival=-1), r"arrival=-1 must be an int >= 0"),
    (dict(params=None), r"params must be SamplingParams or BeamParams, got NoneType"),
])
def test_bad_request_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Request([1, 2, 3], **kwargs)


def test_check_key_accepts_keys_and_seeds():
    typed = jax.random.key(7)
    assert req_mod.check_key(typed) is typed
    raw = jax.random.PRNGKey(7)
    assert req_mod.check_key(raw) is raw
    assert jax.random.key_data(req_mod.check_key(7)).tolist() == jax.random.key_data(typed).tolist()
    assert req_mod.check_key(2**32 - 1).shape == ()
    with pytest.raises(ValueError, match=r"key must be one PRNG key \(shape \(\)\), got shape \(2,\)"):
        req_mod.check_key(jax.random.split(typed))


@pytest.fixture(scope="module")
def gen_pages(model):
    return allocate_pages(page_spec(model.config, GEN_MGR.num_blocks, GEN_MGR.block_size))


def _gen_call(model, pages, what, **over):
    toks, lens = pad_prompts([GOOD, [1, 2, 3]], width=32)
    kw = dict(prompt_tokens=toks, prompt_lens=lens, manager=GEN_MGR, impl="reference")
    if what == "generate":
        kw.update(key=jax.random.key(0), params=SamplingParams(max_new_tokens=4))
    else:
        kw.update(params=BeamParams(beam_width=2, max_new_tokens=4))
    kw.update(over)
    return (generate if what == "generate" else beam_search)(model, pages, **kw)


def _bad_padded(bad_id, pos=17):
    toks, lens = pad_prompts([GOOD, [1, 2, 3]], width=32)
    toks[0, pos] = bad_id
    return toks, lens


BOTH_CASES = [
    (lambda: dict(prompt_tokens=_bad_padded(259)[0]),
     r"prompt 0 token id 259 at position 17 is out of range: ids must be in \[0, vocab_size=259\)"),
    (lambda: dict(prompt_tokens=_bad_padded(-7, pos=3)[0]), r"prompt 0 token id -7 at position 3 is out of range"),
    (lambda: dict(prompt_tokens=_bad_padded(2**31 - 1)[0]), r"prompt 0 token id 2147483647 at position 17"),
    (lambda: dict(prompt_tokens=_bad_padded(1)[0].astype(np.float32)),
     r"prompt_tokens must be integers \(int32\), got dtype float32"),
    (lambda: dict(prompt_tokens=_bad_padded(1)[0].astype(bool)),
     r"prompt_tokens must be integers \(int32\), got dtype bool"),
    (lambda: dict(prompt_tokens=[[1, 2], [3]]), r"prompt_tokens must be a non-empty \[B, L\] integer array"),
    (lambda: dict(prompt_lens=np.array([19.0, 3.0])), r"prompt_lens must be integers \(int32\), got dtype float64"),
    (lambda: dict(max_new_tokens=np.array([0, 3])), r"max_new_tokens per prompt must be >= 1, got 0"),
    (lambda: dict(max_new_tokens=np.array([-5, 3])), r"max_new_tokens per prompt must be >= 1, got -5"),
    (lambda: dict(max_new_tokens=np.array([2.5, 3.0])),
     r"max_new_tokens per prompt must be integers \(int32\), got dtype float64"),
    (lambda: dict(max_new_tokens=np.array([True, True])),
     r"max_new_tokens per prompt must be integers \(int32\), got dtype bool"),
    (lambda: dict(max_new_tokens=np.array([2**31, 3])), r"max_new_tokens per prompt must be < 2\*\*31 \(int32\)"),
]
GEN_CASES = [
    (lambda: dict(params=SamplingParams(top_k=260)), r"top_k=260 must be <= vocab_size=259"),
    (lambda: dict(params=SamplingParams(eos_token_ids=(259,))), r"eos token id 259 must be < vocab_size=259"),
    (lambda: dict(key=-1), r"seed=-1 must be an int in \[0, 2\*\*32\)"),
    (lambda: dict(key=2**32), r"seed=4294967296 must be an int in \[0, 2\*\*32\)"),
    (lambda: dict(key=1.5), r"key must be a PRNG key .* got float 1.5"),
    (lambda: dict(key=True), r"key=True must be a PRNG key"),
    (lambda: dict(key=None), r"key=None must be a PRNG key"),
    (lambda: dict(key=np.zeros(3, np.float32)), r"key must be a PRNG key .* dtype float32 and shape \(3,\)"),
]
BEAM_CASES = [
    (lambda: dict(params=BeamParams(beam_width=2, eos_token_ids=(300,))), r"eos token id 300 must be < vocab_size=259"),
    (lambda: dict(params=BeamParams(beam_width=2, eos_token_ids=tuple(range(130)))),
     r"needs 262 candidate tokens per step; vocab_size=259"),
    (lambda: dict(params=BeamParams(beam_width=100)),
     r"2 prompts x 100 \(beam_width\) = 200 sequences; the manager holds max_seqs=4"),
]


@pytest.mark.parametrize("what,case", [("generate", c) for c in BOTH_CASES + GEN_CASES]
                         + [("beam_search", c) for c in BOTH_CASES + BEAM_CASES])
def test_generate_and_beam_search_reject_before_compiling(model, gen_pages, what, case):
    """Every bad value raises ValueError naming it and the limit; nothing is traced or compiled."""
    over, match = case
    jitted = gen_mod.generate_jit if what == "generate" else beam_mod.beam_search_jit
    before = jitted._cache_size()
    with pytest.raises(ValueError, match=match):
        _gen_call(model, gen_pages, what, **over())
    assert jitted._cache_size() == before


# ---------------------------------------------------------------------------- the jitted guards
def test_safe_tokens_and_in_vocab():
    t = jnp.array([[0, 258, 259, -1, 2**31 - 1]], jnp.int32)
    assert in_vocab(t, VOCAB).tolist() == [[True, True, False, False, False]]
    assert safe_tokens(t, VOCAB).tolist() == [[0, 258, SAFE_TOKEN, SAFE_TOKEN, SAFE_TOKEN]]
    assert gen_mod.bad_prompts(t, jnp.array([2]), VOCAB).tolist() == [False]  # padding is not checked
    assert gen_mod.bad_prompts(t, jnp.array([3]), VOCAB).tolist() == [True]


def test_model_embedding_never_nan(model):
    """The model's lookup of out-of-range ids gives the safe id's hidden states, not NaN."""
    def attend(layer, q, k, v, cache):
        return q, cache  # no cache: enough to see the embedding's effect downstream

    pos = jnp.zeros((1, 4), jnp.int32)
    bad, _ = model(jnp.array([[259, -1, 2**31 - 1, 1000]], jnp.int32), pos, None, attend)
    safe, _ = model(jnp.full((1, 4), SAFE_TOKEN, jnp.int32), pos, None, attend)
    assert bool(jnp.all(jnp.isfinite(bad)))
    np.testing.assert_array_equal(np.asarray(bad), np.asarray(safe))


# ---------------------------------------------------------------------------- end to end, serving
def _state_arrays(state):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


def _greedy(max_new_tokens=8):
    return SamplingParams(max_new_tokens=max_new_tokens)


@pytest.fixture(scope="module")
def clean(model):
    """The good request alone on a fresh engine."""
    eng = ServingEngine(model, CFG)
    (out,) = list(eng.run([Request(GOOD, _greedy(), request_id="good")]))
    assert out.ok and len(out.tokens[0]) == 8
    return out


def test_bad_request_rejected_on_submit_and_good_request_unchanged(model, clean):
    """Issue 14 (b): a valid 16-token block followed by id 259 is refused by ``submit`` (nothing
    queued, the block-manager state untouched, nothing cached); a later valid request with the same
    prefix gets exactly its clean-run tokens and log-probabilities, as does a request whose prefix
    does hit the cache after a valid request registered it."""
    eng = ServingEngine(model, CFG)
    before = _state_arrays(eng.state)
    with pytest.raises(ValueError, match=r"prompt token id 259 at position 16 is out of range: "
                                         r"ids must be in \[0, vocab_size=259\)"):
        eng.submit(Request(BAD, _greedy(), request_id="bad"))
    assert eng.idle and eng.num_waiting == 0
    for a, b in zip(before, _state_arrays(eng.state)):
        np.testing.assert_array_equal(a, b)
    # Through ``run`` the rejection is streamed as an error output; the good request is unaffected.
    outs = {o.request_id: o for o in eng.run([Request(BAD, _greedy(), request_id="bad"),
                                              Request(GOOD, _greedy(), arrival=1, request_id="good")])}
    assert not outs["bad"].ok and "259 at position 16" in outs["bad"].error and "vocab_size=259" in outs["bad"].error
    good = outs["good"]
    assert good.ok and good.stats.cached_prompt_tokens == 0
    assert good.tokens == clean.tokens
    assert good.logprobs == clean.logprobs  # exact, not approximately
    assert eng.stats().rejected == 1
    assert not bool(jnp.any(jnp.isnan(eng.pages)))


def test_bypassed_host_check_leaves_no_nan_and_no_poisoned_cache(model, clean, monkeypatch):
    """Host validation bypassed (as a caller feeding the jitted step directly would): the bad
    request runs, but its id is looked up as ``SAFE_TOKEN``, so no NaN reaches the pages, the
    valid prefix block it registers holds correct K/V, and the later good request that hits it
    gets its clean tokens, and exactly the answer it gets after a valid twin (``SAFE_TOKEN`` in
    place of 259)."""
    def run_pair(first_prompt):
        eng = ServingEngine(model, CFG)
        first = Request(tuple(PREFIX) + (SAFE_TOKEN,), _greedy(), request_id="first")
        object.__setattr__(first, "prompt", tuple(first_prompt))  # skips Request's checks
        outs = {o.request_id: o for o in eng.run([first, Request(GOOD, _greedy(), arrival=20, request_id="good")])}
        assert not bool(jnp.any(jnp.isnan(eng.pages)))
        return eng, outs

    twin_eng, twin = run_pair(PREFIX + [SAFE_TOKEN])
    monkeypatch.setattr(ServingEngine, "check", lambda self, request: None)  # bypass the host check
    eng, outs = run_pair(BAD)
    assert outs["first"].ok  # it ran: only the jitted guards protected the pages
    assert eng.stats().bad_tokens == 1  # and the step said so
    good = outs["good"]
    assert good.stats.cached_prompt_tokens == 16  # the prefix block the bad request registered
    assert good.tokens == clean.tokens
    assert good.tokens == twin["good"].tokens and good.logprobs == twin["good"].logprobs
    assert outs["first"].tokens == twin["first"].tokens


# ---------------------------------------------------------------------------- end to end, generate
def test_generate_and_beam_search_under_jit_flag_bad_rows():
    """The jitted loops called directly (no host check, as inside a caller's jit): a prompt with id
    259 is skipped and flagged, nothing of it is cached or written, no NaN reaches the pages;
    garbage in the padding of a good prompt changes nothing; the good prompt's answer equals its
    clean run exactly."""
    from flax import nnx
    model = init_model(tiny(vocab_size=VOCAB, num_layers=1), seed=0, init_std=0.2)  # one layer: quick to compile
    graphdef, weights = nnx.split(model)
    params = SamplingParams(max_new_tokens=4)
    ctx = GEN_MGR.max_tokens_per_seq

    def run_generate(toks, lens, pages, state):
        return gen_mod.generate_jit(graphdef, weights, pages, state, jnp.asarray(toks), jnp.asarray(lens),
                                    jnp.full((2,), 4, jnp.int32), jax.random.key(0), manager=GEN_MGR, params=params,
                                    impl="reference", chunk_size=32, context=ctx)

    def fresh():
        return allocate_pages(page_spec(model.config, GEN_MGR.num_blocks, GEN_MGR.block_size)), pk.init_state(GEN_MGR)

    toks, lens = pad_prompts([GOOD, [1, 2, 3]], width=32)
    ref, _, _ = run_generate(toks, lens, *fresh())

    bad_toks, bad_lens = pad_prompts([BAD, GOOD], width=32)
    bad_toks[1, len(GOOD):] = 300  # padding garbage in the good row: not checked, looked up safely
    pages, state = fresh()
    cache_before = np.asarray(state.cache.slot)
    out, pages, state = run_generate(bad_toks, bad_lens, pages, state)
    assert out.finish_reason[:, 0].tolist() == [FinishReason.BAD_TOKEN, FinishReason.LENGTH]
    assert out.lengths[0, 0] == 0 and (np.asarray(out.tokens[0]) == -1).all()
    assert not bool(jnp.any(jnp.isnan(pages)))
    np.testing.assert_array_equal(np.asarray(out.tokens[1]), np.asarray(ref.tokens[0]))
    np.testing.assert_array_equal(np.asarray(out.logprobs[1]), np.asarray(ref.logprobs[0]))
    # Only the good prompt's full block was cached (the bad prompt was never admitted).
    assert int(np.sum(np.asarray(state.cache.slot) >= 0)) - int(np.sum(cache_before >= 0)) == 1
    assert int(pk.num_free_blocks(GEN_MGR, state)) == GEN_MGR.num_blocks - 1

    # Beam search (without prefix caching: half the compile time; the flag does not depend on it).
    mgr = dataclasses.replace(GEN_MGR, prefix_caching=False)
    beams, pages, state = beam_mod.beam_search_jit(
        graphdef, weights, pages, pk.init_state(mgr), jnp.asarray(bad_toks), jnp.asarray(bad_lens), manager=mgr,
        params=BeamParams(beam_width=2, max_new_tokens=3), impl="reference", chunk_size=32, context=ctx)
    assert beams.bad_tokens.tolist() == [True, False]
    assert beams.out_of_blocks.tolist() == [False, False]
    assert beams.lengths[0].tolist() == [0, 0] and beams.lengths[1, 0] > 0
    assert not bool(jnp.any(jnp.isnan(pages)))
    assert int(pk.num_free_blocks(mgr, state)) == mgr.num_blocks - 1
