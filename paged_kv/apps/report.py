"""The main job's report: numbers from a serving run, and pictures of one request family's block
tables (terminal and PNG).

``build_report`` turns a ``ServingEngine`` run into a JSON-able dict; ``format_report`` prints it;
``render_block_tables`` draws a ``TableSnapshot`` for the terminal (rows: the family's sequences;
cells: physical block ids, marked and coloured by reference count); ``save_block_tables_png``
draws the same with matplotlib; ``save_report_json`` writes the report (the CLI puts both files in
its output folder, ``paged-kv-out/`` by default).

KV memory saved by sharing (parallel sampling and beam search): at every step, for each running
request with ``n > 1`` samples or beam width ``k > 1``, *blocks without sharing* is the sum over
its sequences of ``ceil(tokens / block_size)`` (each sequence holding its own copy) and *blocks
with sharing* is the number of distinct physical blocks its block tables hold; summed over
steps (block-steps), saved = 1 - with / without.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

from paged_kv.apps.provenance import write_atomic
from paged_kv.engine.serving import EngineStats, RequestOutput, ServingEngine, TableSnapshot

SHARING_DEFINITION = (
    "KV memory saved by sharing: each step, for every running request with n > 1 samples or beam width > 1, "
    "blocks without sharing = sum over its sequences of ceil(tokens / block_size); blocks with sharing = distinct "
    "physical blocks in its block tables; saved = 1 - (with / without), over block-steps of the whole run.")

# ANSI background colours by reference count (1, 2, 3, >= 4).
_ANSI = {1: "\x1b[48;5;252m\x1b[30m", 2: "\x1b[48;5;229m\x1b[30m", 3: "\x1b[48;5;215m\x1b[30m",
         4: "\x1b[48;5;203m\x1b[30m"}
_RESET = "\x1b[0m"


def _saved(shared: int, unshared: int) -> float | None:
    """1 - shared / unshared, rounded; None when nothing ran with n > 1 or beams (no such figure)."""
    return round(1.0 - shared / unshared, 4) if unshared else None


DASH = "–"  # printed for a figure that does not exist (None in the JSON)


def _fmt(value, spec: str = "", scale: float = 1.0, unit: str = "") -> str:
    """``value * scale`` formatted with ``spec``, then ``unit``; ``DASH`` when the figure does not exist."""
    return DASH if value is None else format(value * scale if scale != 1.0 else value, spec) + unit


def _kib(nbytes: float | None) -> str:
    if nbytes is None:
        return DASH
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes / 1024:.1f} KiB"


def answer_entries(o: RequestOutput) -> list[dict]:
    """The answers of one output: token ids, log-probabilities (samples; None for beams) or score
    (beams), and finish reason each (``build_report``)."""
    out = []
    for j, toks in enumerate(o.tokens):
        entry = {"tokens": [int(t) for t in toks],
                 "logprobs": [float(x) for x in o.logprobs[j]] if o.logprobs is not None else None,
                 "finish_reason": o.finish_reasons[j]}
        if o.scores is not None:
            entry["score"] = float(o.scores[j])
        out.append(entry)
    return out


def build_report(engine: ServingEngine, outputs: Sequence[RequestOutput], *, extra: dict | None = None) -> dict:
    """A JSON-able summary of a finished run: configuration, engine statistics, sharing, prefix
    cache, preemptions, per-request statistics and answers (``per_request``, in the order of
    ``outputs``), and the block-table snapshot.

    Each ``per_request`` entry records its answers (``answers``: per sample, or per beam
    hypothesis best first, the generated ``tokens`` (ids), their ``logprobs`` (float32 values
    as JSON numbers, exact; None for beam hypotheses, which have a ``score`` instead) and its
    ``finish_reason``) and the sampling ``seed`` it used, so any answer can be checked or replayed
    from the file alone."""
    st: EngineStats = engine.stats()
    mgr = engine.manager
    bpb = engine.bytes_per_block
    ok = [o for o in outputs if o.ok]
    per_req = []
    for o in outputs:
        s = o.stats
        per_req.append({
            "id": str(o.request_id), "kind": "beam" if o.request.is_beam else "sample",
            "width": o.request.width, "prompt_tokens": s.prompt_tokens,
            "cached_prompt_tokens": s.cached_prompt_tokens, "shared_prompt_tokens": s.shared_prompt_tokens,
            "preemptions": s.preemptions, "generated_tokens": s.generated_tokens,
            "arrival_step": s.arrival_step, "first_token_step": s.first_token_step, "finish_step": s.finish_step,
            "time_to_first_token_s": s.time_to_first_token_s, "latency_s": s.latency_s, "error": o.error,
            "seed": o.seed, "answers": answer_entries(o)})
    ttft = sorted(o.stats.time_to_first_token_s for o in ok if o.stats.time_to_first_token_s is not None)
    timed_s = st.wall_s - st.compile_s
    report = {
        "config": {"num_blocks": mgr.num_blocks, "block_size": mgr.block_size, "max_seqs": mgr.max_seqs,
                   "max_blocks_per_seq": mgr.max_blocks_per_seq, "prefix_caching": mgr.prefix_caching,
                   "chunk_size": engine.config.chunk_size, "max_prefill_rows": engine.config.max_prefill_rows,
                   "decode_steps": engine.config.decode_steps, "kv_bytes_per_block": bpb},
        "requests": {"total": len(outputs), "finished": len(ok), "rejected": len(outputs) - len(ok),
                     "sampling_n_gt_1": sum(1 for o in outputs if not o.request.is_beam and o.request.width > 1),
                     "beam": sum(1 for o in outputs if o.request.is_beam)},
        "throughput": {"generated_tokens": st.generated_tokens, "prefill_tokens": st.prefill_tokens,
                       "steps": st.steps, "prefill_steps": st.prefill_steps, "wall_s": round(st.wall_s, 3),
                       "compile_s": round(st.compile_s, 3),
                       # wall time less compiling: what tokens_per_s divides by
                       "serving_s": round(timed_s, 3),
                       # None (no such figure) when no step ran apart from compiling
                       "tokens_per_s": round(st.tokens_per_s, 1) if st.steps and timed_s > 0 else None,
                       "time_to_first_token_median_s": round(ttft[len(ttft) // 2], 4) if ttft else None},
        "blocks": {"peak_used": st.peak_blocks_used, "allocatable": mgr.num_blocks - 1,
                   "peak_used_bytes": st.peak_blocks_used * bpb, "copy_on_write_copies": st.copies},
        "sharing": {
            "definition": SHARING_DEFINITION,
            "parallel_sampling": {"block_steps_with_sharing": st.sampling_blocks_shared,
                                  "block_steps_without_sharing": st.sampling_blocks_unshared,
                                  "saved_fraction": _saved(st.sampling_blocks_shared, st.sampling_blocks_unshared),
                                  "peak_blocks_saved": st.peak_sampling_saved,
                                  "peak_bytes_saved": st.peak_sampling_saved * bpb},
            "beam_search": {"block_steps_with_sharing": st.beam_blocks_shared,
                            "block_steps_without_sharing": st.beam_blocks_unshared,
                            "saved_fraction": _saved(st.beam_blocks_shared, st.beam_blocks_unshared),
                            "peak_blocks_saved": st.peak_beam_saved, "peak_bytes_saved": st.peak_beam_saved * bpb},
        },
        "prefix_cache": {"hit_rate": round(st.cache_hit_rate, 4) if st.cache_query_tokens else None,
                         "hit_tokens": st.cache_hit_tokens,
                         "query_tokens": st.cache_query_tokens, "lookups": st.cache_lookups,
                         "evictions": st.cache_evictions,
                         "prompt_tokens_from_cache": sum(o.stats.cached_prompt_tokens for o in outputs),
                         "prompt_tokens_shared_in_admission": sum(o.stats.shared_prompt_tokens for o in outputs)},
        "preemptions": {"total": st.preemptions,
                        "requests_preempted": sum(1 for o in outputs if o.stats.preemptions),
                        # over all admissions (first one included) of the preempted requests
                        "readmission_cached_tokens": sum(o.stats.cached_prompt_tokens for o in outputs
                                                         if o.stats.preemptions)},
        # Each jitted program the run compiled ahead of its first step (ServingEngine.compile): its
        # compile seconds and why it exists; compile_s above adds any first call not compiled ahead.
        "compile": {"programs": list(engine.compile_table), "ahead_s": round(st.compile_ahead_s, 3),
                    "first_calls_s": round(st.compile_s - st.compile_ahead_s, 3)},
        "per_request": per_req,
        "block_tables": dataclasses.asdict(engine.snapshot) if engine.snapshot is not None else None,
    }
    if report["block_tables"] is not None:
        report["block_tables"]["request_id"] = str(report["block_tables"]["request_id"])
    if extra:
        report.update(extra)
    return report


def format_report(report: dict) -> str:
    """The report as text for the terminal; a figure that does not exist (None) prints as "–"."""
    t, b, sh, pc, pre = (report[k] for k in ("throughput", "blocks", "sharing", "prefix_cache", "preemptions"))
    cfg, rq = report["config"], report["requests"]
    bpb = cfg["kv_bytes_per_block"]
    timed = None if t["wall_s"] is None or t["compile_s"] is None else t["wall_s"] - t["compile_s"]
    lines = [
        "== paged-kv serving report ==",
        f"requests            {rq['finished']} finished, {rq['rejected']} rejected "
        f"({rq['sampling_n_gt_1']} with n > 1, {rq['beam']} beam search)",
        f"time                compiling {_fmt(t['compile_s'], '.1f', unit=' s')}, serving "
        f"{_fmt(timed, '.1f', unit=' s')} ({t['steps']} steps), wall {_fmt(t['wall_s'], '.1f', unit=' s')}",
        f"throughput          {_fmt(t['tokens_per_s'], '.1f')} generated tokens/s excluding compiling "
        f"({t['generated_tokens']} tokens in {_fmt(timed, '.1f', unit=' s')} of serving)",
        f"time to first token median {_fmt(t['time_to_first_token_median_s'], '.3f', unit=' s')}",
        f"peak blocks in use  {b['peak_used']} of {b['allocatable']} ({_kib(b['peak_used_bytes'])} of KV; "
        f"{cfg['block_size']} tokens x {_kib(bpb)} per block), {b['copy_on_write_copies']} copy-on-write copies",
    ]
    for i, prog in enumerate(report.get("compile", {}).get("programs", [])):
        lines.append(f"{'compiled' if i == 0 else '':<20}{prog['program']}: {prog['seconds']:.1f} s")
    for name, key in (("parallel sampling", "parallel_sampling"), ("beam search", "beam_search")):
        s = sh[key]
        lines.append(f"saved by sharing    {name}: {_fmt(s['saved_fraction'], '.1f', 100, '%')} of block-steps "
                     f"({s['block_steps_with_sharing']} held vs {s['block_steps_without_sharing']} unshared); "
                     f"peak {s['peak_blocks_saved']} blocks = {_kib(s['peak_bytes_saved'])}")
    lines += [
        f"prefix cache        hit rate {_fmt(pc['hit_rate'], '.1f', 100, '%')} ({pc['hit_tokens']} of "
        f"{pc['query_tokens']} prompt tokens), {pc['evictions']} evictions",
        f"preemptions         {pre['total']} ({pre['requests_preempted']} requests, re-admitted by recompute; "
        f"their admissions found {pre['readmission_cached_tokens']} prompt tokens cached)",
        f"({sh['definition']})",
    ]
    return "\n".join(lines)


def _ref_style(r: int) -> str:
    return _ANSI[min(max(r, 1), 4)]


def render_block_tables(snap: TableSnapshot, *, color: bool = False) -> str:
    """Terminal picture of one family's block tables: a row per sequence, a cell per table entry
    holding the physical block id and, when the block is shared, ``xN`` (its reference count).
    With ``color``, cells are shaded by reference count (ANSI)."""
    width = max([len(f"{blk}x{r}") for row, refs in zip(snap.blocks, snap.refs) for blk, r in zip(row, refs)] + [3])
    label_w = max(len(x) for x in snap.labels)
    head = (f"block tables of request {snap.request_id} ({snap.kind}s) at step {snap.step}: "
            f"{snap.saved_blocks} blocks saved by sharing")
    cols = max(len(r) for r in snap.blocks)
    out = [head, " " * (label_w + 9) + " ".join(f"{j:>{width}}" for j in range(cols))]
    for label, row, refs, n in zip(snap.labels, snap.blocks, snap.refs, snap.num_tokens):
        cells = []
        for blk, r in zip(row, refs):
            text = f"{blk}x{r}" if r > 1 else f"{blk}"
            cell = f"{text:>{width}}"
            cells.append(f"{_ref_style(r)}{cell}{_RESET}" if color else cell)
        out.append(f"{label:<{label_w}} {n:4d} tok " + " ".join(cells))
    legend = "cells: physical block id; xN: held by N block tables (shared; a copy-on-write happens before " \
             "a shared, partly full block is written)"
    if color:
        legend += "  " + " ".join(f"{_ref_style(r)} x{r}{'+' if r == 4 else ''} {_RESET}" for r in (1, 2, 3, 4))
    out.append(legend)
    return "\n".join(out)


def _make_parent(path: str | os.PathLike) -> None:
    """Creates the folder ``path`` goes into (and its parents) if missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)


def save_report_json(report: dict, path: str | os.PathLike) -> str:
    """Writes ``report`` (from ``build_report``) as indented JSON, creating its folder if missing,
    atomically (``provenance.write_atomic``: never a truncated file). Returns the path."""
    text = json.dumps(report, indent=2)  # before opening: a report that cannot be encoded writes nothing
    _make_parent(path)
    return write_atomic(path, text + "\n")


def save_block_tables_png(snap: TableSnapshot, path: str | os.PathLike, *, title: str | None = None) -> str:
    """PNG of the same picture: a grid of (sequence x logical block), each cell coloured by its
    block's reference count and labelled with the physical block id; its folder is created if
    missing; written atomically (``provenance.write_atomic``: never a 0-byte or truncated PNG).
    Returns the path."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import BoundaryNorm, ListedColormap

    rows, cols = len(snap.blocks), max(len(r) for r in snap.blocks)
    grid = np.zeros((rows, cols))
    for i, refs in enumerate(snap.refs):
        grid[i, :len(refs)] = refs
    top = int(max(4, grid.max()))
    cmap = ListedColormap(["#ffffff", "#d9d9d9", "#fff2a8", "#fdb863", "#e66101"] +
                          ["#b2182b"] * max(0, top - 4))
    norm = BoundaryNorm(np.arange(-0.5, top + 1.5), cmap.N)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * cols + 2.5), 0.6 * rows + 1.8))
    im = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
    for i, (row, refs) in enumerate(zip(snap.blocks, snap.refs)):
        for j, (blk, r) in enumerate(zip(row, refs)):
            ax.text(j, i, f"{blk}" + (f"\n×{r}" if r > 1 else ""), ha="center", va="center", fontsize=8)
    ax.set_yticks(range(rows), [f"{label} ({n} tok)" for label, n in zip(snap.labels, snap.num_tokens)])
    ax.set_xticks(range(cols))
    ax.set_xlabel("logical block (position // block_size)")
    ax.set_title(title or f"Block tables of request {snap.request_id} ({snap.kind}s) at step {snap.step}: "
                          f"{snap.saved_blocks} blocks saved by sharing", fontsize=10)
    bar = fig.colorbar(im, ax=ax, ticks=range(1, top + 1), fraction=0.04)
    bar.set_label("reference count (tables holding the block)")
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=120)
    finally:
        plt.close(fig)
    _make_parent(path)
    return write_atomic(path, png.getvalue())


__all__ = ["SHARING_DEFINITION", "answer_entries", "build_report", "format_report", "render_block_tables",
           "save_block_tables_png", "save_report_json"]
