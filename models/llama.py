"""Llama 3 family decoder in Flax NNX, with the KV cache as an explicit argument.

The module holds weights only. Where K/V are stored and how attention reads them is supplied by the
caller as `attend`, a `paged_kv.models.protocol.AttentionBackend`, so the same weights run over the
paged KV cache (`paged_kv.models.paged`) and over an ordinary contiguous cache
(`paged_kv.models.contiguous`):

    attend(layer, q[B, T, QH, D], k[B, T, KVH, D], v[B, T, KVH, D], cache) -> (out[B, T, QH, D], cache)

The layer loop follows the layout (below) and the backend's plan, and every layer runs the one
`DecoderLayer.__call__`, whose `LayerAccess` says how it reads its weights:
  stacked, scanned: one `jax.lax.scan` over the layer axis, `layer` a traced int32 scalar; the
    scan slices each layer's weights (`attend.layer_matmul` None: the CPU), or the projections
    read the stacked weights in place through `attend.layer_matmul` (the Pallas kernels on one
    GPU, where XLA:GPU would copy the slices).
  unrolled: Python-int layer ids, on the `per_layer` layout (what the engines run when
    `attend.static_layer`: the Pallas kernels over a tensor-parallel mesh), or on static slices
    of the stacked weights when a stacked model meets such a backend.
The kernels take the layer as an operand, so every layer shares one compiled kernel either way;
`paged_kv.models.layer_layout.layout_for_impl` is where the layout is chosen.

q and k arrive with RoPE applied; `attend` stores k/v into `cache` and attends. Dimension names in
einsum strings: b batch, t query tokens, d model width, h query heads, k kv heads, g heads per kv
head, e head dim, f MLP width, v vocabulary.

Parameter layout (HF tensor it maps to in `paged_kv.models.hf_io`). The decoder layers are stacked: `layers`
is one `DecoderLayer` whose every parameter has a leading layer axis L = num_layers, and the
forward runs one `jax.lax.scan` over that axis (compile time independent of depth). Layer i's
slice `[i]` is HF's `model.layers.{i}.` tensor:
  embed                  [V, d]            model.embed_tokens.weight
  layers.attn.q_proj     [L, d, QH, D]     ...self_attn.q_proj.weight  [QH*D, d] transposed
  layers.attn.k_proj     [L, d, KVH, D]    ...self_attn.k_proj.weight
  layers.attn.v_proj     [L, d, KVH, D]    ...self_attn.v_proj.weight
  layers.attn.o_proj     [L, QH, D, d]     ...self_attn.o_proj.weight  [d, QH*D] transposed
  layers.mlp.gate/up     [L, d, F]; down [L, F, d]
  layers.input_norm / post_attn_norm [L, d]; final_norm [d]
  lm_head                [V, d]            lm_head.weight (absent when tied)

`per_layer(model)` gives the other layout the forward accepts: `layers` an `nnx.List` of L
`DecoderLayer`s, one array per weight per layer (`layers.{i}.attn.q_proj` [d, QH, D], ...), run
unrolled. The engines convert to it, once and outside `jit`, when their kernels are Pallas over a
mesh (see `per_layer` for why); loading, saving and the scans (CPU, one GPU) use the stacked layout.

Family switches (`LlamaConfig`; each parameter exists only when its switch is on):
  layers.attn.q_bias  [L, QH, D]; k_bias, v_bias [L, KVH, D]  ...self_attn.{q,k,v}_proj.bias  (qkv_bias)
  layers.attn.o_bias  [L, d]                                  ...self_attn.o_proj.bias        (o_bias)
  layers.attn.q_norm / k_norm [L, D] (RMSNorm per head)       ...self_attn.{q,k}_norm.weight  (qk_norm)
  layers.mlp.gate_bias / up_bias [L, F]; down_bias [L, d]     ...mlp.{gate,up,down}_proj.bias (mlp_bias)
  layers.attn_out_norm / mlp_out_norm [L, d]                  ...post_attention_layernorm / post_feedforward_layernorm (sandwich_norm;
                                                              post_attn_norm is then ...pre_feedforward_layernorm)
Gemma's other switches have no parameters: `norm_offset` (every norm scales by 1 + w), GeGLU
(`hidden_act`), `embed_scale`, the attend options (`query_pre_attn_scalar`'s scale, `attn_soft_cap`),
`final_soft_cap` in `logits`. Per layer, `LlamaConfig.attend_specs[i]` goes to `attend` as its
`window` option (the `AttentionSpec` unrolled, None for a full layer; in the scan its int32
`code` per layer, 0 for full attention; never passed when every layer is full), and the layers of `LlamaConfig.local_rope` rotate with
the local base (Gemma 3).
"""  # noqa: E501 (a table row)

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from paged_kv.attention_spec import AttentionSpec, SlidingWindow
from paged_kv.models.config import LlamaConfig, rope_inv_freq
from paged_kv.models.protocol import AttentionBackend, LayerMatmul, as_backend, in_vocab
from paged_kv.models.tp_layout import weight_specs
from paged_kv.pallas_kernels import invariant as invariant_ops

Array = jax.Array


def _normal(rngs: nnx.Rngs, shape, dtype, std: float):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)



def _window_option(spec: AttentionSpec) -> int | AttentionSpec | None:
    """A layer's static `window` option for `attend`: None (full), a sliding window's int (as
    before attention kinds had a type), or the spec itself (a chunk)."""
    if spec.is_full:
        return None
    return spec.window if isinstance(spec, SlidingWindow) else spec

class RMSNorm(nnx.Module):
    """y = scale * x / sqrt(mean(x^2) + eps); statistics in float32, as in HF.

    `offset` (Gemma): y = (1 + scale) * x / sqrt(mean(x^2) + eps), all in float32 and cast to x's
    dtype once at the end (the scale starts at 0, the identity), as transformers' Gemma RMSNorm."""

    def __init__(self, dim: int, eps: float, dtype: DTypeLike, offset: bool = False):
        self.eps = eps
        self.offset = offset
        self.scale = nnx.Param((jnp.zeros if offset else jnp.ones)((dim,), dtype))

    def __call__(self, x: Array, invariant: bool = False) -> Array:
        return self.apply(x, self.scale[...], invariant)

    def apply(self, x: Array, scale: Array, invariant: bool = False) -> Array:
        """The norm of x[..., dim] with `scale` [dim] (this norm's weight, or one layer's slice of
        the stacked weight), in x's dtype."""
        if not self.offset:
            return scale * self.normalize(x, invariant)
        x32 = x.astype(jnp.float32)  # Gemma: normalise and scale in float32, one rounding at the end
        normed = invariant_ops.rms_normalize(x32, self.eps) if invariant else \
            x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)

    def normalize(self, x: Array, invariant: bool = False) -> Array:
        """x / sqrt(mean(x^2) + eps) in x's dtype, before the scale (with in-place projections
        the scale goes to the projection after the norm: `LayerAccess.norm`). `invariant`: the
        mean in a fixed order (`paged_kv.pallas_kernels.invariant.rms_normalize`)."""
        if invariant:
            return invariant_ops.rms_normalize(x, self.eps)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class LayerAccess:
    """How one `DecoderLayer` call reads its weights.

    layer: the layer id handed to `attend`, a Python int (unrolled) or an int32 scalar (traced by
      the scan over layers).
    matmul: None when the module holds this layer's own weights (a `per_layer` module, or a
      slice of the stacked ones): projections are XLA einsums on them. Else the module holds the
      stacked weights `[L, ...]` and every projection goes through `matmul`
      (`AttentionBackend.layer_matmul`), which reads `w[layer]` in place; so do the norms'
      weights before the projections (`norm`), and the small per-head q/k norm scales are
      sliced (`weight`). Projections of the same input go as one group (`project_group`:
      q/k/v, gate/up), one kernel launch each.
    """

    layer: Any
    matmul: LayerMatmul | None = None
    invariant: bool = False  # batch-invariant projections and norms (`AttentionBackend.batch_invariant`)

    def norm(self, norm: RMSNorm, x: Array) -> tuple[Array, Array | None]:
        """`(input of the projections after `norm`, the scale they apply)`: `(norm(x), None)` on
        the layer's own weights; `(norm.normalize(x), norm.scale [L, d])` with in-place matmuls
        (the scale multiplies the `x` tile in the kernel: the same product, no slice)."""
        if self.matmul is None:
            return norm(x, self.invariant), None
        if norm.offset:  # (1 + w) in float32 is not a scale of the normalised x in x's dtype: slice w
            return self.full_norm(norm, x), None
        return norm.normalize(x, self.invariant), norm.scale[...]

    def full_norm(self, norm: RMSNorm, x: Array) -> Array:
        """`norm(x)` with this layer's scale (sliced when stacked): a norm no projection follows
        (Gemma's norms of the attention and MLP outputs), or a `(1 + w)` one."""
        return norm.apply(x, self.weight(norm.scale[...]), self.invariant)

    def weight(self, w: Array) -> Array:
        """This layer's `w`: `w` itself on the layer's own weights, `w[layer]` when stacked."""
        return w if self.matmul is None else w[self.layer]

    def project(self, spec: str, x: Array, w: Array, *, bias: Array | None = None,
                scale: Array | None = None, split: str = "k") -> Array:
        """`x[B, T, *K] @ w[*K, *N] + bias[*N]` -> `[B, T, *N]` in x's dtype: `jnp.einsum(spec)` on
        the layer's own `w`; on stacked `w[L, *K, *N]` (`bias [L, *N]`, `scale [L, K]`, the
        preceding norm's weight) `matmul` on the flattened `[B*T, prod(K)] @ [L, prod(K),
        prod(N)]`, layer `layer` read in place. `spec` names the einsum (`scale` is None there:
        `norm` applied it). `split`: how the invariant mode cuts the product so that tensor-parallel
        degrees 1 and 2 give the same bits (`invariant_ops.matmul`): "k" for a row-parallel
        projection (o_proj, down: `paged_kv.models.sharding`), "n" for a column-parallel one."""
        if self.matmul is None and self.invariant:  # fixed row tiles (`invariant_ops.matmul`)
            b, t, *k = x.shape
            out = w.shape[len(k):]
            y = invariant_ops.matmul(x.reshape(b * t, math.prod(k)), w.reshape(math.prod(k), math.prod(out)),
                                     split=split)
            y = y.astype(x.dtype).reshape(b, t, *out)
            return y if bias is None else y + bias
        if self.matmul is None:
            y = jnp.einsum(spec, x, w)
            return y if bias is None else y + bias
        b, t, *k = x.shape
        n = w.shape[0]
        out = w.shape[1 + len(k):]
        y = self.matmul(x.reshape(b * t, math.prod(k)), w.reshape(n, math.prod(k), math.prod(out)), self.layer,
                        scale=scale, bias=None if bias is None else bias.reshape(n, -1))
        return y.reshape(b, t, *out)

    def project_group(self, specs: tuple[str, ...], x: Array, ws: tuple[Array, ...], *,
                      biases: tuple[Array | None, ...] | None = None, scale: Array | None = None) -> tuple[Array, ...]:
        """Several projections of the same `x` (q/k/v, gate/up): `project(specs[i], x, ws[i],
        bias=biases[i], scale=scale)` each. On the layer's own weights exactly those einsums, one
        after another; with in-place matmuls one `matmul` call on the group (a tuple of the
        flattened stacked weights `[L, prod(K), prod(N_i)]`): one launch over their columns side
        by side, where separate narrow projections (k/v) would each be too small to keep the
        memory busy. No weight is concatenated or copied."""
        biases = (None,) * len(ws) if biases is None else biases
        if self.matmul is None:
            return tuple(self.project(spec, x, w, bias=bias, scale=scale, split="n")  # column-parallel
                         for spec, w, bias in zip(specs, ws, biases))
        b, t, *k = x.shape
        n = ws[0].shape[0]
        outs = [w.shape[1 + len(k):] for w in ws]
        flat = tuple(w.reshape(n, math.prod(k), math.prod(out)) for w, out in zip(ws, outs))
        flat_bias = None if all(bias is None for bias in biases) else tuple(
            None if bias is None else bias.reshape(n, -1) for bias in biases)
        ys = self.matmul(x.reshape(b * t, math.prod(k)), flat, self.layer, scale=scale, bias=flat_bias)
        return tuple(y.reshape(b, t, *out) for y, out in zip(ys, outs))


def apply_rope(x: Array, positions: Array, inv_freq: Array, invariant: bool = False) -> Array:
    """Rotate x[B, T, H, D] by angles positions[B, T] * inv_freq[D/2] (HF "rotate_half" layout:
    dimension i pairs with i + D/2). Angles and products in float32. `invariant`: computed in
    fixed tiles of tokens (`paged_kv.pallas_kernels.invariant.row_tiles`): XLA:CPU gave a
    position other bits in a one-token decode step than in a chunk (tiny model, head_dim 16),
    so the batch-invariant mode computes every token on one shape."""
    if invariant:
        b, t, h, d = x.shape
        out = invariant_ops.row_tiles(lambda xt, pt: _rope(xt[None], pt[None], inv_freq)[0],
                                      x.reshape(b * t, h, d), positions.reshape(b * t))
        return out.reshape(b, t, h, d)
    return _rope(x, positions, inv_freq)


def _rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """`apply_rope` on any shape: x[B, T, H, D], positions[B, T]."""
    angles = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention projections; the attention itself is delegated to `attend`.

    With the family switches (module docstring): biases added after the projections, and q/k
    normalised per head (Qwen3, Gemma 3) after their bias and before RoPE, in transformers' order.
    The attend options are the config's: `scale` from `query_pre_attn_scalar`, `soft_cap` from
    `attn_soft_cap` (Gemma), and the layer's `window` (given per call)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        d, e, dt, std = config.hidden_size, config.head_dim, config.jnp_dtype, init_std
        qh, kvh = config.num_heads, config.num_kv_heads
        self.q_proj = nnx.Param(_normal(rngs, (d, qh, e), dt, std))
        self.k_proj = nnx.Param(_normal(rngs, (d, kvh, e), dt, std))
        self.v_proj = nnx.Param(_normal(rngs, (d, kvh, e), dt, std))
        self.o_proj = nnx.Param(_normal(rngs, (qh, e, d), dt, std))
        if config.qkv_bias:
            self.q_bias = nnx.Param(_normal(rngs, (qh, e), dt, std))
            self.k_bias = nnx.Param(_normal(rngs, (kvh, e), dt, std))
            self.v_bias = nnx.Param(_normal(rngs, (kvh, e), dt, std))
        if config.o_bias:
            self.o_bias = nnx.Param(_normal(rngs, (d,), dt, std))
        if config.qk_norm:
            self.q_norm = RMSNorm(e, config.rms_norm_eps, dt, config.norm_offset)
            self.k_norm = RMSNorm(e, config.rms_norm_eps, dt, config.norm_offset)
        self.qkv_bias, self.has_o_bias, self.qk_norm = config.qkv_bias, config.o_bias, config.qk_norm
        # Static attend options (Python floats, part of the compiled program; a tuple of pairs, so
        # the graphdef stays hashable); none for a Llama.
        options = []
        if config.query_pre_attn_scalar is not None:
            options.append(("scale", float(config.query_pre_attn_scalar) ** -0.5))
        if config.attn_soft_cap is not None:
            options.append(("soft_cap", float(config.attn_soft_cap)))
        self.attend_options = tuple(options)

    def __call__(self, x: Array, norm_scale: Array | None, positions: Array, inv_freq: Array, cache,
                 attend: AttentionBackend, access: LayerAccess, window: int | AttentionSpec | Array | None = None):
        """x[B, T, d] (after the input norm; `norm_scale` its weight when the projections apply it,
        `LayerAccess.norm`) -> (out[B, T, d] in x's dtype, cache): q/k/v, RoPE, `attend` at layer
        `access.layer`, the output projection. `window`: the layer's attention kind for `attend`
        (None: no window option; a Python int >= 1, a window; an `AttentionSpec`; or a traced int32
        code: W a window, -C a chunk, 0 full attention)."""
        bias = (lambda name: getattr(self, name)[...]) if self.qkv_bias else (lambda name: None)
        # Named scopes only label the HLO (scripts/profile_decode.py attributes time by them).
        with jax.named_scope("qkv_proj"):
            q, k, v = access.project_group(
                ("btd,dhe->bthe", "btd,dke->btke", "btd,dke->btke"), x,
                (self.q_proj[...], self.k_proj[...], self.v_proj[...]),
                biases=(bias("q_bias"), bias("k_bias"), bias("v_bias")), scale=norm_scale)
            if self.qk_norm:  # per-head scales [D] ([L, D] stacked: a small slice each)
                q = access.full_norm(self.q_norm, q)
                k = access.full_norm(self.k_norm, k)
        with jax.named_scope("rope"):
            q = apply_rope(q, positions, inv_freq, access.invariant)
            k = apply_rope(k, positions, inv_freq, access.invariant)
        options = dict(self.attend_options) if window is None else {**dict(self.attend_options), "window": window}
        out, cache = attend(access.layer, q, k, v, cache, **options)
        with jax.named_scope("o_proj"):
            return access.project("bthe,hed->btd", out.astype(x.dtype), self.o_proj[...],
                                  bias=self.o_bias[...] if self.has_o_bias else None, split="k"), cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), each projection with a bias under `mlp_bias`; GeGLU
    (`hidden_act="gelu_pytorch_tanh"`, Gemma): the tanh approximation of GELU in place of SiLU."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        d, f, dt, std = config.hidden_size, config.intermediate_size, config.jnp_dtype, init_std
        self.gate = nnx.Param(_normal(rngs, (d, f), dt, std))
        self.up = nnx.Param(_normal(rngs, (d, f), dt, std))
        self.down = nnx.Param(_normal(rngs, (f, d), dt, std))
        if config.mlp_bias:
            self.gate_bias = nnx.Param(_normal(rngs, (f,), dt, std))
            self.up_bias = nnx.Param(_normal(rngs, (f,), dt, std))
            self.down_bias = nnx.Param(_normal(rngs, (d,), dt, std))
        self.mlp_bias = config.mlp_bias
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

    @jax.named_scope("mlp")
    def __call__(self, x: Array, norm_scale: Array | None, access: LayerAccess) -> Array:
        """x[B, T, d] (after the post-attention norm; `norm_scale` as in `Attention.__call__`) ->
        [B, T, d] in x's dtype."""
        bias = (lambda name: getattr(self, name)[...]) if self.mlp_bias else (lambda name: None)
        gate, up = access.project_group(("btd,df->btf", "btd,df->btf"), x, (self.gate[...], self.up[...]),
                                        biases=(bias("gate_bias"), bias("up_bias")), scale=norm_scale)
        act = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        return access.project("btf,fd->btd", act * up, self.down[...], bias=bias("down_bias"),
                              split="k")  # row-parallel


class DecoderLayer(nnx.Module):
    """One decoder layer (pre-norm attention and MLP, each residual). In `Llama` its parameters
    carry a leading layer axis (the stacked layout) or it is one of a list (`per_layer`).

    `post_attn_norm` is the norm before the MLP (HF `post_attention_layernorm`, or Gemma's
    `pre_feedforward_layernorm`). `sandwich_norm` (Gemma) adds `attn_out_norm` on the attention
    output and `mlp_out_norm` on the MLP output, each before its residual add (HF
    `post_attention_layernorm` and `post_feedforward_layernorm` there)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        dt, off = config.jnp_dtype, config.norm_offset
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt, off)
        self.attn = Attention(config, rngs=rngs, init_std=init_std)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt, off)
        self.mlp = MLP(config, rngs=rngs, init_std=init_std)
        self.sandwich = config.sandwich_norm
        if config.sandwich_norm:
            self.attn_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt, off)
            self.mlp_out_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt, off)

    def __call__(self, x: Array, positions: Array, inv_freq: Array, cache, attend: AttentionBackend,
                 access: LayerAccess, window: int | AttentionSpec | Array | None = None):
        """x[B, T, d] -> (x[B, T, d], cache) for layer `access.layer`, its weights read as `access`
        says (its own, or the stacked ones in place); `window` as in `Attention.__call__`."""
        h, scale = access.norm(self.input_norm, x)
        h, cache = self.attn(h, scale, positions, inv_freq, cache, attend, access, window)
        if self.sandwich:
            h = access.full_norm(self.attn_out_norm, h)
        x = x + h
        h, scale = access.norm(self.post_attn_norm, x)
        h = self.mlp(h, scale, access)
        if self.sandwich:
            h = access.full_norm(self.mlp_out_norm, h)
        return x + h, cache


SAFE_TOKEN = 0
"""The id an out-of-vocabulary token is looked up as inside ``jit`` (``safe_tokens``)."""


def safe_tokens(tokens: Array, vocab_size: int) -> Array:
    """``tokens`` (integer ``[...]``) with ids outside ``[0, vocab_size)`` replaced by ``SAFE_TOKEN``.

    One compare and one select per token, no host sync. ``jnp.take`` would otherwise fill an
    out-of-range row with NaN, and NaN K/V written into a page poison every later reader of that
    block (0 * NaN is NaN in the attention's masked sums), including prefix-cache hits.
    """
    return jnp.where(in_vocab(tokens, vocab_size), tokens, SAFE_TOKEN)


class Llama(nnx.Module):
    """Llama 3 decoder. `__call__` returns final-normed hidden states; `logits` applies the head.

    Implements `paged_kv.models.protocol.PagedModel`: the facts below are read from `config`, and
    `partition_specs` gives its tensor-parallel layout (`paged_kv.models.tp_layout.weight_specs`).
    """

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    @property
    def dtype(self) -> str:
        return self.config.dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    def partition_specs(self, weights: nnx.State, tp: int) -> nnx.State:
        """PartitionSpecs of `weights` (this model's state) over the "tp" mesh axis."""
        return weight_specs(weights, self.config, tp)

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        self.config = config
        dt, std = config.jnp_dtype, init_std
        self.embed = nnx.Param(_normal(rngs, (config.vocab_size, config.hidden_size), dt, std))
        # Each layer is built as before (same random draws, in the same order) and then stacked, so
        # a seed gives the weights it gave when layers were a list.
        self.layers = stack_layers([DecoderLayer(config, rngs=rngs, init_std=std) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt, config.norm_offset)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(_normal(rngs, (config.vocab_size, config.hidden_size), dt, std))

    def __call__(self, tokens: Array, positions: Array, cache, attend: AttentionBackend):
        """tokens, positions int32[B, T] -> (hidden[B, T, d] in config dtype, cache).

        `attend`: a `paged_kv.models.protocol.AttentionBackend` (a plain attention callable is
        taken as one with the defaults). The layers run unrolled with Python-int ids on the
        `per_layer` layout, or when the backend asks for static layers (`static_layer`); else one
        scan over the stacked layers, reading the weights in place when the backend brings a
        `layer_matmul`.

        A token id outside ``[0, vocab_size)`` is looked up as ``SAFE_TOKEN`` (see ``safe_tokens``):
        its hidden state and K/V are those of that token, never NaN. Callers flag such rows with
        ``in_vocab``; the host-side entry points reject them before anything runs.
        """
        attend = as_backend(attend)
        invariant = attend.batch_invariant  # with `layer_matmul`, the backend's matmul is invariant too
        cfg = self.config
        inv_freq = jnp.asarray(rope_inv_freq(cfg))
        local_freq = jnp.asarray(rope_inv_freq(cfg, local=True)) if any(cfg.local_rope) else None
        specs, codes = cfg.attend_specs, cfg.attend_codes
        x = jnp.take(self.embed[...], safe_tokens(tokens, cfg.vocab_size), axis=0)
        if cfg.embed_scale:  # Gemma: sqrt(d) rounded to the model dtype first, as transformers does
            x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
        if is_per_layer(self) or attend.static_layer:
            # Python-int ids. On stacked weights each layer is a static slice, which XLA:GPU
            # copies on every step: `paged_kv.models.layer_layout.layout_for_impl` gives such a backend's
            # callers the per-layer layout instead, which has nothing to slice.
            for i in range(cfg.num_layers):
                x, cache = self.layer(i)(x, positions, local_freq if cfg.local_rope[i] else inv_freq, cache, attend,
                                         LayerAccess(i, invariant=invariant), _window_option(specs[i]))
            return self.final_norm(x, invariant), cache
        layer_def, stacked = nnx.split(self.layers)
        matmul = attend.layer_matmul
        # In place: the scan carries only the layer id, and the stacked weights stay whole, loop
        # invariants of the scan that XLA:GPU never copies. Else the scan slices them (its xs).
        whole = None if matmul is None else nnx.merge(layer_def, stacked)

        # Per-layer differences that a scan carries as data: the attention kind (its int32 code:
        # W a window, -C a chunk, 0 full) and the RoPE frequencies (Gemma 3's local base); a model
        # without them passes neither.
        window_of = jnp.asarray(codes, jnp.int32) if any(codes) else None
        is_local = jnp.asarray(cfg.local_rope) if local_freq is not None else None

        def body(carry, xs):
            # xs: this layer's weights (None in place) and its id, an int32 scalar that `attend`
            # uses to index the cache's layer axis in place.
            (x, cache), (weights, i) = carry, xs
            layer = whole if weights is None else nnx.merge(layer_def, weights)
            freq = inv_freq if is_local is None else jnp.where(is_local[i], local_freq, inv_freq)
            window = None if window_of is None else window_of[i]
            return layer(x, positions, freq, cache, attend, LayerAccess(i, matmul, invariant), window), None

        ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (stacked if matmul is None else None, ids))
        return self.final_norm(x, invariant), cache

    def layer(self, i: int) -> DecoderLayer:
        """Layer `i` (a Python int) as its own `DecoderLayer`: slice `[i]` of every stacked weight
        (a copy outside `jit`, for inspection such as weight-derived error bounds; static slices
        in a traced forward), or the layer itself in the `per_layer` layout."""
        if not 0 <= i < self.config.num_layers:
            raise IndexError(f"layer {i} out of range [0, {self.config.num_layers})")
        if is_per_layer(self):
            return self.layers[i]  # already its own module (not a copy)
        layer_def, stacked = nnx.split(self.layers)
        return nnx.merge(layer_def, jax.tree.map(lambda w: w[i], stacked))

    def logits(self, hidden: Array, batch_invariant: bool = False) -> Array:
        """hidden[..., d] -> float32 logits[..., V] (matmul in the config dtype). `batch_invariant`:
        each row's bits independent of the others (`paged_kv.pallas_kernels.invariant.matmul`)."""
        head = self.embed[...] if self.config.tie_word_embeddings else self.lm_head[...]
        with jax.named_scope("lm_head"):
            if batch_invariant:
                flat = hidden.reshape(-1, hidden.shape[-1])
                # Columns in two parts: the same bits whether the head is vocab-parallel or not.
                y = invariant_ops.matmul(flat, head, transpose_w=True, split="n").astype(hidden.dtype)
                logits = y.reshape(*hidden.shape[:-1], head.shape[0]).astype(jnp.float32)
            else:
                logits = jnp.einsum("...d,vd->...v", hidden, head).astype(jnp.float32)
        cap = self.config.final_soft_cap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap), elementwise (batch-invariant too)
            logits = cap * jnp.tanh(logits / cap)
        return logits


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """The layers as one `DecoderLayer` whose parameters gain a leading axis of len(layers)
    (works on abstract `jax.ShapeDtypeStruct` leaves too, under `nnx.eval_shape`)."""
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0]
    stacked = jax.tree.map(lambda *ws: jnp.stack(ws), *(state for _, state in splits))
    return nnx.merge(graphdef, stacked)


def is_per_layer(model: Llama) -> bool:
    """True when `model` (a `Llama`) holds its decoder layers one module per layer (`per_layer`),
    False for the stacked layout `Llama.__init__` builds."""
    return not isinstance(model.layers, DecoderLayer)


def _unstack_leaf(w, n: int) -> list:
    """`w[L, ...]` (L = n) -> [w[0], ..., w[n - 1]], each `[...]` of w's dtype, as new arrays.

    Done outside any user `jit`, once: one small program per leaf that writes all n slices. A
    leaf with a `NamedSharding` keeps its spec minus the leading (never sharded) layer axis, so a
    tensor-parallel model stays placed (`paged_kv.models.tp_layout.weight_specs` gives the same spec for the
    per-layer layout). `jax.ShapeDtypeStruct` leaves (abstract models) give abstract slices."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = getattr(w, "sharding", None)
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    else:
        sharding = None
    if isinstance(w, jax.ShapeDtypeStruct):
        return [jax.ShapeDtypeStruct(w.shape[1:], w.dtype, sharding=sharding) for _ in range(n)]
    split = jax.jit(lambda a: tuple(a[i] for i in range(n)),
                    out_shardings=None if sharding is None else (sharding,) * n)
    return list(split(jnp.asarray(w)))


def per_layer(model: Llama | tuple[nnx.GraphDef, nnx.State]) -> Llama | tuple[nnx.GraphDef, nnx.State]:
    """`model` (a `Llama`, or its `(graphdef, state)` split; returns the same kind) with its
    stacked decoder layers turned into one `DecoderLayer` per layer: `layers` becomes an
    `nnx.List` of L modules and parameter `layers.<name>` `[L, ...]` becomes `layers.<i>.<name>`
    `[...]` (same dtype and values; state paths `("layers", i, "attn", "q_proj")`).

    Why: with the Pallas kernels over a mesh the forward is unrolled over layers, and XLA:GPU copies every
    static slice `w[i]` of a stacked weight before its matmul, on every step (the GPU compile
    gate at 32 layers: the serving decode step's copies per step 158 stacked, 31 per layer).
    Per-layer arrays leave nothing to slice inside the program. The forward of a per-layer model
    is always unrolled (Python-int layer ids, which any `attend` accepts); the CPU engines and the
    one-GPU Pallas engines keep the stacked model and its scan.

    Memory: the layer weights are copied once (the slices are new arrays); the stacked arrays
    stay alive while anything references them (`model` itself, when the caller keeps it), so drop
    the stacked model after converting to avoid holding the decoder weights twice. Call it
    outside `jit` (it runs its own small programs). A per-layer model is returned as is. The
    inverse is `stacked`; HF loading and saving use the stacked layout (`save_hf_checkpoint`
    restacks)."""
    is_pair = isinstance(model, tuple)
    if is_per_layer(nnx.merge(*model) if is_pair else model):
        return model
    module = nnx.merge(*model) if is_pair else nnx.merge(*nnx.split(model))  # never mutate the caller's
    layer_def, stacked = nnx.split(module.layers)
    n = module.config.num_layers
    leaves, treedef = jax.tree.flatten(stacked)
    columns = [_unstack_leaf(w, n) for w in leaves]
    module.layers = nnx.List([nnx.merge(layer_def, jax.tree.unflatten(treedef, [c[i] for c in columns]))
                              for i in range(n)])
    return nnx.split(module) if is_pair else module


def stacked(model: Llama | tuple[nnx.GraphDef, nnx.State]) -> Llama | tuple[nnx.GraphDef, nnx.State]:
    """Inverse of `per_layer`: `model` (a `Llama` or its split; same kind back) with its layers
    stacked again (`layers.<name>` `[L, ...]`; a copy of the layer weights). A stacked model is
    returned as is."""
    is_pair = isinstance(model, tuple)
    if not is_per_layer(nnx.merge(*model) if is_pair else model):
        return model
    module = nnx.merge(*model) if is_pair else nnx.merge(*nnx.split(model))
    module.layers = stack_layers(list(module.layers))
    return nnx.split(module) if is_pair else module


def init_model(config: LlamaConfig, seed: int = 0, init_std: float = 0.02) -> Llama:
    """A randomly initialised model (normal(init_std) weights, unit norm scales)."""
    return Llama(config, rngs=nnx.Rngs(seed), init_std=init_std)


def abstract_model(config: LlamaConfig) -> Llama:
    """The model with `jax.ShapeDtypeStruct` leaves: no memory allocated (loading, lowering checks)."""
    return nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
