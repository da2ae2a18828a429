"""GPU compile gate: compiles every Pallas kernel configuration and the engine's jitted programs
for NVIDIA GPUs on a machine without one, and fails on any compile error or register spill.

How: deviceless ahead-of-time compilation. ``JAX_PLATFORMS=cpu`` keeps JAX from starting the
CUDA backend (there is no driver), the CUDA plugin still provides a compile-only topology built
from a ``GpuTargetConfig`` text proto (``TARGETS`` below: compute capability, shared memory,
registers, SMs, bandwidth), and ``jax.jit(f).lower(<ShapeDtypeStructs on that topology>)
.compile()`` runs XLA:GPU's real pipeline: Triton IR -> LLVM -> PTX -> ``ptxas``. What is read
back (``scripts/gate/gpu_report.py``): ptxas's register and spill report from XLA's log
(``TF_CPP_VMODULE=subprocess_compilation=2``), the launches from the thunk sequence
(``--xla_dump_to``), the MMA instructions from the PTX, ``compiled.memory_analysis()``.

What is compiled:

* kernels, sm_90 (H100/H200): decode, prefill, write_kv, copy_blocks x dtype (bf16, fp16, fp32)
  x head_dim (64, 128, 256) x block size (8, 16, 32) x GQA group (1, 4, 8) x a small and a large
  batch/context. Every configuration is lowered; configurations whose Triton kernel is the
  same (identical Triton IR and launch parameters, only the grid differs) are compiled once: the
  report lists which configurations each compilation stands for. That drops, provably, the
  axes that do not change a kernel's code (GQA for write_kv/copy_blocks, whose programs never see
  query heads; GQA 1/4/8 for decode, whose group is padded to 16 rows either way).
* the tiling table (``pallas_kernels/tiling.py``): every row at its largest accepted block
  size, for sm_90 and sm_80, and the check that the next block size is refused.
* the attention knobs (``soft_cap``, ``alibi_slopes``, both; a sliding ``window``, alone and with
  ``soft_cap``): decode and prefill on every tiling
  row at head_dim 64/128/256, at the row's smallest block, block size 16 and its largest block
  (decode at its largest group), for sm_90 and sm_80, each with the row the knob selects, and that
  row's refusals.
* sm_80 (A100): dtype x head_dim for every kernel at block size 16, GQA 4, large size.
* ``layer_matmul`` (the scan's stacked-weight projection): Llama 3.1 8B's four projection shapes
  x dtype x rows (1, 64, 512) for sm_90, with the norm-weight prologue and the bias epilogue;
  bfloat16 at 64 rows for sm_80; the refusal of K = 4100 (not a multiple of 16).
* the execution plan (``pallas_kernels/plan.py``; ``gpu_compile_plan.plan_combinations``): every
  combination of target, KV dtype, batch-invariant mode and attention kind it accepts has
  configurations of the kernel family it names, and every one it refuses one configuration that
  must be refused before tracing (``quant_refusal``, ``plan_refusal``).
* whole programs at Llama 3.1 8B shapes in bfloat16 for sm_90: ``engine.generate``'s loop,
  ``beam_search``'s loop, the serving step without and with a prefill chunk, the serving
  engine's ``admit`` and ``free`` programs and the block manager's ``append``, and the serving
  step of one tensor-parallel slice (tp=2 on a two-GPU topology).

Usage (inside the CUDA environment ``scripts/gpu_gate.sh`` builds; the test environment stays
CPU-only)::

    python scripts/gate/gpu_compile.py [--workers 2] [--out results/gpu_compile_report.json]
        [--summary PATH] [--only kernels|programs] [--quick] [--keep-dumps DIR]
        [--knobs window soft_cap+window]  # only those knobs' configurations

The full report (every configuration with every fusion's figures, megabytes) goes to ``--out``
(git ignores ``results/gpu_compile_report.json``); its summary (``gpu_report.summarize``: per kernel
group and per program, what docs/gpu-gate.md's tables show) beside it, ``gpu_compile_summary.json``.
``results/gpu_compile_summary.json`` is committed, and ``python scripts/gate/gpu_report.py
--update-docs`` rewrites docs/gpu-gate.md's tables from it.

Exit status 0 when everything the input checks accept compiled without spills and every refusal
the tiling table and the execution plan promise happened; 1 otherwise (the failures are printed and in the report).
"""

from __future__ import annotations

import functools
import os

# Before jax is imported (here and in the spawned workers, which import this module).
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
os.environ["TF_CPP_VMODULE"] = "subprocess_compilation=2"

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import multiprocessing
import re
import shutil
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from scripts import checkout_layout

checkout_layout.install()

from paged_kv.pallas_kernels.jax_compat import cuda_lowering, gate_compile_options
from scripts.gate import gpu_report, perf_model, perf_plan
from scripts.gate.gpu_compile_plan import (
  H200_BANDWIDTH,
  KNOBS,
  KV_HEADS,
  MATMUL_LAYERS,
  PROGRAMS,
  SIZES,
  TARGETS,
  judge,
  kernel_groups,
  target_config,
  triton_key,
  xla_fusion_spills,
)

# ------------------------------------------------------------------------------ worker side
_TOPOLOGIES: dict = {}


def _topology(target: str, devices: int = 1):
  """(topology, mesh of all its devices on axis "x") for a target, built once per process."""
  key = (target, devices)
  if key not in _TOPOLOGIES:
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{devices}",
                                        target_config=target_config(target))
    if topo.devices[0].client.runtime_type != "compile_only_runtime":
      raise RuntimeError(f"expected a compile-only client, got {topo.devices[0].client.runtime_type}")
    mesh = topologies.make_mesh(topo, (devices,), ("x",))
    _TOPOLOGIES[key] = (topo, mesh)
  return _TOPOLOGIES[key]


@contextlib.contextmanager
def _stderr_to(path: str):
  """Sends file descriptor 2 (XLA's C++ log, with ptxas's report) to ``path``."""
  sys.stderr.flush()
  saved = os.dup(2)
  with open(path, "wb") as f:
    os.dup2(f.fileno(), 2)
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(saved, 2)
    os.close(saved)


CACHE_DIR = os.environ.get("PAGED_KV_GATE_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "paged-kv", "gpu-gate-results")
_USE_CACHE = True
_DEVICELESS_LOGGED = False  # whether XLA said, in this process, that it compiles without a device


# A stored result's fields: a new field (the PTX pipeline facts) must not reuse older entries.
RESULT_FORMAT = "3: ptx pipeline facts"


def _cache_key(lowered_text: str, target: str) -> str:
  """What decides a compilation's outcome: the lowered program (StableHLO with the Triton
  kernels' IR), the target description, and the compiler (JAX, jaxlib, the CUDA plugin). The
  checkout's folder is replaced by a placeholder first: it appears in the IR's source locations
  only (debug information, not code), and without this a fresh clone in another folder, as CI
  makes, would recompile everything."""
  import jax
  import jaxlib
  try:
    from importlib.metadata import version
    plugin = version("jax-cuda12-plugin")
  except Exception:
    plugin = "?"
  h = hashlib.sha256()
  program = lowered_text.replace(ROOT, "<repo>")
  for part in (RESULT_FORMAT, jax.__version__, jaxlib.__version__, plugin, target_config(target), program):
    h.update(part.encode())
    h.update(b"\0")
  return h.hexdigest()



PROGRAM_DIGEST = "\n// program digest 2: copy bytes per step, weight and page copies"


def _copy_sizes(cfg, mgr, variant: str) -> dict[int, str]:
  """Element counts a step must never copy, with what they are: one layer's slice of each
  decoder weight (per device at tp=2) and one layer's K/V pages (or more: checked as >=)."""
  tp = 2 if variant == "tp2" else 1
  d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  sizes = {d * cfg.num_heads * e // tp: "q_proj/o_proj slice", d * cfg.num_kv_heads * e // tp: "k/v_proj slice",
           d * f // tp: "gate/up/down slice"}
  sizes[-(2 * cfg.num_kv_heads * mgr.num_blocks * mgr.block_size * e // tp)] = "one layer's pages (or more)"
  return sizes


def _digest_program(res: dict, forbidden: dict[int, str] | None = None) -> None:
  """A whole program's fresh compile result, in place: its per-step thunk figures (with the
  bytes its common path copies, and any copy of a weight slice or of the pages), and of its
  kernels the project's Triton kernels only (keeps the report small)."""
  thunks = res.pop("_thunks", None) or []
  step, scope = gpu_report.step_thunks(thunks)
  res["per_step"] = dict(gpu_report.thunk_summary(step), scope=scope)
  copies = gpu_report.step_copies(step, res.pop("_names", {}), res.pop("_shapes", {}))
  res["per_step"]["copy_bytes"] = sum(c["bytes"] * c["times"] for c in copies)
  res["per_step"]["largest_copies"] = sorted(copies, key=lambda c: -c["bytes"] * c["times"])[:3]
  res["weight_or_page_copies"] = gpu_report.weight_or_page_copies(copies, forbidden or {})
  ks = res.pop("kernels", {}) or {}
  mine: dict[str, dict] = {}
  for k, v in sorted(ks.items()):
    base = re.sub(r"__\d+$", "", k)  # one kernel per layer: paged_decode_attention__7, ...
    if base.startswith(("paged_", "write_kv", "copy_blocks", "layer_matmul")):
      mine.setdefault(base, dict(v, instances=0))["instances"] += 1
  res["triton_kernels"] = mine
  res["distinct_kernels"] = len(ks)


def _compile_or_cached(lowered, text: str, target: str, name: str, keep_dir: str | None,
                       digest) -> dict:
  """The stored result of compiling ``lowered`` (whose text is ``text``) for ``target``, marked
  ``cached``; else a fresh compile in a scratch folder (or ``keep_dir/name``), passed through
  ``digest`` (in place) and stored."""
  ckey = _cache_key(text, target)
  hit = _cached(ckey)
  if hit is not None:
    return dict(hit, cached=True)
  work = os.path.join(keep_dir, name) if keep_dir else tempfile.mkdtemp(prefix="gpu_gate_")
  os.makedirs(work, exist_ok=True)
  res = _compile(lowered, work, keep=bool(keep_dir))
  digest(res)
  _store(ckey, {k: v for k, v in res.items() if k in _RESULT_KEYS})
  return res

def _cached(key: str) -> dict | None:
  path = os.path.join(CACHE_DIR, key[:2], key + ".json")
  if not _USE_CACHE or not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _store(key: str, res: dict) -> None:
  """Keeps a passing result (compiled, no spill) for the next run; failures are always redone."""
  if res.get("status") != "compiled" or res.get("spills"):
    return
  path = os.path.join(CACHE_DIR, key[:2], key + ".json")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(res, f, default=str)
  os.replace(tmp, path)


def _set_cache(use: bool) -> None:
  global _USE_CACHE
  _USE_CACHE = use


def _compile(lowered, work_dir: str, keep: bool) -> dict:
  """Compiles a lowered program for its topology; returns the measured figures or the error."""
  dump = os.path.join(work_dir, "dump")
  log_path = os.path.join(work_dir, "xla.log")
  t0 = time.perf_counter()
  err = compiled = None
  with _stderr_to(log_path):
    try:
      compiled = lowered.compile(gate_compile_options(dump))
    except Exception as e:  # any compile failure is a gate failure, reported
      err = e
  res: dict = {"compile_s": round(time.perf_counter() - t0, 2)}
  log = open(log_path, errors="replace").read()
  # XLA logs this once per process from JAX 0.12 (every compile before): a later compile in the
  # same process goes through the same compile-only client.
  global _DEVICELESS_LOGGED
  _DEVICELESS_LOGGED |= "Performing a deviceless compilation" in log
  res["deviceless"] = _DEVICELESS_LOGGED
  ptxas = gpu_report.parse_ptxas(log)
  if err is not None:
    res.update(status="compile_failed", error=f"{type(err).__name__}: {err}"[:1500])
  else:
    hlo = compiled.as_text()
    metadata = gpu_report.read_thunk_metadata(dump)
    thunks = gpu_report.parse_thunks(gpu_report.read_thunk_files(dump), gpu_report.while_trip_counts(metadata, hlo))
    ptx = gpu_report.ptx_entries(dump)
    mem = compiled.memory_analysis()
    kernels = {}
    for t, _, _ in gpu_report.walk(thunks):
      if t["kind"] != "kCustomKernel" or "name" not in t:
        continue
      kernels.setdefault(t["name"], {**ptxas.get(t["name"], {}), **ptx.get(t["name"], {}),
                                     "grid": t.get("grid"), "threads": t.get("threads"),
                                     "shared_memory_bytes": t.get("shared_memory_bytes")})
    res.update(status="compiled", kernels=kernels, thunk_summary=gpu_report.thunk_summary(thunks),
               hlo_control_flow=gpu_report.hlo_control_flow(hlo),
               memory={k: getattr(mem, k) for k in (
                   "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                   "temp_size_in_bytes")} if mem is not None else None)
    res["_thunks"] = thunks
    res["_names"], res["_shapes"] = gpu_report.thunk_names(metadata), gpu_report.hlo_shapes(hlo)
  res["spills"] = gpu_report.spills(ptxas)
  res["max_registers"] = max((r["registers"] or 0 for r in ptxas.values()), default=0)
  if not keep:
    shutil.rmtree(work_dir, ignore_errors=True)
  return res


def _sds(shape, dtype, sharding):
  import jax
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _kernel_program(spec: dict):
  """(function, abstract args) of one kernel configuration on the spec's target."""
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from paged_kv import pallas_kernels as pk

  _, mesh = _topology(spec["target"])
  sh = NamedSharding(mesh, PartitionSpec())
  dt = jnp.dtype(spec["dtype"])
  if spec["kernel"] == "layer_matmul":
    # A spec with a "group" (the weights' widths N_i, summing to "n") launches the grouped form:
    # one kernel over the weights side by side (q|k|v, gate|up), a bias per weight with "bias".
    m, k, n, extras = spec["m"], spec["k"], spec["n"], spec["extras"].split("+")
    ns = tuple(spec.get("group") or (n,))
    layers = MATMUL_LAYERS
    args = (_sds((m, k), dt, sh), tuple(_sds((layers, k, ni), dt, sh) for ni in ns), _sds((), jnp.int32, sh))
    args += ((_sds((layers, k), dt, sh),) if "scale" in extras else ()) + (
        (tuple(_sds((layers, ni), dt, sh) for ni in ns),) if "bias" in extras else ())

    def matmul(x, ws, layer, *rest):
      rest = list(rest)
      scale = rest.pop(0) if "scale" in extras else None
      bias = rest.pop(0) if "bias" in extras else None
      inv = {"batch_invariant": True} if spec.get("invariant") else {}
      if "group" not in spec:
        return pk.layer_matmul(x, ws[0], layer, scale=scale, bias=None if bias is None else bias[0], impl="pallas",
                               **inv)
      return pk.layer_matmul(x, ws, layer, scale=scale, bias=bias, impl="pallas", **inv)
    return matmul, args, ()
  d, bs, g = spec["head_dim"], spec["block_size"], spec["group"]
  batch, context, tokens, rows = SIZES[spec["size"]]
  kv_dt = spec.get("kv_dtype")

  def page_arg(shape):
    """Plain pages in the compute dtype, or quantized ones (``kv_dtype`` values, float32 scales)."""
    if kv_dt is None:
      return _sds(shape, dt, sh)
    from paged_kv.pallas_kernels.quant import QuantPages, storage_dtype
    return QuantPages(values=_sds(shape, storage_dtype(kv_dt), sh), scales=_sds(shape[:-1], jnp.float32, sh))
  if spec["kernel"] == "prefill":
    batch = min(batch, 4)
  max_blocks = -(-context // bs)
  i32 = jnp.int32
  kernel = spec["kernel"]
  if kernel == "invariant_attention":
    # Batch-invariant mode: one kernel for both forms (decode: one token per sequence), a
    # traced sliding window (an operand: the same kernel with or without one).
    knob = KNOBS.get(spec.get("knob"), {})
    kw = dict(impl="pallas", batch_invariant=True, soft_cap=knob.get("soft_cap"), window=knob.get("window"))
    if spec["form"] == "prefill":
      batch = min(batch, 4)
    pages = page_arg((2, 2, KV_HEADS, batch * max_blocks + 1, bs, d))  # quantized: the plan refuses it
    bt, vec = _sds((batch, max_blocks), i32, sh), _sds((batch,), i32, sh)
    slopes = (_sds((KV_HEADS * g,), jnp.float32, sh),) if knob.get("alibi") else ()
    if spec["form"] == "decode":
      return (lambda q, p, t, n, *a: pk.paged_decode_attention(q, p, 1, t, n, alibi_slopes=a[0] if a else None, **kw),
              (_sds((batch, KV_HEADS * g, d), dt, sh), pages, bt, vec) + slopes, ())
    return (lambda q, p, t, s0, n, *a: pk.paged_prefill_attention(
                q, p, 1, t, s0, n, alibi_slopes=a[0] if a else None, **kw),
            (_sds((batch, tokens, KV_HEADS * g, d), dt, sh), pages, bt, vec, vec) + slopes, ())
  if kernel in ("decode", "prefill"):
    pages = page_arg((2, 2, KV_HEADS, batch * max_blocks + 1, bs, d))
    bt, vec = _sds((batch, max_blocks), i32, sh), _sds((batch,), i32, sh)
    # The attention knobs of a "knob_row" spec: a static cap, ALiBi slopes as one more input, a
    # static sliding window (an int32 operand of the kernel).
    knob = KNOBS.get(spec.get("knob"), {})
    cap = knob.get("soft_cap")
    win = knob.get("window")
    slopes = (_sds((KV_HEADS * g,), jnp.float32, sh),) if knob.get("alibi") else ()
    if kernel == "decode":
      return (lambda q, p, t, n, *a: pk.paged_decode_attention(
                  q, p, 1, t, n, impl="pallas", soft_cap=cap, alibi_slopes=a[0] if a else None, window=win),
              (_sds((batch, KV_HEADS * g, d), dt, sh), pages, bt, vec) + slopes, ())
    return (lambda q, p, t, s0, n, *a: pk.paged_prefill_attention(
                q, p, 1, t, s0, n, impl="pallas", soft_cap=cap, alibi_slopes=a[0] if a else None,
                window=win),
            (_sds((batch, tokens, KV_HEADS * g, d), dt, sh), pages, bt, vec, vec) + slopes, ())
  if kernel == "write_kv":
    pages = page_arg((2, 2, KV_HEADS, 4096, bs, d))
    kv = _sds((rows, KV_HEADS, d), dt, sh)
    return (lambda p, k, v, s: pk.write_kv(p, 1, k, v, s, impl="pallas"),
            (pages, kv, kv, _sds((rows,), i32, sh)), (0,))
  if kernel == "copy_blocks":
    pages = page_arg((32, 2, KV_HEADS, 4096, bs, d))
    lst = _sds((rows,), i32, sh)
    return (lambda p, s, t: pk.copy_blocks(p, s, t, impl="pallas"), (pages, lst, lst), (0,))
  raise ValueError(f"unknown kernel {kernel!r}")


def _perf_program(spec: dict):
  """(function, abstract args, donated args) of one performance-model spec
  (``scripts/gate/perf_plan.perf_specs``): a project kernel at a named shape, or a sanity
  kernel (XLA's copy or GEMM, JAX's own paged attention)."""
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  from paged_kv import pallas_kernels as pk
  from paged_kv.pallas_kernels.jax_compat import jax_paged_attention

  _, mesh = _topology(spec["target"])
  sh = NamedSharding(mesh, PartitionSpec())
  dt, i32 = jnp.dtype(spec["dtype"]), jnp.int32
  kernel = spec["kernel"]
  if kernel == "layer_matmul":
    if spec.get("variant"):
      from paged_kv.pallas_kernels.stacked_matmul import Plan, layer_matmul_pallas
      cfg = Plan(**spec["variant"]["config"])
      m, k, n = spec["m"], spec["k"], spec["n"]
      args = (_sds((m, k), dt, sh), _sds((spec["layers"], k, n), dt, sh), _sds((), i32, sh))
      return (lambda x, w, layer: layer_matmul_pallas(x, w, layer, config=cfg)), args, ()
    return _kernel_program(dict(spec, purpose="matmul"))[:2] + ((),)
  if kernel in ("decode", "jax_paged_attention"):
    b, ctx, bs, d = spec["batch"], spec["context"], spec["block_size"], spec["head_dim"]
    max_blocks = ctx // bs
    nblocks = b * max_blocks + 1
    q = _sds((b, spec["q_heads"], d), dt, sh)
    bt, lens = _sds((b, max_blocks), i32, sh), _sds((b,), i32, sh)
    if kernel == "decode":
      pages = _sds((MATMUL_LAYERS, 2, spec["kv_heads"], nblocks, bs, d), dt, sh)
      if spec.get("kv_dtype"):  # quantized pages: kv_dtype values, float32 scales
        from paged_kv.pallas_kernels.quant import QuantPages, storage_dtype
        pages = QuantPages(values=_sds(pages.shape, storage_dtype(spec["kv_dtype"]), sh),
                           scales=_sds(pages.shape[:-1], jnp.float32, sh))
      if spec.get("variant"):
        from paged_kv.pallas_kernels.decode_attention import paged_decode_attention_pallas
        return (lambda q, p, t, n: paged_decode_attention_pallas(q, p, 1, t, n, scale=d ** -0.5, **spec["variant"]),
                (q, pages, bt, lens), ())
      win = spec.get("window")  # a static sliding window (the split rule sizes the launch for it)
      return (lambda q, p, t, n: pk.paged_decode_attention(q, p, 1, t, n, impl="pallas", window=win),
              (q, pages, bt, lens), ())
    kp = _sds((spec["kv_heads"], nblocks, bs, d), dt, sh)
    pa = jax_paged_attention()
    return (lambda q, k, v, t, n: pa.paged_attention(q, k, v, t, n), (q, kp, kp, bt, lens), ())
  if kernel == "copy_blocks":
    pages = _sds((spec["layers"], 2, spec["kv_heads"], 4096, spec["block_size"], spec["head_dim"]), dt, sh)
    lst = _sds((spec["copies"],), i32, sh)
    if spec.get("variant"):
      from paged_kv.pallas_kernels.block_copy import copy_blocks_pallas
      return (lambda p, s, t: copy_blocks_pallas(p, s, t, **spec["variant"]), (pages, lst, lst), (0,))
    return (lambda p, s, t: pk.copy_blocks(p, s, t, impl="pallas"), (pages, lst, lst), (0,))
  if kernel == "xla_copy":
    # An elementwise kernel of XLA's (a plain copy would be a memcpy, kCopy, with no PTX).
    x = _sds((spec["bytes"] // dt.itemsize,), dt, sh)
    return (lambda x: x + jnp.asarray(1, dt)), (x,), ()
  if kernel == "xla_gemm":
    x, w = _sds((spec["m"], spec["k"]), dt, sh), _sds((spec["k"], spec["n"]), dt, sh)
    return (lambda x, w: x @ w), (x, w), ()
  raise ValueError(f"unknown perf kernel {kernel!r}")


def run_perf_group(specs: list[dict], keep_dir: str | None, use_cache: bool = True) -> list[dict]:
  """Worker task: compiles each performance-model spec (no deduplication: the grid, which the
  model reads, is what differs) and attaches the model's estimate (``perf_plan.evaluate``)."""
  import jax
  _set_cache(use_cache)
  out = []
  for spec in specs:
    res = {"spec": spec}
    try:
      fn, args, donate = _perf_program(spec)
      with cuda_lowering(TARGETS[spec["target"]]["name"]):
        lowered = jax.jit(fn, donate_argnums=donate).trace(*args).lower()
    except Exception as e:
      res.update(status="lowering_failed", error=f"{type(e).__name__}: {e}"[:1500],
                 trace=traceback.format_exc()[-1500:])
      out.append(res)
      continue
    name = "perf-" + perf_plan.spec_name(spec).replace(" ", "-")
    res.update(_compile_or_cached(lowered, lowered.as_text(), spec["target"], name, keep_dir,
                                  digest=lambda r: [r.pop(k, None) for k in ("_thunks", "_names", "_shapes")]))
    res["name"] = name
    entry = perf_plan.kernel_entry(spec, res.get("kernels") or {}) if res.get("status") == "compiled" else None
    if entry is not None:
      res["model_kernel"] = entry[0]
      res["model"] = perf_plan.evaluate(spec, entry[1])
    out.append(res)
  return out


def run_kernel_group(specs: list[dict], keep_dir: str | None, use_cache: bool = True) -> list[dict]:
  """Worker task: lowers every spec of a group, compiles each distinct Triton kernel once.

  A spec the input checks refuse (``ValueError``) is recorded as refused, never compiled."""
  import jax
  _set_cache(use_cache)
  out, compiled_by_key = [], {}
  for spec in specs:
    res = {"spec": spec}
    t0 = time.perf_counter()
    try:
      fn, args, donate = _kernel_program(spec)
      with cuda_lowering(TARGETS[spec["target"]]["name"]):
        lowered = jax.jit(fn, donate_argnums=donate).trace(*args).lower()
    except ValueError as e:
      res.update(status="refused", error=str(e)[:800])
      out.append(res)
      continue
    except Exception as e:
      res.update(status="lowering_failed", error=f"{type(e).__name__}: {e}"[:1500],
                 trace=traceback.format_exc()[-1500:])
      out.append(res)
      continue
    res["lower_s"] = round(time.perf_counter() - t0, 2)
    text = lowered.as_text()
    key = triton_key(text)
    res["triton_key"] = key
    if key in compiled_by_key:
      res.update(status="same_kernel_as", same_as=compiled_by_key[key])
      out.append(res)
      continue
    name = "-".join(str(spec[k]) for k in ("target", "kernel", "dtype", "head_dim", "block_size",
                                           "group", "size", "m", "k", "n", "extras", "form") if k in spec)
    if spec.get("knob"):
      name += "-" + spec["knob"]
    if spec.get("kv_dtype"):
      name += "-kv_" + spec["kv_dtype"]
    if spec.get("invariant"):
      name += "-invariant"
    res.update(_compile_or_cached(lowered, text, spec["target"], name, keep_dir,
                                  digest=lambda r: [r.pop(k, None) for k in ("_thunks", "_names", "_shapes")]))
    compiled_by_key[key] = name
    res["name"] = name
    out.append(res)
  return out


# ------------------------------------------------------------------------------ whole programs
LLAMA_BATCH = 64  # serving rows / sequences per decode step
LLAMA_CONTEXT = 4096


def _llama_programs(target: str, variant: str, layers: int = 32):
  """Name -> (jitted fn, abstract args, static kwargs, kind) at Llama 3.1 8B shapes, bf16, with
  ``layers`` decoder layers (32 is the real depth)."""
  import importlib

  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  from paged_kv.allocate import append
  from paged_kv.config import ManagerConfig
  from paged_kv.fused import free_select_append
  from paged_kv.models import abstract_model, layout_for_impl, llama31_8b, page_spec, sharding as msharding
  from paged_kv.models.llama import per_layer
  from paged_kv.reclaim import free
  from paged_kv.share import fork
  # The package re-exports functions named like these modules: import the modules themselves.
  eb = importlib.import_module("paged_kv.engine.beam_search")
  eg = importlib.import_module("paged_kv.engine.generate")
  es = importlib.import_module("paged_kv.engine.serving")
  ss = importlib.import_module("paged_kv.engine.serving_step")
  from paged_kv.engine.sampling import BeamParams, SamplingParams
  from paged_kv.state import init_state

  tp = 2 if variant == "tp2" else 1
  _, mesh1 = _topology(target, tp)
  cfg = llama31_8b("bfloat16").replace(num_layers=layers)
  bs = 16
  blocks_per_seq = LLAMA_CONTEXT // bs
  mgr = ManagerConfig(num_blocks=LLAMA_BATCH * blocks_per_seq + 1, block_size=bs, max_seqs=LLAMA_BATCH,
                      max_blocks_per_seq=blocks_per_seq, prefix_caching=True)
  # The layout the engines run with the Pallas kernels (``paged_kv.models.layer_layout.layout_for_impl``): on one
  # GPU the stacked weights (the scan's projections read them in place), over a mesh one weight
  # array per layer (unrolled); either way no program copies a slice of a stacked weight.
  tp_mesh = None if tp == 1 else jax.sharding.Mesh(mesh1.devices, ("tp",))
  model = layout_for_impl(abstract_model(cfg), "pallas", tp_mesh)
  graphdef, weights = nnx.split(model)
  spec = page_spec(cfg, mgr.num_blocks, bs)
  rep = NamedSharding(mesh1, P())

  def on(tree, sharding=rep):
    return jax.tree.map(lambda x: _sds(x.shape, x.dtype, sharding), tree)

  state = on(jax.eval_shape(lambda: init_state(mgr)))
  if tp == 1:
    w = on(weights)
    pages = _sds(spec.shape, jnp.bfloat16, rep)
    mesh = None
  else:
    mesh = tp_mesh
    specs = msharding.weight_specs(weights, cfg, tp)
    w = jax.tree.map(lambda x, s: _sds(x.shape, x.dtype, NamedSharding(mesh, s)), weights, specs)
    pages = _sds(spec.shape, jnp.bfloat16, NamedSharding(mesh, msharding.PAGE_SPEC))
    rep = NamedSharding(mesh, P())
    state = on(jax.eval_shape(lambda: init_state(mgr)), rep)
  i32 = jnp.int32
  r = mgr.max_seqs
  key = jax.eval_shape(lambda: jax.random.key(0))
  key = _sds(key.shape, key.dtype, rep)
  progs = {}

  def step_inputs(p_rows, chunk):
    v = lambda dt=i32: _sds((r,), dt, rep)
    return ss.StepInputs(
        free_ids=v(), sel_dst=v(), sel_parent=v(), pf_rows=_sds((p_rows,), i32, rep),
        pf_tokens=_sds((p_rows, chunk), i32, rep), pf_start=_sds((p_rows,), i32, rep),
        pf_lens=_sds((p_rows,), i32, rep), dec_tokens=v(), dec_live=v(jnp.bool_), fork_src=v(),
        fork_dst=v(), logit_src=v(), temperature=v(jnp.float32), top_k=v(), top_p=v(jnp.float32),
        seed=v(), sample_idx=v(), token_idx=v())

  scfg = es.ServingConfig(manager=mgr, chunk_size=512, max_prefill_rows=4, top_candidates=8, impl="pallas",
                          record_tables=False, decode_steps=1)  # the gate checks the one-step program
  if variant == "tp2":
    shape = ss.StepShape(scfg, 0, mesh)
    progs["serving_step_decode_tp2"] = (ss.step_jit, (graphdef, w, pages, state, key, step_inputs(1, 512)),
                                        dict(shape=shape), "decode")
    return progs, mgr, cfg
  progs["serving_step_decode"] = (ss.step_jit, (graphdef, w, pages, state, key, step_inputs(1, 512)),
                                  dict(shape=ss.StepShape(scfg, 0, None)), "decode")
  # The other single-GPU layout (unrolled, per-layer weights, XLA's GEMMs), selectable by giving
  # the engines a ``per_layer`` model: compiled for its kernels and compile time beside the
  # stacked one (the performance model's layout decision, ``perf_plan.layout_decision``).
  pl_graphdef, pl_weights = nnx.split(per_layer(model))
  progs["serving_step_decode_per_layer"] = (ss.step_jit, (pl_graphdef, on(pl_weights), pages, state, key,
                                                          step_inputs(1, 512)),
                                            dict(shape=ss.StepShape(scfg, 0, None)), "decode")
  progs["serving_step_prefill"] = (ss.step_jit, (graphdef, w, pages, state, key, step_inputs(4, 512)),
                                   dict(shape=ss.StepShape(scfg, 4, None)), "decode+prefill")
  prompts, plen = _sds((16, 1024), i32, rep), _sds((16,), i32, rep)
  progs["generate_loop"] = (eg.generate_jit, (graphdef, w, pages, state, prompts, plen, plen, key),
                            dict(manager=mgr, params=SamplingParams(max_new_tokens=256, temperature=0.8, top_p=0.9,
                                                                    n=4, eos_token_ids=()),
                                 impl="pallas", chunk_size=512, context=LLAMA_CONTEXT), "decode")
  bprompts, bplen = _sds((16, 1024), i32, rep), _sds((16,), i32, rep)
  progs["beam_search_loop"] = (eb.beam_search_jit, (graphdef, w, pages, state, bprompts, bplen),
                               # No EOS ids, as the recorded gate runs compiled them (the model's three
                               # would widen beam search to k x 4 candidates a step).
                               dict(manager=mgr, params=BeamParams(beam_width=4, max_new_tokens=256, eos_token_ids=()),
                                    impl="pallas",
                                    chunk_size=512, context=LLAMA_CONTEXT), "decode")
  adm = 4
  progs["admit"] = (ss.admit_jit, (mgr, state, _sds((r,), i32, rep), _sds((adm,), i32, rep),
                                    _sds((adm,), i32, rep), _sds((adm, LLAMA_CONTEXT), i32, rep),
                                    _sds((adm,), jnp.uint32, rep)), {}, "manager")
  progs["append"] = (jax.jit(lambda s, ids, toks: append(mgr, s, ids, toks), donate_argnums=0),
                     (state, _sds((r,), i32, rep), _sds((r,), i32, rep)), {}, "manager")
  progs["free"] = (jax.jit(lambda s, ids: free(mgr, s, ids), donate_argnums=0),
                   (state, _sds((r,), i32, rep)), {}, "manager")

  def manager_share(state, free_ids, sel_dst, sel_parent, ids, toks, fork_src, fork_dst):
    # The block-manager calls of one serving step, in its order (free, select, append, fork):
    # the manager's share of a decode step, without the model. On a GPU the serving step runs
    # free, select and append as ``free_select_append`` (one check for the three), as here.
    state, _, _, res, _ = free_select_append(mgr, state, free_ids, sel_dst, sel_parent, ids, toks)
    state, _ = fork(mgr, state, fork_src, fork_dst)
    return state, res

  v = _sds((r,), i32, rep)
  progs["serving_manager_share"] = (jax.jit(manager_share, donate_argnums=0), (state, v, v, v, v, v, v, v), {},
                                    "manager")
  return progs, mgr, cfg


def kv_bytes_per_decode_step(cfg, batch: int, context: int) -> int:
  """K and V bytes a decode step must read at least: every layer's K and V of every cached
  position of every sequence (bf16)."""
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * batch * context


_RESULT_KEYS = ("compile_s", "deviceless", "status", "error", "kernels", "thunk_summary", "hlo_control_flow",
                "memory", "spills", "max_registers", "per_step", "triton_kernels", "distinct_kernels",
                "weight_or_page_copies")


def run_program(target: str, variant: str, name: str, keep_dir: str | None, use_cache: bool = True,
                layers: int = 32) -> dict:
  """Worker task: lower and compile one whole program; figures per step."""
  _set_cache(use_cache)
  t0 = time.perf_counter()
  res: dict = {"program": name, "target": target, "layers": layers}
  try:
    progs, mgr, cfg = _llama_programs(target, variant, layers)
    fn, args, static, kind = progs[name]
    with cuda_lowering(TARGETS[target]["name"]):
      lowered = fn.trace(*args, **static).lower()
  except Exception as e:
    res.update(status="lowering_failed", error=f"{type(e).__name__}: {e}"[:1500],
               trace=traceback.format_exc()[-2000:])
    return res
  res["lower_s"] = round(time.perf_counter() - t0, 2)
  # The digest's format is part of the stored result: a new one must not reuse old entries.
  res.update(_compile_or_cached(lowered, lowered.as_text() + PROGRAM_DIGEST, target, name, keep_dir,
                                digest=functools.partial(_digest_program, forbidden=_copy_sizes(cfg, mgr, variant))))
  res["kind"] = kind
  if kind.startswith("decode"):
    kv = kv_bytes_per_decode_step(cfg, LLAMA_BATCH, LLAMA_CONTEXT)
    res["kv_bytes_per_decode_step_at_full_context"] = kv
    res["kv_read_lower_bound_ms_h200"] = round(1e3 * gpu_report.kv_read_lower_bound(kv, H200_BANDWIDTH), 3)
  return res


DEFAULT_LAYERS = 32  # the real depth: compiling 4 layers instead saved little (docs/gpu-gate.md)
DEPTH_PROBE = 2


def depth_extrapolation(program_results: list[dict]) -> dict | None:
  """Per-layer cost of the serving decode step from two depths, and the step at 32 layers.

  Every layer is the same code (the model's layer loop traces one ``DecoderLayer`` per index; the
  index only moves the kernels' offset into the pages), so per-step kernel counts are affine in
  the depth: ``count(L) = fixed + L * per_layer``."""
  steps = {r["layers"]: r for r in program_results
           if r["program"] == "serving_step_decode" and r.get("status") == "compiled"}
  if len(steps) < 2:
    return None
  lo, hi = sorted(steps)[:2]
  out = {"depths": [lo, hi]}
  for path in ("least", "most"):
    for key in ("kernels", "host_launches", "host_syncs"):
      a, b = steps[lo]["per_step"][path][key], steps[hi]["per_step"][path][key]
      per = (b - a) / (hi - lo)
      out[f"{path}_{key}"] = {"per_layer": per, "fixed": a - lo * per, "at_32_layers": a + (32 - lo) * per}
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--workers", type=int, default=2)
  ap.add_argument("--out", default=os.path.join(ROOT, "results", "gpu_compile_report.json"),
                  help="the full report (megabytes; not committed)")
  ap.add_argument("--summary", default=None,
                  help="the small summary docs/gpu-gate.md's tables read (default: beside --out, "
                       "gpu_compile_summary.json; results/gpu_compile_summary.json is the committed one)")
  ap.add_argument("--only", choices=("kernels", "programs", "perf"), default=None,
                  help="kernels: the configuration matrix; programs: the whole programs; perf: the "
                       "performance model's named shapes and sanity checks")
  ap.add_argument("--quick", action="store_true", help="large size only (a smoke run)")
  ap.add_argument("--purpose", nargs="*", default=None,
                  help="only the kernel configurations of these purposes (e.g. invariant); no programs, no perf")
  ap.add_argument("--keep-dumps", default=None, help="keep XLA dumps and logs under this folder")
  ap.add_argument("--programs", nargs="*", default=None, help="only these whole programs")
  ap.add_argument("--knobs", nargs="*", default=None, choices=sorted(KNOBS),
                  help="only the kernel configurations with these attention knobs (with --only kernels: "
                       "a partial run after a change to one knob's code)")
  ap.add_argument("--layers", type=int, default=DEFAULT_LAYERS,
                  help="decoder layers of the whole programs (Llama 3.1 8B has 32; see docs/gpu-gate.md)")
  ap.add_argument("--no-cache", action="store_true",
                  help=f"compile everything again (passing results are kept in {CACHE_DIR}, keyed by "
                       "the lowered program, the target and the compiler versions)")
  a = ap.parse_args(argv)
  t_start = time.perf_counter()

  groups = [] if a.only in ("programs", "perf") else kernel_groups(a.quick, a.knobs)
  if a.purpose is not None:
    groups = [kept for g in groups for kept in [[s for s in g if s["purpose"] in a.purpose]] if kept]
  only_kernels = a.only in ("kernels",) or a.purpose is not None
  perf_groups = [] if only_kernels or a.only == "programs" else perf_plan.perf_groups()
  progs = [] if only_kernels or a.only == "perf" else [
      (*p, a.layers) for p in PROGRAMS if a.programs is None or p[2] in a.programs]
  if progs and a.layers < 32 and a.layers != DEPTH_PROBE and any(p[2] == "serving_step_decode" for p in progs):
    # At a reduced depth, a second depth of the decode step gives the per-layer cost (the layers
    # are one code traced once per layer index), so the figures extrapolate to 32 layers.
    progs.append(("sm_90", "tp1", "serving_step_decode", DEPTH_PROBE))
  ctx = multiprocessing.get_context("spawn")
  kernel_results, program_results, perf_results = [], [], []
  with concurrent.futures.ProcessPoolExecutor(max_workers=a.workers, mp_context=ctx) as pool:
    # Whole programs first (the longest tasks), then the kernel groups.
    pfut = [pool.submit(run_program, t, v, n, a.keep_dumps, not a.no_cache, L)
            for t, v, n, L in progs]
    kfut = [pool.submit(run_kernel_group, g, a.keep_dumps, not a.no_cache) for g in groups]
    mfut = [pool.submit(run_perf_group, g, a.keep_dumps, not a.no_cache) for g in perf_groups]
    done = 0
    for f in concurrent.futures.as_completed(pfut + kfut + mfut):
      done += 1
      if f in pfut:
        r = f.result()
        program_results.append(r)
        print(f"[{time.perf_counter() - t_start:6.1f}s] program {r['program']} ({r['layers']} layers): {r['status']} "
              f"compile {r.get('compile_s')}s", flush=True)
      else:
        (perf_results if f in mfut else kernel_results).extend(f.result())
        if done % 20 == 0:
          print(f"[{time.perf_counter() - t_start:6.1f}s] {done}/{len(pfut) + len(kfut) + len(mfut)} tasks", flush=True)

  failures = []
  for r in kernel_results:
    why = judge(r)
    r["gate"] = "pass" if why is None else "FAIL: " + why
    if why:
      failures.append((r.get("name") or json.dumps(r["spec"]), why))
  for r in program_results:
    why = judge(r)
    r["gate"] = "pass" if why is None else "FAIL: " + why
    if why:
      failures.append((r["program"], why))
  for r in perf_results:
    why = judge(r) if r.get("status") != "compiled" else None
    if why is None:
      why = perf_plan.judge_perf(r["spec"], r.get("model"), perf_plan.copy_baseline(r["spec"], perf_results))
    r["gate"] = "pass" if why is None else "FAIL: " + why
    if why:
      failures.append((r.get("name") or json.dumps(r["spec"]), why))
  # Spills in XLA's own fusions are reported, not failed: their code is XLA's emitters'.
  xla_spills = [{"what": r.get("program") or r.get("name") or json.dumps(r["spec"]), "spills": s}
                for r in kernel_results + program_results for s in [xla_fusion_spills(r)] if s]
  kernel_results.sort(key=lambda r: json.dumps(r["spec"], sort_keys=True))
  program_results.sort(key=lambda r: (r["program"], r["layers"]))
  depth = depth_extrapolation(program_results)
  perf_results.sort(key=lambda r: json.dumps(r["spec"], sort_keys=True))
  layout = perf_plan.layout_decision(perf_results, program_results)
  if layout["shapes"] and not layout["agrees"]:
    where = [(x["batch"], x["context"], x["faster"], x["margin"]) for x in layout["shapes"]]
    failures.append(("layout", f"the engines run the {layout['engine_layout']} layout on one GPU, but the "
                               f"model says (batch, context, faster, margin): {where}"))
  import jax
  report = {
      "jax": jax.__version__,
      "targets": {k: {x: v[x] for x in ("name", "major", "smem_optin", "sms", "bandwidth")}
                  for k, v in TARGETS.items()},
      "wall_s": round(time.perf_counter() - t_start, 1),
      "workers": a.workers,
      "quick": a.quick,
      "load_average_at_end": os.getloadavg()[0],
      "counts": {
          "configurations": len(kernel_results),
          "compiled": sum(r["status"] == "compiled" for r in kernel_results),
          "same_kernel_as_another": sum(r["status"] == "same_kernel_as" for r in kernel_results),
          "refused": sum(r["status"] == "refused" for r in kernel_results),
          "programs": len(program_results),
          "failures": len(failures),
      },
      "failures": [{"what": w, "why": y} for w, y in failures],
      "xla_fusion_spills": xla_spills,
      "kernels": kernel_results,
      "programs": program_results,
      "decode_step_per_layer": depth,
      "performance_model": {"assumptions": {t: g.describe() for t, g in perf_model.GPUS.items()},
                            "targets": perf_plan.TARGETS, "kernels": perf_results, "layout": layout,
                            "programs": perf_plan.program_sums(perf_results, program_results)},
  }
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(report, f, indent=1, default=str)
  summary = a.summary or gpu_report.summary_path(a.out)
  gpu_report.dump_summary(gpu_report.summarize(report), summary)
  print(f"{report['counts']}; wall {report['wall_s']} s; report {a.out}, summary {summary}")
  for x in xla_spills:
    print(f"note: spills in XLA's own fusions of {x['what']}: {x['spills']} (bytes; reported, not failed)")
  for w, y in failures:
    print(f"FAIL {w}: {y}")
  print("GPU COMPILE GATE:", "PASSED" if not failures else f"FAILED ({len(failures)})")
  return 0 if not failures else 1


if __name__ == "__main__":
  sys.exit(main())
