"""Llama 3 family decoder in Flax NNX, with the KV cache as an explicit argument.

The module holds weights only. Where K/V are stored and how attention reads them is supplied by the
caller as an `attend` function, so the same weights run over the paged KV cache (`paged_kv.models.paged`) and
over an ordinary contiguous cache (`paged_kv.models.contiguous`):

    attend(layer, q[B, T, QH, D], k[B, T, KVH, D], v[B, T, KVH, D], cache) -> (out[B, T, QH, D], cache)

`layer` is an int32 scalar traced by the scan over layers, or a Python int when the callback sets
`attend.static_layer = True` (the Pallas kernels over a tensor-parallel mesh: the layers then run
unrolled, best on `per_layer` weights, since XLA:GPU copies the weight slices a scan over stacked
layers reads). When the callback brings `attend.layer_matmul` (the Pallas kernels on one GPU) the
scan hands it every projection, `DecoderLayer.call_stacked`: it reads the layer's weights out of
the stacked arrays in place, so nothing is sliced. The kernels take the layer as an operand, so
every layer shares one compiled kernel either way.

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
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from paged_kv.models.config import LlamaConfig, rope_inv_freq

Array = jax.Array
AttendFn = Callable[[Array, Array, Array, Array, Any], tuple[Array, Any]]


def _normal(rngs: nnx.Rngs, shape, dtype, std: float):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    """y = scale * x / sqrt(mean(x^2) + eps); statistics in float32, as in HF."""

    def __init__(self, dim: int, eps: float, dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: Array) -> Array:
        return self.scale[...] * self.normalize(x)

    def normalize(self, x: Array) -> Array:
        """x / sqrt(mean(x^2) + eps) in x's dtype, before the scale (the scan on stacked weights
        hands the scale to the projection after the norm: `DecoderLayer.call_stacked`)."""
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(x.dtype)


def apply_rope(x: Array, positions: Array, inv_freq: Array) -> Array:
    """Rotate x[B, T, H, D] by angles positions[B, T] * inv_freq[D/2] (HF "rotate_half" layout:
    dimension i pairs with i + D/2). Angles and products in float32."""
    angles = positions.astype(jnp.float32)[:, :, None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention projections; the attention itself is delegated to `attend`.

    With the family switches (module docstring): biases added after the projections, and q/k
    normalised per head (Qwen3) after their bias and before RoPE, in transformers' order."""

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
            self.q_norm = RMSNorm(e, config.rms_norm_eps, dt)
            self.k_norm = RMSNorm(e, config.rms_norm_eps, dt)
        self.qkv_bias, self.has_o_bias, self.qk_norm = config.qkv_bias, config.o_bias, config.qk_norm

    def __call__(self, x, positions, inv_freq, layer, cache, attend: AttendFn):
        # Named scopes only label the HLO (scripts/profile_decode.py attributes time by them).
        with jax.named_scope("qkv_proj"):
            q = jnp.einsum("btd,dhe->bthe", x, self.q_proj[...])
            k = jnp.einsum("btd,dke->btke", x, self.k_proj[...])
            v = jnp.einsum("btd,dke->btke", x, self.v_proj[...])
            if self.qkv_bias:
                q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
        with jax.named_scope("rope"):
            q = apply_rope(q, positions, inv_freq)
            k = apply_rope(k, positions, inv_freq)
        out, cache = attend(layer, q, k, v, cache)
        with jax.named_scope("o_proj"):
            out = jnp.einsum("bthe,hed->btd", out.astype(x.dtype), self.o_proj[...])
            return (out + self.o_bias[...] if self.has_o_bias else out), cache

    def call_stacked(self, x, norm_scale, positions, inv_freq, layer, cache, attend: AttendFn, matmul):
        """`__call__` on stacked weights (every parameter `[L, ...]`), for layer `layer` (an int32
        scalar, traced by the scan): the projections go through `matmul(x[M, K], w[L, K, N],
        layer, scale=, bias=)` (`attend.layer_matmul`, `paged_kv.models.protocol.PagedModel`), which reads
        `w[layer]` in place.
        `x` is the input norm's normalized input before its weight; `norm_scale` `[L, d]` is that
        weight, applied by the q/k/v projections. Same arithmetic as `__call__` after the norm."""
        b, t, d = x.shape
        e = self.q_proj.shape[-1]
        x2 = x.reshape(b * t, d)

        def proj(w, bias):  # w [L, d, H, E], bias [L, H, E] -> [b, t, H, E]
            n = w.shape[0]
            out = matmul(x2, w.reshape(n, d, -1), layer, scale=norm_scale,
                         bias=None if bias is None else bias.reshape(n, -1))
            return out.reshape(b, t, w.shape[2], e)

        with jax.named_scope("qkv_proj"):
            q = proj(self.q_proj[...], self.q_bias[...] if self.qkv_bias else None)
            k = proj(self.k_proj[...], self.k_bias[...] if self.qkv_bias else None)
            v = proj(self.v_proj[...], self.v_bias[...] if self.qkv_bias else None)
            if self.qk_norm:  # per-head scales [L, E]: a small slice each
                q = self.q_norm.scale[...][layer] * self.q_norm.normalize(q)
                k = self.k_norm.scale[...][layer] * self.k_norm.normalize(k)
        with jax.named_scope("rope"):
            q = apply_rope(q, positions, inv_freq)
            k = apply_rope(k, positions, inv_freq)
        out, cache = attend(layer, q, k, v, cache)
        with jax.named_scope("o_proj"):
            w = self.o_proj[...]  # [L, H, E, d]
            out = matmul(out.astype(x.dtype).reshape(b * t, -1), w.reshape(w.shape[0], -1, d), layer,
                         bias=self.o_bias[...] if self.has_o_bias else None)
            return out.reshape(b, t, d), cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), each projection with a bias under `mlp_bias`."""

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

    @jax.named_scope("mlp")
    def __call__(self, x):
        gate = jnp.einsum("btd,df->btf", x, self.gate[...])
        up = jnp.einsum("btd,df->btf", x, self.up[...])
        if self.mlp_bias:
            gate, up = gate + self.gate_bias[...], up + self.up_bias[...]
        down = jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, self.down[...])
        return down + self.down_bias[...] if self.mlp_bias else down

    def call_stacked(self, x, norm_scale, layer, matmul):
        """`__call__` on stacked weights for layer `layer` (see `Attention.call_stacked`): `x` the
        post-attention norm's normalized input, `norm_scale` `[L, d]` its weight."""
        with jax.named_scope("mlp"):
            b, t, d = x.shape
            x2 = x.reshape(b * t, d)
            bias = (lambda name: getattr(self, name)[...]) if self.mlp_bias else (lambda name: None)
            gate = matmul(x2, self.gate[...], layer, scale=norm_scale, bias=bias("gate_bias"))
            up = matmul(x2, self.up[...], layer, scale=norm_scale, bias=bias("up_bias"))
            down = matmul(jax.nn.silu(gate) * up, self.down[...], layer, bias=bias("down_bias"))
            return down.reshape(b, t, d)


class DecoderLayer(nnx.Module):
    """One decoder layer (pre-norm attention and MLP, each residual). In `Llama` its parameters
    carry a leading layer axis and it is called on one slice inside the scan over layers."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        dt = config.jnp_dtype
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.attn = Attention(config, rngs=rngs, init_std=init_std)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.mlp = MLP(config, rngs=rngs, init_std=init_std)

    def __call__(self, x, positions, inv_freq, layer, cache, attend: AttendFn):
        h, cache = self.attn(self.input_norm(x), positions, inv_freq, layer, cache, attend)
        x = x + h
        return x + self.mlp(self.post_attn_norm(x)), cache

    def call_stacked(self, x, positions, inv_freq, layer, cache, attend: AttendFn, matmul):
        """`__call__` with every parameter stacked `[L, ...]`, for layer `layer` (int32 scalar):
        the weights are read in place by `matmul` (`attend.layer_matmul`), so the scan
        over layers slices no weight; each norm's weight is applied by the projections after it."""
        h, cache = self.attn.call_stacked(self.input_norm.normalize(x), self.input_norm.scale[...], positions,
                                          inv_freq, layer, cache, attend, matmul)
        x = x + h
        return x + self.mlp.call_stacked(self.post_attn_norm.normalize(x), self.post_attn_norm.scale[...], layer,
                                         matmul), cache


SAFE_TOKEN = 0
"""The id an out-of-vocabulary token is looked up as inside ``jit`` (``safe_tokens``)."""


def in_vocab(tokens: Array, vocab_size: int) -> Array:
    """bool, same shape as ``tokens`` (any integer dtype): ``0 <= id < vocab_size``."""
    return (tokens >= 0) & (tokens < vocab_size)


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
    `partition_specs` gives its tensor-parallel layout (`paged_kv.models.sharding.weight_specs`).
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

    def partition_specs(self, weights: nnx.State, tp: int):
        """PartitionSpecs of `weights` (this model's state) over the "tp" mesh axis."""
        from paged_kv.models.sharding import weight_specs
        return weight_specs(weights, self.config, tp)

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, init_std: float = 0.02):
        self.config = config
        dt, std = config.jnp_dtype, init_std
        self.embed = nnx.Param(_normal(rngs, (config.vocab_size, config.hidden_size), dt, std))
        # Each layer is built as before (same random draws, in the same order) and then stacked, so
        # a seed gives the weights it gave when layers were a list.
        self.layers = stack_layers([DecoderLayer(config, rngs=rngs, init_std=std) for _ in range(config.num_layers)])
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(_normal(rngs, (config.vocab_size, config.hidden_size), dt, std))

    def __call__(self, tokens: Array, positions: Array, cache, attend: AttendFn):
        """tokens, positions int32[B, T] -> (hidden[B, T, d] in config dtype, cache).

        A token id outside ``[0, vocab_size)`` is looked up as ``SAFE_TOKEN`` (see ``safe_tokens``):
        its hidden state and K/V are those of that token, never NaN. Callers flag such rows with
        ``in_vocab``; the host-side entry points reject them before anything runs.
        """
        inv_freq = jnp.asarray(rope_inv_freq(self.config))
        x = jnp.take(self.embed[...], safe_tokens(tokens, self.config.vocab_size), axis=0)
        if is_per_layer(self):
            # One array per weight per layer (`per_layer`): nothing to slice inside the program.
            # Layer ids are Python ints, which every `attend` accepts.
            for i, layer in enumerate(self.layers):
                x, cache = layer(x, positions, inv_freq, i, cache, attend)
            return self.final_norm(x), cache
        layer_def, stacked = nnx.split(self.layers)

        def body(carry, xs):
            # xs: this layer's weights (the scan slices the stacked ones) and its id, an int32
            # scalar that `attend` uses to index the cache's layer axis in place.
            x, cache = carry
            weights, i = xs
            x, cache = nnx.merge(layer_def, weights)(x, positions, inv_freq, i, cache, attend)
            return (x, cache), None

        matmul = getattr(attend, "layer_matmul", None)
        if matmul is not None:
            # The attend callback brings a matmul that reads one layer out of a stacked weight
            # (the Pallas kernel on a GPU): the scan then carries only the layer id, and the
            # weights stay whole, loop invariants of the scan that XLA:GPU never copies.
            ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
            layers = nnx.merge(layer_def, stacked)

            def stacked_body(carry, i):
                x, cache = carry
                return layers.call_stacked(x, positions, inv_freq, i, cache, attend, matmul), None

            (x, cache), _ = jax.lax.scan(stacked_body, (x, cache), ids)
            return self.final_norm(x), cache
        if getattr(attend, "static_layer", False):
            # The attend callback asks for the layers unrolled (the Pallas kernels over a mesh, where
            # a scan's dynamic weight slices would be copied): the same layers, each on its static
            # slice of the stacked weights. XLA:GPU copies such static slices too, each step;
            # the engines avoid that by running a `per_layer` model instead (the branch above).
            for i in range(self.config.num_layers):
                weights = jax.tree.map(lambda w: w[i], stacked)
                (x, cache), _ = body((x, cache), (weights, i))
        else:
            ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
            (x, cache), _ = jax.lax.scan(body, (x, cache), (stacked, ids))
        return self.final_norm(x), cache

    def layer(self, i: int) -> DecoderLayer:
        """Layer `i` (a Python int) as its own `DecoderLayer`: slice `[i]` of every stacked weight
        (a copy; for inspection, e.g. weight-derived error bounds), or the layer itself in the
        `per_layer` layout."""
        if not 0 <= i < self.config.num_layers:
            raise IndexError(f"layer {i} out of range [0, {self.config.num_layers})")
        if is_per_layer(self):
            return self.layers[i]  # already its own module (not a copy)
        layer_def, stacked = nnx.split(self.layers)
        return nnx.merge(layer_def, jax.tree.map(lambda w: w[i], stacked))

    def logits(self, hidden: Array) -> Array:
        """hidden[..., d] -> float32 logits[..., V] (matmul in the config dtype)."""
        head = self.embed[...] if self.config.tie_word_embeddings else self.lm_head[...]
        with jax.named_scope("lm_head"):
            return jnp.einsum("...d,vd->...v", hidden, head).astype(jnp.float32)


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """The layers as one `DecoderLayer` whose parameters gain a leading axis of len(layers)
    (works on abstract `jax.ShapeDtypeStruct` leaves too, under `nnx.eval_shape`)."""
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0]
    stacked = jax.tree.map(lambda *ws: jnp.stack(ws), *(state for _, state in splits))
    return nnx.merge(graphdef, stacked)


def is_per_layer(model) -> bool:
    """True when `model` (a `Llama`) holds its decoder layers one module per layer (`per_layer`),
    False for the stacked layout `Llama.__init__` builds."""
    return not isinstance(model.layers, DecoderLayer)


def _unstack_leaf(w, n: int) -> list:
    """`w[L, ...]` (L = n) -> [w[0], ..., w[n - 1]], each `[...]` of w's dtype, as new arrays.

    Done outside any user `jit`, once: one small program per leaf that writes all n slices. A
    leaf with a `NamedSharding` keeps its spec minus the leading (never sharded) layer axis, so a
    tensor-parallel model stays placed (`paged_kv.models.sharding.weight_specs` gives the same spec for the
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


def per_layer(model):
    """`model` (a `Llama`, or its `(graphdef, state)` split; returns the same kind) with its
    stacked decoder layers turned into one `DecoderLayer` per layer: `layers` becomes an
    `nnx.List` of L modules and parameter `layers.<name>` `[L, ...]` becomes `layers.<i>.<name>`
    `[...]` (same dtype and values; state paths `("layers", i, "attn", "q_proj")`).

    Why: with the Pallas kernels over a mesh the forward is unrolled over layers, and XLA:GPU copies every
    static slice `w[i]` of a stacked weight before its matmul, on every step (the GPU compile
    gate at 32 layers: the serving decode step's copies per step 158 stacked, 31 per layer;
    `results/gpu_compile_report_per_layer.json`).
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


def stacked(model):
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
