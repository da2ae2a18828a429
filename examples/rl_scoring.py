"""On-policy RL, the sampler/trainer half: sample answers with the ``ServingEngine`` in
batch-invariant mode, score them with the model's plain forward (``score_tokens``: no cache, no
paging, the whole sequence at once, as a trainer computes its log-probs), and check that the two
agree bit for bit, so the policy gradient's importance ratio is exactly 1 on-policy.

    python examples/rl_scoring.py      # on a CPU, about a minute (compiles)

docs/batch_invariance.md explains the mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import paged_kv as pk
from paged_kv.checkpoints import BUILTIN
from paged_kv.engine import Request, SamplingParams, ServingConfig, ServingEngine
from paged_kv.models import load_hf_checkpoint
from paged_kv.models.contiguous import score_tokens
from paged_kv.models.tokenizer import ByteTokenizer


def main() -> None:
    model = load_hf_checkpoint(BUILTIN)
    tok = ByteTokenizer()
    manager = pk.ManagerConfig(num_blocks=64, block_size=16, max_seqs=8, max_blocks_per_seq=16)
    config = ServingConfig(manager, chunk_size=32, max_prefill_rows=4, impl="reference", batch_invariant=True)
    prompts = ["The cow says", "Once upon a time", "Let us count: 12, 13,"]
    requests = [Request(tok.encode(p), SamplingParams(max_new_tokens=24, temperature=1.0, n=2), request_id=i, seed=i)
                for i, p in enumerate(prompts)]

    # 1. Sample (the engine batches the requests however it likes).
    rollouts = []  # (prompt ids, answer ids, the sampler's log-probs)
    for out in ServingEngine(model, config).run(requests):
        prompt = list(requests[out.request_id].prompt)
        rollouts += [(prompt, answer, lps) for answer, lps in zip(out.tokens, out.logprobs)]

    # 2. Score: one right-padded batch of prompt + answer through the plain forward.
    width = max(len(p) + len(a) for p, a, _ in rollouts)
    batch = np.zeros((len(rollouts), width), np.int32)
    for i, (p, a, _) in enumerate(rollouts):
        batch[i, :len(p) + len(a)] = p + a
    logp = np.asarray(jax.jit(lambda t: score_tokens(model, t))(jnp.asarray(batch)))

    # 3. The trainer's log-probs of the sampled tokens are the sampler's, bit for bit.
    for i, (p, a, lps) in enumerate(rollouts):
        trainer = logp[i, len(p) - 1:len(p) - 1 + len(a)].astype(np.float64).tolist()
        assert trainer == lps, (i, np.max(np.abs(np.subtract(trainer, lps))))
    print(f"{len(rollouts)} rollouts, {sum(len(a) for _, a, _ in rollouts)} tokens: "
          "trainer log-probs == sampler log-probs, bit for bit")


if __name__ == "__main__":
    main()
