"""The rules every attention implementation applies to its scores, written once: the optional
score transforms (soft cap, ALiBi) and the first key a sliding window lets a query see. The XLA
references, the batch-invariant steps and the Pallas kernels all import them from here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def score_knobs(s: jax.Array, soft_cap: float | None, slopes: jax.Array | None, key_pos: jax.Array,
                query_pos: jax.Array) -> jax.Array:
  """The optional score transforms, in float32, in the order every implementation applies them:
  ``s`` (already scaled) is soft-capped, ``cap * tanh(s / cap)`` (Gemma 2), then the ALiBi bias
  ``slope * (key_pos - query_pos)`` is added; masking comes after both. ``slopes``,
  ``key_pos`` and ``query_pos`` broadcast against ``s``. With neither knob, ``s`` is returned
  untouched (the program is the same as without this call)."""
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  if slopes is not None:
    s = s + slopes * (key_pos - query_pos).astype(jnp.float32)
  return s


def window_start(last_pos: jax.Array, window: int | jax.Array) -> jax.Array:
  """The first position each query sees under a sliding window: ``max(last_pos - window + 1, 0)``
  (query at ``last_pos`` sees keys ``last_pos - window < k <= last_pos``), or 0 where the window
  is ``<= 0`` (a traced per-layer window: full attention). ``last_pos`` int32, any shape; ``window``
  a Python int >= 1 or an int32 scalar. Returns int32 of ``last_pos``'s shape."""
  w = jnp.asarray(window, jnp.int32)
  return jnp.where(w > 0, jnp.maximum(last_pos - w + 1, 0), 0).astype(jnp.int32)
