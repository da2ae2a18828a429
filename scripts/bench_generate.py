"""Generated tokens/s: the on-device generation loop (paged_kv.engine.generate, one jax.jit with
lax.while_loop) vs our contiguous-cache decoding driven from the host (paged_kv.models.generate, one jitted
step per token) vs Hugging Face transformers `generate` (PyTorch) on the same weights, for every
(prompt length, batch) pair, side by side in one process.

Greedy decoding, no EOS (every sequence generates exactly `--new` tokens), random prompts, fresh
prompts for every repeat (the same ones for all three). Time per call includes the prefill;
tokens/s = batch * new / time, median over `--repeats` after one warm-up call (which compiles).

    python scripts/bench_generate.py                       # prompts 128 and 512, batches 1 8 32 64
    python scripts/bench_generate.py --prompts 128 --batches 32 --repeats 2 --out /tmp/b.json
    python scripts/bench_generate.py --render-docs         # docs/benchmarks.md's table from the committed file

Needs the ``bench`` extra (torch, transformers): ``pip install -e '.[bench]'``.

**Quiet machine or no file.** Each measurement records the 1-minute load average before and
after it, and the CPU time other processes used while it ran (from /proc/stat, less this
process's own CPU time: the load average counts the benchmark's own threads, so it cannot tell a
busy machine from a busy benchmark). When other processes kept more than `--max-load-per-core`
(default 0.5) of a core busy per core during any measurement, the results are not written to
`--out` (they go to a temporary file, named on stdout) and the script exits with status 3, so a
committed figure cannot come from a contended run. `--update-docs` rewrites the table in
docs/benchmarks.md from the file just written (the README is never written).

**Token agreement.** Greedy decoding of two computations of the same model can differ where the
top two logits are within rounding of each other. To tell such near-ties from real divergences,
transformers is run once more, teacher-forced on the on-device loop's tokens, which gives float32
logits at every generated position of that trajectory. A step is a near-tie when its top-2 margin
is below twice the float32 rounding error of one logit: `6 * sqrt(sum K_i) * u * M`, the
probabilistic bound of Higham & Mary (2019) with `K_i` the reduction lengths of the whole forward
pass (`tests/tolerances.py`, `llama_reduction_lens`), `u` float32's unit roundoff and `M` the
logits' magnitude (exceeded with probability below 3e-8 per logit). The worst-case bound
(`u * sum K_i * M`) is reported too; it is about `sqrt(sum K_i) / 3` times larger and would call
most steps of a random model ties. The benchmark reports, per row: how many steps are near-ties;
how many steps the teacher-forced argmax disagrees with the on-device token (each must be a
near-tie); and for the free-running contiguous and transformers paths, how many sequences diverge
from the on-device one and whether each first divergence falls on a near-tie. A divergence at a
step with a larger margin is a real one (`real_divergences`, which must be 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import paged_kv as pk
from paged_kv import engine
from paged_kv.models import allocate_pages, greedy_generate_contiguous, load_hf_checkpoint, page_spec
from paged_kv.pallas_kernels import resolve_impl
from scripts.doc_tables import BENCHMARKS, markers, replace_block, shown_command
from scripts.extras import require
from scripts.run_record import record, utc_now
from tests import tolerances

HF_CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10_000.0,
                 initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                 tie_word_embeddings=False)
BEGIN, END = markers("bench_generate")


# ---------------------------------------------------------------------------- machine load
class LoadMeter:
    """CPU time used by other processes while a measurement runs, in cores (0 = nothing else ran,
    1 = one core busy all the time), from /proc/stat's busy jiffies less this process's own CPU
    time (all its threads, torch's and XLA's included)."""

    def __init__(self):
        self.cpus = os.cpu_count() or 1
        self.tick = os.sysconf("SC_CLK_TCK")

    def _busy_s(self) -> float | None:
        try:
            fields = open("/proc/stat").readline().split()[1:]
        except OSError:
            return None
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
        return (user + nice + system + irq + softirq) / self.tick

    @staticmethod
    def _own_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    def start(self) -> dict:
        return {"t": time.monotonic(), "busy": self._busy_s(), "own": self._own_s(), "load": os.getloadavg()[0]}

    def stop(self, s: dict) -> dict:
        t, busy, own, load = time.monotonic(), self._busy_s(), self._own_s(), os.getloadavg()[0]
        foreign = None
        if s["busy"] is not None and busy is not None:
            foreign = max(0.0, (busy - s["busy"]) - (own - s["own"])) / max(t - s["t"], 1e-9)
        return {"load_average_before": round(s["load"], 2), "load_average_after": round(load, 2),
                "other_processes_cores": None if foreign is None else round(foreign, 3)}


def _median(fn, prompts_for, repeats: int, meter: LoadMeter) -> tuple[float, dict]:
    fn(prompts_for(-1))  # warm-up: compiles
    s = meter.start()
    times = []
    for r in range(repeats):
        p = prompts_for(r)
        t0 = time.perf_counter()
        fn(p)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), meter.stop(s)


# ---------------------------------------------------------------------------- token agreement
def _hf_model(seed: int):
    import torch
    import transformers
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).eval()


def teacher_forced_logits(hf, prompts: np.ndarray, tokens: np.ndarray, rows_per_call: int = 8) -> np.ndarray:
    """float32 [B, new, V]: transformers' logits at each generated position of the trajectory
    `prompts` [B, P] + `tokens` [B, new] (position P - 1 + s predicts token s)."""
    import torch
    seq = np.concatenate([prompts, tokens[:, :-1]], axis=1)
    p = prompts.shape[1]
    out = []
    with torch.no_grad():
        for i in range(0, len(seq), rows_per_call):
            logits = hf(torch.tensor(seq[i:i + rows_per_call], dtype=torch.long)).logits
            out.append(logits[:, p - 1:].float().numpy())
    return np.concatenate(out)


def agreement(model, logits: np.ndarray, ours: np.ndarray, others: dict[str, np.ndarray], context: int) -> dict:
    """Near-tie accounting (module docstring). `logits` [B, new, V] teacher-forced on `ours`."""
    top2 = np.sort(logits, axis=-1)[..., -2:]
    margin = top2[..., 1] - top2[..., 0]  # [B, new]
    magnitude = float(np.abs(logits).max())
    lens = tolerances.llama_reduction_lens(model.config, context, tolerances.score_bound(model))
    u = tolerances.eps(np.float32) / 2
    # Two computations can swap the top two logits only if their margin is below twice the
    # error bound of one logit. Worst case (Higham (3.5)): u * sum(K_i) * M, which real rounding
    # never approaches; the probabilistic bound of Higham & Mary (2019), lambda * sqrt(sum K_i) *
    # u * M, holds with probability >= 1 - 2 exp(-lambda^2 / 2) per logit: lambda = 6 gives 3e-8.
    worst = 2 * u * float(sum(lens)) * magnitude
    typical = 2 * 6.0 * math.sqrt(float(sum(lens))) * u * magnitude
    tie = margin < typical
    disagree = logits.argmax(-1) != ours
    out = {"steps": int(margin.size), "tie_margin": typical, "near_tie_steps": int(tie.sum()),
           "worst_case_tie_margin": worst, "steps_within_worst_case": int((margin < worst).sum()),
           "smallest_margin": float(margin.min()),
           "teacher_forced": {"disagreeing_steps": int(disagree.sum()),
                              "at_near_ties": int((disagree & tie).sum()),
                              "real_divergences": int((disagree & ~tie).sum())}}
    for name, toks in others.items():
        diff = toks != ours
        rows = np.flatnonzero(diff.any(axis=1))
        first = diff[rows].argmax(axis=1)
        at_tie = tie[rows, first]
        out[name] = {"sequences": int(len(ours)), "identical": int(len(ours) - len(rows)),
                     "diverging": int(len(rows)), "first_divergence_at_near_tie": int(at_tie.sum()),
                     "real_divergences": int((~at_tie).sum()),
                     "margins_at_first_divergence": [round(float(m), 6) for m in margin[rows, first]]}
    out["real_divergences"] = out["teacher_forced"]["real_divergences"] + sum(
        out[n]["real_divergences"] for n in others)
    return out


# ---------------------------------------------------------------------------- one row
def run(model, hf, batch: int, prompt: int, new: int, block_size: int, repeats: int, impl: str, meter: LoadMeter,
        skip_hf: bool) -> dict:
    import torch
    vocab = model.config.vocab_size
    per_seq = -(-(prompt + new) // block_size)
    mgr = pk.ManagerConfig(num_blocks=1 + batch * per_seq + batch, block_size=block_size, max_seqs=batch,
                           max_blocks_per_seq=per_seq)
    params = engine.SamplingParams(max_new_tokens=new)
    box = {"pages": allocate_pages(page_spec(model.config, mgr.num_blocks, block_size)), "state": pk.init_state(mgr)}
    lens = np.full(batch, prompt, np.int32)

    def prompts_for(r):
        return np.random.RandomState(1000 * batch + 7 * prompt + r + 1).randint(0, vocab, (batch, prompt)).astype(
            np.int32)

    def on_device(toks):
        out, box["pages"], box["state"] = engine.generate(model, box["pages"], toks, lens, jax.random.key(0), params,
                                                          manager=mgr, state=box["state"], impl=impl)
        tokens = np.asarray(out.tokens)  # waits for the device
        assert tokens.shape == (batch, 1, new) and (tokens >= 0).all()
        box["ours"] = tokens[:, 0]

    def contiguous(toks):
        tokens, _ = greedy_generate_contiguous(model, toks.tolist(), new, chunk_size=min(prompt, 256))
        box["contiguous"] = np.asarray(tokens, np.int64)

    def transformers_generate(toks):
        with torch.no_grad():
            out = hf.generate(torch.tensor(toks, dtype=torch.long),
                              attention_mask=torch.ones(toks.shape, dtype=torch.long),
                              do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        box["transformers"] = out[:, prompt:].numpy()

    row = {"batch": batch, "prompt": prompt, "new_tokens": new, "load": {}}
    t, row["load"]["on_device"] = _median(on_device, prompts_for, repeats, meter)
    row["on_device_s"], row["on_device_tok_s"] = t, batch * new / t
    t, row["load"]["contiguous"] = _median(contiguous, prompts_for, repeats, meter)
    row["contiguous_host_loop_s"], row["contiguous_host_loop_tok_s"] = t, batch * new / t
    others = {"contiguous": box["contiguous"]}
    if not skip_hf:
        t, row["load"]["transformers"] = _median(transformers_generate, prompts_for, repeats, meter)
        row["transformers_s"], row["transformers_tok_s"] = t, batch * new / t
        row["on_device_over_transformers"] = row["on_device_tok_s"] / row["transformers_tok_s"]
        others["transformers"] = box["transformers"]
    # The last repeat's prompts and tokens of every path.
    logits = teacher_forced_logits(hf, prompts_for(repeats - 1), box["ours"])
    row["agreement"] = agreement(model, logits, box["ours"], others, prompt + new)
    return row


# ------------------------------------------------------------------ docs/benchmarks.md table
def render_table(result: dict) -> str:
    meta = result["meta"]
    lines = [f"Greedy, no EOS, {meta['new_tokens']} new tokens, float32, block size {meta['block_size']}, "
             f"median of {meta['repeats']} (`{shown_command(meta['command'])}`, {meta['cpu_count']} CPU cores, "
             f"jax {meta['jax']}, torch {meta['torch']} with {meta['torch_threads']} threads, transformers "
             f"{meta['transformers']}):",
             "",
             "| prompt | batch | on-device tok/s | contiguous host loop tok/s | transformers tok/s "
             "| on-device / transformers | near-tie steps | divergences (all at near-ties) |",
             "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        a = r["agreement"]
        div = ", ".join(f"{n} {a[n]['diverging']}/{a[n]['sequences']}"
                        for n in ("contiguous", "transformers") if n in a)
        ok = "yes" if a["real_divergences"] == 0 else f"**no: {a['real_divergences']} real**"
        lines.append(f"| {r['prompt']} | {r['batch']} | {r['on_device_tok_s']:,.0f} | "
                     f"{r['contiguous_host_loop_tok_s']:,.0f} | {r.get('transformers_tok_s', float('nan')):,.0f} | "
                     f"{r.get('on_device_over_transformers', float('nan')):.2f}x | "
                     f"{a['near_tie_steps']}/{a['steps']} | {div} ({ok}) |")
    return "\n".join(lines)


def update_docs(result: dict, page: Path = BENCHMARKS) -> None:
    replace_block("bench_generate", render_table(result), page)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompts", type=int, nargs="+", default=[128, 512], help="prompt lengths")
    ap.add_argument("--new", type=int, default=256, help="new tokens per sequence")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--skip-hf", action="store_true", help="skip transformers.generate (still used for agreement)")
    ap.add_argument("--max-load-per-core", type=float, default=0.5,
                    help="refuse to write --out when other processes used more than this share of each core")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_generate.json"))
    ap.add_argument("--update-docs", action="store_true", help="rewrite docs/benchmarks.md's table from the new file")
    ap.add_argument("--render-docs", action="store_true", help="only rewrite docs/benchmarks.md's table from --out")
    args = ap.parse_args(argv)
    started = utc_now()
    if args.render_docs:
        update_docs(json.loads(Path(args.out).read_text()))
        return

    require("bench", "torch", "transformers")
    import torch
    import transformers
    meter = LoadMeter()
    hf = _hf_model(seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        model = load_hf_checkpoint(tmp)
    impl = resolve_impl(args.impl, model.config.head_dim)
    rows = []
    print(f"{'prompt':>6} {'batch':>5} | {'on-device tok/s':>15} {'contiguous tok/s':>16} {'transformers tok/s':>18} "
          f"{'ratio':>6} | near ties, divergences (real) | other procs (cores)", flush=True)
    for prompt in args.prompts:
        for b in args.batches:
            row = run(model, hf, b, prompt, args.new, args.block_size, args.repeats, impl, meter, args.skip_hf)
            rows.append(row)
            a = row["agreement"]
            busy = max(v["other_processes_cores"] or 0.0 for v in row["load"].values())
            div = " ".join(f"{n[:4]} {a[n]['diverging']}" for n in ("contiguous", "transformers") if n in a)
            print(f"{prompt:>6} {b:>5} | {row['on_device_tok_s']:>15.0f} {row['contiguous_host_loop_tok_s']:>16.0f} "
                  f"{row.get('transformers_tok_s', float('nan')):>18.0f} "
                  f"{row.get('on_device_over_transformers', float('nan')):>5.2f}x | "
                  f"{a['near_tie_steps']}/{a['steps']}, {div} ({a['real_divergences']}) | {busy:.2f}", flush=True)
    busiest = max((v["other_processes_cores"] or 0.0) for r in rows for v in r["load"].values())
    run_meta = record(__file__, args, argv, started=started)
    meta = {"backend": jax.default_backend(), "impl": impl, "jax": jax.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "machine": platform.machine(), "cpu_count": meter.cpus,
            "torch_threads": torch.get_num_threads(), "repeats": args.repeats, "block_size": args.block_size,
            "new_tokens": args.new, "dtype": "float32", "decoding": "greedy, no EOS",
            "model": {k: HF_CONFIG[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads", "num_key_value_heads")},
            "max_other_cores_per_core": busiest / meter.cpus, "max_load_per_core": args.max_load_per_core,
            "command": run_meta["command"]}
    result = {"run": run_meta, "meta": meta, "rows": rows}
    text = json.dumps(result, indent=2) + "\n"
    if busiest / meter.cpus > args.max_load_per_core:
        fd, tmp = tempfile.mkstemp(prefix="bench_generate_contended_", suffix=".json")
        os.write(fd, text.encode())
        os.close(fd)
        print(f"refused to write {args.out}: other processes kept {busiest:.2f} cores busy during a measurement "
              f"({busiest / meter.cpus:.2f} per core > {args.max_load_per_core}); the contended results are in {tmp}")
        sys.exit(3)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    if args.update_docs:
        update_docs(result)


if __name__ == "__main__":
    main()
