"""The execution plan (pallas_kernels/plan.py): one table decides what runs for the cross-cutting
switches, refuses each unsupported combination in one line, and docs/design.md prints that table."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.pallas_kernels import invariant, jax_compat, plan, stacked_matmul


def test_design_doc_prints_the_module_table():
    from scripts import doc_tables

    begin, end = doc_tables.markers("execution_plan")
    text = doc_tables.DESIGN.read_text()
    assert text.count(begin) == 1 and text.count(end) == 1
    block = text.split(begin)[1].split(end)[0].strip()
    assert block == plan.table_markdown(), "docs/design.md is stale: run python scripts/doc_tables.py"


def test_restated_limits_agree_with_the_kernels():
    assert plan.INVARIANT_KEY_TILE == invariant.KEY_TILE
    assert plan.MATMUL_MIN_DIM == stacked_matmul.MIN_DIM
    assert len({r.name for r in plan.ROWS}) == len(plan.ROWS)


# One combination per refusal row, with the words its message must carry (the combination and
# what is supported).
REFUSED = [
    ("pallas_on_cpu", dict(impl="pallas", target="cpu"), r"impl='pallas' on target 'cpu'.*supported"),
    ("chunked_pallas", dict(impl="pallas", kinds=("full", "chunked")),
     r"impl='pallas' with attention kinds.*chunked.*supported: impl 'auto'"),
    ("pallas_head_dim", dict(impl="interpret", head_dim=48), r"head_dim=48.*use impl='reference'"),
    ("invariant_quant", dict(batch_invariant=True, kv_dtype="int8"), r"batch_invariant=True .* int8.*plain pages"),
    ("invariant_quant", dict(batch_invariant=True, kv_dtype=jnp.float8_e4m3fn), r"float8_e4m3fn"),
    ("fp8_target", dict(impl="pallas", target="sm_80", kv_dtype="fp8"), r"float8_e4m3fn .*>= 8.9.*sm_80; use int8"),
    ("invariant_reference_block", dict(impl="reference", batch_invariant=True, block_size=256),
     r"block size dividing 128.*block_size=256"),
]


@pytest.mark.parametrize(("row", "kw", "message"), REFUSED)
def test_each_refusal_is_one_line_naming_the_combination(row, kw, message):
    with pytest.raises(ValueError, match=message) as e:
        plan.make_plan(**kw)
    assert "\n" not in str(e.value)
    assert plan.refusal(**kw)[0] == row


def test_every_row_is_reached():
    reached = {r[0] for r in REFUSED}
    on_gpu = plan.Switches(impl="auto", target="sm_90", gpu_backend=True, batch_invariant=False, kv="plain",
                           kinds=("full",), tp=None, head_dim=80, block_size=16)
    reached.add(plan.decide(on_gpu)[0].name)  # auto on a GPU, a head_dim Triton cannot take
    reached.add(plan.decide(dataclasses.replace(on_gpu, head_dim=128))[0].name)
    reached.add(plan.decide(dataclasses.replace(on_gpu, head_dim=128, kinds=("full", "chunked")))[0].name)
    reached.add(plan.decide(dataclasses.replace(on_gpu, head_dim=128, tp=2))[0].name)
    reached.add(plan.make_plan("reference").row)
    assert reached == {r.name for r in plan.ROWS}


def test_plans_of_the_supported_combinations():
    p = plan.make_plan("reference", batch_invariant=True, block_size=16, kinds=("full", "window"))
    assert (p.impl, p.attention, p.layers, p.projections, p.row) == ("reference", "invariant", "scan", "xla",
                                                                       "reference")
    p = plan.make_plan("interpret", kv_dtype="fp8", target="sm_80")  # interpret mode compiles nothing for a GPU
    assert (p.impl, p.attention, p.projections) == ("interpret", "paged", "layer_matmul")
    assert plan.make_plan("pallas", tp=2).layers == "unrolled"
    assert plan.make_plan("pallas", tp=1).layers == "unrolled"  # a mesh of one device: the mesh's layout
    assert plan.make_plan("pallas", batch_invariant=True, block_size=256).attention == "invariant"
    assert plan.make_plan("pallas", kv_dtype="fp8", target="sm_90").impl == "pallas"
    # Chunked-local attention: the reference and interpret mode run it; auto on a GPU picks the reference.
    assert plan.make_plan("interpret", kinds=("chunked",)).impl == "interpret"
    on_gpu = plan.Switches(impl="auto", target="sm_90", gpu_backend=True, batch_invariant=False, kv="plain",
                           kinds=("full", "chunked"), tp=None, head_dim=128, block_size=16)
    row, refused = plan.decide(on_gpu)
    assert (row.name, row.impl, refused) == ("auto_chunked", "reference", None)
    assert plan.make_plan("auto").impl == jax.default_backend().replace("cpu", "reference").replace("gpu", "pallas")
    hash(plan.make_plan())  # a static argument
    # The projections' row: K or N not a multiple of 16 runs the reference for that weight.
    p = plan.make_plan("pallas")
    assert (p.matmul_impl(4096, 1024), p.matmul_impl(24, 32), p.matmul_impl(32, 40)) == (
        "pallas", "reference", "reference")


def test_bad_switches_are_refused():
    for kw, message in [(dict(impl="cuda"), "impl must be one of"), (dict(kinds=("sliding",)), "attention kinds"),
                        (dict(kinds=()), "attention kinds"), (dict(tp=0), "tp=0"),
                        (dict(kv_dtype="int4"), "kv_dtype='int4'"), (dict(block_size=0), "block_size=0"),
                        (dict(batch_invariant=1), "batch_invariant=1")]:
        with pytest.raises(ValueError, match=message):
            plan.make_plan(**kw)


def test_targets():
    assert plan.resolve_target("sm_90a") == "sm_90" and plan.resolve_target((8, 0)) == "sm_80"
    assert plan.resolve_target("cpu") == "cpu"
    assert plan.resolve_target("auto") == ("none" if jax.default_backend() == "cpu" else plan.resolve_target("auto"))
    with jax_compat.cuda_lowering("NVIDIA A100-SXM4-80GB"):
        assert plan.resolve_target("auto") == "sm_80" and plan.resolve_target("auto", backend=False) == "sm_80"
        with pytest.raises(ValueError, match="sm_80"):
            plan.check_early("pallas", kv_dtype="fp8")
    plan.check_early("auto", batch_invariant=True, block_size=256)  # needs the backend: make_plan's


def test_kernel_entry_points_run_their_plan():
    """The kernels' checks return the plan and refuse what the table refuses, before tracing."""
    rng = np.random.default_rng(0)
    pages = jnp.asarray(rng.standard_normal((1, 2, 2, 8, 256, 16)), jnp.float32)
    q = jnp.ones((1, 2, 16), jnp.float32)
    bt, ln = jnp.ones((1, 2), jnp.int32), jnp.asarray([3], jnp.int32)
    with pytest.raises(ValueError, match="block size dividing 128"):
        jax.jit(lambda q, p: pk.paged_decode_attention(q, p, 0, bt, ln, impl="reference",
                                                       batch_invariant=True)).trace(q, pages)
    _, _, p, _ = pk.dispatch.validate.check_decode(q, pages, 0, bt, ln, None, "auto")
    assert p.impl == pk.resolve_impl("auto", 16) and p.attention == "paged"


def test_engines_make_the_plan_before_anything_is_built():
    import paged_kv as pkv
    from paged_kv.engine import call_setup
    from paged_kv.engine.serving import ServingConfig

    mgr = pkv.ManagerConfig(num_blocks=8, block_size=256, max_seqs=2, max_blocks_per_seq=2)
    with pytest.raises(ValueError, match="block size dividing 128"):
        ServingConfig(mgr, impl="reference", batch_invariant=True)
    ServingConfig(mgr, batch_invariant=True)  # "auto": the backend decides, later (`plan`)
    cfg = ServingConfig(dataclasses.replace(mgr, block_size=16), impl="reference", kv_dtype="int8")
    assert (cfg.plan.impl, cfg.plan.switches.kv, cfg.plan.row) == ("reference", "int8", "reference")
    pages = jax.ShapeDtypeStruct((1, 2, 1, 8, 256, 16), jnp.float32)
    with pytest.raises(ValueError, match="block size dividing 128"):
        call_setup.check_kv_pages(pages, "reference", batch_invariant=True)
    assert call_setup.check_kv_pages(pages, "reference").attention == "paged"
