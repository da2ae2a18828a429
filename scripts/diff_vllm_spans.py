"""Spans (``paged_kv.spans``: ``extend``, ``commit``, ``truncate``) against vLLM 0.33's
``KVCacheManager.allocate_slots`` as its scheduler calls it for chunked prefill and speculative
decoding, id for id (``python scripts/diff_vllm.py --spans``; the vLLM side is
``scripts/vllm_spans_driver.py``).

Each stream mixes, on up to 6 requests (block size 4, prompts from one document of repeated
blocks so that prefixes hit):

- **admissions of a first chunk**: vLLM's scheduler schedules ``min(len - hit, budget)`` tokens
  past the hit; paged-kv admits ``prompt[:hit + chunk]`` (``BlockManager.admit`` takes every
  token it is given, so the stream finds the hit first, on a copy of the state: a hit on a prefix
  that reaches past the hit is the hit on the whole prompt);
- **prefill chunks**: vLLM ``allocate_slots(req, chunk, num_lookahead_tokens=L)``; paged-kv
  ``extend(chunk, commit=True)``, or with lookahead ``extend(chunk + L)``, ``commit(chunk)``,
  ``truncate(keep_reserved=True)``;
- **decode steps with drafts** (``1 + d`` tokens: the sampled token and ``d`` drafts, plus ``L``
  lookahead slots; ``a <= d`` drafts accepted): vLLM ``allocate_slots(req, 1 + d,
  num_lookahead_tokens=L)``, then ``num_computed_tokens`` rewound by the ``d - a`` rejected ones
  and ``cache_blocks`` after the accepted ones join (``Scheduler.update_from_output``); paged-kv
  ``extend(1 + d + L)``, ``commit(1 + a)``, ``truncate(n + 1 + a, keep_reserved=True)``;
- frees (a request out of blocks is freed at once, as the scheduler preempts it).

Each stream has its own draft count ``k = 1 + seed % 4`` and lookahead ``L``: 0 (n-gram drafting)
or ``k`` (a draft model), alternating with the seed (seeds 0..7 give every pair). Dense retention
changes only window groups, so ``none`` runs only the group sets that have one. Compared after
every op: the admission's hit tokens, whether the op got its blocks, every group's table of the
request (reserved blocks included: vLLM keeps them in ``req_to_blocks``), blocks in use, the free
queue and the set of blocks holding a hash.

Not generated, because paged-kv's API differs from vLLM's scheduler there (by design, see
docs/design.md "Spans"):

- lookahead on an admission: paged-kv's ``admit`` has no lookahead (it would be ``admit`` then
  ``extend``: two capacity checks where vLLM makes one, and a window group's reclaim measured
  from the chunk's end rather than from the hit);
- truncating below the committed prefix (vLLM never rewinds past verified tokens either).

- chunked prefill where a sliding-window group has sparse retention
  (``prefix_cache_retention_interval=0`` and a ``wN`` group): such a group hashes only the blocks
  before the prompt boundary, which paged-kv takes from what ``admit`` was given, the first chunk,
  and vLLM from the whole prompt (``replay_boundaries``; its ``shared_prefix_boundary`` likewise):
  the first chunk's boundary blocks get a hash in paged-kv only, the prompt's in vLLM only, and a
  later request replaying the prompt then hits differently. Those settings admit whole prompts
  (decode steps with drafts and lookahead are still compared); dense retention, full and chunked
  local groups (always dense) chunk.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np

BLOCK = 4
GROUP_SETS = ("full", "full,w5", "w6", "full,c8", "full,w5,c8")
"""``wN`` a sliding window of N tokens, ``cN`` chunked local attention with chunks of N tokens."""
DRIVER = Path(__file__).resolve().parent / "vllm_spans_driver.py"


def parse_groups(spec: str) -> tuple:
    """``"full,w6,c8"`` -> ``(Group("full"), Group("window", 6), Group("chunked", chunk=8))``."""
    from paged_kv.config import Group

    def one(g: str):
        if g == "full":
            return Group("full")
        return Group("window", int(g[1:])) if g[0] == "w" else Group("chunked", chunk=int(g[1:]))

    return tuple(one(g) for g in spec.split(","))


def spans_config(usable: int, spec: str, retention: str, max_seqs: int = 6):
    import paged_kv as pk

    return pk.ManagerConfig(num_blocks=usable + 1, block_size=BLOCK, max_seqs=max_seqs, max_blocks_per_seq=32,
                            groups=parse_groups(spec),
                            prefix_cache_retention_interval=None if retention == "none" else int(retention))


def _line(bm, i: int, what: str, rid: int | None, ok: bool = True) -> str:
    """The driver's line for op ``i``: ``rid``'s tables, reserved blocks included."""
    if rid is not None and ok:
        st = bm.state
        n, res = int(st.num_tokens[rid]), int(st.num_reserved[rid])
        held = -(-n // BLOCK) + res
        what += f" tables {np.asarray(st.tables[:, rid, :held]).tolist()}"
    elif rid is not None:
        what += " tables None"
    return f"{i} {what} used {bm.usage()['used']} queue {bm.free_queue()} cached {bm.cached_blocks()}"


def make_spans_stream(seed: int, num_ops: int, usable: int, spec: str, retention: str = "0",
                      max_seqs: int = 6) -> tuple[list[list], list[str], dict]:
    """A random op stream for ``vllm_spans_driver.py`` and paged-kv's lines for it (the stream
    adapts to paged-kv's outcomes as it goes); returns ``(ops, lines, stream facts)``."""
    import jax

    import paged_kv as pk

    rng = random.Random(seed)
    bs = BLOCK
    blocks = [[rng.randrange(6) for _ in range(bs)] for _ in range(4)]
    doc = [t for _ in range(32) for t in blocks[rng.choice([0, 0, 1, 2, 3])]]
    k_max = 1 + seed % 4  # seeds 0..3 and 4..7 each cover k = 1..4, together with and without L
    lookahead = k_max if (seed + seed // 4) % 2 else 0
    bm = pk.BlockManager(spans_config(usable, spec, retention, max_seqs))
    limit = bm.config.max_tokens_per_seq - 1
    rows: dict[int, dict] = {}  # rid -> {"prompt": [...], "tokens": [...] committed}
    ops: list[list] = []
    lines: list[str] = []
    facts = {"drafts_max": k_max, "lookahead": lookahead, "chunked_admissions": 0, "prefill_chunks": 0,
             "spec_steps": 0, "drafts": 0, "accepted": 0, "out_of_blocks": 0}
    ok_status = int(pk.Status.OK)
    # Sparse retention takes a window group's prompt boundary from admit's prompt (the first
    # chunk; vLLM: the whole prompt): such settings admit whole prompts (module docstring).
    chunking = not any(bm.config.sparse(g) for g in bm.config.groups)
    facts["chunked_prefill"] = chunking

    def emit(op: list, what: str, rid: int | None, ok: bool = True) -> None:
        ops.append(op)
        lines.append(_line(bm, len(ops) - 1, what, rid, ok))

    def drop(rid: int) -> None:
        bm.free([rid])
        del rows[rid]
        emit(["free", rid], f"free {rid}", None)

    def tok(pos: int) -> int:
        return doc[pos] if pos < len(doc) and rng.random() < 0.9 else rng.randrange(6)

    while len(ops) < num_ops:
        free_ids = [s for s in range(max_seqs) if s not in rows]
        r = rng.random()
        if free_ids and (r < 0.25 or not rows):
            rid = rng.choice(free_ids)
            prompt = doc[: bs * rng.randrange(1, 13)]
            if rng.random() < 0.5:
                prompt = prompt + [rng.randrange(6) for _ in range(rng.randrange(1, bs + 2))]
            salt = 1 if rng.random() < 0.1 else 0
            budget = len(prompt) if rng.random() < 0.4 or not chunking else rng.randrange(1, 3 * bs + 2)
            saved = jax.tree.map(lambda x: x.copy(), bm.state)  # the hit, on a copy of the state
            res = bm.admit([rid], [prompt], [salt])
            bm.state = saved
            if int(res.status[0]) == ok_status:
                hit = int(res.cached_tokens[0])
                first = hit + min(len(prompt) - hit, budget)
            else:
                first = len(prompt)  # fails as a whole on both sides
            res = bm.admit([rid], [prompt[:first]], [salt])
            ok = int(res.status[0]) == ok_status
            if ok:
                rows[rid] = {"prompt": prompt, "tokens": list(prompt[:first])}
                facts["chunked_admissions"] += first < len(prompt)
            hit = int(res.cached_tokens[0]) if ok else None
            emit(["admit", rid, prompt, salt, first], f"admit {rid} hit {hit}", rid, ok)
            continue
        if not rows:
            continue
        rid = rng.choice(sorted(rows))
        row = rows[rid]
        c, prompt = len(row["tokens"]), row["prompt"]
        if r > 0.93:
            drop(rid)
        elif c < len(prompt):  # the next prompt chunk
            chunk = min(len(prompt) - c, rng.randrange(1, 3 * bs + 2))
            span = prompt[c:c + chunk]
            if lookahead == 0:
                res = bm.extend([rid], [span], commit=True)
            else:
                res = bm.extend([rid], [span + [0] * lookahead])
            ok = int(res.status[0]) == ok_status
            if ok and lookahead:
                bm.commit([rid], [span])
                bm.truncate([rid], [c + chunk], keep_reserved=True)
            facts["prefill_chunks"] += ok
            emit(["prefill", rid, chunk, lookahead], f"prefill {rid} {'ok' if ok else 'out of blocks'}", rid)
            if ok:
                row["tokens"] += span
            else:
                facts["out_of_blocks"] += 1
                drop(rid)
        elif c + 1 + k_max + lookahead > limit:
            drop(rid)  # finished
        else:  # a decode step: the sampled token, drafts, lookahead slots
            d = rng.randrange(0, k_max + 1)
            x = tok(c)
            drafts = [tok(c + 1 + j) for j in range(d)]
            a = rng.randrange(0, d + 1)
            res = bm.extend([rid], [[x] + drafts + [0] * lookahead])
            ok = int(res.status[0]) == ok_status
            if ok:
                bm.commit([rid], [[x] + drafts[:a]])
                bm.truncate([rid], [c + 1 + a], keep_reserved=True)
                facts["spec_steps"] += 1
                facts["drafts"] += d
                facts["accepted"] += a
            emit(["spec", rid, x, drafts, lookahead, a], f"spec {rid} {'ok' if ok else 'out of blocks'}", rid)
            if ok:
                row["tokens"] += [x] + drafts[:a]
            else:
                facts["out_of_blocks"] += 1
                drop(rid)
    return ops, lines, facts


def compare_spans(seed: int, num_ops: int, usable: int, spec: str, env: Path, retention: str = "0") -> dict:
    from scripts.diff_vllm import run_vllm

    ops, ours, facts = make_spans_stream(seed, num_ops, usable, spec, retention)
    theirs = run_vllm(ops, usable, env, DRIVER, str(BLOCK), spec, retention)
    admits = [line.split() for line in ours if line.split()[1] == "admit"]
    hit_tokens = sum(int(w[4]) for w in admits if w[4] != "None")
    first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if first_diff is None and len(ours) != len(theirs):
        first_diff = min(len(ours), len(theirs))
    return {
        "seed": seed, "groups": spec, "retention": retention, "ops": len(ops), "admissions": len(admits),
        "hit_tokens": hit_tokens, **facts,
        "comparisons": min(len(ours), len(theirs)) if first_diff is None else first_diff + 1,
        "equal": first_diff is None,
        "first_difference": None if first_diff is None else {
            "op_index": first_diff,
            "op": ops[first_diff] if first_diff < len(ops) else None,
            "paged_kv": ours[first_diff] if first_diff < len(ours) else None,
            "vllm": theirs[first_diff] if first_diff < len(theirs) else None,
        },
    }


def main_spans(args) -> int:
    from scripts.diff_vllm import report, vllm_version
    from scripts.run_record import record, utc_now

    if not DRIVER.is_file() or not (args.vllm_env / "bin" / "python").exists():
        print(f"needs {DRIVER} and the vLLM environment ({args.vllm_env})")
        return 2
    t0 = time.perf_counter()
    started, vllm = utc_now(), vllm_version(args.vllm_env)
    sets = args.group_sets.split(";") if args.group_sets_given else list(GROUP_SETS)
    retentions = args.retention.split(",")
    results = []
    for retention in retentions:
        for spec in sets:
            if retention == "none" and "w" not in spec:
                continue  # the same programs as under 0: retention only changes window groups
            for k in range(args.streams):
                r = compare_spans(args.seed + k, args.ops, args.usable_blocks, spec, args.vllm_env, retention)
                results.append(r)
                print(f"retention {retention} groups {spec} stream {r['seed']} (k {r['drafts_max']}, lookahead "
                      f"{r['lookahead']}): {r['ops']} ops, {r['spec_steps']} spec steps, {r['prefill_chunks']} "
                      f"chunks, {r['hit_tokens']} hit tokens: "
                      + ("identical" if r["equal"] else f"DIFFERS at {r['first_difference']}"), flush=True)
    per_setting = {}
    for retention in retentions:
        for spec in sets:
            rs = [r for r in results if r["retention"] == retention and r["groups"] == spec]
            if not rs:
                continue
            per_setting[f"{spec} / {retention}"] = {
                "streams": len(rs), "ops": sum(r["ops"] for r in rs),
                "comparisons": sum(r["comparisons"] for r in rs),
                "identical_streams": sum(r["equal"] for r in rs),
                "spec_steps": sum(r["spec_steps"] for r in rs), "prefill_chunks": sum(r["prefill_chunks"] for r in rs),
                "hit_tokens": sum(r["hit_tokens"] for r in rs)}
    summary = {
        "group_sets": sets, "block_size": BLOCK, "streams": len(results), "ops_per_stream": args.ops,
        "usable_blocks": args.usable_blocks, "retentions": retentions,
        "identical": sum(r["equal"] for r in results), "hit_tokens": sum(r["hit_tokens"] for r in results),
        "per_setting": per_setting,
        "compared": "after every op: hit tokens of an admission, whether the op got its blocks, every group's "
                    "table of the request (reserved blocks included), blocks in use, the free queue, the set "
                    "of blocks holding a hash",
        "seconds": round(time.perf_counter() - t0, 1), "results": results,
        "run": {**record(str(Path(__file__).with_name("diff_vllm.py")), args, started=started), "vllm": vllm},
    }
    for name, x in per_setting.items():
        print(f"{name}: {x['identical_streams']}/{x['streams']} streams identical, {x['ops']} ops, "
              f"{x['comparisons']} comparisons")
    return report(summary, args.out, "span streams")
