"""What ``layer_matmul`` must do at one shape, for the performance model (``perf_model.Work``).

The figures follow the kernel's own tile choice (:func:`paged_kv.pallas_kernels.stacked_matmul.plan`,
plain Python), so the model reads the same tiles, split count and K steps the compiled kernel
runs:

* ``bytes``: one layer's weight ``K x N``, the activations ``M x K``, the result ``M x N`` and
  the optional norm weight ``K`` and bias ``N``, in the activations' itemsize: what must cross
  HBM at least once. A group (q|k|v, gate|up: one launch over weights side by side) counts the
  sum of its widths as ``N`` (its weights, results and biases).
* ``extra_bytes``: with a split K, the float32 partials ``[splits, M, N]`` the kernel writes and
  the sum reads back (``2 x 4 x splits x M x N``). Not counted: the weight tile re-read by the
  other row blocks when ``M > bm``, and ``x`` re-read by every column block. Program ``(i, j, s)``
  is launched with ``i`` fastest (grid axis 0 is CUDA's x), so the row blocks that share a weight
  tile run side by side and the re-reads meet that tile in L2; ``x`` (at most a few MB) stays in
  L2 for the whole launch. An assumption, not a measurement.
* ``step_bytes``: the weight tile ``bk x bn`` one program streams per K step. The ``x`` tile it
  also loads is an L2 hit after the first column block: it holds no DRAM bytes in flight.
* ``steps``: K steps of one program (``ceil(K / bk / splits)``).
* ``step_flops``: ``2 x bm x bk x bn`` (the padded tile the MMA computes).
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from scripts.gate import perf_model

PARTIAL_ITEMSIZE = 4  # the split's partials are float32


def matmul_work(m: int, k: int, n: int | tuple[int, ...], itemsize: int, has_scale: bool,
                has_bias: bool, config: dict | None = None) -> perf_model.Work:
  """``perf_model.Work`` of one ``layer_matmul`` launch: ``[m, k] @ [k, n]`` in a dtype of
  ``itemsize`` bytes, with the norm weight (``has_scale``) and bias (``has_bias``, one per
  weight) when given, at the tiles :func:`~paged_kv.pallas_kernels.stacked_matmul.plan` chooses.
  ``n`` may be a group's widths ``(N_1, N_2, ...)``: one launch over their sum. ``config``: the
  fields of a ``Plan`` that overrides the kernel's own (a rule-check variant's)."""
  from paged_kv.pallas_kernels import stacked_matmul
  p = stacked_matmul.Plan(**config) if config else stacked_matmul.plan(m, k, n, itemsize, has_scale)
  n = sum(n) if isinstance(n, tuple) else n
  total_steps = k // p.bk
  steps = -(-total_steps // p.splits)
  splits = -(-total_steps // steps)  # as the kernel runs it: no empty split
  must = k * n + m * k + m * n + (k if has_scale else 0) + (n if has_bias else 0)
  partials = 2 * PARTIAL_ITEMSIZE * splits * m * n if splits > 1 else 0
  return perf_model.Work(bytes=must * itemsize, flops=2 * m * k * n, step_bytes=p.bk * p.bn * itemsize,
                         steps=steps, step_flops=2 * p.bm * p.bk * p.bn, extra_bytes=partials)


if __name__ == "__main__":  # python scripts/gate/perf_work_matmul.py M K N[,N2,...] [itemsize]: plan and Work
  from paged_kv.pallas_kernels import stacked_matmul
  m_, k_ = int(sys.argv[1]), int(sys.argv[2])
  n_ = tuple(int(a) for a in sys.argv[3].split(","))
  n_ = n_ if len(n_) > 1 else n_[0]
  size = int(sys.argv[4]) if len(sys.argv) > 4 else 2
  print(stacked_matmul.plan(m_, k_, n_, size))
  print(matmul_work(m_, k_, n_, size, has_scale=False, has_bias=False))
