"""Differential check of paged-kv's block manager against vLLM 0.33's own ``KVCacheManager``.

Random request streams (admit, append, free), rich in duplicate full blocks (prompts made of a few
repeated 16-token blocks, prompts exactly one block long, appends that complete a block another
request holds), run through ``paged_kv.BlockManager`` one request per call, then through vLLM's
v1 ``KVCacheManager`` (pure Python, CPU) in its own environment, driven by
``../shared/tools/vllm_ref/vllm_driver.py``. Compared per operation: hit tokens of every
admission, the block table it got, whether each append got a slot, and the free queue after
every free, id for id.

Build the vLLM environment once (see ../shared/tools/vllm_ref/README.md), then:

    python scripts/diff_vllm.py --streams 20 --ops 300      # exits 1 on the first difference
    python scripts/diff_vllm.py --vllm-env ~/.cache/vllm-ref-env --out results/diff_vllm.json

``tests/test_diff_vllm.py`` runs a short version when the environment exists.

``--groups`` checks KV-cache groups instead (``paged_kv.groups``): the same kind of streams, with
longer prompts and bursts of appends so that sliding windows reclaim, through a manager with a
full-attention group and sliding-window groups (``--group-sets``, block size 4), against
``scripts/vllm_groups_driver.py`` (vLLM's ``KVCacheManager`` with the same groups). Compared after
every op: the admission's hit tokens, every group's table of the request, id for id, the whole
free queue and the set of blocks holding a hash. Each stream runs under both prefix-cache
retention settings (``--retention``), paged-kv's ``ManagerConfig.prefix_cache_retention_interval``
and vLLM's ``KVCacheConfig.prefix_cache_retention_interval`` set alike: ``0`` (sparse, the default
of both paged-kv and a vLLM server) and ``none`` (dense)::

    python scripts/diff_vllm.py --groups --streams 8 --ops 300 --out results/diff_vllm_groups.json

``--spans`` checks spans (``extend``, ``commit``, ``truncate``) against ``allocate_slots`` as
vLLM's scheduler calls it for chunked prefill and speculative decoding (lookahead, rejected
drafts), with and without groups, ChunkedLocal included (``scripts/diff_vllm_spans.py``, whose
docstring lists what is compared and what is left out)::

    python scripts/diff_vllm.py --spans --streams 8 --ops 300 --out results/diff_vllm_spans.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from scripts.run_record import record, utc_now

BLOCK = 16  # vllm_driver.py's block size
DEFAULT_ENV = Path(os.environ.get("VLLM_ENV", Path.home() / ".cache" / "vllm-ref-env"))


def env_built(env: Path = DEFAULT_ENV) -> bool:
    """Whether the vLLM 0.33 reference environment ``env`` exists (../shared/tools/vllm_ref/setup.sh)."""
    return (env / "bin" / "python").exists()
DRIVER_CANDIDATES = [ROOT.parent / "shared" / "tools" / "vllm_ref" / "vllm_driver.py",
                     ROOT / "shared" / "tools" / "vllm_ref" / "vllm_driver.py",
                     ROOT.parent.parent / "shared" / "tools" / "vllm_ref" / "vllm_driver.py"]  # a worktree


def find_driver() -> Path | None:
    return next((p for p in DRIVER_CANDIDATES if p.is_file()), None)


def make_stream(seed: int, num_ops: int, usable: int, max_seqs: int = 8) -> list[list]:
    """A random op stream in ``vllm_driver.py``'s format, adapted as it goes so that a request
    whose append runs out of blocks is freed right after (as a scheduler would preempt it)."""
    import paged_kv as pk

    rng = random.Random(seed)
    blocks = [[rng.randrange(50) for _ in range(BLOCK)] for _ in range(4)]  # T, U, V, W
    bm = pk.BlockManager(pk.ManagerConfig(num_blocks=usable + 1, block_size=BLOCK, max_seqs=max_seqs,
                                          max_blocks_per_seq=16))
    tokens: dict[int, list[int]] = {}
    ops: list[list] = []

    def prompt() -> list[int]:
        kind = rng.random()
        n_blocks = rng.choice([1, 1, 2, 2, 3])
        body = [t for _ in range(n_blocks) for t in blocks[rng.choice([0, 0, 1, 2, 3])]]
        if kind < 0.4:  # exactly whole blocks: the last one is computed even when cached
            return body
        return body + [rng.randrange(50) for _ in range(rng.randrange(1, BLOCK))]

    for _ in range(num_ops):
        free_ids = [s for s in range(max_seqs) if s not in tokens]
        r = rng.random()
        if free_ids and (r < 0.35 or not tokens):
            rid, p = rng.choice(free_ids), prompt()
            salt = 1 if rng.random() < 0.1 else 0
            ops.append(["admit", rid, p, salt])
            res = bm.admit([rid], [p], [salt])
            if int(res.status[0]) == pk.Status.OK:
                tokens[rid] = list(p)
        elif tokens and r < 0.85:
            rid = rng.choice(sorted(tokens))
            seq = tokens[rid]
            # Mostly continue one of the shared blocks from where the sequence stands, so the
            # blocks it fills equal blocks other requests hold.
            tok = blocks[rng.choice([0, 1])][len(seq) % BLOCK] if rng.random() < 0.8 else rng.randrange(50)
            ops.append(["append", rid, tok])
            res = bm.append([rid], [tok])
            if int(res.status[0]) == pk.Status.OK:
                seq.append(tok)
            else:
                ops.append(["free", rid])
                bm.free([rid])
                del tokens[rid]
        elif tokens:
            rid = rng.choice(sorted(tokens))
            ops.append(["free", rid])
            bm.free([rid])
            del tokens[rid]
    return ops


def run_paged_kv(ops: list[list], usable: int, max_seqs: int = 8) -> list[str]:
    """The driver's output lines, produced by paged-kv."""
    import paged_kv as pk

    bm = pk.BlockManager(pk.ManagerConfig(num_blocks=usable + 1, block_size=BLOCK, max_seqs=max_seqs,
                                          max_blocks_per_seq=16))
    lines = []
    for i, op in enumerate(ops):
        if op[0] == "admit":
            res = bm.admit([op[1]], [op[2]], [op[3]])
            ok = int(res.status[0]) == pk.Status.OK
            hit = int(res.cached_tokens[0]) if ok else None
            lines.append(f"{i} admit {op[1]} hit {hit} table {bm.table(op[1]) if ok else None}")
        elif op[0] == "append":
            ok = int(bm.append([op[1]], [op[2]]).status[0]) == pk.Status.OK
            lines.append(f"{i} append {op[1]} {'ok' if ok else 'out of blocks'}")
        else:
            bm.free([op[1]])
            lines.append(f"{i} free {op[1]} queue {bm.free_queue()}")
    return lines


def run_vllm(ops: list[list], usable: int, env: Path, driver: Path, *extra: str) -> list[str]:
    """Runs ``driver`` (``vllm_driver.py``, or ``vllm_groups_driver.py`` with its block size and
    group spec as ``extra``) on ``ops`` in the vLLM environment; returns its numbered lines."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ops, f)
    try:
        out = subprocess.run([str(env / "bin" / "python"), str(driver), f.name, str(usable), *extra],
                             capture_output=True, text=True, check=True, timeout=600)
    finally:
        os.unlink(f.name)
    return [line for line in out.stdout.splitlines() if line and line.split()[0].isdigit()]


def compare(seed: int, num_ops: int, usable: int, env: Path, driver: Path) -> dict:
    ops = make_stream(seed, num_ops, usable)
    ours, theirs = run_paged_kv(ops, usable), run_vllm(ops, usable, env, driver)
    admits = [line for line in ours if " admit " in line]
    hit_tokens = sum(int(line.split()[4]) for line in admits if line.split()[4] != "None")
    first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if first_diff is None and len(ours) != len(theirs):
        first_diff = min(len(ours), len(theirs))
    return {
        "seed": seed, "ops": len(ops), "admissions": len(admits), "hit_tokens": hit_tokens,
        "equal": first_diff is None,
        "first_difference": None if first_diff is None else {
            "op": ops[first_diff] if first_diff < len(ops) else None,
            "paged_kv": ours[first_diff] if first_diff < len(ours) else None,
            "vllm": theirs[first_diff] if first_diff < len(theirs) else None,
        },
    }


GROUP_BLOCK = 4
GROUP_SETS = ("full,w5", "full,w6,w9", "w7", "full,w2", "full,w1", "full,w13,full",
              "w9,w9,w9,w9,w9,full", "w6,w10,w6")
RETENTIONS = ("0", "none")
"""``--retention`` values: vLLM's ``prefix_cache_retention_interval`` as the driver takes it."""
RETENTION_LABELS = {"0": "0 (sparse; the default of paged-kv and of a vLLM server)",
                    "none": "None (dense; vLLM's KVCacheConfig built by hand)"}
GROUPS_DRIVER = ROOT / "scripts" / "vllm_groups_driver.py"


def parse_groups(spec: str) -> tuple:
    """``"full,w6"`` -> ``(Group("full"), Group("window", 6))``."""
    from paged_kv.config import Group

    return tuple(Group("full") if g == "full" else Group("window", int(g[1:])) for g in spec.split(","))


def groups_config(usable: int, spec: str, retention: str = "0", max_seqs: int = 6):
    import paged_kv as pk

    return pk.ManagerConfig(num_blocks=usable + 1, block_size=GROUP_BLOCK, max_seqs=max_seqs,
                            max_blocks_per_seq=32, groups=parse_groups(spec),
                            prefix_cache_retention_interval=None if retention == "none" else int(retention))


def make_groups_stream(seed: int, num_ops: int, usable: int, spec: str, retention: str = "0",
                       max_seqs: int = 6) -> list[list]:
    """A random op stream for ``vllm_groups_driver.py``, rich in shared prefixes: most prompts are
    a prefix of one document (32 blocks drawn from 4 distinct ones, so blocks also repeat inside
    it), sometimes with a short tail of their own; appends come in bursts of up to 12 tokens that
    mostly continue the document (windows move, and a reclaimed block stays a hit for later
    requests); a request that runs out of blocks is freed right after."""
    import paged_kv as pk

    bs = GROUP_BLOCK
    rng = random.Random(seed)
    blocks = [[rng.randrange(6) for _ in range(bs)] for _ in range(4)]
    doc = [t for _ in range(32) for t in blocks[rng.choice([0, 0, 1, 2, 3])]]
    bm = pk.BlockManager(groups_config(usable, spec, retention, max_seqs))
    limit = bm.config.max_tokens_per_seq - 1
    tokens: dict[int, list[int]] = {}
    ops: list[list] = []

    def prompt() -> list[int]:
        body = doc[: bs * rng.randrange(1, 9)]
        if rng.random() < 0.5:
            return body
        return body + [rng.randrange(6) for _ in range(rng.randrange(1, bs + 2))]

    def drop(rid: int) -> None:
        ops.append(["free", rid])
        bm.free([rid])
        del tokens[rid]

    while len(ops) < num_ops:
        free_ids = [s for s in range(max_seqs) if s not in tokens]
        r = rng.random()
        if free_ids and (r < 0.3 or not tokens):
            rid, p = rng.choice(free_ids), prompt()
            salt = 1 if rng.random() < 0.1 else 0
            ops.append(["admit", rid, p, salt])
            if int(bm.admit([rid], [p], [salt]).status[0]) == pk.Status.OK:
                tokens[rid] = list(p)
        elif tokens and r < 0.85:
            rid = rng.choice(sorted(tokens))
            for _ in range(rng.randrange(1, 13)):
                seq = tokens[rid]
                if len(seq) >= limit:
                    break
                tok = doc[len(seq)] if rng.random() < 0.9 else rng.randrange(6)
                ops.append(["append", rid, tok])
                if int(bm.append([rid], [tok]).status[0]) == pk.Status.OK:
                    seq.append(tok)
                else:
                    drop(rid)
                    break
        elif tokens:
            drop(rng.choice(sorted(tokens)))
    return ops


def run_paged_kv_groups(ops: list[list], usable: int, spec: str, retention: str = "0",
                        max_seqs: int = 6) -> list[str]:
    """``vllm_groups_driver.py``'s output lines, produced by paged-kv."""
    import paged_kv as pk

    bm = pk.BlockManager(groups_config(usable, spec, retention, max_seqs))
    lines = []
    for i, op in enumerate(ops):
        rid = op[1]
        if op[0] == "admit":
            res = bm.admit([rid], [op[2]], [op[3]])
            ok = int(res.status[0]) == pk.Status.OK
            hit = int(res.cached_tokens[0]) if ok else None
            what = f"admit {rid} hit {hit} tables {bm.tables(rid) if ok else None}"
        elif op[0] == "append":
            ok = int(bm.append([rid], [op[2]]).status[0]) == pk.Status.OK
            what = f"append {rid} {'ok' if ok else 'out of blocks'} tables {bm.tables(rid)}"
        else:
            bm.free([rid])
            what = f"free {rid}"
        lines.append(f"{i} {what} queue {bm.free_queue()} cached {bm.cached_blocks()}")
    return lines


def compare_groups(seed: int, num_ops: int, usable: int, spec: str, env: Path, retention: str = "0") -> dict:
    ops = make_groups_stream(seed, num_ops, usable, spec, retention)
    ours = run_paged_kv_groups(ops, usable, spec, retention)
    theirs = run_vllm(ops, usable, env, GROUPS_DRIVER, str(GROUP_BLOCK), spec, retention)
    admits = [line.split() for line in ours if line.split()[1] == "admit"]
    hit_tokens = sum(int(w[4]) for w in admits if w[4] != "None")
    # Reclaims seen: appends after which a window table gained a null entry.
    nulls = sum(line.count("[0, ") for line in ours if " append " in line)
    first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if first_diff is None and len(ours) != len(theirs):
        first_diff = min(len(ours), len(theirs))
    return {
        "seed": seed, "groups": spec, "retention": retention, "ops": len(ops), "admissions": len(admits),
        "hit_tokens": hit_tokens, "appends": sum(op[0] == "append" for op in ops), "null_entries_seen": nulls,
        "comparisons": min(len(ours), len(theirs)) if first_diff is None else first_diff + 1,
        "equal": first_diff is None,
        "first_difference": None if first_diff is None else {
            "op": ops[first_diff] if first_diff < len(ops) else None,
            "paged_kv": ours[first_diff] if first_diff < len(ours) else None,
            "vllm": theirs[first_diff] if first_diff < len(theirs) else None,
        },
    }


def main_groups(args) -> int:
    if not GROUPS_DRIVER.is_file() or not (args.vllm_env / "bin" / "python").exists():
        print(f"needs {GROUPS_DRIVER} and the vLLM environment ({args.vllm_env})", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    started, vllm = utc_now(), vllm_version(args.vllm_env)
    results = []
    retentions = args.retention.split(",")
    for retention in retentions:
        for spec in args.group_sets.split(";"):
            for k in range(args.streams):
                r = compare_groups(args.seed + k, args.ops, args.usable_blocks, spec, args.vllm_env, retention)
                results.append(r)
                print(f"retention {retention} groups {spec} stream {r['seed']}: {r['ops']} ops, "
                      f"{r['admissions']} admissions, {r['hit_tokens']} hit tokens: "
                      + ("identical" if r["equal"] else f"DIFFERS at {r['first_difference']}"), flush=True)
    per_setting = {}
    for retention in retentions:
        rs = [r for r in results if r["retention"] == retention]
        per_setting[retention] = {
            "streams": len(rs), "ops": sum(r["ops"] for r in rs), "comparisons": sum(r["comparisons"] for r in rs),
            "divergent_streams": sum(not r["equal"] for r in rs), "hit_tokens": sum(r["hit_tokens"] for r in rs)}
    summary = {
        "group_sets": args.group_sets.split(";"), "block_size": GROUP_BLOCK, "streams": len(results),
        "ops_per_stream": args.ops, "usable_blocks": args.usable_blocks, "retentions": retentions,
        "identical": sum(r["equal"] for r in results), "hit_tokens": sum(r["hit_tokens"] for r in results),
        "per_retention": per_setting,
        "compared": "after every op: hit tokens of an admission, every group's table of the request, "
                    "the free queue, the set of blocks holding a hash",
        "configuration": "paged-kv ManagerConfig.prefix_cache_retention_interval and vLLM's "
                         "KVCacheConfig.prefix_cache_retention_interval set alike per stream: 0 (sparse; "
                         "the default of paged-kv and of a vLLM server's CacheConfig) or none (dense)",
        "seconds": round(time.perf_counter() - t0, 1), "results": results,
        "run": {**record(__file__, args, started=started), "vllm": vllm},
    }
    for retention, x in per_setting.items():
        print(f"retention {RETENTION_LABELS.get(retention, retention)}: {x['streams']} streams, {x['ops']} ops, "
              f"{x['comparisons']} comparisons, {x['divergent_streams']} divergent streams")
    return report(summary, args.out, "grouped streams")


def vllm_version(env: Path) -> str:
    """The vLLM version installed in the reference environment ``env`` ("unknown" without one)."""
    try:
        return subprocess.run([str(env / "bin" / "python"), "-c",
                               "import importlib.metadata as m; print(m.version('vllm'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(summary: dict, out: Path | None, what: str) -> int:
    """Writes ``summary`` to ``out`` (when given), prints the verdict; 0 when every stream agreed."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{summary['identical']}/{summary['streams']} {what} identical to vLLM 0.33 "
          f"({summary['hit_tokens']} hit tokens in all)")
    return 0 if summary["identical"] == summary["streams"] else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=10)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--usable-blocks", type=int, default=12, help="pool size without the null block")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-env", type=Path, default=DEFAULT_ENV)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--groups", action="store_true", help="KV-cache groups against vllm_groups_driver.py")
    ap.add_argument("--spans", action="store_true",
                    help="chunked prefill and speculative decoding against vllm_spans_driver.py")
    ap.add_argument("--group-sets", default=None,
                    help="with --groups: ';'-separated group lists, each like 'full,w6'")
    ap.add_argument("--retention", default=",".join(RETENTIONS),
                    help="with --groups: ','-separated prefix_cache_retention_interval settings, 0 and/or none")
    args = ap.parse_args()
    args.group_sets_given = args.group_sets is not None
    if args.spans:
        from scripts.diff_vllm_spans import main_spans

        if args.usable_blocks == 12:  # the single-group default is too small for several groups
            args.usable_blocks = 40
        return main_spans(args)
    if not args.group_sets_given:
        args.group_sets = ";".join(GROUP_SETS)
    if args.groups:
        if args.usable_blocks == 12:  # the single-group default is too small for several groups
            args.usable_blocks = 24
        return main_groups(args)
    driver = find_driver()
    if driver is None or not (args.vllm_env / "bin" / "python").exists():
        print(f"needs vllm_driver.py ({DRIVER_CANDIDATES[0]}) and the vLLM environment ({args.vllm_env})",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = []
    for k in range(args.streams):
        r = compare(args.seed + k, args.ops, args.usable_blocks, args.vllm_env, driver)
        results.append(r)
        print(f"stream {r['seed']}: {r['ops']} ops, {r['admissions']} admissions, {r['hit_tokens']} hit tokens: "
              + ("identical" if r["equal"] else f"DIFFERS at {r['first_difference']}"), flush=True)
    summary = {
        "streams": len(results), "ops_per_stream": args.ops, "usable_blocks": args.usable_blocks,
        "identical": sum(r["equal"] for r in results), "hit_tokens": sum(r["hit_tokens"] for r in results),
        "seconds": round(time.perf_counter() - t0, 1), "results": results,
        "command": "python " + " ".join(sys.argv), "run": record(__file__, args),
    }
    return report(summary, args.out, "streams")


if __name__ == "__main__":
    sys.exit(main())
