"""The Pallas kernels take the layer as an int32 operand (`decode_attention.layer_operand`), not as
a constant in their block index maps: interpret mode against the reference for every layer, with
the layer a Python int and a traced int32 scalar (bit-identical to each other: one kernel), the
clamp of a traced id outside [0, L), and the CUDA lowering giving every layer the same Triton IR
(so XLA:GPU compiles one kernel per kind however deep the model)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.pallas_kernels import decode_attention, testing as kt
from paged_kv.pallas_kernels.jax_compat import export_cuda
from tests import tolerances as tol

LAYERS = 3
# Roundings to bfloat16 (tests/tolerances.py), as in test_kernels_decode / _prefill: the kernel
# rounds the softmax weights before P V and the output, the reference only the output.
OURS, REFERENCE = 2, 1
# A subset of the kernel tests' cases: both dtypes, GQA 1/4/8, every block size.
CASES = [
    (jnp.float32, 8, 64, 1),
    (jnp.float32, 16, 128, 4),
    (jnp.bfloat16, 32, 64, 8),
    (jnp.bfloat16, 16, 64, 4),
]


def _case(rng, lengths, dtype, block_size, head_dim):
  # Every layer holds its own random K/V, so reading the wrong layer misses the tolerance.
  return kt.make_paged_case(rng, lengths, block_size=block_size, head_dim=head_dim, num_kv_heads=2,
                            dtype=dtype, num_layers=LAYERS)


@pytest.mark.parametrize("dtype,block_size,head_dim,group", CASES)
def test_decode_operand_layer_matches_reference(dtype, block_size, head_dim, group):
  rng = np.random.default_rng(100 + block_size + head_dim + group)
  # Partial last blocks, a one-token and an empty sequence.
  lengths = [1, block_size + 3, 4 * block_size - 5, 0]
  case = _case(rng, lengths, dtype, block_size, head_dim)
  q = kt.random_queries(rng, (len(lengths), 2 * group, head_dim), dtype)
  ln = jnp.asarray(case.lengths)
  traced = jax.jit(lambda layer: pk.paged_decode_attention(q, case.pages, layer, case.block_tables, ln,
                                                           impl="interpret"))
  for layer in range(LAYERS):
    want = pk.paged_decode_attention(q, case.pages, layer, case.block_tables, ln, impl="reference")
    got = pk.paged_decode_attention(q, case.pages, layer, case.block_tables, ln, impl="interpret")
    atol = tol.paged_attention_atol(q, case.pages, layer, head_dim ** -0.5, max(lengths),
                                    roundings=OURS + REFERENCE)
    tol.assert_close(got, want, atol, f"layer {layer}")
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(layer))), np.asarray(got))


@pytest.mark.parametrize("dtype,block_size,head_dim,group", CASES)
def test_prefill_operand_layer_matches_reference(dtype, block_size, head_dim, group):
  rng = np.random.default_rng(200 + block_size + head_dim + group)
  num_tokens = 4
  # From 0, after a block-aligned prefix, mid-block, and an all-padding row.
  q_start = np.array([0, 2 * block_size, block_size + 3, 2], np.int32)
  q_lens = np.array([num_tokens, num_tokens - 1, 2, 0], np.int32)
  case = _case(rng, q_start + q_lens, dtype, block_size, head_dim)
  q = kt.random_queries(rng, (len(q_start), num_tokens, 2 * group, head_dim), dtype)
  rest = (case.block_tables, jnp.asarray(q_start), jnp.asarray(q_lens))
  traced = jax.jit(lambda layer: pk.paged_prefill_attention(q, case.pages, layer, *rest, impl="interpret"))
  for layer in range(LAYERS):
    want = pk.paged_prefill_attention(q, case.pages, layer, *rest, impl="reference")
    got = pk.paged_prefill_attention(q, case.pages, layer, *rest, impl="interpret")
    atol = tol.paged_attention_atol(q, case.pages, layer, head_dim ** -0.5, int(max(q_start + q_lens)),
                                    roundings=OURS + REFERENCE)
    tol.assert_close(got, want, atol, f"layer {layer}")
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(layer))), np.asarray(got))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_operand_layer_writes_only_its_layer(dtype):
  rng = np.random.default_rng(3)
  pages = jnp.asarray(rng.standard_normal((LAYERS, 2, 3, 5, 8, 16), np.float32), dtype)
  k = jnp.asarray(rng.standard_normal((4, 3, 16), np.float32), dtype)
  v = jnp.asarray(rng.standard_normal((4, 3, 16), np.float32), dtype)
  slots = jnp.asarray([9, 10, 33, 0], jnp.int32)  # partial blocks, the null block's slot 0
  traced = jax.jit(lambda layer: pk.write_kv(pages, layer, k, v, slots, impl="interpret"))
  for layer in range(LAYERS):
    want = np.asarray(pk.write_kv(pages, layer, k, v, slots, impl="reference"))
    # A write is exact: bit for bit, and every other layer untouched.
    np.testing.assert_array_equal(np.asarray(pk.write_kv(pages, layer, k, v, slots, impl="interpret")), want)
    np.testing.assert_array_equal(np.asarray(traced(jnp.int32(layer))), want)


def test_traced_layer_out_of_range_is_clamped():
  """A traced id cannot be range-checked before tracing: the kernels clamp it to [0, L), so it
  reads and writes the nearest layer, never memory outside the pages."""
  rng = np.random.default_rng(5)
  case = _case(rng, [9, 20], jnp.float32, 8, 64)
  q = kt.random_queries(rng, (2, 4, 64))
  ln = jnp.asarray(case.lengths)
  decode = jax.jit(lambda layer: pk.paged_decode_attention(q, case.pages, layer, case.block_tables, ln,
                                                           impl="interpret"))
  for outside, nearest in ((-1, 0), (LAYERS, LAYERS - 1), (1000, LAYERS - 1)):
    np.testing.assert_array_equal(np.asarray(decode(jnp.int32(outside))),
                                  np.asarray(decode(jnp.int32(nearest))))
  k = jnp.ones((1, 2, 64), jnp.float32)
  got = np.asarray(jax.jit(lambda layer: pk.write_kv(case.pages, layer, k, k, jnp.asarray([3], jnp.int32),
                                                     impl="interpret"))(jnp.int32(LAYERS + 2)))
  np.testing.assert_array_equal(got, np.asarray(pk.write_kv(case.pages, LAYERS - 1, k, k,
                                                            jnp.asarray([3], jnp.int32), impl="reference")))
  np.testing.assert_array_equal(decode_attention.layer_operand(7, LAYERS), [LAYERS - 1])
  with pytest.raises(ValueError, match="out of range"):  # a Python int is checked, not clamped
    pk.paged_decode_attention(q, case.pages, LAYERS, case.block_tables, ln, impl="interpret")


# ---------------------------------------------------------------------------- CUDA lowering
S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
_IR = re.compile(r'\bir = "([^"]*)"')


def _triton_irs(fn, *args) -> list[str]:
  """The Triton IR of every `xla.gpu.triton` custom call in `fn`'s CUDA lowering (jax.export, no
  GPU needed), one entry per call in the module text."""
  calls = [line for line in export_cuda(fn, *args).mlir_module().splitlines() if "xla.gpu.triton" in line]
  irs = [m.group(1) for line in calls for m in [_IR.search(line)] if m]
  assert irs and len(irs) == len(calls)
  return irs


def test_every_layer_lowers_to_the_same_triton_kernel():
  """Each layer's calls (write, decode, prefill) carry byte-identical Triton IR: the layer is an
  operand, not part of the kernel, so XLA:GPU compiles each kind once for all layers. Before,
  the layer was a constant in the block index maps: one distinct kernel per layer and kind."""
  layers = 4
  pages = S((layers, 2, 2, 16, 16, 64), BF16)
  tables, lens = S((2, 8), jnp.int32), S((2,), jnp.int32)
  q, qp, kv, slots = S((2, 8, 64), BF16), S((2, 3, 8, 64), BF16), S((6, 2, 64), BF16), S((6,), jnp.int32)

  def unrolled(q, qp, p, k, s, bt, ln):
    outs = []
    for i in range(layers):  # Python ints, as the unrolled (per-layer) Llama hands them
      p = pk.write_kv(p, i, k, k, s, impl="pallas")
      outs.append(pk.paged_decode_attention(q, p, i, bt, ln, impl="pallas"))
      outs.append(pk.paged_prefill_attention(qp, p, i, bt, ln, ln, impl="pallas"))
    return outs, p

  irs = _triton_irs(unrolled, q, qp, pages, kv, slots, tables, lens)
  assert len(set(irs)) == 3, f"{len(set(irs))} distinct Triton kernels for 3 kinds over {layers} layers"

  def one(layer):
    return lambda q, p, bt, ln: pk.paged_decode_attention(q, p, layer, bt, ln, impl="pallas")

  first, = set(_triton_irs(one(0), q, pages, tables, lens))
  last, = set(_triton_irs(one(layers - 1), q, pages, tables, lens))
  assert first == last
