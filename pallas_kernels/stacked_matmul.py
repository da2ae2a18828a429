"""One layer's matmul read straight out of a stacked weight, as a Pallas (Triton) kernel.

``out[M, N] = ((scale[layer] * x) @ w[layer] + bias[layer])``, with ``w: [L, K, N]`` the weights
of every layer stacked on axis 0 and ``layer`` an int32 operand (traced inside a scan over
layers). Why a kernel: inside a scan over layers XLA:GPU turns ``w[layer]`` into a copy of the
layer's slice before each matmul, every step (its GEMM fusions and cuBLAS calls take whole
buffers), so a scanned decode step copied every decoder weight once per token. This kernel gets
the whole stacked buffer (a loop invariant of the scan: never copied) and indexes its layer axis
with the operand, as the attention kernels index the pages' layer axis.

``scale`` (optional ``[L, K]``) is the RMSNorm weight that precedes the projection: it
multiplies the ``x`` tile in ``x.dtype`` before the dot, the same product the norm itself would
form, so the norm's weight needs no slice either. ``bias`` (optional ``[L, N]``) is added to the
result after the cast to ``x.dtype``, as the model adds its biases.

Grid ``(M / bm, N / bn)``; program ``(i, j)`` loops over ``K`` in ``bk`` steps, accumulating in
float32 (``preferred_element_type``), and writes its ``[bm, bn]`` tile cast to ``x.dtype``.
The last row block's rows past ``M`` are masked (not padded: a pad and the slice after it
would be an extra copy per projection). ``K`` and ``N`` must be multiples of 16 (Triton's
smallest dot); :func:`supported` says whether a shape qualifies.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from paged_kv.pallas_kernels.decode_attention import layer_operand

MIN_DIM = 16  # tl.dot's smallest tile edge
# Enough programs to cover an H100/H200's 132 SMs twice when the tile is chosen; a decode step's
# M is a handful of rows, so the grid comes from N and bn shrinks before the SMs idle.
_TARGET_PROGRAMS = 264


def supported(k: int, n: int) -> bool:
  """True when a ``[K, N]`` weight can go through the kernel (both multiples of 16)."""
  return k % MIN_DIM == 0 and n % MIN_DIM == 0 and k > 0 and n > 0


def _largest_pow2_divisor(n: int, cap: int) -> int:
  b = MIN_DIM
  while b * 2 <= cap and n % (b * 2) == 0:
    b *= 2
  return b


def tiles(m: int, k: int, n: int) -> tuple[int, int, int]:
  """(bm, bk, bn) for an ``[m, k] @ [k, n]`` product: bm the smallest power of two >= m up to
  64; bk the largest power of two <= 64 dividing k; bn the largest power of two <= 128
  dividing n, halved while the grid has fewer than ``_TARGET_PROGRAMS`` programs, down to 32
  (a weight tile's rows stay 64 bytes or more in bfloat16) or to what divides n.

  Not tuned on a GPU (none was at hand): a guess from the shapes alone, a decode step's M
  being a few rows, so its programs come from N."""
  bm = MIN_DIM
  while bm < min(m, 64):
    bm *= 2
  bk = _largest_pow2_divisor(k, 64)
  bn = _largest_pow2_divisor(n, 128)
  rows = -(-m // bm)
  while bn > 2 * MIN_DIM and rows * (n // bn) < _TARGET_PROGRAMS:
    bn //= 2
  return bm, bk, bn


def _kernel(layer_ref, x_ref, w_ref, *rest, m: int, bk: int, has_scale: bool, has_bias: bool):
  rest = list(rest)
  scale_ref = rest.pop(0) if has_scale else None
  bias_ref = rest.pop(0) if has_bias else None
  (o_ref,) = rest
  layer = layer_ref[0]
  bm, bn = o_ref.shape
  # The last row block may run past M: Triton's Pallas lowering does not mask a block that
  # overhangs its array, so these rows are masked by hand (never read, never written).
  rows = (pl.program_id(0) * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < m

  def body(kk, acc):
    a = pltriton.load(x_ref.at[:, pl.ds(kk * bk, bk)], mask=rows, other=0)
    if scale_ref is not None:
      a = scale_ref[layer, pl.ds(kk * bk, bk)][None, :] * a
    b = w_ref[layer, pl.ds(kk * bk, bk), :]
    return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

  acc = lax.fori_loop(0, x_ref.shape[1] // bk, body, jnp.zeros((bm, bn), jnp.float32))
  out = acc.astype(o_ref.dtype)
  if bias_ref is not None:
    out = out + bias_ref[layer, :][None, :]
  pltriton.store(o_ref, out, mask=rows)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "num_stages"))
def layer_matmul_pallas(x: jax.Array, w: jax.Array, layer: int | jax.Array, scale: jax.Array | None = None,
                        bias: jax.Array | None = None, *, interpret: bool = False, num_warps: int = 4,
                        num_stages: int = 2) -> jax.Array:
  """Pallas version of :func:`paged_kv.pallas_kernels.layer_matmul` (same arguments)."""
  m, k = x.shape
  num_layers, _, n = w.shape
  bm, bk, bn = tiles(m, k, n)
  grid = (pl.cdiv(m, bm), n // bn)
  in_specs = [pl.BlockSpec((1,), lambda i, j: (0,)),
              pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
              pl.BlockSpec((num_layers, k, bn), lambda i, j: (0, 0, j))]  # every layer: indexed in the kernel
  operands = [layer_operand(layer, num_layers), x, w]
  if scale is not None:
    in_specs.append(pl.BlockSpec((num_layers, k), lambda i, j: (0, 0)))
    operands.append(scale)
  if bias is not None:
    in_specs.append(pl.BlockSpec((num_layers, bn), lambda i, j: (0, j)))
    operands.append(bias)
  out = pl.pallas_call(
      functools.partial(_kernel, m=m, bk=bk, has_scale=scale is not None, has_bias=bias is not None),
      grid=grid,
      in_specs=in_specs,
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="layer_matmul",
  )(*operands)
  return out
