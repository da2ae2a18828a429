"""Every Pallas kernel lowers through Triton for CUDA, checked on a CPU through jax.export.

Shapes are Llama 3.1 8B's attention (32 query heads, 8 KV heads, head dim 128, bfloat16,
block size 16) with few blocks so the export stays quick. Interpret mode checks results; this
checks what it cannot: power-of-two tensor shapes and ops the Triton lowering supports.
"""

import jax
import jax.numpy as jnp
import pytest

from paged_kv import pallas_kernels as pk
from paged_kv.pallas_kernels.jax_compat import export_cuda

# A fast check of this area on every supported JAX (CI runs it on the oldest pair too).
pytestmark = pytest.mark.smoke

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
HQ, HKV, D, BS = 32, 8, 128, 16


def _pages(num_layers=4, num_blocks=64, heads=HKV, dtype=BF16):
  return S((num_layers, 2, heads, num_blocks, BS, D), dtype)


def _export_cuda(fn, *args):
  text = export_cuda(fn, *args).mlir_module()
  assert "xla.gpu.triton" in text
  return text


@pytest.mark.parametrize("batch,max_blocks", [(1, 8), (5, 37), (256, 2048)])
def test_decode_lowers_for_cuda(batch, max_blocks):
  _export_cuda(lambda q, p, bt, ln: pk.paged_decode_attention(q, p, 3, bt, ln, impl="pallas"),
               S((batch, HQ, D), BF16), _pages(), S((batch, max_blocks), jnp.int32),
               S((batch,), jnp.int32))


@pytest.mark.parametrize("batch,tokens,max_blocks", [(1, 1, 4), (2, 40, 37), (4, 512, 64)])
def test_prefill_lowers_for_cuda(batch, tokens, max_blocks):
  _export_cuda(
      lambda q, p, bt, a, b: pk.paged_prefill_attention(q, p, 3, bt, a, b, impl="pallas"),
      S((batch, tokens, HQ, D), BF16), _pages(), S((batch, max_blocks), jnp.int32),
      S((batch,), jnp.int32), S((batch,), jnp.int32))


@pytest.mark.parametrize("heads", [HKV, 3])
def test_write_kv_lowers_for_cuda(heads):
  _export_cuda(lambda p, k, v, s: pk.write_kv(p, 1, k, v, s, impl="pallas"),
               _pages(heads=heads), S((7, heads, D), BF16), S((7, heads, D), BF16),
               S((7,), jnp.int32))


def test_copy_blocks_lowers_for_cuda():
  _export_cuda(lambda p, s, d: pk.copy_blocks(p, s, d, impl="pallas"),
               _pages(num_layers=32), S((64,), jnp.int32), S((64,), jnp.int32))


@pytest.mark.parametrize("block_size", [8, 32])
def test_small_tables_keep_dot_shapes_legal(block_size):
  """One-block tables with block size 8 still give >= 16-key tiles (Triton dot minimum)."""
  pages = S((2, 2, 2, 8, block_size, 64), BF16)
  text = _export_cuda(
      lambda q, p, bt, ln: pk.paged_decode_attention(q, p, 1, bt, ln, impl="pallas"),
      S((3, 2, 64), BF16), pages, S((3, 1), jnp.int32), S((3,), jnp.int32))
  assert "xla.gpu.triton" in text
  _export_cuda(
      lambda q, p, bt, a, b: pk.paged_prefill_attention(q, p, 1, bt, a, b, impl="pallas"),
      S((3, 2, 2, 64), BF16), pages, S((3, 1), jnp.int32), S((3,), jnp.int32),
      S((3,), jnp.int32))


def test_float32_kernels_lower_for_cuda():
  pages = _pages(dtype=jnp.float32)
  _export_cuda(lambda q, p, bt, ln: pk.paged_decode_attention(q, p, 0, bt, ln, impl="pallas"),
               S((2, HQ, D), jnp.float32), pages, S((2, 9), jnp.int32), S((2,), jnp.int32))
  _export_cuda(
      lambda q, p, bt, a, b: pk.paged_prefill_attention(q, p, 0, bt, a, b, impl="pallas"),
      S((2, 3, HQ, D), jnp.float32), pages, S((2, 9), jnp.int32), S((2,), jnp.int32),
      S((2,), jnp.int32))


@pytest.mark.parametrize("knobs", [{"soft_cap": 50.0}, {"alibi": True},
                                   {"soft_cap": 30.0, "alibi": True}])
def test_attention_knobs_lower_for_cuda(knobs):
  """Soft-capping (tanh) and the ALiBi slope input lower through Triton for both kernels."""
  cap = knobs.get("soft_cap")
  slopes = S((HQ,), jnp.float32) if knobs.get("alibi") else None
  if slopes is None:
    decode = lambda q, p, bt, ln: pk.paged_decode_attention(q, p, 3, bt, ln, impl="pallas",
                                                            soft_cap=cap)
    prefill = lambda q, p, bt, a, b: pk.paged_prefill_attention(q, p, 3, bt, a, b, impl="pallas",
                                                                soft_cap=cap)
    extra = ()
  else:
    decode = lambda q, p, bt, ln, sl: pk.paged_decode_attention(
        q, p, 3, bt, ln, impl="pallas", soft_cap=cap, alibi_slopes=sl)
    prefill = lambda q, p, bt, a, b, sl: pk.paged_prefill_attention(
        q, p, 3, bt, a, b, impl="pallas", soft_cap=cap, alibi_slopes=sl)
    extra = (slopes,)
  _export_cuda(decode, S((5, HQ, D), BF16), _pages(), S((5, 37), jnp.int32), S((5,), jnp.int32),
               *extra)
  _export_cuda(prefill, S((2, 40, HQ, D), BF16), _pages(), S((2, 37), jnp.int32),
               S((2,), jnp.int32), S((2,), jnp.int32), *extra)
