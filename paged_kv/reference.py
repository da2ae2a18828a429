"""A plain-Python block manager with the same semantics as the jitted operations.

It processes each batch one row at a time with lists, dicts and an ordered dict as the free queue,
which makes it easy to read and to trust. Its prefix cache is keyed by the exact prefix (salt and
every token so far), not by a hash, so it is also the ground truth for the hashed cache. As in
vLLM's ``BlockPool``, every full block is cached, duplicates included: a key holds its blocks in
the order they were cached, a lookup takes the oldest, and evicting one leaves the others. The
property tests run long random operation sequences through both and compare every output and the
whole state; the benchmarks use it as the baseline of a conventional host-side manager.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.reference_spans import SpanOps
from paged_kv.status import Status


class ReferenceBlockManager(SpanOps):
    def __init__(self, config: ManagerConfig):
        self.config = config
        n = config.num_blocks
        self.ref_count = [0] * n
        # Insertion order = queue order; front = first key.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, n))
        self.tables: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}
        self.uncommitted: dict[int, int] = {}  # spans (``reference_spans``)
        self.reserved: dict[int, list[int]] = {}
        # Prefix cache.
        self.seq_tokens: dict[int, list[int]] = {}
        self.seq_salt: dict[int, int] = {}
        # exact key (salt, prefix tokens) -> its cached blocks, oldest first
        self.cached: dict[tuple, list[int]] = {}
        self.key_of: dict[int, tuple] = {}
        self.block_tokens: dict[int, list[int]] = {}
        self.stats = dict(lookups=0, query_tokens=0, hit_tokens=0, evictions=0)

    # -- helpers ---------------------------------------------------------------------------

    def _row_status(self, sid: int, seen: set[int], *, must_be_active: bool) -> Status:
        if sid < 0:
            return Status.PADDING
        repeated = sid in seen
        seen.add(sid)
        if sid >= self.config.max_seqs or repeated or (sid in self.tables) != must_be_active:
            return Status.BAD_SEQUENCE
        return Status.OK

    def _uncache(self, block: int) -> bool:
        key = self.key_of.pop(block, None)
        if key is None:
            return False
        blocks = self.cached[key]
        blocks.remove(block)
        if not blocks:
            del self.cached[key]
        return True

    def _take(self) -> int:
        """The front free block, its hash dropped (it is about to get new contents); the caller
        counts its references."""
        block, _ = self.free_queue.popitem(last=False)
        if self._uncache(block):
            self.stats["evictions"] += 1
        return block

    def _cache(self, block: int, key: tuple) -> None:
        self.cached.setdefault(key, []).append(block)
        self.key_of[block] = key

    def _lookup(self, key: tuple) -> int | None:
        """The oldest cached block of an exact key."""
        blocks = self.cached.get(key)
        return blocks[0] if blocks else None

    def _release(self, tables: list[list[int]]) -> None:
        """Tail first, table by table; cached blocks to the back, the rest to the front."""
        front = []
        for table in tables:
            for block in reversed(table):
                self.ref_count[block] -= 1
                if self.ref_count[block] == 0:
                    cfg = self.config
                    if not (cfg.prefix_caching and cfg.uncached_to_front) or block in self.key_of:
                        self.free_queue[block] = None
                    else:
                        front.append(block)
        for block in reversed(front):
            self.free_queue[block] = None
            self.free_queue.move_to_end(block, last=False)

    def _key(self, salt: int, tokens: Sequence[int], n: int) -> tuple:
        return (salt, tuple(tokens[:n]))

    # -- operations ------------------------------------------------------------------------

    def admit(self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]],
              salts: Sequence[int] | None = None, max_len: int | None = None) -> list[tuple]:
        """Returns (status, cached_tokens, shared_tokens) per row.

        ``max_len`` is the width of the padded token array of the jitted call: longer prompts are
        ``BAD_LENGTH`` there.
        """
        cfg, bs = self.config, self.config.block_size
        salts = [0] * len(seq_ids) if salts is None else list(salts)
        limit = cfg.max_tokens_per_seq if max_len is None else min(max_len, cfg.max_tokens_per_seq)
        seen, out, plans, planned = set(), [], [], {}
        for row, (sid, toks, salt) in enumerate(zip(seq_ids, prompts, salts)):
            status = self._row_status(sid, seen, must_be_active=False)
            if status == Status.OK and not 1 <= len(toks) <= limit:
                status = Status.BAD_LENGTH
            out.append([status, 0, 0])
            if status != Status.OK:
                continue
            n_blocks = cfg.blocks_for(len(toks))
            refs: list[tuple] = []
            n_cached = 0
            if cfg.prefix_caching:
                n_full, n_cacheable = len(toks) // bs, (len(toks) - 1) // bs
                for j in range(n_cacheable):  # 1. cached prefix
                    block = self._lookup(self._key(salt, toks, (j + 1) * bs))
                    if block is None:
                        break
                    refs.append(("cached", block))
                n_cached = len(refs)
                for j in range(n_cached, n_cacheable):  # 2. computed by an earlier request
                    owner = planned.get(self._key(salt, toks, (j + 1) * bs))
                    if owner is None:
                        break
                    refs.append(owner)
                for j in range(len(refs), n_blocks):
                    refs.append(("new", row, j))
                    if j < n_full:
                        planned.setdefault(self._key(salt, toks, (j + 1) * bs), ("new", row, j))
            else:
                refs = [("new", row, j) for j in range(n_blocks)]
            plans.append((row, sid, list(toks), salt, refs, n_cached))

        # First come, first served: fresh blocks plus free cached blocks pulled out of the queue.
        cost_so_far, blocked, pulled, accepted = 0, False, set(), []
        for plan in plans:
            row, refs = plan[0], plan[4]
            fresh = sum(r == ("new", row, j) for j, r in enumerate(refs))
            pulls = {r[1] for r in refs if r[0] == "cached" and self.ref_count[r[1]] == 0} - pulled
            pulled |= pulls
            cost = fresh + len(pulls)
            blocked = blocked or cost_so_far + cost > len(self.free_queue)
            if blocked:
                out[row][0] = Status.NO_FREE_BLOCKS
                continue
            cost_so_far += cost
            accepted.append((plan, pulls))

        for _, pulls in accepted:
            for block in pulls:
                del self.free_queue[block]
        new_blocks = {}
        for plan, _ in accepted:
            row, refs = plan[0], plan[4]
            for j, r in enumerate(refs):
                if r == ("new", row, j):
                    new_blocks[r] = self._take()
        for plan, _ in accepted:
            row, sid, toks, salt, refs, n_cached = plan
            table = [r[1] if r[0] == "cached" else new_blocks[r] for r in refs]
            for block in table:
                self.ref_count[block] += 1
            self.tables[sid], self.num_tokens[sid] = table, len(toks)
            self.seq_tokens[sid], self.seq_salt[sid] = toks, salt
            n_hit = sum(r[0] == "cached" or r[1] != row for r in refs)
            out[row][1:] = [n_cached * bs, (n_hit - n_cached) * bs]
            if cfg.prefix_caching:
                for j, r in enumerate(refs):
                    if r == ("new", row, j):
                        self.block_tokens[table[j]] = (toks[j * bs:(j + 1) * bs] + [0] * bs)[:bs]
                        if j < len(toks) // bs:
                            self._cache(table[j], self._key(salt, toks, (j + 1) * bs))
                self.stats["lookups"] += 1
                self.stats["query_tokens"] += len(toks)
                self.stats["hit_tokens"] += n_hit * bs
        return [tuple(o) for o in out]

    def append(self, seq_ids: Sequence[int], token_ids: Sequence[int] | None = None
               ) -> tuple[list[Status], list[int], list[int], list[int]]:
        """Returns (statuses, slots, copy_src, copy_dst), one entry per row."""
        cfg, bs, seen, blocked = self.config, self.config.block_size, set(), False
        token_ids = [0] * len(seq_ids) if token_ids is None else list(token_ids)
        statuses, slots, src, dst, writes = [], [], [], [], []
        for sid, token in zip(seq_ids, token_ids):  # allocation (and eviction) first, every row
            status = self._row_status(sid, seen, must_be_active=True)
            slot, copy = NULL_BLOCK * bs, (NULL_BLOCK, NULL_BLOCK)
            if status == Status.OK and (self.uncommitted.get(sid) or any(self._reserved(sid))):
                status = Status.BAD_LENGTH  # a row with a span extends instead
            if status == Status.OK:
                table, n = self.tables[sid], self.num_tokens[sid]
                offset = n % bs
                if offset == 0 and len(table) >= cfg.max_blocks_per_seq:
                    status = Status.TABLE_FULL
                else:
                    fresh = offset == 0
                    shared = not fresh and self.ref_count[table[-1]] > 1
                    if (fresh or shared) and (blocked or not self.free_queue):
                        blocked = True
                        status = Status.NO_FREE_BLOCKS
                    elif fresh:
                        table.append(self._take())
                        self.ref_count[table[-1]] = 1
                    elif shared:
                        old = table[-1]
                        self.ref_count[old] -= 1
                        table[-1] = self._take()
                        self.ref_count[table[-1]] = 1
                        copy = (old, table[-1])
                        if cfg.prefix_caching:
                            self.block_tokens[table[-1]] = list(self.block_tokens[old])
                    if status == Status.OK:
                        self.num_tokens[sid] = n + 1
                        slot = table[-1] * bs + offset
                        writes.append((sid, offset, token))
            statuses.append(status)
            slots.append(slot)
            src.append(copy[0])
            dst.append(copy[1])
        if cfg.prefix_caching:  # then tokens, and blocks they fill, in batch order
            for sid, offset, token in writes:
                table = self.tables[sid]
                self.block_tokens.setdefault(table[-1], [0] * bs)[offset] = token
                self.seq_tokens[sid].append(token)
                if offset == bs - 1:
                    key = self._key(self.seq_salt[sid], self.seq_tokens[sid], len(self.seq_tokens[sid]))
                    self._cache(table[-1], key)
        return statuses, slots, src, dst

    def _take_statuses(self, dst_ids, src_ids, dst_must_be_free: bool) -> tuple[list[Status], list]:
        """fork/select's per-row statuses and the (destination, source) moves that go ahead."""
        seen, statuses = set(), []
        for d, s in zip(dst_ids, src_ids):
            if d < 0:
                statuses.append(Status.PADDING)
                continue
            bad = d >= self.config.max_seqs or d in seen or (dst_must_be_free and d in self.tables)
            seen.add(d)
            bad = bad or s < 0 or s not in self.tables or self.uncommitted.get(s, 0) > 0
            statuses.append(Status.BAD_SEQUENCE if bad else Status.OK)
        return statuses, [(d, s) for d, s, st in zip(dst_ids, src_ids, statuses) if st == Status.OK]

    def _take_tables(self, dst_ids, src_ids, *, dst_must_be_free: bool) -> list[Status]:
        statuses, moves = self._take_statuses(dst_ids, src_ids, dst_must_be_free)
        # Every row switches at once: read all sources before touching anything.
        new = {d: (list(self.tables[s]), self.num_tokens[s], list(self.seq_tokens.get(s, [])),
                   self.seq_salt.get(s, 0)) for d, s in moves}
        for d, _ in moves:
            for block in new[d][0]:
                self.ref_count[block] += 1
        self._release([self.tables[d] + (self.reserved.pop(d, None) or [[]])[0] for d, _ in moves if d in self.tables])
        for d, (table, n, toks, salt) in new.items():
            self.tables[d], self.num_tokens[d], self.uncommitted[d] = table, n, 0
            self.seq_tokens[d], self.seq_salt[d] = toks, salt
        return statuses

    def fork(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[Status]:
        return self._take_tables(dst_ids, src_ids, dst_must_be_free=True)

    def select(self, dst_ids: Sequence[int], parent_ids: Sequence[int]) -> list[Status]:
        return self._take_tables(dst_ids, parent_ids, dst_must_be_free=False)

    def free(self, seq_ids: Sequence[int]) -> list[Status]:
        seen, out, released = set(), [], []
        for sid in seq_ids:
            status = self._row_status(sid, seen, must_be_active=True)
            if status == Status.OK:
                released.append(self.tables.pop(sid) + (self.reserved.pop(sid, None) or [[]])[0])
                del self.num_tokens[sid]
                self.uncommitted.pop(sid, None)
                self.seq_tokens.pop(sid, None)
                self.seq_salt.pop(sid, None)
            out.append(status)
        self._release(released)
        return out

    def reset_prefix_cache(self) -> int:
        idle = [b for b in list(self.key_of) if self.ref_count[b] == 0]
        for block in idle:
            self._uncache(block)
        return len(idle)

    # -- views -----------------------------------------------------------------------------

    def queue_order(self) -> list[int]:
        return list(self.free_queue)

    def cached_blocks(self) -> set[int]:
        return set(self.key_of)


class GroupedReference(ReferenceBlockManager):
    """The plain-Python form of ``paged_kv.groups`` (a ``ManagerConfig`` with KV-cache groups):
    one table per group, window reclaim in ``append``, per-group prefix hits with the hybrid
    rule, rows one at a time with first come, first served, the retention rule of
    ``ManagerConfig.prefix_cache_retention_interval`` (``_caches``). Cache keys are exact:
    ``(group, salt, prefix tokens)``. ``tables[sid]`` is the list of the groups' tables (``NULL_BLOCK``
    for a reclaimed prefix); ``null_prefix[sid][g]`` the length of that prefix."""

    def __init__(self, config: ManagerConfig):
        super().__init__(config)
        self.null_prefix: dict[int, list[int]] = {}

    def _gkey(self, g: int, salt: int, tokens: Sequence[int], n: int) -> tuple:
        return (g, salt, tuple(tokens[:n]))

    def _release_blocks(self, blocks: list[int]) -> None:
        """Columns of one table (first column first) lose one reference each, tail first, with
        the order rules of ``_release``."""
        self._release([blocks])

    def _held(self, sid: int, g: int) -> list[int]:
        return self.tables[sid][g][self.null_prefix[sid][g]:] + self._reserved(sid)[g]

    def _hit_length(self, toks: list[int], salt: int) -> tuple[int, int, list[list[int | None]]]:
        """``(h, lead, cands)``: the hybrid hit ``h`` (blocks), the lead groups' own hit ``lead``
        (``ManagerConfig.lead_groups``; vLLM's ``longest_hit_length``, ``>= h``) and every group's cached
        block per position (None: not cached)."""
        cfg, bs = self.config, self.config.block_size
        n_cacheable = (len(toks) - 1) // bs
        cands = [[self._lookup(self._gkey(g, salt, toks, (j + 1) * bs)) for j in range(n_cacheable)]
                 for g in range(cfg.num_groups)]

        def accepts(g: int, h: int) -> bool:
            group = cfg.groups[g]
            lo = group.hit_start(h, bs)
            return all(c is not None for c in cands[g][lo:h])

        def best(gs) -> int:
            return max(h for h in range(n_cacheable + 1) if all(accepts(g, h) for g in gs))

        return best(range(cfg.num_groups)), best(cfg.lead_groups), cands

    def _caches(self, g: int, j: int, n_prompt: int, h: int, lead: int) -> bool:
        """Whether group ``g`` hashes the full block at position ``j`` of a prompt of
        ``n_prompt`` tokens admitted with hit ``h`` and lead hit ``lead``: every one, except
        in a window of 1 token (none) and under sparse retention, where only the
        ``reach_blocks`` blocks before the prompt boundary ``(n_prompt - 1) // bs`` and before
        the shared-prefix junction ``lead`` (when ``lead > h``) do."""
        cfg, group = self.config, self.config.groups[g]
        if not group.caches_blocks:
            return False
        if not cfg.sparse(group):
            return True
        need = group.reach_blocks(cfg.block_size)
        ends = [(n_prompt - 1) // cfg.block_size] + ([lead] if lead > h else [])
        return any(end - need <= j < end for end in ends)

    def admit(self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]],
              salts: Sequence[int] | None = None, max_len: int | None = None,
              chunk: Sequence[int] | None = None) -> list[tuple]:
        """``chunk``: per row, the prefill chunk (chunked admission: blocks to the end of the chunk
        that holds the first uncomputed token; None: the whole prompt)."""
        cfg, bs, groups = self.config, self.config.block_size, self.config.groups
        salts = [0] * len(seq_ids) if salts is None else list(salts)
        chunk = [cfg.max_tokens_per_seq] * len(seq_ids) if chunk is None else list(chunk)
        limit = cfg.max_tokens_per_seq if max_len is None else min(max_len, cfg.max_tokens_per_seq)
        seen, out, blocked, pending = set(), [], False, set()
        for sid, toks, salt, first in zip(seq_ids, prompts, salts, chunk):
            toks = list(toks)
            status = self._row_status(sid, seen, must_be_active=False)
            if status == Status.OK and (not 1 <= len(toks) <= limit or first < 1):
                status = Status.BAD_LENGTH
            if status != Status.OK:
                out.append((status, 0, 0))
                continue
            h, lead, cands = self._hit_length(toks, salt) if cfg.prefix_caching else (0, 0, [[]] * len(groups))
            held = min(len(toks), (h * bs // first + 1) * first)
            n_blocks = cfg.blocks_for(held)
            skip = [g.skipped_blocks(h * bs, bs) for g in groups]
            hits = [cands[g][skip[g]:h] for g in range(len(groups))]
            pulls = [b for hs in hits for b in hs if self.ref_count[b] == 0]
            if blocked or len(groups) * (n_blocks - h) + len(pulls) > len(self.free_queue):
                blocked = True
                out.append((Status.NO_FREE_BLOCKS, 0, 0))
                continue
            for b in pulls:
                del self.free_queue[b]
            fresh = [[self._take() for _ in range(n_blocks - h)] for _ in groups]
            n_cached = min([next((skip[g] + i for i, b in enumerate(hits[g]) if b in pending), h)
                            for g in range(len(groups))])
            tables = []
            for g in range(len(groups)):
                table = [NULL_BLOCK] * skip[g] + hits[g] + fresh[g]
                for b in hits[g] + fresh[g]:
                    self.ref_count[b] += 1
                pending.update(fresh[g])
                if cfg.prefix_caching:
                    for j, b in enumerate(fresh[g], start=h):
                        self.block_tokens[b] = (toks[j * bs:(j + 1) * bs] + [0] * bs)[:bs]
                        if j < held // bs and self._caches(g, j, len(toks), h, lead):
                            self._cache(b, self._gkey(g, salt, toks, (j + 1) * bs))
                tables.append(table)
            self.tables[sid], self.num_tokens[sid], self.null_prefix[sid] = tables, held, skip
            self.seq_tokens[sid], self.seq_salt[sid] = toks[:held], salt
            if cfg.prefix_caching:
                self.stats["lookups"] += 1
                self.stats["query_tokens"] += len(toks)
                self.stats["hit_tokens"] += h * bs
            out.append((Status.OK, n_cached * bs, (h - n_cached) * bs))
        return out

    def append(self, seq_ids: Sequence[int], token_ids: Sequence[int] | None = None
               ) -> tuple[list[Status], list[list[int]], list[list[int]], list[list[int]]]:
        """Returns (statuses, slots, copy_src, copy_dst); the last three ``[row][group]``."""
        cfg, bs, groups = self.config, self.config.block_size, self.config.groups
        token_ids = [0] * len(seq_ids) if token_ids is None else list(token_ids)
        seen, blocked = set(), False
        statuses, slots, src, dst = [], [], [], []
        nulls = [NULL_BLOCK] * len(groups)
        for sid, token in zip(seq_ids, token_ids):
            status = self._row_status(sid, seen, must_be_active=True)
            slot, c_src, c_dst = [NULL_BLOCK * bs] * len(groups), list(nulls), list(nulls)
            if status == Status.OK and (self.uncommitted.get(sid) or any(self._reserved(sid))):
                status = Status.BAD_LENGTH  # a row with a span extends instead
            if status == Status.OK:
                tables, n = self.tables[sid], self.num_tokens[sid]
                for g, group in enumerate(groups):  # 1. reclaim, tail first
                    lo = self.null_prefix[sid][g]
                    hi = max(lo, min(group.skipped_blocks(n, bs), len(tables[g])))
                    self._release_blocks(tables[g][lo:hi])
                    tables[g][lo:hi] = [NULL_BLOCK] * (hi - lo)
                    self.null_prefix[sid][g] = hi
                offset = n % bs
                if offset == 0 and len(tables[0]) >= cfg.max_blocks_per_seq:
                    status = Status.TABLE_FULL
                else:
                    takes = [offset == 0 or self.ref_count[t[-1]] > 1 for t in tables]
                    if any(takes) and (blocked or sum(takes) > len(self.free_queue)):
                        blocked = True
                        status = Status.NO_FREE_BLOCKS
                    else:
                        for g, t in enumerate(tables):
                            if not takes[g]:
                                continue
                            new = self._take()
                            self.ref_count[new] = 1
                            if offset == 0:
                                t.append(new)
                            else:
                                old = t[-1]
                                self.ref_count[old] -= 1
                                t[-1] = new
                                c_src[g], c_dst[g] = old, new
                                if cfg.prefix_caching:
                                    self.block_tokens[new] = list(self.block_tokens[old])
                        self.num_tokens[sid] = n + 1
                        slot = [t[-1] * bs + offset for t in tables]
                        if cfg.prefix_caching:
                            self.seq_tokens[sid].append(token)
                            for g, t in enumerate(tables):
                                self.block_tokens.setdefault(t[-1], [0] * bs)[offset] = token
                                # A block an append fills lies past the prompt boundary: a
                                # sparse window group never reaches it.
                                if offset == bs - 1 and groups[g].caches_blocks and not cfg.sparse(groups[g]):
                                    toks = self.seq_tokens[sid]
                                    self._cache(t[-1], self._gkey(g, self.seq_salt[sid], toks, len(toks)))
            statuses.append(status)
            slots.append(slot)
            src.append(c_src)
            dst.append(c_dst)
        return statuses, slots, src, dst

    def _take_tables(self, dst_ids, src_ids, *, dst_must_be_free: bool) -> list[Status]:
        cfg = self.config
        statuses, moves = self._take_statuses(dst_ids, src_ids, dst_must_be_free)
        new = {d: ([list(t) for t in self.tables[s]], self.num_tokens[s], list(self.seq_tokens.get(s, [])),
                   self.seq_salt.get(s, 0), list(self.null_prefix[s])) for d, s in moves}
        for d, _ in moves:
            for g in range(cfg.num_groups):
                for block in new[d][0][g][new[d][4][g]:]:
                    self.ref_count[block] += 1
        old = [d for d, _ in moves if d in self.tables]
        for g in range(cfg.num_groups):
            self._release([self._held(d, g) for d in old])
        for d, (tables, n, toks, salt, nulls) in new.items():
            self.tables[d], self.num_tokens[d], self.null_prefix[d] = tables, n, nulls
            self.uncommitted[d], self.reserved[d] = 0, []
            self.seq_tokens[d], self.seq_salt[d] = toks, salt
        return statuses

    def free(self, seq_ids: Sequence[int]) -> list[Status]:
        seen, out, released = set(), [], []
        for sid in seq_ids:
            status = self._row_status(sid, seen, must_be_active=True)
            if status == Status.OK:
                released.append(sid)
            out.append(status)
        for g in range(self.config.num_groups):
            self._release([self._held(sid, g) for sid in released])
        for sid in released:
            del self.tables[sid], self.num_tokens[sid], self.null_prefix[sid]
            self.uncommitted.pop(sid, None), self.reserved.pop(sid, None)
            self.seq_tokens.pop(sid, None)
            self.seq_salt.pop(sid, None)
        return out


def reference_for(config: ManagerConfig) -> ReferenceBlockManager:
    """The reference manager for ``config``: ``GroupedReference`` with KV-cache groups."""
    return GroupedReference(config) if config.grouped else ReferenceBlockManager(config)
