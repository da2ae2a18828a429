"""Hugging Face checkpoint loading and saving: round trips and clear errors."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from paged_kv.models import CheckpointError, hf_state_dict, init_model, load_hf_checkpoint, save_hf_checkpoint, tiny


def _leaves(model):
    return jax.tree.leaves(nnx.state(model))


def _assert_same_weights(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.fixture(scope="module")
def model():
    return init_model(tiny(), seed=0)


@pytest.fixture
def ckpt(model, tmp_path):
    save_hf_checkpoint(model, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trip_is_exact(tmp_path, dtype, tied):
    m = init_model(tiny(dtype=dtype, tie_word_embeddings=tied), seed=1)
    save_hf_checkpoint(m, tmp_path)
    back = load_hf_checkpoint(tmp_path)
    assert back.config == m.config
    _assert_same_weights(back, m)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert ("lm_head.weight" in names) == (not tied)


def test_sharded_round_trip(model, tmp_path):
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    _assert_same_weights(load_hf_checkpoint(tmp_path), model)


def test_eos_ids_from_generation_config_first(ckpt):
    """The loaded model's EOS ids (what the engines stop at by default) are generation_config.json's
    when it sets them, as transformers.generate reads them, else config.json's; both loaders agree."""
    from paged_kv.models.hf_format import checkpoint_config

    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["eos_token_id"] = 7
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert load_hf_checkpoint(ckpt).eos_token_ids == (7,)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7, 9]}))
    assert load_hf_checkpoint(ckpt).config.eos_token_ids == (9, 7)
    assert checkpoint_config(ckpt)[1].eos_token_ids == (9, 7)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 300}))
    with pytest.raises(ValueError, match=r"generation_config.json eos_token_id=300: every id must be an int in "
                                         r"\[0, vocab_size=256\)"):
        load_hf_checkpoint(ckpt)


def test_load_with_dtype_override(ckpt, model):
    m16 = load_hf_checkpoint(ckpt, dtype="bfloat16")
    assert m16.config.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in _leaves(m16))


def test_hf_layout(model):
    sd = hf_state_dict(model)
    cfg = model.config
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (cfg.num_heads * cfg.head_dim, cfg.hidden_size)
    assert sd["model.layers.1.self_attn.k_proj.weight"].shape == (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (cfg.hidden_size, cfg.intermediate_size)
    q = np.asarray(model.layers.attn.q_proj[0])
    # HF row h * D + e of q_proj is query head h, dimension e.
    np.testing.assert_array_equal(sd["model.layers.0.self_attn.q_proj.weight"][1 * cfg.head_dim + 3], q[:, 1, 3])


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_checkpoint(tmp_path / "nope")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        load_hf_checkpoint(ckpt)


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        load_hf_checkpoint(ckpt)


def test_missing_shard(model, tmp_path):
    save_hf_checkpoint(model, tmp_path, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=f"missing safetensors shard '{shard}'"):
        load_hf_checkpoint(tmp_path)


def test_missing_tensor(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.up_proj.weight' is missing"):
        load_hf_checkpoint(ckpt)


def test_wrong_shape(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.k_proj.weight'.*shape \(16, 64\), "
                                              r"expected \(32, 64\)"):
        load_hf_checkpoint(ckpt)


def _edit_config(ckpt, **changes):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["GemmaForCausalLM"], model_type="gemma"), "unsupported model_type='gemma'"),
    (dict(architectures=["LlamaForSequenceClassification"]), "unsupported architectures"),
    (dict(architectures=["MistralForCausalLM"]), "unsupported architectures=['MistralForCausalLM'] for "
                                                "model_type='llama'"),
    (dict(hidden_act="gelu"), "unsupported hidden_act='gelu'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope_scaling.rope_type='yarn'"),
    (dict(rope_scaling=None, rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
     "unsupported rope_parameters.rope_type='dynamic'"),
    (dict(num_key_value_heads=3), "num_kv_heads=3 must divide num_heads=4"),
    # Sliding windows: served, but a layer pattern or window this decoder cannot compute is named.
    (dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", layer_types=["full_attention", "chunked"]),
     "unsupported layer_types entry 'chunked'"),
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True, sliding_window=8,
          layer_types=["sliding_attention"]), "layer_types has 1 entries, expected num_hidden_layers=2"),
    (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=0),
     "unsupported sliding_window=0: expected an int >= 1 or null"),
    # Gemma: what transformers' Gemma classes would compute differently.
    (dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3"), "unsupported model_type='gemma3'"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=8,
          use_bidirectional_attention=True),
     "unsupported use_bidirectional_attention=True"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_activation="gelu"),
     "unsupported hidden_activation='gelu': gemma2 runs gelu_pytorch_tanh only"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=None),
     "unsupported sliding_window=None with sliding_attention layers"),
    (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=8, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "unsupported rope_parameters.sliding_attention.rope_type='linear' for the sliding layers"),
    (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window=8,
          rope_scaling={"rope_type": "yarn"}),
     "unsupported rope_scaling.rope_type='yarn'"),
    (dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", sliding_window_pattern=0),
     "unsupported sliding_window_pattern=0"),
    # A Gemma config.json over Llama weights: Gemma's extra norms are missing.
    (dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", sliding_window=8),
     "'model.layers.0.pre_feedforward_layernorm.weight' is missing"),
    # The config and the weights disagree: biases the config asks for are not in the file.
    (dict(attention_bias=True), "'model.layers.0.self_attn.q_proj.bias' is missing"),
    (dict(torch_dtype="float16"), "unsupported checkpoint dtype 'float16'"),
])
def test_unsupported_config(ckpt, changes, message):
    _edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_hf_checkpoint(ckpt)


def test_copy_of_checkpoint_loads(ckpt, tmp_path, model):
    """Nothing but the directory's files is needed (no hub, no cache)."""
    dst = tmp_path / "copy"
    shutil.copytree(ckpt, dst)
    _assert_same_weights(load_hf_checkpoint(dst), model)


# ---------------------------------------------------------------------------- safety on load
def _no_compile(monkeypatch):
    """Fail the test if anything is jitted or placed on a device: every check comes first."""
    import paged_kv.models.hf_io as hf_io

    def boom(*a, **k):
        raise AssertionError("a weight was placed before every tensor was checked")
    monkeypatch.setattr(hf_io.jnp, "asarray", boom)


def test_weights_of_another_config(ckpt, model, tmp_path, monkeypatch):
    """config.json of one size, weights of another: the first tensor that differs is named."""
    other = tmp_path / "other"
    save_hf_checkpoint(init_model(tiny(hidden_size=32, intermediate_size=64)), other)
    shutil.copy(ckpt / "config.json", other / "config.json")
    _no_compile(monkeypatch)
    with pytest.raises(CheckpointError, match=r"tensor 'model.embed_tokens.weight' in 'model.safetensors' has "
                                              r"shape \(256, 32\), expected \(256, 64\)"):
        load_hf_checkpoint(other)


def _refused_after_edit(ckpt, monkeypatch, name, value, match):
    """Store ``value`` as tensor ``name`` of the checkpoint; loading must fail with ``match``
    before any weight is placed."""
    tensors = load_file(ckpt / "model.safetensors")
    tensors[name] = value(tensors) if callable(value) else value
    save_file(tensors, ckpt / "model.safetensors")
    _no_compile(monkeypatch)
    with pytest.raises(CheckpointError, match=match):
        load_hf_checkpoint(ckpt)


def test_tensor_the_config_does_not_use(ckpt, monkeypatch):
    """A bias in a Llama whose config says attention_bias false would be silently dropped."""
    _refused_after_edit(ckpt, monkeypatch, "model.layers.1.self_attn.k_proj.bias", np.zeros((32,), np.float32),
                        r"tensor 'model.layers.1.self_attn.k_proj.bias' in 'model.safetensors' "
                        r"is not a weight of this config \(model_type='llama', qkv_bias=False")


def test_wrong_dtype_named(ckpt, monkeypatch):
    name = "model.layers.0.mlp.gate_proj.weight"
    _refused_after_edit(ckpt, monkeypatch, name, lambda t: t[name].astype(np.float16),
                        r"'model.layers.0.mlp.gate_proj.weight' in 'model.safetensors' has "
                        r"dtype F16; config.json declares 'float32' \(F32\)")


def test_integer_tensor_refused(ckpt, monkeypatch):
    _refused_after_edit(ckpt, monkeypatch, "model.norm.weight", np.ones((64,), np.int8),
                        r"'model.norm.weight' in 'model.safetensors' has dtype I8")


def test_unknown_dtype_in_header(ckpt, monkeypatch):
    """A header naming a dtype safetensors does not know (a quantised format, say)."""
    import struct

    data = (ckpt / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header["model.norm.weight"]["dtype"] = "Q4_K"
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    _no_compile(monkeypatch)
    with pytest.raises(CheckpointError, match=r"safetensors file 'model.safetensors' of .* cannot be read .*Q4_K"):
        load_hf_checkpoint(ckpt)


@pytest.mark.parametrize("cut", [10, 1000])
def test_truncated_file(ckpt, cut, monkeypatch):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:-cut])
    _no_compile(monkeypatch)
    with pytest.raises(CheckpointError, match=r"safetensors file 'model.safetensors' .* cannot be read "
                                              r"\(truncated or corrupt\?\)"):
        load_hf_checkpoint(ckpt)


def test_truncated_shard_sharded_loader(model, tmp_path):
    """The tensor-parallel loader runs the same checks (here on a one-device mesh)."""
    from paged_kv.models import sharding

    save_hf_checkpoint(model, tmp_path, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    data = (tmp_path / shard).read_bytes()
    (tmp_path / shard).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"safetensors file '{shard}'"):
        sharding.load_sharded(tmp_path, sharding.make_mesh(1))


def test_tied_checkpoint_with_a_stored_head_loads(tmp_path):
    """transformers ignores `lm_head.weight` of a tied model (the head is the embedding): so do we."""
    m = init_model(tiny(tie_word_embeddings=True), seed=2)
    save_hf_checkpoint(m, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, tmp_path / "model.safetensors")
    _assert_same_weights(load_hf_checkpoint(tmp_path), m)


def test_float16_checkpoint_loads_with_a_dtype_override(tmp_path):
    """float16 is not a compute dtype here, but a float16 checkpoint loads cast to float32 when
    asked (its tensors must then all be F16, as its config.json declares)."""
    m = init_model(tiny(), seed=3)
    save_hf_checkpoint(m, tmp_path)
    tensors = {k: v.astype(np.float16) for k, v in load_file(tmp_path / "model.safetensors").items()}
    save_file(tensors, tmp_path / "model.safetensors")
    _edit_config(tmp_path, torch_dtype="float16")
    with pytest.raises(ValueError, match="unsupported checkpoint dtype 'float16'"):
        load_hf_checkpoint(tmp_path)
    sd = hf_state_dict(load_hf_checkpoint(tmp_path, dtype="float32"))
    for name, w in tensors.items():
        np.testing.assert_array_equal(sd[name], w.astype(np.float32))
