"""Fingerprints of the optimized XLA:CPU programs of the block manager's operations and of the
serving step: the instruction count and a hash of the instruction list with names and metadata
left out, so two checkouts can be compared ("the CPU programs did not change")::

    PYTHONPATH=<checkout> python scripts/cpu_hlo_fingerprint.py --out /tmp/a.json   # run from <checkout>
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re

import jax
import jax.numpy as jnp

_INSTR = re.compile(r"\s+(ROOT )?%\S+ = ")


def fingerprint(text: str) -> dict:
    lines = [re.sub(r"%[\w.\-]+", "%x", re.sub(r", metadata=\{[^}]*\}", "", line)).strip()
             for line in text.splitlines() if _INSTR.match(line)]
    return {"instructions": len(lines), "sha": hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]}


def manager_programs() -> dict:
    from paged_kv.config import ManagerConfig
    out = {}
    for pc in (True, False):
        mgr = ManagerConfig(num_blocks=1025, block_size=16, max_seqs=64, max_blocks_per_seq=64, prefix_caching=pc)
        for name, (fn, args) in _manager_progs(mgr, pc).items():
            text = jax.jit(fn, donate_argnums=0).lower(*args).compile().as_text()
            out[f"{name}/{'prefix_caching' if pc else 'plain'}"] = fingerprint(text)
    return out


def _manager_progs(mgr, pc: bool) -> dict:
    """{name: (function, abstract arguments)} of the manager's programs under ``mgr``."""
    from paged_kv import admission, allocate, fused, reclaim, share
    from paged_kv.state import init_state
    st = jax.eval_shape(lambda: init_state(mgr))
    v = jax.ShapeDtypeStruct((64,), jnp.int32)
    a4 = jax.ShapeDtypeStruct((4,), jnp.int32)
    return {
        "append": (lambda s, i, t: allocate.append(mgr, s, i, t if pc else None), (st, v, v)),
        "free": (lambda s, i: reclaim.free(mgr, s, i), (st, v)),
        "select": (lambda s, i, p: share.select(mgr, s, i, p), (st, v, v)),
        "fork": (lambda s, i, p: share.fork(mgr, s, i, p), (st, v, v)),
        "free_then_select": (lambda s, f, i, p: fused.free_then_select(mgr, s, f, i, p), (st, v, v, v)),
        "admit": (lambda s, i, n, t, sa: admission.admit(mgr, s, i, n, t if pc else None, sa),
                  (st, a4, a4, jax.ShapeDtypeStruct((4, 1024), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.uint32))),
    }


def serving_step_programs() -> dict:
    import paged_kv as pk
    from paged_kv.engine.serving import ServingConfig, ServingEngine
    from paged_kv.models import load_hf_checkpoint
    mgr = pk.ManagerConfig(num_blocks=24, block_size=16, max_seqs=16, max_blocks_per_seq=16)
    cfg = ServingConfig(mgr, chunk_size=32, max_prefill_rows=4, top_candidates=8, impl="reference", decode_steps=1)
    eng = ServingEngine(load_hf_checkpoint("checkpoints/tiny-llama"), cfg, seed=0)
    return {f"serving_step/prefill_rows={p}": fingerprint(eng.device.lower_step(p).compile().as_text()) for p in (0, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-serving", action="store_true", help="manager operations only")
    a = ap.parse_args(argv)
    out = manager_programs()
    if not a.no_serving:
        out.update(serving_step_programs())
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
