"""A guided tour of the block manager: the worked examples of ``docs/design.md`` (section "Worked
examples"), printed step by step.

    python -m paged_kv.apps.walkthrough      # or: python -m paged_kv --walkthrough
"""

from __future__ import annotations

import jax

from paged_kv import ManagerConfig, Status
from paged_kv.invariants import check_invariants
from paged_kv.manager import BlockManager


def _show(bm: BlockManager, seqs, title: str) -> None:
    print(f"  {title}")
    cached = set(jax.device_get(bm.state.cache.slot >= 0).nonzero()[0].tolist()) \
        if bm.config.prefix_caching else set()
    for s in seqs:
        table = bm.table(s)
        cells = " ".join(
            f"{b}" + (f"(x{bm.ref_count(b)})" if bm.ref_count(b) > 1 else "") + ("*" if b in cached else "")
            for b in table
        )
        print(f"    seq {s}: {bm.num_tokens(s):5d} tokens  {len(table):3d} blocks  [{cells}]")
    u = bm.usage()
    print(f"    pool: {u['used']} used, {u['shared']} shared, {u['free']} free   "
          f"(xN: reference count, *: cached full block)")


def _append(bm: BlockManager, seqs):
    return bm.append(list(seqs), [7] * len(seqs))


def lazy_allocation() -> None:
    print("\n1. Lazy allocation: a 40-token prompt, then 1,000 generated tokens (block size 16)")
    bm = BlockManager(ManagerConfig(num_blocks=128, block_size=16, max_seqs=4, max_blocks_per_seq=80))
    bm.admit([0], [list(range(40))])
    _show(bm, [0], "after admission (3 blocks: 16 + 16 + 8 tokens)")
    lazy = 0
    for _ in range(1000):
        before = len(bm.table(0))
        assert _append(bm, [0]).status[0] == Status.OK
        lazy += len(bm.table(0)) - before
    print(f"  after 1,000 appends: {len(bm.table(0))} blocks, {lazy} allocated lazily, "
          f"one each time the last block filled")
    check_invariants(bm.config, bm.state)


def parallel_sampling() -> None:
    print("\n2. Parallel sampling: two samples of a 20-token prompt share its blocks")
    bm = BlockManager(ManagerConfig(num_blocks=32, block_size=16, max_seqs=4, max_blocks_per_seq=8))
    bm.admit([0], [list(range(20))])
    bm.fork(0, [1])
    _show(bm, [0, 1], "after fork: both tables point at the same blocks, count 2")
    r = _append(bm, [0])
    print(f"  sample 0 writes token 21: copy-on-write of block {r.copy_src[0]} -> {r.copy_dst[0]} "
          f"({r.num_copies} copy; for Llama 3.1 8B one block is 16 x 128 KiB = 2 MiB)")
    r = _append(bm, [1])
    print(f"  sample 1 writes token 21: {r.num_copies} copies, in place at slot {r.slots[0]}")
    _show(bm, [0, 1], "now")
    check_invariants(bm.config, bm.state)


def beam_search() -> None:
    print("\n3. Beam search: four candidates share a root block")
    bm = BlockManager(ManagerConfig(num_blocks=32, block_size=16, max_seqs=4, max_blocks_per_seq=8))
    bm.admit([0], [list(range(20))])
    bm.fork(0, [1, 2, 3])
    r = _append(bm, range(4))
    print(f"  all four write a token: {r.num_copies} copies (the last writer keeps the original)")
    _show(bm, range(4), "four candidates")
    bm.select([0, 1, 2, 3], [0, 0, 1, 1])
    _show(bm, range(4), "select(parents=[0, 0, 1, 1]): the tails of candidates 2 and 3 are freed")
    bm.free([2, 3])
    _show(bm, [0, 1], "after freeing two candidates the root count reads 2")
    check_invariants(bm.config, bm.state)


def reclaim() -> None:
    print("\n4. Reclaim: a finished request's blocks are freed tail first")
    bm = BlockManager(ManagerConfig(num_blocks=12, block_size=16, max_seqs=4, max_blocks_per_seq=8))
    bm.admit([0, 1], [list(range(60)), list(range(100, 120))])
    bm.fork(0, [2])
    _append(bm, [2])  # seq 2 copies seq 0's partly full tail; it still shares the first three blocks
    _show(bm, [0, 1, 2], "seq 2 was forked from seq 0")
    print(f"  free queue, front to back: {bm.free_queue()}")
    bm.free([0])
    print(f"  free(seq 0): only its private, partly full tail reaches count 0; it is not cached "
          f"(nothing can hit it), so it goes to the front: {bm.free_queue()}")
    bm.free([2])
    print(f"  free(seq 2): its cached full blocks join the back, last block first: {bm.free_queue()}")
    print("  allocation takes the front; until a cached block is taken it keeps its contents")
    check_invariants(bm.config, bm.state)


def prefix_caching() -> None:
    print("\n5. Prefix caching: requests with a common 32-token system prompt")
    bm = BlockManager(ManagerConfig(num_blocks=16, block_size=16, max_seqs=4, max_blocks_per_seq=8))
    system = list(range(1000, 1032))
    r = bm.admit([0], [system + [1, 2, 3]])
    r = bm.admit([1], [system + [4, 5]])
    print(f"  second request: {r.cached_tokens[0]} prompt tokens served from the cache")
    _show(bm, [0, 1], "both share the two system-prompt blocks")
    bm.free([0, 1])
    r = bm.admit([2], [system + [6]])
    print(f"  after both finished, a third request still hits {r.cached_tokens[0]} tokens, taking "
          f"the same blocks {bm.table(2)[:2]} back out of the free queue")
    st = bm.cache_stats()
    print(f"  cache: {st['hit_tokens']} of {st['query_tokens']} prompt tokens hit "
          f"(hit rate {st['hit_rate']:.2f}), {st['evictions']} evictions")
    check_invariants(bm.config, bm.state)


def main() -> None:
    print(f"paged-kv block manager walkthrough (JAX {jax.__version__}, {jax.default_backend()})")
    print("The design behind each step: docs/design.md")
    lazy_allocation()
    parallel_sampling()
    beam_search()
    reclaim()
    prefix_caching()
    print("\nAll invariants held after every scenario.")


if __name__ == "__main__":
    main()
