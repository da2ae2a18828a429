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
| `qwen2` (window) | `Qwen2ForCausalLM` | `use_sliding_window`: layers from `max_window_layers` on attend to the last `sliding_window` keys |
| `mistral` | `MistralForCausalLM` | every layer attends to the last `sliding_window` keys (when set) |
| `gemma2` | `Gemma2ForCausalLM` | GeGLU (tanh GELU); RMSNorm with a `(1 + w)` scale; norms before and after attention and MLP; embeddings times `sqrt(hidden)`; softmax scale `query_pre_attn_scalar ** -0.5`; attention and final-logit soft caps; `layer_types` (default: even layers slide) |
| `gemma3_text` | `Gemma3ForCausalLM` | Gemma 2's switches without the soft caps (unless set), plus `(1 + w)` q/k norms per head; sliding layers (default: 5 of every 6) rotate with `rope_local_base_freq`, full ones with `rope_theta` and the linear `rope_scaling` |

Per layer, `layer_windows[i]` is the window W of layer i (query at p sees key k iff `p - W < k <= p`;
0 = full causal attention), derived from `sliding_window`/`layer_types`/`use_sliding_window`/
`max_window_layers`/`sliding_window_pattern` as each transformers family does.

A checkpoint this decoder cannot compute exactly (a RoPE type other than `default`/`llama3`/`linear`,
bidirectional attention, another architecture or activation) is refused with a one-line
`ValueError` naming the field and its value.
"""  # noqa: E501 (a Markdown table row does not wrap)

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from paged_kv.attention_spec import AttentionSpec, ChunkedLocal, Full, SlidingWindow
from paged_kv.pallas_kernels.validate import is_int

SUPPORTED_DTYPES = ("float32", "bfloat16")
FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
"""model_type -> the transformers `*ForCausalLM` class of that family."""
GEMMA = ("gemma2", "gemma3_text")
"""The Gemma families (their switches: `LlamaConfig.gemma_switches`)."""
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
"""MLP activations: SwiGLU's SiLU (Llama, Qwen, Mistral), GeGLU's tanh GELU (Gemma)."""
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
class LinearRopeScaling:
    """`rope_scaling` with `rope_type: linear`: every inverse frequency divided by `factor`
    (positions interpolated; Gemma 3's full-attention layers)."""

    factor: float = 1.0

    def __post_init__(self):
        if not (self.factor > 0 and math.isfinite(self.factor)):
            raise ValueError(f"rope_scaling.factor={self.factor} must be a finite float > 0")


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

    Attention kinds: `layer_attention`, one `paged_kv.attention_spec.AttentionSpec` per layer
    (`Full()`, `SlidingWindow(W)`: the query at position p sees keys p - W < k <= p,
    `ChunkedLocal(C)`: keys of p's chunk of C tokens up to p), the one statement of each layer's
    kind that the page layout, the manager's groups and the kernels derive from (`attention`,
    `attend_specs`). `layer_windows`, one int per layer (0: not a sliding window), is the same for
    the windows, kept as an input (checkpoints, older callers): give either (a config with both
    must have them agree); each is stored normalised from the other. Empty means full attention
    everywhere (and is what a config without a window or chunk stores).

    Gemma switches (`gemma_switches` gives a family's): `hidden_act` ("silu": SwiGLU;
    "gelu_pytorch_tanh": GeGLU), `norm_offset` (every RMSNorm scales by `1 + w`, in float32 before
    the cast, as Gemma's), `sandwich_norm` (a norm on the attention output and on the MLP output,
    before each residual add), `embed_scale` (embeddings times `sqrt(hidden_size)`, rounded to
    `dtype`), `query_pre_attn_scalar` (softmax scale `query_pre_attn_scalar ** -0.5` instead of
    `head_dim ** -0.5`), `attn_soft_cap` (scores `c * tanh(s / c)`), `final_soft_cap` (the same on
    the logits), `rope_local_theta` (the RoPE base of the windowed layers, which then take no
    `rope_scaling`; None: every layer rotates alike).
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
    layer_windows: tuple[int, ...] = ()
    layer_attention: tuple[AttentionSpec, ...] = ()
    hidden_act: str = "silu"
    norm_offset: bool = False
    sandwich_norm: bool = False
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    rope_local_theta: float | None = None

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
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, (Llama3RopeScaling, LinearRopeScaling)):
            raise ValueError(f"rope_scaling={self.rope_scaling!r} must be None, a Llama3RopeScaling or a "
                             "LinearRopeScaling")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {SUPPORTED_DTYPES}")
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type={self.model_type!r} must be one of {tuple(FAMILIES)}")
        for name in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm", "norm_offset", "sandwich_norm", "embed_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act={self.hidden_act!r} must be one of {HIDDEN_ACTS}")
        for name in ("query_pre_attn_scalar", "attn_soft_cap", "final_soft_cap"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value!r} must be None or a finite float > 0")
        local = self.rope_local_theta
        if local is not None and not (local > 1 and math.isfinite(local)):
            raise ValueError(f"rope_local_theta={self.rope_local_theta} must be None or a finite float > 1")
        windows = tuple(self.layer_windows) or (0,) * self.num_layers
        if len(windows) != self.num_layers or not all(is_int(w) and w >= 0 for w in windows):
            raise ValueError(f"layer_windows={self.layer_windows!r} must hold num_layers={self.num_layers} ints >= 0 "
                             "(0: full attention)")
        specs = tuple(self.layer_attention)
        if specs and (len(specs) != self.num_layers or not all(isinstance(s, AttentionSpec) for s in specs)):
            raise ValueError(f"layer_attention={self.layer_attention!r} must hold num_layers={self.num_layers} "
                             "AttentionSpec (Full(), SlidingWindow(W), ChunkedLocal(C))")
        from_windows = tuple(SlidingWindow(int(w)) if w else Full() for w in windows)
        if not specs:
            specs = from_windows
        elif any(self.layer_windows) and tuple(_window_of(s) for s in specs) != tuple(int(w) for w in windows):
            raise ValueError(f"layer_windows={self.layer_windows!r} disagrees with layer_attention="
                             f"{self.layer_attention!r}: give one, or both alike")
        # No window or chunk anywhere is stored as (), so such a config equals one built without
        # the fields and `replace(num_layers=...)` keeps working; `windows` and `attention` give the
        # per-layer tuples either way.
        windows = tuple(_window_of(s) for s in specs)
        object.__setattr__(self, "layer_windows", windows if any(windows) else ())
        object.__setattr__(self, "layer_attention", specs if not all(s.is_full for s in specs) else ())
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

    @property
    def windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (`layer_windows`, or num_layers zeros when it is empty; 0
        for a full or chunked layer)."""
        return self.layer_windows or (0,) * self.num_layers

    @property
    def attention(self) -> tuple[AttentionSpec, ...]:
        """Each layer's `AttentionSpec` (`layer_attention`, or `Full()` for every layer)."""
        return self.layer_attention or (Full(),) * self.num_layers

    @property
    def attend_specs(self) -> tuple[AttentionSpec, ...]:
        """The kind each layer's attention applies: `attention` with a window or chunk that covers
        `max_position_embeddings` (no sequence is longer) as `Full()`, which computes the same and
        skips the mask. The page layout and the manager's groups derive from it
        (`paged_kv.models.kv_group_layout`)."""
        return tuple(Full() if s.span >= self.max_position_embeddings else s for s in self.attention)

    @property
    def attend_windows(self) -> tuple[int, ...]:
        """The sliding window each layer's attention applies (`attend_specs`' windows; 0 for a
        full or chunked layer)."""
        return tuple(_window_of(s) for s in self.attend_specs)

    @property
    def attend_codes(self) -> tuple[int, ...]:
        """`attend_specs` as the kernels' int per layer (`AttentionSpec.code`: W a window, -C a
        chunk, 0 full attention)."""
        return tuple(s.code for s in self.attend_specs)

    @property
    def local_rope(self) -> tuple[bool, ...]:
        """Per layer: True when it rotates with `rope_local_theta` (a windowed layer of a model
        that has a local base: Gemma 3's sliding layers)."""
        return tuple(self.rope_local_theta is not None and w > 0 for w in self.windows)

    @staticmethod
    def gemma_switches(model_type: str) -> dict[str, Any]:
        """The switches a Gemma family always sets (its architecture, not its `config.json`
        values): GeGLU, `(1 + w)` norms, sandwich norms, scaled embeddings, and Gemma 3's q/k norms."""
        if model_type not in GEMMA:
            raise ValueError(f"model_type={model_type!r} is not a Gemma family {GEMMA}")
        return dict(hidden_act="gelu_pytorch_tanh", norm_offset=True, sandwich_norm=True, embed_scale=True,
                    qk_norm=model_type == "gemma3_text")

    def num_params(self) -> int:
        """Number of parameters (embedding counted once when tied)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += self.qkv_bias * d * (self.num_heads + 2 * self.num_kv_heads) + self.o_bias * h + self.qk_norm * 2 * d
        mlp = 3 * h * self.intermediate_size + self.mlp_bias * (2 * self.intermediate_size + h)
        per_layer = attn + mlp + (4 if self.sandwich_norm else 2) * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    def replace(self, **changes: Any) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, dtype: str | None = None) -> LlamaConfig:
        """Build from a Hugging Face `config.json` dict of a family in `FAMILIES` (module docstring).

        Raises a one-line ValueError naming the field and its value for another architecture, an
        activation the family's class would not run (SiLU; Gemma: tanh GELU), a RoPE type other
        than `default`, `llama3` and `linear`, Gemma's bidirectional attention, or anything else
        this decoder would compute differently. `dtype` overrides the checkpoint's
        `torch_dtype`/`dtype`.
        """
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"unsupported model_type={model_type!r}: expected one of {tuple(FAMILIES)}")
        archs = hf.get("architectures")
        if archs is not None and FAMILIES[model_type] not in archs:
            raise ValueError(f"unsupported architectures={archs!r} for model_type={model_type!r}: expected "
                             f"[{FAMILIES[model_type]!r}]")
        gemma = model_type in GEMMA
        # Gemma's MLP reads `hidden_activation` (older configs also carry an unused `hidden_act`).
        act_field = "hidden_activation" if gemma else "hidden_act"
        act = hf.get(act_field) or ("gelu_pytorch_tanh" if gemma else "silu")
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise ValueError(f"unsupported {act_field}={act!r}: {model_type} runs "
                             f"{'gelu_pytorch_tanh' if gemma else 'silu'} only")
        # Which projections carry biases, as each transformers family builds its modules.
        attention_bias = bool(hf.get("attention_bias") or False)
        switches = {
            "llama": dict(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(hf.get("mlp_bias") or False)),
            "qwen2": dict(qkv_bias=True),
            "qwen3": dict(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True),
            "mistral": {},
            "gemma2": dict(qkv_bias=attention_bias, o_bias=attention_bias),
            "gemma3_text": dict(qkv_bias=attention_bias, o_bias=attention_bias),
        }[model_type]
        num_layers = int(hf["num_hidden_layers"])
        max_pos = int(hf.get("max_position_embeddings", 2048))
        if gemma and hf.get("use_bidirectional_attention"):
            raise ValueError(f"unsupported use_bidirectional_attention={hf['use_bidirectional_attention']!r}: "
                             "only causal attention is implemented")
        windows = hf_layer_windows(hf, model_type, num_layers)

        if gemma:
            switches.update(cls.gemma_switches(model_type))
            qpas = hf.get("query_pre_attn_scalar", 256)
            switches["query_pre_attn_scalar"] = None if qpas is None else float(qpas)
            caps = {"gemma2": (50.0, 30.0), "gemma3_text": (None, None)}[model_type]  # transformers' defaults
            for ours, field, default in (("attn_soft_cap", "attn_logit_softcapping", caps[0]),
                                         ("final_soft_cap", "final_logit_softcapping", caps[1])):
                value = hf.get(field, default)
                switches[ours] = None if value is None else float(value)
        theta, scaling, local_theta = _hf_rope(hf, model_type)
        if local_theta is not None:
            switches["rope_local_theta"] = local_theta

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
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            dtype=dtype,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(t) for t in eos),
            model_type=model_type,
            layer_windows=windows,
            **switches,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A `config.json` dict that transformers' class of this family (`FAMILIES`) loads into
        the same model. A switch or a window pattern that family cannot express raises ValueError."""
        gemma = self.model_type in GEMMA
        family_switches = self.gemma_switches(self.model_type) if gemma else dict(
            hidden_act="silu", norm_offset=False, sandwich_norm=False, embed_scale=False)
        fixed = all(getattr(self, k) == v for k, v in family_switches.items() if k != "qk_norm")
        expressible = fixed and {
            "llama": self.qkv_bias == self.o_bias and not self.qk_norm,
            "qwen2": self.qkv_bias and not (self.o_bias or self.mlp_bias or self.qk_norm),
            "qwen3": self.qk_norm and self.qkv_bias == self.o_bias and not self.mlp_bias,
            "mistral": not (self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm),
            "gemma2": self.qkv_bias == self.o_bias and not (self.mlp_bias or self.qk_norm),
            "gemma3_text": self.qk_norm and self.qkv_bias == self.o_bias and not self.mlp_bias,
        }[self.model_type]
        if not gemma:
            expressible = expressible and self.query_pre_attn_scalar is None and self.attn_soft_cap is None and \
                self.final_soft_cap is None and self.rope_local_theta is None
        if self.model_type != "gemma3_text":
            expressible = expressible and self.rope_local_theta is None
        if not expressible:
            raise ValueError(f"model_type={self.model_type!r} cannot express qkv_bias={self.qkv_bias}, "
                             f"o_bias={self.o_bias}, mlp_bias={self.mlp_bias}, qk_norm={self.qk_norm}, "
                             f"hidden_act={self.hidden_act!r}, norm_offset={self.norm_offset}, sandwich_norm="
                             f"{self.sandwich_norm}, embed_scale={self.embed_scale}, query_pre_attn_scalar="
                             f"{self.query_pre_attn_scalar}, attn_soft_cap={self.attn_soft_cap}, final_soft_cap="
                             f"{self.final_soft_cap}, rope_local_theta={self.rope_local_theta}")
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
            "hidden_activation" if gemma else "hidden_act": self.hidden_act,
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
        if self.model_type in ("llama", "gemma2", "gemma3_text"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        elif self.model_type == "qwen3":
            out["attention_bias"] = self.qkv_bias
        out.update(_hf_window_fields(self))
        if gemma:
            qpas = self.query_pre_attn_scalar  # transformers' strict config wants an int where it is one
            qpas = int(qpas) if qpas is not None and float(qpas).is_integer() else qpas
            out.update(query_pre_attn_scalar=qpas, attn_logit_softcapping=self.attn_soft_cap,
                       final_logit_softcapping=self.final_soft_cap, use_bidirectional_attention=False)
        if self.model_type == "gemma3_text":
            out["rope_local_base_freq"] = self.rope_theta if self.rope_local_theta is None else self.rope_local_theta
        s = self.rope_scaling
        if isinstance(s, Llama3RopeScaling):
            out["rope_scaling"] = {
                "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        elif isinstance(s, LinearRopeScaling):
            out["rope_scaling"] = {"rope_type": "linear", "factor": s.factor}
        return out


def checkpoint_dtype(hf: Mapping[str, Any]) -> str:
    """The dtype a `config.json` declares (`torch_dtype`, or transformers 5's `dtype`; float32
    when absent), as one of `SUPPORTED_DTYPES`; ValueError naming it otherwise."""
    hf_dtype = hf.get("torch_dtype", hf.get("dtype")) or "float32"
    hf_dtype = str(hf_dtype).removeprefix("torch.")
    if hf_dtype not in _HF_DTYPE_NAMES:
        raise ValueError(f"unsupported checkpoint dtype {hf_dtype!r}: expected one of {SUPPORTED_DTYPES}")
    return _HF_DTYPE_NAMES[hf_dtype]


def hf_layer_windows(hf: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's attention window (0: full) as transformers' class of `model_type` derives it
    from a `config.json` dict:

      llama: none.
      mistral: `sliding_window` on every layer when set (transformers ignores `layer_types` there).
      qwen2/qwen3: no window unless `use_sliding_window`; then `layer_types` where given, else the
        layers from `max_window_layers` (default 28) on.
      gemma2: `layer_types` where given, else every even layer (0, 2, ...) slides.
      gemma3_text: `layer_types` where given, else every layer but each `sliding_window_pattern`-th
        (default 6: 5 local, 1 global) slides.

    ValueError naming the field for a `layer_types` of the wrong length or with an unknown entry,
    or a window that is not an int >= 1."""
    window = hf.get("sliding_window")
    if model_type == "llama":
        return (0,) * num_layers
    if model_type == "qwen2" or model_type == "qwen3":
        if not hf.get("use_sliding_window", False):
            window = None
    layer_types = hf.get("layer_types")
    if model_type == "mistral":
        layer_types = None
    if layer_types is not None:
        layer_types = list(layer_types)
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"unsupported layer_types entry {unknown[0]!r}: expected 'full_attention' or "
                             "'sliding_attention'")
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries, expected num_hidden_layers={num_layers}")
        sliding = [t == "sliding_attention" for t in layer_types]
    elif model_type == "mistral":
        sliding = [True] * num_layers
    elif model_type in ("qwen2", "qwen3"):
        first = int(hf.get("max_window_layers", 28))
        sliding = [i >= first for i in range(num_layers)]
    elif model_type == "gemma2":
        sliding = [bool((i + 1) % 2) for i in range(num_layers)]
    else:  # gemma3_text
        pattern = hf.get("sliding_window_pattern", 6)
        if not is_int(pattern) or pattern < 1:
            raise ValueError(f"unsupported sliding_window_pattern={pattern!r}: expected an int >= 1")
        sliding = [bool((i + 1) % pattern) for i in range(num_layers)]
    if window is None:
        if model_type in GEMMA and any(sliding):
            raise ValueError("unsupported sliding_window=None with sliding_attention layers: a Gemma local layer "
                             "needs a window")
        return (0,) * num_layers
    if not is_int(window) or window < 1:
        raise ValueError(f"unsupported sliding_window={window!r}: expected an int >= 1 or null")
    return tuple(int(window) if s else 0 for s in sliding)


def _window_of(spec: AttentionSpec) -> int:
    """A layer's `layer_windows` entry: its window, 0 when it is not a sliding window."""
    return spec.window if isinstance(spec, SlidingWindow) else 0


def _hf_window_fields(config: LlamaConfig) -> dict[str, Any]:
    """The `config.json` fields that make transformers' class of `config.model_type` derive
    `config.layer_windows` (`hf_layer_windows` inverted); ValueError when it cannot (a chunked
    layer: none of these families has chunked local attention)."""
    chunked = [i for i, s in enumerate(config.attention) if isinstance(s, ChunkedLocal)]
    if chunked:
        raise ValueError(f"layers {chunked} are ChunkedLocal: transformers' {FAMILIES[config.model_type]} "
                         f"has no chunked local attention (layer_attention={config.layer_attention})")
    windows = config.windows
    sizes = sorted(set(windows) - {0})
    if config.model_type == "llama":
        if sizes:
            raise ValueError(f"model_type='llama' has no sliding window: layer_windows={windows}")
        return {}
    if len(sizes) > 1:
        raise ValueError(f"layer_windows={windows}: transformers' {FAMILIES[config.model_type]} has one "
                         "sliding_window for all its sliding layers")
    window = sizes[0] if sizes else None
    types = ["sliding_attention" if w else "full_attention" for w in windows]
    if config.model_type == "mistral":
        if window is not None and 0 in windows:
            raise ValueError(f"layer_windows={windows}: Mistral slides on every layer or none")
        return {"sliding_window": window}
    if config.model_type in ("qwen2", "qwen3"):
        first = windows.index(window) if window is not None else config.num_layers
        if window is not None and any(w != (window if i >= first else 0) for i, w in enumerate(windows)):
            raise ValueError(f"layer_windows={windows}: {config.model_type} slides on the layers from "
                             "max_window_layers on only")
        return {"sliding_window": window, "use_sliding_window": window is not None, "max_window_layers": first,
                "layer_types": types}
    if window is None:  # Gemma: every layer full; its sliding layers need a window, so name none
        return {"sliding_window": config.max_position_embeddings, "layer_types": types}
    return {"sliding_window": window, "layer_types": types}


def _hf_rope(hf: Mapping[str, Any], model_type: str) -> tuple[float, Any, float | None]:
    """(rope_theta, rope_scaling, rope_local_theta) from a `config.json` dict: the legacy fields
    (`rope_theta`, `rope_scaling`, Gemma 3's `rope_local_base_freq`) or transformers 5's
    `rope_parameters` (Gemma 3: one dict per layer type). ValueError naming the field for a RoPE
    type other than `default`, `llama3` and `linear` (Gemma 3's local layers: `default` only)."""
    params = hf.get("rope_parameters")
    if model_type == "gemma3_text":
        if params and ("full_attention" in params or "sliding_attention" in params):
            full = dict(params.get("full_attention") or {})
            local = dict(params.get("sliding_attention") or {})
            full_field, local_field = "rope_parameters.full_attention", "rope_parameters.sliding_attention"
        else:
            full = dict(params or hf.get("rope_scaling") or {})
            local = {}
            full_field = local_field = "rope_parameters" if params else "rope_scaling"
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
        local_type = local.get("rope_type", local.get("type", "default"))
        if local_type != "default":
            raise ValueError(f"unsupported {local_field}.rope_type={local_type!r} for the sliding layers: expected "
                             "'default'")
        theta, scaling = _rope_scaling(full, full_field)
        return theta, scaling, float(local["rope_theta"])
    rope = params or hf.get("rope_scaling") or {}
    field = "rope_parameters" if params else "rope_scaling"
    rope = {"rope_theta": hf.get("rope_theta", 10_000.0), **rope}
    theta, scaling = _rope_scaling(rope, field)
    return theta, scaling, None


def _rope_scaling(rope: Mapping[str, Any], field: str) -> tuple[float, Any]:
    """(theta, scaling) of one RoPE parameter dict (with its `rope_theta`)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope["rope_theta"])
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        return theta, Llama3RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    if rope_type == "linear":
        return theta, LinearRopeScaling(factor=float(rope["factor"]))
    raise ValueError(f"unsupported {field}.rope_type={rope_type!r}: expected 'default', 'llama3' or 'linear'")


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


def rope_inv_freq(config: LlamaConfig, local: bool = False) -> np.ndarray:
    """Inverse RoPE frequencies float32[head_dim // 2], with the configured scaling (llama3 or
    linear). `local`: those of the windowed layers of a model with a `rope_local_theta` (that
    base, no scaling; Gemma 3); the global ones when it has none."""
    d = config.head_dim
    local = local and config.rope_local_theta is not None
    theta = config.rope_local_theta if local else config.rope_theta
    exponents = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    s = None if local else config.rope_scaling
    if s is None:
        return inv_freq
    if isinstance(s, LinearRopeScaling):
        return (inv_freq / np.float32(s.factor)).astype(np.float32)
    old_len = float(s.original_max_position_embeddings)
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(s.factor), inv_freq).astype(np.float32)
    smooth = ((old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled).astype(np.float32)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
