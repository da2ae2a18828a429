"""A/B of prefix-cache admission: the working tree's ``paged_kv`` against the package as it was at
an earlier git revision, in one process, alternating passes (this VM's timings drift by +-30%
over minutes, so only in-process ratios are trustworthy).

The old package is extracted with ``git archive`` into a temporary directory and imported as
``paged_kv_base`` (its absolute imports are renamed). Workload: the shared-system-prompt requests of
``scripts/bench_prefix_cache.py`` (256 requests of 512 shared + 64 unique tokens, 100,000-block
pool), either one request per jitted call or all 256 in one call. ``--mode decode`` times the
decode step instead: ``append`` for 256 running sequences (``scripts/bench_block_manager.py``'s
lazy workload, prefix caching on), 256 steps inside one jitted ``fori_loop``, per step.

    python scripts/ab_admission.py --base 8396680 --mode batched --rounds 11
    python scripts/ab_admission.py --base 8396680 --mode one --rounds 5 --sync-dispatch
    python scripts/ab_admission.py --base 8396680 --mode decode --rounds 7

Writes ``results/ab_admission_<mode>[_sync].json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def extract_base(rev: str, into: Path) -> None:
    """``paged_kv`` at ``rev`` as the package ``paged_kv_base`` under ``into``."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "paged_kv"], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            text = tar.extractfile(member).read().decode()
            path = into / member.name.replace("paged_kv", "paged_kv_base", 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(re.sub(r"\bpaged_kv\b", "paged_kv_base", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--mode", choices=["one", "batched", "decode"], default="batched")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sync-dispatch", action="store_true",
                        help="jax_cpu_enable_async_dispatch=False (set before JAX starts)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import jax

    if args.sync_dispatch:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    import jax.numpy as jnp
    import numpy as np

    tmp = Path(tempfile.mkdtemp(prefix="paged_kv_base_"))
    extract_base(args.base, tmp)
    sys.path.insert(0, str(tmp))
    sys.path.insert(0, str(ROOT / "scripts"))
    import paged_kv as new
    import paged_kv_base as base
    from bench_prefix_cache import BS, POOL, shared_prompt_requests

    prompts = shared_prompt_requests()
    n, length = prompts.shape
    mods = {"base": base, "new": new}
    cfgs = {k: m.ManagerConfig(num_blocks=POOL, block_size=BS, max_seqs=n, max_blocks_per_seq=64)
            for k, m in mods.items()}
    fns = {k: jax.jit(m.admit, static_argnums=0, donate_argnums=1) for k, m in mods.items()}
    lens1 = jnp.full((1,), length, jnp.int32)
    toks = [jnp.asarray(prompts[i: i + 1]) for i in range(n)]
    sids = [jnp.full((1,), i, jnp.int32) for i in range(n)]
    ids, lens, all_toks = jnp.arange(n, dtype=jnp.int32), jnp.full((n,), length, jnp.int32), jnp.asarray(prompts)

    if args.mode == "decode":
        return decode_ab(args, mods, jax, jnp, np)
    times = {k: [] for k in mods}
    outputs = {}
    for r in range(args.rounds + 1):  # round 0 compiles and is not timed
        for k, m in mods.items():
            f, cfg = fns[k], cfgs[k]
            state = m.init_state(cfg)
            jax.block_until_ready(state)
            if args.mode == "batched":
                t0 = time.perf_counter()
                state, res = f(cfg, state, ids, lens, all_toks)
                jax.block_until_ready(res)
                dt = (time.perf_counter() - t0) / n
            else:
                per = []
                for i in range(n):
                    t0 = time.perf_counter()
                    state, res = f(cfg, state, sids[i], lens1, toks[i])
                    jax.block_until_ready(res)
                    per.append(time.perf_counter() - t0)
                dt = statistics.median(per)
            outputs[k] = [np.asarray(x) for x in (state.block_tables, state.ref_count, res.status,
                                                  res.cached_tokens, res.shared_tokens)]
            if r:
                times[k].append(dt * 1e6)
            print(f"\r  round {r}/{args.rounds}", end="", flush=True)
    print()
    same, med = agree_and_medians(outputs, times, "admitted")
    result = dict(
        base=args.base, mode=args.mode, sync_dispatch=args.sync_dispatch, rounds=args.rounds,
        us_per_request_median=med, us_per_request_runs=times, ratio_new_over_base=med["new"] / med["base"],
        same_tables_and_counts=same, jax=jax.__version__,
        command=" ".join([Path(sys.executable).name, *sys.argv]),
    )
    for k in mods:
        print(f"{args.mode:8s} {k:4s} median {med[k]:8.2f} µs/request  runs {[round(x, 1) for x in times[k]]}")
    print(f"ratio new / base: {result['ratio_new_over_base']:.3f} (same tables and counts: {same})")
    out = args.out or ROOT / "results" / f"ab_admission_{args.mode}{'_sync' if args.sync_dispatch else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def agree_and_medians(outputs: dict, runs: dict, what: str) -> tuple[bool, dict]:
    """Stops unless both versions left identical arrays; else (True, median time per version)."""
    if not all((x == y).all() for x, y in zip(outputs["base"], outputs["new"])):
        raise SystemExit(f"the two versions {what} differently")
    return True, {k: statistics.median(v) for k, v in runs.items()}


def decode_ab(args, mods, jax, jnp, np) -> None:
    """A/B of the decode step: 256 appends per step for 256 sequences, in a jitted fori_loop."""
    from bench_block_manager import prompt_lens

    batch, steps = 256, 256
    lens = prompt_lens(batch)
    tokens = np.random.default_rng(1).integers(0, 32_000, size=(batch, 512)).astype(np.int32)
    ids = jnp.arange(batch, dtype=jnp.int32)
    runs, loops, starts, outputs = {k: [] for k in mods}, {}, {}, {}
    for k, m in mods.items():
        cfg = m.ManagerConfig(num_blocks=100_000, block_size=16, max_seqs=batch, max_blocks_per_seq=512)

        def body(_, state, m=m, cfg=cfg):
            return m.append(cfg, state, ids, ids + 7)[0]

        loops[k] = jax.jit(lambda state, body=body: jax.lax.fori_loop(0, steps, body, state))
        starts[k] = (cfg, m.admit(cfg, m.init_state(cfg), ids, jnp.asarray(lens), jnp.asarray(tokens))[0])
    for r in range(args.rounds + 1):  # round 0 compiles and is not timed
        for k in mods:
            state = jax.tree.map(jnp.copy, starts[k][1])
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            state = jax.block_until_ready(loops[k](state))
            if r:
                runs[k].append((time.perf_counter() - t0) / steps * 1e6)
            outputs[k] = [np.asarray(x) for x in (state.block_tables, state.ref_count, state.num_tokens)]
        print(f"\r  round {r}/{args.rounds}", end="", flush=True)
    print()
    same, med = agree_and_medians(outputs, runs, "decoded")
    result = dict(
        base=args.base, mode="decode", batch=batch, steps_per_run=steps, rounds=args.rounds,
        us_per_step_median=med, us_per_step_runs=runs, ratio_new_over_base=med["new"] / med["base"],
        same_tables_and_counts=same, jax=jax.__version__, load_avg_after=os.getloadavg(),
        command=" ".join([Path(sys.executable).name, *sys.argv]),
    )
    for k in mods:
        print(f"decode {k:4s} median {med[k]:8.2f} µs/step  runs {[round(x, 1) for x in runs[k]]}")
    print(f"ratio new / base: {result['ratio_new_over_base']:.3f} (same tables and counts: {same})")
    out = args.out or ROOT / "results" / "ab_admission_decode.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
