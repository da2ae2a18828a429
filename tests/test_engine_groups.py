"""Engines over KV-cache groups (``ManagerConfig.groups`` from ``paged_kv.models.kv_group_layout``):
``generate``, ``beam_search`` and ``ServingEngine`` on windowed models with window reclaim give
the tokens of the same model run with one full group (no reclaim) and of the contiguous
reference, over several windows, while holding fewer KV bytes; the layout follows vLLM 0.33's
grouping rule. Tiny models (window 8 tokens, blocks of 4), reference kernels."""

import numpy as np
import pytest

import paged_kv as pk
from paged_kv.config import DEFAULT_GROUPS, Group
from paged_kv.engine import BeamParams, SamplingParams, beam_search, generate, kv_cache_groups
from paged_kv.engine.call_setup import group_layout, pad_prompts
from paged_kv.engine.serving import Request, ServingConfig, ServingEngine
from paged_kv.invariants import check_invariants
from paged_kv.models import (
    KVGroupLayout,
    allocate_pages,
    greedy_generate_contiguous,
    init_model,
    kv_bytes_per_block,
    kv_group_layout,
    page_spec,
    page_spec_for_budget,
)
from paged_kv.models.config import tiny

W, BS, NEW = 8, 4, 28
GEMMA3 = dict(model_type="gemma3_text", hidden_act="gelu_pytorch_tanh", norm_offset=True, sandwich_norm=True,
              embed_scale=True, qk_norm=True, rope_local_theta=100.0, rope_scaling=None, head_dim=16)
PROMPTS = [list(np.random.RandomState(0).randint(1, 250, 13)), list(np.random.RandomState(1).randint(1, 250, 6))]


def _model(layers, windows, **extra):
    return init_model(tiny(num_layers=layers, layer_windows=windows, **extra), seed=1)


@pytest.fixture(scope="module")
def gemma3():
    """Gemma 3-shaped: 5 local layers (window 8) : 1 global."""
    return _model(6, (W,) * 5 + (0,), **GEMMA3)


def _manager(groups, num_blocks=96, max_seqs=8):
    """A pool of ``num_blocks`` blocks per group: the same KV bytes for every layout of Gemma 3's
    (6 groups of 1-layer blocks, or 1 group of 6-layer blocks)."""
    return pk.ManagerConfig(num_blocks=1 + (num_blocks - 1) * len(groups), block_size=BS, max_seqs=max_seqs,
                            max_blocks_per_seq=16, groups=groups)


def _pages(model, mgr):
    return allocate_pages(page_spec(model, mgr.num_blocks, mgr.block_size, layout=group_layout(model, mgr)))


def _generate(model, groups, params=None, key=0):
    params = SamplingParams(max_new_tokens=NEW) if params is None else params
    mgr = _manager(groups)
    toks, lens = pad_prompts(PROMPTS)
    out, pages, state = generate(model, _pages(model, mgr), toks, lens, key, params, manager=mgr, impl="reference")
    return mgr, out, state


# -- the layout ---------------------------------------------------------------------------------


def test_layout_follows_vllm_grouping():
    win, full = Group("window", W), Group("full")
    g3 = kv_group_layout((W,) * 5 + (0,))  # kinds in first-layer order, groups of min(count) layers
    assert kv_cache_groups((W,) * 5 + (0,)) == (win,) * 5 + (full,) and g3.slots == 1
    assert g3.layer_group == (0, 1, 2, 3, 4, 5) and g3.layer_slot == (0,) * 6
    g2 = kv_group_layout((W, 0, W, 0))
    assert (g2.group_windows, g2.layer_group, g2.layer_slot, g2.slots) == ((W, 0), (0, 1, 0, 1), (0, 0, 1, 1), 2)
    # 3 window : 2 full: 3 < 1.5 * 2, so groups of 2: window layers split strided, (0, 2) and (1,)
    odd = kv_group_layout((W, W, W, 0, 0))
    assert odd.group_windows == (W, W, 0) and odd.slots == 2
    assert odd.layer_group == (0, 1, 0, 2, 2) and odd.layer_slot == (0, 0, 1, 0, 1)
    assert odd.group_layers(0) == (0, 2) and odd.group_layers(1) == (1,)
    # 7 window : 5 full: 7 < 7.5, one group per kind, the full one with 2 padding slots
    pad = kv_group_layout((W,) * 7 + (0,) * 5)
    assert kv_cache_groups(pad) == (win, full) and pad.slots == 7 and pad.group_layers(1) == (7, 8, 9, 10, 11)
    assert kv_group_layout((W,) * 4) == KVGroupLayout((W,), (0,) * 4, (0, 1, 2, 3), 4)
    assert kv_group_layout((0,) * 3) == KVGroupLayout.single(3) and not KVGroupLayout.single(3).grouped


def test_pages_and_bytes_follow_the_layout(gemma3):
    layout = kv_group_layout(gemma3)
    groups = kv_cache_groups(gemma3)
    assert group_layout(gemma3, _manager(DEFAULT_GROUPS)) is None
    assert group_layout(gemma3, _manager(groups)) == layout
    with pytest.raises(ValueError, match=r"manager groups=.*differ from the model's KV-cache groups"):
        group_layout(gemma3, _manager((Group("window", W), Group("full"))))
    full = page_spec(gemma3, 32, BS)
    grouped = page_spec(gemma3, 32, BS, layout=layout)
    assert full.shape == (6, 2, 2, 32, BS, 16) and grouped.shape == (1, 2, 2, 32, BS, 16)
    assert kv_bytes_per_block(gemma3, BS, layout=layout) * 6 == kv_bytes_per_block(gemma3, BS)
    budget = 100 * kv_bytes_per_block(gemma3, BS)
    assert page_spec_for_budget(gemma3, block_size=BS, budget_bytes=budget, layout=layout).num_blocks == 600
    mgr = pk.ManagerConfig(num_blocks=96, block_size=BS, max_seqs=8, max_blocks_per_seq=16,
                           groups=(Group("window", W), Group("full")))
    with pytest.raises(ValueError, match="differ from the model's KV-cache groups"):
        generate(gemma3, allocate_pages(full), *pad_prompts(PROMPTS), 0, SamplingParams(), manager=mgr)
    with pytest.raises(ValueError, match="pages have shape"):  # full-layer pages for a grouped manager
        generate(gemma3, allocate_pages(page_spec(gemma3, 96, BS)), *pad_prompts(PROMPTS), 0, SamplingParams(),
                 manager=_manager(groups))


# -- generate, beam search, sampling -------------------------------------------------------------


def test_greedy_generate_with_reclaim_equals_single_group_and_contiguous(gemma3):
    layout = kv_group_layout(gemma3)
    _, single, _ = _generate(gemma3, DEFAULT_GROUPS)
    mgr, grouped, state = _generate(gemma3, kv_cache_groups(gemma3))
    ref, _ = greedy_generate_contiguous(gemma3, PROMPTS, NEW)
    np.testing.assert_array_equal(np.asarray(grouped.tokens), np.asarray(single.tokens))
    np.testing.assert_array_equal(np.asarray(grouped.tokens)[:, 0], np.asarray(ref))
    # KV held at the last step, in layer-blocks: 6 layers per full-group block, 1 per grouped one.
    # Contexts of 41 and 34 tokens, windows of 8: the window groups hold ~3 blocks a row.
    last = NEW - 1
    single_kv = int(single.stats.used[last]) * 6
    grouped_kv = int(grouped.stats.used[last]) * layout.slots
    assert grouped_kv < 0.6 * single_kv, (grouped_kv, single_kv)
    check_invariants(mgr, state)
    assert int(state.queue.num_free) == mgr.num_blocks - 1  # every row freed on return
    assert (np.asarray(grouped.finish_reason) == 2).all()  # LENGTH: nobody ran out of blocks


def test_beam_and_sampled_forks_equal_single_group(gemma3):
    params = SamplingParams(max_new_tokens=20, n=3, temperature=1.0)
    _, single, _ = _generate(gemma3, DEFAULT_GROUPS, params, key=7)
    mgr, grouped, state = _generate(gemma3, kv_cache_groups(gemma3), params, key=7)
    np.testing.assert_array_equal(np.asarray(grouped.tokens), np.asarray(single.tokens))
    assert int(np.max(grouped.stats.shared)) > 0  # the samples share their prompt's blocks
    check_invariants(mgr, state)
    beams = {}
    for name, groups in (("single", DEFAULT_GROUPS), ("grouped", kv_cache_groups(gemma3))):
        m = _manager(groups)
        out, _, st = beam_search(gemma3, _pages(gemma3, m), *pad_prompts(PROMPTS[:1]),
                                 BeamParams(beam_width=2, max_new_tokens=20), manager=m, impl="reference")
        check_invariants(m, st)
        beams[name] = out
    np.testing.assert_array_equal(np.asarray(beams["grouped"].tokens), np.asarray(beams["single"].tokens))
    np.testing.assert_allclose(np.asarray(beams["grouped"].scores), np.asarray(beams["single"].scores), rtol=1e-5)


@pytest.mark.parametrize("windows", [(W, 0, W, 0), (W,) * 3], ids=["gemma2_2x2", "mistral_all_window"])
def test_other_layouts_equal_contiguous(windows):
    model = _model(len(windows), windows)
    layout = kv_group_layout(model)
    assert layout.grouped and layout.num_groups == (2 if 0 in windows else 1)
    mgr, out, state = _generate(model, kv_cache_groups(model))
    ref, _ = greedy_generate_contiguous(model, PROMPTS, NEW)
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, 0], np.asarray(ref))
    check_invariants(mgr, state)


# -- serving -------------------------------------------------------------------------------------


def test_serving_engine_with_groups_equals_single_group(gemma3):
    rng = np.random.RandomState(3)
    shared = list(rng.randint(1, 250, 14))
    reqs = [Request(tuple(shared), SamplingParams(max_new_tokens=22), arrival=0, request_id="a"),
            Request(tuple(rng.randint(1, 250, 9)), SamplingParams(max_new_tokens=24, n=2, temperature=1.0),
                    arrival=0, request_id="n2", seed=5),
            Request(tuple(shared), SamplingParams(max_new_tokens=22), arrival=30, request_id="again"),
            Request(tuple(rng.randint(1, 250, 5)), BeamParams(beam_width=2, max_new_tokens=16), arrival=2,
                    request_id="beam")]
    results = {}
    for name, groups in (("single", DEFAULT_GROUPS), ("grouped", kv_cache_groups(gemma3))):
        mgr = _manager(groups, num_blocks=128)
        eng = ServingEngine(gemma3, ServingConfig(mgr, chunk_size=8, max_prefill_rows=2, impl="reference"))
        outs = {o.request_id: o for o in eng.run(reqs)}
        assert all(o.ok for o in outs.values())
        results[name] = (outs, eng)
    (single, eng1), (grouped, eng2) = results["single"], results["grouped"]
    for rid in single:
        assert grouped[rid].tokens == single[rid].tokens, rid
    # The repeated prompt hits the cache in every group (3 whole blocks of its 14 tokens).
    assert grouped["again"].stats.cached_prompt_tokens == single["again"].stats.cached_prompt_tokens == 12
    peak = lambda eng: eng.stats().peak_blocks_used * eng.bytes_per_block
    assert peak(eng2) < peak(eng1) and eng2.bytes_per_block * 6 == eng1.bytes_per_block
    check_invariants(eng2.manager, eng2.device.state)
