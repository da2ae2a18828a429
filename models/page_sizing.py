"""Page sizing: the shape and bytes of a model's KV pages, from the protocol's facts, and their
allocation.

Page layout (owned by `pallas_kernels`): one array per model,
`pages[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]` (axis 1: 0=K, 1=V); with
KV-cache groups (`paged_kv.models.kv_groups.KVGroupLayout`) axis 0 holds the layout's `slots`.
Block 0 is the reserved null block. Quantized pages (int8 / float8_e4m3fn) are `QuantPages`
with one float32 scale per token and KV head, for K and for V, counted in the bytes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from paged_kv.models.kv_groups import KVGroupLayout
from paged_kv.models.protocol import ModelFacts, model_facts
from paged_kv.pallas_kernels.quant import KV_DTYPES, QuantPages

if TYPE_CHECKING:
    from paged_kv.models.config import LlamaConfig

# Bytes of one quantized page scale (float32), stored per token per KV head for K and for V.
SCALE_BYTES = 4


def resolve_kv_dtype(kv_dtype: DTypeLike | None, model_dtype: DTypeLike) -> str:
    """The pages' storage dtype as a string: `model_dtype` for None or "auto" (plain pages), "int8"
    for "int8", "float8_e4m3fn" for "fp8" / "float8_e4m3fn", or a float dtype (plain pages in it).

    Raises:
      ValueError: naming `kv_dtype` and the accepted ones.
    """
    if kv_dtype is None or (isinstance(kv_dtype, str) and kv_dtype == "auto"):
        return str(jnp.dtype(model_dtype))
    if isinstance(kv_dtype, str) and kv_dtype == "fp8":
        kv_dtype = jnp.float8_e4m3fn
    try:
        dt = jnp.dtype(kv_dtype)
    except TypeError:
        dt = None
    if dt is None or (dt not in KV_DTYPES and dt not in (jnp.float32, jnp.bfloat16, jnp.float16)):
        raise ValueError(f"kv_dtype={kv_dtype!r} must be 'auto' (the model's dtype), 'int8', 'fp8' "
                         "('float8_e4m3fn') or one of float32/bfloat16/float16")
    return str(dt)


def is_quant_dtype(dtype: DTypeLike) -> bool:
    """Whether pages stored in `dtype` are `QuantPages` (int8 or float8_e4m3fn)."""
    return jnp.dtype(dtype) in KV_DTYPES


@dataclasses.dataclass(frozen=True)
class KVPageSpec:
    """Shape and size of the KV pages of one model. `num_layers` is the pages' leading axis: the
    model's layers, or a grouped `KVGroupLayout`'s `slots` (layers per group), so a block's bytes
    are those of `num_layers` layers.

    `dtype` is the model's (compute) dtype; `kv_dtype` the pages' storage dtype (None: `dtype`).
    With `kv_dtype` int8 or float8_e4m3fn (`quantized`) the pages are a
    `paged_kv.pallas_kernels.QuantPages`: values of `shape` in `kv_dtype` plus float32 scales
    `shape[:-1]` (one per token per KV head, for K and for V), both counted in the bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    dtype: str
    kv_dtype: str | None = None

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} must be >= 2 (block 0 is the reserved null block)")
        object.__setattr__(self, "kv_dtype", resolve_kv_dtype(self.kv_dtype, self.dtype))

    @property
    def quantized(self) -> bool:
        """Whether the pages are `QuantPages` (`kv_dtype` int8 or float8_e4m3fn)."""
        return is_quant_dtype(self.kv_dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """The (values') shape `[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]`."""
        return (self.num_layers, 2, self.num_kv_heads, self.num_blocks, self.block_size, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token_raw(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    @property
    def usable_tokens(self) -> int:
        """Token capacity excluding the null block."""
        return (self.num_blocks - 1) * self.block_size


def kv_bytes_per_token_raw(num_layers: int, num_kv_heads: int, head_dim: int, dtype: DTypeLike) -> int:
    """K and V bytes of one token in pages of `dtype`: `head_dim` elements per layer, K|V and KV
    head, plus (int8 / float8_e4m3fn) one float32 scale per layer, K|V and KV head."""
    per_head = head_dim * np.dtype(jnp.dtype(dtype)).itemsize
    if is_quant_dtype(dtype):
        per_head += SCALE_BYTES
    return num_layers * 2 * num_kv_heads * per_head


def _storage_dtype(f: ModelFacts, dtype: DTypeLike | None, kv_dtype: DTypeLike | None) -> str:
    """The pages' storage dtype: `kv_dtype` when given (resolved against the model's dtype), else
    `dtype`, else the model's."""
    if kv_dtype is not None:
        return resolve_kv_dtype(kv_dtype, f.dtype)
    return str(jnp.dtype(f.dtype if dtype is None else dtype))


def kv_bytes_per_token(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig,
                       dtype: DTypeLike | None = None, *, kv_dtype: DTypeLike | None = None) -> int:
    """K and V bytes of one token over all layers (Llama 3.1 8B bf16: 128 KiB; int8 with its
    scales: 64 KiB + 1 KiB). `model`: a `paged_kv.models.protocol.PagedModel` (or its split, its
    `ModelFacts`, a `LlamaConfig`). `kv_dtype` (as `resolve_kv_dtype` reads it) wins over `dtype`;
    both default to the model's dtype."""
    f = model_facts(model)
    return kv_bytes_per_token_raw(f.num_layers, f.num_kv_heads, f.head_dim, _storage_dtype(f, dtype, kv_dtype))


def kv_bytes_per_block(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig,
                       block_size: int = 16, dtype: DTypeLike | None = None,
                       layout: KVGroupLayout | None = None, *, kv_dtype: DTypeLike | None = None) -> int:
    """Bytes of one block (Llama 3.1 8B bf16, 16 tokens: 2 MiB). With a `layout` (a grouped
    manager's, `kv_group_layout`), a block holds `layout.slots` layers: Gemma 3's 5 : 1 layout
    makes a block 1/6 of the model's per-block bytes, the same in every group. `kv_dtype` as in
    `kv_bytes_per_token` (quantized pages count their float32 scales)."""
    if layout is None:
        return kv_bytes_per_token(model, dtype, kv_dtype=kv_dtype) * block_size
    f = model_facts(model)
    _check_layout(f, layout)
    return kv_bytes_per_token_raw(layout.slots, f.num_kv_heads, f.head_dim, _storage_dtype(f, dtype, kv_dtype)
                                  ) * block_size


def _check_layout(facts: ModelFacts, layout: KVGroupLayout | None) -> None:
    if layout is not None and layout.num_layers != facts.num_layers:
        raise ValueError(f"layout has {layout.num_layers} layers; the model has num_layers={facts.num_layers}")


def _spec_dtypes(f: ModelFacts, dtype: DTypeLike | None, kv_dtype: DTypeLike | None) -> tuple[str, str]:
    """`(dtype, kv_dtype)` of a `KVPageSpec`: a quantized `dtype` (the old way to name the pages'
    dtype) counts as `kv_dtype` with the model's compute dtype."""
    storage = _storage_dtype(f, dtype, kv_dtype)
    compute = str(jnp.dtype(f.dtype if dtype is None or is_quant_dtype(dtype) else dtype))
    if kv_dtype is not None and is_quant_dtype(storage):
        compute = str(jnp.dtype(f.dtype))
    return compute, storage


def page_spec_for_budget(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig, *,
                         block_size: int = 16, budget_bytes: int | None = None, memory_fraction: float | None = None,
                         device: jax.Device | None = None, dtype: DTypeLike | None = None,
                         layout: KVGroupLayout | None = None, kv_dtype: DTypeLike | None = None) -> KVPageSpec:
    """Largest page pool for `model` (as in `kv_bytes_per_token`; blocks of `layout.slots` layers
    with a grouped `layout`, see `kv_bytes_per_block`) fitting a budget: `budget_bytes`,
    or `memory_fraction` of the device's memory limit (`device.memory_stats()["bytes_limit"]`; first
    device when `device` is None). The null block counts against the budget. `kv_dtype`: the
    pages' storage dtype (`resolve_kv_dtype`: "auto", "int8", "fp8", ...); int8 / fp8 pages with
    their scales hold about 2x the blocks of bfloat16 and 4x of float32 (`head_dim` bytes plus a
    4-byte scale per row instead of 2 or 4 bytes per element). Raises ValueError when fewer
    than 2 blocks fit."""
    f = model_facts(model)
    if (budget_bytes is None) == (memory_fraction is None):
        raise ValueError("give exactly one of budget_bytes and memory_fraction")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if memory_fraction is not None:
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction={memory_fraction} must be in (0, 1]")
        device = jax.devices()[0] if device is None else device
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ValueError(f"device {device} reports no memory limit; pass budget_bytes instead")
        budget_bytes = int(stats["bytes_limit"] * memory_fraction)
    compute, storage = _spec_dtypes(f, dtype, kv_dtype)
    per_block = kv_bytes_per_block(f, block_size, storage, layout)
    num_blocks = int(budget_bytes) // per_block
    if num_blocks < 2:
        raise ValueError(f"budget of {budget_bytes} bytes holds {num_blocks} blocks of {per_block} bytes; "
                         "need >= 2 (block 0 is the reserved null block)")
    layers = f.num_layers if layout is None else layout.slots
    return KVPageSpec(layers, f.num_kv_heads, f.head_dim, num_blocks, block_size, compute, storage)


def page_spec(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | ModelFacts | LlamaConfig, num_blocks: int,
              block_size: int = 16, dtype: DTypeLike | None = None,
              layout: KVGroupLayout | None = None, *, kv_dtype: DTypeLike | None = None) -> KVPageSpec:
    """Pages for `model` (a `paged_kv.models.protocol.PagedModel`, its split, its `ModelFacts` or a
    `LlamaConfig`): its layers (`layout.slots` with a `layout`: a grouped manager's pages, from
    `paged_kv.engine.call_setup.group_layout(model, manager)`), KV heads, head_dim and dtype (or `dtype`).
    `kv_dtype` ("auto", "int8", "fp8", "float8_e4m3fn", or a float dtype; `resolve_kv_dtype`):
    the pages' storage dtype; int8 / float8_e4m3fn makes `allocate_pages` return `QuantPages`."""
    f = model_facts(model)
    _check_layout(f, layout)
    layers = f.num_layers if layout is None else layout.slots
    compute, storage = _spec_dtypes(f, dtype, kv_dtype)
    return KVPageSpec(layers, f.num_kv_heads, f.head_dim, num_blocks, block_size, compute, storage)


def allocate_pages(spec: KVPageSpec, device: jax.Device | None = None) -> jax.Array | QuantPages:
    """Zeroed pages of `spec.shape` in `spec.kv_dtype` (optionally placed on `device`): a plain
    array, or for a quantized spec a `QuantPages` (int8 / float8_e4m3fn values, float32 scales
    `shape[:-1]`, all zero: every row dequantizes to exactly 0)."""
    if spec.quantized:
        pages = QuantPages.zeros(spec.shape, spec.kv_dtype)
    else:
        pages = jnp.zeros(spec.shape, jnp.dtype(spec.kv_dtype))
    return pages if device is None else jax.device_put(pages, device)
