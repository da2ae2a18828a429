"""Public entry points: validate, then dispatch to the Pallas kernel or the XLA reference.

``impl`` chooses the implementation:

* ``"auto"``: the Pallas (Triton) kernel when JAX's default backend is a GPU, else the XLA
  reference (fast enough for real runs on a CPU).
* ``"pallas"``: the Pallas kernel compiled for the GPU through Triton.
* ``"interpret"``: the same Pallas kernel with ``interpret=True`` (runs anywhere; tests).
* ``"reference"``: the pure-``jnp`` reference in :mod:`paged_kv.pallas_kernels.reference`.

All checks in :mod:`paged_kv.pallas_kernels.validate` run before anything is traced, so bad shapes
and dtypes raise ``ValueError`` naming the value and the limit. Which implementation and kernel
family a call runs is its :class:`paged_kv.pallas_kernels.plan.ExecutionPlan` (the checks return
it), so every choice and refusal is a row of that module's table.
"""

from __future__ import annotations

import jax

from paged_kv.attention_spec import AttentionSpec
from paged_kv.pallas_kernels import plan as execution_plan, reference, validate
from paged_kv.pallas_kernels.reference import PagesLike


def resolve_impl(impl: str, head_dim: int | None = None) -> str:
  """Maps "auto" to "pallas" on a GPU backend and to "reference" elsewhere (or when
  ``head_dim`` is not a power of two >= 16, which the Triton kernels need): the execution plan's
  rows (:func:`paged_kv.pallas_kernels.plan.resolve_impl`)."""
  return execution_plan.resolve_impl(impl, head_dim)


def paged_decode_attention(q: jax.Array, pages: PagesLike, layer: int | jax.Array, block_tables: jax.Array,
                           lengths: jax.Array, *, scale: float | None = None, impl: str = "auto",
                           soft_cap: float | None = None, alibi_slopes: jax.Array | None = None,
                           batch_invariant: bool = False,
                           window: int | AttentionSpec | jax.Array | None = None) -> jax.Array:
  """Attention of one new query token per sequence over its paged K/V.

  Args:
    q: ``[B, num_q_heads, head_dim]``, same dtype as ``pages`` (quantized pages: any float
      dtype, the compute dtype the kernels convert each int8/e4m3 tile to).
    pages: ``[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]``, or
      :class:`paged_kv.pallas_kernels.quant.QuantPages` (int8 / float8_e4m3fn values of that shape
      and float32 per-token scales ``[..., block_size]``): K's scale multiplies each score column,
      V's each probability, and no tile is dequantized. float8_e4m3fn on a GPU below compute
      capability 8.9 is refused (:func:`paged_kv.pallas_kernels.quant.check_kv_dtype`).
    layer: the layer whose K/V are read: a Python int in ``[0, num_layers)``, or an integer
      scalar array (e.g. traced inside a scan over layers), for every ``impl``. The Pallas
      kernels take it as an int32 operand, so all layers run one compiled kernel; a traced id
      outside the range is clamped to the nearest layer by the Pallas kernels and taken as
      given by the reference (:func:`paged_kv.pallas_kernels.validate.check_layer`).
    block_tables: int32 ``[B, max_blocks_per_seq]`` physical block ids; entries outside
      ``[0, num_blocks)`` are clamped to the null block 0 (never another sequence's block).
    lengths: int32 ``[B]`` tokens in the cache per sequence, current token included.
      A length of 0 gives zeros; positions past the table's capacity do not exist.
    scale: softmax scale, default ``head_dim ** -0.5``.
    impl: "auto" | "pallas" | "interpret" | "reference".
    soft_cap: optional static float > 0: scaled scores ``s`` become ``soft_cap * tanh(s /
      soft_cap)`` (Gemma 2's attention logit soft-capping), before the bias and the mask.
    alibi_slopes: optional float ``[num_q_heads]``: adds ``slope[h] * (key_pos - query_pos)``
      to head ``h``'s scores (ALiBi; the query sits at ``lengths - 1``).
    batch_invariant: static; each query's bits depend only on its own K/V and position, and
      equal those of :func:`paged_prefill_attention` for the same token
      (:mod:`paged_kv.pallas_kernels.invariant` on the reference; with a Pallas ``impl`` the fixed-tile
      kernel :mod:`paged_kv.pallas_kernels.invariant_attention`, which serves prefill and decode).
      Not with quantized pages (ValueError).
    window: the attention kind (``paged_kv.attention_spec``): sliding-window attention, the
      query at position ``p = lengths - 1`` sees key ``k`` iff ``p - window < k <= p``, or a
      local chunk of ``C`` (``ChunkedLocal(C)``, code ``-C``: keys ``k // C == p // C``, ``k <=
      p``). None (full attention), a Python int >= 1 (a window), an ``AttentionSpec``, or an
      integer scalar array (e.g. a per-layer code traced inside a scan over layers: ``W > 0`` a
      window, ``-C`` a chunk, 0 full attention;
      :func:`paged_kv.pallas_kernels.validate.check_window`). Key tiles wholly before the
      query's range are neither read nor computed, so the null-block entries a local-attention
      block manager leaves there are never read.

  Returns:
    ``[B, num_q_heads, head_dim]`` in ``q.dtype``. Query head ``h`` reads KV head
    ``h // (num_q_heads // num_kv_heads)``.
  """
  window = validate.check_window(window)
  layer, scale, plan, soft_cap = validate.check_decode(
      q, pages, layer, block_tables, lengths, scale, impl, soft_cap, alibi_slopes, window, batch_invariant)
  impl = plan.impl
  knobs = {} if soft_cap is None else {"soft_cap": soft_cap}
  if alibi_slopes is not None:
    knobs["alibi_slopes"] = alibi_slopes
  if window is not None:
    knobs["window"] = window
  if plan.attention == "invariant" and impl != "reference":
    from paged_kv.pallas_kernels import invariant_attention
    return invariant_attention.paged_decode_invariant_pallas(
        q, pages, layer, block_tables, lengths, scale=scale, interpret=impl == "interpret", **knobs)
  if plan.attention == "invariant":
    knobs["batch_invariant"] = True
  if impl == "reference":
    return reference.paged_decode_attention_reference(
        q, pages, layer, block_tables, lengths, scale=scale, **knobs)
  from paged_kv.pallas_kernels import decode_attention
  if isinstance(window, int):  # a static window or chunk: the split rule sizes the launch for it
    knobs["window_bound"] = abs(window)
  return decode_attention.paged_decode_attention_pallas(
      q, pages, layer, block_tables, lengths, scale=scale, interpret=impl == "interpret", **knobs)


def paged_prefill_attention(q: jax.Array, pages: PagesLike, layer: int | jax.Array, block_tables: jax.Array,
                            q_start: jax.Array, q_lens: jax.Array, *, scale: float | None = None, impl: str = "auto",
                            soft_cap: float | None = None, alibi_slopes: jax.Array | None = None,
                            batch_invariant: bool = False,
                            window: int | AttentionSpec | jax.Array | None = None) -> jax.Array:
  """Causal attention of a chunk of query tokens per sequence over its paged K/V.

  Query ``t`` of sequence ``b`` sits at absolute position ``q_start[b] + t``, is valid for
  ``t < q_lens[b]`` and attends to cached positions ``0 .. q_start[b] + t`` (the chunk's own
  K/V must already be written). Invalid (padding) query rows give zeros. Used for prompt
  chunks and for the uncached suffix after a prefix-cache hit.

  Args:
    q: ``[B, T, num_q_heads, head_dim]``, same dtype as ``pages`` (quantized pages: any float dtype).
    pages, layer, block_tables, scale, impl, soft_cap: as in :func:`paged_decode_attention`.
    alibi_slopes: as in :func:`paged_decode_attention`; query ``t`` sits at ``q_start + t``.
    q_start: int32 ``[B]`` absolute position of each sequence's first query token.
    q_lens: int32 ``[B]`` valid query tokens per sequence (``<= T``).
    batch_invariant: as in :func:`paged_decode_attention`.
    window: as in :func:`paged_decode_attention`: query ``t`` (at ``p = q_start + t``) sees
      only positions ``p - window < k <= p`` (a window), or its chunk's up to ``p`` (a chunk).

  Returns:
    ``[B, T, num_q_heads, head_dim]`` in ``q.dtype``.
  """
  window = validate.check_window(window)
  layer, scale, plan, soft_cap = validate.check_prefill(
      q, pages, layer, block_tables, q_start, q_lens, scale, impl, soft_cap, alibi_slopes, window, batch_invariant)
  impl = plan.impl
  # Knobs are passed only when set, so the default call is exactly the program without them.
  knobs = {} if soft_cap is None else {"soft_cap": soft_cap}
  if alibi_slopes is not None:
    knobs["alibi_slopes"] = alibi_slopes
  if window is not None:
    knobs["window"] = window
  if plan.attention == "invariant" and impl != "reference":
    from paged_kv.pallas_kernels import invariant_attention
    return invariant_attention.paged_invariant_attention_pallas(
        q, pages, layer, block_tables, q_start, q_lens, scale=scale, interpret=impl == "interpret", **knobs)
  if plan.attention == "invariant":
    knobs["batch_invariant"] = True
  if impl == "reference":
    return reference.paged_prefill_attention_reference(
        q, pages, layer, block_tables, q_start, q_lens, scale=scale, **knobs)
  from paged_kv.pallas_kernels import prefill_attention
  return prefill_attention.paged_prefill_attention_pallas(
      q, pages, layer, block_tables, q_start, q_lens, scale=scale,
      interpret=impl == "interpret", **knobs)


def write_kv(pages: PagesLike, layer: int | jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, *,
             impl: str = "auto") -> PagesLike:
  """Writes K/V rows at slot indices: ``pages[layer, 0|1, h, s // bs, s % bs] = k|v[n, h]``.

  Args:
    pages: the page array, or :class:`paged_kv.pallas_kernels.quant.QuantPages`; donate it
      (``jax.jit(..., donate_argnums=...)``) so the update is in place.
    layer: as in :func:`paged_decode_attention`.
    k, v: ``[N, num_kv_heads, head_dim]`` in the pages' dtype (quantized pages: any float dtype,
      k and v alike; each row is quantized as written, one scale per token and KV head,
      :func:`paged_kv.pallas_kernels.quant.quantize`).
    slots: int32 ``[N]``, ``slot = block_id * block_size + offset``. Padding rows should carry
      a slot inside the null block 0; slots outside ``[0, num_blocks * block_size)`` are
      redirected to slot 0. Two real rows must not share a slot (which one wins is undefined).

  Returns:
    The updated pages, of the type given.
  """
  layer, plan = validate.check_write_kv(pages, layer, k, v, slots, impl)
  impl = plan.impl
  if impl == "reference":
    return reference.write_kv_reference(pages, layer, k, v, slots)
  from paged_kv.pallas_kernels import kv_write
  return kv_write.write_kv_pallas(pages, layer, k, v, slots, interpret=impl == "interpret")


def copy_blocks(pages: PagesLike, src: jax.Array, dst: jax.Array, *, impl: str = "auto") -> PagesLike:
  """Copies whole blocks in every layer, K and V, every KV head: ``pages[..., dst[i], :, :] =
  pages[..., src[i], :, :]``.

  Args:
    pages: the page array, or :class:`paged_kv.pallas_kernels.quant.QuantPages` (values and
      scales copied together, in one launch). The Pallas version writes in place through
      ``input_output_aliases``; callers should donate ``pages`` (otherwise XLA inserts a full
      copy of the array first to keep the input alive).
    src, dst: int32 ``[C]``, a padded fixed-size copy list (padding is ``(0, 0)``, a no-op on
      the null block, so the list size never changes and nothing retraces). Real destinations
      must be distinct and must not appear as sources in the same list (copy-on-write copies
      always go to fresh blocks); sources may repeat. Ids outside ``[0, num_blocks)`` are
      clamped to block 0 first.

  Returns:
    The updated pages.

  Raises:
    ValueError: for bad shapes or dtypes, and, where ``src`` and ``dst`` are concrete (not
      traced), for duplicate real destinations or a destination that is also a source (a chain
      ``2 -> 3, 3 -> 4`` or a swap ``2 -> 3, 3 -> 2``), on which the kernel and the reference
      disagree (:func:`paged_kv.pallas_kernels.validate.check_copy_lists`). Under ``jit`` the lists are
      traced and the caller guarantees the contract: the block manager's ``append`` copies from
      shared blocks to blocks it has just allocated, never to a source or twice to one block.
  """
  impl = validate.check_copy_blocks(pages, src, dst, impl).impl
  if impl == "reference":
    return reference.copy_blocks_reference(pages, src, dst)
  from paged_kv.pallas_kernels import block_copy
  return block_copy.copy_blocks_pallas(pages, src, dst, interpret=impl == "interpret")


def layer_matmul(x: jax.Array, w: reference.StackedWeights, layer: int | jax.Array, *,
                 scale: jax.Array | None = None, bias: reference.StackedBiases = None,
                 impl: str = "auto", batch_invariant: bool = False) -> reference.Projections:
  """One layer's projection out of a stacked weight: ``(scale[layer] * x) @ w[layer] + bias[layer]``;
  or a group of projections of the same ``x`` in one launch.

  Args:
    x: ``[M, K]`` activations (float32, bfloat16 or float16).
    w: ``[L, K, N]``, every layer's weight stacked on axis 0, x's dtype; or a group: a tuple of
      such weights ``[L, K, N_i]`` (same ``L`` and ``K``; q/k/v, or gate/up), which the Pallas
      kernel runs as one launch over their columns side by side (no weight is copied).
    layer: a Python int in ``[0, L)`` or an integer scalar array (traced inside a scan over
      layers; clamped to ``[0, L)`` by the Pallas kernel, as the attention kernels clamp it).
    scale: optional ``[L, K]``: multiplies ``x`` (in its dtype) before the product; the RMSNorm
      weight that precedes a projection (shared by a group's weights).
    bias: optional ``[L, N]`` (a group: None, or a tuple with an ``[L, N_i]`` or None per
      weight): added after the cast to x's dtype.
    impl: "auto" | "pallas" | "interpret" | "reference". The Pallas kernel reads ``w[layer]``
      in place, where the reference's ``w[layer]`` is a slice XLA:GPU copies inside a scan.
    batch_invariant: static; each row's bits independent of M and of the other rows (the
      kernel's fixed-tile plan, ``stacked_matmul.invariant_plan``; the reference's
      ``invariant.matmul``).

  Returns:
    ``[M, N]`` in x's dtype, accumulated in float32; for a group, a tuple of ``[M, N_i]``.
  """
  layer, impl = validate.check_layer_matmul(x, w, layer, scale, bias, impl)
  impl = resolve_impl(impl)
  knobs = {"batch_invariant": True} if batch_invariant else {}  # the default call compiles as before
  if impl == "reference":
    return reference.layer_matmul_reference(x, w, layer, scale, bias, **knobs)
  from paged_kv.pallas_kernels import stacked_matmul
  return stacked_matmul.layer_matmul_pallas(x, w, layer, scale, bias, interpret=impl == "interpret", **knobs)
