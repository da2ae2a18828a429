"""Bring your own model: the GPT-2 of examples/gpt2.py through the model protocol.

It runs the contiguous and paged forwards, engine.generate (greedy, sampled, n > 1) and
beam_search, and matches transformers' GPT2LMHeadModel on the same weights; its ServingEngine run
with preemption is tests/test_docs_own_model.py, on the page's example. Non-conforming models fail
with a ValueError naming the missing member before anything compiles; attend options reach the
paged and contiguous attention alike. One tiny float32 model and one ManagerConfig for the whole
module, so each loop compiles once."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import paged_kv as pk
from examples.gpt2 import from_transformers
from paged_kv import engine
from paged_kv.engine import BeamParams, SamplingParams, ServingConfig, ServingEngine
from paged_kv.models import (
    allocate_pages,
    contiguous_step,
    greedy_generate_contiguous,
    greedy_generate_paged,
    init_contiguous_cache,
    make_paged_batch,
    page_spec,
    paged_decode_step,
    paged_prefill_step,
    sharding,
)
from paged_kv.models.protocol import ModelFacts, model_facts
from tests import tolerances as tol
from tests.model_helpers import KNOB_PROMPTS, KnobModel
from tests.test_engine_beam import reference_beam_search

VOCAB, BS, PROMPT, NEW = 96, 8, 12, 32
MGR = pk.ManagerConfig(num_blocks=48, block_size=BS, max_seqs=6, max_blocks_per_seq=8)
SERVING = ServingConfig(pk.ManagerConfig(num_blocks=10, block_size=BS, max_seqs=4, max_blocks_per_seq=6),
                        chunk_size=BS, max_prefill_rows=2, impl="reference")


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=None, eos_token_id=None)
    assert cfg.activation_function == "gelu_new"  # the tanh GELU of examples/gpt2.py
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def model(hf):
    return from_transformers(hf)


def _prompts(b=2, n=PROMPT, seed=1):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, n)).astype(np.int32)


def test_facts_and_page_sizing(model):
    assert model_facts(model) == ModelFacts(2, 4, 8, VOCAB, 64, "float32")
    assert model_facts(nnx.split(model)) == model_facts(model)
    assert page_spec(model, 10, BS).shape == (2, 2, 4, 10, BS, 8)


def test_logits_match_transformers(hf, model):
    toks = _prompts()
    with torch.no_grad():
        ref = hf(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    graphdef, state = nnx.split(model)
    b, t = toks.shape
    contig, _ = contiguous_step(graphdef, state, init_contiguous_cache(model, b, 16), jnp.asarray(toks),
                                jnp.zeros(b, jnp.int32), jnp.full(b, t, jnp.int32))
    pages = allocate_pages(page_spec(model, 8, BS))
    tables = jnp.asarray([[5, 2], [7, 3]], jnp.int32)
    chunks = []
    for start in range(0, t, BS):  # two prefill chunks, the second partly full
        n = min(BS, t - start)
        batch = make_paged_batch(tables, [start] * b, [n] * b, BS, BS)
        chunk = np.zeros((b, BS), np.int32)
        chunk[:, :n] = toks[:, start:start + n]
        logits, pages = paged_prefill_step(graphdef, state, pages, batch, jnp.asarray(chunk), impl="reference")
        chunks.append(np.asarray(logits)[:, :n])
    # Relative to the logits' scale, as for the Llama against transformers (tests/tolerances.py).
    rtol = tol.gpt2_atol(model, t, 1.0)
    scale = np.abs(ref).max()
    for name, ours in (("contiguous", np.asarray(contig)), ("paged", np.concatenate(chunks, 1))):
        assert np.abs(ours - ref).max() / scale <= rtol, name


def _contiguous_greedy(model, prompts, steps):
    """Greedy decoding over the model's own contiguous forward, always with batch 2 and a 64-slot
    cache so its two steps compile once for the module."""
    out = []
    for i in range(0, len(prompts), 2):
        pair = list(prompts[i:i + 2]) + [prompts[i]] * (i + 2 - len(prompts))
        out.extend(greedy_generate_contiguous(model, pair, steps, chunk_size=BS, max_len=64)[0][:len(prompts) - i])
    return np.stack(out)


@pytest.fixture(scope="module")
def hf_greedy(hf):
    toks = _prompts()
    with torch.no_grad():
        out = hf.generate(torch.tensor(toks, dtype=torch.long), attention_mask=torch.ones(toks.shape, dtype=torch.long),
                          do_sample=False, max_new_tokens=NEW, pad_token_id=0)
    ref = out[:, PROMPT:].numpy()
    assert len(set(ref.ravel().tolist())) > 8, "degenerate reference continuation"
    return toks, ref


def test_greedy_tokens_match_transformers_and_own_contiguous(model, hf_greedy):
    toks, ref = hf_greedy
    need = -(-(PROMPT + NEW) // BS)
    pages = allocate_pages(page_spec(model, 1 + 2 * need, BS))
    tables = np.random.RandomState(2).permutation(np.arange(1, 1 + 2 * need)).reshape(2, need).astype(np.int32)
    paged, _, _ = greedy_generate_paged(model, pages, tables, toks.tolist(), NEW, chunk_size=BS, impl="reference")
    np.testing.assert_array_equal(paged, _contiguous_greedy(model, toks.tolist(), NEW))
    np.testing.assert_array_equal(paged, ref)


def test_engine_generate_greedy_sampled_and_beam(model, hf_greedy):
    prompts, ref = hf_greedy
    toks, lens = engine.pad_prompts(prompts.tolist(), width=16)
    pages = allocate_pages(page_spec(model, MGR.num_blocks, MGR.block_size))
    out, pages, state = engine.generate(model, pages, toks, lens, 0, SamplingParams(max_new_tokens=NEW),
                                        manager=MGR, chunk_size=BS)
    np.testing.assert_array_equal(np.asarray(out.tokens[:, 0]), ref)  # = transformers' greedy tokens

    sampled = SamplingParams(max_new_tokens=10, n=3, temperature=1.0)
    runs = []
    for _ in range(2):
        out, pages, state = engine.generate(model, pages, toks, lens, jax.random.key(7), sampled, manager=MGR,
                                            state=state, chunk_size=BS)
        runs.append(np.asarray(out.tokens))
    np.testing.assert_array_equal(runs[0], runs[1])  # same key, same samples
    assert runs[0].shape == (2, 3, 10) and ((runs[0] >= 0) & (runs[0] < VOCAB)).all()
    assert len({tuple(r) for r in runs[0].reshape(6, 10).tolist()}) > 1  # the n samples differ
    assert int(pk.usage(MGR, state).used) == 0  # every block released

    k, steps = 2, 5
    beams, pages, state = engine.beam_search(model, pages, toks, lens, BeamParams(k, steps), manager=MGR,
                                             state=state, impl="reference", chunk_size=BS)
    for b, p in enumerate(prompts.tolist()):
        for j, (_, _, tokens) in enumerate(reference_beam_search(model, p, k, steps, 1.0, ())):
            np.testing.assert_array_equal(np.asarray(beams.tokens[b, j, :len(tokens)]), tokens)


# ---------------------------------------------------------------------------- non-conforming models
class NoHead(nnx.Module):
    """Facts, a forward, but no logits and no head_dim."""

    def __init__(self):
        self.num_layers, self.num_kv_heads, self.vocab_size, self.max_positions = 1, 1, 8, 16
        self.dtype = "float32"
        self.w = nnx.Param(jnp.ones((4,)))

    def __call__(self, tokens, positions, cache, attend):
        return jnp.zeros(tokens.shape + (4,)), cache


class BadOption(nnx.Module):
    """Conforming, but asks attend for an option paged-kv does not have."""

    def __init__(self):
        self.num_layers, self.num_kv_heads, self.head_dim, self.vocab_size, self.max_positions = 1, 1, 16, 8, 16
        self.dtype = "float32"
        self.w = nnx.Param(jnp.ones((16,)))

    def __call__(self, tokens, positions, cache, attend):
        q = jnp.ones(tokens.shape + (1, 16)) * self.w[...]
        out, cache = attend(0, q, q, q, cache, sliding_window=4)
        return out[:, :, 0], cache

    def logits(self, hidden):
        return hidden[..., :8]


def test_missing_members_are_named_before_compiling():
    bad = NoHead()
    with pytest.raises(ValueError,
                       match="NoHead does not implement the paged model protocol: missing logits, head_dim"):
        model_facts(bad)
    with pytest.raises(ValueError, match="missing logits, head_dim"):
        page_spec(bad, 4, BS)
    pages = jnp.zeros((1, 2, 1, 4, BS, 4))
    toks, lens = engine.pad_prompts([[1, 2]], width=4)
    for call in (lambda: engine.generate(bad, pages, toks, lens, 0, SamplingParams(max_new_tokens=2), manager=MGR),
                 lambda: engine.beam_search(bad, pages, toks, lens, BeamParams(2, 2), manager=MGR),
                 lambda: ServingEngine(bad, SERVING)):
        with pytest.raises(ValueError, match="missing logits, head_dim"):
            call()
    good_but_zero = BadOption()
    good_but_zero.num_layers = 0
    with pytest.raises(ValueError, match="num_layers=0 must be a Python int >= 1"):
        model_facts(good_but_zero)
    wrong_dtype = BadOption()
    wrong_dtype.dtype = "int8"
    with pytest.raises(ValueError, match="dtype='int8' must be one of"):
        model_facts(wrong_dtype)


def test_unsupported_attend_option_is_named():
    m = BadOption()
    pages = allocate_pages(page_spec(m, 4, BS))
    batch = make_paged_batch(jnp.ones((1, 1), jnp.int32), [0], [1], 1, BS)
    graphdef, state = nnx.split(m)
    with pytest.raises(ValueError, match="unsupported option.*sliding_window; supported: scale, soft_cap, alibi"):
        paged_decode_step(graphdef, state, pages, batch, jnp.zeros((1,), jnp.int32), impl="reference")
    with pytest.raises(ValueError, match="sliding_window"):
        contiguous_step(graphdef, state, init_contiguous_cache(m, 1, 4), jnp.zeros((1, 1), jnp.int32),
                        jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32))


def test_mesh_use_needs_partition_specs(model):
    """GPT-2 has no tensor-parallel rules: a mesh gives a clear error, never a wrong sharding."""
    mesh = sharding.make_mesh(1)
    pages = allocate_pages(page_spec(model, MGR.num_blocks, MGR.block_size))
    with pytest.raises(ValueError, match="GPT2 defines no partition_specs"):
        sharding.shard(model, pages, mesh)
    toks, lens = engine.pad_prompts([[1, 2, 3]], width=8)
    with pytest.raises(ValueError, match="GPT2 defines no partition_specs"):
        engine.generate(model, pages, toks, lens, 0, SamplingParams(max_new_tokens=2), manager=MGR, mesh=mesh)


# ---------------------------------------------------------------------------- attend options through the protocol
def _knob_atol(m: KnobModel, context: int, magnitude: float) -> float:
    """q/k/v projections over d = 32, attention (scores bounded from the weights: ``||q_h|| <=
    sigma(W_q,h) max ||e||`` and likewise ``k``, times the scale, plus the ALiBi bias), the head
    over 64 (tests/tolerances.py)."""
    e = float(np.sqrt((np.asarray(m.embed[...], np.float64) ** 2).sum(-1)).max())
    sig = [max(np.linalg.norm(np.asarray(w[...], np.float64)[:, h], 2) for h in range(w.shape[1]))
           for w in (m.wq, m.wk)]
    s = 0.4 * sig[0] * sig[1] * e * e + 0.5 * (context - 1)
    ops = tol.knob_score_ops(3.0, m.slopes[...])
    attn = 2 * (16 + 4 + ops) * s + 4 * context + 7
    return tol.chain_atol(jnp.float32, [32, attn, 64], magnitude)


def test_attend_options_reach_paged_and_contiguous_attention():
    """A model passing scale, soft_cap and alibi_slopes to ``attend``: paged greedy decoding (the
    XLA kernels, and the Pallas kernels in interpret mode for the prompt) equals its contiguous
    one, logits within the bound, and the options change the logits."""
    prompts = KNOB_PROMPTS
    runs = {}
    for knobs in (True, False):
        m = KnobModel(knobs)
        pages = allocate_pages(page_spec(m, 9, BS))
        tables = np.array([[4, 1], [7, 2]], np.int32)
        paged, paged_logits, _ = greedy_generate_paged(m, pages, tables, prompts, 6, chunk_size=BS, impl="reference")
        contig, contig_logits = greedy_generate_contiguous(m, prompts, 6, chunk_size=BS, max_len=16)
        np.testing.assert_array_equal(paged, contig)
        atol = _knob_atol(m, 13, float(np.abs(contig_logits).max()))
        tol.assert_close(paged_logits, contig_logits, atol, f"paged vs contiguous, knobs={knobs}")
        runs[knobs] = contig_logits, atol
    assert np.abs(runs[True][0] - runs[False][0]).max() > 100 * runs[True][1]

    m = KnobModel(True)
    graphdef, state = nnx.split(m)
    batch = make_paged_batch(jnp.array([[4, 1], [7, 2]], jnp.int32), [0, 0], [7, 5], BS, BS)
    toks = jnp.zeros((2, BS), jnp.int32).at[0, :7].set(jnp.array(prompts[0])).at[1, :5].set(jnp.array(prompts[1]))
    want, _ = paged_prefill_step(graphdef, state, allocate_pages(page_spec(m, 9, BS)), batch, toks, impl="reference")
    got, _ = paged_prefill_step(graphdef, state, allocate_pages(page_spec(m, 9, BS)), batch, toks, impl="interpret")
    tol.assert_close(np.asarray(got)[0, :7], np.asarray(want)[0, :7], _knob_atol(m, 7, float(np.abs(want).max())),
                     "interpret vs reference")
