"""Subprocess side of tests/test_sharding.py: runs on several simulated CPU devices, which must be
configured before JAX starts (so never in the pytest process, whose other tests expect one).

  python tests/sharding_worker.py four CKPT            4 devices in one process
  python tests/sharding_worker.py multi CKPT ID PORT   process ID of 2 (2 devices each) on 127.0.0.1:PORT
  python tests/sharding_worker.py invariant CKPT       2 devices: batch-invariant mode, tp=1 vs tp=2; then, in
                                                       the same process, the serving engine's pressured workload
                                                       (tests/test_serving.py) on the built-in checkpoint, tp=1 vs tp=2
  python tests/sharding_worker.py quant CKPT           2 devices: int8 KV pages, tp=1 vs tp=2; then, in the
                                                       same process, a protocol model's attend options at tp=2

CKPT: a Hugging Face checkpoint directory of a small model with 4 heads and 2 KV heads (the test
writes one), so tp=4 replicates KV heads.

Prints one JSON line (prefixed RESULT) with the tokens and the facts the test checks.
"""

from __future__ import annotations

import json
import os
import sys

MODE = sys.argv[1]
DEVICES = {"four": 4, "multi": 2, "invariant": 2, "quant": 2}[MODE]
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# Compile time dominates these runs (each engine loop compiles once); XLA's optimisation passes
# are off for every run here alike (the SPMD partitioner still runs: it is not an optimisation).
# scripts/sharding_report.py inspects fully optimised programs.
jax.config.update("jax_disable_most_optimizations", True)

TINY_LLAMA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "tiny-llama")
# Shared with the test: the prompts, manager and parameters every run uses.
PROMPTS = [[84, 104, 101, 32, 99, 111, 119, 32, 115, 97, 121, 115], [76, 101, 116, 32, 117, 115]]
NUM_BLOCKS, BLOCK_SIZE, NEW = 48, 4, 10
# `tiny(**GQA_CONFIG)`: the model of the head-layout check (the test derives its tolerances from it).
GQA_CONFIG = dict(num_heads=8, num_kv_heads=4, hidden_size=64)


def _setup():
    import paged_kv as pk
    from paged_kv import engine
    mgr = pk.ManagerConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_seqs=8, max_blocks_per_seq=8)
    toks, lens = engine.pad_prompts(PROMPTS, width=12)
    return mgr, toks, lens


def _tokens(x) -> list:
    from jax.experimental import multihost_utils
    if not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x).tolist()


def run_engine(model, mesh, pages, beam: bool = True):
    """Greedy with n=2 (parallel sampling: forked prompt blocks, copy-on-write), then (if `beam`)
    beam search of width 2 on the same pages. Returns (result dict, pages)."""
    from paged_kv import engine
    mgr, toks, lens = _setup()
    params = engine.SamplingParams(max_new_tokens=NEW, n=2)
    out, pages, state = engine.generate(model, pages, toks, lens, jax.random.key(0), params, manager=mgr,
                                        chunk_size=8, mesh=mesh)
    res = {"greedy": _tokens(out.tokens), "copies": _tokens(out.stats.copies)}
    if beam:
        beams, pages, state = engine.beam_search(model, pages, toks, lens,
                                                 engine.BeamParams(beam_width=2, max_new_tokens=NEW),
                                                 manager=mgr, state=state, chunk_size=8, mesh=mesh)
        res.update(beam=_tokens(beams.tokens), beam_scores=_tokens(beams.scores))
    return res, pages


def four(ckpt: str):
    import time

    from flax import nnx
    t0 = time.time()
    from paged_kv.models import (
        allocate_pages,
        init_model,
        load_hf_checkpoint,
        make_paged_batch,
        page_spec,
        sharding,
        tiny,
    )
    from paged_kv.models.paged import copy_blocks, paged_decode_step, paged_prefill_step
    assert jax.device_count() == 4
    res = {}
    model = load_hf_checkpoint(ckpt)  # 4 heads, 2 KV heads: tp=4 replicates KV heads
    res["t_import"] = time.time() - t0
    res["single"], _ = run_engine(model, None, allocate_pages(page_spec(model.config, NUM_BLOCKS, BLOCK_SIZE)))
    res["t_single"] = time.time() - t0
    mesh = sharding.make_mesh(4)
    # Slices read by the sharded loader equal the full load placed by `shard` (the built-in
    # checkpoint: 4 heads, 2 KV heads, vocab 259 which 4 does not divide, so a replicated head).
    stats = {}
    placed = sharding.load_sharded(TINY_LLAMA, mesh, stats=stats)
    res["load_stats"] = stats
    res["placed_kv_heads"] = placed.config.num_kv_heads
    ref_placed = sharding.shard_model(load_hf_checkpoint(TINY_LLAMA), mesh)
    diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), nnx.state(placed), nnx.state(ref_placed))
    res["load_max_diff"] = max(jax.tree.leaves(diffs))
    res["load_same_specs"] = all(jax.tree.leaves(jax.tree.map(
        lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim), nnx.state(placed), nnx.state(ref_placed))))
    res["t_load"] = time.time() - t0
    # `generate` given the unplaced model, its original pages (2 KV heads) and just the mesh places
    # them itself (KV heads replicated to 4, one per device).
    res["tp4"], pages = run_engine(model, mesh, allocate_pages(page_spec(model.config, NUM_BLOCKS, BLOCK_SIZE)))
    res["page_shards"] = [[list(s.data.shape), int(s.data.nbytes), str(s.device)] for s in pages.addressable_shards]
    res["pages_shape"], res["pages_nbytes"] = list(pages.shape), int(pages.nbytes)
    res["t_tp4"] = time.time() - t0
    # 8 heads / 4 KV heads, vocab 256: KV heads split without replication, vocab-parallel head;
    # on the mesh the Pallas kernels themselves (interpret mode) run per device under shard_map.
    cfg = tiny(**GQA_CONFIG)
    m2 = init_model(cfg, seed=1, init_std=0.2)
    tables = jnp.array([[1, 2, 3, 0], [4, 5, 0, 0]], jnp.int32)
    pre = make_paged_batch(tables, jnp.array([0, 0]), jnp.array([7, 5]), 8, BLOCK_SIZE)
    toks = jnp.array(np.random.RandomState(0).randint(0, 256, (2, 8)), jnp.int32)
    dec = make_paged_batch(tables, jnp.array([7, 5]), jnp.array([1, 1]), 1, BLOCK_SIZE)
    out = {}
    src, dst = jnp.array([1, 4, 0], jnp.int32), jnp.array([6, 7, 0], jnp.int32)
    for name, mesh2, impl in (("single", None, "reference"), ("tp4", sharding.make_mesh(4), "interpret")):
        mdl, pg = m2, allocate_pages(page_spec(cfg, 8, BLOCK_SIZE))
        if mesh2 is not None:
            mdl, pg = sharding.shard(m2, pg, mesh2)
            out["lm_head_spec"] = str(mdl.lm_head[...].sharding.spec)
        g, w = nnx.split(mdl)
        l1, pg = paged_prefill_step(g, w, pg, pre, toks, impl=impl, mesh=mesh2)
        l2, pg = paged_decode_step(g, w, pg, dec, jnp.array([3, 9], jnp.int32), impl=impl, mesh=mesh2)
        pg = copy_blocks(pg, src, dst, impl=impl, mesh=mesh2)
        out[name] = (np.asarray(l1), np.asarray(l2), np.asarray(pg))
    res["gqa_prefill_diff"] = float(np.max(np.abs(out["single"][0] - out["tp4"][0])))
    res["gqa_decode_diff"] = float(np.max(np.abs(out["single"][1] - out["tp4"][1])))
    res["gqa_pages_diff"] = float(np.max(np.abs(out["single"][2] - out["tp4"][2])))
    res["gqa_copied"] = bool(np.abs(out["tp4"][2][:, :, :, 6]).sum() > 0)
    # Magnitudes for the test's rounding tolerances (tests/tolerances.py).
    from tests.tolerances import score_bound
    res["gqa_score_bound"] = score_bound(m2)
    res["gqa_prefill_scale"] = float(np.abs(out["single"][0]).max())
    res["gqa_decode_scale"] = float(np.abs(out["single"][1]).max())
    res["gqa_pages_scale"] = float(np.abs(out["single"][2]).max())
    res["lm_head_spec"] = out["lm_head_spec"]
    res["seconds"] = time.time() - t0
    return res


def multi(ckpt: str, process_id: int, port: int):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    from paged_kv.models import page_spec, sharding
    assert jax.device_count() == 4 and jax.local_device_count() == 2, (jax.device_count(), jax.local_device_count())
    mesh = sharding.make_mesh(4)
    stats = {}
    model = sharding.load_sharded(ckpt, mesh, stats=stats)
    pages = sharding.allocate_pages_on_mesh(page_spec(model.config, NUM_BLOCKS, BLOCK_SIZE), mesh)
    res, pages = run_engine(model, mesh, pages, beam=False)
    res["load_stats"] = stats
    res["process_index"] = jax.process_index()
    res["local_page_shards"] = [list(s.data.shape) for s in pages.addressable_shards]
    jax.distributed.shutdown()
    return res


def invariant(ckpt: str) -> dict:
    """`generate` in batch-invariant mode (docs/batch_invariance.md) on one device (no mesh) and
    over a tp=2 mesh: greedy and seeded sampling (n=2), the prompts in 4-token chunks. Returns
    each run's tokens and log-probs (float32 values as floats: exact)."""
    from paged_kv import engine
    from paged_kv.models import allocate_pages, load_hf_checkpoint, page_spec, sharding
    assert jax.device_count() == 2
    model = load_hf_checkpoint(ckpt)  # 4 heads, 2 KV heads, vocab 256: tp=2 splits all three
    mgr, toks, lens = _setup()
    res = {}
    for name, mesh in (("tp1", None), ("tp2", sharding.make_mesh(2))):
        runs = {}
        for kind, params in (("greedy", engine.SamplingParams(max_new_tokens=NEW)),
                             ("sampled", engine.SamplingParams(max_new_tokens=NEW, n=2, temperature=1.0))):
            pages = allocate_pages(page_spec(model.config, NUM_BLOCKS, BLOCK_SIZE))
            out, _, _ = engine.generate(model, pages, toks, lens, jax.random.key(1), params, manager=mgr,
                                        chunk_size=4, mesh=mesh, batch_invariant=True)
            runs[kind] = {"tokens": _tokens(out.tokens), "logprobs": np.asarray(out.logprobs, np.float64).tolist()}
        res[name] = runs
    return res


def serving() -> dict:
    """`ServingEngine` on the built-in checkpoint with tests/test_serving.py's config and its
    pressured workload (every request at once: repeated preemption), on one device and on a tp=2
    mesh (KV heads sharded, the manager's state replicated): each run's tokens per request and
    preemptions, the device count and the tp=2 pages' sharding."""
    from paged_kv.engine.serving import ServingEngine
    from paged_kv.models import load_hf_checkpoint, sharding
    from tests.test_serving import CFG, _workload
    model = load_hf_checkpoint(TINY_LLAMA)
    res = {"devices": len(jax.devices())}
    for name, mesh in (("tp1", None), ("tp2", sharding.make_mesh(2))):
        eng = ServingEngine(model, CFG, mesh=mesh)
        res[name] = {"tokens": {str(o.request_id): o.tokens for o in eng.run(_workload(0))},
                     "preemptions": eng.stats().preemptions}
    res["spec"] = str(eng.pages.sharding.spec)  # (tp=2's)
    return res


def quant(ckpt: str) -> dict:
    """int8 KV pages (`QuantPages`) on one device and over a tp=2 mesh: greedy with n=2 (forked
    prompt blocks, copy-on-write of values and scales) and beam search (`run_engine`), plus the
    shardings of the returned pages' values and scales."""
    from paged_kv.models import allocate_pages, load_hf_checkpoint, page_spec, sharding
    assert jax.device_count() == 2
    model = load_hf_checkpoint(ckpt)
    res = {}
    for name, mesh in (("tp1", None), ("tp2", sharding.make_mesh(2))):
        pages = allocate_pages(page_spec(model.config, NUM_BLOCKS, BLOCK_SIZE, kv_dtype="int8"))
        res[name], pages = run_engine(model, mesh, pages)
        res[name]["specs"] = [str(tuple(getattr(leaf.sharding, "spec", ()))) for leaf in (pages.values, pages.scales)]
        res[name]["scale_shards"] = [list(s.data.shape) for s in pages.scales.addressable_shards]
    return res


def protocol_model() -> dict:
    """`tests.model_helpers.KnobModel` (a protocol model with its own `partition_specs`, passing a
    scale, a soft cap and ALiBi slopes to `attend`) through `generate` on a tp=2 mesh: its greedy
    tokens, the device count and the pages' sharding. The slopes are split with the query heads
    inside `attend`."""
    import paged_kv as pk
    from paged_kv import engine
    from paged_kv.models import allocate_pages, page_spec, sharding
    from tests.model_helpers import KNOB_PROMPTS, KnobModel
    m = KnobModel(True)
    mgr = pk.ManagerConfig(num_blocks=16, block_size=8, max_seqs=4, max_blocks_per_seq=4)
    toks, lens = engine.pad_prompts(KNOB_PROMPTS, width=8)
    out, pages, _ = engine.generate(m, allocate_pages(page_spec(m, 16, 8)), toks, lens, 0,
                                    engine.SamplingParams(max_new_tokens=6), manager=mgr, chunk_size=8,
                                    mesh=sharding.make_mesh(2))
    return {"tokens": np.asarray(out.tokens[:, 0]).tolist(), "devices": len(jax.devices()),
            "spec": str(pages.sharding.spec)}


if __name__ == "__main__":
    if MODE == "invariant":
        # Two devices too: the serving engine's mesh run shares this process (one JAX start fewer).
        result = dict(invariant(sys.argv[2]), serving=serving())
    elif MODE == "quant":
        # Two devices too: the protocol model's mesh run shares this process (one JAX start fewer).
        result = dict(quant(sys.argv[2]), protocol=protocol_model())
    elif MODE == "four":
        result = four(sys.argv[2])
    else:
        result = multi(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    print("RESULT " + json.dumps(result), flush=True)
