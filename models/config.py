"""Static configuration of a Llama 3 family decoder.

`LlamaConfig` is a frozen, hashable dataclass (usable as a static `jax.jit` argument), validated on
construction: every bad value raises `ValueError` naming the field, the value and the limit.
It converts to and from a Hugging Face `config.json` dictionary (`from_hf_config`/`to_hf_config`);
both the legacy layout (`rope_theta` + `rope_scaling`, as in the published Llama 3 checkpoints) and the
transformers 5 layout (`rope_parameters`) are read; the legacy layout is written.

Families (`model_type`), all the same decoder with a few switches (`FAMILIES`):

| model_type | HF class | differs from Llama by |
|---|---|---|
| `llama` | `LlamaForCausalLM` | optional `attention_bias` (q/k/v/o) and `mlp_bias` (gate/up/down) |
| `qwen2` | `Qwen2ForCausalLM` | a bias on q/k/v (always; none on o) |
| `qwen3` | `Qwen3ForCausalLM` | RMSNorm over each head of q and k before RoPE; explicit `head_dim`; optional `attention_bias` (q/k/v/o) |
| `mistral` | `MistralForCausalLM` | nothing, when its sliding window covers the whole context |

A checkpoint this decoder cannot compute exactly (a sliding window shorter than the context, a
RoPE type other than `default`/`llama3`, another architecture or activation) is refused with a
one-line `ValueError` naming the field and its value.
"""  # noqa: E501 (a Markdown table row does not wrap)

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from paged_kv.pallas_kernels.validate import is_int

SUPPORTED_DTYPES = ("float32", "bfloat16")
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM"}
"""model_type -> the transformers `*ForCausalLM` class of that family."""
_HF_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "fp32": "float32", "bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 `rope_scaling` (`rope_type: llama3`): long wavelengths are slowed by `factor`,
    short ones kept, the band between the two wavelength limits interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"rope_scaling.factor={self.factor} must be > 0")
        if not self.low_freq_factor > 0:
            raise ValueError(f"rope_scaling.low_freq_factor={self.low_freq_factor} must be > 0")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor} must be > "
                f"low_freq_factor={self.low_freq_factor}")
        if not self.original_max_position_embeddings >= 1:
            raise ValueError(
                f"rope_scaling.original_max_position_embeddings={self.original_max_position_embeddings} must be >= 1")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and hyper-parameters of a Llama 3 family decoder.

    `head_dim` defaults to `hidden_size // num_heads`. `dtype` is both the parameter and the
    activation dtype ("float32" or "bfloat16"); attention softmax, RMSNorm statistics and RoPE
    angles are always computed in float32.

    Family switches (module docstring): `model_type` (a key of `FAMILIES`, what `to_hf_config`
    writes), `qkv_bias` (biases on the q/k/v projections), `o_bias` (on the output projection),
    `mlp_bias` (on gate/up/down), `qk_norm` (RMSNorm with a `head_dim` scale over each head of q
    and of k, before RoPE).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads} "
                    "when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if not isinstance(self.head_dim, (int, np.integer)) or self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim!r} must be an even int >= 2 (RoPE rotates pairs)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"rms_norm_eps={self.rms_norm_eps} must be a finite float > 0")
        if not (self.rope_theta > 1 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta={self.rope_theta} must be a finite float > 1")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ValueError(f"rope_scaling={self.rope_scaling!r} must be None or a Llama3RopeScaling")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {SUPPORTED_DTYPES}")
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type={self.model_type!r} must be one of {tuple(FAMILIES)}")
        for name in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        eos = self.eos_token_ids
        if isinstance(eos, (int, np.integer)):
            eos = (int(eos),)
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in eos))
        for t in (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,))):
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"special token id {t} must be in [0, vocab_size={self.vocab_size})")

    # ------------------------------------------------------------------ derived sizes
    @property
    def num_groups(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @property
    def jnp_dtype(self) -> np.dtype:
        import jax.numpy as jnp
        return jnp.dtype(self.dtype)

    def num_params(self) -> int:
        """Number of parameters (embedding counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += self.qkv_bias * d * (self.num_heads + 2 * self.num_kv_heads) + self.o_bias * h + self.qk_norm * 2 * d
        mlp = 3 * h * self.intermediate_size + self.mlp_bias * (2 * self.intermediate_size + h)
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    def replace(self, **changes: Any) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, dtype: str | None = None) -> LlamaConfig:
        """Build from a Hugging Face `config.json` dict of a `LlamaForCausalLM`, `Qwen2ForCausalLM`,
        `Qwen3ForCausalLM` or `MistralForCausalLM` (module docstring).

        Raises a one-line ValueError naming the field and its value for another architecture, an
        activation other than SiLU, a RoPE type other than the default and `llama3`, or a sliding
        window shorter than `max_position_embeddings` (the model would attend differently past
        it). `dtype` overrides the checkpoint's `torch_dtype`/`dtype`.
        """
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"unsupported model_type={model_type!r}: expected one of {tuple(FAMILIES)}")
        archs = hf.get("architectures")
        if archs is not None and FAMILIES[model_type] not in archs:
            raise ValueError(f"unsupported architectures={archs!r} for model_type={model_type!r}: expected "
                             f"[{FAMILIES[model_type]!r}]")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act={act!r}: only 'silu' is supported")
        # Which projections carry biases, as each transformers family builds its modules.
        attention_bias = bool(hf.get("attention_bias") or False)
        switches = {
            "llama": dict(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(hf.get("mlp_bias") or False)),
            "qwen2": dict(qkv_bias=True),
            "qwen3": dict(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True),
            "mistral": {},
        }[model_type]
        num_layers = int(hf["num_hidden_layers"])
        max_pos = int(hf.get("max_position_embeddings", 2048))
        _check_sliding_window(hf, model_type, num_layers, max_pos)

        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
        if rope_type == "default":
            scaling = None
        elif rope_type == "llama3":
            scaling = Llama3RopeScaling(
                factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        else:
            raise ValueError(f"unsupported {field}.rope_type={rope_type!r}: expected 'default' or 'llama3'")

        if dtype is None:
            dtype = checkpoint_dtype(hf)
        eos = hf.get("eos_token_id")
        eos = () if eos is None else (eos if isinstance(eos, (list, tuple)) else (eos,))
        # Qwen2/3 and Mistral checkpoints may store head_dim as null: hidden_size // heads then.
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=int(hf["num_attention_heads"]),
            num_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            head_dim=hf.get("head_dim") or None,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=dtype,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(t) for t in eos),
            model_type=model_type,
            **switches,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A `config.json` dict that transformers' class of this family (`FAMILIES`) loads into
        the same model. A switch that family cannot express raises ValueError."""
        expressible = {
            "llama": self.qkv_bias == self.o_bias and not self.qk_norm,
            "qwen2": self.qkv_bias and not (self.o_bias or self.mlp_bias or self.qk_norm),
            "qwen3": self.qk_norm and self.qkv_bias == self.o_bias and not self.mlp_bias,
            "mistral": not (self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm),
        }[self.model_type]
        if not expressible:
            raise ValueError(f"model_type={self.model_type!r} cannot express qkv_bias={self.qkv_bias}, "
                             f"o_bias={self.o_bias}, mlp_bias={self.mlp_bias}, qk_norm={self.qk_norm}")
        out: dict[str, Any] = {
            "architectures": [FAMILIES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (None if not self.eos_token_ids else
                             self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)),
        }
        if self.model_type == "llama":
            out.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        elif self.model_type == "qwen3":
            out["attention_bias"] = self.qkv_bias
        if self.model_type != "llama":  # full attention everywhere (these families can slide)
            out.update(sliding_window=None, use_sliding_window=False)
        if self.rope_scaling is not None:
            s = self.rope_scaling
            out["rope_scaling"] = {
                "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        return out


def checkpoint_dtype(hf: Mapping[str, Any]) -> str:
    """The dtype a `config.json` declares (`torch_dtype`, or transformers 5's `dtype`; float32
    when absent), as one of `SUPPORTED_DTYPES`; ValueError naming it otherwise."""
    hf_dtype = hf.get("torch_dtype", hf.get("dtype")) or "float32"
    hf_dtype = str(hf_dtype).removeprefix("torch.")
    if hf_dtype not in _HF_DTYPE_NAMES:
        raise ValueError(f"unsupported checkpoint dtype {hf_dtype!r}: expected one of {SUPPORTED_DTYPES}")
    return _HF_DTYPE_NAMES[hf_dtype]


def _check_sliding_window(hf: Mapping[str, Any], model_type: str, num_layers: int, max_pos: int) -> None:
    """ValueError when some layer attends through a sliding window shorter than the context.

    A window of W keys (transformers masks key j for query i unless i - j < W) changes nothing for
    sequences of at most W tokens, and no sequence is longer than `max_position_embeddings`, so a
    window at least that long is served exactly by full attention. Which layers slide follows
    transformers: `layer_types` where given; else Qwen2/3 slide from layer `max_window_layers`
    on when `use_sliding_window`, and Mistral slides everywhere when `sliding_window` is set.
    Llama has no sliding window.
    """
    if model_type == "llama":
        return
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"unsupported layer_types entry {unknown[0]!r}: expected 'full_attention' or "
                             "'sliding_attention'")
        sliding = "sliding_attention" in layer_types
        where = "layer_types"
    elif model_type in ("qwen2", "qwen3"):
        sliding = bool(hf.get("use_sliding_window", False)) and num_layers > int(hf.get("max_window_layers", 28))
        where = "use_sliding_window"
    else:
        sliding = window is not None
        where = "sliding_window"
    if sliding and window is not None and int(window) < max_pos:
        raise ValueError(f"unsupported sliding_window={int(window)} (set by {where}): shorter than "
                         f"max_position_embeddings={max_pos}, and sliding-window attention is not implemented")


# ---------------------------------------------------------------------- presets
def llama31_8b(dtype: str = "bfloat16") -> LlamaConfig:
    """Meta Llama 3.1 8B shapes (for memory arithmetic and lowering checks; never run on CPU)."""
    return LlamaConfig(
        vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500_000.0,
        rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192), max_position_embeddings=131_072,
        tie_word_embeddings=False, dtype=dtype, bos_token_id=128_000, eos_token_ids=(128_001, 128_008, 128_009))


def llama32_1b(dtype: str = "bfloat16") -> LlamaConfig:
    """Meta Llama 3.2 1B shapes (tied embeddings; for memory arithmetic and lowering checks)."""
    return LlamaConfig(
        vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
        num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500_000.0,
        rope_scaling=Llama3RopeScaling(32.0, 1.0, 4.0, 8192), max_position_embeddings=131_072,
        tie_word_embeddings=True, dtype=dtype, bos_token_id=128_000, eos_token_ids=(128_001, 128_008, 128_009))


def tiny(dtype: str = "float32", **overrides: Any) -> LlamaConfig:
    """A small GQA config with llama3 RoPE scaling that runs in milliseconds on a CPU."""
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        rms_norm_eps=1e-5, rope_theta=10_000.0,
        rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=32),
        max_position_embeddings=256, dtype=dtype)
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse RoPE frequencies float32[head_dim // 2], with the llama3 scaling when configured."""
    d = config.head_dim
    exponents = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    old_len = float(s.original_max_position_embeddings)
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(s.factor), inv_freq).astype(np.float32)
    smooth = ((old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled).astype(np.float32)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
