"""Prefix-cache admission cost and hit rates, jitted on this machine, over a 100,000-block pool.

1. Shared system prompt: 256 requests = one 512-token system prompt + 64 unique tokens each.
   a) admitted one call at a time (a jitted ``admit`` of one request per call), and the same
      admissions one per iteration of a jitted ``fori_loop`` (no dispatch per request);
   b) the same requests as one batched admission (one call of 256) on a fresh manager.
   Reports hit tokens per request, the median admission cost per request and the hit rate, and
   the plain-Python reference manager (exact-prefix dict) on (a) in the same process.
2. Mixed workload under memory pressure: waves of 256 requests drawn from 200 system prompts of
   1,024 tokens (Zipf popularity) + ~1,000 unique tokens each, 20 generated tokens, then freed; 40
   waves hold far more than the pool, so eviction decides which prompts survive. Run with freed
   uncached blocks at the front of the free queue (default) and with everything at the back.
3. Short chat turns at the pool's edge (``CHAT_EDGE``): every request frees one uncached, partly
   full block beside four cached ones, so where the uncached blocks go decides how much of the pool
   the cache keeps; same two policies.

The one-request-per-call admissions run three times, each in its own process: with JAX's default
asynchronous CPU dispatch; with ``jax_cpu_enable_async_dispatch=False``, which runs a small
computation on the calling thread instead of handing it to a runtime thread and waiting for it
(the setting for a host loop that reads every result before its next call); and the latter with
the process restricted to one CPU (what ``taskset -c 0`` does). On more than one CPU, XLA:CPU
splits every kernel that reads or writes more than ~512 KB (each one touching a pool-sized array)
in two and runs independent kernels of a call on its worker threads; for a call of ~130 small
kernels the hand-offs between threads cost more than they save on this 2-vCPU VM. Beside them, the
cost of a jitted call that takes the same state and changes one array (the floor of any jitted
per-request call on this machine).

    python scripts/bench_prefix_cache.py     # writes results/bench_prefix_cache.json
    python scripts/bench_prefix_cache.py --smoke --out /tmp/pc.json   # tiny sizes: a check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import paged_kv as pk
from paged_kv.apps.progress import bar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paged_kv.reference import ReferenceBlockManager
from scripts.run_record import record, utc_now

POOL = 100_000
BS = 16


def shared_prompt_requests(n=256, system=512, unique=64, seed=0):
    rng = np.random.default_rng(seed)
    sys_tokens = rng.integers(0, 32_000, system)
    return np.stack([np.concatenate([sys_tokens, rng.integers(0, 32_000, unique)]) for _ in range(n)]
                    ).astype(np.int32)


def one_at_a_time(prompts, repeats=3, pool=POOL):
    """Median admission time of one request per jitted call (the median of ``repeats`` passes
    over the 256 requests, each on a fresh manager), and the same for a call that only touches
    the state (the per-call floor)."""
    n, length = prompts.shape
    cfg = pk.ManagerConfig(num_blocks=pool, block_size=BS, max_seqs=n, max_blocks_per_seq=64)
    admit = jax.jit(pk.admit, static_argnums=0, donate_argnums=1)
    touch = jax.jit(lambda state, sid: (state.replace(num_tokens=state.num_tokens.at[sid].add(1)), sid),
                    donate_argnums=0)
    lens = jnp.full((1,), length, jnp.int32)
    sids = [jnp.full((1,), i, jnp.int32) for i in range(n)]
    toks = [jnp.asarray(prompts[i: i + 1]) for i in range(n)]
    # Compile on a throwaway state first.
    warm, _ = admit(cfg, pk.init_state(cfg), sids[0], lens, toks[0])
    warm, _ = touch(warm, sids[0])
    jax.block_until_ready(warm)
    medians, floors = [], []
    shown = bar(repeats * n, "one at a time", unit="req")
    for _ in range(repeats):
        state = pk.init_state(cfg)
        times, hits = [], []
        for i in range(n):
            t0 = time.perf_counter()
            state, result = admit(cfg, state, sids[i], lens, toks[i])
            jax.block_until_ready(result)
            times.append(time.perf_counter() - t0)
            # Read as a host scheduler reads a result: one transfer. ``result.cached_tokens[0]``
            # would launch a jitted gather between admissions, and it left the next admission
            # ~15 µs slower (a cold start after another computation).
            hits.append(int(np.asarray(result.cached_tokens)[0]))
            shown.update()
        medians.append(statistics.median(times))
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            state, out = touch(state, sids[i])
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t0)
        floors.append(statistics.median(times))
    shown.close()
    st = state.cache.stats
    return dict(
        admit_us_median=statistics.median(medians) * 1e6,
        admit_us_per_pass=[m * 1e6 for m in medians],
        state_call_floor_us=statistics.median(floors) * 1e6,
        state_leaves=len(jax.tree.leaves(state)),
        hit_tokens_first=hits[0], hit_tokens_rest_min=min(hits[1:]), hit_tokens_rest_max=max(hits[1:]),
        hit_rate=int(st.hit_tokens) / int(st.query_tokens),
    )


def one_at_a_time_in_process(sync_dispatch: bool, one_core: bool = False) -> dict:
    """``one_at_a_time`` in a fresh process: the dispatch mode and the CPUs are fixed when JAX
    starts."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one-at-a-time-only"]
    cmd += ["--sync-dispatch"] if sync_dispatch else []
    cmd += ["--one-core"] if one_core else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def one_at_a_time_in_loop(prompts, repeats=3, pool=POOL):
    """The same 256 one-request admissions inside one jitted ``fori_loop``: the per-admission
    cost without the host dispatch of a call (how an on-device loop would admit)."""
    n, length = prompts.shape
    cfg = pk.ManagerConfig(num_blocks=pool, block_size=BS, max_seqs=n, max_blocks_per_seq=64)
    toks = jnp.asarray(prompts)

    @jax.jit
    def admit_all(state):
        def body(i, carry):
            state, hits = carry
            state, res = pk.admit(cfg, state, i[None], jnp.full((1,), length, jnp.int32),
                                  jax.lax.dynamic_slice_in_dim(toks, i, 1))
            return state, hits.at[i].set(res.cached_tokens[0])
        return jax.lax.fori_loop(0, n, body, (state, jnp.zeros((n,), jnp.int32)))

    times = []
    for r in range(repeats + 1):
        state = pk.init_state(cfg)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state, hits = admit_all(state)
        jax.block_until_ready(hits)
        if r:
            times.append(time.perf_counter() - t0)
    hits = hits.tolist()
    return dict(admit_us_per_request=statistics.median(times) / n * 1e6, hit_tokens_first=hits[0],
                hit_tokens_rest_min=min(hits[1:]), hit_tokens_rest_max=max(hits[1:]))


def batched(prompts, repeats=11, pool=POOL):
    n, length = prompts.shape
    cfg = pk.ManagerConfig(num_blocks=pool, block_size=BS, max_seqs=n, max_blocks_per_seq=64)
    admit = jax.jit(pk.admit, static_argnums=0, donate_argnums=1)
    ids, lens, toks = jnp.arange(n, dtype=jnp.int32), jnp.full((n,), length, jnp.int32), jnp.asarray(prompts)
    times = []
    for r in range(repeats + 1):
        state = pk.init_state(cfg)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state, result = admit(cfg, state, ids, lens, toks)
        jax.block_until_ready(result)
        if r:
            times.append(time.perf_counter() - t0)
    hits = (result.cached_tokens + result.shared_tokens).tolist()
    st = state.cache.stats
    total = statistics.median(times)
    return dict(
        admit_us_total=total * 1e6, admit_us_per_request=total / n * 1e6,
        hit_tokens_first=hits[0], hit_tokens_rest_min=min(hits[1:]), hit_tokens_rest_max=max(hits[1:]),
        hit_rate=int(st.hit_tokens) / int(st.query_tokens),
    )


def reference_one_at_a_time(prompts, pool=POOL):
    n = prompts.shape[0]
    cfg = pk.ManagerConfig(num_blocks=pool, block_size=BS, max_seqs=n, max_blocks_per_seq=64)
    ref = ReferenceBlockManager(cfg)
    times = []
    for i in range(n):
        p = prompts[i].tolist()
        t0 = time.perf_counter()
        ref.admit([i], [p])
        times.append(time.perf_counter() - t0)
    return dict(admit_us_median=statistics.median(times) * 1e6)


def mixed(uncached_to_front, waves=40, batch=256, families=200, system_len=1024, unique=(900, 1100), gen=20,
          pool=POOL, seed=0, label="mixed"):
    """Waves of ``batch`` requests: a system prompt drawn from ``families`` (Zipf popularity) plus
    a unique tail, ``gen`` generated tokens, then freed. Returns hit rates and evictions."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 32_000, (families, system_len))
    popularity = 1.0 / np.arange(1, families + 1) ** 1.1
    popularity /= popularity.sum()
    width = system_len + unique[1]
    cfg = pk.ManagerConfig(num_blocks=pool, block_size=BS, max_seqs=batch,
                           max_blocks_per_seq=-(-(width + gen) // BS),
                           uncached_to_front=uncached_to_front)
    admit = jax.jit(pk.admit, static_argnums=0, donate_argnums=1)
    append = jax.jit(pk.append, static_argnums=0, donate_argnums=1)
    free = jax.jit(pk.free, static_argnums=0, donate_argnums=1)
    state = pk.init_state(cfg)
    ids = jnp.arange(batch, dtype=jnp.int32)
    shown = bar(waves, f"{label}, uncached_to_front={uncached_to_front}", unit="wave")
    for _ in range(waves):
        fam = rng.choice(families, size=batch, p=popularity)
        tail = rng.integers(unique[0], unique[1] + 1, size=batch)
        toks = np.zeros((batch, width), np.int32)
        toks[:, :system_len] = system[fam]
        toks[:, system_len:] = rng.integers(0, 32_000, (batch, width - system_len))
        lens = system_len + tail
        state, result = admit(cfg, state, ids, jnp.asarray(lens, jnp.int32), jnp.asarray(toks))
        assert (np.asarray(result.status) == 0).all(), np.asarray(result.status)
        for _ in range(gen):
            state, r = append(cfg, state, ids, jnp.asarray(rng.integers(0, 32_000, batch), jnp.int32))
        state, _ = free(cfg, state, ids)
        shown.update()
    shown.close()
    st = state.cache.stats
    return dict(
        workload=label, uncached_to_front=uncached_to_front, pool=pool,
        hit_rate=int(st.hit_tokens) / int(st.query_tokens),
        system_prompt_hit_rate=int(st.hit_tokens) / (waves * batch * system_len),
        evictions=int(st.evictions), requests=waves * batch,
    )


# Short chat turns at the edge of the pool: a 64-token system prompt (4 full blocks) from 2,000
# families plus 1-11 unique tokens and 4 generated, so every request frees exactly one partly full,
# uncached block beside its 4 cached ones. The pool holds the hot families only if those uncached
# blocks do not take up room in the LRU order: this is where sending them to the front matters.
CHAT_EDGE = dict(batch=64, families=2_000, system_len=64, unique=(1, 11), gen=4, pool=3_000,
                 label="short chat turns at the pool's edge")
# --smoke: every part at a tiny size, in this process (checks that the script runs; no figures).
SMOKE_MIX = dict(batch=8, families=4, system_len=32, unique=(4, 8), gen=2, pool=256)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/bench_prefix_cache.json"))
    parser.add_argument("--waves", type=int, default=40)
    parser.add_argument("--chat-waves", type=int, default=300)
    parser.add_argument("--one-at-a-time-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sync-dispatch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one-core", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true",
                        help="every part at a tiny size, the one-request-per-call runs in this process (a check "
                             "that the script runs, no figures)")
    args = parser.parse_args(argv)
    started = utc_now()

    if args.smoke:
        prompts = shared_prompt_requests(n=4, system=32, unique=8)
        pool = SMOKE_MIX["pool"]
        one = one_async = one_pinned = {**one_at_a_time(prompts, 1, pool), "smoke": "in this process"}
        loop, ref = one_at_a_time_in_loop(prompts, 1, pool), reference_one_at_a_time(prompts, pool)
        many = batched(prompts, 1, pool)
        mix = [mixed(front, waves=2, **SMOKE_MIX) for front in (True, False)]
        return write(args, argv, started, one, one_async, one_pinned, loop, ref, many, mix)
    prompts = shared_prompt_requests()
    if args.one_at_a_time_only:  # a child process of the full run
        if args.one_core:  # like `taskset -c N`: before JAX creates its CPU client and threads
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        if args.sync_dispatch:
            jax.config.update("jax_cpu_enable_async_dispatch", False)
        print(json.dumps(one_at_a_time(prompts)))
        return
    print("one request per call, default (asynchronous) dispatch ...", flush=True)
    one_async = one_at_a_time_in_process(sync_dispatch=False)
    print("one request per call, jax_cpu_enable_async_dispatch=False ...", flush=True)
    one = one_at_a_time_in_process(sync_dispatch=True)
    print("one request per call, synchronous dispatch, process on one CPU ...", flush=True)
    one_pinned = one_at_a_time_in_process(sync_dispatch=True, one_core=True)
    loop = one_at_a_time_in_loop(prompts)
    ref = reference_one_at_a_time(prompts)
    many = batched(prompts)
    mix = [mixed(True, waves=args.waves), mixed(False, waves=args.waves),
           mixed(True, waves=args.chat_waves, **CHAT_EDGE), mixed(False, waves=args.chat_waves, **CHAT_EDGE)]

    print("\nShared 512-token system prompt, 256 requests of 576 tokens, pool 100,000 blocks")
    print("| admission | hit tokens (first / rest) | cost per request (µs) | hit rate |")
    print("|---|---|---|---|")
    print(f"| jitted, one request per call (synchronous dispatch) | {one['hit_tokens_first']} / "
          f"{one['hit_tokens_rest_min']} | {one['admit_us_median']:.1f} | {one['hit_rate']:.3f} |")
    print(f"| jitted, one request per call (default dispatch) | {one_async['hit_tokens_first']} / "
          f"{one_async['hit_tokens_rest_min']} | {one_async['admit_us_median']:.1f} | {one_async['hit_rate']:.3f} |")
    print(f"| jitted, one request per call (synchronous dispatch, process on one CPU) | "
          f"{one_pinned['hit_tokens_first']} / {one_pinned['hit_tokens_rest_min']} | "
          f"{one_pinned['admit_us_median']:.1f} | {one_pinned['hit_rate']:.3f} |")
    print(f"| floor: a jitted call that takes the state ({one['state_leaves']} arrays) and changes one "
          f"| | {one['state_call_floor_us']:.1f} (default dispatch {one_async['state_call_floor_us']:.1f}) | |")
    print(f"| one request per step of a jitted loop | {loop['hit_tokens_first']} / {loop['hit_tokens_rest_min']}"
          f" | {loop['admit_us_per_request']:.1f} | |")
    print(f"| jitted, 256 in one call | {many['hit_tokens_first']} / {many['hit_tokens_rest_min']}"
          f" | {many['admit_us_per_request']:.2f} ({many['admit_us_total']:.0f} in all) | {many['hit_rate']:.3f} |")
    print(f"| Python reference, one per call | 0 / 512 | {ref['admit_us_median']:.1f} | |")
    print("\nMixed workloads under memory pressure (Zipf-popular system prompts)")
    print("| workload | pool | freed uncached blocks go to | hit rate (all prompt tokens) "
          "| system-prompt tokens hit | cached blocks evicted |")
    print("|---|---|---|---|---|---|")
    for m in mix:
        where = "front (default)" if m["uncached_to_front"] else "back"
        print(f"| {m['workload']} | {m['pool']} | {where} | {m['hit_rate']:.3f} | {m['system_prompt_hit_rate']:.3f}"
              f" | {m['evictions']} |")
    write(args, argv, started, one, one_async, one_pinned, loop, ref, many, mix)


def write(args, argv, started, one, one_async, one_pinned, loop, ref, many, mix) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(jax=jax.__version__, backend=jax.default_backend(), machine=platform.machine(),
                pool=SMOKE_MIX["pool"] if args.smoke else POOL, block_size=BS)
    args.out.write_text(json.dumps(dict(run=record(__file__, args, argv, started=started), meta=meta, one_at_a_time=one,
                                        one_at_a_time_default_dispatch=one_async, one_at_a_time_one_cpu=one_pinned,
                                        one_at_a_time_in_loop=loop, batched=many,
                                        reference_one_at_a_time=ref, mixed=mix), indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
