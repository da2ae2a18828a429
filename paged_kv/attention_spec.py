"""Attention kinds, stated once: which keys a query sees, and what that means for blocks.

An ``AttentionSpec`` is one layer's kind of attention: ``Full()``, ``SlidingWindow(W)`` (a query
at position ``p`` sees keys ``p - W < k <= p``; Mistral, Gemma's local layers) or
``ChunkedLocal(C)`` (Llama 4's local layers, vLLM's ``ChunkedLocalAttentionSpec``: a query at
``p`` sees keys ``k`` with ``k // C == p // C`` and ``k <= p``). Every kind's key range is one
contiguous run ``first_visible(p) <= k <= p`` with ``first_visible`` non-decreasing in ``p``; the
rest follows from that one rule:

- the mask (``visible``), which the jnp references, the contiguous model path and the Pallas
  kernels apply through ``first_visible_code`` (a traced per-layer kind in a scan over layers is
  the int32 ``code``: ``W`` for a window, ``-C`` for a chunk, 0 for full attention);
- the blocks no later query reads (``skipped_blocks``: what the block manager reclaims);
- which cached blocks a prefix hit needs (``hit_start``), and whether a kind's blocks are cached at
  all (``caches_blocks``).

This module is a leaf that every layer may import (core, models and kernels alike; see
docs/design.md section 1): it imports nothing from the repository, only NumPy and ``jax.numpy``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

_INT32_MAX = 2**31 - 1


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a Python int, got {value!r} ({type(value).__name__})")
    if not 1 <= value <= _INT32_MAX:
        raise ValueError(f"{name} must be in [1, {_INT32_MAX}], got {value}")


def _clip0(x: Any) -> Any:
    """``max(x, 0)`` for a Python int (stays an int) or an array."""
    return max(x, 0) if isinstance(x, int) else jnp.maximum(x, 0)


class AttentionSpec:
    """Base of the attention kinds (frozen, hashable dataclasses: usable as static config).

    Shared rules, all derived from the kind's ``first_visible``:
      ``visible(q_pos, k_pos)``: whether a query sees a key;
      ``skipped_blocks(computed, block_size)``: leading blocks of a sequence that no query after
        ``computed`` tokens reads (they may be reclaimed);
      ``code``: the int the kernels take for the kind (``first_visible_code``).
    """

    kind: ClassVar[str] = ""

    def first_visible(self, pos: Any) -> Any:
        """The first key position a query at ``pos`` (a Python int or an int array) sees."""
        raise NotImplementedError

    @property
    def code(self) -> int:
        """The kind as one int (the kernels' per-layer operand): 0 full, ``W`` a window, ``-C`` a
        chunk. ``first_visible_code`` decodes it."""
        raise NotImplementedError

    @property
    def span(self) -> int:
        """Most keys a query sees (0: unbounded); bounds what a kernel reads per query."""
        raise NotImplementedError

    @property
    def is_full(self) -> bool:
        return self.code == 0

    def visible(self, q_pos: Any, k_pos: Any) -> Any:
        """The mask: whether a query at ``q_pos`` sees the key at ``k_pos`` (ints or int arrays,
        broadcast; bool)."""
        return (k_pos <= q_pos) & (k_pos >= self.first_visible(q_pos))

    def skipped_blocks(self, computed: Any, block_size: int) -> Any:
        """Leading blocks (of ``block_size`` tokens) that no query after ``computed`` tokens reads:
        the next query sits at ``computed`` and ``first_visible`` never decreases. A Python int
        for an int ``computed``, else an int32 array of its shape."""
        return self.first_visible(computed) // block_size

    def hit_start(self, h: Any, block_size: int) -> Any:
        """First block of the cached run a prefix hit of ``h`` blocks needs (blocks ``[hit_start,
        h)``; the blocks before are skipped). Full attention needs all (0)."""
        raise NotImplementedError

    @property
    def caches_blocks(self) -> bool:
        """Whether a prefix hit can ever use this kind's cached blocks."""
        return True


@dataclasses.dataclass(frozen=True)
class Full(AttentionSpec):
    """Full causal attention: a query at ``p`` sees every key ``k <= p``."""

    kind: ClassVar[str] = "full"

    def first_visible(self, pos: Any) -> Any:
        return pos * 0

    @property
    def code(self) -> int:
        return 0

    @property
    def span(self) -> int:
        return 0

    def hit_start(self, h: Any, block_size: int) -> Any:
        return h * 0


@dataclasses.dataclass(frozen=True)
class SlidingWindow(AttentionSpec):
    """Sliding window of ``window`` tokens (int in ``[1, 2**31 - 1]``): a query at ``p`` sees keys
    ``p - window < k <= p``."""

    window: int
    kind: ClassVar[str] = "window"

    def __post_init__(self) -> None:
        _check_size("SlidingWindow.window", self.window)

    def first_visible(self, pos: Any) -> Any:
        return _clip0(pos - self.window + 1)

    @property
    def code(self) -> int:
        return self.window

    @property
    def span(self) -> int:
        return self.window

    def hit_start(self, h: Any, block_size: int) -> Any:
        # The last cdiv(W - 1, bs) blocks, at least one (vLLM's SlidingWindowManager).
        return _clip0(h - max(1, -(-(self.window - 1) // block_size)))

    @property
    def caches_blocks(self) -> bool:
        # A window of 1 token reads only the query's own token: no hit needs a cached block (vLLM
        # 0.33 hashes none either).
        return self.window != 1


@dataclasses.dataclass(frozen=True)
class ChunkedLocal(AttentionSpec):
    """Chunked local attention of ``chunk`` tokens (int in ``[1, 2**31 - 1]``; Llama 4's
    ``attention_chunk_size``): a query at ``p`` sees keys ``k`` with ``k // chunk == p // chunk``
    and ``k <= p``."""

    chunk: int
    kind: ClassVar[str] = "chunked"

    def __post_init__(self) -> None:
        _check_size("ChunkedLocal.chunk", self.chunk)

    def first_visible(self, pos: Any) -> Any:
        return _clip0(pos // self.chunk * self.chunk)

    @property
    def code(self) -> int:
        return -self.chunk

    @property
    def span(self) -> int:
        return self.chunk

    def hit_start(self, h: Any, block_size: int) -> Any:
        # The blocks of the chunk the next query (at h * bs) lies in; none at a chunk boundary
        # (vLLM's ChunkedLocalAttentionManager).
        return self.skipped_blocks(h * block_size, block_size)


KINDS = (Full, SlidingWindow, ChunkedLocal)
"""Every attention kind."""


def from_code(code: int) -> AttentionSpec:
    """The spec of an int ``code`` (``AttentionSpec.code``): 0 full, ``W > 0`` a window, ``-C`` a
    chunk."""
    if isinstance(code, bool) or not isinstance(code, int):
        raise ValueError(f"an attention code must be a Python int, got {code!r}")
    return Full() if code == 0 else SlidingWindow(code) if code > 0 else ChunkedLocal(-code)


def as_spec(value: Any) -> AttentionSpec:
    """An ``AttentionSpec`` as given, or one from its int code (``from_code``)."""
    if isinstance(value, AttentionSpec):
        return value
    return from_code(int(value) if isinstance(value, np.integer) else value)


def first_visible_code(pos: Any, code: Any) -> Any:
    """int32 ``pos``'s shape: the first key a query at ``pos`` sees under the kind ``code`` (a
    Python int or a traced int32 scalar: one kernel or scan for every kind; an ``AttentionSpec``
    is taken as its code). Each kind's rule is its ``first_visible``; this selects among them."""
    c = jnp.asarray(code.code if isinstance(code, AttentionSpec) else code, jnp.int32)
    pos = jnp.asarray(pos, jnp.int32)
    window = SlidingWindow.first_visible(_Sized(c), pos)
    chunk = ChunkedLocal.first_visible(_Sized(jnp.maximum(-c, 1)), pos)
    return jnp.where(c > 0, window, jnp.where(c < 0, chunk, 0)).astype(jnp.int32)


class _Sized:
    """A traced size standing in for a kind's field, so ``first_visible_code`` runs each kind's
    own ``first_visible`` on a traced code."""

    def __init__(self, size: Any) -> None:
        self.window = self.chunk = size
