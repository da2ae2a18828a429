"""A plain-Python block manager with the same semantics as the jitted operations.

It processes each batch one row at a time with lists, dicts and an ordered dict as the free queue,
which makes it easy to read and to trust. The property tests run long random operation sequences
through both and compare every output and the whole state; the benchmark uses it as the baseline
of a conventional host-side manager.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.status import Status


class ReferenceBlockManager:
    def __init__(self, config: ManagerConfig):
        self.config = config
        self.ref_count = [0] * config.num_blocks
        # Insertion order = queue order; front = first key.
        self.free_queue: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(config.num_blocks) if b != NULL_BLOCK
        )
        self.tables: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}

    # -- helpers ---------------------------------------------------------------------------

    def _row_status(self, sid: int, seen: set[int], *, must_be_active: bool) -> Status:
        if sid < 0:
            return Status.PADDING
        repeated = sid in seen
        seen.add(sid)
        if sid >= self.config.max_seqs or repeated or (sid in self.tables) != must_be_active:
            return Status.BAD_SEQUENCE
        return Status.OK

    def _take(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        self.ref_count[block] = 1
        return block

    def _release(self, table: list[int]) -> None:
        for block in reversed(table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_queue[block] = None

    # -- operations ------------------------------------------------------------------------

    def admit(self, seq_ids: Sequence[int], prompt_lens: Sequence[int]) -> list[Status]:
        cfg, seen, blocked, out = self.config, set(), False, []
        for sid, length in zip(seq_ids, prompt_lens):
            status = self._row_status(sid, seen, must_be_active=False)
            if status == Status.OK and not 1 <= length <= cfg.max_tokens_per_seq:
                status = Status.BAD_LENGTH
            if status == Status.OK:
                need = cfg.blocks_for(length)
                blocked = blocked or need > len(self.free_queue)
                if blocked:
                    status = Status.NO_FREE_BLOCKS
                else:
                    self.tables[sid] = [self._take() for _ in range(need)]
                    self.num_tokens[sid] = length
            out.append(status)
        return out

    def append(self, seq_ids: Sequence[int]):
        """Returns (statuses, slots, copy_src, copy_dst), one entry per row."""
        cfg, seen, blocked = self.config, set(), False
        statuses, slots, src, dst = [], [], [], []
        for sid in seq_ids:
            status = self._row_status(sid, seen, must_be_active=True)
            slot, copy = NULL_BLOCK * cfg.block_size, (NULL_BLOCK, NULL_BLOCK)
            if status == Status.OK:
                table, n = self.tables[sid], self.num_tokens[sid]
                offset = n % cfg.block_size
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
                    elif shared:
                        old = table[-1]
                        self.ref_count[old] -= 1
                        table[-1] = self._take()
                        copy = (old, table[-1])
                    if status == Status.OK:
                        self.num_tokens[sid] = n + 1
                        slot = table[-1] * cfg.block_size + offset
            statuses.append(status)
            slots.append(slot)
            src.append(copy[0])
            dst.append(copy[1])
        return statuses, slots, src, dst

    def _take_tables(self, dst_ids, src_ids, *, dst_must_be_free: bool) -> list[Status]:
        cfg, seen, statuses = self.config, set(), []
        for d, s in zip(dst_ids, src_ids):
            if d < 0:
                statuses.append(Status.PADDING)
                continue
            bad = d >= cfg.max_seqs or d in seen or (dst_must_be_free and d in self.tables)
            seen.add(d)
            bad = bad or s < 0 or s not in self.tables
            statuses.append(Status.BAD_SEQUENCE if bad else Status.OK)
        moves = [(d, s) for d, s, st in zip(dst_ids, src_ids, statuses) if st == Status.OK]
        # Every row switches at once: read all sources before touching anything.
        new = {d: (list(self.tables[s]), self.num_tokens[s]) for d, s in moves}
        for d, _ in moves:
            for block in new[d][0]:
                self.ref_count[block] += 1
        for d, _ in moves:
            if d in self.tables:
                self._release(self.tables[d])
        for d, (table, n) in new.items():
            self.tables[d], self.num_tokens[d] = table, n
        return statuses

    def fork(self, src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[Status]:
        return self._take_tables(dst_ids, src_ids, dst_must_be_free=True)

    def select(self, dst_ids: Sequence[int], parent_ids: Sequence[int]) -> list[Status]:
        return self._take_tables(dst_ids, parent_ids, dst_must_be_free=False)

    def free(self, seq_ids: Sequence[int]) -> list[Status]:
        seen, out = set(), []
        for sid in seq_ids:
            status = self._row_status(sid, seen, must_be_active=True)
            if status == Status.OK:
                self._release(self.tables.pop(sid))
                del self.num_tokens[sid]
            out.append(status)
        return out

    # -- views -----------------------------------------------------------------------------

    def queue_order(self) -> list[int]:
        return list(self.free_queue)
