"""The rules every attention implementation applies to its scores, written once: the optional
score transforms (soft cap, ALiBi) and the first key a query sees under its attention kind (a
sliding window, a local chunk: ``paged_kv.attention_spec``, the one place each kind's rule lives).
The XLA references, the batch-invariant steps and the Pallas kernels all import them from here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_kv.attention_spec import first_visible_code


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
  """The first position each query sees under the attention kind ``window`` (an
  ``AttentionSpec.code``: ``W > 0`` a sliding window, ``max(last_pos - W + 1, 0)``; ``-C`` a
  local chunk, ``last_pos // C * C``; 0 full attention, 0). The query at ``last_pos`` sees keys
  ``window_start <= k <= last_pos``. ``last_pos`` int32, any shape; ``window`` a Python int or an
  int32 scalar (traced per layer). Returns int32 of ``last_pos``'s shape
  (``paged_kv.attention_spec.first_visible_code``)."""
  return first_visible_code(last_pos, window)
