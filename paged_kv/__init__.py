"""paged-kv: paged KV-cache management for LLM inference, as pure, jittable JAX functions.

Every operation has the form ``op(config, state, inputs) -> (state, outputs)``: ``config`` is a
static ``ManagerConfig`` (pass it as a static argument to ``jax.jit``), ``state`` an immutable
``BlockManagerState`` pytree. For code that does not jit, ``BlockManager`` wraps the operations
with input validation.
"""

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
