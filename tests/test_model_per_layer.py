"""The per-layer layout (`paged_kv.models.llama.per_layer`), which the engines run when their kernels are
Pallas over a tensor-parallel mesh: the same weights one array per layer, the same logits and
pages bit for bit as the stacked model's unrolled forward, the tensor-parallel specs following
the layout, and the engines converting only when the layers run unrolled (the CPU scan and the
one-device Pallas scan, `tests/test_model_stacked_matmul.py`, keep the stacked model)."""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from paged_kv.config import ManagerConfig
from paged_kv.engine import call_setup
from paged_kv.engine.sampling import SamplingParams
from paged_kv.models import (
    abstract_model,
    allocate_pages,
    hf_state_dict,
    init_model,
    is_per_layer,
    layout_for_impl,
    make_paged_batch,
    page_spec,
    paged as paged_mod,
    paged_forward,
    per_layer,
    sharding as msharding,
    stacked,
    tp_layout,
)
from paged_kv.models.config import tiny
from paged_kv.models.protocol import AttentionBackend
from paged_kv.state import init_state

# The package re-exports a function named like this module: import the module itself.
generate_mod = importlib.import_module("paged_kv.engine.generate")
BLOCK = 16
FAMILIES = [dict(), dict(qkv_bias=True, qk_norm=True, o_bias=True, mlp_bias=True)]


def test_per_layer_holds_each_layers_weights_and_round_trips():
    """Layer i of the per-layer model is slice [i] of the stacked weights (same dtype, no layer
    axis); `stacked` gives the original back; the caller's model is left as it was."""
    model = init_model(tiny(num_layers=3, qkv_bias=True), seed=4)
    split = per_layer(model)
    assert not is_per_layer(model) and is_per_layer(split)
    assert per_layer(split) is split  # already per layer: as is
    for i in range(3):
        want, got = nnx.state(model.layer(i)), nnx.state(split.layers[i])
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
    back = stacked(split)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(back), nnx.state(model))
    # The split form gives a split back, with the same paths as the module.
    graphdef, state = per_layer(nnx.split(model))
    assert is_per_layer(nnx.merge(graphdef, state))
    # Saving reads the stacked layout: the same HF tensors from either layout.
    a, b = hf_state_dict(model), hf_state_dict(split)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def _static(attend):
    def attend_static(layer, *args, **options):
        assert isinstance(layer, int)
        return attend(layer, *args, **options)
    return AttentionBackend(attend_static, static_layer=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_per_layer_forward_is_bit_identical_to_the_stacked_unrolled_one(family):
    """The stacked model's unrolled forward (static slices, what the Pallas path ran before) and
    the per-layer model's forward give the same logits and pages bit for bit, on the reference
    kernels with a static layer (a chunk, then a decode step over it)."""
    cfg = tiny(num_layers=3, **family)
    model = init_model(cfg, seed=2, init_std=0.2)
    pl = per_layer(model)
    rs = np.random.RandomState(0)
    tokens = jnp.asarray(rs.randint(0, cfg.vocab_size, (2, 20)), jnp.int32)
    tables = jnp.asarray([[3, 1], [2, 4]], jnp.int32)
    chunk = make_paged_batch(tables, [0, 0], [20, 13], 20, BLOCK)
    step = make_paged_batch(tables, [20, 13], [1, 1], 1, BLOCK)
    spec = page_spec(cfg, 5, BLOCK)

    def run(m):
        graphdef, state = nnx.split(m)

        @jax.jit
        def f(state, pages):
            m = nnx.merge(graphdef, state)
            outs = []
            for batch, toks in ((chunk, tokens), (step, tokens[:, 0])):
                attend = _static(paged_mod._make_attend(batch, "reference", toks.ndim == 1, None, cfg.head_dim))
                t = toks[:, None] if toks.ndim == 1 else toks
                hidden, pages = m(t, batch.positions, pages, attend)
                outs.append(m.logits(hidden))
            return outs, pages

        return f(state, allocate_pages(spec))

    (want_chunk, want_step), want_pages = run(model)
    (got_chunk, got_step), got_pages = run(pl)
    np.testing.assert_array_equal(np.asarray(got_chunk), np.asarray(want_chunk))
    np.testing.assert_array_equal(np.asarray(got_step), np.asarray(want_step))
    np.testing.assert_array_equal(np.asarray(got_pages), np.asarray(want_pages))


def test_per_layer_interpret_kernels_bit_identical():
    """With the Pallas kernels in interpret mode and the layers unrolled (what a mesh runs), the
    stacked and the per-layer model write the same pages and give the same logits."""
    cfg = tiny(num_layers=2)
    model = init_model(cfg, seed=5, init_std=0.2)
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 16)), jnp.int32)
    batch = make_paged_batch(jnp.asarray([[1], [2]], jnp.int32), [0, 0], [16, 9], 16, BLOCK)
    spec = page_spec(cfg, 3, BLOCK)
    attend = paged_mod._make_attend(batch, "interpret", False, None, cfg.head_dim)
    # Unrolled on XLA's matmuls, as on a mesh.
    attend = dataclasses.replace(attend, static_layer=True, layer_matmul=None)
    hidden, want_pages = model(tokens, batch.positions, allocate_pages(spec), attend)
    want = (model.logits(hidden[jnp.arange(2), jnp.asarray([15, 8])]), want_pages)
    got = paged_forward(per_layer(model), allocate_pages(spec), batch, tokens, impl="interpret", last_only=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_layout_for_impl_converts_only_for_unrolled_kernels():
    """Reference (and "auto" on the CPU, which resolves to it) keep the stacked model itself, so the
    CPU programs are unchanged, and so do interpret and pallas on one device (their scan reads the
    stacked weights in place); over a mesh interpret and pallas get the per-layer layout."""
    model = init_model(tiny(num_layers=2))
    mesh = msharding.make_mesh(1)
    assert jax.default_backend() == "cpu"
    assert layout_for_impl(model, "reference") is model
    assert layout_for_impl(model, "auto") is model
    assert layout_for_impl(model, "reference", mesh) is model
    pair = nnx.split(model)
    assert layout_for_impl(pair, "reference") is pair
    assert layout_for_impl(model, "interpret") is model
    assert layout_for_impl(pair, "pallas") is pair
    assert is_per_layer(layout_for_impl(model, "interpret", mesh))
    assert is_per_layer(nnx.merge(*layout_for_impl(pair, "pallas", mesh)))
    # Abstract models (the GPU compile gate's tp=2 program) convert too, to abstract per-layer weights.
    abstract = layout_for_impl(abstract_model(tiny(num_layers=2)), "pallas", mesh)
    leaf = nnx.state(abstract.layers[1])["attn"]["q_proj"].get_value()
    assert isinstance(leaf, jax.ShapeDtypeStruct) and leaf.shape == (64, 4, 16)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_partition_specs_follow_the_per_layer_layout(tp):
    """Each per-layer weight's spec is its stacked weight's spec without the (unsharded) layer
    axis; the other weights' specs are unchanged."""
    cfg = tiny(num_layers=2, num_heads=8, num_kv_heads=4, hidden_size=64)
    model = abstract_model(cfg)
    pl = per_layer(model)
    stacked_specs = msharding.weight_specs(nnx.state(model), cfg, tp)
    specs = msharding.weight_specs(nnx.state(pl), cfg, tp)
    flat = dict(jax.tree_util.tree_flatten_with_path(stacked_specs, is_leaf=lambda x: isinstance(x, P))[0])
    checked = 0
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]:
        keys = tp_layout._path_keys(path)
        if keys[0] == "layers":
            assert isinstance(keys[1], int)
            stacked_path = path[:1] + path[2:]
            want = flat[stacked_path]
            assert want[0] is None and tuple(spec) == tuple(want)[1:], (keys, spec, want)
            checked += 1
        else:
            assert spec == flat[path]
    assert checked > 0


def test_per_layer_model_shards_on_a_mesh():
    """`paged_kv.models.sharding.shard` places a per-layer model with the per-layer specs and keeps its
    layout; `per_layer` of a placed stacked model keeps each weight's placement."""
    mesh = msharding.make_mesh(1)
    model = init_model(tiny(num_layers=2))
    placed, _ = msharding.shard(per_layer(model), None, mesh)
    assert is_per_layer(placed)
    want = NamedSharding(mesh, P(None, "tp", None))
    q = nnx.state(placed.layers[0])["attn"]["q_proj"].get_value()
    assert q.sharding.is_equivalent_to(want, q.ndim)
    placed_then_split = per_layer(msharding.shard(model, None, mesh)[0])
    q = nnx.state(placed_then_split.layers[1])["attn"]["q_proj"].get_value()
    assert q.sharding.is_equivalent_to(want, q.ndim)


def test_generate_converts_for_interpret_and_gives_the_stacked_models_tokens():
    """`engine.generate` with the interpret kernels over a mesh runs the per-layer layout
    (converted outside its jit) and gives, bit for bit, what the loop gives on the stacked
    weights (on one device it keeps the stacked model: `test_layout_for_impl_...` and
    tests/test_model_stacked_matmul.py)."""
    cfg = tiny(num_layers=2)
    model = init_model(cfg, seed=1, init_std=0.2)
    mgr = ManagerConfig(num_blocks=16, block_size=BLOCK, max_seqs=4, max_blocks_per_seq=4)
    params = SamplingParams(max_new_tokens=5, temperature=0.7, n=2)
    prompts = jnp.asarray(np.random.RandomState(2).randint(0, cfg.vocab_size, (2, 12)), jnp.int32)
    lens = jnp.asarray([12, 7], jnp.int32)
    spec = page_spec(cfg, mgr.num_blocks, BLOCK)
    mesh = msharding.make_mesh(1)
    seen = []
    real = generate_mod.generate_jit

    def spy(graphdef, weights, *args, **kwargs):
        seen.append(is_per_layer(nnx.merge(graphdef, weights)))
        return real(graphdef, weights, *args, **kwargs)

    generate_mod.generate_jit = spy
    try:
        got, _, _ = generate_mod.generate(model, allocate_pages(spec), prompts, lens, 3, params, manager=mgr,
                                          impl="interpret", mesh=mesh)
    finally:
        generate_mod.generate_jit = real
    assert seen == [True]
    placed, pages = msharding.shard(model, allocate_pages(spec), mesh)
    graphdef, weights = nnx.split(placed)
    state, toks, plens, budgets, key = call_setup.replicate_inputs(
        mesh, init_state(mgr), prompts, lens, jnp.full((2,), 5, jnp.int32), call_setup.check_key(3))
    want, _, _ = real(graphdef, weights, pages, state, toks, plens, budgets, key, manager=mgr, params=params,
                      impl="interpret", chunk_size=12, context=mgr.block_size * mgr.max_blocks_per_seq, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.logprobs), np.asarray(want.logprobs))
