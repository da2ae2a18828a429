#!/usr/bin/env python
"""Does tokenization show up in the serving profile? Encode and streamed-decode time per request
against the engine's step time, from the same run.

A checkpoint with a real BPE tokenizer (scripts/bpe_checkpoint.py: trained with `tokenizers` on the
project's corpus) serves prompts drawn from that corpus through `ServingEngine`, streaming every
token through `paged_kv.models.hf_tokenizer.StreamDecoder` (what `python -m paged_kv --prompt ...` does).
Measured, on the host, in this one run:

* encode: `HFTokenizer.encode` of each prompt (with its special tokens), per request;
* decode: the streamed `StreamDecoder.push` calls of each request's tokens plus the final flush,
  per request, and per token;
* step: the engine's wall time per step, without the first call of each step shape (compilation).

    python scripts/tokenizer_cost.py [--requests 16] [--max-new-tokens 64] [--vocab 2048]
        [--out results/tokenizer_cost.json]

The machine's load average (before and after) and core count are recorded with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size of the checkpoint")
    p.add_argument("--out", default="results/tokenizer_cost.json")
    args = p.parse_args(argv)
    load_before = os.getloadavg()

    import jax
    import tokenizers

    import paged_kv as pk
    from paged_kv.models import load_hf_checkpoint
    from paged_kv.models.hf_tokenizer import HFTokenizer
    from paged_kv.engine import SamplingParams
    from paged_kv.engine.serving import Request, ServingConfig, ServingEngine
    from scripts import bpe_checkpoint
    from scripts.train_tiny_llama import generate_corpus

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = bpe_checkpoint.write_checkpoint(Path(tmp) / "ckpt", vocab_size=args.vocab, hidden_size=64,
                                               num_layers=2)
        tok = HFTokenizer.load(ckpt)
        model = load_hf_checkpoint(ckpt)
    texts = generate_corpus(12345, args.requests)

    encode_s, prompts = [], []
    for text in texts:
        t0 = time.perf_counter()
        ids = tok.encode(text)
        encode_s.append(time.perf_counter() - t0)
        prompts.append(ids)

    mgr = pk.ManagerConfig(num_blocks=256, block_size=16, max_seqs=16, max_blocks_per_seq=16)
    cfg = ServingConfig(mgr, chunk_size=64, max_prefill_rows=8, top_candidates=8)
    engine = ServingEngine(model, cfg, seed=0)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.8, top_p=0.95,
                            eos_token_ids=tok.eos_ids)
    reqs = [Request(ids, params, request_id=i) for i, ids in enumerate(prompts)]
    decoders = {i: tok.stream() for i in range(len(reqs))}
    decode_s = [0.0] * len(reqs)
    tokens = [0] * len(reqs)

    def on_token(delta):
        t0 = time.perf_counter()
        dec = decoders[delta.request_id]
        for t in delta.tokens:
            dec.push(t)
        if delta.finish_reason is not None:
            dec.finish()
        decode_s[delta.request_id] += time.perf_counter() - t0
        tokens[delta.request_id] += len(delta.tokens)

    outs = list(engine.run(reqs, on_token=on_token))
    st = engine.stats()
    steady_steps = st.steps - sum(1 for k in engine._seen_shapes if k[0] == "step")  # less each shape's compile
    step_s = (st.step_s - st.compile_s) / max(steady_steps, 1)
    ms = lambda xs: 1000 * statistics.mean(xs)  # noqa: E731
    result = {
        "what": "tokenization time per request against the engine step time, one run (scripts/tokenizer_cost.py)",
        "tokenizer": tok.describe(), "tokenizers_version": tokenizers.__version__,
        "requests": len(reqs), "finished": sum(o.ok for o in outs),
        "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
        "generated_tokens_mean": statistics.mean(tokens),
        "encode_ms_per_request": ms(encode_s), "encode_ms_per_request_max": 1000 * max(encode_s),
        "decode_ms_per_request": ms(decode_s),
        "decode_us_per_token": 1e6 * sum(decode_s) / max(sum(tokens), 1),
        "step_ms_mean": 1000 * step_s, "steps": st.steps,
        "generated_tokens_per_step": st.generated_tokens / max(st.steps, 1),
        "tokenization_share_of_serving": (sum(encode_s) + sum(decode_s)) / max(st.step_s - st.compile_s, 1e-9),
        "model_params": model.config.num_params(),
        "machine": {"cpus": os.cpu_count(), "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                    "platform": platform.platform(), "jax": jax.__version__, "backend": jax.default_backend()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
