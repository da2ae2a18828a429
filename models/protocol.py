"""The model protocol: what a model must provide to decode through the paged cache.

paged-kv never looks inside a model. The engine (``generate``, ``beam_search``), the
``ServingEngine``, page sizing (``page_spec``, ``page_spec_for_budget``, ``allocate_pages``) and the
paged / contiguous forwards use only the members of ``PagedModel`` below; ``paged_kv.models.Llama`` is one
implementation, ``examples/gpt2.py`` another. ``model_facts`` checks a model against the protocol
on the host, before anything is traced or compiled, and raises ``ValueError`` naming what is
missing or wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

from paged_kv.pallas_kernels.validate import is_int

if TYPE_CHECKING:  # config is imported lazily at run time (model_facts)
    from paged_kv.models.config import LlamaConfig

Array = jax.Array

ATTEND_OPTIONS = ("scale", "soft_cap", "alibi_slopes", "window")
"""Keyword options an ``attend`` callback accepts (see ``PagedModel``)."""

FACTS = ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_positions", "dtype")
"""The facts a model states about itself, as attributes (or properties)."""

REQUIRED = ("__call__", "logits") + FACTS

OPTIONAL_FACTS = ("eos_token_ids",)
"""Facts a model may state (``PagedModel``); absent, they take their ``ModelFacts`` defaults."""


class LayerMatmul(Protocol):
    """A projection that reads one layer of a stacked weight in place.

    ``(x[M, K], w[L, K, N], layer, scale=None | [L, K], bias=None | [L, N]) -> [M, N]`` in x's
    dtype: ``(scale[layer] * x) @ w[layer] + bias[layer]``, float32 accumulation. ``layer`` is a
    Python int or an int32 scalar (traced), one of ``0 .. L - 1``; ``x``, ``w``, ``scale`` and
    ``bias`` share one float dtype. ``scale`` is the weight of a norm that precedes the
    projection, so a model hands its norms' weights over too and slices nothing.

    A group of projections of the same ``x``: ``w`` a tuple of ``[L, K, N_i]`` and ``bias`` None
    or a tuple of ``[L, N_i]`` or None, one product per weight, returned as a tuple of ``[M, N_i]``
    (one launch: the weights' columns side by side).
    """

    def __call__(self, x: Array, w: Array | tuple[Array, ...], layer: int | Array, *, scale: Array | None = None,
                 bias: Array | tuple[Array | None, ...] | None = None) -> Array | tuple[Array, ...]: ...


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """What a ``PagedModel``'s ``__call__`` receives as ``attend``: the attention callable, and how
    the backend would have the layers run (an execution plan the model may follow or ignore; both
    are correct, following it is faster on a GPU).

    Fields:
      attend: ``(layer, q[B, T, QH, D], k[B, T, KVH, D], v[B, T, KVH, D], cache, **options) ->
        (out[B, T, QH, D], cache)``, as ``PagedModel`` describes; calling the backend calls it.
      static_layer: True when the backend prefers the layers unrolled with Python-int layer ids
        over one weight array per layer (paged-kv's Pallas kernels over a tensor-parallel mesh:
        GSPMD partitions XLA's matmuls there, and XLA:GPU copies every slice of a stacked weight,
        static or traced, on every step). False: a traced id, say from a ``lax.scan`` over
        stacked layers, is as good. The id is accepted either way.
      layer_matmul: None, or a ``LayerMatmul`` for the projections of a model that scans over
        stacked weights: it reads ``w[layer]`` in place where the scan would slice (and XLA:GPU
        copy) it (``paged_kv.pallas_kernels.layer_matmul``: the Pallas kernels on one GPU). None:
        project with XLA's matmuls (``x @ w`` on the layer's own weights). Not with
        ``static_layer`` (the two plans ask for different weight layouts): ValueError.
      batch_invariant: True when the model should compute every row's bits independently of
        the batch (``paged_kv.pallas_kernels.invariant``: fixed-tile projections, fixed-order norms;
        the backend's attention is invariant already). A model that cannot may ignore it only
        if its own ops are invariant.

    A frozen dataclass of Python values; ``attend`` usually closes over the step's traced batch
    metadata, so a backend is built inside the traced forward, once per step.
    """

    attend: Callable[..., tuple[Array, Any]]
    static_layer: bool = False
    layer_matmul: LayerMatmul | None = None
    batch_invariant: bool = False

    def __post_init__(self):
        if self.static_layer and self.layer_matmul is not None:
            raise ValueError("AttentionBackend: static_layer (one weight array per layer, unrolled) and "
                             "layer_matmul (a scan over stacked weights) exclude each other")

    def __call__(self, layer: int | Array, q: Array, k: Array, v: Array, cache: Any,
                 **options) -> tuple[Array, Any]:
        return self.attend(layer, q, k, v, cache, **options)


def as_backend(attend: AttentionBackend | Callable[..., tuple[Array, Any]]) -> AttentionBackend:
    """``attend`` itself when it is an ``AttentionBackend``; a plain attention callable gets the
    defaults (traced layer ids are fine, XLA's matmuls)."""
    return attend if isinstance(attend, AttentionBackend) else AttentionBackend(attend)


@runtime_checkable
class PagedModel(Protocol):
    """A decoder that paged-kv can run: a Flax NNX module (the engines jit it as its
    ``(graphdef, state)`` split, so every fact must be a static attribute). Shapes: B sequences, T
    tokens per sequence this step, QH query heads, KVH = ``num_kv_heads`` (QH a multiple of it),
    D = ``head_dim``, V = ``vocab_size``.

    Facts (plain Python values; read on the host, never traced):
      num_layers: int >= 1, layers that call ``attend`` (layer ids ``0 .. num_layers - 1``).
      num_kv_heads: int >= 1, K/V heads per layer (the pages hold these).
      head_dim: int >= 1, D of q, k and v.
      vocab_size: int >= 1, V (token ids and logits).
      max_positions: int >= 1, the longest sequence the model supports (prompt plus generated).
      dtype: the K/V dtype the pages are allocated in (a name or a ``jnp`` dtype: float32,
        bfloat16 or float16), and the dtype attention computes in. Pages may instead be stored
        quantized (``page_spec(..., kv_dtype="int8" | "fp8")``): ``cache`` is then a
        ``paged_kv.pallas_kernels.QuantPages`` pytree (int8 / float8_e4m3fn values, e4m3 kept as
        uint8 bits, float32
        scales), which the model passes through to ``attend`` as it is.

    ``__call__(tokens int32[B, T], positions int32[B, T], cache, attend) -> (hidden[B, T, ...], cache)``:
      for each layer ``i`` in order, computes q, k, v (positional encoding already applied) and calls
      ``out, cache = attend(i, q[B, T, QH, D], k[B, T, KVH, D], v[B, T, KVH, D], cache, **options)``.
      ``i`` is a Python int, or an int32 scalar (traced, say inside a ``lax.scan`` over layers);
      paged-kv's ``attend`` accepts both. ``attend`` is an ``AttentionBackend``: besides being
      called it says how the backend would run the layers (``static_layer``, ``layer_matmul``), and
      a model may ignore that.
      ``attend`` stores k/v in ``cache`` and returns the causal attention output ``out[B, T, QH, D]``
      (dtype of the pages; q's dtype, the model's, with quantized pages). ``cache`` is opaque (an
      array, or a ``QuantPages`` pytree): thread it through and return it, never index it. Rows past a
      sequence's valid tokens (padding) may carry any ids and positions, including ids
      ``>= vocab_size`` and positions ``>= max_positions``: they must not produce NaN (clamp the
      lookups), their outputs are discarded. ``options`` (all optional, see ``ATTEND_OPTIONS``):
        scale: float, the softmax scale (default ``D ** -0.5``);
        soft_cap: float > 0, logit soft-capping ``cap * tanh(s / cap)`` of the scaled scores
          (Gemma 2), applied before the bias and the causal mask;
        alibi_slopes: float ``[QH]``, adds ``slope[h] * (key_pos - query_pos)`` (<= 0) to head ``h``'s
          scores (ALiBi);
        window: the layer's attention kind (``paged_kv.attention_spec``): a Python int >= 1 (a
          sliding window, the query at ``p`` sees keys ``p - window < k <= p``), an
          ``AttentionSpec``, or its int32 ``code`` traced per layer (``W > 0`` a window, ``-C`` a
          local chunk of ``C``: keys of ``p``'s chunk up to ``p``; 0 full attention).
      Any other option raises ``ValueError`` naming it. Every call must pass the same options for a
      given layer at every step (they are part of the compiled program).
    ``logits(hidden[..., ...]) -> float32[..., V]``: the output head on what ``__call__`` returned.

    Optional: ``eos_token_ids``, a tuple of ints in ``[0, vocab_size)``: the tokens that end an
      answer when the caller's ``SamplingParams`` / ``BeamParams`` leave ``eos_token_ids`` None
      (the default); absent or ``()``, answers run to ``max_new_tokens``. ``paged_kv.models.Llama``
      gives its config's (``load_hf_checkpoint``: ``generation_config.json``'s ``eos_token_id``,
      else ``config.json``'s).

    Optional, for tensor parallelism (``paged_kv.models.sharding``, a ``mesh=`` argument):
      ``partition_specs(weights: nnx.State, tp: int) -> PartitionSpec tree`` (same structure as
      ``weights``) over the mesh axis ``paged_kv.models.sharding.AXIS``, with q heads and KV heads split
      over it (the pages are sharded on KV heads). A model without it raises ``ValueError`` when
      used with a mesh.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    dtype: Any

    def __call__(self, tokens: Array, positions: Array, cache: Any,
                 attend: AttentionBackend) -> tuple[Array, Any]: ...

    def logits(self, hidden: Array) -> Array: ...


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """The checked facts of a ``PagedModel`` (hashable; ``dtype`` is a dtype name;
    ``eos_token_ids`` the optional one, ``()`` when the model states none)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    dtype: str
    eos_token_ids: tuple[int, ...] = ()


_FLOATS = ("float32", "bfloat16", "float16")


def _as_module(model):
    """An NNX ``(graphdef, state)`` pair is merged (host-side, no computation)."""
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nnx.GraphDef):
        return nnx.merge(*model)
    return model


def model_facts(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig) -> ModelFacts:
    """Check ``model`` (a ``PagedModel``, its NNX ``(graphdef, state)`` split, ``ModelFacts``, or a
    ``paged_kv.models.LlamaConfig``) against the protocol and return its facts.

    Raises ValueError naming every missing member, or the fact with a bad value and what it must
    be. Cheap and host-side: call it before tracing.
    """
    if isinstance(model, ModelFacts):
        return model
    from paged_kv.models.config import LlamaConfig  # a Llama's config states the same facts
    if isinstance(model, LlamaConfig):
        return ModelFacts(model.num_layers, model.num_kv_heads, model.head_dim, model.vocab_size,
                          model.max_position_embeddings, str(jnp.dtype(model.dtype)), model.eos_token_ids)
    model = _as_module(model)
    name = type(model).__name__
    missing = [m for m in REQUIRED if not (callable(model) if m == "__call__" else hasattr(model, m))]
    if missing:
        raise ValueError(f"model {name} does not implement the paged model protocol: missing "
                         f"{', '.join(missing)} (see paged_kv.models.protocol.PagedModel)")
    if not callable(model.logits):
        raise ValueError(f"model {name}: logits must be a method logits(hidden) -> float32 logits")
    values = {}
    for fact in FACTS[:-1]:
        v = getattr(model, fact)
        if not is_int(v) or v < 1:
            raise ValueError(f"model {name}: {fact}={v!r} must be a Python int >= 1")
        values[fact] = int(v)
    try:
        dtype = str(jnp.dtype(model.dtype))
    except TypeError:
        dtype = None
    if dtype not in _FLOATS:
        raise ValueError(f"model {name}: dtype={model.dtype!r} must be one of {_FLOATS}")
    eos = getattr(model, "eos_token_ids", ())
    ids = eos if isinstance(eos, (tuple, list)) else ()
    if not isinstance(eos, (tuple, list)) or not all(is_int(t) and 0 <= t < values["vocab_size"] for t in ids):
        raise ValueError(f"model {name}: eos_token_ids={eos!r} must be a tuple of ints in "
                         f"[0, vocab_size={values['vocab_size']})")
    return ModelFacts(dtype=dtype, eos_token_ids=tuple(int(t) for t in ids), **values)


def check_model(model: nnx.Module | tuple[nnx.GraphDef, nnx.State]) -> nnx.Module:
    """``model`` merged into a module when split, after ``model_facts`` checked it."""
    model_facts(model)
    return _as_module(model)


def check_partition_specs(model: nnx.Module | tuple[nnx.GraphDef, nnx.State]) -> nnx.Module:
    """ValueError unless ``model`` defines ``partition_specs`` (needed for any mesh use); returns
    the module."""
    model = _as_module(model)
    if not callable(getattr(model, "partition_specs", None)):
        raise ValueError(f"model {type(model).__name__} defines no partition_specs(weights, tp), so it "
                         "cannot be sharded over a mesh (tensor parallelism); run it without mesh= or "
                         "add the method (see paged_kv.models.protocol.PagedModel)")
    return model


def partition_specs(model: nnx.Module | tuple[nnx.GraphDef, nnx.State], weights: nnx.State,
                    tp: int) -> nnx.State:
    """The model's ``partition_specs(weights, tp)`` (a ``PartitionSpec`` tree shaped like ``weights``);
    ValueError when it has none."""
    return check_partition_specs(model).partition_specs(weights, tp)


def in_vocab(tokens: Array, vocab_size: int) -> Array:
    """bool, same shape as ``tokens`` (any integer dtype): ``0 <= id < vocab_size``. Every model's
    token ids are checked against its ``vocab_size`` fact with it (the engines' out-of-vocabulary
    flags, the Llama's safe lookup)."""
    return (tokens >= 0) & (tokens < vocab_size)


def attend_options(options: dict) -> dict:
    """Check the keyword options of an ``attend`` call; ValueError naming an unsupported one."""
    bad = sorted(set(options) - set(ATTEND_OPTIONS))
    if bad:
        raise ValueError(f"attend got unsupported option(s) {', '.join(bad)}; supported: "
                         f"{', '.join(ATTEND_OPTIONS)}")
    return options


__all__ = ["ATTEND_OPTIONS", "FACTS", "OPTIONAL_FACTS", "AttentionBackend", "LayerMatmul", "ModelFacts", "PagedModel",
           "as_backend", "attend_options", "check_model", "check_partition_specs", "in_vocab", "model_facts",
           "partition_specs"]
