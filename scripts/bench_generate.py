"""Generated tokens/s: the on-device generation loop (paged_kv.engine.generate, one jax.jit with
lax.while_loop) vs our contiguous-cache decoding driven from the host (models.generate, one jitted
step per token) vs Hugging Face transformers `generate` (PyTorch) on the same weights.

Greedy decoding, no EOS (every sequence generates exactly `--new` tokens), random prompts of
`--prompt` tokens, fresh prompts for every repeat (the same ones for all three). Time per call
includes the prefill; tokens/s = batch * new / time, median over `--repeats` after one warm-up
call (which compiles). Prints a table and writes JSON (default results/bench_generate.json).

    python scripts/bench_generate.py                                   # CPU defaults (scaled down)
    python scripts/bench_generate.py --prompt 128 --new 256 --batches 1 8 32   # the full sizes
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paged_kv as pk  # noqa: E402
from models import allocate_pages, greedy_generate_contiguous, load_hf_checkpoint, page_spec  # noqa: E402
from paged_kv import engine  # noqa: E402
from pallas_kernels import resolve_impl  # noqa: E402

HF_CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10_000.0,
                 initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                 tie_word_embeddings=False)


def _hf_model(seed: int):
    import torch
    import transformers
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).eval()


def _median(fn, prompts_for, repeats: int) -> float:
    fn(prompts_for(-1))  # warm-up: compiles
    times = []
    for r in range(repeats):
        p = prompts_for(r)
        t0 = time.perf_counter()
        fn(p)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(model, hf, batch: int, prompt: int, new: int, block_size: int, repeats: int, impl: str,
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
        return np.random.RandomState(1000 * batch + r + 1).randint(0, vocab, (batch, prompt)).astype(np.int32)

    def on_device(toks):
        out, box["pages"], box["state"] = engine.generate(model, box["pages"], toks, lens, jax.random.key(0), params,
                                                          manager=mgr, state=box["state"], impl=impl)
        tokens = np.asarray(out.tokens)  # waits for the device
        assert tokens.shape == (batch, 1, new) and (tokens >= 0).all()
        box["last"] = tokens[:, 0]

    def contiguous(toks):
        tokens, _ = greedy_generate_contiguous(model, toks.tolist(), new, chunk_size=min(prompt, 256))
        box["last_contiguous"] = tokens

    def transformers_generate(toks):
        with torch.no_grad():
            out = hf.generate(torch.tensor(toks, dtype=torch.long), attention_mask=torch.ones(toks.shape, dtype=torch.long),
                              do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        box["last_hf"] = out[:, prompt:].numpy()

    row = {"batch": batch, "prompt": prompt, "new_tokens": new}
    t = _median(on_device, prompts_for, repeats)
    row["on_device_s"], row["on_device_tok_s"] = t, batch * new / t
    t = _median(contiguous, prompts_for, repeats)
    row["contiguous_host_loop_s"], row["contiguous_host_loop_tok_s"] = t, batch * new / t
    # The last repeat's tokens of the two JAX paths agree (greedy, same weights).
    row["same_tokens_as_contiguous"] = bool((box["last"] == box["last_contiguous"]).all())
    if not skip_hf:
        t = _median(transformers_generate, prompts_for, repeats)
        row["transformers_s"], row["transformers_tok_s"] = t, batch * new / t
        row["same_tokens_as_transformers_frac"] = float((box["last"] == box["last_hf"]).mean())
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64, help="new tokens per sequence (full size: 256)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "bench_generate.json"))
    args = ap.parse_args()

    hf = _hf_model(seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        model = load_hf_checkpoint(tmp)
    impl = resolve_impl(args.impl, model.config.head_dim)
    rows = []
    print(f"{'batch':>5} {'prompt':>6} {'new':>4} | {'on-device tok/s':>15} {'contiguous tok/s':>16} "
          f"{'transformers tok/s':>18} | same tokens")
    for b in args.batches:
        row = run(model, hf, b, args.prompt, args.new, args.block_size, args.repeats, args.impl, args.skip_hf)
        rows.append(row)
        print(f"{b:>5} {args.prompt:>6} {args.new:>4} | {row['on_device_tok_s']:>15.0f} "
              f"{row['contiguous_host_loop_tok_s']:>16.0f} {row.get('transformers_tok_s', float('nan')):>18.0f} | "
              f"{row['same_tokens_as_contiguous']}, hf {row.get('same_tokens_as_transformers_frac', float('nan')):.3f}",
              flush=True)
    import torch
    import transformers
    meta = {"backend": jax.default_backend(), "impl": impl, "jax": jax.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "machine": platform.machine(),
            "cpu_count": __import__("os").cpu_count(), "torch_threads": torch.get_num_threads(),
            "repeats": args.repeats, "block_size": args.block_size, "dtype": "float32", "decoding": "greedy, no EOS",
            "model": {k: HF_CONFIG[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads", "num_key_value_heads")},
            "command": " ".join(["python", "scripts/bench_generate.py", *sys.argv[1:]])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
