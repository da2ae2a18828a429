"""What the paged decode attention kernel must do at one shape, for the performance model.

:func:`decode_work` turns a decode call's shape into :class:`scripts.gate.perf_model.Work` with the
kernel's own static tiling and partition (``paged_kv.pallas_kernels.decode_attention.decode_partition``:
the tiling table's row and the split rule, plain Python run at trace time), so
the estimate follows the tiles and splits the kernel really launches. Every sequence is taken at
full context (the busiest split walks ``tiles_per_split`` tiles).

* ``bytes`` (the roofline's): every cached K and V element once, the queries and the output;
  with a sliding ``window``, only the K and V of the window's ``min(window, context)`` positions
  (the kernel skips the tiles before it).
* ``extra_bytes``: the split partials (float32 ``o`` and ``lse`` of the real query rows),
  written by the kernel and read back by the merge; 0 when there is one split (the kernel then
  writes the output itself and there is no merge).
* ``step_bytes``: one K and one V tile; ``steps``: the busiest split's tiles; ``step_flops``: the
  two dots of one step at their padded shapes (``rows x keys x head_dim`` each).
* quantized pages (``kv_dtype`` "int8" or "float8_e4m3fn"): a cached position costs
  ``head_dim`` bytes plus a float32 scale, for K and for V, in ``bytes`` and in each tile.
"""

from __future__ import annotations

from scripts.gate import perf_model


def decode_launch(batch: int, context: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  block_size: int, dtype: str = "bfloat16", **overrides):
  """The kernel's own :class:`~paged_kv.pallas_kernels.decode_attention.Partition` for this
  shape (``dtype`` a name; ``overrides``: ``blocks_per_tile``, ``num_splits``, ``num_warps``,
  ``num_stages`` as the kernel takes them, and ``window``, a static sliding window, which the
  split rule sizes the launch for); its grid is ``batch x num_kv_heads x num_splits`` CTAs
  (:func:`ctas`)."""
  from paged_kv.pallas_kernels import decode_attention

  max_blocks = perf_model.ceil_div(context, block_size)
  p = decode_attention.decode_partition(batch, num_q_heads, num_kv_heads, head_dim, block_size, max_blocks,
                                        dtype, **overrides)
  return p


def ctas(batch: int, num_kv_heads: int, launch) -> int:
  """CTAs of a decode launch: one per (sequence, KV head, split)."""
  return batch * num_kv_heads * launch.num_splits


_DTYPES = {2: "bfloat16", 4: "float32"}
_KV_ITEMSIZE = {"int8": 1, "float8_e4m3fn": 1}


def decode_work(batch: int, context: int, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                itemsize: int, launch=None, window: int | None = None, kv_dtype: str | None = None,
                **overrides) -> perf_model.Work:
  """The model's :class:`~scripts.gate.perf_model.Work` of one decode call (every sequence at
  ``context`` tokens; ``itemsize`` 2 for bfloat16/float16, 4 for float32). ``launch``: the
  launch to describe (default :func:`decode_launch` of this shape, with ``overrides``: a
  variant's ``num_splits`` etc., as the kernel takes them). ``window``: a static sliding window
  (an int): each sequence attends to its last ``min(window, context)`` positions, and the
  busiest split walks its share of the window's tiles. ``kv_dtype``: quantized pages ("int8",
  "float8_e4m3fn"; ``itemsize`` stays the compute dtype's, for q and the output)."""
  if kv_dtype is not None:
    overrides["kv_dtype"] = kv_dtype
  if launch is None:
    launch = decode_launch(batch, context, num_q_heads, num_kv_heads, head_dim, block_size, _DTYPES[itemsize],
                           window=window, **overrides)
  group = num_q_heads // num_kv_heads
  tile_keys = launch.blocks_per_tile * block_size
  context = context if window is None else min(window, context)  # the positions each query sees
  # One cached position of one KV head, K or V: head_dim elements, plus a float32 scale when quantized.
  row_bytes = head_dim * itemsize if kv_dtype is None else head_dim * _KV_ITEMSIZE[kv_dtype] + 4
  kv = batch * context * num_kv_heads * 2 * row_bytes
  q_and_out = 2 * batch * num_q_heads * head_dim * itemsize
  extra = 0
  if launch.num_splits > 1:
    # o and lse [B, Hkv, S, G, D] in float32, written once and read once.
    partial = 2 * batch * num_kv_heads * launch.num_splits * group * head_dim * 4
    extra = 2 * partial
  return perf_model.Work(
      bytes=kv + q_and_out,
      flops=2 * 2 * batch * num_q_heads * context * head_dim,
      step_bytes=2 * tile_keys * row_bytes,
      steps=launch.tiles_per_split,
      step_flops=2 * 2 * launch.rows * tile_keys * head_dim,
      extra_bytes=extra)
