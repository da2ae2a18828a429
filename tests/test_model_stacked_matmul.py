"""The scan over stacked layers with the projections read in place (`AttentionBackend.layer_matmul`,
`paged_kv.models.llama.LayerAccess`): what the Pallas kernels run on one GPU. Against the
ordinary scan (XLA's weight slices) on the same weights, for the plain Llama and for every
family switch (biases, q/k norms); the engines' Pallas path scans (one traced body: four
launches, q/k/v and gate/up grouped) instead of converting to the per-layer layout; the layer handed to the matmul is
the scan's traced id."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.models import (
    allocate_pages,
    init_model,
    is_per_layer,
    layer_layout,
    make_paged_batch,
    page_spec,
    paged_forward,
)
from paged_kv.models.config import tiny
from paged_kv.pallas_kernels import stacked_matmul
from paged_kv.pallas_kernels.plan import make_plan
from tests import test_model_scan as scan_tests, tolerances as tol

BLOCK = 16
FAMILIES = [dict(), dict(qkv_bias=True, qk_norm=True, o_bias=True, mlp_bias=True)]


def _case(cfg):
    rs = np.random.RandomState(0)
    tokens = jnp.asarray(rs.randint(0, cfg.vocab_size, (2, 20)), jnp.int32)
    batch = make_paged_batch(jnp.asarray([[3, 1], [2, 4]], jnp.int32), [0, 0], [20, 13], 20, BLOCK)
    return tokens, batch, page_spec(cfg, 5, BLOCK)


def _forward(model, tokens, batch, pages, matmul):
    return scan_tests._forward(model, tokens, batch, pages, static=False, matmul=matmul)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_in_place_projections_match_the_sliced_scan(family, impl):
    """Logits within the chain bound of tests/tolerances.py (the projections' float32 sums are
    blocked differently; the norms' weights multiply the projections' inputs instead of the
    norms' outputs, the same product)."""
    cfg = tiny(num_layers=3, **family)
    model = init_model(cfg, seed=2, init_std=0.2)
    tokens, batch, spec = _case(cfg)
    want, _ = _forward(model, tokens, batch, allocate_pages(spec), None)
    got, _ = _forward(model, tokens, batch, allocate_pages(spec), functools.partial(pk.layer_matmul, impl=impl))
    atol = tol.model_atol(cfg, 20, np.abs(np.asarray(want)).max(), score_mag=tol.score_bound(model))
    tol.assert_close(got, want, atol, f"in-place ({impl}) vs sliced scan")


def test_each_layer_reads_its_own_weights():
    """A matmul that always reads layer 0 (an index bug) misses the bound by far: the test above
    can fail."""
    cfg = tiny(num_layers=3)
    model = init_model(cfg, seed=2, init_std=0.2)
    tokens, batch, spec = _case(cfg)
    want, _ = _forward(model, tokens, batch, allocate_pages(spec), None)

    def layer0(x, w, layer, **kw):
        return pk.layer_matmul(x, w, 0, impl="reference", **kw)

    bad, _ = _forward(model, tokens, batch, allocate_pages(spec), layer0)
    atol = tol.model_atol(cfg, 20, np.abs(np.asarray(want)).max(), score_mag=tol.score_bound(model))
    assert float(np.abs(np.asarray(bad) - np.asarray(want)).max()) > 100 * atol


def test_pallas_impls_scan_with_four_launches_per_layer(monkeypatch):
    """`paged_forward` with the Pallas kernels on one device keeps the stacked model (no per-layer
    conversion) and traces the scan body once: four kernel calls, q/k/v as one group and
    gate/up as one group (the group's weights passed as they are, no concatenated copy), o and
    down alone, each on whole stacked weights and the scan's traced int32 layer id."""
    cfg = tiny(num_layers=3)
    model = init_model(cfg, seed=1, init_std=0.2)
    tokens, batch, spec = _case(cfg)
    assert layer_layout.layout_for_impl(model, "interpret") is model
    calls = []
    real = stacked_matmul.layer_matmul_pallas

    def spy(x, w, layer, *args, **kwargs):
        shapes = tuple(wi.shape for wi in w) if isinstance(w, tuple) else w.shape
        calls.append((shapes, isinstance(layer, jax.core.Tracer), getattr(layer, "dtype", None)))
        return real(x, w, layer, *args, **kwargs)

    monkeypatch.setattr(stacked_matmul, "layer_matmul_pallas", spy)
    got, _ = paged_forward(model, allocate_pages(spec), batch, tokens, impl="interpret")
    assert not is_per_layer(model)
    d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    L, qh, kvh = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads
    assert [c[0] for c in calls] == [((L, d, qh * e), (L, d, kvh * e), (L, d, kvh * e)), (L, qh * e, d),
                                     ((L, d, f), (L, d, f)), (L, f, d)]
    assert all(traced and dtype == jnp.int32 for _, traced, dtype in calls)
    want, _ = paged_forward(model, allocate_pages(spec), batch, tokens, impl="reference")
    atol = tol.model_atol(cfg, 20, np.abs(np.asarray(want)).max(), score_mag=tol.score_bound(model))
    tol.assert_close(got, want, atol, "interpret vs reference")


def test_layer_matmul_only_without_a_mesh_and_for_pallas():
    """The paged backend brings the in-place matmul for the Pallas impls on one device; the
    reference kernels (a CPU) scan with XLA's slices, and a tensor-parallel mesh unrolls on
    per-layer weights (`static_layer`), where GSPMD partitions the XLA matmuls."""
    assert layer_layout.layer_matmul_for("reference") is None
    assert layer_layout.layer_matmul_for("auto") is None  # the CPU: reference
    assert layer_layout.layer_matmul_for("interpret") is not None
    assert layer_layout.layer_matmul_for("pallas") is not None
    assert layer_layout.layer_matmul_for("pallas", mesh=object()) is None
    assert not layer_layout.static_layer_impl("pallas") and layer_layout.static_layer_impl("pallas", mesh=object())
    assert not layer_layout.static_layer_impl("reference", mesh=object())


def test_unsupported_widths_fall_back_to_the_reference():
    """A weight whose K or N is not a multiple of 16 goes through the XLA reference (its slice is
    copied on a GPU, as any scan's), not a refusal: any model width runs. The execution plan's
    `pallas` row says so (`ExecutionPlan.matmul_impl`)."""
    plan = make_plan("interpret")
    assert plan.matmul_impl(24, 40) == "reference" and plan.matmul_impl(32, 48) == "interpret"
    x = jnp.ones((3, 24), jnp.float32)
    w = jnp.asarray(np.random.RandomState(0).randn(2, 24, 40), jnp.float32)
    got = layer_layout._layer_matmul(x, w, 1, plan=plan)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(pk.layer_matmul(x, w, 1, impl="reference")))
    # A group with one such weight goes through the reference as a whole.
    w2 = jnp.asarray(np.random.RandomState(1).randn(2, 24, 32), jnp.float32)
    got = layer_layout._layer_matmul(x, (w2, w), 1, plan=plan)
    want = pk.layer_matmul(x, (w2, w), 1, impl="reference")
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
