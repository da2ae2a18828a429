"""Block copy (copy-on-write) as one in-place Pallas (Triton) launch over all layers.

The pages ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]`` are viewed as
``[rows, num_blocks, block_size, head_dim]`` with ``rows = num_layers * 2 * num_kv_heads`` (a
free reshape), so a block is ``rows`` contiguous ``[block_size, head_dim]`` tiles at the same
block index. Grid ``(num_copies, rows // head_rows)``: program ``(i, g)`` copies ``head_rows``
consecutive (layer, K|V, head) rows of block ``src[i]`` to block ``dst[i]``, in ``head_rows //
slab_rows`` steps; each step loads a ``[slab_rows, block_size, head_dim]`` slab (all of it in
flight at once) and then stores it.

The copy is memory-bound with no arithmetic, so its speed is the bytes it keeps in flight: a
step moves a slab of about ``_SLAB_BYTES`` rather than one tile, and :func:`copy_plan` picks
``slab_rows`` and ``head_rows`` from the copy count at trace time (the copy list has a fixed
padded size): few copies split the rows over many programs of one step each (a single Llama 3.1
8B block is 256 programs, enough to cover the SMs), many copies give each program several steps
so the grid stays near ``_MAX_PROGRAMS`` programs instead of tens of thousands.

The output aliases the pages input (``input_output_aliases``), so with the pages donated the
copy touches only the copied blocks; without donation XLA first copies the whole array to keep
the input alive. The copy list has a fixed padded size (padding ``(0, 0)``, skipped in the
kernel), so a different number of real copies never retraces. Real destinations must be
distinct and not also sources in the same list: programs run in no particular order, so a
chain ``2 -> 3, 3 -> 4`` may copy the new block 3 (old 2) to 4, and a swap ``2 -> 3, 3 -> 2``
may leave both blocks equal. :func:`paged_kv.pallas_kernels.copy_blocks` checks this on concrete lists
(:func:`paged_kv.pallas_kernels.validate.check_copy_lists`); under ``jit`` the caller guarantees it.

Quantized pages (:class:`paged_kv.pallas_kernels.quant.QuantPages`): the scales
``[L, 2, Hkv, NB, bs]`` are viewed as ``[rows, NB, bs]`` and are a second aliased operand of the
same launch; each step copies its slab's ``[slab_rows, bs]`` scales with its values, so a copied
block always dequantizes exactly as its source.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from paged_kv.pallas_kernels import quant
from paged_kv.pallas_kernels.reference import PagesLike, sanitize_block_tables

# Bytes one program loads per step (one slab). 8 KB is 64 B (four 16-byte vector loads) per
# thread at 128 threads, about 30 registers: up to 16 programs fit on an SM, and even the ~8 per
# SM of a _MAX_PROGRAMS grid keep ~64 KB of loads in flight per SM, three times the ~20 KB that
# covers the DRAM round trip at full bandwidth on H100/H200 (Little's law; a single slab per
# program would need 3+ programs per SM). A tile larger than this is one slab of its own.
_SLAB_BYTES = 8 * 1024
# Grid size bounds. At least _MIN_PROGRAMS programs when the copy count allows (about two per SM
# of a 108-132 SM GPU, so no SM idles on a one-block copy): slabs shrink to get there. At most
# about _MAX_PROGRAMS when it is large: programs then take several steps instead of the grid
# growing to tens of thousands of programs that each move one slab. _MAX_PROGRAMS fits in one
# wave of resident programs on A100 and H100/H200 up to 48 registers (10 programs of 128
# threads per SM: 1,080 on an A100), so no tail wave runs a few long programs on a mostly idle
# GPU; only tiles above the slab budget (fp32 32 x 256: 72-80 registers) take a second wave.
_MIN_PROGRAMS = 256
_MAX_PROGRAMS = 1024


def _pow2_divisor(n: int, cap: int) -> int:
  """The largest power of two that divides ``n`` and is at most ``cap`` (at least 1)."""
  d = 1
  while d * 2 <= cap and n % (d * 2) == 0:
    d *= 2
  return d


def copy_plan(num_copies: int, rows: int, block_size: int, head_dim: int, itemsize: int) -> tuple[int, int]:
  """``(slab_rows, head_rows)`` of a copy of ``num_copies`` blocks of ``rows`` tiles of
  ``[block_size, head_dim]`` elements of ``itemsize`` bytes: a program copies ``head_rows`` rows
  in ``head_rows // slab_rows`` steps of ``slab_rows`` rows. Both are powers of two (Triton's
  block shapes) that divide ``rows``; static (the copy list's padded size is)."""
  tile = block_size * head_dim * itemsize
  slab_rows = _pow2_divisor(rows, max(1, _SLAB_BYTES // tile))
  # Few copies: smaller slabs, so the grid still has about two programs per SM or more.
  while slab_rows > 1 and num_copies * (rows // slab_rows) < _MIN_PROGRAMS:
    slab_rows //= 2
  slabs = num_copies * (rows // slab_rows)
  steps = _pow2_divisor(rows // slab_rows, max(1, slabs // _MAX_PROGRAMS))
  return slab_rows, slab_rows * steps


def resolve_plan(num_copies: int, rows: int, block_size: int, head_dim: int, itemsize: int,
                 head_rows: int | None = None, slab_rows: int | None = None) -> tuple[int, int]:
  """``(slab_rows, head_rows)`` the kernel runs with: :func:`copy_plan`'s when neither is given;
  ``head_rows`` alone keeps one tile per step (``slab_rows = 1``, the kernel before slab loads);
  ``slab_rows`` alone is one step per program (``head_rows = slab_rows``).

  Raises:
    ValueError: unless ``slab_rows`` divides ``head_rows`` and ``head_rows`` divides ``rows``.
  """
  if head_rows is None and slab_rows is None:
    slab_rows, head_rows = copy_plan(num_copies, rows, block_size, head_dim, itemsize)
  elif slab_rows is None:
    slab_rows = 1
  elif head_rows is None:
    head_rows = slab_rows
  if rows % head_rows or head_rows % slab_rows:
    raise ValueError(f"slab_rows={slab_rows} must divide head_rows={head_rows}, which must divide "
                     f"num_layers * 2 * num_kv_heads = {rows}")
  return slab_rows, head_rows


def _copy_kernel(src_ref, dst_ref, *refs, head_rows: int, slab_rows: int):
  """``refs``: the input arrays, then their outputs, aliased one to one: ``(pages, out)``, or for
  quantized pages ``(values, scales, out_values, out_scales)``. Reads and writes go through the
  outputs."""
  outs = refs[len(refs) // 2:]
  src = src_ref[0]
  dst = dst_ref[0]

  @pl.when(src != dst)  # Padding (0, 0) and self-copies move nothing.
  def _copy():
    def step(j, carry):
      rows = pl.ds(pl.multiple_of(j * slab_rows, slab_rows), slab_rows)
      # One slab load (all its tiles in flight together), then its store. The next step's load
      # waits for this store to issue (one aliased buffer: the compiler cannot tell the rows
      # apart), so steps are serial round trips: copy_plan keeps them few when copies are few.
      # Quantized pages move the slab's [slab_rows, bs] scales beside its values.
      for out in outs:
        out[rows, dst] = out[rows, src]
      return carry
    lax.fori_loop(0, head_rows // slab_rows, step, 0)


@functools.partial(jax.jit, static_argnames=("interpret", "head_rows", "slab_rows", "num_warps"))
def copy_blocks_pallas(pages: PagesLike, src: jax.Array, dst: jax.Array, *, interpret: bool = False,
                       head_rows: int | None = None, slab_rows: int | None = None,
                       num_warps: int = 4) -> PagesLike:
  """Pallas block copy; arguments as :func:`paged_kv.pallas_kernels.copy_blocks`.

  ``head_rows`` (rows per program) and ``slab_rows`` (rows per step): as :func:`resolve_plan`
  (default :func:`copy_plan`'s choice); on a GPU both must be powers of two (Triton's block
  shapes)."""
  num_layers, _, num_kv_heads, num_blocks, block_size, head_dim = pages.shape
  rows = num_layers * 2 * num_kv_heads
  num_copies = src.shape[0]
  slab_rows, head_rows = resolve_plan(num_copies, rows, block_size, head_dim, pages.dtype.itemsize,
                                      head_rows, slab_rows)
  src = sanitize_block_tables(src, num_blocks).reshape(num_copies, 1)
  dst = sanitize_block_tables(dst, num_blocks).reshape(num_copies, 1)
  if quant.is_quant(pages):
    flat = pages.values.reshape(rows, num_blocks, block_size, head_dim)
    flat_scales = pages.scales.reshape(rows, num_blocks, block_size)
    spec = pl.BlockSpec((head_rows, num_blocks, block_size, head_dim), lambda i, g: (g, 0, 0, 0))
    scale_spec = pl.BlockSpec((head_rows, num_blocks, block_size), lambda i, g: (g, 0, 0))
    id_spec = pl.BlockSpec((None, 1), lambda i, g: (i, 0))
    values, scales = pl.pallas_call(
        functools.partial(_copy_kernel, head_rows=head_rows, slab_rows=slab_rows),
        grid=(num_copies, rows // head_rows),
        in_specs=[id_spec, id_spec, spec, scale_spec],
        out_specs=[spec, scale_spec],
        out_shape=[jax.ShapeDtypeStruct(flat.shape, flat.dtype),
                   jax.ShapeDtypeStruct(flat_scales.shape, flat_scales.dtype)],
        input_output_aliases={2: 0, 3: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="copy_blocks_quant",
    )(src, dst, flat, flat_scales)
    return quant.QuantPages(values=values.reshape(pages.shape), scales=scales.reshape(pages.scales.shape))
  flat = pages.reshape(rows, num_blocks, block_size, head_dim)
  spec = pl.BlockSpec((head_rows, num_blocks, block_size, head_dim), lambda i, g: (g, 0, 0, 0))
  out = pl.pallas_call(
      functools.partial(_copy_kernel, head_rows=head_rows, slab_rows=slab_rows),
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
