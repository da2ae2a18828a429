"""Compile time of the paged decode step against model depth, and the step's run time.

For each depth in `--layers` the decode step (`paged_kv.models.paged_decode_step`, the `bench_model.py`
width: d=256, F=768, 8 query / 2 KV heads, vocab 2048, float32) is lowered and compiled from
abstract shapes (`abstract_model`: no weights allocated), timing tracing + lowering and XLA's
compile separately, in a fresh jit cache each time (`jax.clear_caches`). For each depth in
`--step-layers` the compiled step then runs on real weights: the median of `--repeats` calls.

Only the public API is used, so the same script measures another checkout of the project:

    python scripts/compile_time.py --label after
    PYTHONPATH=/tmp/base17 python scripts/compile_time.py --label before   # main's code

Results are merged into `--out` (default results/compile_time.json) under the label, with the
load average at start and end (the machine is shared: compare runs made back to back); each
label keeps the record of the run that wrote it (`run`), and the file says that its labels come
from separate runs.
`--isolate` compiles each depth in a fresh process, so no depth profits from caches the one
before it warmed (Triton's kernels, XLA's autotuning): the figure a user's first run sees.

`--target sm_90` (or sm_80) compiles the same step for an NVIDIA GPU without one, with the Pallas
kernels (`impl="pallas"`): deviceless, on the compile-only topology of the GPU compile gate
(`scripts/gate/gpu_compile_plan.py`'s target description), so it runs in the gate's CUDA environment
(`~/.cache/paged-kv/gpu-env-<hash>`, built by `scripts/gpu_gate.sh`) and runs no step:

    PYTHONPATH=$PWD ~/.cache/paged-kv/gpu-env-<hash>/bin/python scripts/compile_time.py \
        --label sm_90_after --target sm_90 --step-layers
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _target_from_argv(argv) -> str | None:
    for i, a in enumerate(argv):
        if a == "--target" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--target="):
            return a.split("=", 1)[1]
    return None


TARGET = _target_from_argv(sys.argv[1:])
if TARGET not in (None, "cpu"):
    # Before jax is imported: no CUDA backend is started (there is no driver); the CUDA plugin
    # still gives a compile-only topology for the target.
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

if "PYTHONPATH" not in os.environ:  # measure this checkout unless told otherwise
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paged_kv.models
from paged_kv.models import (
    LlamaConfig,
    allocate_pages,
    init_model,
    layout_for_impl,
    make_paged_batch,
    page_spec,
    paged_decode_step,
)
from paged_kv.models.llama import abstract_model

# This checkout's run record, by path: PYTHONPATH may point at another checkout's `scripts`.
_spec = importlib.util.spec_from_file_location("run_record", Path(__file__).resolve().parent / "run_record.py")
run_record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_record)

BATCH, CONTEXT, BLOCK = 8, 256, 16


def config(num_layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=num_layers, num_heads=8,
                       num_kv_heads=2, max_position_embeddings=4096, dtype="float32")


def inputs(cfg: LlamaConfig):
    """(pages, batch metadata, tokens) of a decode step: BATCH sequences at CONTEXT tokens, each in
    its own scrambled blocks."""
    rs = np.random.RandomState(0)
    per_seq = -(-CONTEXT // BLOCK)
    tables = rs.permutation(np.arange(1, 1 + BATCH * per_seq)).reshape(BATCH, per_seq).astype(np.int32)
    pages = allocate_pages(page_spec(cfg, 1 + BATCH * per_seq, BLOCK))
    meta = make_paged_batch(tables, np.full(BATCH, CONTEXT - 1, np.int32), np.ones(BATCH, np.int32), 1, BLOCK)
    tokens = jnp.asarray(rs.randint(0, cfg.vocab_size, BATCH), jnp.int32)
    return pages, meta, tokens


def gpu_sharding(target: str):
    """A replicated sharding on the one device of a compile-only CUDA topology for `target`."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from scripts.gate.gpu_compile_plan import target_config
    topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=target_config(target))
    if topo.devices[0].client.runtime_type != "compile_only_runtime":
        raise RuntimeError(f"expected a compile-only client, got {topo.devices[0].client.runtime_type}")
    return NamedSharding(topologies.make_mesh(topo, (1,), ("x",)), PartitionSpec())


def compile_seconds(num_layers: int, target: str | None = None) -> dict:
    jax.clear_caches()
    cfg = config(num_layers)
    pages, meta, tokens = inputs(cfg)
    impl = "reference" if target in (None, "cpu") else "pallas"
    # The layer layout the engines give this impl (paged_kv.models.layer_layout.layout_for_impl): stacked for the
    # scan on the reference kernels, one array per layer for the unrolled Pallas path.
    graphdef, state = nnx.split(layout_for_impl(abstract_model(cfg), impl))
    if target in (None, "cpu"):
        pages = jax.ShapeDtypeStruct(pages.shape, pages.dtype)
    else:  # every argument abstract, on the GPU topology
        sharding = gpu_sharding(target)
        pages, meta, tokens, state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), (pages, meta, tokens, state))
    c0, t0 = cpu_seconds(), time.perf_counter()
    lowered = paged_decode_step.lower(graphdef, state, pages, meta, tokens, impl=impl)
    t1 = time.perf_counter()
    lowered.compile()
    t2, c2 = time.perf_counter(), cpu_seconds()
    return {"layers": num_layers, "impl": impl, "lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0,
            "total_cpu_s": c2 - c0}


def isolated_compile_seconds(num_layers: int, args) -> dict:
    """`compile_seconds` of one depth in a fresh Python process running this script (same
    PYTHONPATH, so the same checkout): XLA's and Triton's in-process caches then start empty for
    every depth, as in a user's first run, instead of favouring the depths measured later."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        cmd = [sys.executable, __file__, "--label", "one", "--layers", str(num_layers), "--step-layers",
               "--out", str(out)] + (["--target", args.target] if args.target else [])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        (entry,) = json.loads(out.read_text())["one"]["compile"]
    return dict(entry, isolated=True)


def cpu_seconds() -> float:
    """CPU time of this process (all threads) and of its finished children (ptxas), user and
    system: on a shared machine, and under `nice`, the wall time also counts the time the compile
    waited for a core; this does not."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def step_ms(num_layers: int, repeats: int) -> dict:
    jax.clear_caches()
    cfg = config(num_layers)
    graphdef, state = nnx.split(init_model(cfg, seed=0))
    pages, meta, tokens = inputs(cfg)
    box = {"pages": pages}

    def step():
        logits, box["pages"] = paged_decode_step(graphdef, state, box["pages"], meta, tokens, impl="reference")
        logits.block_until_ready()

    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"layers": num_layers, "step_ms": 1e3 * statistics.median(times), "repeats": repeats}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True, help="key in the JSON, e.g. before / after")
    ap.add_argument("--layers", type=int, nargs="*", default=[4, 16, 32, 80])
    ap.add_argument("--step-layers", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--target", default=None, choices=("cpu", "sm_90", "sm_80"),
                    help="compile for this GPU target without a GPU (Pallas kernels; the gate's CUDA environment)")
    ap.add_argument("--isolate", action="store_true",
                    help="compile each depth in a fresh process (no compiler cache shared between depths, "
                         "as a user's first run)")
    ap.add_argument("--commit", help="commit of the measured source when it is no git checkout (an archive)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "compile_time.json"))
    args = ap.parse_args(argv)
    started = run_record.utc_now()

    load_start = load()
    compiles = []
    for n in args.layers:
        compiles.append(isolated_compile_seconds(n, args) if args.isolate else compile_seconds(n, args.target))
        print(f"{n:3d} layers: lower {compiles[-1]['lower_s']:.2f} s, compile {compiles[-1]['compile_s']:.2f} s "
              f"(CPU {compiles[-1]['total_cpu_s']:.2f} s)", flush=True)
    steps = []
    for n in args.step_layers:
        steps.append(step_ms(n, args.repeats))
        print(f"{n:3d} layers: decode step {steps[-1]['step_ms']:.2f} ms (median of {args.repeats})", flush=True)
    src = Path(paged_kv.models.__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
    except OSError:
        commit = None
    commit = args.commit or commit
    entry = {"source": str(src), "commit": commit, "jax": jax.__version__,
             "backend": jax.default_backend() if args.target in (None, "cpu") else f"cuda {args.target} (deviceless)",
             "cpu_count": os.cpu_count(), "machine": platform.machine(), "batch": BATCH, "context": CONTEXT,
             "block_size": BLOCK, "load_avg_start": load_start, "load_avg_end": load(), "compile": compiles,
             "step": steps}
    by = {c["layers"]: c["total_s"] for c in compiles}
    if 4 in by and 32 in by:
        entry["compile_32_over_4"] = by[32] / by[4]
        cpu = {c["layers"]: c["total_cpu_s"] for c in compiles}
        entry["compile_cpu_32_over_4"] = cpu[32] / cpu[4]
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.exists() else None
    # One label per run; a run with no depths for a part keeps that part from the label's earlier run.
    prev = (old or {}).get(args.label, {})
    kept = [k for k in ("compile", "step") if not entry[k] and prev.get(k)]
    entry.update({k: prev[k] for k in kept})
    if kept:
        entry["from_an_earlier_run"] = {"parts": kept, "run": prev.get("run")}
    labels = [(k,) for k in old or {}]
    data = run_record.merge_parts(old, {args.label: entry}, [(args.label,)], labels,
                                  run_record.record(__file__, args, argv, started=started))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out} [{args.label}]")


if __name__ == "__main__":
    main()
