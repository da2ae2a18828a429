"""Static configuration of the block manager.

The config is a frozen, hashable dataclass so that it can be a static argument of ``jax.jit``:
two equal configs hit the same compiled computation. Every field is checked on construction and
a bad value raises a ``ValueError`` that names the field, the value and the limit.
"""

from __future__ import annotations

import dataclasses

from paged_kv.attention_spec import AttentionSpec, ChunkedLocal, Full, SlidingWindow

# Slot indices (block_id * block_size + offset) are int32 on the device.
_INT32_MAX = 2**31 - 1

NULL_BLOCK = 0
"""The reserved null block: never allocated or freed; padding rows write into it and unused
block-table entries hold it."""


TARGETS = ("auto", "cpu", "gpu")
"""Values of ``ManagerConfig.target``."""

GROUP_KINDS = ("full", "window", "chunked")
"""Values of ``Group.kind`` (``AttentionSpec.kind`` of ``paged_kv.attention_spec``)."""


@dataclasses.dataclass(frozen=True)
class Group:
    """One KV-cache group: the layers of a model that share an attention type (vLLM's
    ``KVCacheGroupSpec``). Every group of a manager has its own block table per sequence; all
    share one block size, one pool, one free queue and one prefix cache. The attention rules
    (which blocks are skipped, what a hit needs) are its ``spec``'s
    (``paged_kv.attention_spec``); ``Group.of(spec)`` builds one from a spec.

    Attributes:
      kind: ``"full"`` (every earlier token is attended), ``"window"`` (sliding window: a
        query at position ``p`` attends keys ``p - window < k <= p``) or ``"chunked"`` (chunked
        local: keys ``k`` with ``k // chunk == p // chunk``, ``k <= p``).
      window: tokens in the window (>= 1) for ``"window"``; else 0.
      chunk: tokens per chunk (>= 1) for ``"chunked"``; else 0.
    """

    kind: str
    window: int = 0
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"Group.kind must be one of {GROUP_KINDS}, got {self.kind!r}")
        if self.kind != "window" and self.window != 0:
            raise ValueError(f"Group({self.kind!r}) takes no window, got window={self.window!r}")
        if self.kind != "chunked" and self.chunk != 0:
            raise ValueError(f"Group({self.kind!r}) takes no chunk, got chunk={self.chunk!r}")
        if self.kind == "window":
            _check_int("Group.window", self.window, 1)
            if self.window > _INT32_MAX:
                raise ValueError(f"Group.window must be <= {_INT32_MAX}, got {self.window}")
        if self.kind == "chunked":
            _check_int("Group.chunk", self.chunk, 1)
            if self.chunk > _INT32_MAX:
                raise ValueError(f"Group.chunk must be <= {_INT32_MAX}, got {self.chunk}")

    @classmethod
    def of(cls, spec: AttentionSpec) -> Group:
        """The group of an ``AttentionSpec`` (``Full()``, ``SlidingWindow(W)``, ``ChunkedLocal(C)``)."""
        if isinstance(spec, SlidingWindow):
            return cls("window", spec.window)
        if isinstance(spec, ChunkedLocal):
            return cls("chunked", chunk=spec.chunk)
        if isinstance(spec, Full):
            return cls("full")
        raise ValueError(f"spec must be an AttentionSpec, got {type(spec).__name__} {spec!r}")

    @property
    def spec(self) -> AttentionSpec:
        """The group's ``AttentionSpec``, which holds its rules."""
        if self.kind == "window":
            return SlidingWindow(self.window)
        return ChunkedLocal(self.chunk) if self.kind == "chunked" else Full()

    @property
    def is_window(self) -> bool:
        """A sliding-window group (the only kind with sparse retention, ``reach_blocks``)."""
        return self.kind == "window"

    @property
    def is_full(self) -> bool:
        """Full attention: never reclaims, its hit needs every block (a verified chain)."""
        return self.kind == "full"

    def skipped_blocks(self, computed: int, block_size: int) -> int:
        """Leading blocks that no query after ``computed`` tokens reads (``spec.skipped_blocks``:
        a window's before ``computed - window + 1``, a chunk's before ``computed // chunk *
        chunk``; 0 for a full group). Plain-Python form of ``groups.skipped_blocks``."""
        return self.spec.skipped_blocks(computed, block_size)

    def hit_start(self, h: int, block_size: int) -> int:
        """First block of the cached run a prefix hit of ``h`` blocks needs (``spec.hit_start``)."""
        return self.spec.hit_start(h, block_size)

    @property
    def caches_blocks(self) -> bool:
        """Whether the group's full blocks are cached (``spec.caches_blocks``). Not for a window
        of 1 token: a query then reads only its own token, no prefix hit needs a cached block of
        the group, and vLLM 0.33 keeps no hash for them either (its ``reachable_block_mask`` is
        all False)."""
        return self.spec.caches_blocks

    def hit_blocks(self, block_size: int) -> int:
        """Trailing cached blocks a prefix hit of this window group needs (vLLM's
        ``cdiv(window - 1, block_size)``, at least 1); 0 for a full group (it needs all). A
        chunked group's depends on the hit (``hit_start``)."""
        return max(1, self.reach_blocks(block_size)) if self.is_window else 0

    def reach_blocks(self, block_size: int) -> int:
        """Blocks a sparse-retention window group keeps cached before each reachable boundary:
        vLLM's ``cdiv(window - 1, block_size)`` (0 for a window of 1 token, which caches
        nothing); 0 for any other group."""
        return -(-(self.window - 1) // block_size) if self.is_window else 0


DEFAULT_GROUPS = (Group("full"),)
"""``ManagerConfig.groups`` by default: one full-attention group."""

RETENTION_INTERVALS = (0, None)
"""Values of ``ManagerConfig.prefix_cache_retention_interval``: ``0`` sparse, ``None`` dense."""


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a Python int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class ManagerConfig:
    """Sizes of the block pool and of the per-sequence block tables.

    Attributes:
      num_blocks: physical KV blocks in the pool, the null block included (so ``num_blocks - 1``
        can be allocated).
      block_size: tokens per block; a power of two (the attention kernels tile by it).
      max_seqs: rows of the block-table array: sequences that can be running at once.
      max_blocks_per_seq: columns of the block-table array; a sequence holds at most
        ``max_blocks_per_seq * block_size`` tokens.
      prefix_caching: keep a hash of every full block so that later requests with the same
        prefix (and salt) reuse it; on by default, as in vLLM. Off, freed blocks all join the back
        of the free queue and nothing is hashed.
      uncached_to_front: with prefix caching, a freed block that is not cached (a partly full
        last block) can never be a hit, so it joins the *front* of the free queue and is reused
        before any cached block (vLLM 0.33 does the same). False puts every freed block at
        the back, for comparing eviction policies.
      groups: the KV-cache groups (``Group``, or an ``AttentionSpec`` that stands for
        ``Group.of(spec)``), default one full-attention group. With more
        than one group, or a local group, every operation keeps one table per group
        (``BlockManagerState.tables``), reclaims a local group's blocks as no later query reads them,
        and runs its sequential grouped form (``paged_kv.groups``) on every platform; the default
        runs the same programs as before groups existed.
      target: which form of each operation is traced (``scan.per_platform``): ``"cpu"`` (skips
        and loops that run only when needed), ``"gpu"`` (straight-line code behind one predicate
        per call), or ``"auto"`` (both, the lowering keeps the one for its platform: a CPU's form
        on a CPU, the GPU form elsewhere). Every form gives the same results bit for bit.
      prefix_cache_retention_interval: which full blocks of a window group get a hash (vLLM 0.33's
        ``KVCacheConfig.prefix_cache_retention_interval``; full groups always cache every full
        block). ``0`` (sparse, the default, as vLLM's engine default ``CacheConfig``): only the
        blocks a later request can reach, the ``Group.reach_blocks`` blocks ending at the prompt
        boundary (block ``(prompt_len - 1) // block_size``, exclusive) and at a shared-prefix
        junction (admission: where the first full group's, or else the first window group's,
        own hit ends, when the hybrid hit stops before it); blocks filled by ``append`` never.
        A window block without a hash that is reclaimed or freed joins the front of the free
        queue (``uncached_to_front``), reused before any cached block. ``None`` (dense, vLLM's
        ``KVCacheConfig`` built by hand): every full block, as a full group. One value for the
        whole manager, as in vLLM, where it is a field of the model's ``KVCacheConfig``, not of
        a group's spec.
    """

    num_blocks: int
    block_size: int = 16
    max_seqs: int = 256
    max_blocks_per_seq: int = 128
    prefix_caching: bool = True
    uncached_to_front: bool = True
    target: str = "auto"
    groups: tuple[Group, ...] = DEFAULT_GROUPS
    prefix_cache_retention_interval: int | None = 0

    def __post_init__(self) -> None:
        if isinstance(self.groups, list):
            object.__setattr__(self, "groups", tuple(self.groups))
        if isinstance(self.groups, tuple):  # an AttentionSpec stands for its Group
            object.__setattr__(self, "groups", tuple(
                Group.of(g) if isinstance(g, AttentionSpec) else g for g in self.groups))
        if not isinstance(self.groups, tuple) or not self.groups:
            raise ValueError(f"groups must be a non-empty tuple of Group, got {self.groups!r}")
        for i, g in enumerate(self.groups):
            if not isinstance(g, Group):
                raise ValueError(f"groups[{i}] must be a Group, got {type(g).__name__} {g!r}")
        if len(self.groups) > 64:
            raise ValueError(f"at most 64 groups, got {len(self.groups)}")
        _check_int("num_blocks", self.num_blocks, 2)
        _check_int("block_size", self.block_size, 1)
        _check_int("max_seqs", self.max_seqs, 1)
        _check_int("max_blocks_per_seq", self.max_blocks_per_seq, 1)
        for name in ("prefix_caching", "uncached_to_front"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        retention = self.prefix_cache_retention_interval
        if not (retention is None or (type(retention) is int and retention in RETENTION_INTERVALS)):
            raise ValueError(
                f"prefix_cache_retention_interval must be 0 (sparse) or None (dense), got {retention!r}")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks * self.block_size > _INT32_MAX:
            raise ValueError(
                f"num_blocks * block_size = {self.num_blocks * self.block_size} overflows int32 "
                f"slot indices (limit {_INT32_MAX})"
            )
        if 2 * self.num_blocks > _INT32_MAX:
            raise ValueError(f"num_blocks={self.num_blocks} too large for the int32 free queue")

    @property
    def grouped(self) -> bool:
        """Whether the groups differ from the default single full group (the grouped forms run)."""
        return self.groups != DEFAULT_GROUPS

    def sparse(self, group: Group) -> bool:
        """Whether ``group`` caches only its reachable blocks (a window group under
        ``prefix_cache_retention_interval == 0``)."""
        return group.is_window and self.prefix_cache_retention_interval == 0

    @property
    def lead_groups(self) -> tuple[int, ...]:
        """The groups whose own prefix hit vLLM's hybrid coordinator looks up first and records
        as ``longest_hit_length`` (where a sparse window group's shared-prefix junction lies):
        every full group (vLLM looks up full attention first, groups of equal specs together),
        or, without one, every group equal to the first."""
        first = next((g for g in self.groups if g.is_full), self.groups[0])
        return tuple(i for i, g in enumerate(self.groups) if g == first)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def max_tokens_per_seq(self) -> int:
        """Longest sequence a block table can describe."""
        return self.max_blocks_per_seq * self.block_size

    @property
    def queue_capacity(self) -> int:
        """Entries in the free-queue ring buffer.

        Twice the pool: live entries never exceed ``num_blocks - 1``, so a full ring always holds
        at least ``num_blocks`` stale entries (left behind by lazy deletion) for a compaction to
        drop, which keeps compaction amortised O(1) per stale entry.
        """
        return 2 * self.num_blocks

    @property
    def hash_table_size(self) -> int:
        """Slots of the prefix-cache hash table: a power of two >= 4 * num_blocks, so live
        entries fill at most a quarter of it and probes stay short."""
        return 1 << (4 * self.num_blocks - 1).bit_length()

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (lazy allocation: no spare block)."""
        return -(-num_tokens // self.block_size)
