"""Quantized KV pages: int8 or float8_e4m3fn values with one float32 scale per token and KV head.

Layout (:class:`QuantPages`, a pytree)::

    values: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]  int8 | uint8 (e4m3 bits)
    scales: [num_layers, 2, num_kv_heads, num_blocks, block_size]            float32

float8_e4m3fn values are stored as their bit patterns (uint8; :func:`as_bits`), and
:attr:`QuantPages.dtype` still reads float8_e4m3fn. Every XLA op on the pages (the write's
scatter, the block copy, the reference's gathers) then moves bytes natively: XLA:CPU has no fp8,
and an op on an fp8 array, or a bitcast of the array a scatter just updated, made it convert or
copy the whole pool (every layer, every step). The Pallas kernels reinterpret each loaded tile
(:func:`stored_as`, a register bitcast) before converting it for the dot.

``values`` has exactly the layout of plain pages (``pallas_kernels`` module docstring), so every
kernel walks it the same way; ``scales`` is that layout without the head_dim axis, so block ``b``
of every (layer, K|V, head) plane is one contiguous ``[block_size]`` run of scales and a block
copy moves its scales with the same index arithmetic.

Scale rule (:func:`quantize`): symmetric, per row over head_dim, i.e. per token, per KV head, for
K and for V separately: ``scale = max|x| / qmax`` (``qmax`` 127 for int8, 448 for e4m3) and
``q = round(x / scale)`` (int8, saturating at +-127) or ``q = cast(x / scale)`` (e4m3, round to
nearest even, clipped to +-448 first so nothing overflows to NaN). A zero row gets scale 0 and
``q = 0``, and dequantizes to exactly 0 (``0 * 0``); no division by zero happens. The kernels
never dequantize a tile: K's scale multiplies the logits column, V's scale the probabilities
(``s_j = (q . k_q,j) k_scale,j softmax_scale``, ``o = sum_j (p_j v_scale,j) v_q,j / sum_j p_j``).

Targets: the Pallas kernels convert the int8/e4m3 tile to the query's dtype for the dot, which
Triton can do for e4m3 only on compute capability >= 8.9 (Ada, Hopper). :func:`check_kv_dtype`
refuses float8_e4m3fn for an older target (an A100, sm_80) before anything is traced.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from paged_kv.pallas_kernels import plan
from paged_kv.pallas_kernels.plan import (  # noqa: F401 (this module's names before the plan held them)
    FP8_MIN_CAPABILITY,
    abstract_device_kind,
    default_target,
    parse_target,
)

# The page dtypes accepted besides the model's own (float32 / bfloat16 / float16).
KV_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
# Largest magnitude each quantized dtype stores: int8 symmetric (-128 is never used, so the grid
# is symmetric about 0), e4m3fn's largest finite value.
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
# float8_e4m3fn pages keep their values as these bit patterns (module docstring).
BITS_DTYPE = jnp.dtype(jnp.uint8)


def check_quant_dtype(dtype: DTypeLike) -> jnp.dtype:
  """``dtype`` as a ``jnp.dtype`` when it is one of :data:`KV_DTYPES`.

  Raises:
    ValueError: naming the dtype and the accepted ones.
  """
  try:
    dt = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"KV dtype must be one of {[str(d) for d in KV_DTYPES]}, got {dtype!r}") from e
  if dt not in KV_DTYPES:
    raise ValueError(f"KV dtype must be one of {[str(d) for d in KV_DTYPES]}, got {dt}")
  return dt


@flax.struct.dataclass
class QuantPages:
  """Quantized KV pages (module docstring): ``values`` int8, or uint8 holding float8_e4m3fn bit
  patterns, ``[L, 2, Hkv, NB, bs, D]``, and ``scales`` float32 ``[L, 2, Hkv, NB, bs]``. A pytree:
  it goes through ``jit`` (donate it like plain pages), ``scan`` and ``tree_map`` as its two arrays.
  Build one with :meth:`zeros` or :func:`quantize_pages` (they store e4m3 as bits)."""

  values: jax.Array
  scales: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    """``values.shape``: ``(num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)``."""
    return tuple(self.values.shape)

  @property
  def dtype(self) -> jnp.dtype:
    """The quantized dtype, int8 or float8_e4m3fn (whose values are stored as uint8 bits)."""
    return kv_dtype_of(self.values.dtype)

  @property
  def num_blocks(self) -> int:
    return int(self.values.shape[3])

  @property
  def block_size(self) -> int:
    return int(self.values.shape[4])

  @classmethod
  def zeros(cls, shape: tuple[int, ...], dtype: DTypeLike) -> QuantPages:
    """Zeroed pages of ``shape`` (the values' 6-axis shape) in storage ``dtype`` (one of
    :data:`KV_DTYPES`), scales 0: every row dequantizes to exactly 0."""
    dt = check_quant_dtype(dtype)
    shape = tuple(int(s) for s in shape)
    if len(shape) != 6:
      raise ValueError(f"QuantPages shape must have 6 axes [L, 2, Hkv, NB, bs, D], got {shape}")
    return cls(values=jnp.zeros(shape, storage_dtype(dt)), scales=jnp.zeros(shape[:-1], jnp.float32))


def is_quant(pages: Any) -> bool:
  """Whether ``pages`` is a :class:`QuantPages` (else plain pages)."""
  return isinstance(pages, QuantPages)


def storage_dtype(dtype: DTypeLike) -> jnp.dtype:
  """The dtype :class:`QuantPages` stores ``dtype`` values in: uint8 bits for float8_e4m3fn, else
  ``dtype`` itself."""
  dt = jnp.dtype(dtype)
  return BITS_DTYPE if dt == jnp.dtype(jnp.float8_e4m3fn) else dt


def kv_dtype_of(stored: DTypeLike) -> jnp.dtype:
  """:func:`storage_dtype` undone: float8_e4m3fn for uint8 bits, else ``stored`` itself."""
  dt = jnp.dtype(stored)
  return jnp.dtype(jnp.float8_e4m3fn) if dt == BITS_DTYPE else dt


def stored_as(x: jax.Array, dtype: DTypeLike) -> jax.Array:
  """A tile of stored values (int8, or e4m3 bit patterns in uint8) converted to ``dtype``, exactly
  when ``dtype`` holds every quantized value (float32, bfloat16, float16 do). In a Pallas kernel the
  bits are reinterpreted in registers (a bitcast) and converted there."""
  if x.dtype == BITS_DTYPE:
    x = jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
  return x.astype(dtype)


def quantize(x: jax.Array, dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
  """Symmetric quantization per row over the last axis (module docstring).

  Args:
    x: float ``[..., D]`` (any float dtype; computed in float32).
    dtype: int8 or float8_e4m3fn.

  Returns:
    ``(q, scale)``: ``q`` ``[..., D]`` in ``dtype``, ``scale`` float32 ``[...]`` with
    ``dequantize(q, scale) ~= x``: per element within ``scale / 2`` for int8, within ``2**-4 |x|``
    (plus ``2**-10 scale`` in e4m3's subnormal range) for e4m3 (``tests/tolerances.py``). A zero row
    gives ``scale = 0`` and ``q = 0``.
  """
  dt = check_quant_dtype(dtype)
  qmax = QMAX[dt]
  xf = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(xf), axis=-1) / qmax
  # A zero row divides by 1 instead of 0: q is then exactly 0 (and so is q * 0 on the way back).
  y = xf / jnp.where(scale > 0, scale, 1.0)[..., None]
  # x / (max|x| / qmax) can round a hair above qmax; clip so int8 saturates and e4m3fn (which has
  # no infinity: an overflowing cast is NaN) stays finite.
  y = jnp.clip(y, -qmax, qmax)
  q = jnp.round(y).astype(dt) if dt == jnp.dtype(jnp.int8) else y.astype(dt)
  return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: DTypeLike = jnp.float32) -> jax.Array:
  """``q * scale[..., None]`` in ``dtype``: ``q`` ``[..., D]`` int8 | float8_e4m3fn, ``scale``
  float32 ``[...]``. The inverse of :func:`quantize` up to its rounding; the kernels never call it
  on a tile (they fold the scales into the logits and the probabilities instead)."""
  return (q.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)


def as_bits(x: jax.Array) -> jax.Array:
  """float8_e4m3fn values as their uint8 bit patterns (how :class:`QuantPages` stores them); any
  other dtype unchanged."""
  if jnp.dtype(x.dtype) == jnp.dtype(jnp.float8_e4m3fn):
    return jax.lax.bitcast_convert_type(x, BITS_DTYPE)
  return x


def bits_to_float32(x: jax.Array) -> jax.Array:
  """Stored page values (int8, or e4m3 bit patterns in uint8) as float32, exactly, with XLA ops.

  Both conversions are integer arithmetic that ends in a bitcast. XLA:CPU emulates the fp8
  conversion (about twice the cost of the whole multiply-reduce it feeds), and a plain int8
  conversion is fused into that multiply-reduce, which then ran 5-30 % slower than over a
  float32 chunk; ending in a bitcast keeps the conversion in its own loop, before the reduce.

  * int8 ``n``: ``|n|`` (0 .. 128, from the byte) converted as an unsigned integer, then the sign
    bit set.
  * e4m3: a normal value ``(-1)^s 2^(e-7) (1 + m/8)`` keeps its exponent and mantissa bits when
    they are shifted into a float32 and 120 (float32's bias 127 less e4m3's 7) is added to the
    exponent field; a subnormal one (``e = 0``) is ``m 2^-9``, read as ``2^-6 (1 + m/8) - 2^-6``.
    The two NaN patterns (0x7F, 0xFF), which :func:`quantize` never writes, read as +-480.

  Both equal ``astype(float32)`` bit for bit on every int8 and every finite e4m3 pattern
  (tests/test_kernels_quant.py checks all of them).
  """
  if x.dtype == jnp.dtype(jnp.int8):
    u = jax.lax.bitcast_convert_type(x, BITS_DTYPE).astype(jnp.uint32)
    neg = u >= 128
    mag = jnp.where(neg, 256 - u, u).astype(jnp.float32)  # |n|, 0 .. 128
    sign = jnp.where(neg, jnp.uint32(0x80000000), jnp.uint32(0))
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(mag, jnp.uint32) | sign, jnp.float32)
  if x.dtype != BITS_DTYPE:
    return x.astype(jnp.float32)
  b = x.astype(jnp.uint32)
  mag = (b & 0x7F) << 20
  # e = 0 (mag < 8 << 20): the pattern read with exponent field 121 is 2^-6 (1 + m/8); less 2^-6
  # it is the subnormal m 2^-9, exactly. Else the exponent field is e + 120.
  sub = jax.lax.bitcast_convert_type(mag + (121 << 23), jnp.float32) - 2.0**-6
  normal = jax.lax.bitcast_convert_type(mag + (120 << 23), jnp.float32)
  mag_f = jnp.where(mag < (8 << 20), sub, normal)
  return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(mag_f, jnp.uint32) | ((b & 0x80) << 24), jnp.float32)


def quantize_pages(pages: jax.Array, dtype: DTypeLike) -> QuantPages:
  """Plain pages ``[L, 2, Hkv, NB, bs, D]`` quantized row by row into :class:`QuantPages`."""
  values, scales = quantize(pages, dtype)
  return QuantPages(values=as_bits(values), scales=scales)


def dequantize_pages(pages: QuantPages, dtype: DTypeLike = jnp.float32) -> jax.Array:
  """:class:`QuantPages` back to plain pages ``[L, 2, Hkv, NB, bs, D]`` in ``dtype`` (tests and
  the explicit-dequantize comparison path)."""
  return dequantize(bits_to_float32(pages.values), pages.scales, dtype)


def check_kv_dtype(dtype: DTypeLike, target: Any = "auto") -> jnp.dtype:
  """Refuses a KV page dtype the target cannot compute, before anything is traced.

  Args:
    dtype: the page dtype: a float dtype (plain pages, always accepted here) or one of
      :data:`KV_DTYPES`.
    target: "auto" (:func:`default_target`: the GPU a deviceless lowering names, or JAX's GPU, or
      None on a CPU), None (no GPU: every dtype runs through XLA or interpret mode), or a target
      as :func:`parse_target` reads it (the gate passes ``"sm_80"`` / ``"sm_90"``).

  Returns:
    ``jnp.dtype(dtype)``.

  Raises:
    ValueError: one line naming the dtype and the target, for float8_e4m3fn below compute
      capability 8.9 (Triton converts e4m3 only from Ada / Hopper on).
  """
  dt = jnp.dtype(dtype)
  cc = default_target() if isinstance(target, str) and target == "auto" else parse_target(target)
  if cc is not None and dt in KV_DTYPES:  # the refusal is the plan's fp8_target row
    plan.make_plan("pallas", target=cc, kv_dtype=dt)
  return dt
