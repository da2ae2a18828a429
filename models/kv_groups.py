"""KV-cache groups: which group and which page slot each layer of a model uses.

With KV-cache groups (a windowed model's grouped manager) the pages' leading axis holds `slots`
layer slots instead of num_layers: a block belongs to one group and holds that group's layers,
layer l at `pages[layout.layer_slot[l]]`, read through `tables[layout.layer_group[l]]`
(`paged_kv.models.paged`). Without windows a model has one full group of every layer
(`KVGroupLayout.single`), the pages and tables of a manager without groups.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from paged_kv.attention_spec import AttentionSpec, Full, SlidingWindow, as_spec
from paged_kv.models.config import LlamaConfig
from paged_kv.models.protocol import ModelFacts, model_facts


@dataclasses.dataclass(frozen=True)
class KVGroupLayout:
    """Which KV-cache group and which page slot each layer of a model uses (hashable, static).

    vLLM 0.33's rule for layers of one page size (`_get_kv_cache_groups_uniform_page_size`):
    layers with the same attention (`AttentionSpec`: full, a window of W tokens, a chunk of C)
    form a kind, kinds in the order
    of their first layer; every group holds the same number of layers, `slots`: the smallest
    kind's layer count, or the largest's when that is under 1.5 times the smallest. A kind of `n`
    layers splits into `ceil(n / slots)` groups, group `i` taking the kind's layers `i`,
    `i + ceil(n / slots)`, ... (strided); a group with fewer than `slots` layers leaves its last
    slots unused (padding). One kind is one group of every layer: a model without windows gets
    today's single full group, with slot `l` for layer `l`.

    So one block id names one page slice of `slots` layers, the same bytes in every group: layer
    `l` writes and reads `pages[layer_slot[l]]` at the slots of `tables[layer_group[l]]`.

    Attributes:
      group_specs: per group, its `AttentionSpec` (an int is taken as its code: W a window, -C a
        chunk, 0 full); the manager's groups are `paged_kv.engine.kv_cache_groups(model)`
        (`Group.of(spec)` each; the models layer does not import the block manager's types).
      layer_group: per layer, the index of its group.
      layer_slot: per layer, its slot (0 <= slot < `slots`) in its group's blocks.
      slots: layers per group, the leading axis of the pages.
    """

    group_specs: tuple[AttentionSpec, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    slots: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_specs", tuple(as_spec(s) for s in self.group_specs))
        if len(self.layer_group) != len(self.layer_slot) or not self.layer_group:
            raise ValueError(f"layer_group ({len(self.layer_group)} layers) and layer_slot "
                             f"({len(self.layer_slot)}) must name the same layers, at least one")
        if sorted(set(zip(self.layer_group, self.layer_slot))) != sorted(zip(self.layer_group, self.layer_slot)):
            raise ValueError("two layers share a (group, slot)")
        for name, vals, hi in (("layer_group", self.layer_group, len(self.group_specs)),
                               ("layer_slot", self.layer_slot, self.slots)):
            if any(v < 0 or v >= hi for v in vals):
                raise ValueError(f"{name}={vals} must lie in [0, {hi})")

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def num_groups(self) -> int:
        return len(self.group_specs)

    @property
    def group_windows(self) -> tuple[int, ...]:
        """Per group, its sliding window in tokens (0: full or chunked attention)."""
        return tuple(s.window if isinstance(s, SlidingWindow) else 0 for s in self.group_specs)

    @property
    def grouped(self) -> bool:
        """Whether the manager runs its grouped forms (`ManagerConfig.grouped`): any layout but
        one full group."""
        return self.group_specs != (Full(),)

    def group_layers(self, g: int) -> tuple[int, ...]:
        """The layers of group `g`, in slot order (padding slots left out)."""
        pairs = zip(self.layer_group, self.layer_slot)
        return tuple(layer for _, layer in sorted((s, layer) for layer, (gg, s) in enumerate(pairs) if gg == g))

    @classmethod
    def single(cls, num_layers: int) -> KVGroupLayout:
        """One full group of `num_layers` layers, layer `l` in slot `l` (the pages and tables of
        a manager without groups)."""
        return cls((Full(),), (0,) * num_layers, tuple(range(num_layers)), num_layers)


ModelLike = nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig | tuple[int | AttentionSpec, ...]
"""What `layer_specs` and `kv_group_layout` take."""


def layer_specs(model: ModelLike) -> tuple[AttentionSpec, ...]:
    """Each layer's `AttentionSpec` as the model attends: a `LlamaConfig`'s (or a module's
    `config`'s) `attend_specs`; a tuple of specs, or of ints (a window W >= 1, 0 full attention;
    a negative int is a chunk's code, -C), as given; every layer full for a model or `ModelFacts`
    that states no kinds."""
    if isinstance(model, (tuple, list)) and all(isinstance(w, (int, np.integer, AttentionSpec)) for w in model):
        if not model:
            raise ValueError("per-layer attention kinds must name at least one layer, got ()")
        return tuple(as_spec(w) for w in model)
    if isinstance(model, ModelFacts):
        return (Full(),) * model.num_layers
    if isinstance(model, LlamaConfig):
        return tuple(model.attend_specs)
    module = nnx.merge(*model) if isinstance(model, tuple) else model
    cfg = getattr(module, "config", None)
    if cfg is not None and hasattr(cfg, "attend_specs"):
        return tuple(cfg.attend_specs)
    return (Full(),) * model_facts(module).num_layers


def layer_windows(model: ModelLike) -> tuple[int, ...]:
    """Each layer's sliding window (0: full or chunked) as the model attends (`layer_specs`)."""
    return tuple(s.window if isinstance(s, SlidingWindow) else 0 for s in layer_specs(model))


def kv_group_layout(model: ModelLike) -> KVGroupLayout:
    """The `KVGroupLayout` of `model` (anything `layer_specs` takes), by vLLM 0.33's rule (see
    `KVGroupLayout`). Gemma 3-shaped, 5 local : 1 global, 6 layers: 6 groups of 1 layer (5 window
    groups, then the full one), pages `[1, 2, kvh, nb, bs, hd]`; Gemma 2, 4 alternating layers: a
    window group of layers (0, 2) and a full group of (1, 3); Mistral (a window on every layer):
    one window group of every layer; no window: `KVGroupLayout.single(num_layers)`."""
    specs = layer_specs(model)
    kinds: dict[AttentionSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        kinds.setdefault(spec, []).append(layer)
    counts = [len(v) for v in kinds.values()]
    slots = min(counts)
    if max(counts) < 1.5 * min(counts):  # few padding slots: one group per kind
        slots = max(counts)
    groups: list[AttentionSpec] = []
    layer_group = [0] * len(specs)
    layer_slot = [0] * len(specs)
    for spec, layers in kinds.items():
        n = -(-len(layers) // slots)
        for i in range(n):
            for s, layer in enumerate(layers[i::n]):
                layer_group[layer], layer_slot[layer] = len(groups), s
            groups.append(spec)
    return KVGroupLayout(tuple(groups), tuple(layer_group), tuple(layer_slot), slots)

