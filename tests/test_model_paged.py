"""Paged decoding equals contiguous decoding; the jitted steps compile once per shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_kv.models import (
    abstract_model,
    allocate_pages,
    compute_slots,
    greedy_generate_contiguous,
    greedy_generate_paged,
    init_model,
    make_paged_batch,
    page_spec,
    paged_decode_step,
    paged_prefill_step,
    tiny,
)
from tests import tolerances as tol

BLOCK = 8


def _scrambled_tables(num_seqs, blocks_per_seq, seed):
    """Disjoint tables over blocks 1..N in a random physical order (block 0 is the null block)."""
    ids = np.random.RandomState(seed).permutation(np.arange(1, 1 + num_seqs * blocks_per_seq))
    return ids.reshape(num_seqs, blocks_per_seq).astype(np.int32)


@pytest.mark.parametrize("cfg_kwargs", [dict(), dict(num_kv_heads=1, tie_word_embeddings=True, rope_scaling=None)],
                         ids=["gqa2_llama3", "mqa_plain_tied"])
@pytest.mark.smoke
def test_paged_greedy_equals_contiguous(cfg_kwargs):
    cfg = tiny(**cfg_kwargs)
    model = init_model(cfg, seed=3, init_std=0.2)
    rs = np.random.RandomState(0)
    lens = (5, 23, 37)  # different lengths in one batch; 37 tokens = 5 prefill chunks of 8
    prompts = [rs.randint(0, cfg.vocab_size, n).tolist() for n in lens]
    new = 16
    per_seq = -(-(max(lens) + new) // BLOCK)
    tables = _scrambled_tables(len(lens), per_seq, seed=1)
    pages = allocate_pages(page_spec(cfg, 1 + tables.size, BLOCK))
    tok_p, logit_p, pages = greedy_generate_paged(model, pages, tables, prompts, new, chunk_size=BLOCK,
                                                  impl="reference")
    tok_c, logit_c = greedy_generate_contiguous(model, prompts, new, chunk_size=BLOCK)
    np.testing.assert_array_equal(tok_p, tok_c)
    assert len(set(tok_c.ravel().tolist())) > 8
    # Equal up to float32 rounding (tests/tolerances.py): float32 eps times the reduction lengths
    # along the model (contexts of up to 37 + 16 positions) times the logits' scale.
    atol = tol.model_atol(cfg, max(lens) + new, np.abs(logit_c).max(), score_mag=tol.score_bound(model))
    tol.assert_close(logit_p, logit_c, atol, "paged vs contiguous logits")


def test_prefill_chunking_is_invisible():
    """The same prompt in one chunk or in 4 chunks gives the same logits and pages."""
    cfg = tiny()
    model = init_model(cfg, seed=0, init_std=0.2)
    graphdef, state = nnx.split(model)
    toks = jnp.asarray(np.random.RandomState(5).randint(0, 256, (2, 32)), jnp.int32)
    tables = jnp.asarray(_scrambled_tables(2, 4, seed=7))
    spec = page_spec(cfg, 9, BLOCK)
    whole, pages1 = paged_prefill_step(graphdef, state, allocate_pages(spec),
                                       make_paged_batch(tables, [0, 0], [32, 32], 32, BLOCK), toks, impl="reference")
    pages4, parts = allocate_pages(spec), []
    for s in range(0, 32, 8):
        logits, pages4 = paged_prefill_step(graphdef, state, pages4, make_paged_batch(tables, [s, s], [8, 8], 8, BLOCK),
                                            toks[:, s:s + 8], impl="reference")
        parts.append(logits)
    # Equal up to float32 rounding (the matmuls see different shapes; tests/tolerances.py).
    s = tol.score_bound(model)
    tol.assert_close(np.concatenate(parts, 1), whole, tol.model_atol(cfg, 32, np.abs(whole).max(), score_mag=s),
                     "logits")
    tol.assert_close(pages4, pages1, tol.model_atol(cfg, 32, np.abs(pages1).max(), score_mag=s, through="kv"),
                     "pages")


def test_padding_rows_write_only_null_block():
    cfg = tiny()
    model = init_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    tables = jnp.asarray([[3, 1], [2, 4]], jnp.int32)
    pages = allocate_pages(page_spec(cfg, 5, BLOCK))
    # Row 1 is a padding row (q_lens 0) in a decode step.
    batch = make_paged_batch(tables, [0, 0], [1, 0], 1, BLOCK)
    assert batch.slots.tolist() == [[3 * BLOCK], [0]]
    assert batch.lengths.tolist() == [1, 0]
    logits, pages = paged_decode_step(graphdef, state, pages, batch, jnp.asarray([7, 9], jnp.int32), impl="reference")
    p = np.asarray(pages)
    assert np.abs(p[:, :, :, 3, 0]).sum() > 0  # row 0's token
    assert np.abs(p[:, :, :, [1, 2, 4]]).sum() == 0  # nothing else but the null block
    assert np.isfinite(np.asarray(logits)).all()


def test_compute_slots():
    tables = jnp.asarray([[5, 2, 0], [1, 4, 3]], jnp.int32)
    pos = jnp.asarray([[0, 7, 8, 17], [3, 16, 23, 24]], jnp.int32)
    valid = jnp.asarray([[True, True, True, True], [True, True, False, True]])
    slots = compute_slots(tables, pos, valid, BLOCK)
    # 17 -> logical block 2 = table entry 0 (null); 23 invalid -> null; 24 -> past the table -> null.
    assert slots.tolist() == [[40, 47, 16, 1], [11, 24, 7, 0]]


def test_decode_step_compiles_once_and_donates():
    cfg = tiny(num_layers=1, vocab_size=128)  # a config no other test uses: a fresh cache entry
    model = init_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    tables = jnp.asarray(_scrambled_tables(2, 2, seed=0))
    pages = allocate_pages(page_spec(cfg, 5, BLOCK))
    before = paged_decode_step._cache_size()
    for pos in (0, 1, 2):
        batch = make_paged_batch(tables, [pos, pos], [1, 1], 1, BLOCK)
        old = pages
        logits, pages = paged_decode_step(graphdef, state, pages, batch, jnp.asarray([pos, 3], jnp.int32),
                                          impl="reference")
        assert old.is_deleted()  # donated
    assert paged_decode_step._cache_size() - before == 1
    assert logits.shape == (2, 128) and logits.dtype == jnp.float32


def test_interpret_kernels_match_reference():
    """One small run through the Pallas kernels in interpret mode: same tokens and logits."""
    cfg = tiny(num_layers=1)
    model = init_model(cfg, seed=4, init_std=0.2)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 43, 44]]
    tables = _scrambled_tables(2, 2, seed=3)
    spec = page_spec(cfg, 5, BLOCK)
    ref_t, ref_l, _ = greedy_generate_paged(model, allocate_pages(spec), tables, prompts, 3, chunk_size=BLOCK,
                                            impl="reference")
    int_t, int_l, _ = greedy_generate_paged(model, allocate_pages(spec), tables, prompts, 3, chunk_size=BLOCK,
                                            impl="interpret")
    np.testing.assert_array_equal(int_t, ref_t)
    atol = tol.model_atol(cfg, 11 + 3, np.abs(ref_l).max(), score_mag=tol.score_bound(model))
    tol.assert_close(int_l, ref_l, atol, "interpret vs reference")


def test_bfloat16_paged_close_to_float32():
    cfg32 = tiny()
    model32 = init_model(cfg32, seed=1, init_std=0.2)
    graphdef, state = nnx.split(model32)
    cfg16 = cfg32.replace(dtype="bfloat16")
    graphdef16 = nnx.graphdef(abstract_model(cfg16))
    state16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state)  # same weights, rounded
    toks = jnp.asarray(np.random.RandomState(0).randint(0, 256, (1, 16)), jnp.int32)
    tables = jnp.asarray([[2, 1]], jnp.int32)
    batch = make_paged_batch(tables, [0], [16], 16, BLOCK)
    l32, _ = paged_prefill_step(graphdef, state, allocate_pages(page_spec(cfg32, 3, BLOCK)), batch, toks,
                                impl="reference")
    pages16 = allocate_pages(page_spec(cfg16, 3, BLOCK))
    assert pages16.dtype == jnp.bfloat16
    l16, pages16 = paged_prefill_step(graphdef16, state16, pages16, batch, toks, impl="reference")
    assert pages16.dtype == jnp.bfloat16 and l16.dtype == jnp.float32
    # bfloat16 weights and activations: bfloat16 eps per rounding along the model (one for each
    # weight and each stored activation, tests/tolerances.py) on top of float32 accumulation.
    atol = tol.model_atol(cfg16, 16, float(jnp.abs(l32).max()), score_mag=tol.score_bound(model32),
                          roundings=tol.llama_roundings(cfg16))
    tol.assert_close(l16, l32, atol, "bfloat16 vs float32 logits")
