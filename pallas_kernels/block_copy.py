"""Block copy (copy-on-write) as one in-place Pallas (Triton) launch over all layers.

The pages ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]`` are viewed as
``[num_layers * 2 * num_kv_heads, num_blocks, block_size, head_dim]`` (a free reshape), so a
block is ``num_layers * 2 * num_kv_heads`` contiguous ``[block_size, head_dim]`` tiles at the
same block index. Grid ``(num_copies, head_groups)``: program ``(i, g)`` copies the tiles of
``head_rows`` consecutive (layer, K|V, head) rows from block ``src[i]`` to block ``dst[i]``.

The output aliases the pages input (``input_output_aliases``), so with the pages donated the
copy touches only the copied blocks; without donation XLA first copies the whole array to keep
the input alive. The copy list has a fixed padded size (padding ``(0, 0)``, skipped in the
kernel), so a different number of real copies never retraces. Real destinations must be
distinct and not also sources in the same list: programs run in no particular order, so a
chain ``2 -> 3, 3 -> 4`` may copy the new block 3 (old 2) to 4, and a swap ``2 -> 3, 3 -> 2``
may leave both blocks equal. :func:`paged_kv.pallas_kernels.copy_blocks` checks this on concrete lists
(:func:`paged_kv.pallas_kernels.validate.check_copy_lists`); under ``jit`` the caller guarantees it.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from paged_kv.pallas_kernels.reference import sanitize_block_tables


def _copy_kernel(src_ref, dst_ref, pages_ref, out_ref, *, head_rows: int):
  del pages_ref  # Same buffer as out_ref (aliased); read and write through out_ref.
  src = src_ref[0]
  dst = dst_ref[0]

  @pl.when(src != dst)
  def _copy():
    def body(j, carry):
      out_ref[j, dst] = out_ref[j, src]
      return carry
    lax.fori_loop(0, head_rows, body, 0)


@functools.partial(jax.jit, static_argnames=("interpret", "head_rows", "num_warps"))
def copy_blocks_pallas(pages: jax.Array, src: jax.Array, dst: jax.Array, *, interpret: bool = False,
                       head_rows: int | None = None, num_warps: int = 4) -> jax.Array:
  """Pallas block copy; arguments as :func:`paged_kv.pallas_kernels.copy_blocks`."""
  num_layers, _, num_kv_heads, num_blocks, block_size, head_dim = pages.shape
  rows = num_layers * 2 * num_kv_heads
  if head_rows is None:
    head_rows = math.gcd(rows, 16)
  if rows % head_rows:
    raise ValueError(f"head_rows={head_rows} must divide num_layers * 2 * num_kv_heads = {rows}")
  num_copies = src.shape[0]
  src = sanitize_block_tables(src, num_blocks).reshape(num_copies, 1)
  dst = sanitize_block_tables(dst, num_blocks).reshape(num_copies, 1)
  flat = pages.reshape(rows, num_blocks, block_size, head_dim)
  spec = pl.BlockSpec((head_rows, num_blocks, block_size, head_dim), lambda i, g: (g, 0, 0, 0))
  out = pl.pallas_call(
      functools.partial(_copy_kernel, head_rows=head_rows),
      grid=(num_copies, rows // head_rows),
      in_specs=[
          pl.BlockSpec((None, 1), lambda i, g: (i, 0)),
          pl.BlockSpec((None, 1), lambda i, g: (i, 0)),
          spec,
      ],
      out_specs=spec,
      out_shape=jax.ShapeDtypeStruct(flat.shape, flat.dtype),
      input_output_aliases={2: 0},
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="copy_blocks",
  )(src, dst, flat)
  return out.reshape(pages.shape)
