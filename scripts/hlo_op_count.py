"""HLO op count of the Llama's compiled paged decode step: the model protocol must add nothing.

Lowers and compiles ``paged_kv.models.paged_decode_step`` for the tiny Llama (4 sequences, 16-token blocks)
with the XLA reference kernels and with the Pallas kernels in interpret mode (which inlines the
kernel bodies as HLO, so a change to the kernels' default program shows too), and counts the
instructions of the HLO before and after XLA's optimisations, with a histogram by opcode. Only
APIs that exist before and after the protocol are used, so the same script runs on an older
checkout:

    python scripts/hlo_op_count.py --label after                         # this checkout
    PYTHONPATH=/tmp/base python scripts/hlo_op_count.py --label before   # e.g. `git archive main`
    python scripts/hlo_op_count.py --compare results/hlo_op_count.json   # both in one file

Writes (merges into) ``results/hlo_op_count.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

import paged_kv.models as models
from paged_kv.models import allocate_pages, init_model, make_paged_batch, page_spec, paged_decode_step, tiny

OUT = Path(__file__).resolve().parent.parent / "results" / "hlo_op_count.json"
# An HLO instruction: "[ROOT] %name = type opcode(...)" (one per line in the text dump).
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = .*?\b([a-z][a-z0-9\-]*)\(")


def count(hlo_text: str) -> tuple[int, dict]:
    ops = collections.Counter()
    for line in hlo_text.splitlines():
        m = INSTR.match(line)
        if m:
            ops[m.group(1)] += 1
    return sum(ops.values()), dict(sorted(ops.items()))


def measure(impl: str) -> dict:
    model = init_model(tiny(), seed=0)
    graphdef, state = nnx.split(model)
    b, bs, m = 4, 16, 4
    pages = allocate_pages(page_spec(model.config, 1 + b * m, bs))
    tables = jnp.arange(1, 1 + b * m, dtype=jnp.int32).reshape(b, m)
    batch = make_paged_batch(tables, jnp.array([3, 17, 40, 0], jnp.int32), jnp.array([1, 1, 1, 0], jnp.int32), 1, bs)
    lowered = paged_decode_step.lower(graphdef, state, pages, batch, jnp.zeros((b,), jnp.int32), impl=impl)
    before, before_ops = count(lowered.as_text(dialect="hlo"))
    compiled = lowered.compile().as_text()
    after, after_ops = count(compiled)
    return {"hlo_ops_unoptimized": before, "hlo_ops_optimized": after, "optimized_by_opcode": after_ops,
            "unoptimized_by_opcode": before_ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="current")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--compare", type=Path, help="print the labels of this results file side by side and exit")
    args = ap.parse_args()
    if args.compare:
        data = json.loads(args.compare.read_text())
        for impl in ("reference", "interpret"):
            row = {label: (d[impl]["hlo_ops_unoptimized"], d[impl]["hlo_ops_optimized"]) for label, d in data.items()}
            print(f"{impl}: " + ", ".join(f"{k}: {u} unoptimized / {o} optimized" for k, (u, o) in row.items()))
            hists = {json.dumps(d[impl]["optimized_by_opcode"], sort_keys=True) for d in data.values()}
            print(f"  optimized opcode histograms {'identical' if len(hists) == 1 else 'DIFFER'} across labels")
        return
    from paged_kv import pallas_kernels
    res = {"jax": jax.__version__, "models_file": paged_kv.models.__file__, "pallas_kernels_file": paged_kv.pallas_kernels.__file__,
           "has_protocol": hasattr(models, "protocol")}
    for impl in ("reference", "interpret"):
        res[impl] = measure(impl)
        print(f"{args.label} {impl}: {res[impl]['hlo_ops_unoptimized']} HLO ops unoptimized, "
              f"{res[impl]['hlo_ops_optimized']} optimized")
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data[args.label] = res
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
