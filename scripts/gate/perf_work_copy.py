"""The performance model (:mod:`scripts.gate.perf_model`) applied to ``copy_blocks``, against
XLA's own device copy of the same bytes.

``copy_blocks`` moves whole KV blocks; a plain device copy of the same number of bytes is what
it can at best hope to match. Both are rated the same way: each is compiled deviceless (XLA's
sm_90a / sm_80 pipeline, ptxas), its grid, threads, registers and shared memory read from the
thunk sequence and the ``ptxas`` report, its main-loop pipeline from its PTX
(:func:`perf_model.pipeline`), and :func:`perf_model.estimate` turns them and the kernel's
:class:`perf_model.Work` into an estimated time. Every figure is an estimate under the
assumptions of :class:`perf_model.Gpu`, not a measurement.

The baseline is XLA's in-place ``dynamic_update_slice`` of ``n`` elements into a donated buffer
twice as long: a loop fusion that reads ``n`` elements and writes them, one element group per
thread, no loop. (``x * 1`` or ``x.copy()`` would not do: XLA turns them into a ``kCopy``
memcpy thunk, which has no PTX to read; :func:`plain_copy_estimate` checks that it got a
kernel.)

Run with the CUDA venv (``$GE/bin/python -m scripts.gate.perf_work_copy [--json OUT]``): prints
the before/after table at Llama 3.1 8B pages (all 32 layers per call) and Llama 3.2 1B
per-layer pages (one layer per call), 1, 16 and 256 copied blocks, bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from scripts import checkout_layout
from scripts.gate import gpu_report, perf_model  # plain Python: no JAX import

# paged_kv.pallas_kernels in the gate's CUDA venv, which does not install this checkout.
checkout_layout.install()

TARGET_OF = {id(g): t for t, g in perf_model.GPUS.items()}

# (name, num_layers per call, kv heads, block size, head dim): the pages of one copy_blocks call.
SHAPES = {
    "llama31_8b": (32, 8, 16, 128),
    "llama32_1b_per_layer": (1, 8, 16, 64),
}
COPIES = (1, 16, 256)
NUM_BLOCKS = 4096  # pages' block count (the kernel's code and the work do not depend on it)


def old_plan(rows: int) -> tuple[int, int]:
  """``(slab_rows, head_rows)`` of the kernel before the slab loads: one ``[block_size,
  head_dim]`` tile per step, ``gcd(rows, 16)`` rows per program whatever the copy count."""
  return 1, math.gcd(rows, 16)


def copy_work(num_copies: int, rows: int, block_size: int, head_dim: int, itemsize: int, *,
              head_rows: int | None = None, slab_rows: int | None = None) -> perf_model.Work:
  """What ``copy_blocks`` must do to copy ``num_copies`` blocks of ``rows`` tiles of
  ``[block_size, head_dim]`` elements of ``itemsize`` bytes.

  ``bytes`` is read plus write (``2 x copies x block bytes``), half of it reads
  (``read_fraction``: the stores are posted, only the loads wait on a round trip);
  ``step_bytes`` the slab one program loads per step (all of it in flight together); ``steps``
  the program's serial steps (a step's store must issue before the next step's load: the kernel
  reads and writes one aliased buffer, so the compiler cannot hoist a load above an earlier
  store). ``head_rows`` and ``slab_rows`` as the kernel resolves them
  (:func:`paged_kv.pallas_kernels.block_copy.resolve_plan`: its own plan by default)."""
  if "jax" not in sys.modules:
    _gc()  # the kernel module loads JAX: set XLA's flags first, as any later compile needs
  from paged_kv.pallas_kernels.block_copy import resolve_plan
  slab_rows, head_rows = resolve_plan(num_copies, rows, block_size, head_dim, itemsize, head_rows, slab_rows)
  tile = block_size * head_dim * itemsize
  return perf_model.Work(bytes=2 * num_copies * rows * tile, flops=0, step_bytes=slab_rows * tile,
                         steps=head_rows // slab_rows, read_fraction=0.5)


def _gc():
  """``scripts.gate.gpu_compile``, imported on first use: it sets XLA's flags (a deviceless CPU
  client, ptxas's report in the log), which must happen before JAX loads, and only the compiling
  functions need it, so :func:`copy_work` stays importable anywhere (the CPU tests)."""
  from scripts.gate import gpu_compile
  return gpu_compile


def _compile_facts(fn, args, donate, target: str, kernel: str | None) -> dict:
  """Compiles ``fn`` deviceless for ``target``; the compile facts of its one kernel (``kernel``
  by name, or the only kernel thunk) with its :class:`perf_model.Pipeline` and the thunk kinds.

  Raises:
    RuntimeError: if the compile fails, or the program has no kernel thunk (e.g. a ``kCopy``).
  """
  gc = _gc()
  import jax

  from paged_kv.pallas_kernels.jax_compat import cuda_lowering

  with cuda_lowering(gc.TARGETS[target]["name"]):
    lowered = jax.jit(fn, donate_argnums=donate).trace(*args).lower()
  work_dir = tempfile.mkdtemp(prefix="perf_work_copy_")
  try:
    res = gc._compile(lowered, work_dir, keep=False)
  finally:
    shutil.rmtree(work_dir, ignore_errors=True)
  if res.get("status") != "compiled":
    raise RuntimeError(f"compile failed: {res.get('error')}")
  thunks = [(t["kind"], t.get("name")) for t, _, _ in gpu_report.walk(res["_thunks"])]
  kernels = res["kernels"]
  if kernel is None:
    if len(kernels) != 1:
      raise RuntimeError(f"expected one kernel thunk, got {thunks}")
    kernel = next(iter(kernels))
  if kernel not in kernels:
    raise RuntimeError(f"no kernel {kernel!r} among the thunks {thunks}")
  k = kernels[kernel]
  return {"kernel": kernel, "thunks": thunks, "ctas": math.prod(k["grid"]), "grid": k["grid"],
          "threads": math.prod(k["threads"]), "registers": k["registers"],
          "spill_bytes": (k["spill_store_bytes"] or 0) + (k["spill_load_bytes"] or 0),
          "shared_memory_bytes": k["shared_memory_bytes"] or 0,
          "pipeline": perf_model.Pipeline(**k["pipeline"])}


def _estimate(gpu: perf_model.Gpu, facts: dict, work: perf_model.Work) -> perf_model.Estimate:
  return perf_model.estimate(gpu, facts["ctas"], facts["threads"], facts["registers"],
                             facts["shared_memory_bytes"], facts["pipeline"], work, None)


def _mesh_sharding(target: str):
  from jax.sharding import NamedSharding, PartitionSpec
  _, mesh = _gc()._topology(target)
  return NamedSharding(mesh, PartitionSpec())


def plain_copy_estimate(nbytes: int, gpu: perf_model.Gpu, dtype: str = "bfloat16") -> tuple[perf_model.Estimate, dict]:
  """The model's estimate of XLA's own device copy of ``nbytes`` bytes of ``dtype`` on ``gpu``
  (an in-place ``dynamic_update_slice`` into a donated buffer, compiled deviceless), and its
  compile facts.

  The work is ``2 x nbytes`` (read and write, half of it reads), one step per CTA (the fusion has no loop: checked),
  ``nbytes / CTAs`` loaded per CTA in that step.

  Raises:
    RuntimeError: when XLA emits something other than one loop-free kernel (a ``kCopy`` thunk
      has no PTX to rate).
  """
  _gc()  # before JAX loads
  import jax
  import jax.numpy as jnp
  from jax import lax

  target = TARGET_OF[id(gpu)]
  sh = _mesh_sharding(target)
  dt = jnp.dtype(dtype)
  n = nbytes // dt.itemsize
  args = (jax.ShapeDtypeStruct((2 * n,), dt, sharding=sh), jax.ShapeDtypeStruct((n,), dt, sharding=sh),
          jax.ShapeDtypeStruct((), jnp.int32, sharding=sh))
  facts = _compile_facts(lambda buf, x, at: lax.dynamic_update_slice(buf, x, (at,)), args, (0,), target, None)
  if facts["pipeline"].loop:
    raise RuntimeError(f"XLA's copy kernel {facts['kernel']} loops; its steps are not modelled here")
  work = perf_model.Work(bytes=2 * n * dt.itemsize, flops=0, step_bytes=-(-n * dt.itemsize // facts["ctas"]),
                         steps=1, read_fraction=0.5)
  return _estimate(gpu, facts, work), facts


def kernel_estimate(num_copies: int, num_layers: int, kv_heads: int, block_size: int, head_dim: int,
                    gpu: perf_model.Gpu, dtype: str = "bfloat16", *, head_rows: int | None = None,
                    slab_rows: int | None = None) -> tuple[perf_model.Estimate, dict]:
  """The model's estimate of one ``copy_blocks`` launch (pages ``[num_layers, 2, kv_heads,
  NUM_BLOCKS, block_size, head_dim]`` of ``dtype``, a copy list of ``num_copies``), compiled
  deviceless for ``gpu``, and its compile facts. ``head_rows`` / ``slab_rows`` as
  :func:`paged_kv.pallas_kernels.block_copy.copy_blocks_pallas` (default: its plan)."""
  _gc()  # before JAX loads
  import jax
  import jax.numpy as jnp

  from paged_kv.pallas_kernels.block_copy import copy_blocks_pallas

  target = TARGET_OF[id(gpu)]
  sh = _mesh_sharding(target)
  dt = jnp.dtype(dtype)
  pages = jax.ShapeDtypeStruct((num_layers, 2, kv_heads, NUM_BLOCKS, block_size, head_dim), dt, sharding=sh)
  lst = jax.ShapeDtypeStruct((num_copies,), jnp.int32, sharding=sh)
  facts = _compile_facts(
      lambda p, s, d: copy_blocks_pallas(p, s, d, head_rows=head_rows, slab_rows=slab_rows),
      (pages, lst, lst), (0,), target, "copy_blocks")
  rows = num_layers * 2 * kv_heads
  work = copy_work(num_copies, rows, block_size, head_dim, dt.itemsize, head_rows=head_rows, slab_rows=slab_rows)
  expected_ctas = num_copies * rows // (work.steps * work.step_bytes // (block_size * head_dim * dt.itemsize))
  if facts["ctas"] != expected_ctas:
    raise RuntimeError(f"copy_blocks launched {facts['ctas']} CTAs, the work assumes {expected_ctas}")
  return _estimate(gpu, facts, work), facts


def _row(est: perf_model.Estimate, facts: dict) -> dict:
  return {"low_us": round(est.low_s * 1e6, 3), "high_us": round(est.high_s * 1e6, 3),
          "fraction": [round(f, 3) for f in est.fraction], "ctas": est.ctas, "resident": est.resident,
          "stages": est.stages, "inflight_per_sm": round(est.inflight_per_sm), "bound": est.bound,
          "registers": facts["registers"], "spill_bytes": facts["spill_bytes"],
          "shared_memory_bytes": facts["shared_memory_bytes"], "grid": facts["grid"],
          "rule_violations": perf_model.rule_violations(est)}


def table(targets=("sm_90", "sm_80"), dtype: str = "bfloat16") -> list[dict]:
  """Before (one tile per step, ``gcd(rows, 16)`` rows per program) and after (the plan), with
  the plain-copy baseline, at every shape of :data:`SHAPES` x :data:`COPIES` and target."""
  import jax.numpy as jnp
  itemsize = jnp.dtype(dtype).itemsize
  out = []
  for target in targets:
    gpu = perf_model.GPUS[target]
    for name, (layers, heads, bs, hd) in SHAPES.items():
      rows = layers * 2 * heads
      for copies in COPIES:
        nbytes = copies * rows * bs * hd * itemsize
        base, base_facts = plain_copy_estimate(nbytes, gpu, dtype)
        slab0, head0 = old_plan(rows)
        rec = {"target": target, "model": name, "copies": copies, "copy_bytes": nbytes,
               "baseline": {**_row(base, base_facts), "kernel": base_facts["kernel"]}}
        for label, kw in (("before", {"head_rows": head0, "slab_rows": slab0}), ("after", {})):
          est, facts = kernel_estimate(copies, layers, heads, bs, hd, gpu, dtype, **kw)
          row = _row(est, facts)
          # Against the baseline: its time over ours, at each end of the latency range.
          row["vs_plain_copy"] = [round(base.low_s / est.low_s, 3), round(base.high_s / est.high_s, 3)]
          w = copy_work(copies, rows, bs, hd, itemsize, **kw)
          row["slab_rows"], row["steps"] = w.step_bytes // (bs * hd * itemsize), w.steps
          rec[label] = row
        out.append(rec)
  return out


def markdown(rows: list[dict]) -> str:
  """The table as Markdown (one line per target, model and copy count)."""
  head = ("| target | pages | copies | plain copy us (frac) | before us (frac, vs plain) | after us (frac, vs plain) "
          "| after CTAs x steps, slab | in flight/SM | regs | spills |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    b, o, a = r["baseline"], r["before"], r["after"]

    def t(x):
      return f"{x['low_us']}-{x['high_us']} ({x['fraction'][0]:.0%}-{x['fraction'][1]:.0%})"

    def v(x):
      return f"{t(x)}, {x['vs_plain_copy'][1]:.0%}-{x['vs_plain_copy'][0]:.0%}"
    lines.append(f"| {r['target']} | {r['model']} | {r['copies']} | {t(b)} | {v(o)} | {v(a)} | "
                 f"{a['ctas']} x {a['steps']}, {a['slab_rows']} | {a['inflight_per_sm']:,} | "
                 f"{o['registers']} -> {a['registers']} | {a['spill_bytes']} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  _gc()  # before JAX loads
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--json", help="write the rows here too")
  ap.add_argument("--targets", default="sm_90,sm_80")
  args = ap.parse_args(argv)
  rows = table(tuple(args.targets.split(",")))
  print(markdown(rows))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
