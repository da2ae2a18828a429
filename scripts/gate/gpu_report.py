"""Reading what XLA:GPU leaves behind after a (deviceless) compilation: the ``ptxas -v`` report
in its log, the thunk sequence it dumps, the PTX, and the optimized HLO.

Pure text processing (no JAX import), so ``tests/test_gpu_report.py`` checks it on any machine.
``scripts/gate/gpu_compile.py`` is the gate that produces the text. Also the gate's summary
(``summarize``: what docs/gpu-gate.md's tables show, a few tens of KB, committed as
``results/gpu_compile_summary.json``) and the tables themselves::

    python scripts/gate/gpu_report.py [SUMMARY_OR_REPORT.json]       # print the tables
    python scripts/gate/gpu_report.py --update-docs                  # rewrite them in docs/gpu-gate.md
    python scripts/gate/gpu_report.py REPORT.json --summarize OUT.json
    python scripts/gate/gpu_report.py --compare OLD.json NEW.json [BY_JAX_OUT.json]

Formats read (XLA 0.10.2 / ptxas 12.9):

* ptxas, one report per kernel, logged by XLA's subprocess compilation at verbosity 2::

    ptxas info    : Compiling entry function 'paged_decode_attention' for 'sm_90a'
    ptxas info    : Function properties for paged_decode_attention
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 168 registers, used 1 barriers, 448 bytes cmem[0]

* thunk sequence (``*.thunk_sequence.txt`` under ``--xla_dump_to``): one line per thunk, kind
  first (``kKernel``, ``kCustomKernel`` for Triton, ``kGemm``, ``kCopy``, ``kConditional``,
  ``kWhile``, ``kCommandBuffer``, ...), nested sequences (a while's body, a conditional's
  branches, a command buffer's commands) indented below their parent.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?")


def parse_ptxas(log: str) -> dict[str, dict]:
  """Kernel name -> ptxas figures (registers, spill store/load bytes, stack frame, arch).

  Each report starts at "Compiling entry function"; its figures are read up to the next report,
  so a kernel whose report lacks a line gets ``None`` there, never another kernel's number. When
  ptxas ran more than once for a kernel name (several modules), the worst figures are kept."""
  out: dict[str, dict] = {}
  starts = list(_ENTRY.finditer(log))
  for i, m in enumerate(starts):
    end = starts[i + 1].start() if i + 1 < len(starts) else len(log)
    seg = log[m.end():end]
    props, used = _PROPS.search(seg), _USED.search(seg)
    rec = {
        "arch": m.group(2),
        "registers": int(used.group(1)) if used else None,
        "barriers": int(used.group(2)) if used and used.group(2) else None,
        "stack_frame_bytes": int(props.group(1)) if props else None,
        "spill_store_bytes": int(props.group(2)) if props else None,
        "spill_load_bytes": int(props.group(3)) if props else None,
    }
    old = out.get(m.group(1))
    if old is not None:
      rec = {k: (max(v, old[k]) if isinstance(v, int) and isinstance(old[k], int) else v or old[k])
             for k, v in rec.items()}
    out[m.group(1)] = rec
  return out


def spills(report: dict[str, dict]) -> dict[str, int]:
  """Kernel -> spilled bytes (stores + loads), only the kernels that spill."""
  out = {}
  for name, r in report.items():
    total = (r.get("spill_store_bytes") or 0) + (r.get("spill_load_bytes") or 0)
    if total:
      out[name] = total
  return out


# ------------------------------------------------------------------------------ thunk sequence
_THUNK_LINE = re.compile(r"^(\s*)(\d+):\s+(k[A-Z]\w*)\s*(?:\[[^\]]*\])?\s*(.*)$")
_LABEL_LINE = re.compile(r"^\s*([a-z_]+\d*):\s*$")
_GRID = re.compile(r"grid:\s*\[([^\]]*)\]")
_THREADS = re.compile(r"threads:\s*\[([^\]]*)\]")
_SMEM = re.compile(r"shared_memory:\s*(\d+)")
# Thunks that launch work on the GPU (kernels, library calls, collectives); copies and memsets are
# counted apart.
LAUNCH_KINDS = frozenset((
    "kKernel", "kCustomKernel", "kGemm", "kCublasLtMatmul", "kCuDnn", "kCustomCall", "kFft",
    "kConvolution", "kTriangularSolve", "kNcclAllReduceStart", "kNcclAllGatherStart",
    "kNcclReduceScatterStart", "kNcclAllToAllStart", "kNcclCollectivePermuteStart",
    "kNcclAllReduce", "kNcclAllGather", "kNcclReduceScatter", "kAllReduceStart", "kAllGatherStart",
    "kReduceScatterStart", "kAllToAllStart", "kCollectivePermuteStart", "kAllReduce", "kAllGather",
    "kReduceScatter"))
COPY_KINDS = frozenset(("kCopy", "kMemset32BitValue", "kMemzero"))
CONTROL_KINDS = frozenset(("kConditional", "kWhile"))


def _dims(text: str) -> list[int]:
  return [int(x) for x in re.findall(r"\d+", text)]


def parse_thunks(text: str, trip_counts: dict[int, int] | None = None) -> list[dict]:
  """Thunk sequence text -> the top-level thunks, as a tree.

  Each thunk: ``{kind, id, name, grid, threads, shared_memory_bytes, children, sections}``, and
  ``trip_count`` for a ``kWhile`` whose thunk id is in ``trip_counts`` (``while_trip_counts``:
  XLA knows how often it runs, a scan's loop).
  ``children``: the commands of a ``kCommandBuffer`` (or any other nesting without labels);
  ``sections``: for a ``kConditional`` its branches (``false_branch``, ``true_branch``,
  ``branch_N``), for a ``kWhile`` its ``condition`` and ``body``, each a list of thunks. Nesting is
  read from the indentation; a section label applies to the thunks after it (XLA prints some
  labels without indentation, so a label's own indent is not trusted)."""
  roots: list[dict] = []
  stack: list[tuple[int, dict]] = []
  last_while = None
  for line in text.splitlines():
    # An empty section prints as "No thunks." with the next label on the same line (a while
    # whose condition only reads its predicate: "condition:\n    No thunks.  body:").
    if line.strip().startswith("No thunks."):
      rest = line.strip()[len("No thunks."):].strip()
      if not rest:
        continue
      line = " " * (len(line) - len(line.lstrip())) + rest
    m = _THUNK_LINE.match(line)
    lm = None if m else _LABEL_LINE.match(line)
    if lm:
      # A label opens a section of the innermost open conditional/while left of it. XLA prints
      # a while's "condition:" at column 0: that one belongs to the last while read.
      ind = len(line) - len(line.lstrip())
      owner = None
      if ind == 0 and lm.group(1) == "condition":
        owner = last_while
      else:
        for i, node in reversed(stack):
          if i < ind and node["kind"] in CONTROL_KINDS:
            owner = node
            break
      if owner is not None:
        owner["_section"] = lm.group(1)
      continue
    if not m:
      continue
    indent, kind, rest = len(m.group(1).expandtabs()), m.group(3), m.group(4)
    node: dict = {"kind": kind, "id": int(m.group(2)), "children": [], "sections": {}}
    if kind == "kWhile" and trip_counts and int(m.group(2)) in trip_counts:
      node["trip_count"] = trip_counts[int(m.group(2))]
    name = rest.split()[0] if rest.split() else ""
    if name and not name.endswith(":"):
      node["name"] = name
    for key, rx, conv in (("grid", _GRID, _dims), ("threads", _THREADS, _dims),
                          ("shared_memory_bytes", _SMEM, int)):
      mm = rx.search(rest)
      if mm:
        node[key] = conv(mm.group(1))
    while stack and stack[-1][0] >= indent:
      stack.pop()
    if not stack:
      roots.append(node)
    else:
      parent = stack[-1][1]
      if parent["kind"] in CONTROL_KINDS:
        parent["sections"].setdefault(parent.get("_section", "body"), []).append(node)
      else:
        parent["children"].append(node)
    stack.append((indent, node))
    if kind == "kWhile":
      last_while = node
  for t, _, _ in walk(roots):
    t.pop("_section", None)
  return roots


def walk(thunks: list[dict], in_graph: bool = False, in_control: bool = False):
  """Every thunk of a tree with two flags: inside a command buffer (CUDA graph), inside a
  branch or loop."""
  for t in thunks:
    yield t, in_graph, in_control
    yield from walk(t["children"], in_graph or t["kind"] == "kCommandBuffer", in_control)
    for sec in t["sections"].values():
      yield from walk(sec, in_graph or t["kind"] == "kCommandBuffer", True)


def _cost(thunks: list[dict], pick, in_graph: bool = False) -> dict:
  """Kernels run, host launch operations and host syncs of one pass over ``thunks``, with
  ``pick`` choosing each conditional's branch and each while's trip count (0 or 1)."""
  c = {"kernels": 0, "copies": 0, "host_launches": 0, "host_syncs": 0}

  def add(d):
    for k in c:
      c[k] += d[k]

  for t in thunks:
    kind = t["kind"]
    if kind in LAUNCH_KINDS:
      c["kernels"] += 1
      c["host_launches"] += 0 if in_graph else 1
    elif kind in COPY_KINDS:
      c["copies"] += 1
      c["host_launches"] += 0 if in_graph else 1
    elif kind == "kCommandBuffer":
      c["host_launches"] += 0 if in_graph else 1  # one graph launch
      add(_cost(t["children"], pick, True))
    elif kind == "kConditional":
      # The predicate is read on the host unless the conditional is a graph node.
      c["host_syncs"] += 0 if in_graph else 1
      branches = [_cost(sec, pick, in_graph) for sec in t["sections"].values()] or [_cost([], pick)]
      add(pick(branches))
    elif kind == "kWhile" and "trip_count" in t:
      # A known trip count (a scan): XLA's WhileThunk runs the body that often and never reads
      # the condition back, so there is no host sync.
      body = _cost(t["sections"].get("body", []), pick, in_graph)
      for _ in range(t["trip_count"]):
        add(body)
    elif kind == "kWhile":
      cond = _cost(t["sections"].get("condition", []), pick, in_graph)
      body = _cost(t["sections"].get("body", []), pick, in_graph)
      trips = pick([{"trips": 0}, {"trips": 1}])["trips"]
      for _ in range(trips + 1):  # the condition runs once more than the body
        add(cond)
        c["host_syncs"] += 0 if in_graph else 1
      for _ in range(trips):
        add(body)
    else:
      add(_cost(t["children"], pick, in_graph))
  return c


def _least(options):
  return min(options, key=lambda d: (d.get("trips", 0), d.get("host_syncs", 0), d.get("kernels", 0)))


def _most(options):
  return max(options, key=lambda d: (d.get("trips", 0), d.get("host_syncs", 0), d.get("kernels", 0)))


def thunk_summary(thunks: list[dict]) -> dict:
  """Figures of one pass over a thunk tree.

  ``least``: every conditional takes its cheapest branch and every while runs zero trips (the
  common path of the block manager: its loops probe past a window or skip stale queue entries,
  which usually does not happen); ``most``: the costliest branch and one trip each. A while with
  a known trip count (a scan over layers) runs exactly that often in both, with no host sync.
  Counts:
  kernels run (command-buffer commands included), copies, host launch operations (a command
  buffer is one graph launch) and host syncs (each conditional predicate and each while
  condition evaluation outside a command buffer is a device-to-host read)."""
  control = [(t, g) for t, g, _ in walk(thunks) if t["kind"] in CONTROL_KINDS]
  return {
      "least": _cost(thunks, _least),
      "most": _cost(thunks, _most),
      "conditionals": sum(t["kind"] == "kConditional" for t, _ in control),
      "whiles": sum(t["kind"] == "kWhile" for t, _ in control),
      "control_flow_in_command_buffers": sum(g for _, g in control),
      "command_buffers": sum(t["kind"] == "kCommandBuffer" for t, _, _ in walk(thunks)),
      "triton_kernels": sorted({t.get("name", "") for t, _, _ in walk(thunks)
                                if t["kind"] == "kCustomKernel" and t.get("name", "").startswith(
                                    ("paged_", "write_kv", "copy_blocks", "layer_matmul"))}),
  }


def step_thunks(thunks: list[dict]) -> tuple[list[dict], str]:
  """The thunks of one decode step. In a program whose step runs in a loop (the on-device
  generate and beam-search loops) that is the body of the while whose body launches the decode
  attention kernel and whose trip count XLA does not know (a scan over layers, a loop of known
  trip count, runs inside each step); otherwise the whole program is one step."""
  best = None
  for t, _, _ in walk(thunks):
    if t["kind"] != "kWhile" or "trip_count" in t:  # a scan over layers is inside a step
      continue
    body = t["sections"].get("body", [])
    if any(u.get("name") == "paged_decode_attention" for u, _, _ in walk(body)):
      best = body  # the innermost such loop wins (walk is pre-order)
  if best is not None:
    return best, "body of the decode loop"
  return thunks, "whole program"


def read_thunk_files(dump_dir: str) -> str:
  """Text of the final thunk sequence of a dump (after XLA's thunk passes, which form the
  command buffers); the largest module's when several were written."""
  for pattern in ("*thunk_sequence_after_thunk_passes.txt", "*thunk_sequence.txt"):
    paths = sorted(glob.glob(os.path.join(dump_dir, pattern)), key=os.path.getsize)
    if paths:
      return open(paths[-1], errors="replace").read()
  return ""


def read_thunk_metadata(dump_dir: str) -> str:
  """Text of the thunk metadata file of a dump (thunk id -> profile annotation, the HLO
  instruction's name); the largest module's when several were written."""
  paths = sorted(glob.glob(os.path.join(dump_dir, "*thunk_metadata.txt")), key=os.path.getsize)
  return open(paths[-1], errors="replace").read() if paths else ""


_META = re.compile(r'profile_annotation:\s*"([^"]+)"\s*thunk_id:\s*(\d+)\s*}')


def thunk_names(metadata: str) -> dict[int, str]:
  """Thunk id -> the HLO instruction it runs (its profile annotation), from a dump's metadata."""
  return {int(m.group(2)): m.group(1) for m in _META.finditer(metadata)}


_WHILE_TRIPS = re.compile(r'^\s*(?:ROOT\s+)?%(\S+)\s*=.*?\bwhile\(.*?"known_trip_count":\{"n":"(\d+)"\}', re.M)


def while_trip_counts(metadata: str, hlo: str) -> dict[int, int]:
  """Thunk id -> trip count, for every ``kWhile`` thunk whose HLO ``while`` carries XLA's
  ``known_trip_count`` (a ``lax.scan``, a ``fori_loop`` with static bounds). ``metadata`` is
  the dump's thunk metadata text (``read_thunk_metadata``), ``hlo`` the optimized module."""
  trips = {m.group(1): int(m.group(2)) for m in _WHILE_TRIPS.finditer(hlo)}
  return {tid: trips[name] for tid, name in thunk_names(metadata).items() if name in trips}


_HLO_DEF = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(\([^=]*?\)|\S+)\s", re.M)
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def hlo_shapes(hlo: str) -> dict[str, list[tuple[str, int]]]:
  """Instruction name -> its result's arrays as (dtype, elements), from an optimized HLO module
  (a tuple result lists each element)."""
  out = {}
  for m in _HLO_DEF.finditer(hlo):
    arrays = []
    for dt, dims in _ARRAY.findall(m.group(2)):
      n = 1
      for x in dims.split(","):
        n *= int(x) if x else 1
      arrays.append((dt, n))
    out[m.group(1)] = arrays
  return out


def step_copies(step: list[dict], names: dict[int, str], shapes: dict[str, list[tuple[str, int]]]) -> list[dict]:
  """The copies one pass over ``step`` always runs: every ``kCopy`` outside conditionals and
  outside loops of unknown trip count (the common path), each ``{name, arrays, bytes, times}``,
  ``times`` the product of the known trip counts around it (a copy inside the scan over layers
  runs once per layer)."""
  out: list[dict] = []

  def visit(thunks, times):
    for t in thunks:
      if t["kind"] == "kCopy":
        name = names.get(t.get("id"), "?")
        arrays = shapes.get(name, [])
        out.append({"name": name, "arrays": arrays, "times": times,
                    "bytes": sum(n * _DTYPE_BYTES.get(dt, 4) for dt, n in arrays)})
      visit(t["children"], times)
      if t["kind"] == "kWhile" and "trip_count" in t:
        visit(t["sections"].get("body", []), times * t["trip_count"])

  visit(step, 1)
  return out


def weight_or_page_copies(copies: list[dict], forbidden: dict[int, str]) -> list[dict]:
  """The copies among ``copies`` (``step_copies``) with an array of a forbidden size: a key > 0
  of ``forbidden`` is an exact element count, a key < 0 a minimum (``scripts/gate/gpu_compile.py``
  passes one layer's weight slices and one layer's pages)."""
  bad = []
  for c in copies:
    for _, n in c["arrays"]:
      what = forbidden.get(n) or next((w for k, w in forbidden.items() if k < 0 and n >= -k), None)
      if what:
        bad.append({"name": c["name"], "elements": n, "what": what, "times": c["times"]})
  return bad


# ------------------------------------------------------------------------------ PTX and HLO
def mma_kind(ptx: str) -> str | None:
  """The matrix instruction family a PTX kernel uses: "wgmma" (Hopper warpgroup MMA),
  "mma.sync" (Ampere-style warp MMA), or None (no tensor-core MMA)."""
  if re.search(r"\bwgmma\.mma_async", ptx):
    return "wgmma"
  if re.search(r"\bmma\.sync", ptx):
    return "mma.sync"
  return None


def ptx_entries(dump_dir: str) -> dict[str, dict]:
  """Kernel entry name -> {target, mma, pipeline} for every PTX file of a dump; ``pipeline`` is
  the main loop's facts (``perf_model.pipeline``: bytes per iteration, commit groups, the
  ``cp.async.wait_group`` depth, stages in flight) the performance model reads."""
  from scripts.gate import perf_model
  out = {}
  for path in glob.glob(os.path.join(dump_dir, "**", "*.ptx"), recursive=True):
    text = open(path, errors="replace").read()
    target = re.search(r"^\.target\s+(\w+)", text, re.M)
    for m in re.finditer(r"\.entry\s+(\w+)", text):
      body = perf_model.entry_text(text, m.group(1))
      out[m.group(1)] = {"ptx_target": target.group(1) if target else None, "mma": mma_kind(body),
                         "pipeline": dataclasses.asdict(perf_model.pipeline(body))}
  return out


def hlo_control_flow(hlo: str) -> dict:
  """Counts of ``while`` and ``conditional`` instructions in an optimized HLO module."""
  return {"while": len(re.findall(r"=\s*\S.*?\bwhile\(", hlo)),
          "conditional": len(re.findall(r"=\s*\S.*?\bconditional\(", hlo))}


def kv_read_lower_bound(kv_bytes: int, bandwidth_bytes_per_s: float) -> float:
  """Seconds to read ``kv_bytes`` of K/V at full memory bandwidth: a step cannot be faster."""
  return kv_bytes / bandwidth_bytes_per_s



# ------------------------------------------------------------------------- the gate's summary
# The gate writes its full report (every configuration, every fusion's figures: megabytes) where it
# is told, and beside it this summary: per kernel group and per program the counts and figures
# docs/gpu-gate.md's tables show, small enough to commit (results/gpu_compile_summary.json).
_KERNEL_NAMES = {"decode": "paged_decode_attention", "prefill": "paged_prefill_attention",
                 "invariant_attention": "paged_invariant_attention",
                 "write_kv": "write_kv", "copy_blocks": "copy_blocks", "layer_matmul": "layer_matmul"}
_DTYPES = {"bfloat16": 0, "float16": 1, "float32": 2}
_HEADER = ("jax", "targets", "wall_s", "workers", "quick", "counts", "failures", "xla_fusion_spills",
           "decode_step_per_layer")


def _summary_config(spec: dict) -> bool:
  """Whether a kernel configuration is one the summary tables show: block size 16, GQA 4, large
  size on sm_90 (the ``matrix`` purpose), and every ``sm_80`` one (GQA 8)."""
  return (spec["purpose"] == "matrix" and spec.get("block_size") == 16 and spec.get("group") == 4
          and spec.get("size") == "large") or spec["purpose"] == "sm_80"


def _figures(src: dict, kernel: str) -> dict:
  """The project kernel's figures in a compiled configuration (its source when it is the same
  kernel as another), with the configuration's status and spilled bytes."""
  k = (src.get("kernels") or {}).get(_KERNEL_NAMES[kernel]) or {}
  out = {"status": src.get("status"), "spills": sum((src.get("spills") or {}).values())}
  out.update({f: k[f] for f in ("registers", "shared_memory_bytes", "grid", "threads", "mma") if f in k})
  return out


def summarize(report: dict) -> dict:
  """The gate's summary of a full report (a summary is returned as it is):

  * the report's header (JAX version, targets, counts, failures, XLA's own spills);
  * ``groups``: per target, kernel and purpose, the configurations and how many compiled, were the
    same kernel as another, were refused or failed, and the most registers and spilled bytes;
  * ``attention``: the kernels at block size 16, GQA 4 (8 on sm_80), large size, one row each;
  * ``layer_matmul``: the stacked-weight projection's bfloat16 rows;
  * ``knobs``: per attention kernel, dtype, head_dim and knob (``none``: the tiling table's rows),
    the most registers and spilled bytes over its configurations;
  * ``programs``: per whole program, its status, the per-step launches, syncs, copies and kernels
    (least and most), its temporary memory, compile time and K/V read bound."""
  if "kernels" not in report:
    return report
  kernels = report.get("kernels", [])
  by_name = {r.get("name"): r for r in kernels if r.get("name")}

  def source(r):
    return by_name.get(r.get("same_as"), r) if r.get("status") == "same_kernel_as" else r

  groups: dict[tuple, dict] = {}
  attention, matmul, knobs = [], [], {}
  for r in kernels:
    s, src = r["spec"], source(r)
    fig = _figures(src, s["kernel"]) if s["kernel"] in _KERNEL_NAMES else {"status": src.get("status")}
    g = groups.setdefault((s.get("target"), s["kernel"], s["purpose"]), {
        "target": s.get("target"), "kernel": s["kernel"], "purpose": s["purpose"], "configurations": 0,
        "compiled": 0, "same_kernel_as": 0, "refused": 0, "failed": 0, "max_registers": 0, "spills": 0})
    g["configurations"] += 1
    g[r.get("status") if r.get("status") in ("compiled", "same_kernel_as", "refused") else "failed"] += 1
    g["max_registers"] = max(g["max_registers"], fig.get("registers") or 0)
    g["spills"] = max(g["spills"], fig.get("spills") or 0)
    key = {"target": s.get("target"), "kernel": s["kernel"], "dtype": s.get("dtype")}
    if s["kernel"] in ("decode", "prefill", "write_kv", "copy_blocks") and _summary_config(s):
      attention.append(dict(key, head_dim=s["head_dim"], **fig))
    elif s["kernel"] == "layer_matmul" and s["purpose"] == "matmul" and s["dtype"] == "bfloat16":
      row = dict(key, m=s["m"], k=s["k"], n=s["n"], extras=s["extras"], **fig)
      if r.get("grid"):
        row["grid"] = r["grid"]
      matmul.append(row)
    if s["purpose"] in ("knob_row", "table_row") and s["kernel"] in ("decode", "prefill"):
      w = knobs.setdefault((s["kernel"], s["dtype"], s["head_dim"], s.get("knob") or "none"), {
          "kernel": s["kernel"], "dtype": s["dtype"], "head_dim": s["head_dim"], "knob": s.get("knob") or "none",
          "registers": 0, "spills": 0, "configurations": 0, "not_compiled": []})
      w["registers"] = max(w["registers"], fig.get("registers") or 0)
      w["spills"] = max(w["spills"], fig.get("spills") or 0)
      w["configurations"] += 1
      if fig["status"] != "compiled" and fig["status"] not in w["not_compiled"]:
        w["not_compiled"] = sorted(w["not_compiled"] + [fig["status"]])
  programs = []
  for p in report.get("programs", []):
    row = {f: p.get(f) for f in ("program", "target", "layers", "status", "gate", "compile_s")}
    if p.get("status") == "compiled":
      st = p["per_step"]
      row.update(least=st["least"], most=st["most"], copy_bytes=st.get("copy_bytes"),
                 conditionals=st["conditionals"], whiles=st["whiles"],
                 control_flow_in_command_buffers=st["control_flow_in_command_buffers"],
                 temp_bytes=p["memory"]["temp_size_in_bytes"], spills=sum((p.get("spills") or {}).values()),
                 weight_or_page_copies=len(p.get("weight_or_page_copies") or []),
                 kv_read_lower_bound_ms_h200=p.get("kv_read_lower_bound_ms_h200"))
    programs.append(row)
  order = lambda r: json.dumps(r, sort_keys=True)
  perf = _perf_summary(report.get("performance_model"))
  return dict({"what": "The GPU compile gate's summary (scripts/gate/gpu_report.py summarize): per kernel "
                       "group and per program what docs/gpu-gate.md's tables show. The gate writes its "
                       "full report beside it."}, **{k: report.get(k) for k in _HEADER},
              groups=sorted(groups.values(), key=lambda g: (str(g["target"]), g["kernel"], g["purpose"])),
              attention=sorted(attention, key=order),
      layer_matmul=sorted(matmul, key=order), knobs=sorted(knobs.values(), key=order), programs=programs,
      **({"performance_model": perf} if perf else {}))


_PERF_FIELDS = ("low_us", "high_us", "roofline_us", "fraction", "attainable_fraction", "memory_bound", "bound",
                "ctas", "resident", "resident_limit", "stages", "inflight_per_sm", "vs_plain_copy")


def _perf_summary(pm: dict | None) -> dict | None:
  """The performance model's part of the summary: its assumptions and targets, one row per
  estimated kernel (name, purpose, verdict, the estimate and the compile facts it used), and the
  layout decision with the whole-program sums."""
  if not pm:
    return None
  from scripts.gate import perf_plan
  rows = []
  for r in pm.get("kernels", []):
    m = r.get("model") or {}
    k = (r.get("kernels") or {}).get(r.get("model_kernel"), {})
    rows.append(dict({"name": perf_plan.spec_name(r["spec"]), "purpose": r["spec"]["purpose"],
                      "gate": r.get("gate"), "registers": k.get("registers"),
                      "shared_memory_bytes": k.get("shared_memory_bytes"), "mma": k.get("mma")},
                     **{f: m[f] for f in _PERF_FIELDS if f in m}))
  return {"assumptions": pm.get("assumptions"), "targets": pm.get("targets"), "kernels": rows,
          "layout": pm.get("layout"), "programs": pm.get("programs")}


def dump_summary(summary: dict, path: str) -> None:
  """Writes a summary with one line per row (a few tens of KB)."""
  lines = ["{"]
  items = list(summary.items())
  for i, (k, v) in enumerate(items):
    end = "," if i + 1 < len(items) else ""
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
      rows = ",\n".join("  " + json.dumps(x, sort_keys=True) for x in v)
      lines.append(f" {json.dumps(k)}: [\n{rows}\n ]{end}")
    else:
      lines.append(f" {json.dumps(k)}: {json.dumps(v, sort_keys=True, default=str)}{end}")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.write("\n".join(lines + ["}"]) + "\n")


def summary_path(report_path: str) -> str:
  """Where the gate writes the summary of a report: beside it, ``*_summary.json`` for
  ``*_report.json`` (``gpu_compile_report.json`` -> ``gpu_compile_summary.json``)."""
  head, name = os.path.split(report_path)
  stem = name[:-len(".json")] if name.endswith(".json") else name
  stem = stem[:-len("_report")] if stem.endswith("_report") else stem
  return os.path.join(head, stem + "_summary.json")


# ------------------------------------------------------------------- docs/gpu-gate.md tables
# Each takes a summary or a full report.
def kernel_table(report: dict, kernels=("decode", "prefill"), targets=("sm_90",)) -> str:
  """One line per (kernel, dtype, head_dim) at block size 16, GQA 4 (8 for sm_80), large size (the
  same kernel stands for GQA 1/4/8 in decode)."""
  lines = ["| target | kernel | dtype | head_dim | registers | spills (B) | shared memory (B) | grid | threads | MMA |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  rows = sorted((r for r in summarize(report)["attention"] if r["kernel"] in kernels and r["target"] in targets),
                key=lambda r: (r["target"], kernels.index(r["kernel"]), _DTYPES[r["dtype"]], r["head_dim"]))
  for r in rows:
    lines.append(f"| {r['target']} | {r['kernel']} | {r['dtype']} | {r['head_dim']} | {r['registers']} | "
                 f"{r['spills']} | {r['shared_memory_bytes']:,} | {r.get('grid')} | {r.get('threads')} | "
                 f"{r.get('mma') or '-'} |" if "registers" in r else f"| {r['target']} | {r['kernel']} | "
                 f"{r['dtype']} | {r['head_dim']} | {r['status']} | | | | | |")
  return "\n".join(lines)


def program_table(report: dict) -> str:
  """One line per whole program."""
  lines = ["| program | layers | kernels / step (least, most) | host launches / step | host syncs / step (least, most) "
           "| copies / step (least), bytes | conditionals, whiles (in CUDA graphs) | temp memory | compile s "
           "| K/V read bound (H200) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for p in summarize(report)["programs"]:
    if p.get("status") != "compiled":
      lines.append(f"| {p['program']} | {p.get('layers')} | {p.get('status')} | | | | | | | |")
      continue
    least, most, copy_bytes, bound = p["least"], p["most"], p.get("copy_bytes"), p.get("kv_read_lower_bound_ms_h200")
    lines.append(
        f"| {p['program']} | {p.get('layers')} | {least['kernels']}, {most['kernels']} | "
        f"{least['host_launches']}, {most['host_launches']} | {least['host_syncs']}, {most['host_syncs']} | "
        f"{least['copies']}, {'-' if copy_bytes is None else f'{copy_bytes / 2**20:.1f} MiB'} | "
        f"{p['conditionals']}, {p['whiles']} ({p['control_flow_in_command_buffers']}) | "
        f"{p['temp_bytes'] / 2**20:.1f} MiB | {p.get('compile_s')} | {f'{bound} ms' if bound else '-'} |")
  return "\n".join(lines)


def markdown_summary(report: dict, kernels=("decode", "prefill"), targets=("sm_90",)) -> str:
  """The kernel table and the whole-program table."""
  return kernel_table(report, kernels, targets) + "\n\n" + program_table(report)


def matmul_summary(report: dict, dtypes=("bfloat16",)) -> str:
  """docs/gpu-gate.md's ``layer_matmul`` table: per target, dtype (of ``dtypes``) and (M, K, N), the
  kernel's registers, spills, shared memory and grid (compiled at 32 stacked layers)."""
  lines = ["| target | dtype | M, K, N | prologue / epilogue | registers | spills (B) | shared memory (B) | grid |",
           "|---|---|---|---|---|---|---|---|"]
  rows = sorted((r for r in summarize(report)["layer_matmul"] if r["dtype"] in dtypes),
                key=lambda r: (r["target"], _DTYPES[r["dtype"]], r["k"], r["n"], r["m"], r["extras"]))
  for r in rows:
    lines.append(f"| {r['target']} | {r['dtype']} | {r['m']}, {r['k']}, {r['n']} | {r['extras']} | "
                 f"{r.get('registers', r['status'])} | {r['spills']} | {r.get('shared_memory_bytes', 0):,} | "
                 f"{r.get('grid')} |")
  return "\n".join(lines)


def knob_summary(report: dict) -> str:
  """docs/gpu-gate.md's knob table: per (kernel, dtype, head_dim, knob), the most registers and spill
  bytes of the attention kernel over every knob configuration compiled (both targets, every
  block size), beside the same row without knobs (``table_row`` configurations), so a knob
  that brings a row to the register limit shows."""
  worst = {(w["kernel"], w["dtype"], w["head_dim"], w["knob"]): w for w in summarize(report)["knobs"]}
  knobs = sorted({k[3] for k in worst if k[3] != "none"})
  lines = ["| kernel | dtype | head_dim | registers, no knob | " + " | ".join(
               f"registers, {n}" for n in knobs) + " | spills (B) | configurations |",
           "|---|---|---|---|" + "---|" * len(knobs) + "---|---|"]
  rows = sorted({k[:3] for k in worst if k[3] != "none"},
                key=lambda k: (k[0] != "decode", _DTYPES[k[1]], k[2]))
  for kernel, dt, d in rows:
    cells = [worst.get((kernel, dt, d, n)) for n in ["none"] + knobs]
    regs = [f"{c['registers']}" + (f" ({', '.join(c['not_compiled'])})" if c["not_compiled"] else "")
            if c else "-" for c in cells]
    spill = max(c["spills"] for c in cells if c)
    count = sum(c["configurations"] for c in cells[1:] if c)
    lines.append(f"| {kernel} | {dt} | {d} | " + " | ".join(regs) + f" | {spill} | {count} |")
  return "\n".join(lines)


def _kernel_figures(report: dict, kernels: tuple[str, ...]) -> dict[tuple, dict]:
  """(target, kernel, dtype, head_dim) -> the attention kernel's compile figures at block size 16,
  GQA 4 (8 on sm_80), large size, from a gate report or summary."""
  return {(r["target"], r["kernel"], r["dtype"], r["head_dim"]):
          {k: v for k, v in r.items() if k not in ("target", "kernel", "dtype", "head_dim")}
          for r in summarize(report)["attention"] if r["kernel"] in kernels}


def version_comparison(old: dict, new: dict, kernels=("decode", "prefill")) -> str:
  """A table of the decode and prefill kernels compiled by two gate reports (or summaries) side by
  side (made with two JAX releases): registers, spills, shared memory and the MMA family,
  ``old / new``."""
  a, b = _kernel_figures(old, kernels), _kernel_figures(new, kernels)
  va, vb = old.get("jax", "?"), new.get("jax", "?")
  lines = [f"| target | kernel | dtype | head_dim | registers (JAX {va} / {vb}) | spills (B) | "
           f"shared memory (B) | MMA |", "|---|---|---|---|---|---|---|---|"]

  def pair(key, field, fmt=str):
    x, y = a.get(key, {}).get(field), b.get(key, {}).get(field)
    return " / ".join("-" if v is None else fmt(v) for v in (x, y))

  for key in sorted(set(a) | set(b), key=lambda k: (k[0] != "sm_90", kernels.index(k[1]), _DTYPES[k[2]], k[3])):
    lines.append(f"| {' | '.join(map(str, key))} | {pair(key, 'registers')} | {pair(key, 'spills')} | "
                 f"{pair(key, 'shared_memory_bytes', lambda v: f'{v:,}')} | {pair(key, 'mma')} |")
  return "\n".join(lines)


# The tables docs/gpu-gate.md holds between `<!-- NAME:begin -->` and `<!-- NAME:end -->` markers.
def perf_table(report: dict, purposes=("perf",)) -> str:
  """The performance model's estimates, one line per kernel at its named shape (an estimate, under
  the assumptions of ``scripts/gate/perf_model.py``)."""
  pm = summarize(report).get("performance_model") or {"kernels": []}
  lines = ["| kernel at shape | estimate (us) | roofline (us) | of roofline | bound | CTAs | resident/SM | stages "
           "| in flight/SM (B) | gate |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in pm["kernels"]:
    if r["purpose"] not in purposes or "low_us" not in r:
      continue
    frac = f"{r['fraction'][0]:.0%}-{r['fraction'][1]:.0%}"
    if r.get("memory_bound") is False:
      frac += f" ({r['attainable_fraction']:.0%} of its MMA's best)"
    if r.get("vs_plain_copy") is not None:
      frac += f" ({r['vs_plain_copy']:.0%} of XLA's copy)"
    gate = "pass" if r["gate"] == "pass" else "**" + str(r["gate"]).replace("|", "/")[:90] + "**"
    lines.append(f"| {r['name']} | {r['low_us']:,.2f}-{r['high_us']:,.2f} | {r['roofline_us']:,.2f} | {frac} | "
                 f"{r['bound']} | {r['ctas']:,} | {r['resident']} ({r['resident_limit']}) | {r['stages']} | "
                 f"{r['inflight_per_sm']:,} | {gate} |")
  return "\n".join(lines)


def perf_checks_table(report: dict) -> str:
  """The model's sanity checks and the rule-breaking variants."""
  return perf_table(report, ("perf_sanity", "perf_rule_check"))


def layout_table(report: dict) -> str:
  """The single-GPU layout decision: the 8B decode step in both layouts by the model."""
  pm = summarize(report).get("performance_model") or {}
  lay = pm.get("layout") or {"shapes": [], "compiled": {}}
  lines = ["| batch x context | stacked + layer_matmul (ms) | per-layer + XLA GEMMs (ms) | roofline (ms) | faster "
           "| margin |", "|---|---|---|---|---|---|"]
  for x in lay["shapes"]:
    st, pl = x["stacked"], x["per_layer"]
    lines.append(f"| {x['batch']} x {x['context']} | {st['low_ms']:.2f}-{st['high_ms']:.2f} | "
                 f"{pl['low_ms']:.2f}-{pl['high_ms']:.2f} | {st['roofline_ms']:.2f} | {x['faster']} | "
                 f"{x['margin']:.2f}x |")
  if lay.get("faster"):
    lines.append(f"\nOver these shapes (geometric mean) the {lay['faster']} layout is faster by "
                 f"{lay['margin']:.2f}x; the engines run the {lay['engine_layout']} layout on one GPU.")
  for name, c in sorted(lay.get("compiled", {}).items()):
    lines.append(f"\n{name}: `{c['program']}` compiles in {c['compile_s']} s, "
                 f"{c['kernels_per_step']} kernels per step.")
  return "\n".join(lines)


DOC_TABLES = {"gate_knobs": knob_summary, "gate_kernels": kernel_table, "gate_programs": program_table,
              "gate_layer_matmul": matmul_summary, "gate_perf": perf_table, "gate_perf_checks": perf_checks_table,
              "gate_layout": layout_table}
SUMMARY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "results", "gpu_compile_summary.json")


def main(argv=None) -> int:
  import argparse
  ap = argparse.ArgumentParser(description="docs/gpu-gate.md's tables from the gate's summary (or a full report).")
  ap.add_argument("report", nargs="?", default=SUMMARY, help=f"a summary or a full report (default {SUMMARY})")
  ap.add_argument("--update-docs", action="store_true", help="rewrite the tables in docs/gpu-gate.md")
  ap.add_argument("--summarize", metavar="OUT", help="write the summary of a full report to OUT")
  ap.add_argument("--compare", nargs="+", metavar="JSON",
                  help="OLD NEW [BY_JAX_OUT]: the attention kernels of two reports or summaries side by side; "
                       "with BY_JAX_OUT, also write the figures both columns come from")
  a = ap.parse_args(argv)
  if a.compare:
    old, new = (json.load(open(p)) for p in a.compare[:2])
    print(version_comparison(old, new))
    if len(a.compare) > 2:  # the figures both tables come from, small enough to keep
      kernels = ("decode", "prefill")
      by_jax = {r["jax"]: {" ".join(map(str, k)): v for k, v in _kernel_figures(r, kernels).items()}
                for r in (old, new)}
      with open(a.compare[2], "w") as f:
        json.dump({"what": "decode and prefill kernels at block size 16, GQA 4 (sm_80: GQA 8), large size, "
                           "per JAX release: target kernel dtype head_dim -> figures",
                   "by_jax": by_jax}, f, indent=1, sort_keys=True)
    return 0
  with open(a.report) as f:
    summary = summarize(json.load(f))
  if a.summarize:
    dump_summary(summary, a.summarize)
    print(f"wrote {a.summarize}")
  tables = {name: fn(summary) for name, fn in DOC_TABLES.items()}
  if a.update_docs:
    from scripts import doc_tables
    for name, markdown in tables.items():
      doc_tables.replace_block(name, markdown, doc_tables.GPU_GATE)
  elif not a.summarize:
    print("\n\n".join(tables.values()))
  return 0


if __name__ == "__main__":
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  sys.exit(main())
