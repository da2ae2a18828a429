"""paged-kv: paged KV-cache management for LLM inference, as pure, jittable JAX functions.

Every operation has the form ``op(config, state, inputs) -> (state, outputs)``: ``config`` is a
static ``ManagerConfig`` (pass it as a static argument to ``jax.jit``), ``state`` an immutable
``BlockManagerState`` pytree. For code that does not jit, ``BlockManager`` wraps the operations
with input validation.
"""

import sys as _sys

_cmd = " ".join(getattr(_sys, "orig_argv", []))
if (_sys.argv[:1] == ["-m"] and (" -m paged_kv" in _cmd or " -mpaged_kv" in _cmd)) or _sys.argv[0].endswith("paged-kv"):
    # This very import is ``python -m paged_kv`` or the ``paged-kv`` script starting (never a
    # program that merely uses the library): Ctrl-C exits at once, even while JAX imports below
    # (the handler imports nothing itself).
    from paged_kv.cli import install_interrupt_handler

    install_interrupt_handler()

from paged_kv.admission import AdmitResult, admit
from paged_kv.allocate import AppendResult, append
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.manager import BlockManager
from paged_kv.reclaim import free
from paged_kv.prefix_cache import is_cached, reset_prefix_cache
from paged_kv.share import fork, select
from paged_kv.state import BlockManagerState, CacheStats, FreeQueue, init_state
from paged_kv.status import Status
from paged_kv.views import Usage, num_free_blocks, shared_blocks, slots_for, usage

__all__ = [
    "NULL_BLOCK",
    "AdmitResult",
    "AppendResult",
    "BlockManager",
    "BlockManagerState",
    "CacheStats",
    "FreeQueue",
    "ManagerConfig",
    "Status",
    "Usage",
    "admit",
    "append",
    "fork",
    "free",
    "init_state",
    "is_cached",
    "num_free_blocks",
    "reset_prefix_cache",
    "select",
    "shared_blocks",
    "slots_for",
    "usage",
]
