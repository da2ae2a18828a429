"""Placement of a call: the model split into ``(graphdef, weights)``, the model and pages put on
the call's tensor-parallel mesh (``paged_kv.models.sharding``), the layers in the layout the
kernels want (``paged_kv.models.layer_layout``), and the other inputs replicated over the mesh.
Outside ``jit`` only.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from paged_kv.models import sharding
from paged_kv.models.layer_layout import layout_for_impl
from paged_kv.models.protocol import ModelFacts, model_facts


def split_model(model: nnx.Module | tuple[nnx.GraphDef, nnx.State]) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, weights)`` from an NNX module or an already split pair."""
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nnx.GraphDef):
        return model
    if isinstance(model, nnx.Module):
        return nnx.split(model)
    raise ValueError(f"model must be an nnx.Module or a (graphdef, state) pair, got {type(model).__name__}")


def place(model: nnx.Module | tuple[nnx.GraphDef, nnx.State], pages: jax.Array, mesh: jax.sharding.Mesh | None
          ) -> tuple[nnx.GraphDef, nnx.State, ModelFacts, jax.Array, jax.sharding.Mesh | None]:
    """Resolve the mesh of a call and put the model and pages on it.

    ``mesh`` None: the mesh the pages are already sharded over (``paged_kv.models.sharding.shard``), or none
    (one device: nothing changes). Returns ``(graphdef, weights, facts, pages, mesh)``; with a mesh
    the model and pages are placed (a no-op when they already are), and ``facts`` (the model's
    ``paged_kv.models.protocol.ModelFacts``) are the placed model's (KV heads replicated when tp exceeds them).
    ValueError, before anything is traced, when the model does not implement the protocol.
    """
    graphdef, weights = split_model(model)
    facts = model_facts(model if isinstance(model, nnx.Module) else (graphdef, weights))
    mesh = sharding.mesh_of(pages) if mesh is None else mesh
    if mesh is None:
        return graphdef, weights, facts, pages, None
    sharding.tp_degree(mesh)
    (graphdef, weights), pages = sharding.shard((graphdef, weights), pages, mesh)
    return graphdef, weights, model_facts((graphdef, weights)), pages, mesh


def layer_layout(graphdef: nnx.GraphDef, weights: nnx.State, impl: str,
                 mesh: jax.sharding.Mesh | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, weights)`` in the layer layout for ``impl`` and ``mesh``
    (``paged_kv.models.layer_layout.layout_for_impl``): a stacked Llama becomes one array per layer when the
    kernels are Pallas over a tensor-parallel mesh, so the jitted programs hold no slice of a
    stacked weight (XLA:GPU copies each one on every step); on one device the layers stay
    stacked (the Pallas matmul reads them in place). Outside ``jit`` only; a conversion copies
    the decoder-layer weights once, so callers rebind their ``weights`` to the result and keep no
    reference to the stacked ones. Call after ``impl`` is checked (an unknown ``impl`` must
    raise before anything is copied)."""
    return layout_for_impl((graphdef, weights), impl, mesh)


def replicate_inputs(mesh: jax.sharding.Mesh | None, *arrays: Any) -> tuple[Any, ...]:
    """Arrays (block-manager state, prompts, keys) replicated over ``mesh``, or as given without one.
    Over several processes every process must pass the same values."""
    if mesh is None:
        return arrays
    return sharding.replicate(arrays, mesh)
