"""Shape, dtype and argument checks for the public kernel entry points.

Every public function in :mod:`pallas_kernels` calls one of the ``check_*`` functions below
before anything is traced, so a mismatch raises a ``ValueError`` that names the offending
value, its shape or dtype, and the limit it breaks, instead of a Triton or XLA error deep inside
a lowering. The checks only look at static metadata (``.shape``, ``.dtype``, Python ints), so
they work on concrete arrays, tracers and ``jax.ShapeDtypeStruct`` alike.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

IMPLS = ("auto", "pallas", "interpret", "reference")
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_INT32 = jnp.dtype(jnp.int32)
PAGES_LAYOUT = "[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]"


def is_power_of_two(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def check_impl(impl: Any) -> str:
  if not isinstance(impl, str) or impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  return impl


def check_pages(pages: Any) -> tuple[int, int, int, int, int]:
  """Returns (num_layers, num_kv_heads, num_blocks, block_size, head_dim)."""
  shape = tuple(np.shape(pages))
  if len(shape) != 6:
    raise ValueError(f"pages must have rank 6 {PAGES_LAYOUT}, got rank {len(shape)} shape {shape}")
  num_layers, kv, num_kv_heads, num_blocks, block_size, head_dim = shape
  if kv != 2:
    raise ValueError(f"pages axis 1 must have size 2 (0 = K, 1 = V), got {kv} in shape {shape}")
  if min(num_layers, num_kv_heads, num_blocks, block_size, head_dim) < 1:
    raise ValueError(f"pages dimensions must all be >= 1, got shape {shape}")
  if not is_power_of_two(block_size):
    raise ValueError(f"pages block_size (axis 4) must be a power of two, got {block_size}")
  if jnp.dtype(pages.dtype) not in FLOAT_DTYPES:
    raise ValueError(f"pages dtype must be one of float32/bfloat16/float16, got {pages.dtype}")
  return num_layers, num_kv_heads, num_blocks, block_size, head_dim


def check_layer(layer: Any, num_layers: int) -> int:
  if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
    raise ValueError(f"layer must be a static Python int, got {type(layer).__name__} {layer!r}")
  if not 0 <= int(layer) < num_layers:
    raise ValueError(f"layer={layer} out of range [0, {num_layers}) for pages with {num_layers} layers")
  return int(layer)


def check_scale(scale: Any, head_dim: int) -> float:
  if scale is None:
    return float(head_dim) ** -0.5
  if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
    raise ValueError(f"scale must be a Python float or None, got {type(scale).__name__} {scale!r}")
  return float(scale)


def _check_int32(name: str, x: Any, shape: tuple[int, ...] | None = None, ndim: int | None = None):
  xshape = tuple(np.shape(x))
  if ndim is not None and len(xshape) != ndim:
    raise ValueError(f"{name} must have rank {ndim}, got shape {xshape}")
  if shape is not None and xshape != shape:
    raise ValueError(f"{name} must have shape {shape}, got {xshape}")
  dtype = jnp.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
  if dtype != _INT32:
    raise ValueError(f"{name} must be int32, got {dtype}")
  return xshape


def _check_pallas_shapes(impl: str, head_dim: int):
  if impl in ("pallas", "interpret") and not (is_power_of_two(head_dim) and head_dim >= 16):
    raise ValueError(
        f"head_dim={head_dim}: the Pallas (Triton) kernels need a power-of-two head_dim >= 16; "
        "use impl='reference'")


def _check_query(q: Any, ndim: int, pages: Any, num_kv_heads: int, head_dim: int, layout: str):
  shape = tuple(np.shape(q))
  if len(shape) != ndim:
    raise ValueError(f"q must have rank {ndim} {layout}, got shape {shape}")
  num_q_heads, q_head_dim = shape[-2], shape[-1]
  if q_head_dim != head_dim:
    raise ValueError(f"q head_dim {q_head_dim} does not match pages head_dim {head_dim}")
  if num_q_heads < 1 or num_q_heads % num_kv_heads:
    raise ValueError(
        f"num_q_heads={num_q_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
  if jnp.dtype(q.dtype) != jnp.dtype(pages.dtype):
    raise ValueError(f"q dtype {q.dtype} must equal pages dtype {pages.dtype}")
  return shape


def check_decode(q, pages, layer, block_tables, lengths, scale, impl):
  impl = check_impl(impl)
  num_layers, num_kv_heads, num_blocks, block_size, head_dim = check_pages(pages)
  layer = check_layer(layer, num_layers)
  b, _, _ = _check_query(q, 3, pages, num_kv_heads, head_dim, "[batch, num_q_heads, head_dim]")
  bt_shape = _check_int32("block_tables", block_tables, ndim=2)
  if bt_shape[0] != b:
    raise ValueError(f"block_tables batch {bt_shape[0]} does not match q batch {b}")
  if bt_shape[1] < 1:
    raise ValueError(f"block_tables must have at least one column, got shape {bt_shape}")
  _check_int32("lengths", lengths, shape=(b,))
  _check_pallas_shapes(impl, head_dim)
  return layer, check_scale(scale, head_dim), impl


def check_prefill(q, pages, layer, block_tables, q_start, q_lens, scale, impl):
  impl = check_impl(impl)
  num_layers, num_kv_heads, num_blocks, block_size, head_dim = check_pages(pages)
  layer = check_layer(layer, num_layers)
  b, t, _, _ = _check_query(q, 4, pages, num_kv_heads, head_dim,
                            "[batch, num_tokens, num_q_heads, head_dim]")
  if t < 1:
    raise ValueError(f"q must have at least one token per sequence, got shape {tuple(np.shape(q))}")
  bt_shape = _check_int32("block_tables", block_tables, ndim=2)
  if bt_shape[0] != b:
    raise ValueError(f"block_tables batch {bt_shape[0]} does not match q batch {b}")
  if bt_shape[1] < 1:
    raise ValueError(f"block_tables must have at least one column, got shape {bt_shape}")
  _check_int32("q_start", q_start, shape=(b,))
  _check_int32("q_lens", q_lens, shape=(b,))
  _check_pallas_shapes(impl, head_dim)
  return layer, check_scale(scale, head_dim), impl


def check_write_kv(pages, layer, k, v, slots, impl):
  impl = check_impl(impl)
  num_layers, num_kv_heads, _, _, head_dim = check_pages(pages)
  layer = check_layer(layer, num_layers)
  n = _check_int32("slots", slots, ndim=1)[0]
  want = (n, num_kv_heads, head_dim)
  for name, x in (("k", k), ("v", v)):
    if tuple(np.shape(x)) != want:
      raise ValueError(f"{name} must have shape [N, num_kv_heads, head_dim] = {want} "
                       f"(N from slots), got {tuple(np.shape(x))}")
    if jnp.dtype(x.dtype) != jnp.dtype(pages.dtype):
      raise ValueError(f"{name} dtype {x.dtype} must equal pages dtype {pages.dtype}")
  _check_pallas_shapes(impl, head_dim)
  return layer, impl


def check_copy_blocks(pages, src, dst, impl):
  impl = check_impl(impl)
  _, _, _, _, head_dim = check_pages(pages)
  c = _check_int32("src", src, ndim=1)
  _check_int32("dst", dst, shape=c)
  _check_pallas_shapes(impl, head_dim)
  return impl
