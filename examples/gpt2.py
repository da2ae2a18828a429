"""A GPT-2-style decoder in Flax NNX that runs through paged-kv (docs/own_model.md).

Learned absolute positions, pre-LayerNorm blocks, GELU (tanh) MLP, multi-head attention and an
output head tied to the token embedding, as in Radford et al. (2019). It implements
`paged_kv.models.protocol.PagedModel`: the six facts as attributes, `__call__(tokens, positions, cache,
attend)` and `logits(hidden)`. It calls `attend` (a `paged_kv.models.protocol.AttentionBackend`)
once per layer with a Python int and leaves its plan (`static_layer`, `layer_matmul`) aside: one
weight array per layer, XLA's matmuls. Einsum letters: b batch, t tokens, d width, h heads, e head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    dtype: str = "float32"


def _param(rngs, shape, dtype, std=0.02):
    return nnx.Param((std * jax.random.normal(rngs.params(), shape)).astype(dtype))


class LayerNorm(nnx.Module):
    def __init__(self, d: int, eps: float, dtype):
        self.eps = eps
        self.scale, self.bias = nnx.Param(jnp.ones((d,), dtype)), nnx.Param(jnp.zeros((d,), dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)  # statistics in float32
        mean = x32.mean(-1, keepdims=True)
        var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        d, h, dt = cfg.n_embd, cfg.n_head, cfg.dtype
        e = d // h
        self.ln_1 = LayerNorm(d, cfg.layer_norm_epsilon, dt)
        self.qkv = _param(rngs, (d, 3, h, e), dt)  # HF c_attn [d, 3d], columns (q|k|v, head, e)
        self.qkv_bias = nnx.Param(jnp.zeros((3, h, e), dt))
        self.out = _param(rngs, (h, e, d), dt)  # HF attn.c_proj [d, d], rows (head, e)
        self.out_bias = nnx.Param(jnp.zeros((d,), dt))
        self.ln_2 = LayerNorm(d, cfg.layer_norm_epsilon, dt)
        self.fc, self.fc_bias = _param(rngs, (d, 4 * d), dt), nnx.Param(jnp.zeros((4 * d,), dt))
        self.proj, self.proj_bias = _param(rngs, (4 * d, d), dt), nnx.Param(jnp.zeros((d,), dt))

    def __call__(self, x, layer: int, cache, attend):
        qkv = jnp.einsum("btd,dshe->btshe", self.ln_1(x), self.qkv[...]) + self.qkv_bias[...]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, T, H, E] each
        a, cache = attend(layer, q, k, v, cache)  # paged-kv stores k/v and attends (causal)
        x = x + jnp.einsum("bthe,hed->btd", a.astype(x.dtype), self.out[...]) + self.out_bias[...]
        f = jax.nn.gelu(self.ln_2(x) @ self.fc[...] + self.fc_bias[...], approximate=True)
        return x + f @ self.proj[...] + self.proj_bias[...], cache


class GPT2(nnx.Module):
    """GPT-2 decoder; `__call__` returns the final LayerNorm's output, `logits` the tied head's."""

    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # The facts paged-kv reads (paged_kv.models.protocol.PagedModel).
        self.num_layers, self.num_kv_heads = cfg.n_layer, cfg.n_head
        self.head_dim, self.vocab_size = cfg.n_embd // cfg.n_head, cfg.vocab_size
        self.max_positions, self.dtype = cfg.n_positions, cfg.dtype
        self.wte = _param(rngs, (cfg.vocab_size, cfg.n_embd), cfg.dtype)
        self.wpe = _param(rngs, (cfg.n_positions, cfg.n_embd), cfg.dtype, std=0.01)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.n_embd, cfg.layer_norm_epsilon, cfg.dtype)

    def __call__(self, tokens, positions, cache, attend):
        # Padding rows may hold any id or position: clip the lookups so they never give NaN.
        x = (jnp.take(self.wte[...], tokens, axis=0, mode="clip")
             + jnp.take(self.wpe[...], positions, axis=0, mode="clip"))
        for i, block in enumerate(self.blocks):
            x, cache = block(x, i, cache, attend)
        return self.ln_f(x), cache

    def logits(self, hidden):
        return jnp.einsum("...d,vd->...v", hidden, self.wte[...]).astype(jnp.float32)


def from_transformers(hf_model, dtype: str = "float32") -> GPT2:
    """A `GPT2` holding the weights of a transformers `GPT2LMHeadModel` (its Conv1D weights are
    stored [in, out], so only reshapes are needed)."""
    c = hf_model.config
    cfg = GPT2Config(c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head, c.layer_norm_epsilon, dtype)
    sd = {k: v.detach().cpu().numpy() for k, v in hf_model.state_dict().items()}
    model = nnx.eval_shape(lambda: GPT2(cfg, rngs=nnx.Rngs(0)))
    d, h = cfg.n_embd, cfg.n_head
    as_param = lambda a, *shape: nnx.Param(jnp.asarray(np.reshape(a, shape or a.shape), dtype))
    model.wte, model.wpe = as_param(sd["transformer.wte.weight"]), as_param(sd["transformer.wpe.weight"])
    for i, b in enumerate(model.blocks):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            getattr(b, ln).scale = as_param(sd[p + ln + ".weight"])
            getattr(b, ln).bias = as_param(sd[p + ln + ".bias"])
        b.qkv = as_param(sd[p + "attn.c_attn.weight"], d, 3, h, d // h)
        b.qkv_bias = as_param(sd[p + "attn.c_attn.bias"], 3, h, d // h)
        b.out, b.out_bias = as_param(sd[p + "attn.c_proj.weight"], h, d // h, d), as_param(sd[p + "attn.c_proj.bias"])
        b.fc, b.fc_bias = as_param(sd[p + "mlp.c_fc.weight"]), as_param(sd[p + "mlp.c_fc.bias"])
        b.proj, b.proj_bias = as_param(sd[p + "mlp.c_proj.weight"]), as_param(sd[p + "mlp.c_proj.bias"])
    model.ln_f.scale, model.ln_f.bias = as_param(sd["transformer.ln_f.weight"]), as_param(sd["transformer.ln_f.bias"])
    return model
