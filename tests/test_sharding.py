"""Tensor parallelism (paged_kv.models.sharding): degree validation, KV capacity arithmetic and sharded
loading in this process (one device); generation on 4 simulated devices and on a 2-process,
4-device mesh over loopback in subprocesses (tests/sharding_worker.py), since the device count
is fixed when JAX starts and the other tests expect one device; there too a protocol model's
attend options (ALiBi slopes split with the query heads) and the serving engine (preempting) at
tp=2.

Every subprocess is bounded in time and killed (with its process group) on failure.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import paged_kv as pk
from paged_kv import engine
from paged_kv.models import (
    abstract_model,
    greedy_generate_contiguous,
    llama31_8b,
    load_hf_checkpoint,
    page_spec,
    save_hf_checkpoint,
    sharding,
    tiny,
)
from tests import tolerances as tol
from tests.model_helpers import KNOB_PROMPTS, KnobModel

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "sharding_worker.py"
TIMEOUT_S = 420  # generous: the CPU is shared; normally the slowest run takes well under a minute


def _start(argv: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen([sys.executable, str(WORKER), *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _collect(procs: list[subprocess.Popen], deadline: float) -> list[dict] | str:
    """Each worker's RESULT, or an error text. Waits until `deadline` (time.monotonic()) at most;
    every worker of the group is killed (with its process group) on any failure."""
    outs = [""] * len(procs)
    try:
        for i, p in enumerate(procs):
            outs[i], _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            if p.returncode != 0:
                return f"worker {p.args[2:]} exited with {p.returncode}:\n{outs[i][-4000:]}"
    except subprocess.TimeoutExpired:
        return f"workers {[p.args[2:] for p in procs]} did not finish within {TIMEOUT_S} s"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    results = []
    for out in outs:
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if not lines:
            return f"no RESULT line in worker output:\n{out[-4000:]}"
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 2-layer checkpoint with 4 query heads and 2 KV heads (tp=4 replicates KV heads) and vocab
    256 (vocab-parallel head at tp=4)."""
    path = tmp_path_factory.mktemp("tiny_tp")
    # Weights drawn with numpy into the abstract model: no JAX computation (the workers wait on this).
    rng = np.random.RandomState(3)
    graphdef, state = nnx.split(abstract_model(tiny()))
    state = jax.tree_util.tree_map_with_path(
        lambda p, x: (1.0 + 0.1 * rng.randn(*x.shape) if "norm" in jax.tree_util.keystr(p) else
                      0.2 * rng.randn(*x.shape)).astype(np.float32), state)
    save_hf_checkpoint(nnx.merge(graphdef, state), path)
    return str(path)


@pytest.fixture(scope="module")
def workers(ckpt):
    """The 4-device worker, the two processes of the 2-process mesh, the 2-device batch-invariant
    (then serving) worker and the 2-device int8 (then protocol model) worker, started together
    (the waits overlap); {"four": [result] | error, "multi": [result, result] | error,
    "invariant": [result] | error, "quant": [result] | error}."""
    port = str(_free_port())
    deadline = time.monotonic() + TIMEOUT_S
    four = [_start(["four", ckpt])]
    multi = [_start(["multi", ckpt, "0", port]), _start(["multi", ckpt, "1", port])]
    inv = [_start(["invariant", ckpt])]
    quant = [_start(["quant", ckpt])]
    try:
        return {"four": _collect(four, deadline), "multi": _collect(multi, deadline),
                "invariant": _collect(inv, deadline), "quant": _collect(quant, deadline)}
    finally:
        for p in four + multi + inv + quant:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _ok(result):
    if isinstance(result, str):
        pytest.fail(result)
    return result


@pytest.fixture(scope="module")
def four(workers):
    return _ok(workers["four"])[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- one device, in process
def test_degrees_and_errors():
    cfg = load_hf_checkpoint(ROOT / "checkpoints" / "tiny-llama").config  # 4 heads, 2 KV heads
    assert sharding.valid_degrees(cfg) == [1, 2, 4]
    assert [sharding.kv_heads_for(cfg, t) for t in (1, 2, 4)] == [2, 2, 4]
    with pytest.raises(ValueError, match=r"tp=3 .*does not divide num_heads=4.*degrees that work.*\[1, 2, 4\]"):
        sharding.check_degree(cfg, 3)
    odd = tiny(num_heads=12, num_kv_heads=4, hidden_size=96, intermediate_size=96)
    assert sharding.valid_degrees(odd) == [1, 2, 4, 12]
    with pytest.raises(ValueError, match=r"tp=6 .*neither divides num_kv_heads=4.*\[1, 2, 4, 12\]"):
        sharding.check_degree(odd, 6)
    assert sharding.valid_degrees(llama31_8b()) == [1, 2, 4, 8, 16, 32]
    with pytest.raises(ValueError, match="tp=0"):
        sharding.check_degree(cfg, 0)
    with pytest.raises(ValueError, match=r"tp=2 needs 2 devices; JAX has 1 \(cpu\); on a CPU, make 2 devices with "
                                         r"jax.config.update\(\"jax_num_cpu_devices\", 2\) before JAX starts"):
        sharding.make_mesh(2)
    with pytest.raises(ValueError, match=r"tp=0 must be an int in \[1, 1\]"):
        sharding.make_mesh(0)


def test_bad_mesh_rejected_before_tracing():
    model = abstract_model(tiny())  # shapes only: nothing may be traced or compiled
    mgr = pk.ManagerConfig(num_blocks=16, block_size=8, max_seqs=2, max_blocks_per_seq=4)
    toks, lens = engine.pad_prompts([[1, 2, 3]], width=8)
    no_tp = Mesh(np.array(jax.devices()[:1]), ("data",))
    pages = np.zeros(page_spec(model.config, 16, 8).shape, np.float32)
    with pytest.raises(ValueError, match=r"mesh has axes \('data',\); expected a tensor-parallel axis named 'tp'"):
        engine.generate(model, pages, toks, lens, jax.random.key(0), engine.SamplingParams(max_new_tokens=2),
                        manager=mgr, mesh=no_tp)
    with pytest.raises(ValueError, match="expected a tensor-parallel axis named 'tp'"):
        engine.beam_search(model, pages, toks, lens, engine.BeamParams(beam_width=2), manager=mgr, mesh=no_tp)
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        sharding.shard(model, pages, mesh="tp")


def test_kv_capacity_llama31_8b():
    cfg = llama31_8b()
    one = sharding.kv_capacity(cfg, 80 * 10**9, 1)
    assert one.weight_bytes == cfg.num_params() * 2  # bfloat16, all on one device
    assert one.kv_bytes_per_token == 128 * 1024 and one.kv_bytes_per_block == 2 * 1024 * 1024
    assert one.num_blocks == (int(80e9 * 0.9) - one.weight_bytes) // (2 * 1024 * 1024)
    assert one.tokens == (one.num_blocks - 1) * 16
    eight = sharding.kv_capacity(cfg, 80 * 10**9, 8)
    assert eight.kv_heads_per_device == 1 and eight.kv_bytes_per_token == 16 * 1024
    # Norms and the (untied) input embedding stay replicated: 8 devices hold 8 copies of them.
    replicated = ((2 * cfg.num_layers + 1) * cfg.hidden_size + cfg.vocab_size * cfg.hidden_size) * 2
    assert eight.weight_bytes * 8 == one.weight_bytes + 7 * replicated
    assert eight.num_blocks > 8 * one.num_blocks  # less weight per device and 1/8 of the KV
    # Beyond the KV-head count the KV heads are replicated: still one head per device.
    sixteen = sharding.kv_capacity(cfg, 80 * 10**9, 16)
    assert sixteen.kv_heads_per_device == 1 and sixteen.kv_bytes_per_token == 16 * 1024
    # int8 pages: 128 bytes of values and a 4-byte float32 scale per (layer, K|V, KV head) row.
    int8 = sharding.kv_capacity(cfg, 80 * 10**9, 1, dtype="int8")
    assert int8.kv_bytes_per_token == 32 * 2 * 8 * (128 + 4)
    assert int8.num_blocks == one.kv_budget_bytes // (int8.kv_bytes_per_token * 16)
    tiny_gpu = sharding.kv_capacity(cfg, 8 * 10**9, 1)
    assert tiny_gpu.num_blocks == 0 and tiny_gpu.tokens == 0  # the weights alone do not fit
    with pytest.raises(ValueError, match="memory_fraction=0"):
        sharding.kv_capacity(cfg, 80 * 10**9, 1, memory_fraction=0)


def test_sharded_load_on_one_device(ckpt):
    """On a 1-device mesh the sharded loader reads every tensor once and matches the plain loader."""
    stats = {}
    placed = sharding.load_sharded(ckpt, sharding.make_mesh(1), stats=stats)
    ref = load_hf_checkpoint(ckpt)
    assert stats["bytes_read"] == stats["bytes_total"] > 0
    got, want = jax.tree.leaves(placed), jax.tree.leaves(ref)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---------------------------------------------------------------------------- 4 simulated devices
def test_four_devices_same_tokens(four, ckpt):
    """tp=4 on a model with 2 KV heads (replicated to 4): greedy with n=2 (forked blocks and a
    copy-on-write copy) and beam search give the single-device tokens; each device holds 1/4 of
    the pages (one KV head of every block)."""
    single, tp4 = four["single"], four["tp4"]
    assert tp4["greedy"] == single["greedy"]
    assert tp4["copies"] == single["copies"] and sum(single["copies"]) >= 1
    assert tp4["beam"] == single["beam"]
    # Sharded matmuls sum their partial products in another order: the rounding bound of
    # tests/tolerances.py (prompts of <= 12 tokens, NEW = 10 steps).
    model = load_hf_checkpoint(ckpt)
    for got, want in zip(np.ravel(tp4["beam_scores"]), np.ravel(single["beam_scores"])):
        np.testing.assert_allclose(got, want, rtol=0, atol=tol.beam_score_atol(model, 12 + 10, 10, want))
    assert four["pages_shape"][2] == 4
    assert len(four["page_shards"]) == 4
    for shape, nbytes, _ in four["page_shards"]:
        assert shape[2] == 1 and nbytes * 4 == four["pages_nbytes"]
    assert sorted(dev for _, _, dev in four["page_shards"]) == [f"cpu:{i}" for i in range(4)]


def test_four_devices_loading_and_head_layouts(four):
    """Sharded loading of the built-in checkpoint equals loading then placing; 8 heads / 4 KV
    heads (no replication, vocab-parallel head) with the Pallas kernels in interpret mode under
    shard_map give the single-device reference's logits and pages (block copies included)."""
    assert four["placed_kv_heads"] == 4 and four["load_max_diff"] == 0.0 and four["load_same_specs"]
    assert four["lm_head_spec"] == "P('tp', None)"
    # Per-device kernels and sharded matmuls vs one device: the rounding bound of tests/tolerances.py
    # (8 prompt tokens, then 1 decoded; the pages hold K/V of both layers).
    cfg, s = tiny(num_heads=8, num_kv_heads=4, hidden_size=64), four["gqa_score_bound"]  # worker's GQA_CONFIG
    assert four["gqa_prefill_diff"] <= tol.model_atol(cfg, 8, four["gqa_prefill_scale"], score_mag=s)
    assert four["gqa_decode_diff"] <= tol.model_atol(cfg, 9, four["gqa_decode_scale"], score_mag=s)
    assert four["gqa_pages_diff"] <= tol.model_atol(cfg, 9, four["gqa_pages_scale"], score_mag=s, through="kv")
    assert four["gqa_copied"]


# ---------------------------------------------------------------------------- 2 processes
def test_two_processes_one_mesh(workers, four):
    """Two processes with 2 devices each form one 4-device mesh (gloo collectives over loopback),
    each loading only its slices of the sharded weights: the single-device greedy tokens."""
    results = _ok(workers["multi"])
    assert sorted(r["process_index"] for r in results) == [0, 1]
    for r in results:
        assert r["greedy"] == four["single"]["greedy"]
        assert r["copies"] == four["single"]["copies"]
        assert r["local_page_shards"] == [[2, 2, 1, 48, 4, 16]] * 2  # 1 of 4 KV heads on each local device
        # Each process reads its halves of the sharded tensors plus the replicated ones (norms),
        # never the whole checkpoint.
        assert r["load_stats"]["bytes_read"] < 0.75 * r["load_stats"]["bytes_total"]


# ---------------------------------------------------------------------------- 2 devices, invariant mode
def test_batch_invariant_tp1_equals_tp2(workers: dict) -> None:
    """Batch-invariant mode (docs/batch_invariance.md): `generate` on one device and over a tp=2
    mesh (heads, KV heads, MLP columns and the vocab all split in two) gives the same tokens and
    the same log-probs, bit for bit, greedy and seeded sampling with n=2, prompts in 4-token chunks.
    The invariant matmul always computes in two parts (`invariant.matmul`'s `split`), which tp=2
    places one per device. Mutation check: without the split (one dot) the log-probs differ."""
    res = _ok(workers["invariant"])[0]
    for kind in ("greedy", "sampled"):
        one, two = res["tp1"][kind], res["tp2"][kind]
        assert two["tokens"] == one["tokens"], kind
        assert two["logprobs"] == one["logprobs"], kind  # exact: float32 values carried as floats


def test_tensor_parallel_serving_matches_one_device(workers: dict) -> None:
    """tests/test_serving.py's pressured workload (greedy, shared system prompt, n=3 sampled, a
    width-3 beam; all at once in 23 blocks) through `ServingEngine` on a 2-device "tp" mesh (KV
    heads sharded, state replicated; run by the "invariant" worker): the same preemptions and the
    same tokens as on one device."""
    res = _ok(workers["invariant"])[0]["serving"]
    assert res["devices"] == 2 and "tp" in res["spec"]
    one, two = res["tp1"], res["tp2"]
    assert one["preemptions"] >= 2  # the workload really preempts
    assert two["preemptions"] == one["preemptions"]
    assert sorted(two["tokens"]) == sorted(one["tokens"]) and len(one["tokens"]) == 7
    for rid, tokens in one["tokens"].items():
        assert two["tokens"][rid] == tokens, rid


def test_protocol_model_attend_options_on_a_mesh(workers: dict) -> None:
    """A protocol model with its own partition_specs and ALiBi slopes on a 2-device "tp" mesh
    (slopes split with the query heads inside attend; run by the "quant" worker): the same
    greedy tokens as its contiguous decoding on one device."""
    res = _ok(workers["quant"])[0]["protocol"]
    assert res["devices"] == 2 and "tp" in res["spec"]
    want, _ = greedy_generate_contiguous(KnobModel(True), KNOB_PROMPTS, 6, chunk_size=8, max_len=16)
    assert res["tokens"] == want.tolist()


def test_int8_pages_tp1_equals_tp2(workers: dict) -> None:
    """int8 KV pages over a tp=2 mesh: the scales are sharded on the KV-head axis with their values
    (one KV head per device: scale shards [layers, 2, 1, blocks, block_size]), and greedy n=2
    (copy-on-write through `copy_blocks` under `shard_map`) and beam search give tp=1's tokens."""
    res = _ok(workers["quant"])[0]
    one, two = res["tp1"], res["tp2"]
    assert all(spec.startswith("(None, None, 'tp'") for spec in two["specs"]), two["specs"]  # values, scales
    assert all(shape[2] == 1 for shape in two["scale_shards"]) and len(two["scale_shards"]) == 2
    assert sum(one["copies"]) > 0 and sum(two["copies"]) > 0  # copy-on-write happened
    assert two["greedy"] == one["greedy"] and two["beam"] == one["beam"]
