"""The checkout's benchmarks and tools (not installed): the benchmarks and the tools that build the
built-in checkpoint sit in this folder, the GPU compile gate and the GPU check in ``scripts.gate``.
Tests import them as ``scripts.<name>`` from the repository root."""
