"""Per-row sampling (`sample_rows`, the serving step's sampler): the CPU's skips change no result,
and no row's token depends on the other rows' parameters."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.engine.sampling import filter_rows, sample_rows
from tests.tolerances import logprob_atol


def _logits(r=6, v=97, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((r, v)).astype(np.float32) * 3)


def _keys(r):
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(r))


def test_all_greedy_rows_are_the_argmax():
    x = _logits()
    r = x.shape[0]
    tok, lp = sample_rows(x, _keys(r), jnp.zeros(r), jnp.zeros(r, jnp.int32), jnp.ones(r))
    np.testing.assert_array_equal(tok, jnp.argmax(x, axis=-1))
    # Two computations of the same log-softmax (logits exact): (V + 3) eps apart at most.
    np.testing.assert_allclose(lp, jax.nn.log_softmax(x)[jnp.arange(r), tok], rtol=0,
                               atol=logprob_atol(0.0, x.shape[-1]))


def test_filter_keeps_every_token_at_top_p_one():
    # Many near-equal logits: the cumulative probability rounds up to 1 before the last token.
    x = jnp.asarray(np.random.default_rng(1).uniform(0, 1e-3, (4, 4099)).astype(np.float32))
    r = x.shape[0]
    out = filter_rows(x, jnp.full(r, 0.7), jnp.zeros(r, jnp.int32), jnp.ones(r))
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_array_equal(out, x / 0.7)


def test_a_rows_token_does_not_depend_on_its_batchmates():
    x = _logits(r=2)
    keys = _keys(2)
    temp = jnp.array([0.9, 0.0])
    for other_k, other_p in ((0, 1.0), (5, 1.0), (0, 0.3)):  # batchmate: no filter / top-k / top-p
        tok, lp = sample_rows(x, keys, temp, jnp.array([0, other_k], jnp.int32), jnp.array([1.0, other_p]))
        if other_k == 0 and other_p == 1.0:
            first = (int(tok[0]), float(lp[0]))
        assert (int(tok[0]), float(lp[0])) == first
    # ... nor on whether any batchmate samples at all.
    tok, _ = sample_rows(x, keys, jnp.array([0.9, 0.5]), jnp.zeros(2, jnp.int32), jnp.ones(2))
    assert int(tok[0]) == first[0]


def test_cpu_skips_give_the_gpu_forms_results_bit_for_bit():
    x = _logits(r=4)
    keys = _keys(4)
    cases = [(jnp.zeros(4), jnp.zeros(4, jnp.int32), jnp.ones(4)),  # all greedy: the draw skipped
             (jnp.array([0.0, 0.7, 1.3, 0.0]), jnp.zeros(4, jnp.int32), jnp.ones(4)),  # no filter: sort skipped
             (jnp.array([0.0, 0.7, 1.3, 0.9]), jnp.array([0, 5, 0, 3], jnp.int32), jnp.array([1.0, 1.0, 0.4, 0.9]))]
    for temp, top_k, top_p in cases:
        cpu = jax.jit(functools.partial(sample_rows, target="cpu"))(x, keys, temp, top_k, top_p)
        gpu = jax.jit(functools.partial(sample_rows, target="gpu"))(x, keys, temp, top_k, top_p)
        for a, b in zip(cpu, gpu):
            np.testing.assert_array_equal(a, b)
