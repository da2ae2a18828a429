"""The GPU the kernels' launch plans are sized for, stated once: an NVIDIA H200 (sm_90, SXM).

The H100 is the same chip with less and slower memory (80 GB at 3.35 TB/s): the same SMs, shared
memory and bf16 rate, so a plan sized here suits it too. Public datasheet figures, except the
ones marked as assumptions. Read by the decode kernel's split rule
(``decode_attention.split_time``), the ``layer_matmul`` tile plan (``stacked_matmul.plan``) and
the GPU gate: its performance model (``scripts/gate/perf_model.py``), its compile targets
(``scripts/gate/gpu_compile_plan.py``) and its K/V read bounds.

Plain Python that imports nothing: the gate's plain-Python modules load this file directly, so
they stay free of JAX (importing it as ``paged_kv.pallas_kernels.gpu_figures`` runs the package's
``__init__``, which imports JAX).
"""

H200_NAME = "NVIDIA H200"
H200_SMS = 132
"""Streaming multiprocessors."""
H200_FP32_PER_SM = 128
"""FP32 units per SM."""
H200_BANDWIDTH = 4.8e12
"""Peak HBM3e bandwidth, bytes/s (the roofline's). Measured on the lent H200s: a device-to-device
copy moves about 4.3e12 bytes/s read and written."""
H200_ACHIEVABLE = 0.92
"""Assumption: the fraction of ``H200_BANDWIDTH`` a streaming kernel sustains at best (STREAM-like
copies reach about 0.9)."""
H200_SUSTAINED_BANDWIDTH = H200_ACHIEVABLE * H200_BANDWIDTH
"""Bytes/s a well-fed streaming kernel moves: what the launch plans divide by."""
H200_LATENCY_S = (0.4e-6, 0.7e-6)
"""Assumption: a DRAM round trip under load, low and high end, seconds (public microbenchmarks
quote about 0.3-0.6 us unloaded). The plans size for the high end."""
H200_DENSE_FLOPS = 989e12
"""Dense bf16 tensor-core FLOP/s."""
H200_SMEM_PER_SM = 233_472
"""Shared memory per SM, bytes."""
H200_SMEM_OPTIN = 232_448
"""Shared memory one block may opt in to, bytes (227 KiB)."""
H200_L2_BYTES = 52_428_800
H200_CLOCK_GHZ = 1.98
H200_MEMORY_BYTES = 151_397_597_184
"""HBM3e capacity (141 GB)."""
