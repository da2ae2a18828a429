"""Quantized KV pages (int8, float8_e4m3fn) against plain pages: accuracy, capacity and CPU
decode-step time, measured (issue 32). Reference kernels on the CPU.

    python scripts/bench_kv_quant.py            # accuracy + capacity (+ timing), results/bench_kv_quant.json
    python scripts/bench_kv_quant.py --quick    # a smoke run of every part, small sizes (not for the results)

Parts (each under its key in the JSON, with the ``run`` that measured it: ``--parts`` reruns some
and keeps the others from the file, which then says ``parts_from_separate_runs``):

* ``accuracy.tiny``: the built-in trained model (``checkpoints/tiny-llama``, float32) on held-out
  text (``scripts/train_tiny_llama.py``'s validation corpus: ``generate_corpus(VAL_SEED_OFFSET, 400)``
  packed into 128-token windows, never trained on), per page dtype: plain (``auto``: float32),
  int8, fp8, and bfloat16 as a control: 8 significant bits per element (int8 has 8 bits, sign
  included, on a per-token, per-KV-head scale), with no scale and no integer grid. If bfloat16
  pages agree about as badly as int8, the greedy metrics measure this model's near-ties, not a
  quantization defect.

  ``teacher_forced``: every window is prefilled through the paged cache (K/V written, quantized
  for int8/fp8, then attended over) in chunks of ``--chunk`` tokens; per token the log-prob of
  the true next token. ``max_abs_logprob_err`` / ``mean_abs_logprob_err``: max / mean
  ``|log-prob - log-prob on plain pages|``; ``perplexity``: exp of the mean negative log-prob.

  ``greedy``: ``generate`` 256 new tokens for 64 prompts (the first 16 tokens of held-out
  documents) on each dtype's pages. ``agreement``: the fraction of the 64 x 256 positions whose
  token equals plain pages' (free-running: one flip changes the rest of a row);
  ``mean_first_disagreement``: the mean position of a row's first differing token (256 when
  none); ``rows_all_equal``. ``stepwise_agreement``: plain pages' greedy rows teacher-forced
  through each dtype's pages (the same prefix at every step), the fraction of positions whose
  argmax is plain's token.

  ``greedy.<dtype>.divergence``: why rows diverge. At a row's first disagreement both runs have
  the same prefix, so teacher-forcing plain's row through plain and through the dtype's pages
  gives the log-probs each run saw there. ``rows``: diverging rows. ``reproduced``: the fraction
  of them whose teacher-forced passes pick the same two tokens at the same first position (a
  check of the method). ``beyond_short_context``: the fraction of them whose first disagreement
  has a context longer than the 128-token teacher-forced windows (the length the model was
  trained on). ``top2_both``: the fraction where each run's token is in the other's
  top 2 log-probs (the idea of vLLM's ``check_logprobs_close`` with k = 2: a divergence between
  near-equal candidates). ``plain_margin``: plain's top-1 minus top-2 log-prob there (median,
  max); ``plain_gap``: plain's log-prob of its token minus of the run's token there (median,
  max: the margin the perturbation overcame). ``margin_below_near_tie``: the fraction of
  divergences whose ``plain_margin`` is below ``near_tie_threshold`` = the dtype's teacher-forced
  ``max_abs_logprob_err``.
  ``plain_token_logprob_change`` / ``run_token_logprob_change``: ``|log-prob on the dtype's pages -
  on plain pages|`` of plain's / the run's token there (median, max: the perturbation that flipped
  it). Over all 64 x 256 plain greedy positions: ``near_tie_fraction``, the fraction whose margin
  is below ``near_tie_threshold`` (how common near-ties are in this model); ``stepwise_flips``,
  the positions where the stepwise argmax differs, ``stepwise_flips_at_near_ties``, the
  fraction of them below the threshold, and ``stepwise_flips_beyond_short_context``, how many of
  them have a context longer than 128 tokens; ``path_abs_logprob_err``: teacher_forced's
  ``|log-prob error|`` of plain's token on these generated rows (mean, max, and
  ``max_short_context`` over the positions whose context is no longer than the 128-token
  teacher-forced windows').
* ``accuracy.llama8b_layer``: one random Llama 3.1 8B-shaped layer (hidden 4096, 32 heads, 8 KV
  heads, head_dim 128, MLP 14336, vocabulary ``--vocab``, float32), random tokens; ``--context``
  tokens are prefilled in chunks and the log-probs of the last chunk's tokens (which attend over
  the longest contexts) are compared: max / mean |log-prob error|.
* ``capacity``: blocks a fixed KV budget holds per page dtype (Llama 3.1 8B bf16 and the tiny
  float32 model), and the serving engine on the command line's workload (``paged_kv.apps.cli.
  build_workload``) at a KV budget where plain pages preempt: preemptions, the most requests
  running at once, steps.
* ``timing`` (only with ``--timing``; the machine must be quiet): one decode step of the tiny
  model at batch 32 and 128 or 512 positions of context, plain vs int8 vs fp8 pages, alternating
  step by step in one process, 5 rounds
  of 40 steps each: the median step over all rounds, the ratio plain / quantized of those medians
  (goal >= 0.9) and each round's ratio.
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
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paged_kv as pk
from paged_kv.checkpoints import BUILTIN
from paged_kv.engine import SamplingParams, generate
from paged_kv.engine.call_setup import pad_prompts
from paged_kv.models import (
    allocate_pages,
    init_model,
    load_hf_checkpoint,
    make_paged_batch,
    page_spec,
    page_spec_for_budget,
    paged_decode_step,
    paged_forward,
)
from paged_kv.models.tokenizer import ByteTokenizer
from scripts.run_record import merge_parts, record, table, utc_now

KV_DTYPES = ("auto", "int8", "fp8")
# The tiny model's accuracy also runs bfloat16 pages on the float32 model: a control with int8's
# 8 significant bits and no quantization step (no scale, no integer grid).
TINY_KV_DTYPES = (*KV_DTYPES, "bfloat16")


# ---------------------------------------------------------------------------- teacher forcing
@functools.partial(jax.jit, static_argnames=("graphdef", "logits"), donate_argnames=("pages",))
def _chunk(graphdef: nnx.GraphDef, state: nnx.State, pages, batch, tokens: jax.Array, *, logits: bool):
    """One prefill chunk ``tokens`` int32 [B, T] through the paged cache (reference kernels):
    ``(float32 log-probs [B, T, V] or None, pages)``; without ``logits`` only the K/V are written."""
    out, pages = paged_forward(nnx.merge(graphdef, state), pages, batch, tokens, impl="reference",
                               last_only=not logits)
    if not logits:
        return None, pages
    return jax.nn.log_softmax(out.astype(jnp.float32), axis=-1), pages


def teacher_forced_logprobs(model: nnx.Module, windows: np.ndarray, kv_dtype: str, chunk: int, block_size: int = 16,
                            score_from: int = 0, full: bool = False) -> np.ndarray:
    """float32 [B, N - 1 - score_from] log-probs of ``windows[:, 1:]`` (int [B, N]) given the
    prefix, through pages of ``kv_dtype``, prefilled ``chunk`` tokens at a time; positions before
    ``score_from`` are prefilled without computing logits. ``full``: every token's log-prob
    instead, float32 [B, N - 1 - score_from, V] (the argmax is the greedy next token)."""
    b, n = windows.shape
    inputs = windows[:, :-1]
    length = inputs.shape[1]
    per_seq = -(-length // block_size)
    graphdef, state = nnx.split(model)
    pages = allocate_pages(page_spec(model, 1 + b * per_seq, block_size, kv_dtype=kv_dtype))
    tables = (1 + np.arange(b * per_seq, dtype=np.int32)).reshape(b, per_seq)
    out = []
    for start in range(0, length, chunk):
        t = min(chunk, length - start)
        batch = make_paged_batch(tables, [start] * b, [t] * b, t, block_size)
        want = start + t > score_from
        lp, pages = _chunk(graphdef, state, pages, batch, jnp.asarray(inputs[:, start:start + t]), logits=want)
        if want:
            tgt = windows[:, start + 1:start + t + 1]
            got = np.asarray(lp) if full else np.take_along_axis(np.asarray(lp), tgt[..., None], axis=-1)[..., 0]
            lo = max(score_from - start, 0)
            out.append(got[:, lo:])
    return np.concatenate(out, axis=1)


def logprob_errors(lps: dict[str, np.ndarray]) -> dict:
    """Per KV dtype: max / mean |log-prob - plain's| and perplexity."""
    ref = lps["auto"]
    res = {}
    for kd, lp in lps.items():
        err = np.abs(lp - ref)
        res[kd] = {"max_abs_logprob_err": float(err.max()), "mean_abs_logprob_err": float(err.mean()),
                   "perplexity": float(np.exp(-lp.mean())), "tokens": int(lp.size)}
    for kd in res:
        res[kd]["perplexity_rel_change_pct"] = 100 * (res[kd]["perplexity"] / res["auto"]["perplexity"] - 1)
    return res


# ---------------------------------------------------------------------------- the tiny model
def heldout(num_docs: int, seq_len: int = 128):
    from scripts.train_tiny_llama import VAL_SEED_OFFSET, generate_corpus, pack_documents
    docs = generate_corpus(VAL_SEED_OFFSET, num_docs)  # train_tiny_llama's seed 0 + VAL_SEED_OFFSET
    return docs, pack_documents(docs, ByteTokenizer(), seq_len)


def _median_max(x: np.ndarray) -> dict[str, float | None]:
    """``{"median", "max"}`` of a float array (None for both when it is empty)."""
    if x.size == 0:
        return {"median": None, "max": None}
    return {"median": float(np.median(x)), "max": float(x.max())}


def top2_margin(lp: np.ndarray) -> np.ndarray:
    """float32 [...] top-1 minus top-2 log-prob of float32 [..., V] log-probs (>= 0)."""
    two = np.partition(lp, -2, axis=-1)[..., -2:]
    return two[..., 1] - two[..., 0]


def _pick(lp: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """float32 [R] log-prob of ``tokens`` (int [R]) in float32 [R, V] log-probs."""
    return np.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]


def _in_top2(lp: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """bool [R]: ``tokens`` (int [R]) among the two largest of float32 [R, V] log-probs."""
    return (np.argpartition(lp, -2, axis=-1)[:, -2:] == tokens[:, None]).any(1)


def divergence_analysis(lp_plain: np.ndarray, lp_kd: np.ndarray, plain: np.ndarray, run: np.ndarray,
                        near_tie: float, short: int) -> dict:
    """Where free-running greedy rows on another page dtype leave plain pages' rows (module docstring).

    ``plain`` / ``run``: int [P, L] greedy tokens generated on plain / the other dtype's pages.
    ``lp_plain`` / ``lp_kd``: float32 [P, L, V] log-probs at each position of ``plain``'s rows,
    teacher-forced (prompt + ``plain``'s previous tokens) through plain / the other dtype's pages.
    Up to a row's first disagreement the two runs share their prefix, so the teacher-forced
    log-probs there are those each run saw. ``near_tie``: a log-prob margin (the dtype's
    teacher-forced max |log-prob error|). ``short``: how many leading positions have contexts no
    longer than the teacher-forced windows' (``max_short_context``, ``beyond_short_context``)."""
    rows = np.flatnonzero((plain != run).any(1))
    d = np.argmax(plain[rows] != run[rows], axis=1)  # the first disagreement of each diverging row
    p_at, q_at = lp_plain[rows, d], lp_kd[rows, d]  # [R, V]
    a, b = plain[rows, d], run[rows, d]  # plain's token, the other run's token
    # vLLM's check_logprobs_close idea with k = 2: each run's token is in the other's top 2.
    both = _in_top2(q_at, a) & _in_top2(p_at, b)
    # The teacher-forced passes reproduce a divergence when each pass's argmax is its run's token
    # and the row's first stepwise disagreement is at the same position (chunked prefill vs
    # one-token decode could round differently).
    flips = lp_kd.argmax(-1) != plain  # [P, L] stepwise disagreements
    reproduced = (p_at.argmax(-1) == a) & (q_at.argmax(-1) == b) & (np.argmax(flips[rows], axis=1) == d)
    margin_at = top2_margin(p_at)
    margin_all = top2_margin(lp_plain)  # [P, L]
    path_err = np.abs(_pick(lp_kd.reshape(-1, lp_kd.shape[-1]), plain.reshape(-1))
                      - _pick(lp_plain.reshape(-1, lp_plain.shape[-1]), plain.reshape(-1))).reshape(plain.shape)
    return {
        "rows": int(rows.size),
        "reproduced": float(reproduced.mean()) if rows.size else None,
        "beyond_short_context": float((d >= short).mean()) if rows.size else None,
        "top2_both": float(both.mean()) if rows.size else None,
        "plain_margin": _median_max(margin_at),
        # The margin the perturbation overcame: plain's log-prob of its token minus of the run's
        # (plain_margin when the run's token is plain's second).
        "plain_gap": _median_max(_pick(p_at, a) - _pick(p_at, b)),
        "margin_below_near_tie": float((margin_at < near_tie).mean()) if rows.size else None,
        "plain_token_logprob_change": _median_max(np.abs(_pick(q_at, a) - _pick(p_at, a))),
        "run_token_logprob_change": _median_max(np.abs(_pick(q_at, b) - _pick(p_at, b))),
        "near_tie_threshold": near_tie,
        "near_tie_fraction": float((margin_all < near_tie).mean()),
        "stepwise_flips": int(flips.sum()),
        "stepwise_flips_beyond_short_context": int(flips[:, short:].sum()),
        "stepwise_flips_at_near_ties": float((margin_all[flips] < near_tie).mean()) if flips.any() else None,
        # teacher_forced's error measure on the generated text (plain's greedy rows) instead of
        # the held-out windows; also over the positions whose context is as short as theirs.
        "path_abs_logprob_err": {"mean": float(path_err.mean()), "max": float(path_err.max()),
                                 "max_short_context": float(path_err[:, :short].max())},
    }


def tiny_accuracy(windows: int, chunk: int, prompts: int, new_tokens: int) -> dict:
    model = load_hf_checkpoint(BUILTIN)
    docs, packed = heldout(400)
    wins = packed[:windows]
    lps = {kd: teacher_forced_logprobs(model, wins, kd, chunk) for kd in TINY_KV_DTYPES}
    tf = logprob_errors(lps)
    res = {"teacher_forced": {"windows": len(wins), "window_tokens": int(wins.shape[1]), "chunk": chunk, **tf}}
    tok = ByteTokenizer()
    heads = [tok.encode(d, add_bos=True)[:16] for d in docs[:prompts]]
    toks, lens = pad_prompts(heads)
    assert (lens == toks.shape[1]).all(), "every held-out prompt has 16 tokens (no padding inside a row)"
    bs = 16
    per_seq = -(-(toks.shape[1] + new_tokens) // bs)
    mgr = pk.ManagerConfig(num_blocks=1 + prompts * per_seq, block_size=bs, max_seqs=prompts,
                           max_blocks_per_seq=per_seq, prefix_caching=False)
    outs = {}
    for kd in TINY_KV_DTYPES:
        pages = allocate_pages(page_spec(model, mgr.num_blocks, bs, kv_dtype=kd))
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)  # every row runs new_tokens
        out, _, _ = generate(model, pages, toks, lens, 0, params, manager=mgr, impl="reference")
        outs[kd] = np.asarray(out.tokens)[:, 0, :new_tokens]
    # Plain pages' greedy sequences teacher-forced through each dtype's pages: every token's
    # log-prob at each generated position, float32 [prompts, new_tokens, V]. Stepwise agreement
    # compares their argmax with plain's tokens (one near-tie no longer shifts the rest of a row).
    forced = np.concatenate([toks, outs["auto"]], axis=1)
    w = toks.shape[1]
    step = {kd: teacher_forced_logprobs(model, forced, kd, chunk, score_from=w - 1, full=True)
            for kd in TINY_KV_DTYPES}
    greedy = {}
    for kd in TINY_KV_DTYPES:
        same = outs[kd] == outs["auto"]
        first = np.where(same.all(1), new_tokens, np.argmin(same, axis=1))
        greedy[kd] = {"agreement": float(same.mean()), "mean_first_disagreement": float(first.mean()),
                      "rows_all_equal": int(same.all(1).sum()),
                      "stepwise_agreement": float((step[kd].argmax(-1) == outs["auto"]).mean())}
        if kd != "auto":
            greedy[kd]["divergence"] = divergence_analysis(step["auto"], step[kd], outs["auto"], outs[kd],
                                                           tf[kd]["max_abs_logprob_err"],
                                                           short=wins.shape[1] - w)
    res["greedy"] = {"prompts": prompts, "new_tokens": new_tokens, **greedy}
    return res


# ---------------------------------------------------------------------------- Llama 8B layer
def llama8b_config(vocab: int, context: int, dtype: str = "float32"):
    from paged_kv.models.config import tiny
    return tiny(num_layers=1, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                intermediate_size=14336, vocab_size=vocab, max_position_embeddings=max(context, 8192),
                rope_theta=500_000.0, dtype=dtype)


def llama8b_accuracy(context: int, vocab: int, chunk: int, scored: int) -> dict:
    cfg = llama8b_config(vocab, context)
    model = init_model(cfg, seed=0)
    toks = np.random.RandomState(0).randint(0, vocab, (1, context + 1)).astype(np.int32)
    lps = {kd: teacher_forced_logprobs(model, toks, kd, chunk, score_from=context - scored) for kd in KV_DTYPES}
    errs = logprob_errors(lps)
    for kd in errs:
        errs[kd].pop("perplexity_rel_change_pct")
        errs[kd].pop("perplexity")  # random weights: no meaningful perplexity
    return {"config": {"layers": 1, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128,
                       "intermediate": 14336, "vocab": vocab, "dtype": cfg.dtype, "weights": "random (seed 0)"},
            "context": context, "scored_tokens": scored, **errs}


# ---------------------------------------------------------------------------- capacity
def capacity_table() -> dict:
    cfg = llama8b_config(128256, 8192, "bfloat16")
    cfg = cfg.__class__(**{**cfg.__dict__, "num_layers": 32})
    out = {}
    for name, c, budget in (("llama3.1_8b_bf16", cfg, 16 * 2**30),
                            ("tiny_float32", load_hf_checkpoint(BUILTIN).config, 24 * 32768)):
        row = {}
        for kd in ("auto", "float32", "bfloat16", "int8", "fp8"):
            spec = page_spec_for_budget(c, budget_bytes=budget, kv_dtype=kd)
            row[spec.kv_dtype] = {"bytes_per_block": spec.bytes_per_block, "blocks": spec.num_blocks,
                                  "tokens": spec.usable_tokens}
        q = row["int8"]["blocks"]
        out[name] = {"budget_bytes": budget, "model_dtype": str(c.dtype), "by_kv_dtype": row,
                     "int8_vs_bfloat16": q / row["bfloat16"]["blocks"], "int8_vs_float32": q / row["float32"]["blocks"]}
    return out


def serving_capacity(num_blocks_plain: int, requests: int, max_new_tokens: int) -> dict:
    """The CLI's workload (``build_workload``) on a pool of ``num_blocks_plain`` float32 blocks'
    bytes, plain vs int8 / fp8 pages in the same bytes (as ``--kv-dtype`` sizes them)."""
    from paged_kv.apps.workload import build_workload
    from paged_kv.engine.serving import ServingConfig, ServingEngine
    from paged_kv.models import kv_bytes_per_block
    model = load_hf_checkpoint(BUILTIN)
    tok = ByteTokenizer()
    res = {"workload": {"requests": requests, "max_new_tokens": max_new_tokens, "arrival_gap": 2},
           "budget": f"{num_blocks_plain} float32 blocks of 16 tokens"}
    budget = num_blocks_plain * kv_bytes_per_block(model.config, 16)
    for kd in KV_DTYPES:
        pool = page_spec_for_budget(model.config, block_size=16, budget_bytes=budget, kv_dtype=kd)
        mgr = pk.ManagerConfig(num_blocks=pool.num_blocks, block_size=16, max_seqs=32, max_blocks_per_seq=16)
        eng = ServingEngine(model, ServingConfig(mgr, chunk_size=64, max_prefill_rows=8, top_candidates=8,
                                                 impl="reference", decode_steps=1, kv_dtype=kd))
        peak = [0]

        def on_step(e, peak=peak):
            peak[0] = max(peak[0], e.num_running)

        outs = list(eng.run(build_workload(tok, requests, max_new_tokens, 2, tok.eos_ids), on_step=on_step))
        res[kd] = {"blocks": pool.num_blocks, "bytes_per_block": pool.bytes_per_block,
                   "preemptions": eng.preemptions, "max_running_requests": peak[0], "steps": eng.step_count,
                   "finished": sum(o.error is None for o in outs)}
    return res


# ---------------------------------------------------------------------------- timing
def decode_timing(batch: int, context: int, repeats: int, rounds: int = 5) -> dict:
    """One decode step of the built-in model at ``batch`` x ``context`` on each page dtype, the
    dtypes alternating step by step in one process: ``rounds`` rounds of ``repeats`` steps each.
    Reports the median step over all rounds, the speed ratio plain / quantized from those medians,
    and each round's ratio (the spread a single shorter run would show)."""
    from scripts.bench_model import decode_inputs
    model = load_hf_checkpoint(BUILTIN)
    graphdef, state = nnx.split(model)
    tokens, _, meta, num_blocks = decode_inputs(model.config, batch, context, 16)
    kinds = KV_DTYPES
    pages = {kd: allocate_pages(page_spec(model, num_blocks, 16, kv_dtype=kd)) for kd in kinds}

    def step(kd):
        logits, pages[kd] = paged_decode_step(graphdef, state, pages[kd], meta, tokens, impl="reference")
        logits.block_until_ready()

    for kd in kinds:
        for _ in range(3):
            step(kd)
    times = {kd: [[] for _ in range(rounds)] for kd in kinds}
    for r in range(rounds):
        for _ in range(repeats):
            for kd in kinds:
                t0 = time.perf_counter()
                step(kd)
                times[kd][r].append(time.perf_counter() - t0)
    med = {kd: statistics.median(t for rt in v for t in rt) for kd, v in times.items()}
    per_round = {kd: [statistics.median(times["auto"][r]) / statistics.median(times[kd][r]) for r in range(rounds)]
                 for kd in ("int8", "fp8")}
    return {"batch": batch, "context": context, "repeats": repeats, "rounds": rounds,
            **{f"{kd}_step_ms": med[kd] * 1e3 for kd in kinds},
            **{f"speed_ratio_{kd}": med["auto"] / med[kd] for kd in ("int8", "fp8")},
            **{f"speed_ratio_{kd}_per_round": [round(x, 3) for x in v] for kd, v in per_round.items()},
            }


PARTS = [("accuracy", "tiny"), ("accuracy", "llama8b_layer"), ("capacity",), ("timing",)]


def summary(res: dict) -> str:
    """The closing table: per page dtype, the headline figure of each part in ``res``."""
    tiny, layer = res["accuracy"].get("tiny"), res["accuracy"].get("llama8b_layer")
    serving, timing = res.get("capacity", {}).get("serving"), res.get("timing", {})
    rows = []
    for kd in TINY_KV_DTYPES:
        row = [kd]
        row.append(tiny["teacher_forced"][kd]["max_abs_logprob_err"] if tiny else "-")
        row.append(tiny["greedy"][kd]["agreement"] if tiny and kd in tiny["greedy"] else "-")
        row.append(layer[kd]["max_abs_logprob_err"] if layer and kd in layer else "-")
        row.append(serving[kd]["preemptions"] if serving and kd in serving else "-")
        row.append(", ".join(f"{t[f'speed_ratio_{kd}']:.2f}" for t in timing.values() if isinstance(t, dict)
                             and f"speed_ratio_{kd}" in t) or "-")
        rows.append(row)
    return table(["kv dtype", "tiny max|dlogp|", "greedy agreement", "8B layer max|dlogp|", "preemptions",
                  "speed vs plain"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every part")
    ap.add_argument("--timing", action="store_true", help="also time the decode step (a quiet machine only)")
    ap.add_argument("--parts", nargs="+", default=["tiny", "llama8b", "capacity"],
                    choices=["tiny", "llama8b", "capacity"])
    ap.add_argument("--context", type=int, default=4096, help="the 8B-shaped layer's context")
    ap.add_argument("--vocab", type=int, default=128256, help="the 8B-shaped layer's vocabulary")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    started = utc_now()
    q = args.quick
    res = {"backend": jax.default_backend(), "jax": jax.__version__,
           "machine": platform.processor() or platform.machine(), "quick": q, "accuracy": {}}
    out = Path(args.out or ("/tmp/bench_kv_quant_quick.json" if q else "results/bench_kv_quant.json"))
    ran = []
    if "tiny" in args.parts:
        print("accuracy of the built-in model ...", flush=True)
        res["accuracy"]["tiny"] = tiny_accuracy(4 if q else 64, 32, 4 if q else 64, 16 if q else 256)
        ran.append(("accuracy", "tiny"))
    if "llama8b" in args.parts:
        print("accuracy of an 8B-shaped layer ...", flush=True)
        ctx, vocab = (256, 4096) if q else (args.context, args.vocab)
        res["accuracy"]["llama8b_layer"] = llama8b_accuracy(ctx, vocab, min(512, ctx), min(256, ctx))
        ran.append(("accuracy", "llama8b_layer"))
    if "capacity" in args.parts:
        print("capacity ...", flush=True)
        res["capacity"] = {"blocks_for_budget": capacity_table(),
                           "serving": serving_capacity(24, 6 if q else 24, 12 if q else 48)}
        ran.append(("capacity",))
    if args.timing or q:
        print("decode-step timing ...", flush=True)
        res["timing"] = {f"context_{c}": decode_timing(32 if not q else 8, c, 5 if q else 40, 2 if q else 5)
                         for c in ((128,) if q else (128, 512))}
        ran.append(("timing",))
    out.parent.mkdir(parents=True, exist_ok=True)
    # Parts run separately add up in one file (read at write time); each part keeps its own record.
    old = json.loads(out.read_text()) if out.exists() and not q else None
    res = merge_parts(old, res, ran, PARTS, record(__file__, args, argv, started=started))
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(summary(res))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
