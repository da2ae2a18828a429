"""The Llama forward over the paged KV cache, through `pallas_kernels` only.

Page layout (owned by `pallas_kernels`): one array per model,
`pages[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]` (axis 1: 0=K, 1=V).
With KV-cache groups (`KVGroupLayout`, a windowed model's grouped manager) axis 0 holds `slots`
layer slots instead of num_layers: a block belongs to one group and holds that group's layers,
layer l at `pages[layout.layer_slot[l]]`, read through `tables[layout.layer_group[l]]`.
Block 0 is the reserved null block: padding tokens write into it and it is never read as data.
The slot of the token at position p of a sequence is `table[p // bs] * bs + p % bs`.

One step is a pure function `(graphdef, state, pages, batch, tokens) -> (logits, pages)`, jitted once
per shape with `pages` donated:
  - `paged_prefill_step`: a chunk of T tokens per sequence (K/V written, then paged prefill attention);
  - `paged_decode_step`: one token per sequence (K/V written, then paged decode attention).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.typing import ArrayLike, DTypeLike

from paged_kv import pallas_kernels as pk
from paged_kv.models.protocol import (
    AttentionBackend,
    LayerMatmul,
    ModelFacts,
    attend_options,
    check_model,
    model_facts,
)
from paged_kv.pallas_kernels import IMPLS
from paged_kv.pallas_kernels.quant import KV_DTYPES, QuantPages, is_quant
from paged_kv.pallas_kernels.reference import Projections, StackedBiases, StackedWeights

if TYPE_CHECKING:
    from paged_kv.models.config import LlamaConfig

NULL_BLOCK = pk.NULL_BLOCK


# ---------------------------------------------------------------------------- KV-cache groups
@dataclasses.dataclass(frozen=True)
class KVGroupLayout:
    """Which KV-cache group and which page slot each layer of a model uses (hashable, static).

    vLLM 0.33's rule for layers of one page size (`_get_kv_cache_groups_uniform_page_size`):
    layers with the same attention (full, or a window of W tokens) form a kind, kinds in the order
    of their first layer; every group holds the same number of layers, `slots`: the smallest
    kind's layer count, or the largest's when that is under 1.5 times the smallest. A kind of `n`
    layers splits into `ceil(n / slots)` groups, group `i` taking the kind's layers `i`,
    `i + ceil(n / slots)`, ... (strided); a group with fewer than `slots` layers leaves its last
    slots unused (padding). One kind is one group of every layer: a model without windows gets
    today's single full group, with slot `l` for layer `l`.

    So one block id names one page slice of `slots` layers, the same bytes in every group: layer
    `l` writes and reads `pages[layer_slot[l]]` at the slots of `tables[layer_group[l]]`.

    Attributes:
      group_windows: per group, its window in tokens (0: full attention); the manager's groups
        are `paged_kv.engine.kv_cache_groups(model)` (`Group("window", w)` or `Group("full")`
        each; the models layer does not import the block manager's types).
      layer_group: per layer, the index of its group.
      layer_slot: per layer, its slot (0 <= slot < `slots`) in its group's blocks.
      slots: layers per group, the leading axis of the pages.
    """

    group_windows: tuple[int, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    slots: int

    def __post_init__(self) -> None:
        if len(self.layer_group) != len(self.layer_slot) or not self.layer_group:
            raise ValueError(f"layer_group ({len(self.layer_group)} layers) and layer_slot "
                             f"({len(self.layer_slot)}) must name the same layers, at least one")
        if sorted(set(zip(self.layer_group, self.layer_slot))) != sorted(zip(self.layer_group, self.layer_slot)):
            raise ValueError("two layers share a (group, slot)")
        for name, vals, hi in (("layer_group", self.layer_group, len(self.group_windows)),
                               ("layer_slot", self.layer_slot, self.slots)):
            if any(v < 0 or v >= hi for v in vals):
                raise ValueError(f"{name}={vals} must lie in [0, {hi})")

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def grouped(self) -> bool:
        """Whether the manager runs its grouped forms (`ManagerConfig.grouped`): any layout but
        one full group."""
        return self.group_windows != (0,)

    def group_layers(self, g: int) -> tuple[int, ...]:
        """The layers of group `g`, in slot order (padding slots left out)."""
        pairs = zip(self.layer_group, self.layer_slot)
        return tuple(layer for _, layer in sorted((s, layer) for layer, (gg, s) in enumerate(pairs) if gg == g))

    @classmethod
    def single(cls, num_layers: int) -> KVGroupLayout:
        """One full group of `num_layers` layers, layer `l` in slot `l` (the pages and tables of
        a manager without groups)."""
        return cls((0,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def layer_windows(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig
                  | tuple[int, ...]) -> tuple[int, ...]:
    """Each layer's attention window (0: full) as the model attends: a `LlamaConfig`'s (or a
    module's `config`'s) `attend_windows`; a tuple of ints as given; every layer full for a model
    or `ModelFacts` that states no windows."""
    if isinstance(model, (tuple, list)) and all(isinstance(w, (int, np.integer)) for w in model):
        windows = tuple(int(w) for w in model)
        if not windows or any(w < 0 for w in windows):
            raise ValueError(f"windows={windows} must be one int >= 0 per layer (0: full attention)")
        return windows
    from paged_kv.models.config import LlamaConfig
    if isinstance(model, ModelFacts):
        return (0,) * model.num_layers
    if isinstance(model, LlamaConfig):
        return tuple(model.attend_windows)
    module = nnx.merge(*model) if isinstance(model, tuple) else model
    cfg = getattr(module, "config", None)
    if cfg is not None and hasattr(cfg, "attend_windows"):
        return tuple(int(w) for w in cfg.attend_windows)
    return (0,) * model_facts(module).num_layers


def kv_group_layout(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig
                    | tuple[int, ...]) -> KVGroupLayout:
    """The `KVGroupLayout` of `model` (anything `layer_windows` takes), by vLLM 0.33's rule (see
    `KVGroupLayout`). Gemma 3-shaped, 5 local : 1 global, 6 layers: 6 groups of 1 layer (5 window
    groups, then the full one), pages `[1, 2, kvh, nb, bs, hd]`; Gemma 2, 4 alternating layers: a
    window group of layers (0, 2) and a full group of (1, 3); Mistral (a window on every layer):
    one window group of every layer; no window: `KVGroupLayout.single(num_layers)`."""
    windows = layer_windows(model)
    kinds: dict[int, list[int]] = {}
    for layer, w in enumerate(windows):
        kinds.setdefault(w, []).append(layer)
    counts = [len(v) for v in kinds.values()]
    slots = min(counts)
    if max(counts) < 1.5 * min(counts):  # few padding slots: one group per kind
        slots = max(counts)
    groups: list[int] = []
    layer_group = [0] * len(windows)
    layer_slot = [0] * len(windows)
    for w, layers in kinds.items():
        n = -(-len(layers) // slots)
        for i in range(n):
            for s, layer in enumerate(layers[i::n]):
                layer_group[layer], layer_slot[layer] = len(groups), s
            groups.append(w)
    return KVGroupLayout(tuple(groups), tuple(layer_group), tuple(layer_slot), slots)


# ---------------------------------------------------------------------------- batch metadata
@struct.dataclass
class PagedBatch:
    """Per-step batch metadata (all int32; B sequences, T tokens per sequence this step).

    Attributes:
      block_tables: int32[B, M] physical block ids of each sequence, in logical order; unused
        entries hold NULL_BLOCK (0).
      q_start: int32[B] position of the first token of this step (= tokens already cached).
      q_lens: int32[B] valid tokens this step, in [0, T]; 0 marks a padding row.
      slots: int32[B, T] flat KV slot of each token (block_id * block_size + offset); tokens with
        t >= q_lens[b] point into the null block.
      lengths: int32[B] tokens with K/V after this step (q_start + q_lens); 0 for padding rows.

    With KV-cache groups (a grouped manager: `KVGroupLayout`), `block_tables` is int32[G, B, M]
    and `slots` int32[G, B, T]: every group's table and slots (`grouped`); the forward then maps
    each layer to its group's.
    """

    block_tables: jax.Array
    q_start: jax.Array
    q_lens: jax.Array
    slots: jax.Array
    lengths: jax.Array

    @property
    def grouped(self) -> bool:
        """Whether the batch holds one table per KV-cache group (`block_tables` [G, B, M])."""
        return self.block_tables.ndim == 3

    @property
    def positions(self) -> jax.Array:
        """int32[B, T] position of each token (meaningful where t < q_lens)."""
        t = self.slots.shape[-1]
        return self.q_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def compute_slots(block_tables: jax.Array, positions: jax.Array, valid: jax.Array, block_size: int) -> jax.Array:
    """slot = table[pos // bs] * bs + pos % bs where `valid`, else a slot in the null block.

    block_tables int32[B, M], positions int32[B, T], valid bool[B, T] -> int32[B, T]. Positions past
    the table (pos // bs >= M) are treated as invalid (null block) instead of wrapping.
    """
    m = block_tables.shape[1]
    logical = positions // block_size
    ok = valid & (logical < m) & (positions >= 0)
    block = jnp.take_along_axis(block_tables, jnp.clip(logical, 0, m - 1), axis=1)
    slots = block * block_size + positions % block_size
    return jnp.where(ok, slots, NULL_BLOCK * block_size + (positions % block_size)).astype(jnp.int32)


def make_paged_batch(block_tables: ArrayLike, q_start: ArrayLike, q_lens: ArrayLike, num_tokens: int,
                     block_size: int) -> PagedBatch:
    """Build the metadata for a step of `num_tokens` tokens per sequence (T; 1 for decode).
    `block_tables` int32[B, M], or int32[G, B, M] with KV-cache groups (slots then [G, B, T])."""
    block_tables = jnp.asarray(block_tables, jnp.int32)
    q_start = jnp.asarray(q_start, jnp.int32)
    q_lens = jnp.asarray(q_lens, jnp.int32)
    t = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
    positions = q_start[:, None] + t
    valid = t < q_lens[:, None]
    if block_tables.ndim == 3:
        slots = jax.vmap(lambda tables: compute_slots(tables, positions, valid, block_size))(block_tables)
    else:
        slots = compute_slots(block_tables, positions, valid, block_size)
    return PagedBatch(
        block_tables=block_tables, q_start=q_start, q_lens=q_lens, slots=slots,
        lengths=jnp.where(q_lens > 0, q_start + q_lens, 0).astype(jnp.int32))


# ---------------------------------------------------------------------------- forward
def _make_attend(batch: PagedBatch, impl: str, decode: bool, mesh=None,
                 head_dim: int | None = None, batch_invariant: bool = False,
                 layout: KVGroupLayout | None = None) -> AttentionBackend:
    """The `attend` of `paged_kv.models.protocol.PagedModel` over the paged cache, as an
    `AttentionBackend`: its callable writes k/v at `batch.slots`, then runs paged decode or prefill
    attention with the call's options (scale, soft_cap, alibi_slopes, window; anything else raises
    ValueError naming it).

    Its plan: `layer_matmul` is `layer_matmul_for(impl, head_dim, mesh)` (the Pallas projection
    that reads a stacked weight's layer in place, on one GPU), `static_layer` is
    `static_layer_impl(impl, head_dim, mesh)` (the Pallas kernels over a mesh); `layout_for_impl`
    names the layout each gives the Llama. The kernels take the layer as an int32 operand either
    way, so every layer calls one compiled kernel per kind. `batch_invariant`: the plan's
    `batch_invariant`, and the attention's (`paged_kv.pallas_kernels.invariant`).

    `layout` (a grouped `batch`): layer `l` writes and attends in page slot `layout.layer_slot[l]`
    with group `layout.layer_group[l]`'s tables and slots; a traced layer (the scan's int32) looks
    both up in small constant int32 arrays."""
    plan = dict(static_layer=static_layer_impl(impl, head_dim, mesh),
                layer_matmul=layer_matmul_for(impl, head_dim, mesh, batch_invariant))
    if batch_invariant:
        plan["batch_invariant"] = True

    def attend_local(layer, q, k, v, pages, batch, slopes, *, scale=None, soft_cap=None, window=None):
        b, t, _, _ = q.shape
        kvh, e = k.shape[2], k.shape[3]
        if is_quant(pages):
            # Quantized pages: attention computes in the model's dtype (q's); write_kv quantizes
            # the float k/v rows as it writes them (one scale per token and KV head).
            cdt = q.dtype
        else:
            cdt = pages.dtype
            q = q.astype(cdt)
        tables, slots = batch.block_tables, batch.slots
        if layout is not None:
            if isinstance(layer, (int, np.integer)):
                group, layer = layout.layer_group[layer], layout.layer_slot[layer]
            else:
                group = jnp.asarray(layout.layer_group, jnp.int32)[layer]
                layer = jnp.asarray(layout.layer_slot, jnp.int32)[layer]
            tables, slots = tables[group], slots[group]
        pages = pk.write_kv(pages, layer, k.reshape(b * t, kvh, e).astype(cdt),
                            v.reshape(b * t, kvh, e).astype(cdt), slots.reshape(b * t), impl=impl)
        # Knobs are passed only when set: without them the kernels compile exactly as before.
        knobs = {} if soft_cap is None else {"soft_cap": soft_cap}
        if slopes is not None:
            knobs["alibi_slopes"] = slopes
        if batch_invariant:
            knobs["batch_invariant"] = True
        if window is not None:
            knobs["window"] = window
        if decode:
            out = pk.paged_decode_attention(q[:, 0], pages, layer, tables, batch.lengths,
                                            scale=scale, impl=impl, **knobs)
            out = jnp.where((batch.q_lens > 0)[:, None, None], out, 0)[:, None]
        else:
            out = pk.paged_prefill_attention(q, pages, layer, tables, batch.q_start, batch.q_lens,
                                             scale=scale, impl=impl, **knobs)
        return out, pages

    if mesh is None:
        def attend(layer, q, k, v, pages, **options):
            options = attend_options(options)
            slopes = options.pop("alibi_slopes", None)
            return attend_local(layer, q, k, v, pages, batch, slopes, **options)

        return AttentionBackend(attend, **plan)

    from paged_kv.models.sharding import AXIS, pages_spec

    # Each device writes and attends over its own KV heads (and the query heads that read them):
    # block ids are global and the metadata is replicated, so nothing crosses devices here. ALiBi
    # slopes are per query head, so they are split like the query heads.
    heads = P(None, None, AXIS, None)

    def attend(layer, q, k, v, pages, **options):
        options = attend_options(options)
        slopes = options.pop("alibi_slopes", None)
        fn = jax.shard_map(functools.partial(attend_local, layer, **options), mesh=mesh,
                           in_specs=(heads, heads, heads, pages_spec(pages), P(), None if slopes is None else P(AXIS)),
                           out_specs=(heads, pages_spec(pages)), check_vma=False)
        return fn(q, k, v, pages, batch, slopes)

    return AttentionBackend(attend, **plan)


def static_layer_impl(impl: str, head_dim: int | None = None, mesh: Mesh | None = None) -> bool:
    """True when a model's layers should run unrolled on `per_layer` weights (the paged
    `AttentionBackend`'s `static_layer`): `impl` (as `paged_kv.pallas_kernels.resolve_impl` resolves it: "auto" is
    "pallas" on a GPU) runs the Pallas kernels and `mesh` is set (tensor parallelism). There the
    projections stay XLA matmuls, which GSPMD partitions, and an unrolled forward on per-layer
    arrays is the layout in which XLA:GPU copies no weight. On one device the Pallas kernels scan
    over stacked weights instead (`layer_matmul_for`)."""
    return mesh is not None and pk.resolve_impl(impl, head_dim) != "reference"


def layer_matmul_for(impl: str, head_dim: int | None = None, mesh: Mesh | None = None,
                     batch_invariant: bool = False) -> LayerMatmul | None:
    """The paged `AttentionBackend`'s `layer_matmul` (`paged_kv.models.protocol`): on one device with
    the Pallas kernels, `paged_kv.pallas_kernels.layer_matmul` in that impl ("pallas" or "interpret"), so
    the scan over stacked layers reads each layer's weights in place (XLA:GPU would copy the
    slices a scan takes, every step); None otherwise (the reference kernels on a CPU scan with
    XLA's slices, which XLA:CPU reads in place or copies cheaply; a mesh unrolls instead,
    `static_layer_impl`). `batch_invariant`: the kernel's fixed-tile plan (a row's bits independent
    of the batch: `paged_kv.pallas_kernels.stacked_matmul.invariant_plan`)."""
    resolved = pk.resolve_impl(impl, head_dim)
    if mesh is not None or resolved == "reference":
        return None
    if batch_invariant:
        return functools.partial(_layer_matmul, impl=resolved, batch_invariant=True)
    return functools.partial(_layer_matmul, impl=resolved)


def _layer_matmul(x: jax.Array, w: StackedWeights, layer: int | jax.Array, *, scale: jax.Array | None = None,
                  bias: StackedBiases = None, impl: str, batch_invariant: bool = False) -> Projections:
    """`paged_kv.pallas_kernels.layer_matmul` in `impl` (one weight, or a group: a tuple), or its XLA
    reference for a weight (a group with one) whose K or N is not a multiple of 16 (the kernel's
    smallest tile; such a weight's slice is then copied on a GPU, as any scan's would be)."""
    from paged_kv.pallas_kernels.stacked_matmul import supported
    ws = w if isinstance(w, (tuple, list)) else (w,)
    use = impl if all(supported(wi.shape[1], wi.shape[2]) for wi in ws) else "reference"
    knobs = {"batch_invariant": True} if batch_invariant else {}
    return pk.layer_matmul(x, w, layer, scale=scale, bias=bias, impl=use, **knobs)


def layout_for_impl(model: nnx.Module | tuple[nnx.GraphDef, nnx.State], impl: str,
                    mesh: Mesh | None = None) -> nnx.Module | tuple[nnx.GraphDef, nnx.State]:
    """`model` (a `paged_kv.models.protocol.PagedModel` or its `(graphdef, state)` split; same kind back)
    in the layer layout that suits `impl` and `mesh`. The three ways a `paged_kv.models.Llama` runs
    its layers, and where each is chosen (the engines call this once, outside `jit`, through
    `paged_kv.engine.call_setup.layer_layout`; the backend's plan comes from `_make_attend`):

      impl resolves to   mesh   layout      loop      projections
      "reference" (CPU)  any    stacked     scan      XLA einsums on the scan's weight slices
      Pallas             none   stacked     scan      `layer_matmul_for`: in place on the stacked weights
      Pallas             tp     per_layer   unrolled  XLA einsums (GSPMD partitions them)

    So a stacked Llama becomes `paged_kv.models.llama.per_layer` exactly when `static_layer_impl`
    holds; anything else is returned as is (other models have their own layout).

    Converting copies the decoder-layer weights once (see `per_layer`): callers that keep the
    result should drop the stacked model. Weights that are tracers (a call under the caller's own
    `jit`) are left as they are: slicing them there would be the same slice in the program."""
    from paged_kv.models.llama import Llama, is_per_layer, per_layer

    module = nnx.merge(*model) if isinstance(model, tuple) else model
    if not isinstance(module, Llama) or is_per_layer(module):
        return model
    if not static_layer_impl(impl, module.config.head_dim, mesh):
        return model
    if any(isinstance(w, jax.core.Tracer) for w in jax.tree.leaves(nnx.state(module))):
        return model
    return per_layer(model)


def copy_blocks(pages: jax.Array | QuantPages, src: jax.Array, dst: jax.Array, *, impl: str = "auto",
                mesh: Mesh | None = None) -> jax.Array | QuantPages:
    """`paged_kv.pallas_kernels.copy_blocks`, run per device under `shard_map` when `mesh` is given (pages
    sharded on KV heads hold every block, so a block copy is device-local). `QuantPages` move their
    scales with the blocks (sharded on KV heads like their values: `sharding.pages_spec`)."""
    if mesh is None:
        return pk.copy_blocks(pages, src, dst, impl=impl)
    from paged_kv.models.sharding import pages_spec
    spec = pages_spec(pages)
    fn = jax.shard_map(functools.partial(pk.copy_blocks, impl=impl), mesh=mesh, in_specs=(spec, P(), P()),
                       out_specs=spec, check_vma=False)
    return fn(pages, src, dst)


def _check_mesh(model, mesh) -> None:
    if mesh is not None:
        from paged_kv.models.sharding import check_on_mesh
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
                         f"(group windows {layout.group_windows})")
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


# ---------------------------------------------------------------------------- page sizing
# Bytes of one quantized page scale (float32), stored per token per KV head for K and for V.
SCALE_BYTES = 4


def resolve_kv_dtype(kv_dtype: DTypeLike | None, model_dtype: DTypeLike) -> str:
    """The pages' storage dtype as a string: `model_dtype` for None or "auto" (plain pages), "int8"
    for "int8", "float8_e4m3fn" for "fp8" / "float8_e4m3fn", or a float dtype (plain pages in it).

    Raises:
      ValueError: naming `kv_dtype` and the accepted ones.
    """
    if kv_dtype is None or (isinstance(kv_dtype, str) and kv_dtype == "auto"):
        return str(jnp.dtype(model_dtype))
    if isinstance(kv_dtype, str) and kv_dtype == "fp8":
        kv_dtype = jnp.float8_e4m3fn
    try:
        dt = jnp.dtype(kv_dtype)
    except TypeError:
        dt = None
    if dt is None or (dt not in KV_DTYPES and dt not in (jnp.float32, jnp.bfloat16, jnp.float16)):
        raise ValueError(f"kv_dtype={kv_dtype!r} must be 'auto' (the model's dtype), 'int8', 'fp8' "
                         "('float8_e4m3fn') or one of float32/bfloat16/float16")
    return str(dt)


def is_quant_dtype(dtype: DTypeLike) -> bool:
    """Whether pages stored in `dtype` are `QuantPages` (int8 or float8_e4m3fn)."""
    return jnp.dtype(dtype) in KV_DTYPES


@dataclasses.dataclass(frozen=True)
class KVPageSpec:
    """Shape and size of the KV pages of one model. `num_layers` is the pages' leading axis: the
    model's layers, or a grouped `KVGroupLayout`'s `slots` (layers per group), so a block's bytes
    are those of `num_layers` layers.

    `dtype` is the model's (compute) dtype; `kv_dtype` the pages' storage dtype (None: `dtype`).
    With `kv_dtype` int8 or float8_e4m3fn (`quantized`) the pages are a
    `paged_kv.pallas_kernels.QuantPages`: values of `shape` in `kv_dtype` plus float32 scales
    `shape[:-1]` (one per token per KV head, for K and for V), both counted in the bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    dtype: str
    kv_dtype: str | None = None

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 2 (block 0 is the reserved null block)")
        object.__setattr__(self, "kv_dtype", resolve_kv_dtype(self.kv_dtype, self.dtype))

    @property
    def quantized(self) -> bool:
        """Whether the pages are `QuantPages` (`kv_dtype` int8 or float8_e4m3fn)."""
        return is_quant_dtype(self.kv_dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """The (values') shape `[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]`."""
        return (self.num_layers, 2, self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token_raw(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    @property
    def usable_tokens(self) -> int:
        """Token capacity excluding the null block."""
        return (self.num_blocks - 1) * self.block_size


def kv_bytes_per_token_raw(num_layers: int, num_kv_heads: int, head_dim: int, dtype: DTypeLike) -> int:
    """K and V bytes of one token in pages of `dtype`: `head_dim` elements per layer, K|V and KV
    head, plus (int8 / float8_e4m3fn) one float32 scale per layer, K|V and KV head."""
    per_head = head_dim * np.dtype(jnp.dtype(dtype)).itemsize
    if is_quant_dtype(dtype):
        per_head += SCALE_BYTES
    return num_layers * 2 * num_kv_heads * per_head


def _storage_dtype(f: ModelFacts, dtype: DTypeLike | None, kv_dtype: DTypeLike | None) -> str:
    """The pages' storage dtype: `kv_dtype` when given (resolved against the model's dtype), else
    `dtype`, else the model's."""
    if kv_dtype is not None:
        return resolve_kv_dtype(kv_dtype, f.dtype)
    return str(jnp.dtype(f.dtype if dtype is None else dtype))


def kv_bytes_per_token(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig,
                       dtype: DTypeLike | None = None, *, kv_dtype: DTypeLike | None = None) -> int:
    """K and V bytes of one token over all layers (Llama 3.1 8B bf16: 128 KiB; int8 with its
    scales: 64 KiB + 1 KiB). `model`: a `paged_kv.models.protocol.PagedModel` (or its split, its
    `ModelFacts`, a `LlamaConfig`). `kv_dtype` (as `resolve_kv_dtype` reads it) wins over `dtype`;
    both default to the model's dtype."""
    f = model_facts(model)
    return kv_bytes_per_token_raw(f.num_layers, f.num_kv_heads, f.head_dim, _storage_dtype(f, dtype, kv_dtype))


def kv_bytes_per_block(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig,
                       block_size: int = 16, dtype: DTypeLike | None = None,
                       layout: KVGroupLayout | None = None, *, kv_dtype: DTypeLike | None = None) -> int:
    """Bytes of one block (Llama 3.1 8B bf16, 16 tokens: 2 MiB). With a `layout` (a grouped
    manager's, `kv_group_layout`), a block holds `layout.slots` layers: Gemma 3's 5 : 1 layout
    makes a block 1/6 of the model's per-block bytes, the same in every group. `kv_dtype` as in
    `kv_bytes_per_token` (quantized pages count their float32 scales)."""
    if layout is None:
        return kv_bytes_per_token(model, dtype, kv_dtype=kv_dtype) * block_size
    f = model_facts(model)
    _check_layout(f, layout)
    return kv_bytes_per_token_raw(layout.slots, f.num_kv_heads, f.head_dim, _storage_dtype(f, dtype, kv_dtype)
                                  ) * block_size


def _check_layout(facts: ModelFacts, layout: KVGroupLayout | None) -> None:
    if layout is not None and layout.num_layers != facts.num_layers:
        raise ValueError(f"layout has {layout.num_layers} layers; the model has num_layers={facts.num_layers}")


def _spec_dtypes(f: ModelFacts, dtype: DTypeLike | None, kv_dtype: DTypeLike | None) -> tuple[str, str]:
    """`(dtype, kv_dtype)` of a `KVPageSpec`: a quantized `dtype` (the old way to name the pages'
    dtype) counts as `kv_dtype` with the model's compute dtype."""
    storage = _storage_dtype(f, dtype, kv_dtype)
    compute = str(jnp.dtype(f.dtype if dtype is None or is_quant_dtype(dtype) else dtype))
    if kv_dtype is not None and is_quant_dtype(storage):
        compute = str(jnp.dtype(f.dtype))
    return compute, storage


def page_spec_for_budget(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig, *,
                         block_size: int = 16, budget_bytes: int | None = None, memory_fraction: float | None = None,
                         device: jax.Device | None = None, dtype: DTypeLike | None = None,
                         layout: KVGroupLayout | None = None, kv_dtype: DTypeLike | None = None) -> KVPageSpec:
    """Largest page pool for `model` (as in `kv_bytes_per_token`; blocks of `layout.slots` layers
    with a grouped `layout`, see `kv_bytes_per_block`) fitting a budget: `budget_bytes`,
    or `memory_fraction` of the device's memory limit (`device.memory_stats()["bytes_limit"]`; first
    device when `device` is None). The null block counts against the budget. `kv_dtype`: the
    pages' storage dtype (`resolve_kv_dtype`: "auto", "int8", "fp8", ...); int8 / fp8 pages with
    their scales hold about 2x the blocks of bfloat16 and 4x of float32 (`head_dim` bytes plus a
    4-byte scale per row instead of 2 or 4 bytes per element). Raises ValueError when fewer
    than 2 blocks fit."""
    f = model_facts(model)
    if (budget_bytes is None) == (memory_fraction is None):
        raise ValueError("give exactly one of budget_bytes and memory_fraction")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if memory_fraction is not None:
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction={memory_fraction} must be in (0, 1]")
        device = jax.devices()[0] if device is None else device
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ValueError(f"device {device} reports no memory limit; pass budget_bytes instead")
        budget_bytes = int(stats["bytes_limit"] * memory_fraction)
    compute, storage = _spec_dtypes(f, dtype, kv_dtype)
    per_block = kv_bytes_per_block(f, block_size, storage, layout)
    num_blocks = int(budget_bytes) // per_block
    if num_blocks < 2:
        raise ValueError(f"budget of {budget_bytes} bytes holds {num_blocks} blocks of {per_block} bytes; "
                         "need >= 2 (block 0 is the reserved null block)")
    layers = f.num_layers if layout is None else layout.slots
    return KVPageSpec(layers, f.num_kv_heads, f.head_dim, num_blocks, block_size, compute, storage)


def page_spec(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig, num_blocks: int,
              block_size: int = 16, dtype: DTypeLike | None = None,
              layout: KVGroupLayout | None = None, *, kv_dtype: DTypeLike | None = None) -> KVPageSpec:
    """Pages for `model` (a `paged_kv.models.protocol.PagedModel`, its split, its `ModelFacts` or a
    `LlamaConfig`): its layers (`layout.slots` with a `layout`: a grouped manager's pages, from
    `paged_kv.engine.call_setup.group_layout(model, manager)`), KV heads, head_dim and dtype (or `dtype`).
    `kv_dtype` ("auto", "int8", "fp8", "float8_e4m3fn", or a float dtype; `resolve_kv_dtype`):
    the pages' storage dtype; int8 / float8_e4m3fn makes `allocate_pages` return `QuantPages`."""
    f = model_facts(model)
    _check_layout(f, layout)
    layers = f.num_layers if layout is None else layout.slots
    compute, storage = _spec_dtypes(f, dtype, kv_dtype)
    return KVPageSpec(layers, f.num_kv_heads, f.head_dim, num_blocks, block_size, compute, storage)


def allocate_pages(spec: KVPageSpec, device: jax.Device | None = None) -> jax.Array | QuantPages:
    """Zeroed pages of `spec.shape` in `spec.kv_dtype` (optionally placed on `device`): a plain
    array, or for a quantized spec a `QuantPages` (int8 / float8_e4m3fn values, float32 scales
    `shape[:-1]`, all zero: every row dequantizes to exactly 0)."""
    if spec.quantized:
        pages = QuantPages.zeros(spec.shape, spec.kv_dtype)
    else:
        pages = jnp.zeros(spec.shape, jnp.dtype(spec.kv_dtype))
    return pages if device is None else jax.device_put(pages, device)
