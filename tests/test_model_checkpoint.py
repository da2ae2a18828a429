"""Hugging Face checkpoint loading and saving: round trips and clear errors."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from models import CheckpointError, hf_state_dict, init_model, load_hf_checkpoint, save_hf_checkpoint, tiny


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
    q = np.asarray(model.layers[0].attn.q_proj[...])
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
    (dict(architectures=["MistralForCausalLM"], model_type="mistral"), "unsupported model_type='mistral'"),
    (dict(architectures=["LlamaForSequenceClassification"]), "unsupported architectures"),
    (dict(attention_bias=True), "unsupported attention_bias"),
    (dict(hidden_act="gelu"), "unsupported hidden_act='gelu'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope type 'yarn'"),
    (dict(num_key_value_heads=3), "num_kv_heads=3 must divide num_heads=4"),
])
def test_unsupported_config(ckpt, changes, message):
    _edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_hf_checkpoint(ckpt)


def test_copy_of_checkpoint_loads(ckpt, tmp_path, model):
    """Nothing but the directory's files is needed (no hub, no cache)."""
    dst = tmp_path / "copy"
    shutil.copytree(ckpt, dst)
    _assert_same_weights(load_hf_checkpoint(dst), model)
