"""Attention kinds stated once (``paged_kv.attention_spec``): the specs' validation and rules
against their definitions, the manager's groups, config and page layout derived from them, and
``ChunkedLocal`` end to end: the block manager reclaims a chunk's blocks as it closes, a prefix hit
needs the blocks of the current chunk, and a model with chunked layers generates through the
engine the tokens of the contiguous reference (whose chunked layers equal a full model run on
each chunk alone). The kernels' chunked masks: tests/test_kernels_window.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv as pk
from paged_kv.attention_spec import ChunkedLocal, Full, SlidingWindow, as_spec, first_visible_code, from_code
from paged_kv.config import Group
from paged_kv.engine import SamplingParams, generate, kv_cache_groups, manager_config
from paged_kv.engine.call_setup import group_layout, pad_prompts
from paged_kv.invariants import check_invariants
from paged_kv.models import allocate_pages, greedy_generate_contiguous, init_model, kv_group_layout, page_spec
from paged_kv.models.config import tiny
from paged_kv.models.contiguous import plain_forward

BS = 4
SPECS = [Full(), SlidingWindow(1), SlidingWindow(5), SlidingWindow(8), ChunkedLocal(1), ChunkedLocal(3),
         ChunkedLocal(4), ChunkedLocal(6), ChunkedLocal(13)]


# -- the specs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make, bad, match", [
    (SlidingWindow, 0, r"SlidingWindow.window must be in \[1, 2147483647\], got 0"),
    (ChunkedLocal, 0, r"ChunkedLocal.chunk must be in \[1, 2147483647\], got 0"),
    (ChunkedLocal, 2**31, r"ChunkedLocal.chunk must be in \[1, 2147483647\], got 2147483648"),
    (ChunkedLocal, True, "ChunkedLocal.chunk must be a Python int"),
    (SlidingWindow, 2.0, "SlidingWindow.window must be a Python int"),
])
def test_specs_are_validated(make, bad, match):
    with pytest.raises(ValueError, match=match):
        make(bad)


def test_specs_are_frozen_hashable_and_coded():
    assert {ChunkedLocal(4): 1}[ChunkedLocal(4)] == 1 and ChunkedLocal(4) != SlidingWindow(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ChunkedLocal(4).chunk = 5
    for spec in SPECS:
        assert from_code(spec.code) == spec == as_spec(spec) == as_spec(np.int32(spec.code))
    assert [s.code for s in (Full(), SlidingWindow(5), ChunkedLocal(6))] == [0, 5, -6]
    with pytest.raises(ValueError, match="attention code must be a Python int"):
        from_code(2.5)


@pytest.mark.parametrize("spec", SPECS)
def test_visible_is_the_definition_and_the_traced_rule_agrees(spec):
    p, k = np.meshgrid(np.arange(40), np.arange(40), indexing="ij")
    if isinstance(spec, SlidingWindow):
        want = (p - spec.window < k) & (k <= p)
    elif isinstance(spec, ChunkedLocal):
        want = (k // spec.chunk == p // spec.chunk) & (k <= p)
    else:
        want = k <= p
    np.testing.assert_array_equal(spec.visible(p, k), want)
    # The kernels' form: one function of the int32 code, traced or not.
    pos = np.arange(40)
    firsts = np.array([spec.first_visible(int(x)) for x in pos])
    np.testing.assert_array_equal(np.asarray(first_visible_code(jnp.asarray(pos), jnp.int32(spec.code))), firsts)
    np.testing.assert_array_equal(np.asarray(first_visible_code(pos, spec)), firsts)


@pytest.mark.parametrize("spec", SPECS)
def test_block_rules_follow_the_mask(spec):
    """``skipped_blocks(n)``: exactly the leading blocks no query at a position >= n reads.
    ``hit_start(h)``: the first block a query at ``h * bs`` reads (a window: at least the block
    before ``h``, as vLLM)."""
    horizon = 80
    for n in range(60):
        read = [any(spec.visible(p, k) for p in range(n, horizon) for k in range(b * BS, (b + 1) * BS))
                for b in range(n // BS + 1)]
        want = read.index(True) if True in read else len(read)
        assert spec.skipped_blocks(n, BS) == want, (spec, n)
        assert int(spec.skipped_blocks(jnp.int32(n), BS)) == want
    for h in range(12):
        start = spec.hit_start(h, BS)
        if isinstance(spec, ChunkedLocal):
            assert start == (h * BS // spec.chunk * spec.chunk) // BS  # the current chunk's blocks
        elif isinstance(spec, SlidingWindow):
            assert start == max(0, h - max(1, -(-(spec.window - 1) // BS)))
        else:
            assert start == 0
    assert not SlidingWindow(1).caches_blocks and ChunkedLocal(1).caches_blocks


def test_groups_carry_a_spec():
    for spec in SPECS:
        assert Group.of(spec).spec == spec
    assert Group.of(ChunkedLocal(6)) == Group("chunked", chunk=6)
    with pytest.raises(ValueError, match="Group.chunk must be >= 1, got 0"):
        Group("chunked")
    with pytest.raises(ValueError, match=r"Group\('window'\) takes no chunk"):
        Group("window", 4, chunk=2)
    cfg = pk.ManagerConfig(num_blocks=8, groups=(ChunkedLocal(6), Full(), SlidingWindow(4)))
    assert cfg.groups == (Group("chunked", chunk=6), Group("full"), Group("window", 4))
    assert cfg.lead_groups == (1,)  # the full group, not the first (chunked) one
    assert not cfg.sparse(cfg.groups[0]) and cfg.sparse(cfg.groups[2])  # chunks cache every full block


# -- the manager: reclaim and hits ---------------------------------------------------------------


def _manager(groups, num_blocks=24) -> pk.BlockManager:
    return pk.BlockManager(pk.ManagerConfig(num_blocks=num_blocks, block_size=BS, max_seqs=4,
                                            max_blocks_per_seq=8, groups=groups))


def test_chunk_blocks_are_reclaimed_as_the_chunk_closes():
    bm = _manager((ChunkedLocal(8), Full()))
    bm.admit([0], [list(range(10))])
    assert bm.tables(0) == [[1, 2, 3], [4, 5, 6]]
    bm.append([0], [10])  # the query at 10 reads chunk [8, 16): blocks 0, 1 closed
    assert bm.tables(0) == [[0, 0, 3], [4, 5, 6]]
    for t in range(11, 16):
        bm.append([0], [t])
    assert bm.tables(0)[0][:3] == [0, 0, 3]  # still chunk [8, 16)
    bm.append([0], [16])  # a new chunk: blocks 2, 3 closed, a fresh block for token 16
    assert bm.tables(0)[0][:4] == [0, 0, 0, 0] and len(bm.tables(0)[0]) == 5
    check_invariants(bm.config, bm.state)
    # A chunk that is not a multiple of the block: the block holding the chunk's start stays.
    bm = _manager((ChunkedLocal(6),))
    bm.admit([0], [list(range(10))])
    bm.append([0], [10])  # chunk [6, 12): block 0 closed, block 1 (tokens 4..7) still read
    assert bm.tables(0) == [[0, 2, 3]]
    check_invariants(bm.config, bm.state)


def test_a_chunked_hit_needs_the_blocks_of_the_current_chunk():
    bm = _manager((ChunkedLocal(8),))
    # Nothing cached: a 21-token prompt still skips its first 16 tokens (chunks 0 and 1 closed:
    # no later query reads them, as vLLM's ChunkedLocalAttentionManager marks them computed).
    res = bm.admit([0], [list(range(16)) + [99] * 4 + [1]])
    assert int(res.cached_tokens[0]) == 16 and bm.tables(0)[0][:4] == [0, 0, 0, 0]
    bm.free([0])
    # h = 5 blocks needs block 4 (tokens 16..19, the current chunk [16, 24)): cached only when
    # its tokens match.
    res = bm.admit([1], [list(range(16)) + [5] * 4 + [1]])
    assert int(res.cached_tokens[0]) == 16
    res = bm.admit([2], [list(range(16)) + [99] * 4 + [2]])
    assert int(res.cached_tokens[0]) == 20 and bm.tables(2)[0][:4] == [0, 0, 0, 0] and bm.tables(2)[0][4] != 0
    check_invariants(bm.config, bm.state)
    # With a full group the hybrid hit needs every block of the full group too.
    bm = _manager((Full(), ChunkedLocal(8)))
    res = bm.admit([0], [list(range(21))])
    assert int(res.cached_tokens[0]) == 0
    check_invariants(bm.config, bm.state)


# -- config, layout, engine ----------------------------------------------------------------------

C, NEW = 6, 24
PROMPTS = [list(np.random.RandomState(0).randint(1, 250, 13)), list(np.random.RandomState(1).randint(1, 250, 6))]


def test_llama_config_states_each_layer_once():
    cfg = tiny(num_layers=3, layer_attention=(ChunkedLocal(C), SlidingWindow(8), Full()))
    assert cfg.layer_windows == (0, 8, 0) and cfg.attend_codes == (-C, 8, 0)
    assert cfg == tiny(num_layers=3, layer_windows=(0, 8, 0), layer_attention=cfg.layer_attention)
    assert tiny(num_layers=2, layer_windows=(8, 0)).layer_attention == (SlidingWindow(8), Full())
    assert tiny(num_layers=2, layer_attention=(Full(), Full())).layer_attention == ()  # as no kinds
    assert tiny(num_layers=2, layer_attention=(ChunkedLocal(999), Full())).attend_specs == (Full(), Full())
    with pytest.raises(ValueError, match="disagrees with layer_attention"):
        tiny(num_layers=2, layer_windows=(4, 0), layer_attention=(ChunkedLocal(4), Full()))
    with pytest.raises(ValueError, match="must hold num_layers=3 AttentionSpec"):
        tiny(num_layers=3, layer_attention=(Full(),))
    with pytest.raises(ValueError, match="no chunked local attention"):
        cfg.to_hf_config()
    layout = kv_group_layout(cfg)
    assert layout.group_specs == (ChunkedLocal(C), SlidingWindow(8), Full()) and layout.slots == 1
    assert kv_cache_groups(cfg) == (Group("chunked", chunk=C), Group("window", 8), Group("full"))


@pytest.mark.parametrize("kinds", [(ChunkedLocal(C), ChunkedLocal(C), Full()), (ChunkedLocal(C),) * 2],
                         ids=["chunked_and_full", "all_chunked"])
def test_chunked_model_generates_the_contiguous_reference(kinds):
    model = init_model(tiny(num_layers=len(kinds), layer_attention=kinds), seed=1)
    groups = kv_cache_groups(model)
    # The groups come from the model: stated once, in its config.
    mgr = manager_config(model, num_blocks=1 + 48 * len(groups), block_size=BS, max_seqs=8, max_blocks_per_seq=16)
    assert mgr.groups == groups and group_layout(model, mgr) == kv_group_layout(model)
    with pytest.raises(ValueError, match="manager_config takes the groups from the model"):
        manager_config(model, num_blocks=8, groups=groups)
    pages = allocate_pages(page_spec(model, mgr.num_blocks, BS, layout=group_layout(model, mgr)))
    out, _, state = generate(model, pages, *pad_prompts(PROMPTS), 0, SamplingParams(max_new_tokens=NEW),
                             manager=mgr, impl="reference")
    ref, _ = greedy_generate_contiguous(model, PROMPTS, NEW)
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, 0], np.asarray(ref))
    check_invariants(mgr, state)
    # The chunked groups reclaimed: at the last step each row holds about a chunk of blocks in them.
    assert int(out.stats.used[NEW - 1]) < len(groups) * sum(-(-(len(p) + NEW) // BS) for p in PROMPTS)


def test_a_chunked_layer_is_a_full_layer_on_each_chunk_alone():
    """Independent of the mask code: a model of chunked layers gives, at every position of chunk
    ``i``, the logits the same weights with full attention give on that chunk's tokens alone (RoPE
    is relative, so the chunk's offset does not matter)."""
    chunked = init_model(tiny(num_layers=2, layer_attention=(ChunkedLocal(C),) * 2), seed=3)
    full = init_model(tiny(num_layers=2), seed=3)
    # Jitted (one program per model and width): op by op, the forwards compiled ~100 small programs.
    forward = jax.jit(lambda model, toks: plain_forward(model, toks, batch_invariant=False))
    tokens = jnp.asarray(np.random.RandomState(2).randint(1, 250, (2, 3 * C + 2)), jnp.int32)
    got = np.asarray(forward(chunked, tokens))
    for start in range(0, tokens.shape[1], C):
        alone = np.asarray(forward(full, tokens[:, start:start + C]))
        np.testing.assert_allclose(got[:, start:start + C], alone, atol=1e-3, rtol=0)
