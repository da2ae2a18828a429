"""The scan over stacked decoder layers (`paged_kv.models.llama`): the stacked layout, the scanned and the
unrolled forward agreeing, a traced layer id in the kernels, and the compiled decode step
updating the pages in place (no page-sized copy in its HLO)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_kv import pallas_kernels as pk
from paged_kv.models import (
    allocate_pages,
    init_model,
    make_paged_batch,
    page_spec,
    paged as paged_mod,
    paged_decode_step,
)
from paged_kv.models.config import tiny
from paged_kv.models.llama import DecoderLayer, stack_layers
from paged_kv.models.protocol import AttentionBackend
from tests import tolerances as tol

BLOCK = 16


def test_layers_are_stacked_with_the_seeds_weights():
    """Every layer weight has a leading [L] axis, and slice i is the layer a list of layers built
    from the same seed held (the stacking changes the layout, not the initialisation)."""
    cfg = tiny(num_layers=3, qkv_bias=True)
    model = init_model(cfg, seed=7)
    _, layers = nnx.split(model.layers)
    for leaf in jax.tree.leaves(layers):
        assert leaf.shape[0] == 3
    rngs = nnx.Rngs(7)
    rngs.params()  # the embedding is drawn first
    built = [DecoderLayer(cfg, rngs=rngs) for _ in range(3)]
    for i, layer in enumerate(built):
        want, got = nnx.state(layer), nnx.state(model.layer(i))
        jax.tree.map(np.testing.assert_array_equal, got, want)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(stack_layers(built)), layers)


def _forward(model, tokens, batch, pages, static: bool, matmul=None):
    """Jitted logits and pages of `model` on the reference kernels: scanned, or unrolled with
    Python-int layer ids (`static`); `matmul` becomes the backend's `layer_matmul` (the
    scan's in-place projections, tests/test_model_stacked_matmul.py)."""
    attend = paged_mod._make_attend(batch, "reference", False, None, model.config.head_dim)
    attend = dataclasses.replace(attend, layer_matmul=matmul)
    if static:
        def attend_static(layer, *args, **options):
            assert isinstance(layer, int)  # the unrolled path hands Python ints
            return attend(layer, *args, **options)
        fn = AttentionBackend(attend_static, static_layer=True)
    else:
        fn = attend
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, pages):
        m = nnx.merge(graphdef, state)
        hidden, pages = m(tokens, batch.positions, pages, fn)
        return m.logits(hidden), pages

    return run(state, pages)


@pytest.mark.parametrize("family", [dict(), dict(qkv_bias=True, qk_norm=True)])
def test_scanned_and_unrolled_layers_agree(family):
    """The scan (traced layer id) and the unrolled loop (Python ints, as for the Pallas kernels)
    compute the same logits and write the same pages."""
    cfg = tiny(num_layers=3, **family)
    model = init_model(cfg, seed=2, init_std=0.2)
    rs = np.random.RandomState(0)
    tokens = jnp.asarray(rs.randint(0, cfg.vocab_size, (2, 20)), jnp.int32)
    tables = jnp.asarray([[3, 1], [2, 4]], jnp.int32)
    batch = make_paged_batch(tables, [0, 0], [20, 13], 20, BLOCK)
    spec = page_spec(cfg, 5, BLOCK)
    scan_logits, scan_pages = _forward(model, tokens, batch, allocate_pages(spec), static=False)
    unrolled_logits, unrolled_pages = _forward(model, tokens, batch, allocate_pages(spec), static=True)
    atol = tol.model_atol(cfg, 20, np.abs(np.asarray(scan_logits)).max(), score_mag=tol.score_bound(model))
    tol.assert_close(scan_logits, unrolled_logits, atol, "scanned vs unrolled logits")
    # Layer 0's K/V come straight from the embeddings through identical ops: bit for bit.
    np.testing.assert_array_equal(np.asarray(scan_pages[0]), np.asarray(unrolled_pages[0]))


def test_kernels_take_a_traced_layer():
    """write_kv and the paged attentions with layer as an int32 scalar (inside jit) give what the
    Python int gives, in the reference and in the Pallas kernels (interpret mode; they take the
    layer as an operand); a non-integer layer is refused by name."""
    rs = np.random.RandomState(1)
    pages = jnp.asarray(rs.randn(3, 2, 2, 4, BLOCK, 16), jnp.float32)
    k = jnp.asarray(rs.randn(5, 2, 16), jnp.float32)
    v = jnp.asarray(rs.randn(5, 2, 16), jnp.float32)
    slots = jnp.asarray([16, 17, 40, 63, 3], jnp.int32)
    q = jnp.asarray(rs.randn(2, 4, 16), jnp.float32)
    tables = jnp.asarray([[1, 2], [3, 0]], jnp.int32)
    lengths = jnp.asarray([20, 9], jnp.int32)

    def step(layer, pages, impl):
        pages = pk.write_kv(pages, layer, k, v, slots, impl=impl)
        out = pk.paged_decode_attention(q, pages, layer, tables, lengths, impl=impl)
        pre = pk.paged_prefill_attention(q[:, None], pages, layer, tables, lengths - 1, jnp.ones(2, jnp.int32),
                                         impl=impl)
        return pages, out, pre

    for impl in ("reference", "interpret"):
        for layer in range(3):
            want = step(layer, pages, impl)
            got = jax.jit(step, static_argnums=2)(jnp.int32(layer), pages, impl)
            for w, g in zip(want, got):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="integer scalar"):
        jax.jit(lambda layer: pk.write_kv(pages, layer, k, v, slots, impl="reference"))(jnp.float32(0))


# ---------------------------------------------------------------------------- compiled HLO
_INSTR = re.compile(r"=\s*(?:\(?)([a-z0-9]+)\[([0-9,]*)\][^ ]*\s+([a-z][a-z0-9-]*)\(")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.-]+)\s*\(.*\)\s*->.*\{\s*$")


def page_sized_copies(hlo_text: str, min_elements: int) -> list[str]:
    """Instructions of a compiled module (`compiled.as_text()`) that materialise at least
    `min_elements` elements as a copy: any `copy`/`copy-start` (also inside a fusion, where XLA
    writes a copy fusion's body), and any unfused `dynamic-slice`/`slice` (one that writes its own
    buffer). Returns the offending lines."""
    found, computation = [], ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            continue
        m = _INSTR.search(line)
        if not m:
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        elements = int(np.prod(dims)) if dims else 1
        op = m.group(3)
        fused = "fused" in computation or "fusion" in computation
        if elements >= min_elements and (op in ("copy", "copy-start") or
                                          (op in ("dynamic-slice", "slice") and not fused)):
            found.append(line.strip())
    return found


def _layer_elements(spec) -> int:
    return int(np.prod(spec.shape[1:]))


def test_page_copy_detector_sees_a_copy():
    """The check below can fail: updating pages that are not donated (the input stays alive)
    makes XLA copy them whole, which the detector reports."""
    spec = page_spec(tiny(num_layers=2), 257, BLOCK)
    pages = jax.ShapeDtypeStruct(spec.shape, jnp.float32)
    keep = jax.jit(lambda p: (p.at[0, 0, 0, 1].set(1.0), p)).lower(pages).compile().as_text()
    assert page_sized_copies(keep, _layer_elements(spec))


@pytest.mark.parametrize("num_layers", [1, 4])
def test_decode_step_updates_pages_in_place(num_layers):
    """The compiled decode step (scan over layers, traced layer id, reference kernels) writes the
    donated pages in place: no copy of the page array or of one layer's pages anywhere in its HLO,
    and the pages output aliases the pages input."""
    cfg = tiny(num_layers=num_layers)
    graphdef, state = nnx.split(init_model(cfg, seed=0))
    spec = page_spec(cfg, 257, BLOCK)  # pages far larger than any weight of the tiny model
    pages = jax.ShapeDtypeStruct(spec.shape, jnp.float32)
    batch = make_paged_batch(np.asarray([[1, 2], [3, 4]], np.int32), np.asarray([17, 5], np.int32),
                             np.ones(2, np.int32), 1, BLOCK)
    tokens = jnp.asarray([5, 9], jnp.int32)
    compiled = paged_decode_step.lower(graphdef, state, pages, batch, tokens, impl="reference").compile()
    text = compiled.as_text()
    assert page_sized_copies(text, _layer_elements(spec)) == []
    assert "input_output_alias" in text
