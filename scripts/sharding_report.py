"""Tensor-parallel figures: per-device bytes and collective traffic of the compiled decode step, and
the KV capacity per device.

For tensor-parallel degrees 1, 2 and 4 (simulated CPU devices; the program is compiled, never
run, so Llama 3.1 8B shapes cost no memory) the script lowers `paged_kv.models.paged.paged_decode_step`
with the weights and pages placed as `paged_kv.models.sharding` places them and reads from the compiled
HLO every collective (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute)
with its result bytes. The textbook expectation for Megatron-style tensor parallelism is two
all-reduces of the hidden state `[B, d]` per layer (after the attention output projection and
after the MLP down projection); the vocab-parallel output head leaves the logits sharded.
On the CPU, XLA computes bfloat16 matmuls in float32, so the partial sums it all-reduces are
float32 (twice the bytes of the textbook bfloat16 figure) and its temporary memory holds float32
copies of the weights; a GPU keeps both in bfloat16.

Then `paged_kv.models.sharding.kv_capacity` for Llama 3.1 8B in bfloat16 on one 80 GB and one 141 GB
GPU at degrees 1, 2, 4, 8 (90% of the memory as the budget, 16-token blocks).

    python scripts/sharding_report.py [--batch 8] [--out results/sharding_report.json] [--skip-8b]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from paged_kv.models import LlamaConfig, abstract_model, llama31_8b, page_spec, sharding
from paged_kv.models.hf_format import read_hf_config
from paged_kv.models.paged import PagedBatch, paged_decode_step
from scripts.run_record import record, utc_now

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(?P<shape>\(?[^=]*?\)?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8}


def collectives(hlo: str) -> list[dict]:
    """Every collective of an optimised HLO module: op and result bytes (async pairs counted once,
    at their -start)."""
    out = []
    for line in hlo.splitlines():
        m = _OP.search(line)
        if not m or "-done" in line.split("=", 1)[-1].split("(", 1)[0]:
            continue
        arrays = _ARRAY.findall(m.group("shape"))
        nbytes = sum(_ITEMSIZE[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in arrays)
        shapes = [f"{t}[{dims}]" for t, dims in arrays]
        out.append({"op": m.group("op"), "bytes": nbytes, "shapes": shapes})
    return out


def abstract_inputs(config: LlamaConfig, tp: int, batch: int, num_blocks: int, block_size: int, blocks_per_seq: int):
    """ShapeDtypeStructs of (graphdef, weights, pages, batch, tokens) placed as `sharding.shard`
    would place them at degree `tp` (single device for tp == 1)."""
    mesh = sharding.make_mesh(tp) if tp > 1 else None
    placed = config.replace(num_kv_heads=sharding.kv_heads_for(config, tp))
    graphdef, weights = nnx.split(abstract_model(placed))
    spec = page_spec(placed, num_blocks, block_size)

    def sds(shape, dtype, pspec=P()):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=None if mesh is None else NamedSharding(mesh, pspec))

    if mesh is not None:
        specs = sharding.weight_specs(weights, placed, tp)
        weights = jax.tree.map(lambda x, s: sds(x.shape, x.dtype, s), weights, specs)
    i32 = jnp.int32
    meta = PagedBatch(block_tables=sds((batch, blocks_per_seq), i32), q_start=sds((batch,), i32),
                      q_lens=sds((batch,), i32), slots=sds((batch, 1), i32), lengths=sds((batch,), i32))
    pages = sds(spec.shape, jnp.dtype(spec.dtype), sharding.PAGE_SPEC)
    return mesh, placed, graphdef, weights, pages, meta, sds((batch,), i32), spec


def decode_report(name: str, config: LlamaConfig, tp: int, *, batch: int, num_blocks: int, block_size: int,
                  blocks_per_seq: int) -> dict:
    mesh, placed, graphdef, weights, pages, meta, tokens, spec = abstract_inputs(
        config, tp, batch, num_blocks, block_size, blocks_per_seq)
    t0 = time.perf_counter()
    compiled = paged_decode_step.lower(graphdef, weights, pages, meta, tokens, impl="reference", mesh=mesh).compile()
    seconds = time.perf_counter() - t0
    coll = collectives(compiled.as_text())
    mem = compiled.memory_analysis()
    itemsize = jnp.dtype(config.dtype).itemsize
    layers, d = config.num_layers, config.hidden_size
    # Megatron: the attention output projection and the MLP down projection are row-parallel, so
    # each ends in an all-reduce of the hidden state [B, 1, d]. The vocab-parallel head needs no
    # collective inside the step: its logits leave the step sharded over the vocabulary (the
    # sampler of a loop gathers them).
    expected = [] if tp == 1 else [{"op": "all-reduce", "shape": [batch, 1, d], "bytes": batch * d * itemsize,
                                    "count": 2 * layers}]
    logits_sharding = compiled.output_shardings[0]
    by_op: dict[str, dict] = {}
    for c in coll:
        e = by_op.setdefault(c["op"], {"count": 0, "bytes": 0, "shapes": {}})
        e["count"] += 1
        e["bytes"] += c["bytes"]
        key = ",".join(c["shapes"])
        e["shapes"][key] = e["shapes"].get(key, 0) + 1
    return {
        "model": name, "tp": tp, "batch": batch, "num_blocks": num_blocks, "block_size": block_size,
        "kv_heads_placed": placed.num_kv_heads, "compile_seconds": round(seconds, 2),
        "weights_bytes_per_device": sharding.weight_bytes_per_device(config, tp),
        "kv_pages_bytes_per_device": spec.total_bytes // tp,
        "kv_bytes_per_block_per_device": spec.bytes_per_block // tp,
        "xla_argument_bytes_per_device": getattr(mem, "argument_size_in_bytes", None),
        "xla_temp_bytes_per_device": getattr(mem, "temp_size_in_bytes", None),
        "collectives": by_op,
        "collective_bytes_per_step": sum(c["bytes"] for c in coll),
        "expected": expected,
        "expected_bytes_per_step": sum(e["bytes"] * e["count"] for e in expected),
        "logits_spec": str(getattr(logits_sharding, "spec", "single device")),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default="results/sharding_report.json")
    ap.add_argument("--skip-8b", action="store_true", help="only the built-in tiny model")
    args = ap.parse_args(argv)
    started = utc_now()
    if jax.device_count() < 4:
        raise SystemExit(f"need 4 devices, have {jax.device_count()} (XLA_FLAGS={os.environ.get('XLA_FLAGS')})")

    models = [("tiny-llama", LlamaConfig.from_hf_config(read_hf_config("checkpoints/tiny-llama")), 512)]
    if not args.skip_8b:
        models.append(("llama-3.1-8b", llama31_8b(), 1024))
    rows = []
    for name, cfg, blocks in models:
        for tp in (1, 2, 4):
            r = decode_report(name, cfg, tp, batch=args.batch, num_blocks=blocks, block_size=16, blocks_per_seq=32)
            rows.append(r)
            print(f"{name:13s} tp={tp} weights/dev {r['weights_bytes_per_device'] / 2**20:9.2f} MiB  "
                  f"KV/dev {r['kv_pages_bytes_per_device'] / 2**20:9.2f} MiB  collectives "
                  f"{ {k: v['count'] for k, v in r['collectives'].items()} } "
                  f"{r['collective_bytes_per_step']} B/step (expected {r['expected_bytes_per_step']} B)  "
                  f"compile {r['compile_seconds']} s", flush=True)

    capacity = []
    cfg = llama31_8b()
    for gb in (80, 141):
        for tp in (1, 2, 4, 8):
            c = sharding.kv_capacity(cfg, gb * 10**9, tp)
            capacity.append({"device_gb": gb, **{k: getattr(c, k) for k in c.__dataclass_fields__}})
            print(f"llama-3.1-8b bf16 {gb:3d} GB tp={tp}: weights/dev {c.weight_bytes / 1e9:6.2f} GB, "
                  f"KV {c.kv_bytes_per_token // 1024} KiB/token/dev, {c.num_blocks:7d} blocks, {c.tokens:9d} tokens",
                  flush=True)
    note = (f"decode step of batch B={args.batch} (one token per sequence), compiled for simulated CPU devices; "
            "collective bytes are result sizes per step; on the CPU bfloat16 matmuls run in float32, so their "
            "all-reduces carry float32 (2x the bfloat16 expectation)")
    out = {"run": record(__file__, args, argv, started=started), "note": note, "jax": jax.__version__,
           "backend": jax.default_backend(), "devices": jax.device_count(),
           "memory_fraction": 0.9, "decode_step": rows, "kv_capacity": capacity}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
