"""The tensor-parallel layout: which axis of each array is split over the mesh axis "tp"
(Megatron-style, XLA SPMD). Everything not in the table is replicated.

| array | shape (model layout) | sharded axis |
|---|---|---|
| `q_proj` | `[d, num_heads, head_dim]` | heads |
| `k_proj`, `v_proj` | `[d, kv_heads, head_dim]` | KV heads |
| `o_proj` | `[num_heads, head_dim, d]` | heads (row-parallel: XLA all-reduces its output) |
| `gate`, `up` | `[d, f]` | `f` (column-parallel) |
| `q_bias`, `k_bias`, `v_bias` (qwen2, biased llama/qwen3) | `[heads, head_dim]` | heads |
| `gate_bias`, `up_bias` (llama `mlp_bias`) | `[f]` | `f` |
| `down` | `[f, d]` | `f` (row-parallel: XLA all-reduces its output) |
| `lm_head` (or the tied `embed`) | `[vocab, d]` | vocab, when `tp` divides it |
| KV `pages` | `[layers, 2, kv_heads, blocks, block_size, head_dim]` | KV heads |

The decoder-layer weights are stacked (`paged_kv.models.llama`): each of them has a leading layer axis
`[L, ...]` before the shape above, never sharded, so its spec is `P(None, ...)` of the table's.

The table is the Llama's layout (`Llama.partition_specs`); the pages' specs are every model's.
Only the specs live here, below the Llama and the paged forward that read them; placing a model
and its pages, sharded loading and capacity are `paged_kv.models.sharding`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_kv.models.page_sizing import KVPageSpec
from paged_kv.pallas_kernels.quant import QuantPages, is_quant

if TYPE_CHECKING:
    from paged_kv.models.config import LlamaConfig

AXIS = "tp"
"""Name of the tensor-parallel mesh axis."""

PAGE_SPEC = P(None, None, AXIS, None, None, None)
"""Pages `[layers, 2, kv_heads, blocks, block_size, head_dim]`: sharded on KV heads."""
SCALE_SPEC = P(None, None, AXIS, None, None)
"""Quantized pages' scales `[layers, 2, kv_heads, blocks, block_size]`: sharded on KV heads, with
their values."""


def pages_spec(pages: jax.Array | QuantPages | KVPageSpec) -> P | QuantPages:
    """The partition spec(s) of `pages` (or of the pages a `KVPageSpec` describes): `PAGE_SPEC`
    for plain pages; for `QuantPages` the same pytree of specs (`PAGE_SPEC` values, `SCALE_SPEC`
    scales), so `shard_map` / `jit` shardings split the scales on the KV-head axis with their values."""
    quantized = pages.quantized if isinstance(pages, KVPageSpec) else is_quant(pages)
    return QuantPages(values=PAGE_SPEC, scales=SCALE_SPEC) if quantized else PAGE_SPEC


def pages_sharding(pages: jax.Array | QuantPages | KVPageSpec, mesh: Mesh) -> NamedSharding | QuantPages:
    """`pages_spec(pages)` as `NamedSharding`s on `mesh` (a pytree for `QuantPages`)."""
    spec = pages_spec(pages)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec, is_leaf=lambda x: isinstance(x, P))


def weight_spec(name: str, shape: tuple[int, ...], tp: int, tied: bool) -> P:
    """PartitionSpec of the weight whose last state-path key is `name` (model layout)."""
    if name in ("q_proj", "k_proj", "v_proj"):
        return P(None, AXIS, None)
    if name == "o_proj":
        return P(AXIS, None, None)
    if name in ("gate", "up"):
        return P(None, AXIS)
    if name == "down":
        return P(AXIS, None)
    # Family biases follow their projection's output axis: the q/k/v biases [heads, head_dim] and
    # the gate/up biases [f] are split with it; o_proj's and down's [d] are added after the
    # all-reduce, so they are replicated (as are the q/k norm scales [head_dim], named "scale").
    if name in ("q_bias", "k_bias", "v_bias"):
        return P(AXIS, None)
    if name in ("gate_bias", "up_bias"):
        return P(AXIS)
    # The output head is vocab-parallel when tp divides the vocabulary (logits are gathered for the
    # sampler); an embedding that is also the head is sharded the same way (XLA masks the lookup).
    if name == "lm_head" or (name == "embed" and tied):
        return P(AXIS, None) if shape[0] % tp == 0 else P()
    return P()


def _path_keys(path) -> list:
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return [k for k in keys if k != "value"]


def _leaf_name(path) -> str:
    return str(_path_keys(path)[-1])


def _stacked_spec(stacked: bool, name: str, shape: tuple[int, ...], tp: int, tied: bool) -> P:
    """`weight_spec` of one layer's slice, with the leading layer axis (never sharded) in front
    when the variable is a stacked decoder-layer weight (`paged_kv.models.llama`: `layers.*` is [L, ...])."""
    if not stacked:
        return weight_spec(name, shape, tp, tied)
    return P(None, *weight_spec(name, shape[1:], tp, tied))


def _is_stacked_path(keys: list) -> bool:
    """A stacked decoder-layer weight: under "layers" with no layer index next (`paged_kv.models.llama`'s
    `per_layer` layout puts an int there, `("layers", i, ...)`, and its weights have no layer axis)."""
    return keys[0] == "layers" and not (len(keys) > 1 and isinstance(keys[1], int))


def weight_specs(weights: nnx.State, config: LlamaConfig, tp: int) -> nnx.State:
    """PartitionSpecs for an `nnx.State` of a model (same tree structure). Stacked layer weights
    (under "layers") get an unsharded leading layer axis before the table's spec; per-layer ones
    (`paged_kv.models.llama.per_layer`, under "layers/<i>") get the table's spec as they are."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: _stacked_spec(_is_stacked_path(_path_keys(path)), _leaf_name(path), tuple(x.shape), tp,
                                      config.tie_word_embeddings), weights)

