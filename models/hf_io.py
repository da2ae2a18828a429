"""Load and save Hugging Face Llama-family checkpoints (`config.json` + safetensors), numpy API only.

A checkpoint directory holds `config.json` and either `model.safetensors` or several shards listed in
`model.safetensors.index.json` (`weight_map`: tensor name -> shard file). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from paged_kv.models.config import LlamaConfig
from paged_kv.models.hf_format import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    check_checkpoint,
    checkpoint_config,
    hf_tensors as _hf_tensors,
    state_node,
)
from paged_kv.models.llama import Llama, abstract_model, is_per_layer, stacked
from paged_kv.models.sharding import load_sharded


def _stack_into(state: nnx.State, pending: dict) -> None:
    """Set each stacked variable of `state` from its per-layer arrays `pending[path]` (in layer
    order), and each unstacked one from its single array: one stack per variable, so loading
    never rewrites a stacked array once per layer."""
    for path, ws in pending.items():
        node, _ = state_node(state, path)
        node.set_value(ws[0] if len(ws) == 1 and path[0] != "layers" else jnp.stack(ws))


def _to_model_layout(name: str, w: np.ndarray, config: LlamaConfig) -> np.ndarray:
    """HF [out, in] (torch Linear) -> this model's einsum layout."""
    e = config.head_dim
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
        return w.T.reshape(w.shape[1], w.shape[0] // e, e)
    if name.endswith("o_proj.weight"):
        return w.T.reshape(w.shape[1] // e, e, w.shape[0])
    if name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
        return w.T
    if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
        return w.reshape(w.shape[0] // e, e)
    return w


def _to_hf_layout(name: str, w: np.ndarray) -> np.ndarray:
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
        return w.reshape(w.shape[0], -1).T
    if name.endswith("o_proj.weight"):
        return w.reshape(-1, w.shape[-1]).T
    if name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
        return w.T
    if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
        return w.reshape(-1)
    return w


def load_hf_checkpoint(path: str | os.PathLike, *, dtype: str | None = None,
                       mesh: jax.sharding.Mesh | None = None) -> Llama:
    """Load a Hugging Face Llama-family checkpoint directory (`paged_kv.models.config.FAMILIES`) into a `Llama`.

    Every tensor is checked against the config first (`check_checkpoint`), before any weight is
    read or anything compiled.

    `dtype` ("float32"/"bfloat16") overrides the checkpoint's dtype; weights are cast to it.
    `mesh`: a `jax.sharding.Mesh` with a "tp" axis to load tensor-parallel, each process reading
    only the slices its devices hold (`paged_kv.models.sharding.load_sharded`).
    Raises FileNotFoundError (missing directory, config.json, weight file or shard), ValueError
    (unsupported architecture/variant) and CheckpointError (missing, unexpected or unreadable
    tensor, wrong shape or dtype, truncated file), each naming the file or tensor.
    """
    if mesh is not None:
        return load_sharded(path, mesh, dtype=dtype)
    path = Path(path)
    hf, config = checkpoint_config(path, dtype)
    files = check_checkpoint(path, config, hf)
    model = abstract_model(config)
    graphdef, state = nnx.split(model)
    target = config.jnp_dtype
    handles: dict[Path, object] = {}
    pending: dict[tuple, list] = {}  # path without the layer index -> arrays in layer order
    try:
        for name, state_path, hf_shape in _hf_tensors(config):
            if name not in files:
                raise CheckpointError(f"tensor {name!r} is missing from checkpoint {str(path)!r}")
            file = files[name]
            if file not in handles:
                handles[file] = safe_open(file, framework="numpy").__enter__()
            try:
                w = handles[file].get_tensor(name)
            except Exception as err:  # listed in the index but not in the shard
                raise CheckpointError(f"tensor {name!r} listed for {file.name!r} cannot be read: {err}") from err
            if tuple(w.shape) != hf_shape:
                raise CheckpointError(f"tensor {name!r} in {file.name!r} has shape {tuple(w.shape)}, "
                                      f"expected {hf_shape} for this config")
            key = tuple(k for k in state_path if not isinstance(k, int))
            pending.setdefault(key, []).append(jnp.asarray(_to_model_layout(name, w, config), dtype=target))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    _stack_into(state, pending)
    return nnx.merge(graphdef, state)


def hf_state_dict(model: Llama) -> dict[str, np.ndarray]:
    """The model's weights as HF-named numpy arrays in HF layout (bfloat16 as ml_dtypes.bfloat16).
    A `per_layer` model is restacked first (the HF mapping reads the stacked layout)."""
    config = model.config
    _, state = nnx.split(stacked(model) if is_per_layer(model) else model)
    out, host = {}, {}
    for name, state_path, hf_shape in _hf_tensors(config):
        node, layer = state_node(state, state_path)
        if id(node) not in host:  # one device-to-host copy per (stacked) variable
            host[id(node)] = np.asarray(node.get_value())
        # bfloat16 arrives as ml_dtypes.bfloat16, which safetensors writes as BF16
        w = host[id(node)] if layer is None else host[id(node)][layer]
        w = np.ascontiguousarray(_to_hf_layout(name, w))
        assert w.shape == hf_shape, (name, w.shape, hf_shape)
        out[name] = w
    return out


def save_hf_checkpoint(model: Llama, path: str | os.PathLike, *, max_shard_bytes: int | None = None) -> None:
    """Write `config.json` and the weights as safetensors (sharded with an index when the weights
    exceed `max_shard_bytes`). transformers' `*ForCausalLM.from_pretrained` of the config's family reads
    the result."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / CONFIG_FILE, "w") as fh:
        json.dump(model.config.to_hf_config(), fh, indent=2)
    tensors = hf_state_dict(model)
    total = sum(w.nbytes for w in tensors.values())
    meta = {"format": "pt"}
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, str(path / SINGLE_FILE), metadata=meta)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, w in tensors.items():
        if shards[-1] and size + w.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(path / fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    with open(path / INDEX_FILE, "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
