"""Chained 64-bit hashes of full blocks, as two uint32 lanes (no ``jax_enable_x64`` needed).

A block's key depends on its own tokens, on every block before it and on a per-request salt, so
two requests share a cached block only if their whole prefixes and salts are equal. The chain is
a linear recurrence per lane, ``x_j = x_{j-1} * P + c_j (mod 2**32)``, where ``c_j`` mixes the
block's tokens and ``x_{-1}`` mixes the salt; because the recurrence is associative, the keys of
all blocks of a prompt come from one ``lax.associative_scan`` instead of a sequential loop. The
key of block ``j`` is a final avalanche of ``x_j``. Integer arithmetic only: the same inputs give
the same keys in every process and on every backend.

Collisions are possible (it is a hash); the prefix cache never trusts a key alone, it compares the
cached block's tokens, salt and parent before reusing it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

LANES = 2
# Odd multipliers of the chain recurrence, one per lane.
_CHAIN_MULT = np.array([0x9E3779B1, 0x85EBCA77], np.uint32)
_SALT_SEED = np.array([0x27D4EB2F, 0x165667B1], np.uint32)


def _fmix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's finaliser: a bijection on uint32 with full avalanche."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _position_constants(block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-lane, per-position seeds and odd multipliers, fixed by a splitmix64 stream."""
    state = np.uint64(0x243F6A8885A308D3)
    out = np.empty((2, LANES, block_size), np.uint32)
    with np.errstate(over="ignore"):
        for i in range(out.size):
            state = state + np.uint64(0x9E3779B97F4A7C15)
            z = state
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            out.flat[i] = np.uint32((z ^ (z >> np.uint64(31))) & np.uint64(0xFFFFFFFF))
    seeds, mults = out[0], out[1] | np.uint32(1)
    return seeds, mults


def block_contents(tokens: jax.Array) -> jax.Array:
    """uint32 ``[..., 2]``: a hash of each block's tokens alone (``tokens`` int32 ``[..., bs]``).

    Per lane, ``fmix(sum_i (t_i ^ s_i) * m_i)`` with per-position seeds ``s_i`` and odd
    multipliers ``m_i`` (mod 2**32): two operations per token, vectorised over the block (a full
    avalanche per token cost 4x as much in a 256-request admission). Changing any one token always
    changes the sum (an odd multiplier keeps a nonzero difference nonzero); collisions of other
    changes are possible, like any hash's, and the cache verifies every hit.
    """
    seeds, mults = _position_constants(tokens.shape[-1])
    t = tokens.astype(jnp.uint32)
    # One reduction per lane over the contiguous token axis: the [..., LANES, bs] form made
    # XLA:CPU reduce across a strided axis, 1.5-2x slower on a 256-request admission.
    sums = [jnp.sum((t ^ jnp.asarray(seeds[i])) * jnp.asarray(mults[i]), axis=-1, dtype=jnp.uint32)
            for i in range(LANES)]
    return _fmix32(jnp.stack(sums, axis=-1))


def root_state(salt: jax.Array) -> jax.Array:
    """uint32 ``[..., 2]``: the chain state before a request's first block, from its salt."""
    s = salt.astype(jnp.uint32)[..., None]
    return _fmix32(s ^ jnp.asarray(_SALT_SEED))


def extend(chain: jax.Array, contents: jax.Array) -> jax.Array:
    """The chain state after one more block: ``chain * P + contents`` per lane."""
    return chain * jnp.asarray(_CHAIN_MULT) + contents


MATRIX_MAX = 1 << 16
"""Up to this many ``B * C * C`` products, ``chain_states`` unrolls the recurrence as one
matrix of powers (a single kernel); larger batches use the log-depth scan."""


def _powers(c: int) -> np.ndarray:
    """uint32 ``[C, C, LANES]``: ``P ** (j - i)`` per lane where ``i <= j``, else 0."""
    out = np.zeros((c, c, LANES), np.uint32)
    with np.errstate(over="ignore"):
        for lane in range(LANES):
            p = np.uint32(1)
            for d in range(c):
                idx = np.arange(c - d)
                out[idx + d, idx, lane] = p
                p = p * _CHAIN_MULT[lane]
    return out


def chain_states(salt: jax.Array, tokens: jax.Array, block_size: int) -> jax.Array:
    """uint32 ``[B, C, 2]``: chain state after each block of each prompt.

    Args:
      salt: uint32 ``[B]``.
      tokens: int32 ``[B, C * block_size]``.
    """
    b, length = tokens.shape
    c = length // block_size
    contents = block_contents(tokens.reshape(b, c, block_size))
    root = root_state(salt)[:, None, :]
    if b * c * c <= MATRIX_MAX:
        # x_j = x_{-1} P^(j+1) + sum_{i<=j} c_i P^(j-i): one product with a constant matrix.
        # Small calls (a one-request admission) are dominated by the number of kernels, and the
        # scan below is a dozen of them.
        powers = jnp.asarray(_powers(c + 1))
        terms = contents[:, None, :, :] * powers[None, :c, :c, :]  # [B, C (j), C (i), LANES]
        # Both lanes in one two-output reduction: XLA:CPU splits a plain sum over more than 32
        # blocks into two kernels (see ``paged_kv.scan``).
        summed = lax.reduce(
            (terms[..., 0], terms[..., 1]), (jnp.uint32(0), jnp.uint32(0)),
            lambda a, b: (a[0] + b[0], a[1] + b[1]), (2,),
        )
        return root * powers[1:, 0, :][None] + jnp.stack(summed, axis=-1)
    # x_j = x_{j-1} * P + c_j  is the composition of affine maps  x -> x * P + c.
    mult = jnp.broadcast_to(jnp.asarray(_CHAIN_MULT), contents.shape)

    def compose(first, second):
        (a1, c1), (a2, c2) = first, second
        return a1 * a2, c1 * a2 + c2

    scale, offset = lax.associative_scan(compose, (mult, contents), axis=1)
    return root * scale + offset


def key_of(chain: jax.Array) -> jax.Array:
    """uint32 ``[..., 2]``: the cache key of a block whose chain state is ``chain``."""
    return _fmix32(chain ^ jnp.uint32(0x61C88647))
