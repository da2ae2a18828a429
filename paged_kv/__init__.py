"""paged-kv: paged KV-cache management for LLM inference, as pure, jittable JAX functions.

Every operation has the form ``op(config, state, inputs) -> (state, outputs)``: ``config`` is a
static ``ManagerConfig`` (pass it as a static argument to ``jax.jit``), ``state`` an immutable
``BlockManagerState`` pytree. For code that does not jit, ``BlockManager`` wraps the operations
with input validation.

Subpackages: ``paged_kv.engine`` (``generate``, ``beam_search``, ``ServingEngine``),
``paged_kv.models`` (the model protocol, a Flax Llama, checkpoints, KV pages),
``paged_kv.pallas_kernels`` (paged attention, ``write_kv``, ``copy_blocks``) and ``paged_kv.apps``
(the ``python -m paged_kv`` command line).

The names below are loaded on first use: ``import paged_kv`` itself imports nothing (not even
JAX) and changes nothing, so the command line answers ``--help`` at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module that defines it
_EXPORTS = {
    "AdmitResult": "paged_kv.results",
    "admit": "paged_kv.admission",
    "AppendResult": "paged_kv.results",
    "append": "paged_kv.allocate",
    "AttentionSpec": "paged_kv.attention_spec",
    "ChunkedLocal": "paged_kv.attention_spec",
    "Full": "paged_kv.attention_spec",
    "SlidingWindow": "paged_kv.attention_spec",
    "ExtendResult": "paged_kv.results",
    "extend": "paged_kv.spans",
    "commit": "paged_kv.spans",
    "truncate": "paged_kv.spans",
    "NULL_BLOCK": "paged_kv.config",
    "Group": "paged_kv.config",
    "ManagerConfig": "paged_kv.config",
    "BlockManager": "paged_kv.manager",
    "free": "paged_kv.reclaim",
    "is_cached": "paged_kv.prefix_cache",
    "reset_prefix_cache": "paged_kv.prefix_cache",
    "fork": "paged_kv.share",
    "select": "paged_kv.share",
    "BlockManagerState": "paged_kv.state",
    "CacheStats": "paged_kv.state",
    "FreeQueue": "paged_kv.state",
    "init_state": "paged_kv.state",
    "Status": "paged_kv.status",
    "StatusArray": "paged_kv.status",
    "Usage": "paged_kv.views",
    "num_free_blocks": "paged_kv.views",
    "shared_blocks": "paged_kv.views",
    "slots_for": "paged_kv.views",
    "usage": "paged_kv.views",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from paged_kv.admission import admit
    from paged_kv.allocate import append
    from paged_kv.attention_spec import AttentionSpec, ChunkedLocal, Full, SlidingWindow
    from paged_kv.config import NULL_BLOCK, Group, ManagerConfig
    from paged_kv.manager import BlockManager
    from paged_kv.prefix_cache import is_cached, reset_prefix_cache
    from paged_kv.reclaim import free
    from paged_kv.results import AdmitResult, AppendResult, ExtendResult
    from paged_kv.share import fork, select
    from paged_kv.spans import commit, extend, truncate
    from paged_kv.state import BlockManagerState, CacheStats, FreeQueue, init_state
    from paged_kv.status import Status, StatusArray
    from paged_kv.views import Usage, num_free_blocks, shared_blocks, slots_for, usage


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paged_kv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
