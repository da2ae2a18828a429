"""The Flax Llama against transformers' LlamaForCausalLM (PyTorch, CPU) on the same random weights.

transformers writes the checkpoint (`save_pretrained(..., safe_serialization=True)`), our loader reads
it. Relative error = max |ours - HF| / max |HF| over all prompt logits.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from paged_kv.models import (
    allocate_pages,
    contiguous_step,
    greedy_generate_contiguous,
    greedy_generate_paged,
    init_contiguous_cache,
    load_hf_checkpoint,
    page_spec,
    save_hf_checkpoint,
)
from tests import tolerances as tol
from tests.model_helpers import paged_prefill_logits

# A fast check of this area on every supported JAX (CI runs it on the oldest pair too).
pytestmark = pytest.mark.smoke

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

CASES = {
    # GQA (4 query heads over 2 KV heads), llama3 RoPE scaling, untied head.
    "gqa_llama3": dict(num_attention_heads=4, num_key_value_heads=2, rope_scaling=LLAMA3_ROPE,
                       rope_theta=10_000.0, tie_word_embeddings=False),
    # MHA, plain RoPE, tied embeddings.
    "mha_plain_tied": dict(num_attention_heads=4, num_key_value_heads=4, rope_scaling=None,
                           rope_theta=10_000.0, tie_word_embeddings=True),
}
PROMPT_LEN = 24
NEW_TOKENS = 32
BLOCK = 8


def _hf_model(case: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **CASES[case])
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    hf = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return request.param, hf, load_hf_checkpoint(path), path


def _prompts(b=2, n=PROMPT_LEN, seed=1):
    return np.random.RandomState(seed).randint(0, 256, (b, n)).astype(np.int32)


def _rel_err(ours, ref):
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def test_config_read_from_checkpoint(pair):
    case, hf, model, _ = pair
    cfg = model.config
    assert cfg.num_kv_heads == CASES[case]["num_key_value_heads"]
    assert cfg.tie_word_embeddings == CASES[case]["tie_word_embeddings"]
    assert (cfg.rope_scaling is None) == (CASES[case]["rope_scaling"] is None)
    assert cfg.dtype == "float32"


def test_prompt_logits_match(pair):
    case, hf, model, _ = pair
    toks = _prompts()
    with torch.no_grad():
        ref = hf(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    graphdef, state = nnx.split(model)
    b, t = toks.shape
    # Contiguous path, the whole prompt in one chunk.
    cache = init_contiguous_cache(model.config, b, 32)
    ours, _ = contiguous_step(graphdef, state, cache, jnp.asarray(toks), jnp.zeros(b, jnp.int32),
                              jnp.full(b, t, jnp.int32))
    err_contig = _rel_err(np.asarray(ours), ref)
    # Paged path, the prompt in 3 prefill chunks of 8 tokens.
    err_paged = _rel_err(paged_prefill_logits(model, toks, BLOCK), ref)
    # Two float32 computations of the same function (tests/tolerances.py): float32 eps times the
    # reduction lengths along the model, relative to the logits' scale.
    rtol = tol.model_atol(model.config, t, 1.0, score_mag=tol.score_bound(model))
    print(f"{case}: relative error contiguous {err_contig:.2e}, paged {err_paged:.2e}, bound {rtol:.2e}")
    assert err_contig <= rtol
    assert err_paged <= rtol


def test_greedy_tokens_match(pair):
    case, hf, model, _ = pair
    toks = _prompts()
    with torch.no_grad():
        out = hf.generate(torch.tensor(toks, dtype=torch.long), attention_mask=torch.ones(toks.shape, dtype=torch.long),
                          do_sample=False, max_new_tokens=NEW_TOKENS,
                          pad_token_id=0)
    ref = out[:, PROMPT_LEN:].numpy()
    assert ref.shape == (2, NEW_TOKENS)
    assert len(set(ref.ravel().tolist())) > 8, "degenerate reference continuation"
    need = -(-(PROMPT_LEN + NEW_TOKENS) // BLOCK)
    pages = allocate_pages(page_spec(model.config, 1 + 2 * need, BLOCK))
    tables = np.random.RandomState(2).permutation(np.arange(1, 1 + 2 * need)).reshape(2, need).astype(np.int32)
    paged, _, _ = greedy_generate_paged(model, pages, tables, toks.tolist(), NEW_TOKENS, chunk_size=BLOCK,
                                        impl="reference")
    contig, _ = greedy_generate_contiguous(model, toks.tolist(), NEW_TOKENS, chunk_size=BLOCK)
    np.testing.assert_array_equal(paged, ref)
    np.testing.assert_array_equal(contig, ref)


def test_transformers_reads_our_checkpoint(pair, tmp_path):
    """save_hf_checkpoint writes a directory transformers loads into the same function."""
    case, hf, model, _ = pair
    save_hf_checkpoint(model, tmp_path)
    hf2 = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    toks = torch.tensor(_prompts(1, 12, seed=3), dtype=torch.long)
    with torch.no_grad():
        np.testing.assert_array_equal(hf2(toks).logits.numpy(), hf(toks).logits.numpy())
    with open(tmp_path / "config.json") as fh:
        assert json.load(fh)["architectures"] == ["LlamaForCausalLM"]
