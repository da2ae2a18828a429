"""The serving engine's outputs on a mixed workload, as JSON, to check that a change alters no bit.

Greedy, temperature with top-k / top-p, ``n = 3``, beams and EOS requests arriving over several
steps, once with ample blocks and once with a pool so small that requests are preempted; per
request its tokens, log-probabilities (exact: JSON floats round-trip), beam scores and finish
reasons, plus the engine's step, preemption, copy and sharing counts.

    PYTHONPATH=/path/to/old/tree python scripts/serving_outputs.py /tmp/before.json
    python scripts/serving_outputs.py /tmp/after.json && cmp /tmp/before.json /tmp/after.json
"""
import json
import sys
from pathlib import Path

import numpy as np
import paged_kv as pk
from paged_kv.models import load_hf_checkpoint
from paged_kv.engine import serving
from paged_kv.engine.sampling import BeamParams, SamplingParams
KINDS = (
    SamplingParams(max_new_tokens=20),
    SamplingParams(max_new_tokens=20, temperature=0.8, top_k=20, top_p=0.9),
    SamplingParams(max_new_tokens=16, temperature=1.2, n=3),
    BeamParams(beam_width=2, max_new_tokens=10),
    SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.5, eos_token_ids=(5, 7)),
)


def outputs(model, blocks: int, rows: int) -> dict:
    mgr = pk.ManagerConfig(num_blocks=blocks, block_size=16, max_seqs=rows, max_blocks_per_seq=8)
    cfg = serving.ServingConfig(mgr, chunk_size=64, max_prefill_rows=8)
    rng = np.random.default_rng(0)
    reqs = [serving.Request([int(x) for x in rng.integers(3, 250, size=int(rng.integers(4, 40)))], KINDS[i % 5])
            for i in range(14)]
    eng = serving.ServingEngine(model, cfg, seed=3)
    outs = sorted(eng.run(reqs, arrivals=[i // 2 for i in range(14)]), key=lambda o: o.request_id)
    st = eng.stats()
    print(f"{blocks} blocks, {rows} rows: {st.steps} steps, {st.preemptions} preemptions, {st.copies} copies")
    return {"outs": [(o.tokens, o.logprobs, o.scores, o.finish_reasons) for o in outs],
            "stats": [st.steps, st.preemptions, st.copies, st.sampling_blocks_shared, st.beam_blocks_shared,
                      st.peak_blocks_used, st.cache_hit_tokens]}


def main() -> None:
    model = load_hf_checkpoint(Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-llama")
    res = {"ample": outputs(model, 200, 32), "tight": outputs(model, 13, 8)}
    Path(sys.argv[1]).write_text(json.dumps(res))


if __name__ == "__main__":
    main()
