"""Batch invariance of the Pallas kernels (interpret mode): ``batch_invariant=True`` with a Pallas
``impl`` (docs/batch_invariance.md).

* Attention (``pallas_kernels/invariant_attention.py``): a query's output bits are the same decoded
  alone or in a batch (any row, any batch size), and the same prefilled in any chunk split (any
  batch) as decoded; with soft_cap, ALiBi, a sliding window, bfloat16.
* ``layer_matmul``'s invariant plan: a row's bits are the same for M = 1, 5, 17, 70, in any row
  tile, for one weight and a group, with the norm's scale and a bias.

Mutation checks (each made alone, each fails a test here): the attention's key step made to
depend on the batch (``key_step(...) * batch``), the row tile made 64 for more than one token,
``batch_invariant`` decode routed to the default split-K decode kernel, the matmul's invariant
plan replaced by the shape-dependent ``plan``, and RoPE on the call's own shape (the model test).
Not caught here: a row tile of 32 (XLA:CPU's dot gives a row the same bits in 16 and 32 rows).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv.pallas_kernels as pk
from paged_kv.models import allocate_pages, init_model, make_paged_batch, page_spec, paged_forward
from paged_kv.models.config import tiny
from paged_kv.pallas_kernels import invariant_attention
from paged_kv.pallas_kernels.testing import PagedCase, make_paged_case, random_queries

BS = 8
D = 32
HKV = 2
HQ = 4  # GQA group of 2: a decode step's 2 rows sit in a 16-row tile; a prefill chunk's span tiles
LENGTHS = (75, 20, 71, 5)  # > one key step of 64: two steps (the default kernels' tile is 128 keys)


def _decode(q: jnp.ndarray, case: PagedCase, tables: jnp.ndarray, lengths: list | np.ndarray, **knobs) -> np.ndarray:
    return np.asarray(pk.paged_decode_attention(q, case.pages, case.layer, tables, jnp.asarray(lengths, jnp.int32),
                                                impl="interpret", batch_invariant=True, **knobs).astype(jnp.float32))


def _prefill(q: jnp.ndarray, case: PagedCase, tables: jnp.ndarray, q_start: list, q_lens: list,
             **knobs) -> np.ndarray:
    return np.asarray(pk.paged_prefill_attention(
        q, case.pages, case.layer, tables, jnp.asarray(q_start, jnp.int32), jnp.asarray(q_lens, jnp.int32),
        impl="interpret", batch_invariant=True, **knobs).astype(jnp.float32))


KNOBS = {
    "plain": {},
    "soft_cap+alibi": {"soft_cap": 5.0, "alibi_slopes": jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)},
}


@pytest.fixture(scope="module")
def case() -> PagedCase:
    # 400 table columns: wide enough for the default decode kernel to split K, by a count that
    # follows the batch (50 splits at batch 1, 5 at 75), so routing invariant decode to it shows;
    # this kernel's steps stop at each tile's last visible position whatever the width.
    return make_paged_case(np.random.default_rng(0), LENGTHS, block_size=BS, head_dim=D, num_kv_heads=HKV,
                           extra_columns=390)


@pytest.mark.parametrize("knob", list(KNOBS))
def test_decode_alone_equals_batched_and_prefill_chunks(case: PagedCase, knob: str) -> None:
    """Sequence 0's tokens at every position: decoded alone, decoded all at once (a batch of 75
    rows), decoded among the other sequences (rows 2 of 4 and 0 of 3), and prefilled whole, in
    chunks of 13/17/45 and 1/74 beside another sequence: the same bits everywhere."""
    knobs = KNOBS[knob]
    n = LENGTHS[0]
    table0 = case.block_tables[:1]
    q = random_queries(np.random.default_rng(1), (n, HQ, D))
    # Decode at each position p (length p + 1): one batch of n rows over the same table.
    dec = _decode(q, case, jnp.repeat(table0, n, axis=0), np.arange(1, n + 1), **knobs)
    for p in (0, 70, n - 1):  # alone
        np.testing.assert_array_equal(_decode(q[p:p + 1], case, table0, [p + 1], **knobs), dec[p:p + 1])
    # Among batchmates, in another row.
    others = random_queries(np.random.default_rng(2), (4, HQ, D))
    p = n - 1
    qb = others.at[2].set(q[p])
    tb = case.block_tables[jnp.asarray([1, 2, 0, 3])]
    np.testing.assert_array_equal(_decode(qb, case, tb, [20, 71, n, 5], **knobs)[2], dec[p])
    qb = others[:3].at[0].set(q[p])
    np.testing.assert_array_equal(_decode(qb, case, case.block_tables[:3], [n, 20, 71], **knobs)[0], dec[p])
    # Prefill: the whole prompt at once, and in chunks.
    whole = _prefill(q[None], case, table0, [0], [n], **knobs)[0]
    np.testing.assert_array_equal(whole, dec)
    for cuts in ((13, 30), (1,)):
        bounds = (0, *cuts, n)
        for a, b in zip(bounds[:-1], bounds[1:]):
            t = max(17, b - a)  # chunk width (padded); a batchmate (sequence 2) in row 0
            qc = jnp.zeros((2, t, HQ, D), q.dtype).at[1, :b - a].set(q[a:b])
            qc = qc.at[0].set(random_queries(np.random.default_rng(3), (t, HQ, D)))
            tc = case.block_tables[jnp.asarray([2, 0])]
            out = _prefill(qc, case, tc, [40, a], [qc.shape[1], b - a], **knobs)
            np.testing.assert_array_equal(out[1, :b - a], dec[a:b], err_msg=f"chunk {a}..{b}")


def test_bfloat16_and_window(case: PagedCase) -> None:
    """bfloat16 pages, and a sliding window of 10 (an int32 scalar, as a model's per-layer window
    arrives): decoding alone equals a batch and a prefill chunk; the window changes the result."""
    pages16 = case.pages.astype(jnp.bfloat16)
    n = LENGTHS[2]  # 71 positions: the window skips whole key steps
    table = case.block_tables[2:3]
    q = random_queries(np.random.default_rng(4), (n, HQ, D), jnp.bfloat16)
    scale = D ** -0.5
    window = jnp.asarray(10, jnp.int32)
    dec = invariant_attention.paged_decode_invariant_pallas(
        q, pages16, case.layer, jnp.repeat(table, n, axis=0), jnp.arange(1, n + 1, dtype=jnp.int32),
        scale=scale, interpret=True, window=window)
    alone = invariant_attention.paged_decode_invariant_pallas(
        q[n - 1:], pages16, case.layer, table, jnp.asarray([n], jnp.int32), scale=scale, interpret=True,
        window=window)
    np.testing.assert_array_equal(np.asarray(alone[0], np.float32), np.asarray(dec[n - 1], np.float32))
    pre = invariant_attention.paged_invariant_attention_pallas(
        q[None, 30:], pages16, case.layer, table, jnp.asarray([30], jnp.int32), jnp.asarray([n - 30], jnp.int32),
        scale=scale, interpret=True, window=window)
    np.testing.assert_array_equal(np.asarray(pre[0], np.float32), np.asarray(dec[30:], np.float32))
    full = invariant_attention.paged_decode_invariant_pallas(
        q[n - 1:], pages16, case.layer, table, jnp.asarray([n], jnp.int32), scale=scale, interpret=True)
    assert not np.array_equal(np.asarray(full, np.float32), np.asarray(alone, np.float32))


@pytest.mark.parametrize("grouped", [False, True])
def test_layer_matmul_invariant_rows(grouped: bool) -> None:
    """layer_matmul's invariant plan: rows 0 and 4 of x give the same bits for M = 1, 5, 17, 70 and
    placed at rows 63/64 (either side of a row tile's edge) of M = 70."""
    rs = np.random.RandomState(0)
    k, ns, layers = 256, (96, 32), 2
    x = jnp.asarray(rs.randn(70, k).astype(np.float32))
    ws = tuple(jnp.asarray(rs.randn(layers, k, n).astype(np.float32) / 16) for n in ns)
    scale = jnp.asarray(rs.rand(layers, k).astype(np.float32) + 0.5)
    bias = tuple(jnp.asarray(rs.randn(layers, n).astype(np.float32)) for n in ns)
    w, b = (ws, bias) if grouped else (ws[0], bias[0])

    def run(xm: jnp.ndarray) -> list[np.ndarray]:
        out = pk.layer_matmul(xm, w, jnp.asarray(1), scale=scale, bias=b, impl="interpret", batch_invariant=True)
        return [np.asarray(o) for o in (out if grouped else (out,))]

    base = run(x[:1])
    for m in (5, 17, 70):
        for got, want in zip(run(x[:m]), base):
            np.testing.assert_array_equal(got[:1], want, err_msg=f"M={m}")
    ref = run(x[4:5])
    for row in (63, 64):
        moved = x.at[row].set(x[4])
        for got, want in zip(run(moved), ref):
            np.testing.assert_array_equal(got[row:row + 1], want, err_msg=f"row {row}")


def test_model_pallas_invariant_prefill_chunks_and_decode() -> None:
    """The whole model (tiny Llama, one layer, the scan with in-place ``layer_matmul``: Pallas
    attention and projections in interpret mode): an 8-token prompt's logits prefilled alone in
    one padded chunk (72 rows: the default matmul plan takes 64-row tiles) equal, bit for
    bit, its first 7 tokens' prefilled beside another sequence (a chunk of 8 rows each) and its
    last token's decoded in a batch of 2."""
    cfg = tiny(num_layers=1)
    model = init_model(cfg, seed=2, init_std=0.2)
    rs = np.random.RandomState(0)
    tok_a = jnp.asarray(rs.randint(0, cfg.vocab_size, 8), jnp.int32)
    tok_b = jnp.asarray(rs.randint(0, cfg.vocab_size, 9), jnp.int32)
    spec = page_spec(cfg, 8, 4)
    run = functools.partial(paged_forward, model, impl="interpret", batch_invariant=True)
    alone, _ = run(allocate_pages(spec), make_paged_batch([[1, 2, 0]], [0], [8], 72, 4),
                   jnp.zeros((1, 72), jnp.int32).at[0, :8].set(tok_a))
    tables = [[4, 5, 6], [1, 2, 0]]
    chunk, pages = run(allocate_pages(spec), make_paged_batch(tables, [0, 0], [8, 7], 8, 4),
                       jnp.stack([tok_b[:8], jnp.zeros(8, jnp.int32).at[:7].set(tok_a[:7])]))
    dec, _ = run(pages, make_paged_batch(tables, [8, 7], [1, 1], 1, 4), jnp.stack([tok_b[8], tok_a[7]]))
    got = np.concatenate([np.asarray(chunk[1, :7]), np.asarray(dec[1:2])])
    np.testing.assert_array_equal(got, np.asarray(alone[0, :8]))
