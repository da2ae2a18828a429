"""Subprocess side of tests/test_model_families.py: greedy decoding through the paged KV cache with
tensor parallelism at tp=2 on two simulated CPU devices, which must be configured before JAX starts
(so never in the pytest process, whose other tests expect one device; as tests/sharding_worker.py).

  python tests/families_worker.py SPEC.json

SPEC.json: {"checkpoints": {name: dir}, "prompts": [[ids], ...], "new_tokens": N, "block_size": B}.
Each checkpoint is loaded straight onto the mesh (`paged_kv.models.sharding.load_sharded`: every tensor's
shape and dtype checked first), its pages sharded on KV heads; the prompts are prefilled in chunks
of B and decoded one token per step. Prints one JSON line (prefixed RESULT): per checkpoint the
greedy tokens [batch, N], the placed model's KV-head count and whether the sliced load equals
the whole load placed by `paged_kv.models.sharding.shard_model`.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

# Compile time dominates (two small programs per family); as in tests/sharding_worker.py, XLA's
# optimisation passes are off (the SPMD partitioner still runs).
jax.config.update("jax_disable_most_optimizations", True)


def greedy_tp2(ckpt: str, prompts: list[list[int]], new_tokens: int, block: int) -> dict:
    from flax import nnx

    from paged_kv.models import load_hf_checkpoint, make_paged_batch, page_spec, sharding
    from paged_kv.models.paged import paged_decode_step, paged_prefill_step

    mesh = sharding.make_mesh(2)
    model = sharding.load_sharded(ckpt, mesh)
    placed = sharding.shard_model(load_hf_checkpoint(ckpt), mesh)
    a, b = jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(placed))
    same = len(a) == len(b) and all(
        x.shape == y.shape and x.sharding.is_equivalent_to(y.sharding, x.ndim) and
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    b, n = len(prompts), len(prompts[0])
    need = -(-(n + new_tokens) // block)
    pages = sharding.allocate_pages_on_mesh(page_spec(model.config, 1 + b * need, block), mesh)
    # Interleaved block ids (sequence i holds blocks i+1, i+1+b, ...): logical order != physical.
    tables = jnp.asarray(np.arange(1, 1 + b * need).reshape(need, b).T, jnp.int32)
    graphdef, state = nnx.split(model)
    toks = np.asarray(prompts, np.int32)
    logits = None
    for start in range(0, n, block):
        q = min(block, n - start)
        chunk = np.zeros((b, block), np.int32)
        chunk[:, :q] = toks[:, start:start + q]
        batch = make_paged_batch(tables, [start] * b, [q] * b, block, block)
        logits, pages = paged_prefill_step(graphdef, state, pages, batch, jnp.asarray(chunk), impl="reference",
                                           last_only=True, mesh=mesh)
    out = []
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    for i in range(new_tokens):
        out.append(np.asarray(tok))
        if i == new_tokens - 1:
            break
        batch = make_paged_batch(tables, [n + i] * b, [1] * b, 1, block)
        logits, pages = paged_decode_step(graphdef, state, pages, batch, tok, impl="reference", mesh=mesh)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
    return {"tokens": np.stack(out, 1).tolist(), "placed_kv_heads": model.config.num_kv_heads,
            "devices": jax.device_count(), "same_as_shard_model": bool(same)}


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        spec = json.load(fh)
    result = {name: greedy_tp2(path, spec["prompts"], spec["new_tokens"], spec["block_size"])
              for name, path in spec["checkpoints"].items()}
    print("RESULT " + json.dumps(result), flush=True)
