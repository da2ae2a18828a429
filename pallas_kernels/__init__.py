"""Paged-attention kernels for a paged KV cache: Pallas (Triton) on GPU, XLA references elsewhere.

KV page layout: one preallocated array per model,

    pages: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]
            (axis 1: 0 = K, 1 = V)

* For a fixed (layer, K|V, kv_head), a block is one contiguous ``[block_size, head_dim]`` tile,
  so the decode and prefill kernels read K and V through the block table as coalesced tiles,
  one KV head per program, all query heads of that KV head (GQA) together.
* Block ``b`` of every layer, K/V and head sits at the same index on axis 3, so a block copy
  (copy-on-write) is one strided copy over the leading axes, all layers in one launch.
* The KV-head axis is outside the block axis, so the cache can later be sharded over KV heads
  (tensor parallelism) without touching block ids.

Block 0 is the reserved null block: padding writes go there and unused block-table entries hold
0. Slot index = ``block_id * block_size + offset``. Out-of-range block ids and slots are clamped
to the null block, so a bad index never reads or writes another sequence's memory.

Public API (``__all__``; the kernels' full docs are in :mod:`paged_kv.pallas_kernels.dispatch`):

* :func:`paged_decode_attention` ``(q, pages, layer, block_tables, lengths, *, scale, impl, soft_cap,
  alibi_slopes, batch_invariant, window)``
* :func:`paged_prefill_attention` ``(q, pages, layer, block_tables, q_start, q_lens, *, scale, impl,
  soft_cap, alibi_slopes, batch_invariant, window)``
* :func:`write_kv` ``(pages, layer, k, v, slots, *, impl)``
* :func:`copy_blocks` ``(pages, src, dst, *, impl)``
* :func:`layer_matmul` ``(x, w, layer, *, scale, bias, impl, batch_invariant)``: one layer's
  projection read out of a stacked ``[L, K, N]`` weight in place (the scan over layers on a GPU)
* :func:`resolve_impl` ``(impl, head_dim=None)``: the implementation "auto" runs here
* ``IMPLS``: the accepted ``impl`` values; ``NULL_BLOCK``: the reserved block id 0
* :class:`QuantPages`, ``KV_DTYPES``, :func:`quantize`, :func:`dequantize`, :func:`check_kv_dtype`:
  quantized pages (below)

``impl`` is "auto" (Pallas on GPU, XLA reference elsewhere), "pallas", "interpret" (Pallas with
``interpret=True``, used in tests) or "reference". The attention knobs (``soft_cap``,
``alibi_slopes``, ``window``) and ``batch_invariant`` (the fixed-tile kernels: a query's bits do
not depend on the batch; :mod:`paged_kv.pallas_kernels.invariant`) are off by default, and a
kernel compiles exactly as without them when they are. ``window`` is the attention kind
(``paged_kv.attention_spec``: a sliding window ``W``, a local chunk ``ChunkedLocal(C)`` as its
code ``-C``, or the spec itself; traced per layer, 0 is full attention).

Quantized pages (:mod:`paged_kv.pallas_kernels.quant`): the attention, ``write_kv`` and
``copy_blocks`` entry points also take a :class:`~paged_kv.pallas_kernels.quant.QuantPages`: ``values`` int8 or
float8_e4m3fn (stored as uint8 bit patterns) in the layout above and ``scales`` float32
``[num_layers, 2, num_kv_heads, num_blocks, block_size]``, one per token, per KV head, for K and for
V (symmetric: ``scale = max|x| / qmax``, qmax 127 or 448; a zero row has scale 0 and reads back as
0). ``write_kv`` quantizes as it writes, ``copy_blocks`` copies the scales with the blocks, and
attention converts each tile to the query's dtype for the dot and applies the scales to the logits
(K) and the probabilities (V), never dequantizing a tile in memory. float8_e4m3fn is refused on a
GPU below compute capability 8.9 (:func:`~paged_kv.pallas_kernels.quant.check_kv_dtype`).
"""

from paged_kv.pallas_kernels.dispatch import (
    copy_blocks,
    layer_matmul,
    paged_decode_attention,
    paged_prefill_attention,
    resolve_impl,
    write_kv,
)
from paged_kv.pallas_kernels.quant import KV_DTYPES, QuantPages, check_kv_dtype, dequantize, quantize
from paged_kv.pallas_kernels.reference import NULL_BLOCK
from paged_kv.pallas_kernels.validate import IMPLS

__all__ = [
    "IMPLS",
    "KV_DTYPES",
    "NULL_BLOCK",
    "QuantPages",
    "check_kv_dtype",
    "copy_blocks",
    "dequantize",
    "layer_matmul",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize",
    "resolve_impl",
    "write_kv",
]
