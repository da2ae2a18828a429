"""Quantized KV pages (int8, float8_e4m3fn: ``paged_kv.pallas_kernels.QuantPages``) through the
model and the engines: page sizing with the scales' bytes, ``generate`` / ``beam_search`` /
``ServingEngine`` on the built-in trained tiny model, copy-on-write that moves the scales, a
grouped (Gemma 3-shaped) manager, and the refusals before tracing (fp8 on sm_80,
``batch_invariant``). Reference kernels on the CPU.

Log-prob bound: ``LOGPROB_ATOL`` is measured, not picked: ``scripts/bench_kv_quant.py`` teacher-
forces the model's held-out text (``scripts/train_tiny_llama.py``'s validation corpus) through
int8 pages and reports the max |log-prob error| over every token (``results/bench_kv_quant.json``,
``accuracy.tiny.teacher_forced.int8.max_abs_logprob_err``: 0.048 over 64 x 128 tokens); the bound
is that figure rounded up to 0.05. fp8's measured max is 0.63 (mean 0.003): beam scores on fp8
pages get ten times the int8 bound.
"""

import numpy as np
import pytest

import paged_kv as pk
from paged_kv.engine import BeamParams, SamplingParams, beam_search, generate, kv_cache_groups
from paged_kv.engine.call_setup import group_layout, pad_prompts
from paged_kv.engine.serving import Request, ServingConfig, ServingEngine
from paged_kv.models import (
    allocate_pages,
    init_model,
    kv_bytes_per_block,
    kv_group_layout,
    load_hf_checkpoint,
    page_spec,
    page_spec_for_budget,
)
from paged_kv.models.config import tiny
from paged_kv.models.tokenizer import ByteTokenizer
from paged_kv.pallas_kernels import QuantPages

TOK = ByteTokenizer()
PROMPTS = ["The cow says", "Once upon a time", "Q: What do bees make? A:", "Let us count: 1, 2,"]
LOGPROB_ATOL = 0.05  # module docstring: the measured teacher-forced max error, rounded up
GREEDY = SamplingParams(max_new_tokens=24)
MGR = pk.ManagerConfig(num_blocks=48, block_size=8, max_seqs=8, max_blocks_per_seq=8, prefix_caching=False)


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint("checkpoints/tiny-llama")


def _pages(model, kv_dtype, mgr=MGR, layout=None):
    return allocate_pages(page_spec(model, mgr.num_blocks, mgr.block_size, layout=layout, kv_dtype=kv_dtype))


def _generate(model, kv_dtype, prompts=PROMPTS, params=GREEDY, mgr=MGR):
    toks, lens = pad_prompts([TOK.encode(p) for p in prompts], width=32)
    out, pages, state = generate(model, _pages(model, kv_dtype, mgr), toks, lens, 0, params, manager=mgr,
                                 impl="reference")
    return out, pages


# -- sizing --------------------------------------------------------------------------------------


def test_quantized_specs_count_scales_and_buy_about_2x_bf16_and_4x_float32_blocks():
    llama8b = tiny(num_layers=32, num_kv_heads=8, head_dim=128, num_heads=32, hidden_size=4096, dtype="bfloat16")
    # Llama 3.1 8B, 16-token blocks: bf16 2 MiB a block; int8 1 MiB + 32 * 2 * 8 * 16 * 4 bytes of scales.
    assert kv_bytes_per_block(llama8b, 16) == 2 * 2**20
    for kd in ("int8", "fp8", "float8_e4m3fn"):
        assert kv_bytes_per_block(llama8b, 16, kv_dtype=kd) == 2**20 + 32 * 2 * 8 * 16 * 4
    budget = 1000 * 2**20
    blocks = {kd: page_spec_for_budget(llama8b, budget_bytes=budget, kv_dtype=kd).num_blocks
              for kd in ("auto", "float32", "int8", "fp8")}
    assert blocks["auto"] == 500 and blocks["float32"] == 250
    # head_dim 128: a row of 128 bytes + a 4-byte scale, against 256 (bf16) or 512 (float32) bytes.
    assert blocks["int8"] == blocks["fp8"] == budget // (2**20 + 2**15) == 969
    assert 2 * 128 / 132 * 500 - 1 <= blocks["int8"] <= 2 * 500 and 4 * 128 / 132 * 250 - 1 <= blocks["int8"]
    spec = page_spec_for_budget(llama8b, budget_bytes=budget, kv_dtype="int8")
    assert (spec.dtype, spec.kv_dtype, spec.quantized) == ("bfloat16", "int8", True)
    assert spec.total_bytes <= budget < spec.total_bytes + spec.bytes_per_block
    # A grouped (Gemma 3-shaped, 5 : 1) layout: blocks of one layer, the same ratio.
    g3 = tiny(num_layers=6, layer_windows=(8,) * 5 + (0,), head_dim=16)
    layout = kv_group_layout(g3)
    assert kv_bytes_per_block(g3, 4, layout=layout, kv_dtype="int8") == 1 * 2 * 2 * (16 + 4) * 4
    assert page_spec(g3, 10, 4, layout=layout, kv_dtype="int8").shape == (1, 2, 2, 10, 4, 16)
    with pytest.raises(ValueError, match="kv_dtype='int4' must be"):
        page_spec(g3, 10, 4, kv_dtype="int4")


def test_allocate_pages_gives_zeroed_quant_pages():
    spec = page_spec(tiny(num_layers=2, head_dim=16), 6, 4, kv_dtype="int8")
    pages = allocate_pages(spec)
    assert isinstance(pages, QuantPages) and pages.values.dtype == np.int8 and pages.scales.dtype == np.float32
    assert pages.shape == spec.shape and pages.scales.shape == spec.shape[:-1]
    assert not np.asarray(pages.values).any() and not np.asarray(pages.scales).any()
    assert not isinstance(allocate_pages(page_spec(tiny(num_layers=2, head_dim=16), 6, 4)), QuantPages)


# -- the trained model ---------------------------------------------------------------------------


def test_greedy_int8_agrees_with_plain_pages_within_the_measured_bound(model):
    plain, _ = _generate(model, None)
    quant, pages = _generate(model, "int8")
    assert isinstance(pages, QuantPages) and np.asarray(pages.scales).any()
    pt, qt = np.asarray(plain.tokens)[:, 0], np.asarray(quant.tokens)[:, 0]
    pl, ql = np.asarray(plain.logprobs)[:, 0], np.asarray(quant.logprobs)[:, 0]
    same = pt == qt
    assert same.mean() >= 0.9, same.mean()
    # Up to each row's first disagreement the contexts are equal, so the log-probs compare.
    for b in range(len(PROMPTS)):
        n = int(np.argmin(same[b])) if not same[b].all() else same.shape[1]
        assert n > 0
        np.testing.assert_allclose(ql[b, :n], pl[b, :n], atol=LOGPROB_ATOL, rtol=0)
    assert np.abs(ql - pl).max() > 0  # the pages were quantized


def test_copy_on_write_moves_the_scales_forked_equals_unforked(model):
    """n=2 greedy samples share the prompt's blocks; their first decode step copies the shared
    partial last block (copy-on-write) into each row's own: the copy must carry the scales, so
    both samples equal the unforked run of the prompt twice (prefix caching off)."""
    greedy2 = SamplingParams(max_new_tokens=12, n=2)
    prompt = ["The cow says"]  # 12 tokens: a partial second block of 8
    forked, _ = _generate(model, "int8", prompt, greedy2)
    unforked, _ = _generate(model, "int8", prompt * 2, SamplingParams(max_new_tokens=12))
    assert int(np.asarray(forked.stats.copies).sum()) >= 1  # a copy-on-write happened
    ft, ut = np.asarray(forked.tokens)[0], np.asarray(unforked.tokens)[:, 0]
    np.testing.assert_array_equal(ft, ut)
    np.testing.assert_allclose(np.asarray(forked.logprobs)[0], np.asarray(unforked.logprobs)[:, 0], atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_beam_search_and_serving_engine_run_on_quantized_pages(model, kv_dtype):
    toks, lens = pad_prompts([TOK.encode(p) for p in PROMPTS[:2]], width=32)
    params = BeamParams(beam_width=2, max_new_tokens=8)
    ref, _, _ = beam_search(model, _pages(model, None), toks, lens, params, manager=MGR, impl="reference")
    out, pages, _ = beam_search(model, _pages(model, kv_dtype), toks, lens, params, manager=MGR, impl="reference")
    assert isinstance(pages, QuantPages)
    # The best beam's score (a sum of 8 log-probs) within 8 steps' measured bound of plain pages'.
    np.testing.assert_allclose(np.asarray(out.scores)[:, 0], np.asarray(ref.scores)[:, 0],
                               atol=8 * LOGPROB_ATOL * (1 if kv_dtype == "int8" else 10))
    cfg = ServingConfig(pk.ManagerConfig(num_blocks=48, block_size=8, max_seqs=4, max_blocks_per_seq=8),
                        chunk_size=16, max_prefill_rows=2, kv_dtype=kv_dtype)
    engine = ServingEngine(model, cfg)
    assert isinstance(engine.pages, QuantPages)
    assert engine.bytes_per_block == kv_bytes_per_block(model, 8, kv_dtype=kv_dtype)
    reqs = [Request(TOK.encode(PROMPTS[0]), SamplingParams(max_new_tokens=8, n=2, temperature=1.0)),
            Request(TOK.encode(PROMPTS[1]), BeamParams(beam_width=2, max_new_tokens=6))]
    outs = list(engine.run(reqs))
    assert [o.error for o in outs] == [None, None]
    assert all(len(t) > 0 for o in outs for t in o.tokens)


def test_grouped_manager_with_int8_pages():
    """A Gemma 3-shaped tiny model (5 window layers : 1 full) with its KV-cache groups: int8
    pages of one layer slot; generate runs (window reclaim on), every group's blocks get scales.
    (Accuracy is the trained model's tests above; one compile here keeps the test small.)"""
    m = init_model(tiny(num_layers=6, layer_windows=(8,) * 5 + (0,), head_dim=16), seed=1)
    groups = kv_cache_groups(m)
    mgr = pk.ManagerConfig(num_blocks=1 + 40 * len(groups), block_size=4, max_seqs=4, max_blocks_per_seq=16,
                           groups=groups)
    layout = group_layout(m, mgr)
    toks, lens = pad_prompts([list(range(5, 18)), list(range(30, 36))])
    out, pages, state = generate(m, _pages(m, "int8", mgr, layout), toks, lens, 0,
                                 SamplingParams(max_new_tokens=20), manager=mgr, impl="reference")
    assert isinstance(pages, QuantPages) and pages.shape[0] == layout.slots == 1
    written = np.asarray(pages.scales)[0].any(axis=(0, 1, 3))  # [blocks]: a scale set in the block
    assert written[1:].sum() >= 6  # blocks of every group (6 groups, two prompts)
    assert np.isfinite(np.asarray(out.logprobs)).all() and (np.asarray(out.tokens) < m.config.vocab_size).all()


# -- refusals before tracing ---------------------------------------------------------------------


def test_fp8_on_sm80_and_batch_invariant_are_refused_before_tracing(model):
    from paged_kv.pallas_kernels import jax_compat

    toks, lens = pad_prompts([TOK.encode(PROMPTS[0])], width=16)
    with pytest.raises(ValueError, match=r"batch_invariant=True does not support quantized KV pages.*int8"):
        generate(model, _pages(model, "int8"), toks, lens, 0, SamplingParams(), manager=MGR, impl="reference",
                 batch_invariant=True)
    with pytest.raises(ValueError, match=r"batch_invariant=True does not support quantized KV pages.*float8_e4m3fn"):
        ServingConfig(MGR, kv_dtype="fp8", batch_invariant=True)
    with jax_compat.cuda_lowering("NVIDIA A100-SXM4-80GB"):
        with pytest.raises(ValueError, match=r"float8_e4m3fn needs compute capability >= 8.9.*sm_80"):
            generate(model, _pages(model, "fp8"), toks, lens, 0, SamplingParams(), manager=MGR, impl="pallas")
        with pytest.raises(ValueError, match=r"float8_e4m3fn .*sm_80"):
            ServingConfig(MGR, kv_dtype="fp8", impl="pallas")  # the config already (one check for all)


def test_own_model_runs_unchanged_on_quantized_pages():
    """docs/own_model.md's GPT-2 (examples/gpt2.py) threads `cache` through `attend` only: int8
    pages reach its `attend` as a `QuantPages` pytree and come back filled."""
    from flax import nnx

    from examples.gpt2 import GPT2, GPT2Config

    m = GPT2(GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4), rngs=nnx.Rngs(0))
    mgr = pk.ManagerConfig(num_blocks=16, block_size=8, max_seqs=2, max_blocks_per_seq=4)
    toks, lens = pad_prompts([[5, 6, 7, 8, 9], [10, 11, 12]])
    out, pages, _ = generate(m, _pages(m, "int8", mgr), toks, lens, 0, SamplingParams(max_new_tokens=6),
                             manager=mgr, impl="reference")
    assert isinstance(pages, QuantPages) and np.asarray(pages.scales).any()
    assert np.isfinite(np.asarray(out.logprobs)).all() and np.asarray(out.tokens).shape[-1] >= 6


def test_attend_on_quantized_pages_computes_in_the_model_dtype():
    """The paged `attend` on `QuantPages`: out in q's dtype (the model's, float32 here), and the
    pages come back quantized, the written rows' scales set."""
    import jax.numpy as jnp

    from paged_kv.models import make_paged_batch
    from paged_kv.models.paged import _make_attend

    pages = allocate_pages(page_spec(tiny(num_layers=1, head_dim=16), 4, 4, kv_dtype="int8"))
    batch = make_paged_batch([[1, 2]], [0], [3], 3, 4)
    attend = _make_attend(batch, "reference", False, head_dim=16)
    rs = np.random.RandomState(0)
    q, k, v = (jnp.asarray(rs.randn(1, 3, h, 16), jnp.float32) for h in (4, 2, 2))
    out, pages = attend(0, q, k, v, pages)
    assert out.dtype == jnp.float32 and isinstance(pages, QuantPages) and pages.values.dtype == jnp.int8
    assert np.asarray(pages.scales)[0, :, :, 1, :3].all() and not np.asarray(pages.scales)[0, :, :, 1, 3].any()
