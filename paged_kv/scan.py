"""Prefix sums and a cumulative AND over small batch axes and a rarely-looping ``while``, in the
forms that XLA:CPU runs fastest."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

TRIANGLE_MAX = 256
"""Up to this many elements on the summed axis, ``prefix_sum`` is one masked reduction over a
``[K, K]`` triangle, which fuses with whatever computes ``x``. XLA:CPU splits ``jnp.cumsum`` into
a tree of reduce-windows, about five kernels for 36 elements: on a one-request admission the
cumsums were a fifth of all kernels run."""


def prefix_sum(x: jax.Array) -> jax.Array:
    """int32 ``[..., K]`` inclusive prefix sums of ``x`` (bool or int) along its last axis."""
    x = x.astype(jnp.int32)
    k = x.shape[-1]
    if k > TRIANGLE_MAX:
        return jnp.cumsum(x, axis=-1, dtype=jnp.int32)
    lanes = jnp.arange(k, dtype=jnp.int32)
    upto = lanes[None, :] <= lanes[:, None]  # [K (output), K (input)]
    return jnp.sum(jnp.where(upto, x[..., None, :], 0), axis=-1, dtype=jnp.int32)


def leading_true(mask: jax.Array) -> jax.Array:
    """bool ``[..., K]``: the longest all-True prefix of ``mask`` along its last axis (a
    cumulative AND, found from the first False: one reduction instead of a scan)."""
    k = mask.shape[-1]
    first_false = jnp.where(jnp.all(mask, axis=-1), k, jnp.argmin(mask, axis=-1))
    return jnp.arange(k, dtype=jnp.int32) < first_false[..., None]


def while_needed(cond_fun, body_fun, init):
    """``lax.while_loop(cond_fun, body_fun, init)``, entered only when ``cond_fun(init)`` holds.

    For loops that usually run zero iterations (probing past a window, skipping stale queue
    entries): on XLA:CPU a ``while`` costs a few microseconds per call even when it does not
    iterate, a ``cond`` that skips it well under one.
    """
    return lax.cond(cond_fun(init), lambda c: lax.while_loop(cond_fun, body_fun, c), lambda c: c, init)
