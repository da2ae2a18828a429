"""Per-step cost of the block manager's ``append`` over a 100,000-block pool, jitted on this
machine, against the plain-Python reference manager on the same workload in the same process.

Workloads, for a batch of B running sequences:
  lazy  B independent sequences (prompts of 100..500 tokens); every step appends one token to
        each, so a fresh block is allocated every 16 tokens per sequence.
  cow   B/4 prompts, each forked into 4 samples; before every step the samples of a group are
        re-forked from their first member (``select``, as beam search does), so every step writes
        into shared, partly full blocks: 3 copies per group per step, plus lazy allocations.

With ``--groups``, every workload also runs on Gemma 3's KV-cache groups (5 sliding-window groups
of 1,024 tokens and 1 full group: vLLM's grouping of its 5 : 1 layers) on the same pool, against
the plain-Python ``GroupedReference``; the single-group and grouped fori_loops alternate repeat
by repeat, and each grouped row gives its time over the single group's (``over_single_*``).

Times: ``call`` = median of individually timed, synchronised jitted ``append`` calls (dispatch
included; for cow the ``select`` before it is timed apart); ``loop`` = whole steps (select +
append for cow) inside one jitted ``lax.fori_loop`` (how the on-device decode loop runs them),
total / steps. The reference is timed per whole step with ``time.perf_counter``. Prefix caching
is on by default (token ids stored, filled blocks hashed and cached); one workload runs without.

    python scripts/bench_block_manager.py            # writes results/bench_block_manager.json
    python scripts/bench_block_manager.py --batches 4 --steps 3 --repeats 1 --num-blocks 512 --out /tmp/bm.json
    python scripts/bench_block_manager.py --groups --workloads lazy --batches 1 8 64 256 \
        --out results/bench_block_manager_groups.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import paged_kv as pk

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paged_kv.engine import kv_cache_groups
from paged_kv.reference import GroupedReference, ReferenceBlockManager
from scripts.run_record import record, utc_now

GROUP = 4
# --workloads: (workload, prefix caching)
WORKLOADS = {"lazy": ("lazy", True), "lazy-no-cache": ("lazy", False), "cow": ("cow", True)}


# Gemma 3's KV-cache groups: vLLM's grouping of its 5 : 1 layers (window 1,024 tokens).
GEMMA3_GROUPS = kv_cache_groups((1024,) * 5 + (0,))


def make_config(batch: int, caching: bool, num_blocks: int = 100_000, groups: tuple = (pk.Group("full"),)
                ) -> pk.ManagerConfig:
    return pk.ManagerConfig(num_blocks=num_blocks, block_size=16, max_seqs=batch,
                            max_blocks_per_seq=512, prefix_caching=caching, groups=groups)


def prompt_lens(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, 501, size=batch).astype(np.int32)


# The setup's admission and fork, jitted: run op by op they would compile a few hundred small
# programs (seconds) for two calls.
_admit = jax.jit(pk.admit, static_argnums=0)
_fork = jax.jit(pk.fork, static_argnums=0)


def start(cfg, workload, batch):
    """Admitted (and for cow, forked) state on device, and the same on the reference."""
    lens = prompt_lens(batch)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 32_000, size=(batch, 512)).astype(np.int32)
    prompts = [tokens[i, : lens[i]].tolist() for i in range(batch)]
    ref = GroupedReference(cfg) if cfg.grouped else ReferenceBlockManager(cfg)
    state = pk.init_state(cfg)
    ids = np.arange(batch, dtype=np.int32)
    if workload == "lazy":
        state, result = _admit(cfg, state, jnp.asarray(ids), jnp.asarray(lens), jnp.asarray(tokens))
        ref.admit(ids.tolist(), prompts)
    else:
        roots = ids[::GROUP]
        children = np.setdiff1d(ids, roots)
        parents = children - children % GROUP
        state, result = _admit(cfg, state, jnp.asarray(roots), jnp.asarray(lens[roots]),
                               jnp.asarray(tokens[roots]))
        ref.admit(roots.tolist(), [prompts[i] for i in roots])
        state, s2 = _fork(cfg, state, jnp.asarray(parents), jnp.asarray(children))
        ref.fork(parents.tolist(), children.tolist())
        assert (np.asarray(s2) == 0).all()
    assert (np.asarray(result.status) == 0).all()
    return state, ref


def device_step(cfg, workload, batch):
    ids = jnp.arange(batch, dtype=jnp.int32)
    parents = ids - ids % GROUP

    def step(state):
        if workload == "cow":
            state, _ = pk.select(cfg, state, ids, parents)
        state, result = pk.append(cfg, state, ids, ids + 7)
        return state, result.num_copies

    return step


def reference_step(workload, batch):
    ids = list(range(batch))
    parents = [i - i % GROUP for i in ids]

    tokens = [i + 7 for i in ids]

    def step(ref):
        if workload == "cow":
            ref.select(ids, parents)
        return ref.append(ids, tokens)

    return step


def time_calls(cfg, workload, batch, steps):
    """Median per-call time of the jitted ``append`` (and, for cow, of the ``select`` before it,
    timed separately), each call synchronised."""
    state, _ = start(cfg, workload, batch)
    ids = jnp.arange(batch, dtype=jnp.int32)
    parents = ids - ids % GROUP
    append = jax.jit(lambda s: pk.append(cfg, s, ids, ids + 7), donate_argnums=0)
    select = jax.jit(lambda s: pk.select(cfg, s, ids, parents)[0], donate_argnums=0)

    def timed(fn, state):
        t0 = time.perf_counter()
        out = fn(state)
        jax.block_until_ready(out)
        return out, time.perf_counter() - t0

    append_times, select_times, total_copies = [], [], 0
    for i in range(steps + 1):
        if workload == "cow":
            state, dt = timed(select, state)
            select_times.append(dt)
        (state, result), dt = timed(append, state)
        if i:  # the first call compiles
            append_times.append(dt)
            total_copies += int(result.num_copies)
    assert int(jnp.sum(state.active)) == batch
    select_s = statistics.median(select_times[1:]) if select_times else 0.0
    return statistics.median(append_times), select_s, total_copies / steps


def time_loops(cfgs, workload, batch, steps, repeats):
    """Median seconds per step of each config's jitted fori_loop, the configs alternating repeat
    by repeat (so a drift of the machine's speed reaches every config alike)."""
    loops = []
    for cfg in cfgs:
        body = device_step(cfg, workload, batch)

        @functools.partial(jax.jit, donate_argnums=0)
        def loop(state, body=body):
            return jax.lax.fori_loop(0, steps, lambda _, c: (body(c[0])[0], c[1]), (state, 0))[0]

        loops.append(loop)
    out = [[] for _ in cfgs]
    for r in range(repeats + 1):
        for cfg, loop, times in zip(cfgs, loops, out):
            state, _ = start(cfg, workload, batch)
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            state = loop(state)
            jax.block_until_ready(state)
            if r:  # the first run compiles
                times.append((time.perf_counter() - t0) / steps)
    return [statistics.median(times) for times in out]


def time_reference(cfg, workload, batch, steps):
    _, ref = start(cfg, workload, batch)
    step = reference_step(workload, batch)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(ref)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 256], help="B (a multiple of 4 for cow)")
    parser.add_argument("--num-blocks", type=int, default=100_000, help="the pool")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--groups", action="store_true",
                        help="also run each workload on Gemma 3's KV-cache groups (5 window : 1 full), alternating")
    parser.add_argument("--out", type=Path, default=Path("results/bench_block_manager.json"))
    args = parser.parse_args(argv)
    started = utc_now()

    rows = []
    for workload, caching in (WORKLOADS[w] for w in args.workloads):
        for batch in args.batches:
            layouts = {"1 full": (pk.Group("full"),)}
            if args.groups:
                layouts["gemma3 5:1"] = GEMMA3_GROUPS
            cfgs = {name: make_config(batch, caching, args.num_blocks, groups) for name, groups in layouts.items()}
            loop_s = dict(zip(cfgs, time_loops(list(cfgs.values()), workload, batch, args.steps, args.repeats)))
            single = None
            for name, cfg in cfgs.items():
                call_s, select_s, copies = time_calls(cfg, workload, batch, args.steps)
                ref_s = time_reference(cfg, workload, batch, args.steps)
                row = dict(
                    workload=workload, groups=name, batch=batch, pool=cfg.num_blocks, prefix_caching=caching,
                    jit_call_us=call_s * 1e6, select_call_us=select_s * 1e6,
                    jit_loop_us=loop_s[name] * 1e6, reference_us=ref_s * 1e6,
                    speedup_loop=ref_s / loop_s[name],
                    copies_per_step=copies,
                )
                if single is None:
                    single = row
                else:
                    row["over_single_loop"] = row["jit_loop_us"] / single["jit_loop_us"]
                    row["over_single_call"] = row["jit_call_us"] / single["jit_call_us"]
                rows.append(row)
                print(
                    f"{workload:5s} {name:10s} cache={caching!s:5s} B={batch:4d}  "
                    f"jit call {row['jit_call_us']:8.1f} us  jit loop {row['jit_loop_us']:8.1f} us  "
                    f"python ref {row['reference_us']:8.1f} us  "
                    f"copies/step {copies:6.1f}",
                    flush=True,
                )

    print("\n| workload | groups | prefix caching | batch | append, jitted call (µs) | select call (µs) "
          "| step in fori_loop (µs) | Python reference step (µs) | ref / loop | loop over 1 group |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        over = f"{r['over_single_loop']:.2f}x" if "over_single_loop" in r else ""
        print(f"| {r['workload']} | {r['groups']} | {r['prefix_caching']} | {r['batch']} | {r['jit_call_us']:.1f} | "
              f"{r['select_call_us']:.1f} | {r['jit_loop_us']:.1f} | {r['reference_us']:.1f} | "
              f"{r['speedup_loop']:.1f}x | {over} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(jax=jax.__version__, backend=jax.default_backend(), machine=platform.machine(),
                cpus=jax.device_count(), steps=args.steps, repeats=args.repeats)
    run = record(__file__, args, argv, started=started)
    args.out.write_text(json.dumps(dict(run=run, meta=meta, rows=rows), indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
