"""Baseline: the same model (any `paged_kv.models.protocol.PagedModel`) over an ordinary contiguous KV cache.

Cache layout: one array `[num_layers, 2, batch, max_len, num_kv_heads, head_dim]` (axis 1: 0=K, 1=V);
sequence b's token at position p lives at `[:, :, b, p]`. Attention is plain `jnp` over all `max_len`
keys with a causal mask by position, and the same attend options as the paged path (scale, soft_cap,
alibi_slopes, window). Used as the reference for the paged path in tests and benchmarks.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from paged_kv.attention_spec import first_visible_code
from paged_kv.models.protocol import AttentionBackend, ModelFacts, attend_options, check_model, model_facts

if TYPE_CHECKING:
    from paged_kv.models.config import LlamaConfig


def init_contiguous_cache(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig, batch: int,
                          max_len: int, dtype: DTypeLike | None = None) -> jax.Array:
    """Zeroed cache `[num_layers, 2, batch, max_len, num_kv_heads, head_dim]` for `model` (a
    `paged_kv.models.protocol.PagedModel`, its facts or a `LlamaConfig`)."""
    f = model_facts(model)
    dtype = f.dtype if dtype is None else dtype
    return jnp.zeros((f.num_layers, 2, batch, max_len, f.num_kv_heads, f.head_dim), dtype)


def _make_attend(q_start, q_lens) -> AttentionBackend:
    """The `attend` over the contiguous cache (XLA einsums, traced layer ids, the default plan)."""

    def attend(layer, q, k, v, cache, **options):
        options = attend_options(options)
        b, t, qh, e = q.shape
        scale = options.get("scale")
        scale = e ** -0.5 if scale is None else scale
        slopes = options.get("alibi_slopes")
        kvh = k.shape[2]
        max_len = cache.shape[3]
        pos = q_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
        valid = jnp.arange(t)[None, :] < q_lens[:, None]
        write_pos = jnp.where(valid, pos, max_len)  # out of bounds -> dropped
        bidx = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        cache = cache.at[layer, 0, bidx, write_pos].set(k.astype(cache.dtype), mode="drop")
        cache = cache.at[layer, 1, bidx, write_pos].set(v.astype(cache.dtype), mode="drop")
        keys, values = cache[layer, 0], cache[layer, 1]  # [B, S, KVH, D]
        qg = q.reshape(b, t, kvh, qh // kvh, e).astype(jnp.float32)
        s = jnp.einsum("btkge,bske->bkgts", qg, keys.astype(jnp.float32)) * scale
        # The options in the kernels' order (scale, soft cap, ALiBi, then the mask), written out here
        # independently of pallas_kernels so the paged-vs-contiguous comparisons check them.
        cap = options.get("soft_cap")
        if cap is not None:
            s = cap * jnp.tanh(s / cap)
        if slopes is not None:  # [QH] -> [1, KVH, G, 1, 1], head h = kv * G + g
            slopes = jnp.asarray(slopes, jnp.float32).reshape(1, kvh, qh // kvh, 1, 1)
            dist = jnp.arange(max_len)[None, None, :] - pos[:, :, None]  # key - query position [B, T, S]
            s = s + slopes * dist[:, None, None].astype(jnp.float32)
        mask = jnp.arange(max_len)[None, None, :] <= pos[:, :, None]  # [B, T, S]
        window = options.get("window")
        if window is not None:  # the attention kind's first key (paged_kv.attention_spec): a
            # window's pos - W + 1, a chunk's pos // C * C; an AttentionSpec or its (traced) code
            first = first_visible_code(pos, window)
            mask = mask & (jnp.arange(max_len)[None, None, :] >= first[:, :, None])
        s = jnp.where(mask[:, None, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        out = jnp.einsum("bkgts,bske->btkge", p, values.astype(jnp.float32)).reshape(b, t, qh, e)
        out = jnp.where(valid[:, :, None, None], out, 0.0)
        return out.astype(q.dtype), cache

    return AttentionBackend(attend)


def contiguous_forward(model: nnx.Module | tuple[nnx.GraphDef, nnx.State], cache: jax.Array, tokens: jax.Array,
                       q_start: jax.Array, q_lens: jax.Array, *,
                       last_only: bool = False) -> tuple[jax.Array, jax.Array]:
    """Run a chunk: tokens int32[B, T] at positions q_start[b] + t (valid for t < q_lens[b]).

    Returns (float32 logits [B, T, V], or [B, V] at each sequence's last valid token when
    `last_only`; updated cache). Padding positions give zero attention outputs and write nothing.
    """
    model = check_model(model)
    b, t = tokens.shape
    positions = q_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    hidden, cache = model(tokens, positions, cache, _make_attend(q_start, q_lens))
    if last_only:
        hidden = hidden[jnp.arange(b), jnp.maximum(q_lens - 1, 0)]
    return model.logits(hidden), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "last_only"), donate_argnames=("cache",))
def contiguous_step(graphdef: nnx.GraphDef, state: nnx.State, cache: jax.Array, tokens: jax.Array,
                    q_start: jax.Array, q_lens: jax.Array, *, last_only: bool = False) -> tuple[jax.Array, jax.Array]:
    """Jitted pure step `(graphdef, state, cache, tokens[B, T], q_start[B], q_lens[B]) -> (logits, cache)`
    with the cache donated. A decode step is a chunk with T = 1 and q_lens = 1."""
    model = nnx.merge(graphdef, state)
    return contiguous_forward(model, cache, tokens, q_start, q_lens, last_only=last_only)


# ---------------------------------------------------------------------------- training-side scoring
def plain_forward(model: nnx.Module | tuple[nnx.GraphDef, nnx.State], tokens: jax.Array, *,
                  batch_invariant: bool = True) -> jax.Array:
    """The model's plain teacher-forced forward: tokens int32 ``[B, T]`` at positions ``0 .. T - 1``,
    causal attention over the sequence's own K/V, no cache and no paging. Returns float32 logits
    ``[B, T, V]`` (``[b, t]`` predicts token ``t + 1``).

    ``batch_invariant`` (default True): the model runs in its batch-invariant mode (the
    ``AttentionBackend``'s ``batch_invariant``; the Llama: ``paged_kv.pallas_kernels.invariant``), so
    each sequence's logits are the same bits as the engines' in that mode (``generate``,
    ``beam_search``, ``ServingEngine`` with ``batch_invariant=True``), whatever else is in the
    batch. Right padding is harmless: a position attends only to those before it. False: plain
    XLA ops (as fast as XLA makes them, bits that depend on the batch's shape)."""
    from paged_kv.pallas_kernels.invariant import contiguous_attention

    model = check_model(model)
    b, t = tokens.shape
    if not batch_invariant:
        cache = init_contiguous_cache(model, b, t)
        return contiguous_forward(model, cache, tokens, jnp.zeros((b,), jnp.int32), jnp.full((b,), t, jnp.int32))[0]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    every = jnp.ones((b, t), bool)

    def attend(layer, q, k, v, cache, **options):
        options = attend_options(options)
        scale = options.get("scale")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = contiguous_attention(q, k, v, positions, every, scale, options.get("soft_cap"),
                                   options.get("alibi_slopes"), options.get("window"))
        return out, cache

    hidden, _ = model(tokens, positions, None, AttentionBackend(attend, batch_invariant=True))
    return model.logits(hidden, batch_invariant=True)


def score_tokens(model: nnx.Module | tuple[nnx.GraphDef, nnx.State], tokens: jax.Array, *,
                 batch_invariant: bool = True) -> jax.Array:
    """Training-side log-probabilities: float32 ``[B, T - 1]``, entry ``[b, t]`` the log-probability
    of ``tokens[b, t + 1]`` given ``tokens[b, :t + 1]`` under `plain_forward`'s logits, with the
    sampler's ``log_softmax`` (``paged_kv.pallas_kernels.invariant.log_softmax``). With ``batch_invariant`` these equal,
    bit for bit, the log-probs the engines report for the same tokens in their
    ``batch_invariant`` mode (sampled or greedy, any batch): docs/batch_invariance.md."""
    logits = plain_forward(model, tokens, batch_invariant=batch_invariant)[:, :-1]
    b, t, v = logits.shape
    from paged_kv.pallas_kernels.invariant import log_softmax
    logp = log_softmax(logits.reshape(b * t, v))  # rows, as the sampler's [R, V]
    return jnp.take_along_axis(logp, tokens[:, 1:].reshape(b * t, 1), axis=-1).reshape(b, t)
