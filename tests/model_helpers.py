"""Test utilities for the models: a prompt run through the paged cache in prefill chunks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_kv.models import allocate_pages, make_paged_batch, page_spec, paged_prefill_step

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
