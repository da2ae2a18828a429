"""What one ``BlockManager.append`` host call costs, beside vLLM 0.33's Python manager doing the same
work on the same machine, in the same window.

The workload is vLLM's decode workload of ``../shared/tools/vllm_ref/vllm_block_bench.py``: B
requests with 40-token prompts, then ``--steps`` decode steps of one token each (every 16th step
takes a fresh block per request; with prefix caching each filled block is hashed and cached), a
pool of ``B * ceil((40 + steps) / 16) + 1`` blocks. vLLM's step is ``allocate_slots(req, 1)`` for
each running request plus appending the sampled token (which hashes a filled block); paged-kv's is
one ``BlockManager.append(ids, tokens)``. Per B and caching setting, the median step over the
steps, and for paged-kv its parts (medians of calls timed apart, same state and inputs):

* ``host_call_us``: ``BlockManager.append``: input checks, padding, the jitted call, results to
  numpy;
* ``program_us``: the jitted ``append`` called directly on device inputs and synchronised: the
  XLA program and its dispatch;
* ``dispatch_floor_us``: a jitted program that only adds 0 to each leaf of the manager's state
  (the same pytree, donated): what any call that passes the state costs before it does any work.

With ``--vllm-env`` (default ``~/.cache/vllm-ref-env``, built by ``../shared/tools/vllm_ref/setup.sh``)
the vLLM benchmark runs right after, in a subprocess of that environment, with the same B, steps and
repetitions, and each row gets ``vllm_step_us`` and ``ratio`` (paged-kv's host call / vLLM's step;
<= 1 is the goal). Without the environment those fields are None and the file says why.

    python scripts/bench_host_calls.py                         # writes results/bench_host_calls.json
    python scripts/bench_host_calls.py --batches 1 --steps 40 --no-vllm --out /tmp/h.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.run_record import record, table, utc_now

PROMPT = 40
VLLM_BENCH = ROOT.parent / "shared" / "tools" / "vllm_ref" / "vllm_block_bench.py"
DEFAULT_ENV = Path(os.environ.get("VLLM_ENV", Path.home() / ".cache" / "vllm-ref-env"))


def median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def paged_kv_row(batch: int, caching: bool, steps: int) -> dict:
    """Median step of ``BlockManager.append`` on the workload (module docstring), and its parts."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import paged_kv as pk

    blocks = -(-(PROMPT + steps) // 16)
    cfg = pk.ManagerConfig(num_blocks=batch * blocks + 1, block_size=16, max_seqs=batch,
                           max_blocks_per_seq=blocks, prefix_caching=caching)
    rng = np.random.default_rng(0)
    ids = list(range(batch))
    tokens = rng.integers(0, 32_000, size=(steps + 1, batch)).tolist()

    def fresh():
        bm = pk.BlockManager(cfg)
        bm.admit(ids, rng.integers(0, 32_000, size=(batch, PROMPT)).tolist())
        return bm

    fresh().append(ids, tokens[0])  # compiles
    bm = fresh()
    times = []
    for t in tokens[:steps]:
        t0 = time.perf_counter()
        result = bm.append(ids, t)
        times.append(time.perf_counter() - t0)
    assert (result.status == 0).all() and all(len(bm.table(i)) == blocks for i in ids)
    host = statistics.median(times) * 1e6

    # The parts, on a state that has room: the same program on device inputs, then the floor.
    # The public operation jitted as BlockManager jits it (max_seqs = B: no padding rows).
    append = jax.jit(pk.append, static_argnums=0, donate_argnums=1)
    bm = fresh()
    dev_ids, dev_tok = jnp.asarray(ids, jnp.int32), jnp.asarray(tokens[0], jnp.int32)
    n = min(steps, 16 * (blocks - -(-PROMPT // 16)) - 1)  # appends that stay within the table

    def program():
        bm.state, r = append(cfg, bm.state, dev_ids, dev_tok)
        jax.block_until_ready(r)

    program()
    prog = median_us(program, n)
    floor_fn = jax.jit(lambda s: jax.tree.map(lambda x: x + 0, s), donate_argnums=0)
    box = [floor_fn(pk.init_state(cfg))]

    def floor():
        box[0] = floor_fn(box[0])
        jax.block_until_ready(box[0])

    return dict(batch=batch, prefix_caching=caching, pool=cfg.num_blocks, steps=steps,
                host_call_us=round(host, 1), program_us=round(prog, 1),
                dispatch_floor_us=round(median_us(floor, 200), 1))


def vllm_rows(env: Path, batches: list[int], steps: int, reps: int) -> tuple[dict | None, str]:
    """``{(B, caching): median step µs}`` from vLLM's benchmark, and a note (why it is None)."""
    py = env / "bin" / "python"
    if not py.exists():
        return None, f"no vLLM environment at {env} (../shared/tools/vllm_ref/setup.sh builds it)"
    if not VLLM_BENCH.is_file():
        return None, f"{VLLM_BENCH} not found"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        cmd = [str(py), str(VLLM_BENCH), "--workloads", "decode", "--batches", ",".join(map(str, batches)),
               "--steps", str(steps), "--prompt-len", str(PROMPT), "--reps", str(reps), "--out", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if res.returncode != 0:
            return None, f"vLLM benchmark failed: {res.stderr[-500:]}"
        data = json.loads(out.read_text())
    steps_us = {(r["B"], r["prefix_caching"]): r["step_median_s"] * 1e6 for r in data["decode"]}
    return steps_us, f"vLLM {data['meta']['vllm_version']} ({' '.join(cmd[1:])})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3, help="vLLM's repetitions (its medians)")
    ap.add_argument("--vllm-env", type=Path, default=DEFAULT_ENV)
    ap.add_argument("--no-vllm", action="store_true", help="paged-kv only")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench_host_calls.json")
    args = ap.parse_args(argv)
    started = utc_now()
    import jax  # noqa: F401  (the record reads its backend)

    rows = [paged_kv_row(b, c, args.steps) for b in args.batches for c in (True, False)]
    vllm, note = (None, "not run (--no-vllm)") if args.no_vllm else vllm_rows(args.vllm_env, args.batches,
                                                                              args.steps, args.reps)
    for r in rows:
        v = vllm.get((r["batch"], r["prefix_caching"])) if vllm else None
        r["vllm_step_us"] = None if v is None else round(v, 1)
        r["ratio"] = None if v is None else round(r["host_call_us"] / v, 2)
    print(table(["B", "caching", "host call µs", "program µs", "floor µs", "vLLM step µs", "ratio"],
                [[r["batch"], r["prefix_caching"], r["host_call_us"], r["program_us"], r["dispatch_floor_us"],
                  r["vllm_step_us"], r["ratio"]] for r in rows]))
    print(f"vLLM: {note}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run = record(__file__, args, argv, started=started)
    run["load_average"] = list(os.getloadavg())
    args.out.write_text(json.dumps(dict(run=run, prompt_tokens=PROMPT, vllm=note, rows=rows), indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
