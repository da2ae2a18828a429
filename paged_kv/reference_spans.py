"""Plain-Python spans (``paged_kv.spans``) for ``ReferenceBlockManager``: ``extend``, ``commit``,
``truncate``, one row at a time with lists, as obviously as possible.

A row's table (``tables[sid]``) holds its tokens' blocks; ``reserved[sid]`` the blocks kept past
them (the jitted state's columns ``len(table) ..``); ``uncommitted[sid]`` how many of its last
tokens are drafts. ``seq_tokens[sid]`` holds only committed tokens, so a cache key (the exact
prefix) is never built from a draft.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_kv.config import NULL_BLOCK
from paged_kv.status import Status


class SpanOps:
    """Mixed into ``ReferenceBlockManager`` (which owns the attributes used here)."""

    def span_of(self, sid: int) -> tuple[int, list[int]]:
        """``(uncommitted tokens, reserved blocks)`` of a running row."""
        return self.uncommitted.get(sid, 0), list(self.reserved.get(sid, []))

    def extend(self, seq_ids: Sequence[int], num_new: Sequence[int], token_ids: Sequence[Sequence[int]] | None,
               k_max: int, commit: bool = False) -> tuple[list[Status], list[list[int]], list[int], list[int]]:
        """Returns (statuses, slots [K] per row, copy_src, copy_dst)."""
        cfg, bs = self.config, self.config.block_size
        seen, blocked = set(), False
        statuses, slots, src, dst = [], [], [], []
        for row, (sid, k) in enumerate(zip(seq_ids, num_new)):
            status = self._row_status(sid, seen, must_be_active=True)
            row_slots, copy = [NULL_BLOCK * bs] * k_max, (NULL_BLOCK, NULL_BLOCK)
            if status == Status.OK and not 0 <= k <= k_max:
                status = Status.BAD_LENGTH
            if status == Status.OK:
                table, n = self.tables[sid], self.num_tokens[sid]
                reserved = self.reserved.get(sid, [])
                grow = cfg.blocks_for(n + k) - len(table)
                if cfg.blocks_for(n + k) > cfg.max_blocks_per_seq:
                    status = Status.TABLE_FULL
                else:
                    cow = k > 0 and n % bs > 0 and self.ref_count[table[-1]] > 1
                    reused = [j < len(reserved) and self.ref_count[reserved[j]] == 1 for j in range(grow)]
                    need = int(cow) + sum(not r for r in reused)
                    if need and (blocked or need > len(self.free_queue)):
                        blocked, status = True, Status.NO_FREE_BLOCKS
            if status == Status.OK:
                if cow:
                    old = table[-1]
                    self.ref_count[old] -= 1
                    table[-1] = self._take()
                    self.ref_count[table[-1]] = 1
                    copy = (old, table[-1])
                    if cfg.prefix_caching:
                        self.block_tokens[table[-1]] = list(self.block_tokens.get(old, [0] * bs))
                for j in range(grow):
                    if reused[j]:
                        if self._uncache(reserved[j]):  # new contents (never cached in practice)
                            self.stats["evictions"] += 1
                        table.append(reserved[j])
                        continue
                    if j < len(reserved):  # shared reserved block: drop our reference
                        self.ref_count[reserved[j]] -= 1
                    table.append(self._take())
                    self.ref_count[table[-1]] = 1
                self.reserved[sid] = reserved[grow:]
                for i in range(k):
                    p = n + i
                    row_slots[i] = table[p // bs] * bs + p % bs
                    if cfg.prefix_caching and token_ids is not None:
                        self.block_tokens.setdefault(table[p // bs], [0] * bs)[p % bs] = token_ids[row][i]
                self.num_tokens[sid] = n + k
                self.uncommitted[sid] = self.uncommitted.get(sid, 0) + k
            statuses.append(status)
            slots.append(row_slots)
            src.append(copy[0])
            dst.append(copy[1])
        if commit:
            counts = [k if s == Status.OK else 0 for k, s in zip(num_new, statuses)]
            self.commit(seq_ids, counts, token_ids, k_max)
        return statuses, slots, src, dst

    def commit(self, seq_ids: Sequence[int], counts: Sequence[int], token_ids: Sequence[Sequence[int]] | None,
               k_max: int) -> list[Status]:
        """Commits the next ``counts[b]`` tokens (``token_ids[b][:counts[b]]``) of each row."""
        cfg, bs = self.config, self.config.block_size
        seen, out = set(), []
        for row, (sid, k) in enumerate(zip(seq_ids, counts)):
            status = self._row_status(sid, seen, must_be_active=True)
            if status == Status.OK and not 0 <= k <= min(k_max, self.uncommitted.get(sid, 0)):
                status = Status.BAD_LENGTH
            out.append(status)
            if status != Status.OK:
                continue
            table = self.tables[sid]
            c = self.num_tokens[sid] - self.uncommitted.get(sid, 0)
            self.uncommitted[sid] = self.uncommitted.get(sid, 0) - k
            if not cfg.prefix_caching:
                continue
            for i in range(k):
                p, t = c + i, token_ids[row][i]
                self.block_tokens.setdefault(table[p // bs], [0] * bs)[p % bs] = t
                self.seq_tokens[sid].append(t)
                if (p + 1) % bs == 0:  # the block is now wholly committed
                    toks = self.seq_tokens[sid]
                    self._cache(table[p // bs], self._key(self.seq_salt[sid], toks, len(toks)))
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
            table = self.tables[sid]
            keep = self.config.blocks_for(length)
            past, reserved = table[keep:], self.reserved.get(sid, [])
            del table[keep:]
            if keep_reserved:
                self.reserved[sid] = past + reserved
            else:
                released.append(past + reserved)
                self.reserved[sid] = []
            self.uncommitted[sid] = length - (n - unc)
            self.num_tokens[sid] = length
        self._release(released)
        return out
