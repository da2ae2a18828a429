"""vLLM 0.33's v1 ``KVCacheManager`` with several KV-cache groups (full attention and sliding
windows, one block size), driven by an op stream; runs in the vLLM reference environment
(``../shared/tools/vllm_ref``), not in paged-kv's::

    $VLLM_ENV/bin/python scripts/vllm_groups_driver.py OPS.json USABLE_BLOCKS BLOCK_SIZE GROUPS [RETENTION]

``GROUPS`` is a comma list, ``full`` or ``wN`` (a sliding window of N tokens), e.g. ``full,w6``.
``RETENTION`` is ``KVCacheConfig.prefix_cache_retention_interval``: ``0`` (sparse: a window group
hashes only the blocks a later request can reach; vLLM's engine default, ``CacheConfig``) or
``none`` (dense: every full block; what ``KVCacheConfig`` defaults to when built by hand). Default
``0``, as a vLLM server builds it. The request's ``shared_prefix_boundary`` is set from
``get_computed_blocks`` as the scheduler sets it.
OPS.json is a list of ``["admit", rid, [tokens...], salt]``, ``["append", rid, token]``,
``["free", rid]``. After every op it prints one line: the op's result (an admission's hit tokens
or ``None`` when out of blocks, an append's ``ok`` / ``out of blocks``), every group's table of
the request (block 0 is vLLM's null block), the free queue, front first, and the blocks that hold
a hash (the cached set), ascending.
``scripts/diff_vllm.py --groups`` prints the same lines from paged-kv and compares them.
"""
from __future__ import annotations

import json
import sys

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus


def spec_of(name: str, block_size: int):
    common = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    if name == "full":
        return FullAttentionSpec(**common)
    if name.startswith("w") and name[1:].isdigit():
        return SlidingWindowSpec(**common, sliding_window=int(name[1:]))
    raise SystemExit(f"unknown group {name!r}: 'full' or 'wN'")


class GroupedVllm:
    """admit / append / free with the scheduler's own calls on a hybrid ``KVCacheManager``."""

    def __init__(self, num_blocks: int, block_size: int, groups: list[str], retention: int | None = 0):
        specs = [KVCacheGroupSpec([f"layer{i}"], spec_of(g, block_size)) for i, g in enumerate(groups)]
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs,
                            prefix_cache_retention_interval=retention)
        self.m = KVCacheManager(cfg, max_model_len=8192, scheduler_block_size=block_size,
                                hash_block_size=block_size, enable_caching=True)
        fn = get_hash_fn_by_name("sha256")
        init_none_hash(fn)
        self.hasher = get_request_block_hasher(block_size, fn)
        self.params = SamplingParams(max_tokens=4096)
        self.reqs: dict[int, Request] = {}

    def admit(self, rid: int, prompt: list[int], salt: int = 0):
        req = Request(f"r{rid}", list(prompt), self.params, None, block_hasher=self.hasher,
                      cache_salt=None if salt == 0 else f"s{salt}")
        blocks, hit, req.shared_prefix_boundary = self.m.get_computed_blocks(req)
        if self.m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
            return None
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = req.num_tokens
        self.reqs[rid] = req
        return hit

    def append(self, rid: int, token: int) -> bool:
        req = self.reqs[rid]
        req.append_output_token_ids(token)
        if self.m.allocate_slots(req, 1) is None:
            return False
        req.num_computed_tokens += 1
        return True

    def free(self, rid: int) -> None:
        self.m.free(self.reqs.pop(rid))

    def tables(self, rid: int) -> list[list[int]]:
        return [list(t) for t in self.m.get_block_ids(f"r{rid}")]

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.m.block_pool.free_block_queue.get_all_free_blocks()]

    def cached(self) -> list[int]:
        """Blocks holding a hash, ascending."""
        return [b.block_id for b in self.m.block_pool.blocks if b.block_hash is not None]


def main() -> None:
    ops, usable, bs = json.load(open(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
    retention = sys.argv[5] if len(sys.argv) > 5 else "0"
    v = GroupedVllm(usable + 1, bs, sys.argv[4].split(","), None if retention == "none" else int(retention))
    for i, op in enumerate(ops):
        rid = op[1]
        # After a difference (an admission one side refused), keep going without crashing: the
        # comparison reports the first differing line anyway.
        if (op[0] != "admit") == (rid not in v.reqs):
            print(i, op[0], rid, "running" if rid in v.reqs else "not running")
            continue
        if op[0] == "admit":
            hit = v.admit(rid, op[2], op[3] if len(op) > 3 else 0)
            what = f"admit {rid} hit {hit} tables {v.tables(rid) if hit is not None else None}"
        elif op[0] == "append":
            ok = v.append(rid, op[2])
            what = f"append {rid} {'ok' if ok else 'out of blocks'} tables {v.tables(rid)}"
        elif op[0] == "free":
            v.free(rid)
            what = f"free {rid}"
        else:
            raise SystemExit(f"unknown op {op[0]!r}")
        print(i, what, "queue", v.free_queue(), "cached", v.cached())


if __name__ == "__main__":
    main()
