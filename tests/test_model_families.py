"""Llama-shaped families (paged_kv.models.config.FAMILIES) against transformers' own classes, on random
float32 weights: Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm, explicit head_dim), Mistral
(a sliding window that covers the whole context) and Llama with attention and MLP biases; and the
sliding-window families, whose windows (8 to 16 tokens, against 24-token prompts and 32 new
tokens: several windows) the paged and contiguous attention apply per layer: Mistral with a
window, Qwen2 with `use_sliding_window` from layer 1 on, Gemma 2 (alternating local and global
layers, soft caps, GeGLU, sandwich norms) and Gemma 3 (q/k norms, a local RoPE base, linear
scaling on the global layer).

Each family: transformers writes the checkpoint (single file and sharded), our loader reads it;
prompt logits within the float32 bound of tests/tolerances.py (as tests/test_model_hf_parity.py);
32 greedy tokens through the paged cache equal `transformers.generate`'s, on one device and with
tensor parallelism at tp=2 on two host devices (a subprocess, tests/families_worker.py, since the
device count is fixed when JAX starts); our `save_hf_checkpoint` (sharded) loads back into
transformers as the same function.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from paged_kv.models import (
    LinearRopeScaling,
    LlamaConfig,
    allocate_pages,
    greedy_generate_paged,
    load_hf_checkpoint,
    page_spec,
    per_layer,
    save_hf_checkpoint,
)
from paged_kv.models.contiguous import plain_forward
from tests import tolerances as tol
from tests.model_helpers import paged_prefill_logits

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "families_worker.py"
TIMEOUT_S = 420  # generous: the CPU is shared; normally the worker takes well under a minute

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2,
              rope_theta=10_000.0, bos_token_id=None, eos_token_id=None, pad_token_id=None)
CASES = {
    # Qwen2.5-like: q/k/v biases, tied embeddings (as the 0.5B); one KV head, so tp=2 replicates
    # it (and its k/v biases).
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True, use_sliding_window=False, num_key_value_heads=1)),
    # Qwen3-like: head_dim 32 with hidden 64 and 4 heads (q is 128 wide), q/k norms, no bias.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=32, attention_bias=False, tie_word_embeddings=False)),
    # Mistral with its window at the context limit: full attention for every sequence it serves.
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(sliding_window=256, head_dim=16, tie_word_embeddings=False)),
    # Llama with every bias transformers offers.
    "llama_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    # Windows shorter than the context. Mistral: every layer; 10 keys (not a multiple of the block).
    "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM,
                       dict(sliding_window=10, head_dim=16, tie_word_embeddings=False)),
    # Qwen2: layer 0 full, layer 1 slides over 16 keys (two blocks).
    "qwen2_window": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                     dict(use_sliding_window=True, sliding_window=16, max_window_layers=1, tie_word_embeddings=False)),
    # Gemma 2: layer 0 local (8 keys), layer 1 global; a softmax scale off head_dim's (query_pre_attn_scalar),
    # attention and final soft caps low enough to bite on these logits. Untied (as Gemma 3 below): at
    # this size a tied head reads back the sqrt(d)-scaled embedding, and greedy decoding repeats a token.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                    final_logit_softcapping=6.0, tie_word_embeddings=False)),
    # Gemma 3 (text): three layers, two local (12 keys, base 100) and a global one (base 10000, linear
    # scaling 4), q/k norms.
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(num_hidden_layers=3, head_dim=16, sliding_window=12, sliding_window_pattern=3,
                    query_pre_attn_scalar=24, rope_theta=10_000.0, rope_local_base_freq=100.0,
                    rope_scaling={"rope_type": "linear", "factor": 4.0}, tie_word_embeddings=False)),
}
EXPECTED = {  # the switches our config must read from each
    "qwen2": dict(model_type="qwen2", qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen3": dict(model_type="qwen3", qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, head_dim=32),
    "mistral": dict(model_type="mistral", qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "llama_bias": dict(model_type="llama", qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=False),
    "mistral_window": dict(model_type="mistral", layer_windows=(10, 10)),
    "qwen2_window": dict(model_type="qwen2", qkv_bias=True, layer_windows=(0, 16)),
    "gemma2": dict(model_type="gemma2", layer_windows=(8, 0), hidden_act="gelu_pytorch_tanh", norm_offset=True,
                   sandwich_norm=True, embed_scale=True, qk_norm=False, query_pre_attn_scalar=24.0, attn_soft_cap=3.0,
                   final_soft_cap=6.0, rope_local_theta=None),
    "gemma3": dict(model_type="gemma3_text", layer_windows=(12, 12, 0), local_rope=(True, True, False),
                   hidden_act="gelu_pytorch_tanh", norm_offset=True, sandwich_norm=True, embed_scale=True,
                   qk_norm=True, attn_soft_cap=None, final_soft_cap=None, rope_local_theta=100.0, rope_theta=10_000.0,
                   rope_scaling=LinearRopeScaling(4.0)),
}
PROMPT_LEN, NEW_TOKENS, BLOCK = 24, 32, 8


def _hf_model(case: str, seed: int = 0):
    config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**COMMON, **extra})).eval()
    # transformers initialises biases to 0 and norm scales to 1 (Gemma's (1 + w): w to 0): draw
    # them, so that a bias or a norm scale applied in the wrong place (or not at all) changes the logits.
    unit = 0.0 if case.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.copy_(unit + 0.1 * torch.randn_like(p))
    return model


def _prompts(b=2, n=PROMPT_LEN, seed=1):
    return np.random.RandomState(seed).randint(0, 256, (b, n)).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{case: (hf model, checkpoint dir written by transformers)}."""
    out = {}
    for case in CASES:
        hf = _hf_model(case)
        path = tmp_path_factory.mktemp(case)
        hf.save_pretrained(path, safe_serialization=True)
        out[case] = (hf, path)
    return out


@pytest.fixture(scope="module")
def references(checkpoints):
    """{case: transformers' 32 greedy tokens [2, 32] on the shared prompts}."""
    toks = _prompts()
    refs = {}
    for case, (hf, _) in checkpoints.items():
        with torch.no_grad():
            out = hf.generate(torch.tensor(toks, dtype=torch.long),
                              attention_mask=torch.ones(toks.shape, dtype=torch.long),
                              do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
        refs[case] = out[:, PROMPT_LEN:].numpy()
        assert len(set(refs[case].ravel().tolist())) > 8, f"{case}: degenerate reference continuation"
    return refs


@pytest.fixture(scope="module")
def tp2(checkpoints, tmp_path_factory):
    """The tp=2 worker, started as soon as the checkpoints exist (it runs while the other tests do);
    yields a function that waits for its RESULT."""
    spec = tmp_path_factory.mktemp("tp2") / "spec.json"
    spec.write_text(json.dumps({"checkpoints": {c: str(p) for c, (_, p) in checkpoints.items()},
                                "prompts": _prompts().tolist(), "new_tokens": NEW_TOKENS, "block_size": BLOCK}))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.Popen([sys.executable, str(WORKER), str(spec)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + TIMEOUT_S

    def result():
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pytest.fail(f"tp=2 worker did not finish within {TIMEOUT_S} s")
        assert proc.returncode == 0, f"tp=2 worker exited with {proc.returncode}:\n{out[-4000:]}"
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"no RESULT line in worker output:\n{out[-4000:]}"
        return json.loads(lines[-1][len("RESULT "):])

    yield result
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_switches(checkpoints, case, tp2):
    hf, path = checkpoints[case]
    cfg = LlamaConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    for field, value in EXPECTED[case].items():
        assert getattr(cfg, field) == value, (case, field)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())  # (a tied head counted once by both)


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_logits_match(checkpoints, case):
    hf, path = checkpoints[case]
    model = load_hf_checkpoint(path)
    toks = _prompts()
    with torch.no_grad():
        ref = hf(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    t = toks.shape[1]
    # Relative to the logits' magnitude; under a final soft cap (slope <= 1) the error is the
    # uncapped logits' error, relative to their magnitude (bounded from the weights).
    mag = tol.logits_bound(model) if model.config.final_soft_cap else float(np.abs(ref).max())
    err = float(np.abs(paged_prefill_logits(model, toks, BLOCK) - ref).max() / mag)
    rtol = tol.model_atol(model.config, t, 1.0, score_mag=tol.score_bound(model))
    print(f"{case}: relative error {err:.2e}, bound {rtol:.2e}")
    assert err <= rtol


def test_unrolled_per_layer_logits_match(checkpoints):
    """The unrolled forward (Python-int layer ids on the per-layer layout, what the Pallas kernels
    over a mesh run) hands each layer its own window and RoPE base as Python values: Gemma 3's
    logits there match transformers' within the same bound as the scan's."""
    hf, path = checkpoints["gemma3"]
    model = per_layer(load_hf_checkpoint(path))
    toks = _prompts()
    with torch.no_grad():
        ref = hf(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    err = float(np.abs(paged_prefill_logits(model, toks, BLOCK) - ref).max() / np.abs(ref).max())
    assert err <= tol.model_atol(model.config, toks.shape[1], 1.0, score_mag=tol.score_bound(model))


def test_tied_gemma_logits_match(tmp_path):
    """Gemma ties its head to the embedding (the checkpoints above are untied, see CASES): the
    head reads the stored embedding, not the sqrt(d)-scaled lookup. Gemma 3, tied, logits only."""
    config_cls, model_cls, extra = CASES["gemma3"]
    torch.manual_seed(5)
    hf = model_cls(config_cls(**{**COMMON, **extra, "tie_word_embeddings": True})).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_hf_checkpoint(tmp_path)
    assert model.config.tie_word_embeddings and not hasattr(model, "lm_head")
    toks = _prompts(b=2, n=16, seed=6)
    with torch.no_grad():
        ref = hf(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    err = float(np.abs(paged_prefill_logits(model, toks, BLOCK) - ref).max() / np.abs(ref).max())
    assert err <= tol.model_atol(model.config, toks.shape[1], 1.0, score_mag=tol.score_bound(model))


def test_geglu_is_transformers_tanh_gelu(checkpoints):
    """Gemma's MLP activation is transformers' `gelu_pytorch_tanh`: the exact erf GELU differs from
    it by at most ~5e-4, below what the whole model's rounding bound can tell apart, so the MLP
    is run here with 0/1 weights (exact products) that make its output `gelu(x) * x` per unit."""
    from transformers.activations import ACT2FN

    from paged_kv.models.llama import LayerAccess

    _, path = checkpoints["gemma2"]
    mlp = load_hf_checkpoint(path).layer(0).mlp
    eye = np.eye(64, 128, dtype=np.float32)  # unit i of the MLP reads x_i (gate and up), down returns it
    mlp.gate[...], mlp.up[...], mlp.down[...] = eye, eye, eye.T
    x = np.linspace(-6.0, 6.0, 64, dtype=np.float32)[None, None]
    got = np.asarray(mlp(jax.numpy.asarray(x), None, LayerAccess(0)))
    with torch.no_grad():
        ref = (ACT2FN["gelu_pytorch_tanh"](torch.tensor(x)) * torch.tensor(x)).numpy()
    # Two float32 evaluations of 0.5 x (1 + tanh(...)) times x: 12 operations each
    # (tests/tolerances.py), each off by u relative to a value of magnitude at most x^2 (the sum
    # 1 + tanh is off absolutely, and near 0 for negative x). The erf GELU is off by up to 1e-3 here.
    assert np.all(np.abs(got - ref) <= 2 * 12 * tol.eps(np.float32) * x * x)


def test_batch_invariant_plain_forward_matches(checkpoints):
    """`plain_forward` in its batch-invariant mode (fixed-order norms, fixed-tile projections, the
    invariant attention steps with the window) on Gemma 2, whose every switch runs there too:
    (1 + w) norms, windows, soft caps. Within the parity bound of transformers' logits."""
    hf, path = checkpoints["gemma2"]
    model = load_hf_checkpoint(path)
    toks = _prompts()
    with torch.no_grad():
        ref = hf(torch.tensor(toks, dtype=torch.long)).logits.numpy()
    got = np.asarray(plain_forward(model, jax.numpy.asarray(toks), batch_invariant=True))
    err = float(np.abs(got - ref).max() / tol.logits_bound(model))
    assert err <= tol.model_atol(model.config, toks.shape[1], 1.0, score_mag=tol.score_bound(model))


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_match_paged(checkpoints, references, case):
    _, path = checkpoints[case]
    model = load_hf_checkpoint(path)
    need = -(-(PROMPT_LEN + NEW_TOKENS) // BLOCK)
    pages = allocate_pages(page_spec(model.config, 1 + 2 * need, BLOCK))
    tables = np.random.RandomState(2).permutation(np.arange(1, 1 + 2 * need)).reshape(2, need).astype(np.int32)
    paged, _, _ = greedy_generate_paged(model, pages, tables, _prompts().tolist(), NEW_TOKENS, chunk_size=BLOCK,
                                        impl="reference")
    np.testing.assert_array_equal(paged, references[case])


def test_greedy_tokens_match_tp2(references, tp2):
    res = tp2()
    for case in CASES:
        assert res[case]["devices"] == 2
        np.testing.assert_array_equal(np.asarray(res[case]["tokens"]), references[case], err_msg=case)
        # Sliced loading onto the mesh equals loading whole and placing (shard_model), leaf for leaf.
        assert res[case]["same_as_shard_model"], case
    assert res["qwen2"]["placed_kv_heads"] == 2  # its one KV head (and k/v biases) replicated over tp=2


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_checkpoints_both_ways(checkpoints, case, tmp_path):
    """transformers' sharded save loads into the same weights as its single file; our sharded save
    loads back into transformers' class as the same function."""
    hf, path = checkpoints[case]
    single = load_hf_checkpoint(path)
    hf.save_pretrained(tmp_path / "hf_sharded", safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "hf_sharded" / "model.safetensors.index.json").is_file()
    sharded = load_hf_checkpoint(tmp_path / "hf_sharded")
    assert sharded.config == single.config
    for a, b in zip(jax.tree.leaves(nnx.state(single)), jax.tree.leaves(nnx.state(sharded))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    save_hf_checkpoint(single, tmp_path / "ours", max_shard_bytes=40_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    _, model_cls, _ = CASES[case]
    hf2 = model_cls.from_pretrained(tmp_path / "ours").eval()
    toks = torch.tensor(_prompts(1, 12, seed=3), dtype=torch.long)
    with torch.no_grad():
        np.testing.assert_array_equal(hf2(toks).logits.numpy(), hf(toks).logits.numpy())
