"""Tensor parallelism over a `jax.sharding.Mesh` axis named "tp" (Megatron-style, XLA SPMD):
placing a model and its pages, sharded loading, KV capacity per device.

What is sharded over "tp" (heads, KV heads, MLP width, the vocabulary; the pages on KV heads) is
the table of `paged_kv.models.tp_layout`, whose names (`AXIS`, `PAGE_SPEC`, `pages_spec`,
`weight_spec(s)`, ...) this module re-exports.

So each device holds every block for its own KV heads: block ids are global, the block-manager
state stays small and replicated, and block copies, KV writes and paged attention are
device-local; `paged_kv.models.paged` runs those kernels under `jax.shard_map` over "tp" (a Pallas call is
opaque to the SPMD partitioner, and shard_map makes the locality explicit for the reference path
too). A decode step needs two all-reduces of the hidden state per layer, inserted by XLA.

Head layouts: `tp` must divide `num_heads` and `intermediate_size`, and either divide
`num_kv_heads` or be a multiple of it. In the second case each KV head is replicated
`tp // num_kv_heads` times (`k_proj`/`v_proj` and the pages get `tp` KV heads, one per device):
query head `h` then reads replicated head `h // (num_heads // tp)`, whose weights are those of
original head `h // (num_heads // num_kv_heads)`, so the model computes exactly the same function.
The placed model's `config.num_kv_heads` is that effective count; pages are sized from it.

The table is the Llama's layout (`Llama.partition_specs`). Any other `paged_kv.models.protocol.PagedModel`
is placed with its own `partition_specs(weights, tp)` (a model without one raises ValueError for
mesh use, never a guessed layout), with no KV-head replication: tp must divide its KV heads.

Entry points: `make_mesh`, `shard(model, pages, mesh)` (place a model and its pages),
`allocate_pages_on_mesh`, `load_sharded` (each process reads only its slices of the safetensors
tensors), `kv_capacity` (blocks and tokens per device after weights), `valid_degrees`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.typing import DTypeLike

from paged_kv.models import hf_format
from paged_kv.models.config import LlamaConfig
from paged_kv.models.llama import Llama, abstract_model, is_per_layer, per_layer
from paged_kv.models.page_sizing import KVPageSpec, allocate_pages, kv_bytes_per_token_raw
from paged_kv.models.protocol import check_model, check_partition_specs, model_facts, partition_specs
from paged_kv.models.tp_layout import (
    AXIS,
    PAGE_SPEC,
    SCALE_SPEC,
    _leaf_name,
    _stacked_spec,
    pages_sharding,
    pages_spec,
    weight_spec,
    weight_specs,
)
from paged_kv.pallas_kernels.quant import QuantPages, is_quant
from paged_kv.pallas_kernels.validate import is_int

_Tree = TypeVar("_Tree")


# ---------------------------------------------------------------------------- degrees and meshes
def _divisors_up_to(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degree_problem(config: LlamaConfig, tp: int) -> str | None:
    """Why `tp` fits no head layout of `config` (None when it fits)."""
    if not is_int(tp) or tp < 1:
        return f"tensor-parallel degree {tp!r} must be an int >= 1"
    if config.num_heads % tp:
        return f"{tp} does not divide num_heads={config.num_heads}"
    if config.intermediate_size % tp:
        return f"{tp} does not divide intermediate_size={config.intermediate_size}"
    kvh = config.num_kv_heads
    if kvh % tp and tp % kvh:
        return f"{tp} neither divides num_kv_heads={kvh} nor is a multiple of it (to replicate KV heads)"
    return None


def valid_degrees(config: LlamaConfig) -> list[int]:
    """Every tensor-parallel degree with a head layout for `config` (all divide `num_heads`)."""
    return [d for d in _divisors_up_to(config.num_heads) if degree_problem(config, d) is None]


def check_degree(config: LlamaConfig, tp: int) -> None:
    """Raise ValueError naming `tp`, the reason and the degrees that work."""
    problem = degree_problem(config, tp)
    if problem is not None:
        raise ValueError(f"tensor-parallel degree tp={tp!r} fits no head layout: {problem}; "
                         f"degrees that work for this model: {valid_degrees(config)}")


def kv_heads_for(config: LlamaConfig, tp: int) -> int:
    """KV heads of the placed model and its pages: `num_kv_heads`, or `tp` when KV heads are
    replicated (tp a multiple of num_kv_heads)."""
    check_degree(config, tp)
    return max(config.num_kv_heads, tp)


def tp_degree(mesh: Mesh) -> int:
    """Size of the mesh's "tp" axis; ValueError when `mesh` is not a Mesh with that axis."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if AXIS not in mesh.axis_names:
        raise ValueError(f"mesh has axes {tuple(mesh.axis_names)}; expected a tensor-parallel axis named "
                         f"{AXIS!r} (see paged_kv.models.sharding.make_mesh)")
    return int(mesh.shape[AXIS])


def make_mesh(tp: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh with axis "tp" over `devices` (default: every device of every process, in
    `jax.devices()` order). `tp` defaults to all of them; else the first `tp` are used."""
    devices = list(jax.devices() if devices is None else devices)
    tp = len(devices) if tp is None else tp
    if not is_int(tp) or tp < 1:
        raise ValueError(f"tp={tp!r} must be an int in [1, {len(devices)}] (the devices available)")
    if tp > len(devices):
        platform = devices[0].platform if devices else "cpu"
        hint = (f"; on a CPU, make {tp} devices with jax.config.update(\"jax_num_cpu_devices\", {tp}) before "
                "JAX starts its backend (before the first jax.devices(), array or jit call)"
                if platform == "cpu" else "")
        raise ValueError(f"tp={tp} needs {tp} devices; JAX has {len(devices)} ({platform}){hint}")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def mesh_of(pages: jax.Array | QuantPages) -> Mesh | None:
    """The mesh `pages` are sharded over by `shard` (NamedSharding on a mesh with a "tp" axis),
    else None (a single-device or uncommitted array). `QuantPages`: their values' mesh."""
    if is_quant(pages):
        pages = pages.values
    sh = getattr(pages, "sharding", None)
    if isinstance(sh, NamedSharding) and isinstance(sh.mesh, Mesh) and AXIS in sh.mesh.axis_names \
            and sh.mesh.size > 1:
        return sh.mesh
    return None


# ---------------------------------------------------------------------------- placing arrays
def put(x: jax.Array | np.ndarray, sharding: NamedSharding) -> jax.Array:
    """`x` (numpy or jax array, same value on every process) placed with `sharding`, which may span
    several processes: then each process builds only its own devices' shards."""
    if isinstance(x, jax.Array):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if sharding.is_fully_addressable or not x.is_fully_addressable:  # a reshard XLA can do
            return jax.device_put(x, sharding)
    elif sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed keys: place their raw data, then re-wrap
        return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def replicate(tree: _Tree, mesh: Mesh) -> _Tree:
    """Every array leaf of `tree` replicated over `mesh` (block-manager state, prompts, keys)."""
    rep = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: put(x, rep), tree)


def _expand_kv(w, r: int):
    """Repeat each KV head `r` times along the KV-head axis, the second to last of `[..., kv, e]`
    (projections `[L, d, kv, e]`, biases `[L, kv, e]`, with or without the layer axis)."""
    return w if r == 1 else jnp.repeat(w, r, axis=-2)


def _expand_kv_leaf(name: str, w, r: int):
    """`_expand_kv` for the K/V leaves of a model (projections and their biases); other leaves
    unchanged."""
    return _expand_kv(w, r) if name in ("k_proj", "v_proj", "k_bias", "v_bias") else w


def _llama_config(model) -> LlamaConfig | None:
    """The config of a Llama (module, split, or the config itself); None for other models."""
    if isinstance(model, LlamaConfig):
        return model
    module = nnx.merge(*model) if isinstance(model, tuple) else model
    return module.config if isinstance(module, Llama) else None


def placed_kv_heads(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | LlamaConfig, tp: int) -> int:
    """KV heads of `model` (a `paged_kv.models.protocol.PagedModel`, its split, or a `LlamaConfig`) once
    placed at degree `tp`: a Llama's `kv_heads_for`; any other model keeps its own count, which tp
    must divide (only the Llama knows how to replicate its KV heads)."""
    config = _llama_config(model)
    if config is not None:
        return kv_heads_for(config, tp)
    f = model_facts(model)
    if f.num_kv_heads % tp:
        raise ValueError(f"tensor-parallel degree tp={tp} does not divide num_kv_heads={f.num_kv_heads} of "
                         f"{type(check_model(model)).__name__}")
    return f.num_kv_heads


def shard_model(model: nnx.Module | tuple[nnx.GraphDef, nnx.State],
                mesh: Mesh) -> nnx.Module | tuple[nnx.GraphDef, nnx.State]:
    """Place a `paged_kv.models.protocol.PagedModel` (or its `(graphdef, state)` split) on `mesh`; returns
    the same kind. The layout is the model's own `partition_specs(weights, tp)` (a model without
    one raises ValueError before anything is placed).

    A Llama's KV heads are replicated when `tp > num_kv_heads` (the returned model's config says
    so). A model already placed this way is returned as is (no copy)."""
    tp = tp_degree(mesh)
    is_pair = isinstance(model, tuple)
    graphdef, weights = model if is_pair else nnx.split(model)
    module = check_partition_specs(check_model((graphdef, weights)))
    config = _llama_config(module)
    if config is None:
        placed_kv_heads(module, tp)
    else:
        check_degree(config, tp)
        kvh = kv_heads_for(config, tp)
        if kvh != config.num_kv_heads:
            r = kvh // config.num_kv_heads
            weights = jax.tree_util.tree_map_with_path(
                lambda path, x: _expand_kv_leaf(_leaf_name(path), x, r), weights)
            config = config.replace(num_kv_heads=kvh)
            abstract = abstract_model(config)
            # The graph of the placed config in the model's own layer layout.
            graphdef, _ = nnx.split(per_layer(abstract) if is_per_layer(module) else abstract)
    specs = partition_specs(module, weights, tp)
    weights = jax.tree.map(lambda x, s: put(x, NamedSharding(mesh, s)), weights, specs)
    return (graphdef, weights) if is_pair else nnx.merge(graphdef, weights)


def shard_pages(pages: jax.Array | QuantPages, mesh: Mesh,
                model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | LlamaConfig) -> jax.Array | QuantPages:
    """Place pages on `mesh`, sharded on KV heads. `model` is the placed model (or the original, or
    a Llama's config): pages with the original KV-head count are repeated to the placed count first
    (fresh pages are zeros; pages holding K/V stay exact since replicas hold the same K/V).
    `QuantPages`: values and scales alike (axis 2 of both is the KV head)."""
    tp = tp_degree(mesh)
    kvh = placed_kv_heads(model, tp)
    have = pages.shape[2]
    if have != kvh:
        if kvh % have:
            raise ValueError(f"pages have {have} KV heads; at tp={tp} this model needs {kvh}")
        pages = jax.tree.map(lambda x: jnp.repeat(x, kvh // have, axis=2), pages)
    return jax.tree.map(put, pages, pages_sharding(pages, mesh))


def shard(model: nnx.Module | tuple[nnx.GraphDef, nnx.State], pages: jax.Array | None,
          mesh: Mesh) -> tuple[nnx.Module | tuple[nnx.GraphDef, nnx.State], jax.Array | None]:
    """`(model, pages) -> (model, pages)` placed on `mesh` (pages may be None). Idempotent."""
    model = shard_model(model, mesh)
    return model, (None if pages is None else shard_pages(pages, mesh, model))


def allocate_pages_on_mesh(spec: KVPageSpec, mesh: Mesh) -> jax.Array:
    """Zeroed pages of `spec` (a `paged_kv.models.KVPageSpec` sized from the *placed* model's config),
    created already sharded: no device ever holds the whole array."""
    tp = tp_degree(mesh)
    if spec.num_kv_heads % tp:
        raise ValueError(f"pages with num_kv_heads={spec.num_kv_heads} cannot be split over tp={tp}; size "
                         "them from the placed model's config (paged_kv.models.sharding.shard replicates KV heads)")
    return jax.jit(lambda: allocate_pages(spec), out_shardings=pages_sharding(spec, mesh))()


def check_on_mesh(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | LlamaConfig, mesh: Mesh,
                  num_kv_heads: int) -> int:
    """Check a placed model (or a Llama's config; `num_kv_heads`: the placed count) against `mesh`;
    returns tp. A model without `partition_specs` cannot run on a mesh (ValueError naming it)."""
    tp = tp_degree(mesh)
    config = _llama_config(model)
    if config is not None:
        check_degree(config, tp)
    else:
        check_partition_specs(check_model(model))
    if num_kv_heads % tp:
        raise ValueError(f"num_kv_heads={num_kv_heads} is not divisible by tp={tp}: place the model with "
                         "paged_kv.models.sharding.shard(model, pages, mesh) first (it replicates KV heads)")
    return tp


# ---------------------------------------------------------------------------- sharded loading
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


def _range(s: slice, n: int) -> tuple[int, int]:
    start, stop, step = s.indices(n)
    if step != 1:
        raise ValueError(f"unsupported strided shard index {s}")
    return start, stop


def _read_slice(handle, name: str, index, model_shape, config: LlamaConfig, r: int, counter: list):
    """The block `index` (slices in model layout, as jax hands to make_array_from_callback) of
    tensor `name`, reading only the rows/columns of the HF `[out, in]` tensor it needs."""
    sl = handle.get_slice(name)
    index = tuple(index) + (slice(None),) * (len(model_shape) - len(index))
    e = config.head_dim
    rng = [_range(s, n) for s, n in zip(index, model_shape)]

    def read(*hf_index):
        w = sl[hf_index]
        counter[0] += w.nbytes
        return w

    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
        (d0, d1), (h0, h1), (e0, e1) = rng
        rep = r if name.endswith(("k_proj.weight", "v_proj.weight")) else 1
        lo, hi = h0 // rep, (h1 - 1) // rep + 1  # original heads behind placed heads h0..h1-1
        w = read(slice(lo * e, hi * e), slice(d0, d1))  # HF [heads * e, d]
        w = w.T.reshape(d1 - d0, hi - lo, e)
        return w[:, [h // rep - lo for h in range(h0, h1)], e0:e1]
    if name.endswith("o_proj.weight"):
        (h0, h1), (e0, e1), (d0, d1) = rng
        w = read(slice(d0, d1), slice(h0 * e, h1 * e))  # HF [d, heads * e]
        return w.T.reshape(h1 - h0, e, d1 - d0)[:, e0:e1]
    if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
        (h0, h1), (e0, e1) = rng
        rep = r if name.endswith(("k_proj.bias", "v_proj.bias")) else 1
        lo, hi = h0 // rep, (h1 - 1) // rep + 1
        w = read(slice(lo * e, hi * e)).reshape(hi - lo, e)  # HF [heads * e]
        return w[[h // rep - lo for h in range(h0, h1)], e0:e1]
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        (d0, d1), (f0, f1) = rng
        return read(slice(f0, f1), slice(d0, d1)).T  # HF [f, d]
    if name.endswith("down_proj.weight"):
        (f0, f1), (d0, d1) = rng
        return read(slice(d0, d1), slice(f0, f1)).T  # HF [d, f]
    return read(*(slice(a, b) for a, b in rng))  # embeddings, head, norms: same layout


def load_sharded(path: str | os.PathLike, mesh: Mesh, *, dtype: str | None = None, stats: dict | None = None) -> Llama:
    """Load a Hugging Face Llama checkpoint directly onto `mesh`.

    Every weight is built with `jax.make_array_from_callback`, whose callback runs only for this
    process's devices and reads just their slice through `safe_open(...).get_slice` (a device
    shard of `q_proj` reads only its heads' rows). Replicated KV heads (tp > num_kv_heads) are
    read from the original head. `stats`, when given, receives `bytes_read` (this process) and
    `bytes_total` (the checkpoint's tensors). Errors as `paged_kv.models.load_hf_checkpoint`.
    """
    from safetensors import safe_open

    path = Path(path)
    hf, config = hf_format.checkpoint_config(path, dtype)
    tp = tp_degree(mesh)
    kvh = kv_heads_for(config, tp)
    placed = config.replace(num_kv_heads=kvh)
    r = kvh // config.num_kv_heads
    files = hf_format.check_checkpoint(path, config, hf)  # every shape and dtype, before any array is built
    graphdef, state = nnx.split(abstract_model(placed))
    target = placed.jnp_dtype
    handles: dict[Path, object] = {}
    counter, total = [0], 0
    groups: dict[tuple, list] = {}  # variable path (no layer index) -> [(HF name, handle)] in layer order
    try:
        for name, state_path, hf_shape in hf_format.hf_tensors(config):
            if name not in files:
                raise hf_format.CheckpointError(f"tensor {name!r} is missing from checkpoint {str(path)!r}")
            file = files[name]
            if file not in handles:
                handles[file] = safe_open(file, framework="numpy").__enter__()
            h = handles[file]
            try:
                shape = tuple(h.get_slice(name).get_shape())
            except Exception as err:
                raise hf_format.CheckpointError(
                    f"tensor {name!r} listed for {file.name!r} cannot be read: {err}") from err
            if shape != hf_shape:
                raise hf_format.CheckpointError(f"tensor {name!r} in {file.name!r} has shape {shape}, "
                                            f"expected {hf_shape} for this config")
            total += math.prod(hf_shape) * _ST_ITEMSIZE.get(h.get_slice(name).get_dtype(), 0)
            groups.setdefault(tuple(k for k in state_path if not isinstance(k, int)), []).append((name, h))
        for var_path, members in groups.items():
            node, _ = hf_format.state_node(state, var_path)
            model_shape = tuple(node.get_value().shape)
            stacked = var_path[0] == "layers"  # leading layer axis: member l is layer l's tensor
            spec = _stacked_spec(stacked, str(var_path[-1]), model_shape, tp, placed.tie_word_embeddings)
            cache: dict = {}

            def callback(index, members=members, model_shape=model_shape, cache=cache, stacked=stacked):
                key = tuple(_range(s, n) for s, n in zip(index, model_shape))
                if key not in cache:  # several local devices may hold the same (replicated) block
                    if stacked:  # the block's layers, each read as its own HF tensor's slice
                        l0, l1 = _range(index[0], model_shape[0]) if len(index) else (0, model_shape[0])
                        block = np.stack([np.asarray(_read_slice(members[layer][1], members[layer][0], tuple(index)[1:],
                                                                 model_shape[1:], config, r, counter))
                                          for layer in range(l0, l1)])
                    else:
                        name, h = members[0]
                        block = np.asarray(_read_slice(h, name, index, model_shape, config, r, counter))
                    cache[key] = block.astype(target)
                return cache[key]

            node.set_value(jax.make_array_from_callback(model_shape, NamedSharding(mesh, spec), callback))
    finally:
        for fh in handles.values():
            fh.__exit__(None, None, None)
    if stats is not None:
        stats.update(bytes_read=counter[0], bytes_total=total)
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------- capacity
@dataclasses.dataclass(frozen=True)
class KVCapacity:
    """Per-device KV capacity at a tensor-parallel degree (all sizes in bytes).

    Attributes:
      tp: the degree. kv_heads_per_device: KV heads of each layer a device holds.
      weight_bytes: weights held by one device. kv_bytes_per_token / kv_bytes_per_block: K and V
        of one token / block over all layers, this device's heads only.
      budget_bytes: `memory_fraction` of the device memory. kv_budget_bytes: what is left after
        the weights. num_blocks: blocks that fit (block 0, the null block, included; every device
        holds every block for its heads, so this is also the pool size). tokens: usable tokens,
        `(num_blocks - 1) * block_size` (0 when the weights do not fit).
    """

    tp: int
    kv_heads_per_device: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    budget_bytes: int
    kv_budget_bytes: int
    num_blocks: int
    tokens: int


def weight_bytes_per_device(config: LlamaConfig, tp: int) -> int:
    """Bytes of weights on one device at degree `tp` (replicated KV heads counted). Arithmetic on
    the checkpoint's tensor list: no model is built."""
    kvh = kv_heads_for(config, tp)
    r = kvh // config.num_kv_heads
    itemsize = jnp.dtype(config.dtype).itemsize
    total = 0
    for name, state_path, hf_shape in hf_format.hf_tensors(config):
        kv = name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"))
        numel = math.prod(hf_shape) * (r if kv else 1)
        model_shape = (config.vocab_size,) if state_path[-1] in ("embed", "lm_head") else ()
        spec = weight_spec(str(state_path[-1]), model_shape, tp, config.tie_word_embeddings)
        total += numel * itemsize // (tp if AXIS in tuple(spec) else 1)
    return total


def kv_capacity(config: LlamaConfig, device_bytes: int, tp: int = 1, *, block_size: int = 16,
                memory_fraction: float = 0.9, dtype: DTypeLike | None = None) -> KVCapacity:
    """How many KV blocks and tokens fit on each device after its weights.

    `device_bytes`: one device's memory; `memory_fraction` of it is the budget (the rest is left
    for activations, the sampler and the runtime, as vLLM's `gpu_memory_utilization`). `dtype` of
    the pages defaults to the model's; int8 / float8_e4m3fn pages count their float32 scales too
    (`paged_kv.models.page_sizing.kv_bytes_per_token_raw`).
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction={memory_fraction} must be in (0, 1]")
    if device_bytes <= 0:
        raise ValueError(f"device_bytes={device_bytes} must be > 0")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    kvh = kv_heads_for(config, tp)
    per_dev_heads = kvh // tp
    per_token = kv_bytes_per_token_raw(config.num_layers, per_dev_heads, config.head_dim,
                                       config.dtype if dtype is None else dtype)
    weights = weight_bytes_per_device(config, tp)
    budget = int(device_bytes * memory_fraction)
    kv_budget = max(budget - weights, 0)
    blocks = kv_budget // (per_token * block_size)
    return KVCapacity(tp=tp, kv_heads_per_device=per_dev_heads, weight_bytes=weights, kv_bytes_per_token=per_token,
                      kv_bytes_per_block=per_token * block_size, budget_bytes=budget, kv_budget_bytes=kv_budget,
                      num_blocks=int(blocks), tokens=int(max(blocks - 1, 0) * block_size))


__all__ = [
    "AXIS", "KVCapacity", "PAGE_SPEC", "SCALE_SPEC", "allocate_pages_on_mesh", "check_degree", "check_on_mesh",
    "kv_capacity", "kv_heads_for", "load_sharded", "make_mesh", "mesh_of", "pages_sharding", "pages_spec", "put",
    "replicate", "shard", "shard_model", "shard_pages", "tp_degree", "valid_degrees", "weight_bytes_per_device",
    "weight_spec", "weight_specs",
]
