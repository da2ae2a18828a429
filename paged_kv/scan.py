"""A cumulative AND over small batch axes and a rarely-looping ``while``, in the forms that
XLA:CPU runs fastest."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

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
