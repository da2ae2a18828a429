"""The Hugging Face checkpoint format, as both loaders read it: file names, the tensor list of a
Llama-family model (`hf_tensors`), `read_hf_config`, `checkpoint_config` (the model config with
the EOS ids a generation stops on, `checkpoint_token_ids`) and `check_checkpoint` (every
tensor's presence, shape and dtype, before anything is read), and `CheckpointError`.

Its own module so that `paged_kv.models.hf_io` (single-process load and save) and `paged_kv.models.sharding`
(tensor-parallel load) both import it and neither imports the other's internals: the import
graph is `hf_io -> sharding -> hf_format`, `hf_io -> hf_format`, with no cycle.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flax import nnx
from safetensors import safe_open

from paged_kv.models.config import LlamaConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model (wrong shape, missing tensor, ...)."""


def hf_tensors(config: LlamaConfig) -> Iterator[tuple[str, tuple, tuple[int, ...]]]:
    """(HF tensor name, path into the NNX state, HF shape) for every weight of the model,
    including the family's biases, q/k norms and Gemma's four norms per layer (`paged_kv.models.llama`
    docstring). A layer's path holds
    its index after "layers": ("layers", i, "attn", "q_proj") is slice [i] of the stacked
    `layers.attn.q_proj` (`state_node`)."""
    d, e, f, v = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    qh, kvh = config.num_heads, config.num_kv_heads
    yield "model.embed_tokens.weight", ("embed",), (v, d)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        yield p + "self_attn.q_proj.weight", ("layers", i, "attn", "q_proj"), (qh * e, d)
        yield p + "self_attn.k_proj.weight", ("layers", i, "attn", "k_proj"), (kvh * e, d)
        yield p + "self_attn.v_proj.weight", ("layers", i, "attn", "v_proj"), (kvh * e, d)
        yield p + "self_attn.o_proj.weight", ("layers", i, "attn", "o_proj"), (d, qh * e)
        if config.qkv_bias:
            yield p + "self_attn.q_proj.bias", ("layers", i, "attn", "q_bias"), (qh * e,)
            yield p + "self_attn.k_proj.bias", ("layers", i, "attn", "k_bias"), (kvh * e,)
            yield p + "self_attn.v_proj.bias", ("layers", i, "attn", "v_bias"), (kvh * e,)
        if config.o_bias:
            yield p + "self_attn.o_proj.bias", ("layers", i, "attn", "o_bias"), (d,)
        if config.qk_norm:
            yield p + "self_attn.q_norm.weight", ("layers", i, "attn", "q_norm", "scale"), (e,)
            yield p + "self_attn.k_norm.weight", ("layers", i, "attn", "k_norm", "scale"), (e,)
        yield p + "mlp.gate_proj.weight", ("layers", i, "mlp", "gate"), (f, d)
        yield p + "mlp.up_proj.weight", ("layers", i, "mlp", "up"), (f, d)
        yield p + "mlp.down_proj.weight", ("layers", i, "mlp", "down"), (d, f)
        if config.mlp_bias:
            yield p + "mlp.gate_proj.bias", ("layers", i, "mlp", "gate_bias"), (f,)
            yield p + "mlp.up_proj.bias", ("layers", i, "mlp", "up_bias"), (f,)
            yield p + "mlp.down_proj.bias", ("layers", i, "mlp", "down_bias"), (d,)
        yield p + "input_layernorm.weight", ("layers", i, "input_norm", "scale"), (d,)
        if config.sandwich_norm:  # Gemma: norms after attention and MLP, and one before the MLP
            yield p + "post_attention_layernorm.weight", ("layers", i, "attn_out_norm", "scale"), (d,)
            yield p + "pre_feedforward_layernorm.weight", ("layers", i, "post_attn_norm", "scale"), (d,)
            yield p + "post_feedforward_layernorm.weight", ("layers", i, "mlp_out_norm", "scale"), (d,)
        else:
            yield p + "post_attention_layernorm.weight", ("layers", i, "post_attn_norm", "scale"), (d,)
    yield "model.norm.weight", ("final_norm", "scale"), (d,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", ("lm_head",), (v, d)


def state_node(state: nnx.State, state_path: tuple) -> tuple[nnx.Variable, int | None]:
    """(the variable at `state_path` in `state`, its layer index or None): an int in the path is
    the layer, an index into the variable's leading (stacked) axis, not a key."""
    node, layer = state, None
    for key in state_path:
        if isinstance(key, int):
            layer = key
        else:
            node = node[key]
    return node, layer


def read_hf_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    if not cfg_file.is_file():
        raise FileNotFoundError(f"missing {CONFIG_FILE} in checkpoint directory {str(path)!r}")
    with open(cfg_file) as fh:
        return json.load(fh)


def read_json_object(path: Path) -> dict:
    """A JSON object from `path`, {} when the file is absent; ValueError naming the file otherwise."""
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(path)!r} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} holds a {type(data).__name__}, not a JSON object")
    return data


def _ids(value: Any, field: str, vocab_size: int) -> tuple[int, ...]:
    """An id or a list of ids (generation_config's `eos_token_id`), each checked to be in the vocabulary."""
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size:
            raise ValueError(f"{field}={value!r}: every id must be an int in [0, vocab_size={vocab_size})")
        out.append(int(v))
    return tuple(dict.fromkeys(out))


def checkpoint_token_ids(path: str | os.PathLike, field: str, vocab_size: int) -> tuple[int, ...]:
    """A checkpoint's special token ids `field` ("eos_token_id", "bos_token_id"): those of
    `generation_config.json` when it sets them (what `transformers.generate` stops on), else
    `config.json`'s; () when neither does. An id or a list (every id of the list ends a
    generation), each checked to be in `[0, vocab_size)` (ValueError naming the file)."""
    path = Path(path)
    for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
        ids = _ids(read_json_object(path / name).get(field), f"{name} {field}", vocab_size)
        if ids:
            return ids
    return ()


def checkpoint_config(path: str | os.PathLike, dtype: str | None = None) -> tuple[dict, LlamaConfig]:
    """`config.json` of the checkpoint directory `path` (`read_hf_config`) and the `LlamaConfig` it
    gives (`dtype` overriding the checkpoint's), whose `eos_token_ids` are the ones a generation
    stops on (`checkpoint_token_ids`: `generation_config.json` first). The engines stop there by
    default (`SamplingParams.eos_token_ids`)."""
    hf = read_hf_config(path)
    config = LlamaConfig.from_hf_config(hf, dtype=dtype)
    return hf, config.replace(eos_token_ids=checkpoint_token_ids(path, "eos_token_id", config.vocab_size))


def _weight_map(path: Path) -> dict[str, Path]:
    index = path / INDEX_FILE
    if index.is_file():
        with open(index) as fh:
            wm = json.load(fh).get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        files = {name: path / shard for name, shard in wm.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise FileNotFoundError(f"missing safetensors shard {shard.name!r} listed in {INDEX_FILE} "
                                        f"of {str(path)!r}")
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {str(path)!r}")
    try:
        with safe_open(single, framework="numpy") as fh:
            return {name: single for name in fh.keys()}
    except Exception as err:  # safetensors raises its own error type for a bad header or size
        raise _unreadable(single, path, err) from err


def _unreadable(file: Path, path: Path, err: BaseException) -> CheckpointError:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return CheckpointError(f"safetensors file {file.name!r} of {str(path)!r} cannot be read (truncated or "
                           f"corrupt?): {first}")


_DECLARED_ST_DTYPE = {"float32": "F32", "fp32": "F32", "bfloat16": "BF16", "bf16": "BF16", "float16": "F16",
                      "fp16": "F16"}
"""config.json's declared dtype -> the safetensors dtype its tensors must have. float16 checkpoints
load only with a `dtype` override (`paged_kv.models.config.SUPPORTED_DTYPES`): their F16 weights are cast."""

# Non-weights that some checkpoints carry (older transformers saved RoPE's buffer); ignored.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def check_checkpoint(path: str | os.PathLike, config: LlamaConfig, hf: dict) -> dict[str, Path]:
    """Check every tensor of a checkpoint against its config before anything is built or compiled;
    returns the weight map (tensor name -> file).

    Each safetensors file must open (a truncated file or a header naming an unknown dtype raises
    here, naming the file); each tensor the config implies must be present with the HF shape and
    the dtype `config.json` declares (`torch_dtype`/`dtype`: F32, BF16, or F16 for a float16
    checkpoint loaded with a `dtype` override);
    and no file may hold a tensor the config does not use (say a `q_proj.bias` in a Llama whose
    config says `attention_bias: false`: ignoring it would compute another model). The one
    exception is `lm_head.weight` of a tied model, which transformers ignores too (the head is the
    embedding), and RoPE buffers. Raises CheckpointError naming the tensor (or file), what it is
    and what the config expects.
    """
    path = Path(path)
    files = _weight_map(path)
    declared = str(hf.get("torch_dtype", hf.get("dtype")) or "float32").removeprefix("torch.")
    if declared not in _DECLARED_ST_DTYPE:
        raise CheckpointError(f"unsupported checkpoint dtype {declared!r} in config.json: expected one of "
                              f"{sorted(set(_DECLARED_ST_DTYPE))}")
    want_dt = _DECLARED_ST_DTYPE[declared]
    want = {name: shape for name, _, shape in hf_tensors(config)}
    headers: dict[Path, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for file in sorted(set(files.values())):
        try:
            with safe_open(file, framework="numpy") as fh:
                headers[file] = {n: (fh.get_slice(n).get_dtype(), tuple(fh.get_slice(n).get_shape()))
                                 for n in fh.keys()}
        except Exception as err:  # safetensors raises its own error type for a bad header or size
            raise _unreadable(file, path, err) from err
    for name, file in files.items():
        if name not in headers[file]:
            raise CheckpointError(f"tensor {name!r} listed for {file.name!r} is not in that file")
    for file, header in headers.items():
        for name in header:
            if name in want or name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            raise CheckpointError(
                f"tensor {name!r} in {file.name!r} is not a weight of this config (model_type="
                f"{config.model_type!r}, qkv_bias={config.qkv_bias}, o_bias={config.o_bias}, mlp_bias="
                f"{config.mlp_bias}, qk_norm={config.qk_norm}, tie_word_embeddings={config.tie_word_embeddings}): "
                "config.json and the weights disagree")
    for name, shape in want.items():
        if name not in files:
            raise CheckpointError(f"tensor {name!r} is missing from checkpoint {str(path)!r}")
        file = files[name]
        dt, got = headers[file][name]
        if got != shape:
            raise CheckpointError(f"tensor {name!r} in {file.name!r} has shape {got}, expected {shape} for this "
                                  "config")
        if dt != want_dt:
            raise CheckpointError(f"tensor {name!r} in {file.name!r} has dtype {dt}; config.json declares "
                                  f"{declared!r} ({want_dt})")
    return files


