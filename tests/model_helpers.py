"""Test utilities for the models: a prompt run through the paged cache in prefill chunks, and
``KnobModel``, a one-layer protocol model that passes every attend option (the GPT-2 tests run it
on one device, the sharding worker over a 2-device mesh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from paged_kv.models import allocate_pages, make_paged_batch, page_spec, paged_prefill_step, sharding

# Two sequences of up to four blocks each, on scattered, interleaved physical blocks (block 0 is
# the null block), so a wrong table lookup reads the other sequence's K/V.
_TABLES = [[8, 3, 5, 1], [2, 7, 4, 6]]


def paged_prefill_logits(model, toks: np.ndarray, block: int) -> np.ndarray:
    """float32 [2, T, V] logits of the prompts ``toks`` (int [2, T], T <= 4 * block) computed
    through the paged cache with the reference kernels, one block-sized prefill chunk at a time."""
    b, t = toks.shape
    assert b == len(_TABLES) and t <= block * len(_TABLES[0]), (b, t, block)
    graphdef, state = nnx.split(model)
    pages = allocate_pages(page_spec(model.config, 1 + b * len(_TABLES[0]), block))
    tables = jnp.asarray(_TABLES, jnp.int32)
    chunks = []
    for start in range(0, t, block):
        batch = make_paged_batch(tables, [start] * b, [block] * b, block, block)
        logits, pages = paged_prefill_step(graphdef, state, pages, batch, jnp.asarray(toks[:, start:start + block]),
                                           impl="reference")
        chunks.append(np.asarray(logits))
    return np.concatenate(chunks, 1)


class KnobModel(nnx.Module):
    """One attention layer that asks ``attend`` for a scale, a soft cap and ALiBi slopes (or none):
    embedding [V, d] -> q, k, v (GQA, 4 query heads over 2 KV heads of 16) -> attend -> head [64, V]."""

    def __init__(self, knobs: bool, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.num_layers, self.num_kv_heads, self.head_dim, self.vocab_size = 1, 2, 16, 64
        self.max_positions, self.dtype, self.knobs = 64, "float32", knobs
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (64, 32)))
        self.wq = nnx.Param(0.5 * jax.random.normal(rngs.params(), (32, 4, 16)))
        self.wk = nnx.Param(0.5 * jax.random.normal(rngs.params(), (32, 2, 16)))
        self.wv = nnx.Param(0.2 * jax.random.normal(rngs.params(), (32, 2, 16)))
        self.head = nnx.Param(0.2 * jax.random.normal(rngs.params(), (64, 64)))  # [QH * D, V]
        self.slopes = nnx.Param(jnp.array([0.5, 0.25, 0.125, 0.0625]))

    def __call__(self, tokens, positions, cache, attend):
        x = jnp.take(self.embed[...], tokens, axis=0, mode="clip")
        q, k, v = (jnp.einsum("btd,dhe->bthe", x, w[...]) for w in (self.wq, self.wk, self.wv))
        options = dict(scale=0.4, soft_cap=3.0, alibi_slopes=self.slopes[...]) if self.knobs else {}
        out, cache = attend(0, q, k, v, cache, **options)
        return out.reshape(out.shape[:2] + (64,)), cache

    def logits(self, hidden):
        return (hidden @ self.head[...]).astype(jnp.float32)

    def partition_specs(self, weights, tp):
        """Query and KV heads split over "tp" (the head's input rows, heads * D, too); the rest
        replicated. ALiBi slopes stay whole here: attend splits them with the query heads."""
        heads = {"wq": P(None, sharding.AXIS, None), "wk": P(None, sharding.AXIS, None),
                 "wv": P(None, sharding.AXIS, None), "head": P(sharding.AXIS, None)}
        name = lambda path: [getattr(k, "key", None) for k in path if getattr(k, "key", None) != "value"][-1]
        return jax.tree_util.tree_map_with_path(lambda path, x: heads.get(name(path), P()), weights)


KNOB_PROMPTS = [[3, 9, 27, 17, 51, 25, 11], [40, 2, 8, 32, 60]]
