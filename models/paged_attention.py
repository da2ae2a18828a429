"""The paged cache's `AttentionBackend`: the `attend` a model calls per layer, which writes the
layer's new K/V at the batch's slots and runs paged decode or prefill attention over the block
tables (`paged_kv.pallas_kernels`), on one device or per device under `jax.shard_map` over the
"tp" mesh axis, with the layer plan of `paged_kv.models.layer_layout`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from paged_kv import pallas_kernels as pk
from paged_kv.models.kv_groups import KVGroupLayout
from paged_kv.models.layer_layout import layer_matmul_of, plan_for
from paged_kv.models.paged_batch import PagedBatch
from paged_kv.models.protocol import AttentionBackend, attend_options
from paged_kv.models.tp_layout import AXIS, pages_spec
from paged_kv.pallas_kernels.quant import is_quant


def _make_attend(batch: PagedBatch, impl: str, decode: bool, mesh=None,
                 head_dim: int | None = None, batch_invariant: bool = False,
                 layout: KVGroupLayout | None = None) -> AttentionBackend:
    """The `attend` of `paged_kv.models.protocol.PagedModel` over the paged cache, as an
    `AttentionBackend`: its callable writes k/v at `batch.slots`, then runs paged decode or prefill
    attention with the call's options (scale, soft_cap, alibi_slopes, window; anything else raises
    ValueError naming it).

    Its plan comes from the execution plan (`layer_layout.plan_for(impl, head_dim, mesh,
    batch_invariant)`, made once): `layer_matmul` where its projections column says
    "layer_matmul" (the Pallas projection that reads a stacked weight's layer in place, on one
    GPU), `static_layer` where its layers column says "unrolled" (the Pallas kernels over a mesh);
    `layout_for_impl` names the layout each gives the Llama. The kernels take the layer as an int32 operand either
    way, so every layer calls one compiled kernel per kind. `batch_invariant`: the plan's
    `batch_invariant`, and the attention's (`paged_kv.pallas_kernels.invariant`).

    `layout` (a grouped `batch`): layer `l` writes and attends in page slot `layout.layer_slot[l]`
    with group `layout.layer_group[l]`'s tables and slots; a traced layer (the scan's int32) looks
    both up in small constant int32 arrays."""
    # The layers' kinds where the page layout states them (a grouped batch); otherwise the
    # kernel-level plan sees each call's kind.
    kinds = tuple(sorted({spec.kind for spec in layout.group_specs})) if layout is not None else ("full",)
    execution = plan_for(impl, head_dim, mesh, batch_invariant, kinds)
    plan = dict(static_layer=execution.layers == "unrolled", layer_matmul=layer_matmul_of(execution))
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
