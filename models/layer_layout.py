"""How a model runs its layers over the paged cache, decided by the execution plan
(`paged_kv.pallas_kernels.plan`: its `layers` and `projections` columns) from the kernels' `impl`
and the mesh: stacked and scanned (the XLA reference, or the Pallas projection that reads
a stacked weight's layer in place on one GPU) or unrolled on per-layer weights (the Pallas
kernels over a tensor-parallel mesh). `layout_for_impl` has the table; the paged
`AttentionBackend`'s plan (`static_layer`, `layer_matmul`) comes from the functions here.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import Mesh

from paged_kv import pallas_kernels as pk
from paged_kv.models.llama import Llama, is_per_layer, per_layer
from paged_kv.models.protocol import LayerMatmul
from paged_kv.pallas_kernels import plan as execution_plan
from paged_kv.pallas_kernels.reference import Projections, StackedBiases, StackedWeights


def static_layer_impl(impl: str, head_dim: int | None = None, mesh: Mesh | None = None) -> bool:
    """True when a model's layers should run unrolled on `per_layer` weights (the paged
    `AttentionBackend`'s `static_layer`): `impl` (as `paged_kv.pallas_kernels.resolve_impl` resolves it: "auto" is
    "pallas" on a GPU) runs the Pallas kernels and `mesh` is set (tensor parallelism). There the
    projections stay XLA matmuls, which GSPMD partitions, and an unrolled forward on per-layer
    arrays is the layout in which XLA:GPU copies no weight. On one device the Pallas kernels scan
    over stacked weights instead (`layer_matmul_for`)."""
    return plan_for(impl, head_dim, mesh).layers == "unrolled"


def plan_for(impl: str, head_dim: int | None = None, mesh: Mesh | None = None,
             batch_invariant: bool = False, kinds: tuple[str, ...] = ("full",)) -> execution_plan.ExecutionPlan:
    """The execution plan (`paged_kv.pallas_kernels.plan.make_plan`) whose `layers` and `projections`
    columns lay a model out for `impl` on `mesh` (its `tp`: the mesh's size; the refusals of the
    other switches are the engines' and the kernels' to raise), for layers of attention `kinds`
    (`AttentionSpec.kind` names)."""
    tp = None if mesh is None else int(getattr(mesh, "size", 1))
    return execution_plan.make_plan(impl, tp=tp, head_dim=head_dim, batch_invariant=batch_invariant, kinds=kinds)


def layer_matmul_for(impl: str, head_dim: int | None = None, mesh: Mesh | None = None,
                     batch_invariant: bool = False) -> LayerMatmul | None:
    """The paged `AttentionBackend`'s `layer_matmul` (`paged_kv.models.protocol`): on one device with
    the Pallas kernels, `paged_kv.pallas_kernels.layer_matmul` in that impl ("pallas" or "interpret"), so
    the scan over stacked layers reads each layer's weights in place (XLA:GPU would copy the
    slices a scan takes, every step); None otherwise (the reference kernels on a CPU scan with
    XLA's slices, which XLA:CPU reads in place or copies cheaply; a mesh unrolls instead,
    `static_layer_impl`). `batch_invariant`: the kernel's fixed-tile plan (a row's bits independent
    of the batch: `paged_kv.pallas_kernels.stacked_matmul.invariant_plan`)."""
    return layer_matmul_of(plan_for(impl, head_dim, mesh, batch_invariant))


def layer_matmul_of(plan: execution_plan.ExecutionPlan) -> LayerMatmul | None:
    """`layer_matmul_for` from a made plan: the in-place `layer_matmul` where its projections column
    says so, else None."""
    if plan.projections != "layer_matmul":
        return None
    if plan.batch_invariant:
        return functools.partial(_layer_matmul, plan=plan, batch_invariant=True)
    return functools.partial(_layer_matmul, plan=plan)


def _layer_matmul(x: jax.Array, w: StackedWeights, layer: int | jax.Array, *, scale: jax.Array | None = None,
                  bias: StackedBiases = None, plan: execution_plan.ExecutionPlan,
                  batch_invariant: bool = False) -> Projections:
    """`paged_kv.pallas_kernels.layer_matmul` in the plan's impl (one weight, or a group: a tuple), or
    its XLA reference for a weight (a group with one) whose K or N is not a multiple of 16 (the
    kernel's smallest tile; such a weight's slice is then copied on a GPU, as any scan's would be):
    `ExecutionPlan.matmul_impl`, a row of the plan's table."""
    ws = w if isinstance(w, (tuple, list)) else (w,)
    impls = {plan.matmul_impl(wi.shape[1], wi.shape[2]) for wi in ws}
    use = plan.impl if impls == {plan.impl} else "reference"
    knobs = {"batch_invariant": True} if batch_invariant else {}
    return pk.layer_matmul(x, w, layer, scale=scale, bias=bias, impl=use, **knobs)


def layout_for_impl(model: nnx.Module | tuple[nnx.GraphDef, nnx.State], impl: str,
                    mesh: Mesh | None = None) -> nnx.Module | tuple[nnx.GraphDef, nnx.State]:
    """`model` (a `paged_kv.models.protocol.PagedModel` or its `(graphdef, state)` split; same kind back)
    in the layer layout that suits `impl` and `mesh`. The three ways a `paged_kv.models.Llama` runs
    its layers, and where each is chosen (the engines call this once, outside `jit`, through
    `paged_kv.engine.call_setup.layer_layout`; the backend's plan comes from
    `paged_kv.models.paged_attention`):

      impl resolves to   mesh   layout      loop      projections                               plan row
      "reference" (CPU)  any    stacked     scan      XLA einsums on the scan's weight slices   reference
      Pallas             none   stacked     scan      `layer_matmul_for`: in place               pallas
      Pallas             tp     per_layer   unrolled  XLA einsums (GSPMD partitions them)       pallas_mesh

    So a stacked Llama becomes `paged_kv.models.llama.per_layer` exactly when `static_layer_impl`
    holds; anything else is returned as is (other models have their own layout).

    Converting copies the decoder-layer weights once (see `per_layer`): callers that keep the
    result should drop the stacked model. Weights that are tracers (a call under the caller's own
    `jit`) are left as they are: slicing them there would be the same slice in the program."""
    module = nnx.merge(*model) if isinstance(model, tuple) else model
    if not isinstance(module, Llama) or is_per_layer(module):
        return model
    if not static_layer_impl(impl, module.config.head_dim, mesh):
        return model
    if any(isinstance(w, jax.core.Tracer) for w in jax.tree.leaves(nnx.state(module))):
        return model
    return per_layer(model)
