"""Plain-Python spans (``paged_kv.spans``) for ``ReferenceBlockManager`` and ``GroupedReference``:
``extend``, ``commit``, ``truncate``, one row at a time with lists, as obviously as possible.

A row's tables hold its tokens' blocks; ``reserved[sid]`` (one list per group) the blocks kept
past them (the jitted state's columns ``len(table) ..``); ``uncommitted[sid]`` how many of its
last tokens are drafts. ``seq_tokens[sid]`` holds only committed tokens, so a cache key (the
exact prefix) is never built from a draft.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_kv.config import NULL_BLOCK
from paged_kv.status import Status


class SpanOps:
    """Mixed into ``ReferenceBlockManager`` (which owns the attributes used here). Without groups
    ``tables[sid]`` is one table; ``GroupedReference`` keeps a list of them, one per group."""

    def _group_tables(self, sid: int) -> list[list[int]]:
        return self.tables[sid] if self.config.grouped else [self.tables[sid]]

    def _reserved(self, sid: int) -> list[list[int]]:
        return self.reserved.get(sid) or [[] for _ in self.config.groups]

    def span_of(self, sid: int) -> tuple[int, list[int] | list[list[int]]]:
        """``(uncommitted tokens, reserved blocks)`` of a running row (reserved: one list per
        group with groups)."""
        reserved = [list(r) for r in self._reserved(sid)]
        return self.uncommitted.get(sid, 0), reserved if self.config.grouped else reserved[0]

    def _span_caches(self, g: int, j: int, prompt_len: int | None) -> bool:
        """Whether group ``g`` registers column ``j`` once committed: every group that caches,
        but a sparse window group only within reach of a prompt chunk's boundary."""
        group = self.config.groups[g]
        if prompt_len is not None and self.config.sparse(group):
            return self._caches(g, j, prompt_len, 0, 0)
        return group.caches_blocks and not self.config.sparse(group)

    def _span_key(self, g: int, salt: int, toks: list[int]) -> tuple:
        return self._gkey(g, salt, toks, len(toks)) if self.config.grouped else self._key(salt, toks, len(toks))

    def extend(self, seq_ids: Sequence[int], num_new: Sequence[int], token_ids: Sequence[Sequence[int]] | None,
               k_max: int, commit: bool = False, prompt_lens: Sequence[int] | None = None
               ) -> tuple[list[Status], list, list, list]:
        """Returns (statuses, slots, copy_src, copy_dst): per row ``[K]`` slots and one copy
        entry (``[K][G]`` and ``[G]`` with groups)."""
        cfg, bs, n_groups = self.config, self.config.block_size, self.config.num_groups
        seen, blocked = set(), False
        statuses, slots, src, dst = [], [], [], []
        for row, (sid, k) in enumerate(zip(seq_ids, num_new)):
            status = self._row_status(sid, seen, must_be_active=True)
            row_slots = [[NULL_BLOCK * bs] * n_groups for _ in range(k_max)]
            copy = [(NULL_BLOCK, NULL_BLOCK)] * n_groups
            if status == Status.OK and not 0 <= k <= k_max:
                status = Status.BAD_LENGTH
            if status == Status.OK:
                tables, n = self._group_tables(sid), self.num_tokens[sid]
                if cfg.grouped:  # window reclaim, measured from the committed prefix
                    committed = n - self.uncommitted.get(sid, 0)
                    for g, group in enumerate(cfg.groups):
                        lo = self.null_prefix[sid][g]
                        hi = max(lo, min(group.skipped_blocks(committed, bs), len(tables[g])))
                        self._release([tables[g][lo:hi]])
                        tables[g][lo:hi] = [NULL_BLOCK] * (hi - lo)
                        self.null_prefix[sid][g] = hi
                reserved = self._reserved(sid)
                grow = cfg.blocks_for(n + k) - len(tables[0])
                if cfg.blocks_for(n + k) > cfg.max_blocks_per_seq:
                    status = Status.TABLE_FULL
                else:
                    cow = [k > 0 and n % bs > 0 and self.ref_count[t[-1]] > 1 for t in tables]
                    reused = [[j < len(r) and self.ref_count[r[j]] == 1 for j in range(grow)] for r in reserved]
                    need = sum(cow) + sum(not x for r in reused for x in r)
                    if need and (blocked or need > len(self.free_queue)):
                        blocked, status = True, Status.NO_FREE_BLOCKS
            if status == Status.OK:
                for g, table in enumerate(tables):  # per group: the copy, then the columns
                    if cow[g]:
                        old = table[-1]
                        self.ref_count[old] -= 1
                        table[-1] = self._take()
                        self.ref_count[table[-1]] = 1
                        copy[g] = (old, table[-1])
                        if cfg.prefix_caching:
                            self.block_tokens[table[-1]] = list(self.block_tokens.get(old, [0] * bs))
                    for j in range(grow):
                        if reused[g][j]:
                            if self._uncache(reserved[g][j]):  # new contents (never cached in practice)
                                self.stats["evictions"] += 1
                            table.append(reserved[g][j])
                            continue
                        if j < len(reserved[g]):  # a shared reserved block: drop our reference
                            self.ref_count[reserved[g][j]] -= 1
                        table.append(self._take())
                        self.ref_count[table[-1]] = 1
                    for i in range(k):
                        p = n + i
                        row_slots[i][g] = table[p // bs] * bs + p % bs
                        if cfg.prefix_caching and token_ids is not None:
                            self.block_tokens.setdefault(table[p // bs], [0] * bs)[p % bs] = token_ids[row][i]
                self.reserved[sid] = [r[grow:] for r in reserved]
                self.num_tokens[sid] = n + k
                self.uncommitted[sid] = self.uncommitted.get(sid, 0) + k
            if not cfg.grouped:
                row_slots, copy = [s[0] for s in row_slots], copy[0]
                src.append(copy[0])
                dst.append(copy[1])
            else:
                src.append([c[0] for c in copy])
                dst.append([c[1] for c in copy])
            statuses.append(status)
            slots.append(row_slots)
        if commit:
            counts = [k if s == Status.OK else 0 for k, s in zip(num_new, statuses)]
            self.commit(seq_ids, counts, token_ids, k_max, prompt_lens)
        return statuses, slots, src, dst

    def commit(self, seq_ids: Sequence[int], counts: Sequence[int], token_ids: Sequence[Sequence[int]] | None,
               k_max: int, prompt_lens: Sequence[int] | None = None) -> list[Status]:
        """Commits the next ``counts[b]`` tokens (``token_ids[b][:counts[b]]``) of each row
        (``prompt_lens``: the rows' spans are chunks of prompts of these lengths)."""
        cfg, bs = self.config, self.config.block_size
        seen, out = set(), []
        for row, (sid, k) in enumerate(zip(seq_ids, counts)):
            status = self._row_status(sid, seen, must_be_active=True)
            if status == Status.OK and not 0 <= k <= min(k_max, self.uncommitted.get(sid, 0)):
                status = Status.BAD_LENGTH
            out.append(status)
            if status != Status.OK:
                continue
            c = self.num_tokens[sid] - self.uncommitted.get(sid, 0)
            self.uncommitted[sid] = self.uncommitted.get(sid, 0) - k
            if not cfg.prefix_caching:
                continue
            for i in range(k):
                p, t = c + i, token_ids[row][i]
                self.seq_tokens[sid].append(t)
                for g, table in enumerate(self._group_tables(sid)):
                    if table[p // bs] == NULL_BLOCK:
                        continue
                    self.block_tokens.setdefault(table[p // bs], [0] * bs)[p % bs] = t
                    plen = None if prompt_lens is None else prompt_lens[row]
                    if (p + 1) % bs == 0 and self._span_caches(g, p // bs, plen):  # now wholly committed
                        self._cache(table[p // bs], self._span_key(g, self.seq_salt[sid], self.seq_tokens[sid]))
        return out

    def truncate(self, seq_ids: Sequence[int], new_lens: Sequence[int], keep_reserved: bool) -> list[Status]:
        """Rolls rows back to ``new_lens`` tokens (never below their committed prefix)."""
        seen, out, released = set(), [], []
        for sid, length in zip(seq_ids, new_lens):
            status = self._row_status(sid, seen, must_be_active=True)
            if status == Status.OK:
                n, unc = self.num_tokens[sid], self.uncommitted.get(sid, 0)
                if not n - unc <= length <= n:
                    status = Status.BAD_LENGTH
            out.append(status)
            if status != Status.OK:
                continue
            keep, reserved = self.config.blocks_for(length), self._reserved(sid)
            gone = []
            for table, r in zip(self._group_tables(sid), reserved):
                gone.append(table[keep:] + r)
                del table[keep:]
            self.reserved[sid] = gone if keep_reserved else [[] for _ in gone]
            if not keep_reserved:
                released.append(gone)
            self.uncommitted[sid] = length - (n - unc)
            self.num_tokens[sid] = length
        for g in range(self.config.num_groups):  # group by group, rows in order, each tail first
            self._release([gone[g] for gone in released])
        return out
