"""The GPU compile gate and the GPU check.

* ``gpu_compile``: the gate (run by ``scripts/gpu_gate.sh`` in its own CUDA environment);
* ``gpu_compile_plan``: what it compiles and what fails (plain Python);
* ``gpu_report``: reading XLA:GPU's output, the small summary the gate commits
  (``results/gpu_compile_summary.json``) and docs/gpu-gate.md's tables from it (plain Python);
* ``gpu_check``: the checks for a machine with a GPU (run by ``scripts/gpu_check.sh``).

Nothing is imported here, so ``scripts.gate.gpu_report`` and ``scripts.gate.gpu_compile_plan`` load
without JAX."""
