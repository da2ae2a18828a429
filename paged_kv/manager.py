"""``BlockManager``: the jitted operations behind a small class that checks Python inputs.

For scripts and schedulers that do not write jitted code. Every call validates its arguments
first and raises ``ValueError`` (bad value) or ``KeyError`` (unknown sequence) naming the value
and the limit; a rejected call changes nothing. Running out of blocks is not an error: it comes
back as ``Status.NO_FREE_BLOCKS`` for the rows concerned, so the caller can preempt. Statuses come
back as a ``StatusArray``: int32 numpy that prints the names (``StatusArray([OK, NO_FREE_BLOCKS])``).

Batches are padded to power-of-two sizes with padding rows, so a long-running scheduler compiles
each operation only a handful of times.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np

from paged_kv import admission, allocate, prefix_cache, reclaim, share, spans, views
from paged_kv.batch import blocks_held
from paged_kv.config import ManagerConfig
from paged_kv.free_queue import live_entries
from paged_kv.inputs import is_int
from paged_kv.results import ExtendResult
from paged_kv.state import init_state
from paged_kv.status import Status, StatusArray

_jit = functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
_admit = _jit(admission.admit)
_append = _jit(allocate.append)
_fork = _jit(share.fork)
_select = _jit(share.select)
_free = _jit(reclaim.free)
_extend = jax.jit(spans.extend, static_argnums=0, donate_argnums=1, static_argnames=("commit", "max_new"))
_commit = _jit(spans.commit)
_truncate = jax.jit(spans.truncate, static_argnums=0, donate_argnums=1, static_argnames="keep_reserved")
_usage = jax.jit(views.usage, static_argnums=0)
_queue = jax.jit(live_entries)
_reset = _jit(prefix_cache.reset_prefix_cache)


def _bucket(n: int, limit: int) -> int:
    return min(max(8, 1 << max(0, n - 1).bit_length()), max(limit, n))


def _padded(values: Sequence[int], size: int) -> np.ndarray:
    out = np.full((size,), -1, np.int32)
    out[: len(values)] = values
    return out


def _show(v) -> str:
    """``repr`` of a bad value, cut short."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _typed(v) -> str:
    """A bad value with its type: ``int 5``, ``str 'ab'``, ``None``."""
    return "None" if v is None else f"{type(v).__name__} {_show(v)}"


def _as_list(values, what: str, of: str, ndim: int = 1) -> list:
    """The elements of a list-like argument (list, tuple, range, numpy or JAX array of ``ndim``
    dimensions, other iterables); ``ValueError`` for a scalar, None, a string, a mapping or a set."""
    if not isinstance(values, (list, tuple, range)) and hasattr(values, "__array__"):
        array = np.asarray(values)
        if array.ndim != ndim:
            got = _typed(values) if array.ndim == 0 else f"a {array.ndim}-D array of shape {array.shape}"
            raise ValueError(f"{what} must be a sequence of {of}, got {got}")
        return list(array)
    if values is None or isinstance(values, (str, bytes, dict, set, frozenset)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{what} must be a sequence of {of}, got {_typed(values)}")
    try:
        return list(values)
    except TypeError as e:
        raise ValueError(f"{what} must be a sequence of {of}, got {type(values).__name__}: {e}") from None


def _ints(values: list) -> np.ndarray | None:
    """``values`` as int64 numpy when each is a Python or NumPy integer (no bool) that fits, else
    None (the caller then walks the values for a precise error)."""
    if not all(t is int or (issubclass(t, np.integer) and t is not np.bool_) for t in set(map(type, values))):
        return None
    try:
        return np.asarray(values, dtype=np.int64) if values else np.zeros((0,), np.int64)
    except OverflowError:
        return None


def _tokens(values: list, message) -> list[int]:
    """``values`` as ints, each a token id in [0, 2**31); else ``ValueError(message(pos, tok))``
    for the first bad one. One numpy check for the common case; the message is built only for a
    bad value."""
    arr = _ints(values)
    if arr is not None and (arr.size == 0 or (arr.min() >= 0 and arr.max() < 2**31)):
        return arr.tolist()
    for pos, tok in enumerate(values):
        if not is_int(tok) or not 0 <= tok < 2**31:
            raise ValueError(f"{message(pos, tok)} (token ids are ints in [0, 2**31))")
    return [int(t) for t in values]


class BlockManager:
    """Owns a ``BlockManagerState`` and updates it through the jitted operations.

    Example::

        bm = BlockManager(ManagerConfig(num_blocks=1024, block_size=16, max_seqs=8))
        bm.admit([0], [list(range(40))])      # 3 blocks
        bm.fork(0, [1])                        # a second sample shares them
        result = bm.append([0, 1], [7, 8])     # copy-on-write of the partly full last block

    Compilation: each operation is a ``jax.jit`` program, compiled on its first call for each
    config and padded size (the number of sequence ids rounded up to a power of two from 8, and
    for ``admit`` the longest prompt likewise), so that first call takes seconds on a CPU
    (``admit`` and ``append``, which reach the prefix cache, the longest) and later calls of the
    same sizes take milliseconds. The programs are shared by every ``BlockManager`` of the
    process, and JAX's persistent compilation cache (``jax_compilation_cache_dir``) keeps them
    across processes.
    """

    def __init__(self, config: ManagerConfig):
        if not isinstance(config, ManagerConfig):
            raise ValueError(f"config must be a ManagerConfig, got {type(config).__name__}")
        self.config = config
        self.state = init_state(config)

    # -- validation ------------------------------------------------------------------------

    def running(self) -> set[int]:
        return set(np.flatnonzero(np.asarray(self.state.active)).tolist())

    def _check_id(self, sid, what: str) -> int:
        if not is_int(sid):
            raise ValueError(f"{what}: sequence id {_show(sid)} is not an int")
        if not 0 <= sid < self.config.max_seqs:
            raise ValueError(f"{what}: sequence id {sid} out of range [0, {self.config.max_seqs})")
        return int(sid)

    def _check_ids(self, seq_ids: Sequence[int], what: str, arg: str = "seq_ids") -> list[int]:
        ids = _as_list(seq_ids, f"{what}: {arg}", "sequence ids")
        if len(ids) > self.config.max_seqs:
            raise ValueError(f"{what}: {len(ids)} sequence ids in one call; max_seqs is {self.config.max_seqs}")
        arr = _ints(ids)
        if arr is not None and (arr.size == 0 or (arr.min() >= 0 and arr.max() < self.config.max_seqs
                                                  and np.unique(arr).size == arr.size)):
            return arr.tolist()  # the common case in a few numpy calls; the loop below names a bad id
        seen = set()
        for sid in ids:
            sid = self._check_id(sid, what)
            if sid in seen:
                raise ValueError(f"{what}: sequence id {sid} appears more than once in one call")
            seen.add(sid)
        return [int(s) for s in ids]

    def _check_running(self, ids: Sequence[int], what: str) -> None:
        active = np.asarray(self.state.active)
        if all(is_int(i) and 0 <= i < active.size for i in ids) and active[list(ids)].all():
            return
        running = self.running()
        for sid in ids:
            if sid not in running:
                raise KeyError(f"{what}: sequence {sid} is not running")

    def _check_not_running(self, ids: Sequence[int], what: str) -> None:
        running = self.running()
        for sid in ids:
            if sid in running:
                raise ValueError(f"{what}: sequence {sid} is already running")

    # -- operations ------------------------------------------------------------------------

    def admit(
        self,
        seq_ids: Sequence[int],
        prompts: Sequence[Sequence[int]],
        salts: Sequence[int] | None = None,
    ) -> admission.AdmitResult:
        """Starts ``seq_ids[i]`` with prompt ``prompts[i]`` (token ids) and cache salt
        ``salts[i]`` (default 0); returns statuses and cached/shared prompt tokens (numpy)."""
        ids = self._check_ids(seq_ids, "admit")
        prompts = _as_list(prompts, "admit: prompts", "prompts (each a sequence of token ids)", ndim=2)
        if len(prompts) != len(ids):
            raise ValueError(f"admit: {len(ids)} sequence ids but {len(prompts)} prompts")
        prompts = [_as_list(p, f"admit: prompt of sequence {sid}", "token ids") for sid, p in zip(ids, prompts)]
        salts = [0] * len(ids) if salts is None else _as_list(salts, "admit: salts", "ints in [0, 2**32)")
        if len(salts) != len(ids):
            raise ValueError(f"admit: {len(ids)} sequence ids but {len(salts)} salts")
        for sid, salt in zip(ids, salts):
            if not is_int(salt) or not 0 <= salt < 2**32:
                raise ValueError(f"admit: salt {_show(salt)} of sequence {sid} is not an int in [0, 2**32)")
        limit = self.config.max_tokens_per_seq
        for sid, prompt in zip(ids, prompts):
            if not prompt:
                raise ValueError(f"admit: prompt of sequence {sid} is empty")
            if len(prompt) > limit:
                raise ValueError(
                    f"admit: prompt of sequence {sid} has {len(prompt)} tokens; a sequence holds at "
                    f"most {limit} (max_blocks_per_seq={self.config.max_blocks_per_seq} x "
                    f"block_size={self.config.block_size})"
                )
        prompts = [_tokens(prompt, lambda pos, tok, sid=sid: f"admit: prompt of sequence {sid} has invalid "
                                                            f"token id {_show(tok)} at position {pos}")
                   for sid, prompt in zip(ids, prompts)]
        salts = [int(t) for t in salts]
        self._check_not_running(ids, "admit")
        if not ids:
            empty = np.zeros((0,), np.int32)
            return admission.AdmitResult(status=StatusArray(empty), cached_tokens=empty.copy(),
                                         shared_tokens=empty.copy())
        size = _bucket(len(ids), self.config.max_seqs)
        width = _bucket(max(len(p) for p in prompts), limit)
        tokens = np.zeros((size, width), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        lens = _padded([len(p) for p in prompts], size)
        salt_arr = np.zeros((size,), np.uint32)
        salt_arr[: len(ids)] = salts
        self.state, result = _admit(
            self.config, self.state, _padded(ids, size), lens, tokens, salt_arr
        )
        k = len(ids)
        return admission.AdmitResult(
            status=StatusArray(np.asarray(result.status)[:k]),
            cached_tokens=np.asarray(result.cached_tokens)[:k],
            shared_tokens=np.asarray(result.shared_tokens)[:k],
        )

    def append(self, seq_ids: Sequence[int], token_ids: Sequence[int] | None = None) -> allocate.AppendResult:
        """One more token for each sequence; returns statuses, slots and the copy list (numpy).

        ``token_ids[i]`` is the token appended to ``seq_ids[i]``; required with prefix caching
        (a block it fills is cached under its tokens).
        """
        ids = self._check_ids(seq_ids, "append")
        if token_ids is None:
            if self.config.prefix_caching:
                raise ValueError("append: token_ids are required with prefix_caching=True")
            token_ids = [0] * len(ids)
        token_ids = _as_list(token_ids, "append: token_ids", "token ids")
        if len(token_ids) != len(ids):
            raise ValueError(f"append: {len(ids)} sequence ids but {len(token_ids)} token ids")
        token_ids = _tokens(token_ids,
                            lambda pos, tok: f"append: invalid token id {_show(tok)} for sequence {ids[pos]}")
        self._check_running(ids, "append")
        if not ids:
            empty = np.zeros((0,), np.int32)
            return allocate.AppendResult(status=StatusArray(empty), slots=empty.copy(), copy_src=empty.copy(),
                                         copy_dst=empty.copy(), num_copies=0)
        size = _bucket(len(ids), self.config.max_seqs)
        self.state, result = _append(
            self.config, self.state, _padded(ids, size), _padded(token_ids, size)
        )
        k = len(ids)  # with groups, slots and copy lists are [k, G]
        return allocate.AppendResult(
            status=StatusArray(np.asarray(result.status)[:k]),
            slots=np.asarray(result.slots)[:k],
            copy_src=np.asarray(result.copy_src)[:k],
            copy_dst=np.asarray(result.copy_dst)[:k],
            num_copies=int(result.num_copies),
        )

    def fork(self, src: int, dst_ids: Sequence[int]) -> np.ndarray:
        """Each of ``dst_ids`` starts as a sharing copy of running sequence ``src``."""
        src = self._check_id(src, "fork source")
        ids = self._check_ids(dst_ids, "fork", "dst_ids")
        self._check_running([src], "fork source")
        self._check_not_running(ids, "fork")
        if not ids:
            return np.zeros((0,), np.int32)
        size = _bucket(len(ids), self.config.max_seqs)
        self.state, status = _fork(
            self.config, self.state, _padded([src] * len(ids), size), _padded(ids, size)
        )
        return StatusArray(np.asarray(status)[: len(ids)])

    def select(self, dst_ids: Sequence[int], parent_ids: Sequence[int]) -> np.ndarray:
        """Beam reselection: ``dst_ids[i]`` takes ``parent_ids[i]``'s table, all at once."""
        ids = self._check_ids(dst_ids, "select", "dst_ids")
        parents = _as_list(parent_ids, "select: parent_ids", "sequence ids")
        if len(parents) != len(ids):
            raise ValueError(f"select: {len(ids)} destinations but {len(parents)} parents")
        parents = [self._check_id(p, "select parent") for p in parents]
        self._check_running(parents, "select parent")
        if not ids:
            return np.zeros((0,), np.int32)
        size = _bucket(len(ids), self.config.max_seqs)
        self.state, status = _select(
            self.config, self.state, _padded(ids, size), _padded(parents, size)
        )
        return StatusArray(np.asarray(status)[: len(ids)])

    def free(self, seq_ids: Sequence[int]) -> np.ndarray:
        """Ends sequences; their blocks join the back of the free queue, tail first."""
        ids = self._check_ids(seq_ids, "free")
        self._check_running(ids, "free")
        if not ids:
            return np.zeros((0,), np.int32)
        size = _bucket(len(ids), self.config.max_seqs)
        self.state, status = _free(self.config, self.state, _padded(ids, size))
        return StatusArray(np.asarray(status)[: len(ids)])

    def _span_tokens(self, ids: list[int], token_lists, what: str) -> tuple[np.ndarray, np.ndarray]:
        """Per-row token lists as a padded int32 ``[size, K]`` array and int32 ``[size]`` counts."""
        token_lists = _as_list(token_lists, f"{what}: token_ids", "token-id sequences", ndim=2)
        if len(token_lists) != len(ids):
            raise ValueError(f"{what}: {len(ids)} sequence ids but {len(token_lists)} token lists")
        rows = []
        for sid, toks in zip(ids, token_lists):
            toks = _as_list(toks, f"{what}: tokens of sequence {sid}", "token ids")
            if len(toks) > self.config.max_tokens_per_seq:
                raise ValueError(f"{what}: {len(toks)} tokens for sequence {sid}; a sequence holds at most "
                                 f"{self.config.max_tokens_per_seq}")
            rows.append(_tokens(toks, lambda _, t, sid=sid: f"{what}: invalid token id {_show(t)} for sequence {sid}"))
        size = _bucket(len(ids), self.config.max_seqs)
        width = _bucket(max([len(r) for r in rows] + [1]), self.config.max_tokens_per_seq)
        tokens = np.zeros((size, width), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        return tokens, _padded([len(r) for r in rows], size)

    def extend(self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]], *,
               commit: bool = False) -> ExtendResult:
        """Room for the tokens ``token_ids[i]`` after sequence ``seq_ids[i]``'s, uncommitted
        (drafts) unless ``commit`` (``paged_kv.spans.extend``); returns statuses, slots (``[k,
        K]``, ``K`` the longest list; ``[k, K, G]`` with groups) and the copy list (numpy)."""
        ids = self._check_ids(seq_ids, "extend")
        tokens, counts = self._span_tokens(ids, token_ids, "extend")
        self._check_running(ids, "extend")
        k, width = len(ids), max([int(c) for c in counts[: len(ids)]] + [1])
        size = counts.shape[0]
        self.state, result = _extend(self.config, self.state, _padded(ids, size), counts, tokens,
                                     commit=bool(commit))
        return ExtendResult(
            status=StatusArray(np.asarray(result.status)[:k]),
            slots=np.asarray(result.slots)[:k, :width],
            copy_src=np.asarray(result.copy_src)[:k],
            copy_dst=np.asarray(result.copy_dst)[:k],
            num_copies=int(result.num_copies),
        )

    def commit(self, seq_ids: Sequence[int], token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Commits the next ``len(token_ids[i])`` uncommitted tokens of ``seq_ids[i]``, which are
        ``token_ids[i]`` (``paged_kv.spans.commit``); ``BAD_LENGTH`` for more than it holds."""
        ids = self._check_ids(seq_ids, "commit")
        tokens, counts = self._span_tokens(ids, token_ids, "commit")
        self._check_running(ids, "commit")
        self.state, status = _commit(self.config, self.state, _padded(ids, counts.shape[0]), counts, tokens)
        return StatusArray(np.asarray(status)[: len(ids)])

    def truncate(self, seq_ids: Sequence[int], new_lens: Sequence[int], *, keep_reserved: bool = False
                 ) -> np.ndarray:
        """Rolls ``seq_ids[i]`` back to ``new_lens[i]`` tokens, dropping uncommitted ones
        (``paged_kv.spans.truncate``); ``BAD_LENGTH`` below the committed prefix."""
        ids = self._check_ids(seq_ids, "truncate")
        lens = _as_list(new_lens, "truncate: new_lens", "ints")
        if len(lens) != len(ids):
            raise ValueError(f"truncate: {len(ids)} sequence ids but {len(lens)} lengths")
        for sid, n in zip(ids, lens):
            if not is_int(n) or not 0 <= n <= self.config.max_tokens_per_seq:
                raise ValueError(f"truncate: length {_show(n)} of sequence {sid} is not an int in "
                                 f"[0, {self.config.max_tokens_per_seq}]")
        self._check_running(ids, "truncate")
        if not ids:
            return np.zeros((0,), np.int32)
        size = _bucket(len(ids), self.config.max_seqs)
        self.state, status = _truncate(self.config, self.state, _padded(ids, size), _padded([int(n) for n in lens],
                                       size), keep_reserved=bool(keep_reserved))
        return StatusArray(np.asarray(status)[: len(ids)])

    # -- views -----------------------------------------------------------------------------

    def num_committed(self, seq_id: int) -> int:
        """Committed tokens of sequence ``seq_id`` (its others are drafts, see ``extend``)."""
        sid = self._check_id(seq_id, "num_committed")
        return int(self.state.num_committed[sid])

    def table(self, seq_id: int) -> list[int]:
        """Physical block ids of a running sequence, first block first (group 0's, with groups)."""
        sid = self._check_id(seq_id, "table")
        self._check_running([sid], "table")
        held = int(blocks_held(self.config, self.state.num_tokens[sid]))
        return np.asarray(self.state.block_tables[sid, :held]).tolist()

    def tables(self, seq_id: int) -> list[list[int]]:
        """Every group's physical block ids of a running sequence (``NULL_BLOCK`` for a window
        group's reclaimed prefix), group by group; ``[table(seq_id)]`` without groups."""
        sid = self._check_id(seq_id, "tables")
        self._check_running([sid], "tables")
        held = int(blocks_held(self.config, self.state.num_tokens[sid]))
        return np.asarray(self.state.tables[:, sid, :held]).tolist()

    def num_tokens(self, seq_id: int) -> int:
        """Tokens held by sequence ``seq_id``."""
        sid = self._check_id(seq_id, "num_tokens")
        return int(self.state.num_tokens[sid])

    def ref_count(self, block: int) -> int:
        """Reference count of physical block ``block``."""
        if not is_int(block):
            raise ValueError(f"ref_count: block {_show(block)} is not an int")
        if not 0 <= block < self.config.num_blocks:
            raise ValueError(f"ref_count: block {block} out of range [0, {self.config.num_blocks})")
        return int(self.state.ref_count[int(block)])

    def free_queue(self) -> list[int]:
        """Free blocks front (next allocated) to back (most recently freed). O(pool)."""
        q = np.asarray(_queue(self.state.queue))
        return q[q >= 0].tolist()

    def cached_blocks(self) -> list[int]:
        """Blocks that hold a prefix-cache hash (held or free), ascending. O(pool)."""
        return np.flatnonzero(np.asarray(self.state.cache.slot) >= 0).tolist()

    def reset_prefix_cache(self) -> int:
        """Drops the hash of every cached block no request holds; returns how many."""
        self.state, dropped = _reset(self.config, self.state)
        return int(dropped)

    def cache_stats(self) -> dict[str, float]:
        """Prefix-cache counters and the hit rate (hit tokens / query tokens)."""
        st = self.state.cache.stats
        out = {k: int(getattr(st, k)) for k in ("lookups", "query_tokens", "hit_tokens", "evictions")}
        out["hit_rate"] = out["hit_tokens"] / out["query_tokens"] if out["query_tokens"] else 0.0
        out["cached_blocks"] = int(self.state.cache.table.num_live)
        return out

    def usage(self) -> dict[str, int]:
        u = _usage(self.config, self.state)
        return {k: int(getattr(u, k)) for k in ("used", "free", "shared", "table_entries", "running")}


__all__ = ["BlockManager", "Status", "StatusArray"]
