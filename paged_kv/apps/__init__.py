"""Programs built on the library, outside its core: the ``python -m paged_kv`` command line
(``cli``, which runs a job; ``options``, its options and their checks; ``workload``, the built-in
workload; ``prompts``, your prompts and their stream; ``interrupt``, Ctrl-C), its report and
picture (``report``), its block-manager walkthrough (``walkthrough``),
its progress bars (``progress``), the record of how a run was made and its atomic file writes
(``provenance``), and the trace readers of the sharing benchmark (``traces``).
Nothing in ``paged_kv``'s core, ``paged_kv.engine``, ``paged_kv.models`` or
``paged_kv.pallas_kernels`` imports this package."""
