"""paged-kv: paged KV-cache management for LLM inference, as pure, jittable JAX functions.

Every operation has the form ``op(config, state, inputs) -> (state, outputs)``: ``config`` is a
static ``ManagerConfig`` (pass it as a static argument to ``jax.jit``), ``state`` an immutable
``BlockManagerState`` pytree. For code that does not jit, ``BlockManager`` wraps the operations
with input validation.
"""

from paged_kv.allocate import AppendResult, admit, append
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.manager import BlockManager
from paged_kv.reclaim import free
from paged_kv.share import fork, select
from paged_kv.state import BlockManagerState, FreeQueue, init_state
from paged_kv.status import Status
from paged_kv.views import Usage, num_free_blocks, shared_blocks, slots_for, usage

__all__ = [
    "NULL_BLOCK",
    "AppendResult",
    "BlockManager",
    "BlockManagerState",
    "FreeQueue",
    "ManagerConfig",
    "Status",
    "Usage",
    "admit",
    "append",
    "fork",
    "free",
    "init_state",
    "num_free_blocks",
    "select",
    "shared_blocks",
    "slots_for",
    "usage",
]
