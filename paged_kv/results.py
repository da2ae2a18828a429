"""What the manager's operations return beside the new state: ``AdmitResult`` (``admit``) and
``AppendResult`` (``append``), pytrees of int32 arrays. Every form of an operation (the
single-group forms of ``admission`` and ``allocate``, the grouped ones of ``groups``) builds them
from here.
"""

from __future__ import annotations

import flax.struct
import jax


@flax.struct.dataclass
class AdmitResult:
    """Attributes:
    status: int32 ``[B]``, a ``Status`` per request.
    cached_tokens: int32 ``[B]``, prompt tokens whose K/V is already in cached blocks: prefill
      starts after them.
    shared_tokens: int32 ``[B]``, the next prompt tokens, held in blocks that an earlier request
      of this call computes: prefill them in the same forward pass as (or after) that request.
    """

    status: jax.Array
    cached_tokens: jax.Array
    shared_tokens: jax.Array


@flax.struct.dataclass
class AppendResult:
    """What one decode step's ``append`` tells the model and the copy kernel.

    Attributes:
      status: int32 ``[B]``, a ``Status`` per row.
      slots: int32 ``[B]``, where the row's new token's K/V goes (block * block_size + offset);
        a slot in the null block for rows that did not take effect, so padding writes are harmless.
      copy_src, copy_dst: int32 ``[B]``, the copy-on-write list: block ``copy_src[i]`` must be
        copied to ``copy_dst[i]`` before the K/V write; ``(NULL_BLOCK, NULL_BLOCK)`` where no copy.
      num_copies: int32 scalar, real entries in the copy list.
    """

    status: jax.Array
    slots: jax.Array
    copy_src: jax.Array
    copy_dst: jax.Array
    num_copies: jax.Array


@flax.struct.dataclass
class ExtendResult(AppendResult):
    """What ``spans.extend`` tells the model and the copy kernel: ``AppendResult``'s fields, for a
    span of up to ``K`` tokens per row. ``slots`` is int32 ``[B, K]`` (``[B, K, G]`` with KV-cache
    groups): where the K/V of the span's token ``i`` goes, slot 0 of the null block past
    ``num_new`` and for rows that did not take effect; the copy list is ``[B]`` (``[B, G]``), as
    ``append``'s: copy before writing K/V."""
