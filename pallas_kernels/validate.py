"""Shape, dtype and argument checks for the public kernel entry points.

Every public function in :mod:`pallas_kernels` calls one of the ``check_*`` functions below
before anything is traced, so a mismatch raises a ``ValueError`` that names the offending
value, its shape or dtype, and the limit it breaks, instead of a Triton or XLA error deep inside
a lowering. The checks only look at static metadata (``.shape``, ``.dtype``, Python ints), so
they work on concrete arrays, tracers and ``jax.ShapeDtypeStruct`` alike. The one exception is
:func:`check_copy_lists`: where a copy list is concrete (a NumPy or Python sequence, or a
committed ``jax.Array``, not a tracer), its values are read and checked against the copy
contract, since the Pallas kernel and the reference disagree on lists that break it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.attention_spec import AttentionSpec
from paged_kv.pallas_kernels import plan as execution_plan, quant, tiling

# Defined with the execution plan (which sits below this module); the other layers import them from here.
from paged_kv.pallas_kernels.plan import IMPLS, check_impl, is_int  # noqa: F401 (IMPLS: re-exported)
from paged_kv.pallas_kernels.reference import NULL_BLOCK

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_INT32 = jnp.dtype(jnp.int32)
PAGES_LAYOUT = "[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]"


def is_power_of_two(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def check_pages(pages: Any) -> tuple[int, int, int, int, int]:
  """Returns (num_layers, num_kv_heads, num_blocks, block_size, head_dim).

  ``pages``: a plain float page array, or :class:`paged_kv.pallas_kernels.quant.QuantPages` whose
  ``values`` (int8, or uint8 holding float8_e4m3fn bits) have the same layout and whose ``scales`` are float32 of the
  values' shape without head_dim."""
  if quant.is_quant(pages):
    return _check_quant_pages(pages)
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


def _check_quant_pages(pages: quant.QuantPages) -> tuple[int, int, int, int, int]:
  """:func:`check_pages` for :class:`paged_kv.pallas_kernels.quant.QuantPages`."""
  values, scales = pages.values, pages.scales
  stored = [quant.storage_dtype(d) for d in quant.KV_DTYPES]
  if jnp.dtype(values.dtype) not in stored:
    hint = " (float8_e4m3fn values are stored as their uint8 bits: quant.as_bits)" \
        if jnp.dtype(values.dtype) == jnp.dtype(jnp.float8_e4m3fn) else ""
    raise ValueError(f"QuantPages values dtype must be one of {[str(d) for d in stored]}, got {values.dtype}{hint}")
  if not hasattr(scales, "shape") or jnp.dtype(scales.dtype) != jnp.dtype(jnp.float32):
    raise ValueError(f"QuantPages scales must be float32, got {getattr(scales, 'dtype', type(scales).__name__)}")
  dims = check_pages(jax.ShapeDtypeStruct(tuple(np.shape(values)), jnp.float32))
  if tuple(np.shape(scales)) != tuple(np.shape(values))[:-1]:
    raise ValueError(f"QuantPages scales must have shape [num_layers, 2, num_kv_heads, num_blocks, block_size] = "
                     f"{tuple(np.shape(values))[:-1]} (values' shape without head_dim), got {tuple(np.shape(scales))}")
  return dims


def compute_dtype(pages: Any, q: Any) -> jnp.dtype:
  """The dtype attention computes in: the pages' dtype for plain pages, q's for quantized ones (the
  kernels convert each int8/e4m3 tile to it for the dot)."""
  return jnp.dtype(q.dtype if quant.is_quant(pages) else pages.dtype)


def check_kv_options(kv_dtype: Any, impl: str | None, batch_invariant: bool = False) -> None:
  """What quantized pages support, checked before anything is traced: the kernels' entry points
  call it on their pages, the engines and ``ServingConfig`` on the KV dtype they will allocate.
  A float ``kv_dtype`` (plain pages) passes.

  Args:
    kv_dtype: the pages' dtype (``QuantPages.dtype`` for quantized pages).
    impl: the kernel implementation; on the Pallas paths that compile for a GPU (``"pallas"``,
      ``"auto"``) a dtype the target cannot compute is refused
      (:func:`paged_kv.pallas_kernels.quant.check_kv_dtype`: float8_e4m3fn below compute
      capability 8.9); interpret mode, the reference and None (no target yet) skip it.
    batch_invariant: quantized pages with the fixed-tile batch-invariant kernels are refused
      (those kernels have no scale operands).

  Raises:
    ValueError: one line naming the KV dtype and ``batch_invariant``, or the dtype and the target.
  """
  # The refusals are rows of the execution plan's table (pallas_kernels/plan.py); interpret mode
  # stands in for "no target yet", which compiles nothing for a GPU.
  execution_plan.make_plan(impl or "interpret", batch_invariant=batch_invariant, kv_dtype=kv_dtype)


def check_layer(layer: Any, num_layers: int) -> int | jax.Array:
  """The layer id, for every ``impl``: a static Python int in ``[0, num_layers)`` (returned as
  int), or an integer scalar ``jax.Array`` (e.g. traced inside a scan over layers; returned as
  int32). The Pallas kernels take the layer as an int32 operand, not as a compiled-in block
  index (:func:`paged_kv.pallas_kernels.decode_attention.layer_operand`), so both kinds reach them.

  A traced id cannot be range-checked here. It must lie in ``[0, num_layers)`` (a scan over
  layers guarantees it); outside that range the Pallas kernels clamp it to the nearest layer
  (never memory outside the pages) and the XLA reference takes it as given (XLA's gather clamps,
  its scatter drops the write)."""
  if isinstance(layer, jax.Array):
    if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
      raise ValueError(f"layer must be an integer scalar, got {layer.dtype} shape {layer.shape}")
    return layer.astype(jnp.int32)
  if not is_int(layer):
    raise ValueError(f"layer must be a static Python int or an integer scalar array, got "
                     f"{type(layer).__name__} {layer!r}")
  if not 0 <= int(layer) < num_layers:
    raise ValueError(f"layer={layer} out of range [0, {num_layers}) for pages with {num_layers} layers")
  return int(layer)


def check_scale(scale: Any, head_dim: int) -> float:
  if scale is None:
    return float(head_dim) ** -0.5
  if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
    raise ValueError(f"scale must be a Python float or None, got {type(scale).__name__} {scale!r}")
  return float(scale)


def check_soft_cap(soft_cap: Any) -> float | None:
  """None (no capping) or a finite Python float > 0 (static: it is compiled into the kernel)."""
  if soft_cap is None:
    return None
  if isinstance(soft_cap, (bool, np.bool_)) or not isinstance(
      soft_cap, (int, float, np.integer, np.floating)):
    raise ValueError(f"soft_cap must be a Python float > 0 or None, got {type(soft_cap).__name__} "
                     f"{soft_cap!r}")
  if not np.isfinite(soft_cap) or soft_cap <= 0:
    raise ValueError(f"soft_cap={soft_cap!r} must be a finite float > 0")
  return float(soft_cap)


def check_window(window: Any) -> int | jax.Array | None:
  """The attention kind of a call, as the kernels take it (an ``AttentionSpec.code``).

  None: full causal attention. A static Python int: ``W >= 1`` a sliding window (a query at
  ``p`` sees key ``k`` iff ``p - W < k <= p``), ``-C <= -1`` a chunk's code (keys of ``p``'s
  chunk of ``C`` up to ``p``). An ``AttentionSpec`` (``paged_kv.attention_spec``): ``Full()``
  is None, ``SlidingWindow(W)`` is ``W``, ``ChunkedLocal(C)`` is ``-C``. An integer scalar array
  (a per-layer code traced in a scan over layers; returned as int32): ``W > 0``, ``-C < 0`` or
  0 for full attention, so one scan serves every kind. Arrays are never read here (they may be
  tracers)."""
  if window is None:
    return None
  if isinstance(window, AttentionSpec):
    return None if window.is_full else window.code
  if isinstance(window, (jax.Array, np.ndarray)):
    if window.shape != () or not jnp.issubdtype(window.dtype, jnp.integer):
      raise ValueError(f"window must be an integer scalar, got {window.dtype} shape {window.shape}")
    return jnp.asarray(window, jnp.int32)
  if not is_int(window):
    raise ValueError(f"window must be None, an AttentionSpec, a Python int != 0 or an integer scalar array, "
                     f"got {type(window).__name__} {window!r}")
  if int(window) == 0:
    raise ValueError("window=0 must be >= 1 (a window) or <= -1 (a chunk's code, ChunkedLocal(C).code); None "
                     "is full attention (a traced code 0 also is)")
  return int(window)


def check_alibi_slopes(alibi_slopes: Any, num_q_heads: int) -> Any:
  """None, or a float ``[num_q_heads]`` array of ALiBi slopes (one per query head)."""
  if alibi_slopes is None:
    return None
  shape = tuple(np.shape(alibi_slopes))
  if shape != (num_q_heads,):
    raise ValueError(f"alibi_slopes must have shape [num_q_heads] = ({num_q_heads},), got {shape}")
  dtype = jnp.dtype(alibi_slopes.dtype if hasattr(alibi_slopes, "dtype")
                    else np.asarray(alibi_slopes).dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"alibi_slopes must be a float array, got dtype {dtype}")
  return alibi_slopes


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


def _kind_of(window: Any) -> str:
  """The plan's name for a call's kind (``check_window``'s input): a traced per-layer code is
  planned as a window (the layer layout's plan names the kinds it holds)."""
  if window is None:
    return "full"
  if isinstance(window, AttentionSpec):
    return window.kind
  return "chunked" if is_int(window) and int(window) < 0 else "window"


def _plan(impl: str, pages: Any, batch_invariant: bool = False, window: Any = None) -> execution_plan.ExecutionPlan:
  """The execution plan of a kernel call on ``pages`` (its refusals: a head_dim the Pallas kernels
  cannot take, quantized pages with ``batch_invariant``, float8_e4m3fn below sm_89, the invariant
  reference's block sizes; :mod:`paged_kv.pallas_kernels.plan`)."""
  *_, block_size, head_dim = pages.shape
  return execution_plan.make_plan(impl, batch_invariant=batch_invariant, kv_dtype=pages.dtype,
                                  kinds=(_kind_of(window),), head_dim=head_dim,
                                  block_size=block_size)


def _check_tiling(kernel: str, plan: execution_plan.ExecutionPlan, dtype, head_dim: int, block_size: int,
                  group: int, knobs: tiling.Knobs = tiling.NO_KNOBS):
  """Refuses an attention configuration no checked tile serves (see
  :mod:`paged_kv.pallas_kernels.tiling`; the knobs may select a smaller row) where the plan runs
  the Pallas kernels."""
  if plan.pallas:
    tiling.check_attention_fits(kernel, dtype, head_dim, block_size, group, knobs)


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
  if quant.is_quant(pages):
    if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
      raise ValueError(f"q dtype must be one of float32/bfloat16/float16 with {pages.dtype} pages, got {q.dtype}")
  elif jnp.dtype(q.dtype) != jnp.dtype(pages.dtype):
    raise ValueError(f"q dtype {q.dtype} must equal pages dtype {pages.dtype}")
  return shape


def check_decode(q: Any, pages: Any, layer: Any, block_tables: Any, lengths: Any, scale: Any, impl: Any,
                 soft_cap: Any = None, alibi_slopes: Any = None,
                 window: Any = None, batch_invariant: bool = False
                 ) -> tuple[int | jax.Array, float, execution_plan.ExecutionPlan, float | None]:
  """Checks :func:`paged_kv.pallas_kernels.paged_decode_attention`'s arguments; returns ``(layer,
  scale, plan, soft_cap)``, ``plan`` the call's :class:`paged_kv.pallas_kernels.plan.ExecutionPlan`."""
  impl = check_impl(impl)
  num_layers, num_kv_heads, num_blocks, block_size, head_dim = check_pages(pages)
  layer = check_layer(layer, num_layers)
  b, num_q_heads, _ = _check_query(q, 3, pages, num_kv_heads, head_dim, "[batch, num_q_heads, head_dim]")
  bt_shape = _check_int32("block_tables", block_tables, ndim=2)
  if bt_shape[0] != b:
    raise ValueError(f"block_tables batch {bt_shape[0]} does not match q batch {b}")
  if bt_shape[1] < 1:
    raise ValueError(f"block_tables must have at least one column, got shape {bt_shape}")
  _check_int32("lengths", lengths, shape=(b,))
  plan = _plan(impl, pages, batch_invariant, window)
  check_alibi_slopes(alibi_slopes, np.shape(q)[-2])
  soft_cap = check_soft_cap(soft_cap)
  _check_tiling("decode", plan, compute_dtype(pages, q), head_dim, block_size, num_q_heads // num_kv_heads,
                tiling.Knobs.of(soft_cap, alibi_slopes, check_window(window)))
  return layer, check_scale(scale, head_dim), plan, soft_cap


def check_prefill(q: Any, pages: Any, layer: Any, block_tables: Any, q_start: Any, q_lens: Any, scale: Any, impl: Any,
                  soft_cap: Any = None, alibi_slopes: Any = None,
                 window: Any = None, batch_invariant: bool = False
                 ) -> tuple[int | jax.Array, float, execution_plan.ExecutionPlan, float | None]:
  """:func:`check_decode` for :func:`paged_kv.pallas_kernels.paged_prefill_attention`."""
  impl = check_impl(impl)
  num_layers, num_kv_heads, num_blocks, block_size, head_dim = check_pages(pages)
  layer = check_layer(layer, num_layers)
  b, t, num_q_heads, _ = _check_query(q, 4, pages, num_kv_heads, head_dim,
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
  plan = _plan(impl, pages, batch_invariant, window)
  check_alibi_slopes(alibi_slopes, np.shape(q)[-2])
  soft_cap = check_soft_cap(soft_cap)
  _check_tiling("prefill", plan, compute_dtype(pages, q), head_dim, block_size, num_q_heads // num_kv_heads,
                tiling.Knobs.of(soft_cap, alibi_slopes, check_window(window)))
  return layer, check_scale(scale, head_dim), plan, soft_cap


def check_write_kv(pages: Any, layer: Any, k: Any, v: Any, slots: Any, impl: Any
                   ) -> tuple[int | jax.Array, execution_plan.ExecutionPlan]:
  """Checks :func:`paged_kv.pallas_kernels.write_kv`'s arguments; returns ``(layer, plan)``."""
  impl = check_impl(impl)
  num_layers, num_kv_heads, _, _, head_dim = check_pages(pages)
  layer = check_layer(layer, num_layers)
  n = _check_int32("slots", slots, ndim=1)[0]
  want = (n, num_kv_heads, head_dim)
  for name, x in (("k", k), ("v", v)):
    if tuple(np.shape(x)) != want:
      raise ValueError(f"{name} must have shape [N, num_kv_heads, head_dim] = {want} "
                       f"(N from slots), got {tuple(np.shape(x))}")
    if quant.is_quant(pages):
      if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"{name} dtype must be one of float32/bfloat16/float16 with {pages.dtype} pages "
                         f"(quantized as written), got {x.dtype}")
    elif jnp.dtype(x.dtype) != jnp.dtype(pages.dtype):
      raise ValueError(f"{name} dtype {x.dtype} must equal pages dtype {pages.dtype}")
  if jnp.dtype(k.dtype) != jnp.dtype(v.dtype):
    raise ValueError(f"k dtype {k.dtype} must equal v dtype {v.dtype}")
  return layer, _plan(impl, pages)


def check_copy_blocks(pages: Any, src: Any, dst: Any, impl: Any) -> execution_plan.ExecutionPlan:
  """Checks :func:`paged_kv.pallas_kernels.copy_blocks`'s arguments; returns the call's plan."""
  impl = check_impl(impl)
  _, _, num_blocks, _, head_dim = check_pages(pages)
  c = _check_int32("src", src, ndim=1)
  _check_int32("dst", dst, shape=c)
  plan = _plan(impl, pages)
  check_copy_lists(src, dst, num_blocks)
  return plan


def _concrete_values(x: Any) -> np.ndarray | None:
  """The values of ``x`` as NumPy, or None when they are not known on the host without
  computation (a tracer under ``jit``/``shard_map``, a ``ShapeDtypeStruct``, an array spread
  over several processes)."""
  if isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct)):
    return None
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return None
  return np.asarray(x)


def check_copy_lists(src: Any, dst: Any, num_blocks: int) -> None:
  """Enforces the copy contract of :func:`paged_kv.pallas_kernels.copy_blocks` on concrete lists.

  Ids are first clamped as the kernels clamp them (outside ``[0, num_blocks)`` -> the null
  block 0). Padding entries ``(0, 0)`` are allowed in any number. Among the other ("real")
  entries:

  * destinations must be distinct (the kernel's programs run in no particular order, and the
    reference's scatter keeps an unspecified one of the duplicates);
  * no destination may also be the source of a real entry (a chain ``2 -> 3, 3 -> 4`` or a swap
    ``2 -> 3, 3 -> 2``: the reference reads every source before writing, the kernel may read a
    block another program already overwrote). This includes the null block: ``6 -> 0`` (a
    destination clamped to 0) with ``0 -> 2``.

  Sources may repeat (one shared block copied for several sequences). After a copy into the
  null block its contents are unspecified, as always (it never holds data).

  Raises ``ValueError`` naming the block ids and the list positions. Traced lists (under
  ``jit``) cannot be checked here: there the caller guarantees the contract, as the block
  manager's ``append`` does (each copy goes from a block shared by several sequences to a block
  it has just taken from the free queue, so no destination is a source or another destination).
  """
  s, d = _concrete_values(src), _concrete_values(dst)
  if s is None or d is None:
    return
  s = np.where((s >= 0) & (s < num_blocks), s, NULL_BLOCK)
  d = np.where((d >= 0) & (d < num_blocks), d, NULL_BLOCK)
  real = np.flatnonzero((s != NULL_BLOCK) | (d != NULL_BLOCK))
  dst_at: dict[int, int] = {}
  for i in real:
    block = int(d[i])
    if block in dst_at:
      raise ValueError(
          f"copy_blocks: block {block} is the destination at positions {dst_at[block]} and {i}; "
          "real destinations must be distinct (padding entries are (0, 0))")
    dst_at[block] = int(i)
  for i in real:
    block = int(s[i])
    if block in dst_at:
      raise ValueError(
          f"copy_blocks: block {block} is the source at position {i} and the destination at "
          f"position {dst_at[block]}; a destination must not also be a source in the same call "
          "(a chain or a swap needs two calls)")


def check_layer_matmul(x: Any, w: Any, layer: Any, scale: Any, bias: Any, impl: Any) -> tuple[int | jax.Array, str]:
  """Checks :func:`paged_kv.pallas_kernels.layer_matmul`'s arguments; returns ``(layer, impl)``.

  x ``[M, K]`` and w ``[L, K, N]`` of one float dtype; scale ``[L, K]`` and bias ``[L, N]`` of
  that dtype when given; for the Pallas impls K and N multiples of 16 (Triton's smallest dot).
  A group: w a non-empty tuple of ``[L, K, N_i]`` (one ``L`` and ``K``), bias None or a tuple of
  as many entries, each ``[L, N_i]`` or None."""
  impl = check_impl(impl)
  grouped = isinstance(w, (tuple, list))
  ws = tuple(w) if grouped else (w,)
  if not ws:
    raise ValueError("a layer_matmul group needs at least one weight")
  if bias is None:
    biases = (None,) * len(ws)
  elif grouped != isinstance(bias, (tuple, list)) or (grouped and len(bias) != len(ws)):
    raise ValueError(f"bias must be {'a tuple of one entry per weight' if grouped else 'an array'} or None, "
                     f"got {type(bias).__name__}{f' of {len(bias)}' if isinstance(bias, (tuple, list)) else ''}")
  else:
    biases = tuple(bias) if grouped else (bias,)
  if getattr(x, "ndim", None) != 2:
    raise ValueError(f"x must have 2 dimensions, got shape {getattr(x, 'shape', None)}")
  for wi in ws:
    if getattr(wi, "ndim", None) != 3:
      raise ValueError(f"w must have 3 dimensions, got shape {getattr(wi, 'shape', None)}")
  if jnp.dtype(x.dtype) not in FLOAT_DTYPES or any(wi.dtype != x.dtype for wi in ws):
    raise ValueError(f"x and w must share a float dtype of {[str(d) for d in FLOAT_DTYPES]}, got "
                     f"{x.dtype} and {', '.join(str(wi.dtype) for wi in ws)}")
  num_layers, k, _ = ws[0].shape
  if any(wi.shape[:2] != (num_layers, k) for wi in ws):
    raise ValueError(f"a group's weights must share L and K, got {[tuple(wi.shape) for wi in ws]}")
  if x.shape[1] != k:
    raise ValueError(f"x's K={x.shape[1]} must equal w's K={k} (w shape {ws[0].shape})")
  checks = [("scale", scale, (num_layers, k))] + [("bias", b, (num_layers, wi.shape[2])) for wi, b in zip(ws, biases)]
  for name, a, want in checks:
    if a is not None and (tuple(a.shape) != want or a.dtype != x.dtype):
      raise ValueError(f"{name} must be {x.dtype}{list(want)}, got {a.dtype}{list(a.shape)}")
  for wi in ws:
    n = wi.shape[2]
    if impl in ("pallas", "interpret") and (k % 16 or n % 16):
      raise ValueError(f"the Pallas layer_matmul needs K and N multiples of 16, got K={k}, N={n}")
  return check_layer(layer, num_layers), impl
