"""Prefix scans over small batch axes and a rarely-looping ``while``, in the forms that XLA:CPU
runs fastest."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

SCAN_MIN = 1 << 30
"""From this many elements on, ``prefix_sum`` runs as a log-depth ``lax.associative_scan``:
XLA:CPU lowers ``jnp.cumsum`` to a reduce-window, which took about 2x as long on the 9,216
table entries of a 256-request admission. Shorter vectors keep ``jnp.cumsum`` (one kernel
instead of a dozen)."""


def prefix_sum(x: jax.Array) -> jax.Array:
    """int32 inclusive prefix sums of ``x`` (bool or int, ``[..., K]``) along its last axis."""
    x = x.astype(jnp.int32)
    if x.shape[-1] < SCAN_MIN:
        return jnp.cumsum(x, axis=-1, dtype=jnp.int32)
    return lax.associative_scan(jnp.add, x, axis=x.ndim - 1)


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
