"""Batch-invariant mode (``batch_invariant=True``; docs/batch_invariance.md): one probe request's
tokens and log-probs are the same bits whatever runs beside it, in ``generate`` and in the
``ServingEngine`` (batchmates, rows, max_seqs, chunk sizes, prefix cache warm or cold, preemption
and recompute), and equal to the plain teacher-forced forward's (``score_tokens``). The
primitives (``paged_kv.pallas_kernels.invariant``) are checked row by row.

Mutation check: with ``batch_invariant=False`` (``BI`` below) the engine tests fail on XLA:CPU
(log-probs differ by ~1e-6 at batch >= 16, and the plain forward's differ from the decoded ones)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import paged_kv as pk
from paged_kv import engine
from paged_kv.checkpoints import BUILTIN
from paged_kv.engine import BeamParams, Request, SamplingParams, ServingConfig, ServingEngine
from paged_kv.models import allocate_pages, load_hf_checkpoint, page_spec
from paged_kv.models.contiguous import score_tokens
from paged_kv.pallas_kernels import invariant as inv

BI = True  # the mode under test (False: the mutation check, every engine test below must fail)
BS = 16
N_NEW = 16
PROBE = tuple(int(t) for t in np.random.RandomState(7).randint(0, 256, 40))
GREEDY = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)  # all N_NEW tokens, past the model's EOS


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(BUILTIN)


def _generate(model, prompts, row_of_probe, chunk_size, max_seqs=64):
    mgr = pk.ManagerConfig(num_blocks=256, block_size=BS, max_seqs=max_seqs, max_blocks_per_seq=16)
    toks, lens = engine.pad_prompts(prompts)
    pages = allocate_pages(page_spec(model.config, mgr.num_blocks, mgr.block_size))
    out, _, _ = engine.generate(model, pages, toks, lens, jax.random.key(0), GREEDY,
                                manager=mgr, impl="reference", chunk_size=chunk_size, batch_invariant=BI)
    return (np.asarray(out.tokens[row_of_probe, 0]).tolist(),
            np.asarray(out.logprobs[row_of_probe, 0]).astype(np.float64).tolist())


@pytest.fixture(scope="module")
def alone(model):
    """The probe alone in ``generate``: (tokens, log-probs), the reference for every test."""
    return _generate(model, [list(PROBE)], 0, 8)


# ---------------------------------------------------------------------------- primitives
@pytest.mark.parametrize("k,n", [(128, 384), (384, 128), (128, 259), (2048, 512)])
def test_primitives_row_invariant(k, n):
    """A row's bits of matmul (one dot, and in two parts over K or N), rms_normalize, log_softmax
    and tree_sum do not depend on the number of rows beside it (M 1..70) nor on its place among
    them."""
    rs = np.random.RandomState(0)
    w = jnp.asarray(rs.randn(k, n).astype(np.float32))
    x = jnp.asarray(rs.randn(70, k).astype(np.float32))
    probe = x[5]
    fns = {"matmul": jax.jit(lambda a: inv.matmul(a, w)),
           "matmul_t": jax.jit(lambda a: inv.matmul(a, w.T, transpose_w=True)),
           # The two-part forms (tp 1 = tp 2): K halves added, and N halves of a transposed head.
           "matmul_k": jax.jit(lambda a: inv.matmul(a, w, split="k")),
           "matmul_n_t": jax.jit(lambda a: inv.matmul(a, w.T, transpose_w=True, split="n")),
           "rms": jax.jit(lambda a: inv.rms_normalize(a, 1e-5)),
           "log_softmax": jax.jit(inv.log_softmax),
           "tree_sum": jax.jit(lambda a: inv.tree_sum(a * a, -1))}
    for name, f in fns.items():
        ref = np.asarray(f(probe[None]))[0]
        for m in (2, 3, 16, 17, 33, 64, 70):
            for pos in (0, m // 2, m - 1):
                got = np.asarray(f(x[:m].at[pos].set(probe)))[pos]
                assert np.array_equal(got, ref), (name, m, pos)


def test_tree_sum_matches_sum():
    x = jnp.asarray(np.random.RandomState(1).randn(3, 7, 37).astype(np.float32))
    for axis in (0, 1, 2, -1):
        np.testing.assert_allclose(inv.tree_sum(x, axis), x.sum(axis), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- engines
def test_plain_forward_equals_decoded(model, alone):
    """score_tokens (the trainer's plain forward, no cache) of the probe plus its answer gives the
    decoded log-probs bit for bit, alone and in a batch with other sequences (right-padded)."""
    tokens, logprobs = alone
    seq = list(PROBE) + tokens
    rs = np.random.RandomState(3)
    batch = np.stack([rs.randint(0, 256, len(seq) + 9), np.array(seq + [0] * 9), rs.randint(0, 256, len(seq) + 9)])
    for rows, row in ((np.array([seq]), 0), (batch, 1)):
        got = np.asarray(jax.jit(lambda s: score_tokens(model, s))(jnp.asarray(rows, jnp.int32)))[row]
        assert got[len(PROBE) - 1:len(seq) - 1].astype(np.float64).tolist() == logprobs


def test_generate_invariant(model, alone):
    """generate: the probe among batchmates, in another row, with other prefill chunk sizes."""
    rs = np.random.RandomState(5)
    for batch, row, chunk in ((5, 3, 32), (24, 17, 8)):
        prompts = [rs.randint(0, 256, rs.randint(1, 120)).tolist() for _ in range(batch)]
        prompts[row] = list(PROBE)
        assert _generate(model, prompts, row, chunk) == alone, (batch, row, chunk)


def test_beam_search_invariant(model):
    """beam_search: the probe's beams alone and beside another prompt, in either row."""
    mgr = pk.ManagerConfig(num_blocks=128, block_size=BS, max_seqs=8, max_blocks_per_seq=16)
    other = np.random.RandomState(9).randint(0, 256, 70).tolist()
    outs = []
    for prompts, row in (([list(PROBE)], 0), ([other, list(PROBE)], 1)):
        toks, lens = engine.pad_prompts(prompts)
        pages = allocate_pages(page_spec(model.config, mgr.num_blocks, mgr.block_size))
        out, _, _ = engine.beam_search(model, pages, toks, lens, BeamParams(beam_width=3, max_new_tokens=8),
                                       manager=mgr, impl="reference", batch_invariant=BI)
        outs.append((np.asarray(out.tokens[row]).tolist(), np.asarray(out.sum_logprobs[row]).tolist()))
    assert outs[0] == outs[1]


SAMPLED = SamplingParams(max_new_tokens=N_NEW, temperature=0.8, n=2, ignore_eos=True)


@pytest.fixture(scope="module")
def alone_sampled(model):
    """A sampled probe (n=2, its own seed) alone in the ServingEngine: its samples and log-probs."""
    (out,) = ServingEngine(model, _serving_config(*CONFIGS[1])).run(
        [Request(PROBE[::-1], SAMPLED, request_id="sampled", seed=123)])
    return out.tokens, out.logprobs


# (max_seqs, chunk_size, num_blocks): the last two pressure the pool into preemptions. The engine's
# programs depend only on these, so alone_sampled (CONFIGS[1]) shares them with
# test_serving_invariant's draws instead of compiling its own.
CONFIGS = [(8, 32, 96), (4, 8, 64), (8, 16, 14), (4, 32, 11)]


def _serving_config(max_seqs: int, chunk: int, blocks: int) -> ServingConfig:
    """The module's ServingConfig for (max_seqs, chunk size, blocks): 16-token blocks, 16 blocks a
    row, up to 4 prefill rows, the reference attention, the mode under test."""
    mgr = pk.ManagerConfig(num_blocks=blocks, block_size=BS, max_seqs=max_seqs, max_blocks_per_seq=16)
    return ServingConfig(mgr, chunk_size=chunk, max_prefill_rows=min(4, max_seqs), impl="reference",
                         batch_invariant=BI)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(config=st.sampled_from(CONFIGS),
       mates=st.lists(st.tuples(st.integers(1, 110), st.integers(0, 12), st.integers(4, 24), st.booleans()),
                      max_size=7),
       probe_arrival=st.integers(0, 6), shared_prefix=st.integers(0, 40))
def test_serving_invariant(model, alone, alone_sampled, config, mates, probe_arrival, shared_prefix):
    """ServingEngine: a greedy probe among drawn batchmates (lengths, arrivals, budgets, greedy or
    sampled; one may share the probe's first ``shared_prefix`` tokens, so the probe hits the
    prefix cache), in drawn pools (max_seqs, chunk size, few blocks: preemption and recompute)
    gives the same tokens and log-probs as the probe alone in ``generate``; a sampled probe with
    its own seed (two samples) the same samples and log-probs as alone in the engine."""
    cfg = _serving_config(*config)
    rs = np.random.RandomState(len(mates) * 131 + shared_prefix)
    reqs = [Request(PROBE, GREEDY, arrival=probe_arrival, request_id="probe"),
            Request(PROBE[::-1], SAMPLED, arrival=probe_arrival + 1, request_id="sampled", seed=123)]
    for i, (length, arrival, budget, sampled) in enumerate(mates):
        prompt = rs.randint(0, 256, length).tolist()
        if i == 0 and shared_prefix:
            prompt = list(PROBE[:shared_prefix]) + prompt
        params = SamplingParams(max_new_tokens=budget, temperature=0.8 if sampled else 0.0)
        reqs.append(Request(prompt, params, arrival=arrival, request_id=i, seed=i))
    outs = {o.request_id: o for o in ServingEngine(model, cfg).run(reqs)}
    probe = outs["probe"]
    assert probe.error is None
    assert (probe.tokens[0], probe.logprobs[0]) == alone
    assert (outs["sampled"].tokens, outs["sampled"].logprobs) == alone_sampled


def test_serving_preempted_and_cached(model, alone):
    """A pinned workload in which the probe hits the prefix cache (a batchmate holds its first
    two blocks) and is preempted and recomputed (10 blocks): still the bits of the probe alone."""
    cfg = _serving_config(4, 16, 10)
    rs = np.random.RandomState(11)
    mates = SamplingParams(max_new_tokens=30, ignore_eos=True)  # past EOS: they hold their blocks
    reqs = [Request(list(PROBE[:32]) + rs.randint(0, 256, 20).tolist(), mates, request_id="m0"),
            Request(rs.randint(0, 256, 60).tolist(), mates, request_id="m1"),
            Request(PROBE, GREEDY, arrival=3, request_id="probe")]
    probe = {o.request_id: o for o in ServingEngine(model, cfg).run(reqs)}["probe"]
    assert probe.stats.preemptions >= 1 and probe.stats.cached_prompt_tokens >= 32
    assert (probe.tokens[0], probe.logprobs[0]) == alone


def test_rl_example_runs():
    """examples/rl_scoring.py: the engine's sampled log-probs equal score_tokens' (it asserts)."""
    from examples import rl_scoring
    rl_scoring.main()


def test_sampled_generate_equals_serving(model, alone_sampled):
    """A sampled prompt with its own seed: ``generate`` in row 2 of 4 gives the samples and
    log-probs the ServingEngine gave it alone (the seeding depends only on the request; the mode
    makes the logits equal)."""
    rs = np.random.RandomState(13)
    prompts = [rs.randint(0, 256, n).tolist() for n in (30, 90, 1, 64)]
    prompts[2] = list(PROBE[::-1])
    mgr = pk.ManagerConfig(num_blocks=256, block_size=BS, max_seqs=16, max_blocks_per_seq=16)
    toks, lens = engine.pad_prompts(prompts)
    pages = allocate_pages(page_spec(model.config, mgr.num_blocks, mgr.block_size))
    out, _, _ = engine.generate(model, pages, toks, lens, jax.random.key(0), SAMPLED, manager=mgr, impl="reference",
                                chunk_size=16, seeds=[1, 2, 123, 4], batch_invariant=BI)
    n = np.asarray(out.lengths[2])
    tokens = [np.asarray(out.tokens[2, i, :n[i]]).tolist() for i in range(SAMPLED.n)]
    logprobs = [np.asarray(out.logprobs[2, i, :n[i]]).astype(np.float64).tolist() for i in range(SAMPLED.n)]
    assert (tokens, logprobs) == alone_sampled
