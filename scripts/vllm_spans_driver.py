"""vLLM 0.33's v1 ``KVCacheManager`` driven with the scheduler's own ``allocate_slots`` calls for
chunked prefill and speculative decoding (lookahead, rejected drafts); runs in the vLLM reference
environment (``../shared/tools/vllm_ref``), not in paged-kv's::

    $VLLM_ENV/bin/python scripts/vllm_spans_driver.py OPS.json USABLE_BLOCKS BLOCK_SIZE GROUPS [RETENTION]

``GROUPS`` is a comma list of ``full``, ``wN`` (a sliding window of N tokens) or ``cN``
(``ChunkedLocalAttentionSpec`` with chunks of N tokens), e.g. ``full,w5,c8``; ``RETENTION`` as in
``vllm_groups_driver.py`` (``0`` sparse, ``none`` dense). OPS.json is a list of:

- ``["admit", rid, prompt, salt, first_len]``: a new request; ``get_computed_blocks`` gives the
  hit ``h``, then ``allocate_slots(req, first_len - h, h, blocks)`` (the scheduler's first chunk:
  ``first_len = h + min(len(prompt) - h, budget)``), and ``num_computed_tokens = first_len``.
- ``["prefill", rid, chunk, lookahead]``: the next prompt chunk of a running request
  (``allocate_slots(req, chunk, num_lookahead_tokens=lookahead)``, then ``num_computed_tokens +=
  chunk``), as the scheduler's running loop schedules a partial prefill.
- ``["spec", rid, token, drafts, lookahead, accepted]``: one decode step with speculative
  decoding. ``token`` (the last sampled token) joins the request and ``drafts`` become its
  ``spec_token_ids``; ``allocate_slots(req, 1 + len(drafts), num_lookahead_tokens=lookahead)``
  (which caches up to ``request.num_tokens``: never a draft); ``num_computed_tokens`` advances by
  ``1 + len(drafts)``, then the rejected ``len(drafts) - accepted`` are rolled back, the accepted
  drafts join the request and ``cache_blocks(req, num_computed_tokens)`` runs, as
  ``Scheduler.update_from_output`` does. Out of blocks: the request keeps its blocks (the stream
  frees it next, as the scheduler preempts).
- ``["free", rid]``.

After every op it prints one line: the op's result (hit tokens or ``None``; ``ok`` / ``out of
blocks``), every group's table of the request (all of ``req_to_blocks``: blocks past
``num_computed_tokens``, kept after rejected drafts, included), blocks in use, the free queue,
front first, and the blocks holding a hash, ascending.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_groups_driver  # the grouped driver: the same manager, the same requests

_GROUPED_SPEC_OF = vllm_groups_driver.spec_of


def spec_of(name: str, block_size: int):
    if name.startswith("c") and name[1:].isdigit():
        return ChunkedLocalAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                         dtype=torch.float32, attention_chunk_size=int(name[1:]))
    return _GROUPED_SPEC_OF(name, block_size)


vllm_groups_driver.spec_of = spec_of  # GroupedVllm builds its groups through this name


class SpanVllm(vllm_groups_driver.GroupedVllm):
    """admit (a first chunk), prefill (a further chunk), spec (a decode step with drafts and
    lookahead), free: each with the scheduler's own calls."""

    def admit_chunk(self, rid: int, prompt: list[int], salt: int, first_len: int):
        req = vllm_groups_driver.Request(f"r{rid}", list(prompt), self.params, None, block_hasher=self.hasher,
                                         cache_salt=None if salt == 0 else f"s{salt}")
        blocks, hit, req.shared_prefix_boundary = self.m.get_computed_blocks(req)
        if first_len <= hit:  # paged-kv found a shorter hit (a difference): nothing to allocate
            return f"{hit} (not below first_len {first_len})"
        if self.m.allocate_slots(req, first_len - hit, hit, blocks) is None:
            return None
        req.status = vllm_groups_driver.RequestStatus.RUNNING
        req.num_computed_tokens = first_len
        self.reqs[rid] = req
        return hit

    def prefill(self, rid: int, chunk: int, lookahead: int) -> bool:
        req = self.reqs[rid]
        assert 0 < chunk <= req.num_tokens - req.num_computed_tokens
        if self.m.allocate_slots(req, chunk, num_lookahead_tokens=lookahead) is None:
            return False
        req.num_computed_tokens += chunk
        return True

    def spec(self, rid: int, token: int, drafts: list[int], lookahead: int, accepted: int) -> bool:
        req = self.reqs[rid]
        assert req.num_computed_tokens == req.num_tokens, "a decode step follows a finished prefill"
        req.append_output_token_ids(token)
        req.spec_token_ids = list(drafts)
        if self.m.allocate_slots(req, 1 + len(drafts), num_lookahead_tokens=lookahead) is None:
            req.spec_token_ids = []
            return False
        req.num_computed_tokens += 1 + len(drafts)
        req.spec_token_ids = []
        req.num_computed_tokens -= len(drafts) - accepted  # rejected drafts: rewind only the count
        if accepted:
            req.append_output_token_ids(list(drafts[:accepted]))
        self.m.cache_blocks(req, req.num_computed_tokens)
        return True

    def used(self) -> int:
        return self.m.block_pool.num_gpu_blocks - 1 - self.m.block_pool.get_num_free_blocks()


def main() -> None:
    ops, usable, bs = json.load(open(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
    retention = sys.argv[5] if len(sys.argv) > 5 else "0"
    v = SpanVllm(usable + 1, bs, sys.argv[4].split(","), None if retention == "none" else int(retention))
    for i, op in enumerate(ops):
        kind, rid = op[0], op[1]
        if (kind != "admit") == (rid not in v.reqs):  # after a difference: keep going
            print(i, kind, rid, "running" if rid in v.reqs else "not running")
            continue
        if kind == "admit":
            hit = v.admit_chunk(rid, op[2], op[3], op[4])
            what = f"admit {rid} hit {hit} tables {v.tables(rid) if rid in v.reqs else None}"
        elif kind in ("prefill", "spec"):
            try:
                ok = v.prefill(rid, op[2], op[3]) if kind == "prefill" else v.spec(rid, *op[2:6])
            except AssertionError:  # an op that no longer fits this request, after a difference
                print(i, kind, rid, "does not fit the request")
                continue
            what = f"{kind} {rid} {'ok' if ok else 'out of blocks'} tables {v.tables(rid)}"
        elif kind == "free":
            v.free(rid)
            what = f"free {rid}"
        else:
            raise SystemExit(f"unknown op {kind!r}")
        print(i, what, "used", v.used(), "queue", v.free_queue(), "cached", v.cached())


if __name__ == "__main__":
    main()
