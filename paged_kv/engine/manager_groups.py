"""The block manager's KV-cache groups of a model: its ``KVGroupLayout``
(``paged_kv.models.kv_groups``, vLLM 0.33's layer grouping) as the ``ManagerConfig.groups`` the
manager is built with, and the check that a manager's groups are the model's.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from paged_kv.config import DEFAULT_GROUPS, Group, ManagerConfig
from paged_kv.models.kv_groups import KVGroupLayout, kv_group_layout, layer_specs


def layout_groups(layout: KVGroupLayout) -> tuple[Group, ...]:
    """The ``ManagerConfig.groups`` of a ``KVGroupLayout``: ``Group.of(spec)`` for each group's
    ``AttentionSpec`` (``Group("window", W)``, ``Group("chunked", chunk=C)``, ``Group("full")``)."""
    return tuple(Group.of(spec) for spec in layout.group_specs)


def kv_cache_groups(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | Any) -> tuple[Group, ...]:
    """The KV-cache groups to build a windowed ``model``'s manager with
    (``ManagerConfig(groups=kv_cache_groups(model))``): those of
    ``paged_kv.models.kv_group_layout(model)``, vLLM 0.33's layer grouping. ``(Group("full"),)``
    for a model without windows. ``model``: anything ``kv_group_layout`` takes (a model, its
    split, a ``LlamaConfig``, per-layer windows), or a ``KVGroupLayout``."""
    return layout_groups(model if isinstance(model, KVGroupLayout) else kv_group_layout(model))


def manager_config(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | Any, **fields: Any) -> ManagerConfig:
    """A ``ManagerConfig`` for ``model`` whose groups come from the model
    (``kv_cache_groups(model)``: each layer's ``AttentionSpec`` stated once, in its config);
    ``fields`` are the other ``ManagerConfig`` fields (``num_blocks``, ``block_size``, ...). Passing
    ``groups`` too raises ``ValueError``: the model states them."""
    if "groups" in fields:
        raise ValueError(f"groups={fields['groups']!r}: manager_config takes the groups from the model "
                         "(build ManagerConfig(groups=...) directly to state them)")
    return ManagerConfig(groups=kv_cache_groups(model), **fields)


def group_layout(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | Any, manager: ManagerConfig
                 ) -> KVGroupLayout | None:
    """The pages' ``KVGroupLayout`` for a grouped ``manager``: ``kv_group_layout(model)``, whose
    groups must equal ``manager.groups`` (else ``ValueError`` naming both); None for the default
    single full group (pages of every layer, as without groups: a windowed model then keeps one
    full table per sequence and never reclaims)."""
    if not isinstance(manager, ManagerConfig):
        raise ValueError(f"manager must be a ManagerConfig, got {type(manager).__name__}")
    if manager.groups == DEFAULT_GROUPS:
        return None
    specs = layer_specs(model)
    layout = kv_group_layout(specs)
    if layout_groups(layout) != manager.groups:
        raise ValueError(f"manager groups={manager.groups!r} differ from the model's KV-cache groups "
                         f"{layout_groups(layout)!r} (paged_kv.engine.kv_cache_groups(model); layer kinds "
                         f"{specs})")
    return layout
