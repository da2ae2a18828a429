"""Copies XLA:GPU adds to the block manager's programs, with their byte sizes, at several pool
sizes (issue 15: no per-step copy may grow with ``num_blocks``).

Deviceless XLA:GPU for sm_90, like the gate (``scripts/gpu_compile.py``), but only the manager's
programs and at the pool sizes asked for. A copy is an unfused ``copy`` instruction of the optimized HLO
(the ``kCopy`` thunks of the thunk sequence come from them), listed with its shape, its bytes and
the computation it sits in; ``copy_bytes_least_path`` adds up those on the path the gate's
"least" figures follow (cheapest branch of each conditional, no while trip), where the common
path's copies are (a lower bound for a program whose common branch is not its cheapest).
Run in the gate's CUDA environment::

    ENV=$(ls -d ~/.cache/paged-kv/gpu-env-*/ | grep -v bootstrap | head -1)
    PYTHONPATH=$PWD $ENV/bin/python scripts/gpu_manager_copies.py --blocks 16385 100001 \\
        --out results/gpu_manager_copies.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from scripts import gpu_compile  # noqa: E402,F401  (sets the deviceless environment before JAX loads)
from scripts import gpu_report  # noqa: E402

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COPY = re.compile(r"^\s*(?:ROOT\s+)?(\S+)\s*=\s*(\w+)\[([\d,]*)\]\{[^}]*\}\s+copy\(")
_COMP = re.compile(r"^(?:ENTRY\s+)?(%?[\w.\-]+)\s.*\{\s*$")


def hlo_copies(hlo: str) -> list[dict]:
  """Every ``copy`` of an optimized HLO module: name, dtype, shape, bytes and computation."""
  out, comp = [], None
  for line in hlo.splitlines():
    m = _COMP.match(line)
    if m and not line.startswith(" "):
      comp = m.group(1)
      continue
    c = _COPY.match(line)
    if c:
      dims = [int(x) for x in c.group(3).split(",") if x]
      n = 1
      for d in dims:
        n *= d
      out.append({"name": c.group(1), "dtype": c.group(2), "shape": dims,
                  "bytes": n * _DTYPE_BYTES.get(c.group(2), 4), "computation": comp})
  return out


_CALLS = re.compile(r"\b(true_computation|false_computation|body|condition)=(%[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def least_path_copy_bytes(hlo: str) -> int:
  """Bytes copied by the program's unfused ``copy`` instructions on its least path, the one the
  gate's "least" figures follow: every conditional takes its cheapest branch (by copied bytes),
  every while runs zero trips (its condition once, not its body)."""
  comps: dict[str, list[str]] = {}
  entry, comp = None, None
  for line in hlo.splitlines():
    m = _COMP.match(line)
    if m and not line.startswith(" "):
      comp = m.group(1)
      comps[comp] = []
      if line.startswith("ENTRY"):
        entry = comp
      continue
    if comp is not None and line.startswith(" "):
      comps[comp].append(line)
  copy_bytes = {}
  for c in hlo_copies(hlo):
    copy_bytes[c["computation"]] = copy_bytes.get(c["computation"], 0) + c["bytes"]
  memo: dict[str, int] = {}

  def cost(name: str) -> int:
    if name not in memo:
      memo[name] = 0
      total = copy_bytes.get(name, 0)
      for line in comps.get(name, []):
        if " conditional(" in line:
          targets = [t for k, t in _CALLS.findall(line) if k.endswith("_computation")]
          b = _BRANCHES.search(line)
          if b:
            targets += [t.strip() for t in b.group(1).split(",")]
          total += min((cost(t) for t in targets), default=0)
        elif " while(" in line:
          total += sum(cost(t) for k, t in _CALLS.findall(line) if k == "condition")
      memo[name] = total
    return memo[name]

  return cost(entry) if entry else 0


def programs(num_blocks: int):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from paged_kv.allocate import append
  from paged_kv.config import ManagerConfig
  from paged_kv.share import fork, free_then_select
  from paged_kv.state import init_state
  from scripts.gpu_compile import LLAMA_BATCH, LLAMA_CONTEXT, _sds, _topology

  _, mesh = _topology("sm_90", 1)
  rep = NamedSharding(mesh, P())
  bs = 16
  r = LLAMA_BATCH
  mgr = ManagerConfig(num_blocks=num_blocks, block_size=bs, max_seqs=r, max_blocks_per_seq=LLAMA_CONTEXT // bs,
                      prefix_caching=True)
  state = jax.tree.map(lambda x: _sds(x.shape, x.dtype, rep), jax.eval_shape(lambda: init_state(mgr)))
  v = _sds((r,), jnp.int32, rep)

  def manager_share(state, free_ids, sel_dst, sel_parent, ids, toks, fork_src, fork_dst):
    state, _, _ = free_then_select(mgr, state, free_ids, sel_dst, sel_parent)
    state, res = append(mgr, state, ids, toks)
    state, _ = fork(mgr, state, fork_src, fork_dst)
    return state, res

  import paged_kv.share as share
  progs = {
      "append": (jax.jit(lambda s, ids, toks: append(mgr, s, ids, toks), donate_argnums=0), (state, v, v)),
      "serving_manager_share": (jax.jit(manager_share, donate_argnums=0), (state, v, v, v, v, v, v, v)),
  }
  if hasattr(share, "free_select_append"):
    def fused_share(state, free_ids, sel_dst, sel_parent, ids, toks, fork_src, fork_dst):
      state, _, _, res, _ = share.free_select_append(mgr, state, free_ids, sel_dst, sel_parent, ids, toks)
      state, _ = fork(mgr, state, fork_src, fork_dst)
      return state, res
    progs["serving_manager_share"] = (jax.jit(fused_share, donate_argnums=0), (state, v, v, v, v, v, v, v))
  return progs


def measure(num_blocks: int, names) -> dict:
  out = {}
  for name, (fn, args) in programs(num_blocks).items():
    if names and name not in names:
      continue
    lowered = fn.trace(*args).lower()
    with tempfile.TemporaryDirectory() as d:
      with gpu_compile._stderr_to(os.path.join(d, "xla.log")):
        compiled = lowered.compile({"xla_dump_to": os.path.join(d, "dump")})
      thunk_text = gpu_report.read_thunk_files(os.path.join(d, "dump"))
      if os.environ.get("KEEP_THUNKS"):
        with open(os.path.join(os.environ["KEEP_THUNKS"], f"{name}_{num_blocks}.thunks.txt"), "w") as f:
          f.write(thunk_text)
        with open(os.path.join(os.environ["KEEP_THUNKS"], f"{name}_{num_blocks}.hlo.txt"), "w") as f:
          f.write(compiled.as_text())
      thunks = gpu_report.parse_thunks(thunk_text)
    copies = hlo_copies(compiled.as_text())
    summary = gpu_report.thunk_summary(thunks)
    entry = [c for c in copies if c["computation"] and "main" in c["computation"]]
    out[name] = {
        "least": summary["least"], "conditionals": summary["conditionals"], "whiles": summary["whiles"],
        "copies": copies,
        "copy_bytes_total": sum(c["bytes"] for c in copies),
        "copy_bytes_entry": sum(c["bytes"] for c in entry),
        "copy_bytes_least_path": least_path_copy_bytes(compiled.as_text()),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
    }
    print(f"num_blocks={num_blocks} {name}: least {summary['least']}, {len(copies)} copies "
          f"{out[name]['copy_bytes_total']:,} B in all; on the least path {out[name]['copy_bytes_least_path']:,} B",
          flush=True)
    for c in sorted(copies, key=lambda c: -c["bytes"])[:8]:
      print(f"    {c['bytes']:>12,} B {c['dtype']}{c['shape']} in {c['computation']}")
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--blocks", type=int, nargs="+", default=[16385, 100001])
  ap.add_argument("--programs", nargs="*", default=None)
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  report = {str(n): measure(n, a.programs) for n in a.blocks}
  if a.out:
    with open(a.out, "w") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
