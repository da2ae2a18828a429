"""Host-driven greedy generation over the paged or the contiguous cache (tests, benchmarks).

Prompts of different lengths are prefilled in chunks of `chunk_size` tokens per sequence (chunk c
covers positions [c * chunk_size, (c + 1) * chunk_size)); then one decode step per new token. The
paged loop takes the block tables from the caller (allocation is not the model's business): each
table must hold enough blocks for the prompt plus the new tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from paged_kv.models.contiguous import contiguous_step, init_contiguous_cache
from paged_kv.models.paged import make_paged_batch, paged_decode_step, paged_prefill_step


def _greedy(prefill: Callable, decode: Callable, prompts: Sequence[Sequence[int]], max_new_tokens: int,
            chunk_size: int):
    lens = np.array([len(p) for p in prompts], np.int32)
    if lens.min() < 1:
        raise ValueError("every prompt needs at least one token")
    b = len(prompts)
    last_logits = [None] * b
    num_chunks = -(-int(lens.max()) // chunk_size)
    for c in range(num_chunks):
        start = c * chunk_size
        q_start = np.minimum(start, lens).astype(np.int32)
        q_lens = np.clip(lens - start, 0, chunk_size).astype(np.int32)
        toks = np.zeros((b, chunk_size), np.int32)
        for i, p in enumerate(prompts):
            seg = p[start:start + chunk_size]
            toks[i, :len(seg)] = seg
        logits = np.asarray(prefill(toks, q_start, q_lens))  # [B, V] at the last valid token
        for i in range(b):
            if q_lens[i] > 0 and start + q_lens[i] == lens[i]:
                last_logits[i] = logits[i]
    step_logits = [np.stack(last_logits)]
    tokens = [step_logits[0].argmax(-1).astype(np.int32)]
    for s in range(max_new_tokens - 1):
        logits = np.asarray(decode(tokens[-1], (lens + s).astype(np.int32)))
        step_logits.append(logits)
        tokens.append(logits.argmax(-1).astype(np.int32))
    return np.stack(tokens, 1), np.stack(step_logits, 1)


def greedy_generate_paged(model: nnx.Module, pages: jax.Array, block_tables: ArrayLike,
                          prompts: Sequence[Sequence[int]], max_new_tokens: int, *, chunk_size: int = 16,
                          impl: str = "auto") -> tuple[np.ndarray, np.ndarray, jax.Array]:
    """Greedy decoding through the paged cache.

    Returns (tokens int32[B, N], logits float32[B, N, V] that chose each token, pages). `pages` is
    donated; `block_tables` int32[B, M] in logical order (any physical order).
    """
    graphdef, state = nnx.split(model)
    block_size = pages.shape[4]
    need = max(len(p) for p in prompts) + max_new_tokens - 1  # the last token's K/V is never written
    if np.shape(block_tables)[1] * block_size < need:
        raise ValueError(f"block_tables hold {np.shape(block_tables)[1]} blocks of {block_size} tokens per sequence; "
                         f"{need} tokens need {-(-need // block_size)}")
    tables = jnp.asarray(block_tables, jnp.int32)
    box = [pages]

    def prefill(toks, q_start, q_lens):
        batch = make_paged_batch(tables, q_start, q_lens, toks.shape[1], block_size)
        logits, box[0] = paged_prefill_step(graphdef, state, box[0], batch, jnp.asarray(toks), impl=impl,
                                            last_only=True)
        return logits

    def decode(toks, positions):
        batch = make_paged_batch(tables, positions, np.ones_like(positions), 1, block_size)
        logits, box[0] = paged_decode_step(graphdef, state, box[0], batch, jnp.asarray(toks), impl=impl)
        return logits

    tokens, logits = _greedy(prefill, decode, prompts, max_new_tokens, chunk_size)
    return tokens, logits, box[0]


def greedy_generate_contiguous(model: nnx.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                               chunk_size: int = 16, max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding through a contiguous cache. Returns (tokens [B, N], logits [B, N, V])."""
    graphdef, state = nnx.split(model)
    if max_len is None:
        max_len = max(len(p) for p in prompts) + max_new_tokens
    box = [init_contiguous_cache(model, len(prompts), max_len)]

    def prefill(toks, q_start, q_lens):
        logits, box[0] = contiguous_step(graphdef, state, box[0], jnp.asarray(toks), jnp.asarray(q_start),
                                         jnp.asarray(q_lens), last_only=True)
        return logits

    def decode(toks, positions):
        logits, box[0] = contiguous_step(graphdef, state, box[0], jnp.asarray(toks)[:, None], jnp.asarray(positions),
                                         jnp.ones(len(positions), jnp.int32), last_only=True)
        return logits

    return _greedy(prefill, decode, prompts, max_new_tokens, chunk_size)
