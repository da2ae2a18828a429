"""The forward of a `paged_kv.models.protocol.PagedModel` over the paged KV cache, through
`pallas_kernels` only.

One step is a pure function `(graphdef, state, pages, batch, tokens) -> (logits, pages)`, jitted once
per shape with `pages` donated:
  - `paged_prefill_step`: a chunk of T tokens per sequence (K/V written, then paged prefill attention);
  - `paged_decode_step`: one token per sequence (K/V written, then paged decode attention).
`paged_forward` is the un-jitted forward the engines call inside their own `jit`, `copy_blocks`
the copy-on-write of whole blocks.

The parts live in modules of one concern each, whose public names this module also exports:
  - `paged_kv.models.paged_batch`: `PagedBatch`, the step's metadata (tables, slots, lengths);
  - `paged_kv.models.paged_attention`: the `AttentionBackend` a model calls per layer;
  - `paged_kv.models.layer_layout`: how a model runs its layers for an `impl` and a mesh;
  - `paged_kv.models.kv_groups`: `KVGroupLayout`, each layer's KV-cache group and page slot;
  - `paged_kv.models.page_sizing`: `KVPageSpec`, page bytes and allocation (the page layout).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_kv import pallas_kernels as pk
from paged_kv.models.kv_groups import KVGroupLayout, kv_group_layout, layer_windows
from paged_kv.models.layer_layout import layer_matmul_for, layout_for_impl, static_layer_impl
from paged_kv.models.page_sizing import (
    SCALE_BYTES,
    KVPageSpec,
    allocate_pages,
    is_quant_dtype,
    kv_bytes_per_block,
    kv_bytes_per_token,
    kv_bytes_per_token_raw,
    page_spec,
    page_spec_for_budget,
    resolve_kv_dtype,
)
from paged_kv.models.paged_attention import _make_attend
from paged_kv.models.paged_batch import PagedBatch, compute_slots, make_paged_batch
from paged_kv.models.protocol import check_model, model_facts
from paged_kv.models.sharding import check_on_mesh
from paged_kv.models.tp_layout import pages_spec
from paged_kv.pallas_kernels import IMPLS
from paged_kv.pallas_kernels.quant import QuantPages

NULL_BLOCK = pk.NULL_BLOCK


def copy_blocks(pages: jax.Array | QuantPages, src: jax.Array, dst: jax.Array, *, impl: str = "auto",
                mesh: Mesh | None = None) -> jax.Array | QuantPages:
    """`paged_kv.pallas_kernels.copy_blocks`, run per device under `shard_map` when `mesh` is given (pages
    sharded on KV heads hold every block, so a block copy is device-local). `QuantPages` move their
    scales with the blocks (sharded on KV heads like their values: `tp_layout.pages_spec`)."""
    if mesh is None:
        return pk.copy_blocks(pages, src, dst, impl=impl)
    spec = pages_spec(pages)
    fn = jax.shard_map(functools.partial(pk.copy_blocks, impl=impl), mesh=mesh, in_specs=(spec, P(), P()),
                       out_specs=spec, check_vma=False)
    return fn(pages, src, dst)


def _check_mesh(model, mesh) -> None:
    if mesh is not None:
        check_on_mesh(model, mesh, model_facts(model).num_kv_heads)


def _batch_layout(model: nnx.Module, pages: jax.Array, batch: PagedBatch) -> KVGroupLayout | None:
    """The model's `KVGroupLayout` for a grouped `batch` (None otherwise), checked against the
    batch's group count and the pages' slots (ValueError naming both)."""
    if not batch.grouped:
        return None
    layout = kv_group_layout(model)
    if batch.block_tables.shape[0] != layout.num_groups or pages.shape[0] != layout.slots:
        raise ValueError(f"a batch of {batch.block_tables.shape[0]} KV-cache groups and pages of {pages.shape[0]} "
                         f"layer slots; the model's layout has {layout.num_groups} groups of {layout.slots} slots "
                         f"(group kinds {layout.group_specs})")
    return layout


def paged_forward(model: nnx.Module | tuple[nnx.GraphDef, nnx.State], pages: jax.Array, batch: PagedBatch,
                  tokens: jax.Array, *, impl: str = "auto", last_only: bool = False,
                  mesh: Mesh | None = None, batch_invariant: bool = False) -> tuple[jax.Array, jax.Array]:
    """Un-jitted forward of a `paged_kv.models.protocol.PagedModel`. tokens int32[B, T] (a prefill chunk) or
    int32[B] (decode, one per sequence).

    Returns (float32 logits, pages): logits [B, T, V] for a chunk ([B, V] at the last valid token
    when `last_only`), [B, V] for decode.

    A grouped `batch` (tables [G, B, M], slots [G, B, T]: a grouped manager's) runs the model's
    `kv_group_layout`: pages `[layout.slots, 2, ...]`, each layer in its slot with its group's
    tables.

    `mesh`: a `jax.sharding.Mesh` with a "tp" axis when the model and pages were placed with
    `paged_kv.models.sharding.shard`; the KV write and paged attention then run per device under
    `jax.shard_map` over KV heads, and XLA inserts the all-reduces of the sharded matmuls.

    `batch_invariant` (static): every token's logits depend only on its own sequence, whatever
    the batch, its row, the chunking of its prompt or decode against prefill
    (`paged_kv.pallas_kernels.invariant`; with a Pallas `impl` the fixed-tile kernels,
    `invariant_attention` and `layer_matmul`'s invariant plan; a model whose `logits` takes
    `batch_invariant`, as the Llama's). On the reference kernels they also equal
    `paged_kv.models.contiguous.score_tokens` bit for bit. Over a mesh: tp = 1 and tp = 2 give
    the same bits (docs/batch_invariance.md).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    model = check_model(model)
    _check_mesh(model, mesh)
    decode = tokens.ndim == 1
    toks = tokens[:, None] if decode else tokens
    layout = _batch_layout(model, pages, batch)
    attend = _make_attend(batch, impl, decode, mesh, model_facts(model).head_dim, batch_invariant, layout)
    hidden, pages = model(toks, batch.positions, pages, attend)
    if decode:
        hidden = hidden[:, 0]
    elif last_only:
        hidden = hidden[jnp.arange(toks.shape[0]), jnp.maximum(batch.q_lens - 1, 0)]
    if batch_invariant:
        if "batch_invariant" not in inspect.signature(model.logits).parameters:
            raise ValueError(f"{type(model).__name__} has no batch-invariant mode: its logits() takes no "
                             "batch_invariant (docs/batch_invariance.md)")
        logits = model.logits(hidden, batch_invariant=True)
    else:
        logits = model.logits(hidden)
    if mesh is not None:
        # A vocabulary-parallel head gives vocabulary-sharded logits; they are gathered here, once.
        # Left to the partitioner, the sampler's prefix sum over the sorted vocabulary became a
        # loop of one trip per vocabulary entry under JAX 0.12 (64,128 per tp=2 decode step).
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))
    return logits, pages


@functools.partial(jax.jit, static_argnames=("graphdef", "impl", "last_only", "mesh", "batch_invariant"),
                   donate_argnames=("pages",))
def paged_prefill_step(graphdef: nnx.GraphDef, state: nnx.State, pages: jax.Array, batch: PagedBatch,
                       tokens: jax.Array, *, impl: str = "auto", last_only: bool = False,
                       mesh: Mesh | None = None, batch_invariant: bool = False) -> tuple[jax.Array, jax.Array]:
    """`(graphdef, state, pages, batch, tokens int32[B, T]) -> (logits, pages)`: one prefill chunk
    per sequence, K/V written at `batch.slots`, causal paged attention. `pages` is donated.
    `mesh`: as in `paged_forward` (static). With Pallas kernels pass the split of
    `layout_for_impl(model, impl)` (once, outside the step): a stacked Llama would copy every
    layer's weight slices on every step on a GPU."""
    if tokens.ndim != 2:
        raise ValueError(f"prefill tokens must be [B, T], got shape {tokens.shape}")
    return paged_forward(nnx.merge(graphdef, state), pages, batch, tokens, impl=impl, last_only=last_only,
                         mesh=mesh, batch_invariant=batch_invariant)


@functools.partial(jax.jit, static_argnames=("graphdef", "impl", "mesh", "batch_invariant"),
                   donate_argnames=("pages",))
def paged_decode_step(graphdef: nnx.GraphDef, state: nnx.State, pages: jax.Array, batch: PagedBatch,
                      tokens: jax.Array, *, impl: str = "auto",
                      mesh: Mesh | None = None, batch_invariant: bool = False) -> tuple[jax.Array, jax.Array]:
    """`(graphdef, state, pages, batch, tokens int32[B]) -> (logits float32[B, V], pages)`: one token
    per sequence (batch.q_lens 1, or 0 for padding rows). `pages` is donated. `mesh`: as in
    `paged_forward` (static). With Pallas kernels pass the split of `layout_for_impl(model, impl)`
    (once, outside the step), as in `paged_prefill_step`."""
    if tokens.ndim != 1:
        raise ValueError(f"decode tokens must be [B], got shape {tokens.shape}")
    return paged_forward(nnx.merge(graphdef, state), pages, batch, tokens, impl=impl, mesh=mesh,
                         batch_invariant=batch_invariant)

__all__ = [
    "NULL_BLOCK", "SCALE_BYTES", "KVGroupLayout", "KVPageSpec", "PagedBatch", "allocate_pages", "compute_slots",
    "copy_blocks", "is_quant_dtype", "kv_bytes_per_block", "kv_bytes_per_token", "kv_bytes_per_token_raw",
    "kv_group_layout", "layer_matmul_for", "layer_windows", "layout_for_impl", "make_paged_batch", "page_spec",
    "page_spec_for_budget", "paged_decode_step", "paged_forward", "paged_prefill_step", "resolve_kv_dtype",
    "static_layer_impl",
]
