"""KV write at slot indices as an in-place Pallas (Triton) kernel.

The pages are viewed as ``[num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim]``
(a free reshape): slot ``s = block_id * block_size + offset`` is then row ``s`` of every
(layer, K|V, head) plane. The layer is an int32 operand (a Python int or a scalar, traced or
not, clamped to ``[0, num_layers)``: see
:func:`paged_kv.pallas_kernels.decode_attention.layer_operand`), not a compiled-in block index,
so every layer's write is the same kernel. Grid ``(N,)``: program ``n`` writes ``k[n, h]`` and
``v[n, h]`` for every KV head into row ``slots[n]``. The output aliases the pages
(``input_output_aliases``): donate the pages so only ``N`` rows are written. Padding rows write
into the null block 0; slots outside the pages are clamped to slot 0 beforehand.

Quantized pages (:class:`paged_kv.pallas_kernels.quant.QuantPages`): the rows are quantized first
(one elementwise XLA fusion over the ``N`` new rows, :func:`paged_kv.pallas_kernels.quant.quantize`),
then the same kernel shape writes each row's values and its scale at the slot, values and scales
both aliased in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from paged_kv.pallas_kernels import quant
from paged_kv.pallas_kernels.decode_attention import layer_operand
from paged_kv.pallas_kernels.reference import PagesLike, sanitize_slots


def _write_kernel(layer_ref, slot_ref, k_ref, v_ref, *refs):
  """``refs``: ``(pages, out)``, or for quantized pages ``(k_scales, v_scales, values, scales,
  out_values, out_scales)``; each output aliases its input, and writes go through the outputs."""
  quantized = len(refs) == 6
  out_ref = refs[-2] if quantized else refs[-1]
  layer = layer_ref[0]
  slot = slot_ref[0]
  num_kv_heads = k_ref.shape[0]

  def body(h, carry):
    out_ref[layer, 0, h, slot] = k_ref[h]
    out_ref[layer, 1, h, slot] = v_ref[h]
    if quantized:
      ks_ref, vs_ref, out_scales_ref = refs[0], refs[1], refs[-1]
      # A scale is one float32; stored as a one-element run (Triton block shapes are vectors).
      out_scales_ref[layer, 0, h, pl.ds(slot, 1)] = ks_ref[pl.ds(h, 1)]
      out_scales_ref[layer, 1, h, pl.ds(slot, 1)] = vs_ref[pl.ds(h, 1)]
    return carry

  lax.fori_loop(0, num_kv_heads, body, 0)


def _write_quant(pages: quant.QuantPages, layer: int | jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, *,
                 interpret: bool, num_warps: int) -> quant.QuantPages:
  """:func:`write_kv_pallas` for quantized pages: quantize the ``N`` rows, then write values and
  scales in one launch (both aliased)."""
  num_layers, _, num_kv_heads, num_blocks, block_size, head_dim = pages.shape
  num_slots = num_blocks * block_size
  n = slots.shape[0]
  q, s = quant.quantize(jnp.stack([k, v]), pages.dtype)  # K and V rows in one call
  q = quant.as_bits(q)  # e4m3 stored as bits
  (kq, vq), (ks, vs) = q, s
  slots = sanitize_slots(slots, num_slots).reshape(n, 1)
  flat = pages.values.reshape(num_layers, 2, num_kv_heads, num_slots, head_dim)
  flat_scales = pages.scales.reshape(num_layers, 2, num_kv_heads, num_slots)
  page_spec = pl.BlockSpec(flat.shape, lambda i: (0, 0, 0, 0, 0))  # all layers
  scale_spec = pl.BlockSpec(flat_scales.shape, lambda i: (0, 0, 0, 0))
  row_spec = pl.BlockSpec((None, num_kv_heads, head_dim), lambda i: (i, 0, 0))
  head_spec = pl.BlockSpec((None, num_kv_heads), lambda i: (i, 0))
  values, scales = pl.pallas_call(
      _write_kernel,
      grid=(n,),
      in_specs=[pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((None, 1), lambda i: (i, 0)),
                row_spec, row_spec, head_spec, head_spec, page_spec, scale_spec],
      out_specs=[page_spec, scale_spec],
      out_shape=[jax.ShapeDtypeStruct(flat.shape, flat.dtype),
                 jax.ShapeDtypeStruct(flat_scales.shape, jnp.float32)],
      input_output_aliases={6: 0, 7: 1},
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="write_kv_quant",
  )(layer_operand(layer, num_layers), slots, kq, vq, ks, vs, flat, flat_scales)
  return quant.QuantPages(values=values.reshape(pages.shape), scales=scales.reshape(pages.scales.shape))


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def write_kv_pallas(pages: PagesLike, layer: int | jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, *,
                    interpret: bool = False, num_warps: int = 1) -> PagesLike:
  """Pallas KV write; arguments as :func:`paged_kv.pallas_kernels.write_kv`."""
  if quant.is_quant(pages):
    return _write_quant(pages, layer, k, v, slots, interpret=interpret, num_warps=num_warps)
  num_layers, _, num_kv_heads, num_blocks, block_size, head_dim = pages.shape
  num_slots = num_blocks * block_size
  n = slots.shape[0]
  slots = sanitize_slots(slots, num_slots).reshape(n, 1)
  flat = pages.reshape(num_layers, 2, num_kv_heads, num_slots, head_dim)
  page_spec = pl.BlockSpec(flat.shape, lambda i: (0, 0, 0, 0, 0))  # all layers
  row_spec = pl.BlockSpec((None, num_kv_heads, head_dim), lambda i: (i, 0, 0))
  out = pl.pallas_call(
      _write_kernel,
      grid=(n,),
      in_specs=[pl.BlockSpec((1,), lambda i: (0,)), pl.BlockSpec((None, 1), lambda i: (i, 0)),
                row_spec, row_spec, page_spec],
      out_specs=page_spec,
      out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
      input_output_aliases={4: 0},
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="write_kv",
  )(layer_operand(layer, num_layers), slots, k, v, flat)
  return out.reshape(pages.shape)
