"""Where the time of one on-device decode step goes, on XLA:CPU, from a profiler trace.

Runs `paged_kv.engine.generate` (greedy, no EOS) on the benchmark model of
`scripts/bench_generate.py`, once to compile and warm up and once under `jax.profiler`. XLA:CPU's
thunk executor records one trace event per executed HLO instruction; each event's exclusive time
(its duration less that of the events nested in it) is attributed to a part of the step through
the instruction's `op_name` metadata in the optimized HLO, dumped by XLA for this run. The parts
follow the named scopes the code sets (`qkv_proj`, `o_proj`, `mlp`, `lm_head`, `manager_append`,
`block_copy`, `sampling`, ...) and the jitted kernel references (`paged_decode_attention_reference`,
`write_kv_reference`). Only instructions inside the decode loop's body (`decode_step`) count, so
the prefill and the loop's set-up are left out; time per step = part total / decode steps.

    python scripts/profile_decode.py                       # batch 32, prompt 128, 256 new tokens
    python scripts/profile_decode.py --prompt 512 --update-docs   # the committed file and docs/benchmarks.md's table

Writes JSON (default results/profile_decode.json) and prints the table; `--update-docs`
rewrites the profile table in docs/benchmarks.md from it (the README is never written). Times
are thread-milliseconds (XLA:CPU runs independent instructions on both cores at once), so the
parts add up to more than the wall time of a step; read them as shares. Load average is
recorded before and after; a profile from a busy machine is marked `"contended": true`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

DUMP = tempfile.mkdtemp(prefix="paged_kv_hlo_")
# Must be set before jax initialises its backend: the optimized HLO of the generate program.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*generate.*")

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paged_kv as pk
from paged_kv import engine
from paged_kv.models import LlamaConfig, allocate_pages, init_model, page_spec
from scripts.doc_tables import BENCHMARKS, replace_block, shown_command
from scripts.run_record import record, utc_now

# The model of scripts/bench_generate.py (HF_CONFIG there).
CONFIG = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                     num_kv_heads=2, max_position_embeddings=4096, rope_theta=10_000.0)

# (part, substrings of op_name, first match wins). Order matters: the attention reference's
# einsums are dots too, so the kernels are matched before the projections.
PARTS = [
    ("layer weight slices (scan over layers)", ("dynamic_index_in_dim",)),
    ("attention (paged, XLA reference)", ("paged_decode_attention", "paged_prefill_attention",
                                          "_paged_attention")),
    ("kv write", ("write_kv",)),
    ("block copy (copy-on-write)", ("block_copy", "copy_blocks")),
    ("manager append", ("manager_append",)),
    ("manager free", ("manager_free",)),
    ("sampling", ("sampling",)),
    ("qkv projections", ("qkv_proj",)),
    ("rope", ("rope",)),
    ("o projection", ("o_proj",)),
    ("mlp", ("mlp",)),
    ("lm head", ("lm_head",)),
]
OTHER = "other (norms, embedding, residuals, loop bookkeeping)"

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?(?:metadata=\{([^}]*)\})?\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def load_average() -> float:
    return os.getloadavg()[0]


def op_names(dump_dir: str, module: str = "generate") -> dict[str, str]:
    """HLO instruction name -> its op_name metadata, from the optimized module(s) XLA dumped; an
    instruction without one (a fusion or call, on XLA:CPU) gets that of the ROOT of the
    computation it calls. One pass over the files."""
    own: dict[str, str] = {}
    root_name: dict[str, str] = {}
    calls: dict[str, str] = {}
    comp = None
    for f in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")):
        if module not in f:
            continue
        for line in open(f):
            head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if head and "=" not in line.split("{")[0]:
                comp = head.group(1)
                continue
            m = _INSTR.match(line)
            if not m:
                continue
            meta = _OP_NAME.search(line)
            own[m.group(1)] = meta.group(1) if meta else ""
            if comp and meta and line.lstrip().startswith("ROOT"):
                root_name[comp] = meta.group(1)
            c = re.search(r"calls=%?([\w.\-]+)", line)
            if c:
                calls[m.group(1)] = c.group(1)
    return {instr: name or root_name.get(calls.get(instr, ""), "") for instr, name in own.items()}


def exclusive_times(trace_file: str) -> list[tuple[str, float]]:
    """(hlo_op, exclusive µs) for every thunk event of the generate module in the trace."""
    data = json.load(gzip.open(trace_file))
    events = data["traceEvents"] if isinstance(data, dict) else data
    by_thread = collections.defaultdict(list)
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") == "X" and "hlo_op" in args and "generate" in args.get("hlo_module", ""):
            by_thread[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), float(e["dur"]), args["hlo_op"]))
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda x: (x[0], -x[1]))
        stack: list[list] = []  # [end, op, child_total, dur]
        for ts, dur, op in evs:
            while stack and ts >= stack[-1][0] - 1e-3:
                end, sop, child, sdur = stack.pop()
                out.append((sop, sdur - child))
            if stack:
                stack[-1][2] += dur
            stack.append([ts + dur, op, 0.0, dur])
        while stack:
            end, sop, child, sdur = stack.pop()
            out.append((sop, sdur - child))
    return out


def classify(op_name: str) -> str:
    for part, keys in PARTS:
        if any(k in op_name for k in keys):
            return part
    return OTHER


def render_table(result: dict) -> str:
    m = result["meta"]
    lines = [f"Batch {m['batch']}, prompt {m['prompt']}, {m['new_tokens']} new tokens "
             f"(`{shown_command(m['command'])}`, jax {m['jax']}, {m['cpu_count']} CPU cores). "
             f"Thread-milliseconds: XLA:CPU runs independent "
             f"instructions on several cores at once, so they add up to more than the wall time.",
             "", "| part of a decode step | thread-ms per step | share |", "|---|---:|---:|"]
    lines += [f"| {r['part']} | {r['ms_per_step']:.3f} | {100 * r['share']:.1f} % |" for r in result["parts"]]
    lines += ["", f"| part of the prefill ({m['batch']} x {m['prompt']} tokens) | thread-ms | share |",
              "|---|---:|---:|"]
    lines += [f"| {r['part']} | {r['ms']:.1f} | {100 * r['share']:.1f} % |" for r in result["prefill_parts"]]
    return "\n".join(lines)


def update_docs(result: dict, page: Path = BENCHMARKS) -> None:
    replace_block("profile_decode", render_table(result), page)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="auto", help="the pages' dtype: auto (the model's), int8 or fp8")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "profile_decode.json"))
    ap.add_argument("--update-docs", action="store_true",
                    help="rewrite docs/benchmarks.md's profile table from the result")
    ap.add_argument("--render-docs", action="store_true", help="only rewrite docs/benchmarks.md's table from --out")
    args = ap.parse_args(argv)
    started = utc_now()
    if args.render_docs:
        update_docs(json.loads(Path(args.out).read_text()))
        return

    load_before = load_average()
    model = init_model(CONFIG, seed=0, init_std=0.2)
    b, bs = args.batch, args.block_size
    per_seq = -(-(args.prompt + args.new) // bs)
    mgr = pk.ManagerConfig(num_blocks=1 + b * per_seq + b, block_size=bs, max_seqs=b, max_blocks_per_seq=per_seq)
    params = engine.SamplingParams(max_new_tokens=args.new)
    pages = allocate_pages(page_spec(CONFIG, mgr.num_blocks, bs, kv_dtype=args.kv_dtype))
    box = {"pages": pages, "state": pk.init_state(mgr)}
    lens = np.full(b, args.prompt, np.int32)

    def run(seed):
        toks = np.random.RandomState(seed).randint(0, CONFIG.vocab_size, (b, args.prompt)).astype(np.int32)
        out, box["pages"], box["state"] = engine.generate(model, box["pages"], toks, lens, jax.random.key(0), params,
                                                          manager=mgr, state=box["state"])
        return np.asarray(out.tokens)

    print("compiling and warming up ...", flush=True)
    run(0)
    t0 = time.perf_counter()
    run(1)
    untraced_s = time.perf_counter() - t0
    trace_dir = tempfile.mkdtemp(prefix="paged_kv_trace_")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    t0 = time.perf_counter()
    run(2)
    traced_s = time.perf_counter() - t0
    jax.profiler.stop_trace()
    load_after = load_average()

    trace = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    names = op_names(DUMP)
    shutil.rmtree(DUMP, ignore_errors=True)
    totals: dict[str, float] = collections.defaultdict(float)
    top: dict[tuple[str, str], float] = collections.defaultdict(float)
    in_loop_us = 0.0
    prefill: dict[str, float] = collections.defaultdict(float)
    steps = args.new - 1  # decode steps: token 0 comes from the prefill's logits
    for op, us in exclusive_times(trace):
        meta = names.get(op, "")
        if "/prefill/" in meta:
            prefill[classify(meta)] += us
            continue
        if "decode_step" not in meta:
            continue
        part = classify(meta)
        totals[part] += us
        top[(part, op)] += us
        in_loop_us += us
    per_step = {p: totals[p] / steps / 1e3 for p in [p for p, _ in PARTS] + [OTHER] if totals[p] > 0}
    step_ms = in_loop_us / steps / 1e3
    rows = [{"part": p, "ms_per_step": round(ms, 4), "share": round(ms / step_ms, 4)} for p, ms in
            sorted(per_step.items(), key=lambda kv: -kv[1])]
    heavy = sorted(top.items(), key=lambda kv: -kv[1])[:15]
    print(f"\nbatch {b}, prompt {args.prompt}, {args.new} new tokens: {step_ms:.3f} ms per decode step in the "
          f"loop body ({steps} steps); whole call {traced_s:.2f} s traced, {untraced_s:.2f} s untraced")
    print(f"{'part':<56} {'ms/step':>8} {'share':>6}")
    for r in rows:
        print(f"{r['part']:<56} {r['ms_per_step']:>8.3f} {100 * r['share']:>5.1f}%")
    prefill_ms = sum(prefill.values()) / 1e3
    prefill_rows = [{"part": p, "ms": round(us / 1e3, 3), "share": round(us / 1e3 / prefill_ms, 4)}
                    for p, us in sorted(prefill.items(), key=lambda kv: -kv[1])]
    print(f"\nprefill of {b} x {args.prompt} tokens: {prefill_ms:.1f} ms")
    for r in prefill_rows:
        print(f"{r['part']:<56} {r['ms']:>8.1f} {100 * r['share']:>5.1f}%")
    cpus = os.cpu_count() or 1
    run_meta = record(__file__, args, argv, started=started)
    result = {
        "run": run_meta,
        "meta": {"batch": b, "prompt": args.prompt, "new_tokens": args.new, "block_size": bs, "decode_steps": steps,
                 "kv_dtype": args.kv_dtype,
                 "model": {"vocab_size": CONFIG.vocab_size, "hidden_size": CONFIG.hidden_size,
                           "intermediate_size": CONFIG.intermediate_size, "num_layers": CONFIG.num_layers,
                           "num_heads": CONFIG.num_heads, "num_kv_heads": CONFIG.num_kv_heads, "dtype": "float32"},
                 "jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": cpus,
                 "load_average_before": load_before, "load_average_after": load_after,
                 "contended": max(load_before, load_after) > 0.5 * cpus,
                 "command": run_meta["command"]},
        "decode_step_ms": round(step_ms, 4), "call_s_traced": traced_s, "call_s_untraced": untraced_s,
        "parts": rows, "prefill_ms": round(prefill_ms, 2), "prefill_parts": prefill_rows,
        "heaviest_instructions": [{"part": p, "hlo_op": op, "ms_per_step": round(us / steps / 1e3, 4)}
                                  for (p, op), us in heavy],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(trace_dir, ignore_errors=True)
    print(f"wrote {args.out} (load {load_before:.2f} -> {load_after:.2f})")
    if args.update_docs:
        update_docs(result)


if __name__ == "__main__":
    main()
