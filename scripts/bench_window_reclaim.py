"""What sliding-window reclaim saves: KV held per request, concurrent requests per pool, prefix hits.

Runs ``paged_kv.engine.ServingEngine`` on windowed models twice per setting: with the model's
KV-cache groups (``paged_kv.models.kv_group_layout``: blocks that left a window go back to the free
queue as the request grows) and without (one full-attention group: the window only masks
attention, and every block stays until the request ends). Both runs give the pool the same bytes.

Models (random weights, tiny widths: block counts do not depend on the weights or the widths, and
every figure is a ratio of KV bytes, which scale alike in both runs):

* ``gemma3``: 6 layers, 5 local (window 1,024) : 1 global, as Gemma 3. Layout: six groups of one
  layer (five window groups, one full).
* ``gemma2``: 4 layers, alternating local (window 4,096) and global, as Gemma 2. Two groups of two
  layers.
* ``mistral``: 4 layers, every layer a window of 4,096, as Mistral 7B v0.1. One window group of four
  layers.

Measurements (block size 16, greedy, no EOS: every request runs to its context):

1. **KV held over time by one request** of ``context`` tokens (8,192 and 32,768): a 1,024-token
   prompt, then decoding to ``context``. KV is counted in layer-blocks (blocks x layers per block:
   ``layout.slots`` with groups, ``num_layers`` without), token by token, from the block manager
   driven by the operations the engine runs for that request (``replay``: ``admit``, then one
   ``append`` per token). At 8,192 tokens the serving engine runs the request too, and its peak
   and final KV must equal the replay's (the script stops otherwise); at 32,768 the engine on the
   CPU's reference kernels would take about an hour per run (their attention reads the whole block
   table every step), so the replay alone gives those rows. Reported: the peak KV with reclaim as a
   fraction of without, the time-averaged fraction, and the memory a cache without reclaim
   wastes at full context, ``1 - final_with / final_without``: the definition of vLLM's RFC
   (vllm#11382), which gives 25 % for Gemma 2 and 56 % for Ministral. Two more rows (``--parts
   long_prompt``, full-size runs only): a Gemma 3 request of 32,768 tokens whose prompt is 31,744
   of them, replayed twice. Admitted whole, as the serving engine admits today: the peak is the
   prompt's, and the window groups give their blocks back at the first decode step. Admitted in
   chunks of 512 (``admit(..., chunk=512)``, then ``extend(..., commit=True)`` per chunk, as vLLM
   allocates per prefill chunk): the window groups give blocks back as each chunk arrives. The
   engine does not run that form yet, so the chunked row is the block manager's alone.
2. **Concurrent requests one pool serves**: 12 Gemma 3-shaped requests of 4,096 tokens arrive at
   once; the pool holds 4 of them without reclaim (the same bytes either way). They run to the
   end. Reported: requests running on average and at most, preemptions, and the steps until all
   12 finished.
3. **Prefix-cache hit rate**: 6 requests share a 4,096-token document and differ in a 64-token
   question, arriving one after another (each after the previous finished); hit tokens / prompt
   tokens with and without reclaim. Reclaimed blocks that hold a hash stay at the back of the
   free queue, so they still hit while the pool has room.

Measurements 2 and 3 run the reclaiming engine under both prefix-cache retention settings
(``ManagerConfig.prefix_cache_retention_interval``): ``0``, sparse, the default (as vLLM's engine),
where a window group hashes only the blocks before each prompt's boundary and before a shared-prefix
junction (``"with"``), and ``None``, dense, every full block (``"with_dense_retention"``). Without
reclaim there is no window group, so retention changes nothing there.

Usage::

    pip install -e '.[bench]'
    python scripts/bench_window_reclaim.py            # full run (writes results/bench_window_reclaim.{json,png})
    python scripts/bench_window_reclaim.py --quick    # small contexts, written under /tmp
    python scripts/bench_window_reclaim.py --smoke    # every path in seconds (windows scaled down): the suite's run
    python scripts/bench_window_reclaim.py --parts capacity,prefix --out results/bench_window_retention.json
    python scripts/bench_window_reclaim.py --parts long_prompt --out /tmp/long.json   # the 31,744-token prompt rows
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.extras import require
from scripts.run_record import record

require("bench", "tqdm", "matplotlib")

import jax
import jax.numpy as jnp
from tqdm import tqdm

import paged_kv as pk
from paged_kv.engine import Request, SamplingParams, ServingConfig, ServingEngine, kv_cache_groups
from paged_kv.models import LlamaConfig, init_model, kv_group_layout

BLOCK = 16
PROMPT = 1024
CHUNK = 512  # the engine's prefill chunk (``ServingConfig.chunk_size``), and chunked admission's
VOCAB = 256

# name -> (model_type, per-layer windows)
SHAPES = {
    "gemma3": ("gemma3_text", (1024,) * 5 + (0,)),
    "gemma2": ("gemma2", (4096, 0) * 2),
    "mistral": ("mistral", (4096,) * 4),
}
# The RFC's figure for the memory wasted without reclaim (vllm#11382), where one exists.
VLLM_RFC_WASTE = {"gemma2": 0.25, "mistral (Ministral in the RFC)": 0.56}


def model_for(shape: str, context: int):
    model_type, windows = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=len(windows),
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=max(context, 2048),
                      model_type=model_type, layer_windows=windows)
    return init_model(cfg, seed=0)


@dataclasses.dataclass
class Run:
    """One engine run's KV timeline in layer-blocks (blocks x layers per block)."""

    steps: list[int]
    kv: list[int]
    running: list[int]
    stats: dict
    wall_s: float


PARTS = ("per_request", "long_prompt", "capacity", "prefix")
"""``--parts``: measurement 1 (its 31,744-token prompt row apart: ``long_prompt``, full-size runs
only), 2 and 3."""

RUNS = (("with", True, 0), ("with_dense_retention", True, None), ("without", False, 0))
"""Measurements 2 and 3: (result key, reclaim, prefix_cache_retention_interval)."""


def engine_for(model, *, reclaim: bool, layer_blocks: int, max_seqs: int, max_tokens: int,
               retention: int | None = 0) -> tuple[ServingEngine, int]:
    """An engine whose pool holds `layer_blocks` layer-blocks (the same bytes either way); returns it
    and the layers per block."""
    layout = kv_group_layout(model)
    groups = kv_cache_groups(layout) if reclaim else (pk.Group("full"),)
    per_block = layout.slots if reclaim else layout.num_layers
    manager = pk.ManagerConfig(num_blocks=layer_blocks // per_block + 1, block_size=BLOCK, max_seqs=max_seqs,
                               max_blocks_per_seq=-(-max_tokens // BLOCK), groups=groups, prefix_caching=True,
                               prefix_cache_retention_interval=retention)
    config = ServingConfig(manager=manager, chunk_size=CHUNK, max_prefill_rows=min(max_seqs, 4), decode_steps=64,
                           record_tables=False)
    return ServingEngine(model, config), per_block


def run(engine: ServingEngine, per_block: int, requests: list[Request], *, max_steps: int | None = None,
        label: str = "") -> Run:
    """`engine.run(requests)` (arrival steps set) until every request finished or `max_steps` steps
    ran; records KV (layer-blocks) and running requests after every device call."""
    steps, kv, running = [], [], []
    t0 = time.perf_counter()
    total = max_steps or max(r.arrival for r in requests) + sum(r.params.max_new_tokens for r in requests)
    with tqdm(total=total, desc=label, unit="step", leave=False, mininterval=2.0) as bar:
        def on_step(eng: ServingEngine) -> None:
            bar.update(eng.step_count - bar.n)
            steps.append(eng.step_count)
            kv.append(eng.scheduler.blocks_in_use * per_block)
            running.append(eng.num_running)

        try:
            for _ in engine.run(requests, max_steps=max_steps, on_step=on_step):
                pass
        except RuntimeError:  # max_steps reached with requests left: expected for the capacity runs
            if max_steps is None:
                raise
    st = engine.stats()
    stats = {k: getattr(st, k) for k in ("steps", "generated_tokens", "preemptions", "cache_query_tokens",
                                         "cache_hit_tokens", "peak_blocks_used")}
    return Run(steps, kv, running, stats, time.perf_counter() - t0)


def replay(groups: tuple, per_block: int, context: int, prompt: np.ndarray, chunk: int | None = None) -> np.ndarray:
    """The block manager alone, driven by the operations the engine runs for one request of
    `context` tokens: `admit` of the prompt, then one `append` per generated token fed back (the
    last sampled token is never fed). With `chunk` (chunked admission, what vLLM's scheduler does
    and the engine's prefill pieces are to do; the engine does not yet): `admit(..., chunk=)` takes
    blocks for the first `chunk` tokens, then `extend(..., commit=True)` per further chunk of the
    prompt. Returns KV held (layer-blocks) after the admission, after each further chunk and after
    each append, int64 `[chunks + context - len(prompt) - 1]`. One jitted `lax.scan` per phase:
    seconds where the engine on the CPU's reference kernels takes an hour at 32k (its attention
    reads the whole table)."""
    m = -(-context // BLOCK)
    # Chunked admission is not implemented for one full group with prefix caching: there, the
    # replay runs without it (a lone request on an empty pool hits nothing: the same blocks).
    caching = chunk is None or pk.ManagerConfig(num_blocks=2, block_size=BLOCK, groups=groups).grouped
    config = pk.ManagerConfig(num_blocks=len(groups) * m + 2, block_size=BLOCK, max_seqs=1, max_blocks_per_seq=m,
                              groups=groups, prefix_caching=caching)
    n = context - len(prompt) - 1
    p = len(prompt)
    first = p if chunk is None else min(chunk, p)
    rest = 0 if chunk is None else -(-(p - first) // chunk)  # further chunks
    k = chunk or 1
    padded = jnp.asarray(np.concatenate([prompt, np.zeros(rest * k + k, prompt.dtype)]), jnp.int32)

    @jax.jit
    def go():
        state = pk.init_state(config)
        ids = jnp.zeros((1,), jnp.int32)
        state, admitted = pk.admit(config, state, ids, jnp.asarray([p], jnp.int32), padded[None, :p],
                                   chunk=None if chunk is None else jnp.asarray([first], jnp.int32))

        def piece(state, i):
            lo = first + i * k
            toks = jax.lax.dynamic_slice(padded, (lo,), (k,))
            state, res = pk.extend(config, state, ids, jnp.minimum(k, p - lo)[None], toks[None], commit=True)
            return state, (pk.usage(config, state).used, res.status[0])

        def step(state, tok):
            state, res = pk.append(config, state, ids, tok[None])
            return state, (pk.usage(config, state).used, res.status[0])

        used0 = pk.usage(config, state).used
        state, (chunk_used, chunk_status) = jax.lax.scan(piece, state, jnp.arange(rest, dtype=jnp.int32))
        state, (used, status) = jax.lax.scan(step, state, jnp.ones((n,), jnp.int32))
        return used0, admitted.status[0], chunk_used, chunk_status, used, status

    used0, admitted, chunk_used, chunk_status, used, status = jax.device_get(go())
    assert int(admitted) == 0 and (np.asarray(status) == 0).all() and (np.asarray(chunk_status) == 0).all(), \
        "the pool holds the request"
    return np.concatenate([[used0], np.asarray(chunk_used), np.asarray(used)]).astype(np.int64) * per_block


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0)


def one_request(shape: str, context: int, rng: np.random.Generator, *, engine_check: bool,
                prompt_len: int | None = None, chunk: int | None = None) -> dict:
    """Measurement 1: one request of `context` tokens, with and without reclaim, token by token
    (`replay`; `chunk`: chunked admission). With `engine_check`, the serving engine also runs it
    with reclaim, and its KV peak and its KV at the last step must equal the replay's."""
    model = model_for(shape, context)
    layout = kv_group_layout(model)
    prompt_len = PROMPT if prompt_len is None else prompt_len
    prompt = rng.integers(1, VOCAB, prompt_len)
    with_ = replay(kv_cache_groups(layout), layout.slots, context, prompt, chunk)
    without = replay((pk.Group("full"),), layout.num_layers, context, prompt, chunk)
    first = prompt_len if chunk is None else min(chunk, prompt_len)
    rest = 0 if chunk is None else -(-(prompt_len - first) // chunk)
    held = [first] + [min(first + (i + 1) * chunk, prompt_len) for i in range(rest)]  # tokens after each chunk
    row = {
        "shape": shape, "context": context, "prompt": prompt_len, "layers": layout.num_layers,
        "admission": "whole prompt" if chunk is None else f"chunks of {chunk}",
        "layers_per_block": layout.slots, "source": "block-manager replay",
        "peak_layer_blocks": {"with": int(with_.max()), "without": int(without.max())},
        "final_layer_blocks": {"with": int(with_[-1]), "without": int(without[-1])},
        "peak_fraction": float(with_.max() / without.max()),
        "time_avg_fraction": float(with_.sum() / without.sum()),
        "waste_without_reclaim": float(1 - with_[-1] / without[-1]),
        "timeline": {"tokens": _thin(held + list(range(prompt_len + 1, context))), "with": _thin(with_.tolist()),
                     "without": _thin(without.tolist())},
    }
    if engine_check:
        pool = layout.num_layers * (-(-context // BLOCK) + 1)
        engine, per_block = engine_for(model, reclaim=True, layer_blocks=pool, max_seqs=1, max_tokens=context)
        r = run(engine, per_block, [Request(prompt, greedy(context - prompt_len))], label=f"engine {shape} {context}")
        assert (max(r.kv), r.kv[-1]) == (int(with_.max()), int(with_[-1])), (max(r.kv), r.kv[-1])
        row["engine"] = {"peak_layer_blocks": int(max(r.kv)), "final_layer_blocks": int(r.kv[-1]),
                         "steps": r.stats["steps"], "wall_s": round(r.wall_s, 1)}
        row["source"] = "block-manager replay, equal to the serving engine's run"
    return row


def _thin(xs: list, n: int = 400) -> list:
    """At most `n` evenly spaced points of a timeline (the last kept)."""
    if len(xs) <= n:
        return list(xs)
    idx = np.unique(np.linspace(0, len(xs) - 1, n).round().astype(int))
    return [xs[i] for i in idx]


def capacity(shape: str, context: int, num_requests: int, fits: int, rng: np.random.Generator) -> dict:
    """Measurement 2: `num_requests` requests of `context` tokens arrive at once; the pool holds
    `fits` of them without reclaim. Runs until all finish."""
    model = model_for(shape, context)
    layers = len(SHAPES[shape][1])
    pool = fits * layers * -(-context // BLOCK)
    reqs = [Request(rng.integers(1, VOCAB, PROMPT), greedy(context - PROMPT), request_id=i)
            for i in range(num_requests)]
    out = {"shape": shape, "context": context, "requests": num_requests, "pool_fits_without_reclaim": fits,
           "pool_layer_blocks": pool}
    for key, reclaim, retention in RUNS:
        engine, per_block = engine_for(model, reclaim=reclaim, layer_blocks=pool, max_seqs=num_requests,
                                       max_tokens=context, retention=retention)
        r = run(engine, per_block, reqs, label=f"capacity {shape} {key}")
        spans = np.diff([0, *r.steps])
        out[key] = {
            "max_running": int(max(r.running)),
            "mean_running": float(np.dot(spans, r.running) / spans.sum()),
            "steps_to_finish_all": int(r.steps[-1]), "preemptions": r.stats["preemptions"],
            "generated_tokens": r.stats["generated_tokens"], "peak_layer_blocks": int(max(r.kv)),
            "wall_s": round(r.wall_s, 1)}
    return out


def prefix_hits(shape: str, doc: int, num_requests: int, rng: np.random.Generator, *, max_seqs: int = 2,
                pool_contexts: int = 3) -> dict:
    """Measurement 3: requests sharing a `doc`-token document, one after another, on an engine of
    `max_seqs` rows whose pool holds `pool_contexts` requests without reclaim."""
    context = doc + 64 + 64
    model = model_for(shape, context)
    layers = len(SHAPES[shape][1])
    document = rng.integers(1, VOCAB, doc)
    reqs = []
    for i in range(num_requests):
        prompt = np.concatenate([document, rng.integers(1, VOCAB, 64)])
        reqs.append(Request(prompt, greedy(64), request_id=i, arrival=i * 200))
    pool = pool_contexts * layers * -(-context // BLOCK)
    out = {"shape": shape, "document": doc, "question": 64, "requests": num_requests, "max_seqs": max_seqs,
           "pool_layer_blocks": pool}
    for key, reclaim, retention in RUNS:
        engine, per_block = engine_for(model, reclaim=reclaim, layer_blocks=pool, max_seqs=max_seqs,
                                       max_tokens=context, retention=retention)
        r = run(engine, per_block, reqs, label=f"prefix {shape} {key}")
        q, h = r.stats["cache_query_tokens"], r.stats["cache_hit_tokens"]
        out[key] = {"hit_tokens": h, "query_tokens": q, "hit_rate": h / q if q else 0.0,
                    "preemptions": r.stats["preemptions"]}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["per_request"]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.6 * len(rows), 3.2), squeeze=False)
    for ax, row in zip(axes[0], rows):
        t = row["timeline"]
        ax.plot(t["tokens"], t["without"], label="without reclaim", color="tab:gray")
        ax.plot(t["tokens"], t["with"], label="with reclaim", color="tab:blue")
        ax.set_title(f"{row['shape']}, {row['context'] // 1024}k: peak {row['peak_fraction']:.0%}", fontsize=9)
        ax.set_xlabel("tokens in the request")
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("KV held (layer-blocks of 16 tokens)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("KV held by one request: sliding-window blocks reclaimed as the window moves", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_tables(result: dict) -> None:
    print("\nKV held by one request (with reclaim / without):")
    print(f"{'shape':8} {'context':>8} {'prompt':>7} {'peak':>6} {'mean':>6} {'waste w/o':>9}  admission")
    for r in result["per_request"] + result["long_prompt"]:
        print(f"{r['shape']:8} {r['context']:>8} {r['prompt']:>7} {r['peak_fraction']:>6.1%} "
              f"{r['time_avg_fraction']:>6.1%} {r['waste_without_reclaim']:>9.1%}  {r['admission']}")
    labels = {"with": "reclaim, sparse retention", "with_dense_retention": "reclaim, dense retention",
              "without": "no reclaim"}
    for c in result["capacity"]:
        print(f"\n{c['requests']} {c['shape']} requests of {c['context']} tokens, a pool for "
              f"{c['pool_fits_without_reclaim']} without reclaim:")
        for k, _, _ in RUNS:
            x = c[k]
            print(f"  {labels[k]:26}: {x['mean_running']:.1f} running on average (max {x['max_running']}), "
                  f"{x['preemptions']} preemptions, all done in {x['steps_to_finish_all']} steps")
    for p in result["prefix"]:
        rates = [f"{labels[k]} {p[k]['hit_rate']:.1%} ({p[k]['preemptions']} preemptions)" for k, _, _ in RUNS]
        print(f"prefix hits {p['shape']}: " + ", ".join(rates))


def _commit() -> str:
    """The checkout's commit, ``+dirty`` when it has uncommitted changes."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain") else "")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small contexts; writes under a temporary folder")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest run that takes every path (Gemma 3's windows scaled to 64 tokens, two layers: "
                         "one window, one full; contexts of a few hundred tokens): for the test suite; writes "
                         "under a temporary folder")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default results/bench_window_reclaim.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"','-separated measurements to run, of {', '.join(PARTS)} (default all)")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        ap.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; choose from {PARTS}")
    # One generator per measurement, so that running only some (--parts) draws the same requests.
    rng, cap_rng, pre_rng = (np.random.default_rng([args.seed, k]) for k in range(3))
    global PROMPT, SHAPES
    if args.smoke:
        PROMPT = 32
        # Two layers (one window group, one full: every grouped path) and one engine configuration
        # shared by the capacity and prefix runs (same context, rows and pool), so the smoke compiles
        # four engines, not seven: the suite's time is compile time.
        SHAPES = {**SHAPES, "gemma3": ("gemma3_text", (64, 0))}
        settings = [("gemma3", 256, True)]
        cap = ("gemma3", 224, 3, 1)
        pre = dict(shape="gemma3", doc=96, num_requests=2, max_seqs=3, pool_contexts=1)
    elif args.quick:
        PROMPT = 64
        settings = [("gemma3", 2048, True)]
        cap = ("gemma3", 1024, 4, 1)
        pre = dict(shape="gemma3", doc=1024, num_requests=3)
    else:
        settings = [("gemma3", 8192, True), ("gemma3", 32768, False), ("gemma2", 8192, False),
                    ("mistral", 8192, True), ("mistral", 32768, False)]
        cap = ("gemma3", 4096, 12, 4)
        pre = dict(shape="gemma3", doc=4096, num_requests=6)
    out = args.out or (Path(tempfile.gettempdir()) / "bench_window_reclaim.json" if args.quick or args.smoke
                       else REPO / "results" / "bench_window_reclaim.json")
    t0 = time.perf_counter()
    commit = _commit()  # before the run: the checkout it ran on
    per_request = ([one_request(shape, ctx, rng, engine_check=check) for shape, ctx, check in settings]
                   if "per_request" in parts else [])
    # A long prompt, admitted whole (what the serving engine runs: the peak is the prompt's,
    # reclaimed at the first decode step) and in chunks of CHUNK (chunked admission, manager level:
    # the window groups give blocks back as each chunk arrives; the engine does not run it yet).
    full_size = not (args.quick or args.smoke)
    long_prompt = []
    if full_size and "long_prompt" in parts:
        for chunk in (None, CHUNK):
            long_prompt.append(one_request("gemma3", 32768, np.random.default_rng([args.seed, 3]),
                                           engine_check=False, prompt_len=32768 - 1024, chunk=chunk))
    result = {
        "run": record(__file__, args, argv),
        "meta": {
            "command": "python " + shlex.join(["scripts/bench_window_reclaim.py", *(argv or sys.argv[1:])]),
            "date": datetime.date.today().isoformat(), "commit": commit, "jax": jax.__version__,
            "python": platform.python_version(),
            "retention_runs": {k: {"reclaim": reclaim, "prefix_cache_retention_interval": retention}
                               for k, reclaim, retention in RUNS},
            "cpu_count": os.cpu_count(), "block_size": BLOCK, "prompt": PROMPT,
            "shapes": {k: {"model_type": v[0], "layer_windows": list(v[1])} for k, v in SHAPES.items()},
            "vllm_rfc_waste": VLLM_RFC_WASTE,
            "units": "layer-blocks: blocks x layers per block (16 tokens of one layer's K and V each)",
        },
        "per_request": per_request,
        "long_prompt": long_prompt,
        "capacity": [capacity(*cap, cap_rng)] if "capacity" in parts else [],
        "prefix": [prefix_hits(**pre, rng=pre_rng)] if "prefix" in parts else [],
    }
    result["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if per_request:
        plot(result, out.with_suffix(".png"))
    print_tables(result)
    print(f"\nwrote {out}" + (f" and {out.with_suffix('.png')}" if per_request else ""))
    return result


if __name__ == "__main__":
    main()
