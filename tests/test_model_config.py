"""LlamaConfig validation, HF conversion, presets, RoPE frequencies, KV page sizing, CUDA lowering at
Llama 3.1 8B / 3.2 1B shapes."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from paged_kv.models import (
    KVPageSpec,
    LlamaConfig,
    PagedBatch,
    abstract_model,
    allocate_pages,
    kv_bytes_per_block,
    kv_bytes_per_token,
    llama31_8b,
    llama32_1b,
    page_spec,
    page_spec_for_budget,
    paged_decode_step,
    paged_prefill_step,
    rope_inv_freq,
    tiny,
)
from paged_kv.pallas_kernels.jax_compat import export_cuda
from tests import tolerances as tol

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize("changes, message", [
    (dict(vocab_size=0), "vocab_size=0 must be an int >= 1"),
    (dict(num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
    (dict(head_dim=15), "head_dim=15 must be an even int"),
    (dict(dtype="float16"), "dtype='float16' must be one of"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps=0.0 must be"),
    (dict(rope_theta=1.0), "rope_theta=1.0 must be"),
    (dict(eos_token_ids=(999,)), "special token id 999 must be in \\[0, vocab_size=256\\)"),
    (dict(layer_windows=(8,)), "layer_windows=\\(8,\\) must hold num_layers=2 ints >= 0"),
    (dict(layer_windows=(8, -1)), "layer_windows=\\(8, -1\\) must hold num_layers=2 ints >= 0"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' must be one of"),
    (dict(attn_soft_cap=0.0), "attn_soft_cap=0.0 must be None or a finite float > 0"),
    (dict(rope_local_theta=1.0), "rope_local_theta=1.0 must be None or a finite float > 1"),
])
def test_validation(changes, message):
    with pytest.raises(ValueError, match=message):
        tiny(**changes)


def test_rope_scaling_validation():
    from paged_kv.models import Llama3RopeScaling
    with pytest.raises(ValueError, match="high_freq_factor=1.0 must be > low_freq_factor=2.0"):
        Llama3RopeScaling(factor=8.0, low_freq_factor=2.0, high_freq_factor=1.0)


def test_frozen_and_hashable():
    cfg = tiny()
    assert hash(cfg) == hash(tiny()) and cfg == tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3
    assert cfg.head_dim == 16 and cfg.num_groups == 2


@pytest.mark.parametrize("make", [tiny, llama31_8b, llama32_1b,
                                  lambda: tiny(rope_scaling=None, tie_word_embeddings=True)])
def test_hf_config_round_trip(make):
    cfg = make()
    assert LlamaConfig.from_hf_config(cfg.to_hf_config()) == cfg
    # Through transformers' own config class (which rewrites RoPE into `rope_parameters`).
    hf = transformers.LlamaConfig(**cfg.to_hf_config()).to_dict()
    assert LlamaConfig.from_hf_config(hf, dtype=cfg.dtype) == cfg


def test_presets_shapes():
    big, small = llama31_8b(), llama32_1b()
    assert 8.0e9 < big.num_params() < 8.1e9  # 8.03 B
    assert 1.2e9 < small.num_params() < 1.3e9  # 1.24 B
    assert big.num_groups == 4 and small.tie_word_embeddings


def test_kv_bytes_llama31_8b():
    cfg = llama31_8b()
    assert kv_bytes_per_token(cfg) == 128 * KiB
    assert kv_bytes_per_block(cfg, 16) == 2 * MiB
    assert kv_bytes_per_token(cfg, "float32") == 256 * KiB
    assert kv_bytes_per_token(llama32_1b()) == 32 * KiB
    spec = page_spec_for_budget(cfg, block_size=16, budget_bytes=16 * GiB + MiB)
    assert spec.num_blocks == 8192 and spec.bytes_per_block == 2 * MiB
    assert spec.total_bytes == 16 * GiB and spec.usable_tokens == 8191 * 16
    assert spec.shape == (32, 2, 8, 8192, 16, 128)


def test_budget_from_device_fraction():
    class FakeDevice:
        def memory_stats(self):
            return {"bytes_limit": 140 * GiB}

    spec = page_spec_for_budget(llama31_8b(), memory_fraction=0.5, device=FakeDevice())
    assert spec.num_blocks == 35 * 1024

    class NoStats:
        def memory_stats(self):
            return None

    with pytest.raises(ValueError, match="reports no memory limit"):
        page_spec_for_budget(llama31_8b(), memory_fraction=0.5, device=NoStats())
    with pytest.raises(ValueError, match="holds 1 blocks"):
        page_spec_for_budget(llama31_8b(), budget_bytes=3 * MiB)
    with pytest.raises(ValueError, match="exactly one"):
        page_spec_for_budget(llama31_8b())


def test_allocate_pages():
    pages = allocate_pages(page_spec(tiny(dtype="bfloat16"), 5, 8))
    assert pages.shape == (2, 2, 2, 5, 8, 16) and pages.dtype == jnp.bfloat16
    assert not np.asarray(pages, np.float32).any()
    with pytest.raises(ValueError, match="num_blocks=1 must be >= 2"):
        KVPageSpec(2, 2, 16, 1, 8, "float32")


WINDOWED = {  # transformers' config class of a family, and a small config of it with sliding windows
    "mistral": (transformers.MistralConfig, dict(sliding_window=12)),
    "qwen2": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=12, max_window_layers=2)),
    "gemma2": (transformers.Gemma2Config, dict(sliding_window=12, head_dim=16)),
    "gemma3_text": (transformers.Gemma3TextConfig, dict(sliding_window=12, head_dim=16, sliding_window_pattern=3,
                                                        rope_scaling={"rope_type": "linear", "factor": 8.0})),
}
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_windowed_hf_config_round_trip(family):
    """Each family's windows as transformers lays them out (`layer_types` after its own
    derivation), and our `to_hf_config` read back by transformers' class into the same config."""
    config_cls, extra = WINDOWED[family]
    hf = config_cls(**SMALL, **extra)
    cfg = LlamaConfig.from_hf_config(hf.to_dict())
    layer_types = getattr(hf, "layer_types", None) or ["sliding_attention"] * 4  # Mistral: every layer
    want = tuple(hf.sliding_window if t == "sliding_attention" else 0 for t in layer_types)
    assert cfg.layer_windows == want and any(want) and (family == "mistral" or not all(want))
    # As Hub configs written before `layer_types` existed: the family's own rule gives the layers.
    legacy = {k: v for k, v in hf.to_dict().items() if k != "layer_types"}
    if family == "gemma3_text":
        legacy["sliding_window_pattern"] = 3
    assert LlamaConfig.from_hf_config(legacy).layer_windows == want
    assert LlamaConfig.from_hf_config(config_cls(**cfg.to_hf_config()).to_dict()) == cfg


def test_window_patterns_transformers_cannot_express_are_refused():
    with pytest.raises(ValueError, match="Mistral slides on every layer or none"):
        tiny(model_type="mistral", rope_scaling=None, layer_windows=(8, 0)).to_hf_config()
    with pytest.raises(ValueError, match="one sliding_window for all its sliding layers"):
        tiny(model_type="mistral", rope_scaling=None, layer_windows=(8, 16)).to_hf_config()
    with pytest.raises(ValueError, match="has no sliding window"):
        tiny(layer_windows=(8, 0)).to_hf_config()


def test_gemma3_local_and_global_rope_match_transformers():
    """Gemma 3's two RoPE tables: the local layers' base without scaling, the global layers' base
    with linear scaling (transformers' `Gemma3RotaryEmbedding` per layer type)."""
    config_cls, extra = WINDOWED["gemma3_text"]
    hf = config_cls(**SMALL, **{**extra, "rope_local_base_freq": 500.0})
    cfg = LlamaConfig.from_hf_config(hf.to_dict())
    emb = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(hf)
    for local, layer_type in ((False, "full_attention"), (True, "sliding_attention")):
        ref = getattr(emb, f"{layer_type}_inv_freq").numpy()
        rtol = tol.rope_inv_freq_rtol(None) + (0 if local else tol.eps(jnp.float32))  # + the division by the factor
        np.testing.assert_allclose(rope_inv_freq(cfg, local=local), ref, rtol=rtol, atol=0)
    assert cfg.local_rope == (True, True, False, True)


@pytest.mark.parametrize("make", [llama31_8b, llama32_1b, tiny, lambda: tiny(rope_scaling=None)])
def test_rope_inv_freq_matches_transformers(make):
    cfg = make()
    hf_cfg = transformers.LlamaConfig(**cfg.to_hf_config())
    rope_type = hf_cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        theta = hf_cfg.rope_parameters["rope_theta"]
        ref = 1.0 / (theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    # Two float32 computations of one formula: the rounding bound of tests/tolerances.py.
    np.testing.assert_allclose(rope_inv_freq(cfg), ref.numpy(), rtol=tol.rope_inv_freq_rtol(cfg.rope_scaling), atol=0)


@pytest.mark.parametrize("make, step, tokens", [(llama31_8b, "decode", 1), (llama32_1b, "prefill", 16)])
def test_preset_step_lowers_for_cuda_with_pallas(make, step, tokens):
    """The jitted paged step at real Llama shapes traces with abstract weights and pages (nothing
    allocated) and exports for CUDA with the KV write, the attention and the projections as
    Triton kernels, inside one scan over the layers (one traced body, whatever the depth)."""
    cfg = make()
    graphdef, state = nnx.split(abstract_model(cfg))
    b, m = 4, 64
    spec = page_spec(cfg, 1024, 16)
    pages = jax.ShapeDtypeStruct(spec.shape, jnp.bfloat16)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    batch = PagedBatch(block_tables=i32(b, m), q_start=i32(b), q_lens=i32(b), slots=i32(b, tokens), lengths=i32(b))
    toks = i32(b) if step == "decode" else i32(b, tokens)
    fn = paged_decode_step if step == "decode" else paged_prefill_step
    exp = export_cuda(lambda st, p, bt, tk: fn(graphdef, st, p, bt, tk, impl="pallas"), state, pages, batch, toks)
    text = exp.mlir_module()
    # One Triton kernel per kind, shared by every layer (the kernels take the layer as an operand):
    # write_kv, the attention, and the projections' layer_matmul, one per distinct tile and
    # prologue/epilogue (q|k|v and gate|up each one grouped launch; o and down their own). The
    # scan's body is traced once: each kernel is called from it once.
    attention = "paged_decode_attention_pallas" if step == "decode" else "paged_prefill_attention_pallas"
    assert "stablehlo.while" in text
    for kernel in ("write_kv_pallas", attention):
        assert len(re.findall(rf"\bcall @{kernel}\(", text)) == 1, kernel
    matmuls = len(re.findall(r"\bcall @layer_matmul_pallas\w*\(", text))
    assert matmuls == 4, matmuls  # q|k|v, o, gate|up, down
    assert 2 < text.count("__gpu$xla.gpu.triton") <= 2 + 4
    logits, new_pages = exp.out_avals
    want = (b, cfg.vocab_size) if step == "decode" else (b, tokens, cfg.vocab_size)
    assert logits.shape == want and logits.dtype == jnp.float32
    assert new_pages.shape == spec.shape and new_pages.dtype == jnp.bfloat16
