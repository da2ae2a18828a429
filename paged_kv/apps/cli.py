"""``python -m paged_kv`` / ``paged-kv``: serve a ready-made workload and report on the KV cache.

The workload mixes prompts from the built-in tiny model's domain (stories, animal facts, Q&A,
counting, days, sums): some share a Q&A preamble (prefix-cache hits), some ask for ``n = 4``
parallel samples, some for beam search of width 4, all arriving over time into a block pool small
enough that requests get preempted and re-admitted. It ends with a report (throughput, peak
blocks, KV memory saved by sharing, prefix-cache hit rate, preemptions) and a picture of one
request family's block tables, in the terminal and as a PNG. The files (the report as JSON and
the PNG) go to an output folder, ``paged-kv-out/`` by default (``--out-dir``), created if missing;
the report records how the run was made (``paged_kv.apps.provenance``). A run refuses to replace
an earlier run's files unless ``--overwrite``; Ctrl-C while serving writes a partial report.

    python -m paged_kv                       # the built-in checkpoints/tiny-llama
    python -m paged_kv --checkpoint DIR      # a Hugging Face Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 folder
    python -m paged_kv --checkpoint DIR --prompt "Once upon a time" --prompt "The cow says" --n 2
                                             # your prompts instead of the workload, streamed as generated
    python -m paged_kv --out-dir runs/a      # write report.json and block_tables.png there
    python -m paged_kv --walkthrough         # the block-manager walkthrough instead

With ``--prompt`` (repeatable) or ``--prompts-file`` the CLI serves those prompts instead of the
workload, with the sampling options of the library (``--n``, ``--beam-width``, ``--temperature``,
``--top-p``, ``--top-k``, ``--max-new-tokens``, ``--seed``); ``--chat`` renders each prompt as a
user message through the checkpoint's chat template. The text streams to the terminal as tokens
are generated (one answer at a time, in prompt order; later answers are held until their turn),
then the report follows. Prompts are tokenized with the checkpoint's own ``tokenizer.json`` (a
Hugging Face tokenizer, through the ``tokenizers`` library) or, for the built-in model, bytes;
the run's header says which.

This module runs a job (``main``: check the options, start JAX, check them against the checkpoint,
load, compile, serve, write the report); its pieces live beside it: the options and their checks
(``options``), the workload (``workload``), your prompts and their stream (``prompts``), Ctrl-C
(``interrupt``), the run's record and atomic writes (``provenance``), the report (``report``)
and the progress lines (``progress``).

How the library works: ``docs/design.md``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paged_kv.apps.interrupt import (
    INTERRUPTED_STATUS,
    first_line,
    flush_streams,
    install_interrupt_handler,
    interrupted_without_handler,
    on_interrupt_write,
    phase,
)
from paged_kv.apps.options import (
    DEFAULT_OUT_DIR,
    OptionCheck,
    UsageError,
    build_parser,
    check_options,
    check_prompts,
    checkpoint_dir,
    missing_cli_dependencies,
    missing_extra_message,
    output_paths,
    sequence_context,
)
from paged_kv.apps.prompts import answers, print_beams, prompt_requests, prompt_seed, stream_prompts, user_prompts
from paged_kv.apps.provenance import finish_record, run_record, utc_now
from paged_kv.apps.workload import TEMPLATES, build_workload, print_outputs, serve_workload, workload_notes
from paged_kv.checkpoints import BUILTIN as BUILTIN_CHECKPOINT


def default_compile_cache() -> Path:
    """The per-user folder of the CLI's persistent compilation cache."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "paged-kv" / "jax"


def _enable_compile_cache(jax, args) -> Path | None:
    """Turns on JAX's persistent compilation cache for this process (the CLI is the program here;
    the library itself never changes process-wide settings). Every program is cached, however
    fast it compiled: a run compiles dozens of small ones. A folder that cannot be created only
    costs the cache (one note on stderr)."""
    if args.no_compile_cache:
        return None
    folder = Path(args.compile_cache).expanduser() if args.compile_cache else default_compile_cache()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"paged-kv: note: no compilation cache ({first_line(e)})", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


def _start_jax(args):
    """Imports JAX, turns on the compilation cache, creates the host devices for ``--tp`` (before
    the backend starts) and checks that ``--impl pallas`` has a GPU. Returns the jax module."""
    import jax

    _enable_compile_cache(jax, args)
    if args.tp > 1:  # host devices to shard over when JAX runs on the CPU (before it starts)
        jax.config.update("jax_num_cpu_devices", args.tp)
    from paged_kv.pallas_kernels import plan

    backend = jax.default_backend()
    # The execution plan's refusals that need the backend, in the options' terms (a row of its table:
    # pallas_kernels/plan.py; "cpu" names this process's platform when it has no GPU).
    refused = plan.refusal(args.impl, target="auto" if backend == "gpu" else "cpu",
                           batch_invariant=args.batch_invariant, block_size=args.block_size)
    if refused is not None and refused[0] == "pallas_on_cpu":
        raise UsageError(f"--impl pallas needs a GPU (the Pallas kernels compile through Triton); JAX runs on "
                          f"{backend} here: use --impl auto, reference or interpret")
    if refused is not None and refused[0] == "invariant_reference_block":
        # The reference kernels' invariant attention steps over KEY_TILE keys, whole blocks at a time.
        tile = plan.INVARIANT_KEY_TILE
        raise UsageError(f"--batch-invariant on the reference kernels (--impl {args.impl} on {backend}) needs "
                          f"a --block-size that divides {tile} (a power of two up to {tile}), got "
                          f"{args.block_size}")
    if refused is not None:
        raise UsageError(refused[1])
    return jax


def _load_tokenizer(ckpt: Path, vocab_size: int, loaded=None):
    """(tokenizer, answers as text, note, description): what the checkpoint ships
    (``paged_kv.models.hf_tokenizer.load_tokenizer``, or ``loaded``, what it returned): its Hugging
    Face ``tokenizer.json``, its byte-level one, or none (the byte tokenizer for the prompts, answers
    printed as text where every id is a byte, else as token ids). ``ValueError`` for a tokenizer
    file that cannot be read."""
    from paged_kv.models.hf_tokenizer import load_tokenizer
    from paged_kv.models.tokenizer import TOKENIZER_FILE, ByteTokenizer

    tok, desc = loaded if loaded is not None else load_tokenizer(ckpt)
    note = None
    if isinstance(tok, ByteTokenizer) and not (ckpt / TOKENIZER_FILE).is_file() and vocab_size != tok.vocab_size:
        note = (f"no {TOKENIZER_FILE} and a vocabulary of {vocab_size} ids: prompts go in as UTF-8 bytes, answers "
                f"are printed as text where every id is a byte-level one, else as token ids")
    return tok, True, note, desc


def _import_plotting() -> None:
    """Imports matplotlib's Agg backend and pyplot (``report.save_block_tables_png`` then finds
    them loaded). A failure here only means the import happens, and fails visibly, later."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot
    except Exception:  # reported by the real import at the end
        pass


def _model_config(ckpt: Path):
    """The checkpoint's ``LlamaConfig`` from its ``config.json`` alone (no weights read), so the
    options are checked against the model's context and heads before anything loads."""
    from paged_kv.models.config import LlamaConfig
    from paged_kv.models.hf_format import read_hf_config

    try:
        return LlamaConfig.from_hf_config(read_hf_config(ckpt))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot load checkpoint {str(ckpt)!r}: {first_line(e)}") from None


def _kind_name(spec: Any) -> str:
    """A group's attention kind in the run's header: "full", "window W", "chunk C"."""
    if spec.kind == "window":
        return f"window {spec.window}"
    return f"chunk {spec.chunk}" if spec.kind == "chunked" else "full"


def _kv_pool(config: Any, num_blocks: int, block_size: int, kv_dtype: str, layout: Any) -> dict:
    """The pool ``--kv-dtype`` buys: the KV budget is ``num_blocks`` blocks in the model's dtype;
    pages in ``kv_dtype`` (``"auto"``: the same pages) get as many blocks as fit in it
    (``paged_kv.models.page_spec_for_budget``). Returns the report's ``kv_pages`` entry: dtypes,
    bytes per block, budget, blocks and usable tokens (the null block excluded)."""
    from paged_kv.models import kv_bytes_per_block, page_spec_for_budget

    budget = num_blocks * kv_bytes_per_block(config, block_size, layout=layout)
    spec = page_spec_for_budget(config, block_size=block_size, budget_bytes=budget, layout=layout, kv_dtype=kv_dtype)
    return {"kv_dtype": spec.kv_dtype, "model_dtype": spec.dtype, "quantized": spec.quantized,
            "bytes_per_block": spec.bytes_per_block, "budget_bytes": budget, "blocks": spec.num_blocks,
            "tokens": spec.usable_tokens}


class _RunFiles:
    """The run's files: the report JSON and the block-table picture, at ``output_paths``, each
    written atomically (``provenance.write_atomic``); a picture this run does not draw is removed
    (``--overwrite`` let an earlier run's stay until now), so nothing stale stays beside the
    report. ``record``: the run's provenance (``provenance.run_record``), finished when written."""

    def __init__(self, args, record: dict):
        self.png, self.json = output_paths(args)
        self.record = record

    def write(self, rep: dict, snapshot) -> tuple[list[str], list[str]]:
        """Writes the report (``rep``, ``stamped`` with the finished record) and the picture of
        ``snapshot`` (or removes an old one); returns (lines saying what was written, problems)."""
        from paged_kv.apps import report

        written, problems = [], []
        try:
            written.append(f"report JSON: {report.save_report_json(self.stamped(rep), self.json)}")
        except (OSError, ValueError, TypeError) as e:
            problems.append(f"cannot write the report JSON {str(self.json)!r}: {first_line(e)}")
        if snapshot is not None:
            try:
                written.append(f"block-table picture: {report.save_block_tables_png(snapshot, self.png)}")
            except (OSError, ValueError) as e:
                problems.append(f"cannot write the block-table picture {str(self.png)!r}: {first_line(e)}")
        else:
            problem = self.remove_stale_png()
            if problem:
                problems.append(problem)
        return written, problems

    def stamped(self, rep: dict) -> dict:
        """``rep`` with ``partial`` and the finished run record (``run``) first."""
        return {"partial": rep.get("partial", False), "run": finish_record(self.record), **rep}

    def remove_stale_png(self) -> str | None:
        """Removes an earlier run's picture at the PNG path; the problem if it cannot."""
        try:
            self.png.unlink(missing_ok=True)
        except OSError as e:
            return f"cannot remove the earlier block-table picture {str(self.png)!r}: {first_line(e)}"
        return None

    def write_partial(self, engine, outputs: list, extra_of) -> str:
        """The report of the requests in ``outputs`` (those that finished before an interrupt),
        marked ``"partial": true``, without a picture (an earlier one is removed); returns the
        line that says where it went."""
        from paged_kv.apps import report

        done = sorted(outputs, key=lambda o: o.request_id)  # request order
        rep = report.build_report(engine, done, extra={**extra_of(done), "partial": True})
        path = report.save_report_json(self.stamped(rep), self.json)
        self.remove_stale_png()
        return f"paged-kv: partial report ({len(done)} finished requests): {path}"


def _report(args, engine, outputs, files: _RunFiles, tok, as_text: bool, extra: dict, *, show) -> int:
    """The report, its files and the answers (``show(outputs, tok, count, as_text=...)``); the exit status."""
    from paged_kv.apps import report

    phase("report")
    outputs = sorted(outputs, key=lambda o: o.request_id)  # request order (they finish in any order)
    rep = report.build_report(engine, outputs, extra={**extra, "partial": False})
    # The files first: nothing printed below can lose them. Their folder (--out-dir) is created
    # only now, so a run that fails early leaves nothing behind.
    written, problems = files.write(rep, engine.snapshot)
    on_interrupt_write(None)  # the report is written: a Ctrl-C from here on leaves it as it is
    if args.show:
        show(outputs, tok, args.show, as_text=as_text)
    print()
    print(report.format_report(rep))
    tk = extra.get("tokenizer")
    if tk and tk.get("steps"):
        render = (f" (+ {tk['chat_render_ms_per_request']:.3f} ms rendering the chat template)"
                  if args.chat else "")
        print(f"tokenization: encode {tk['encode_ms_per_request']:.3f} ms per request{render}, streamed decode "
              f"{tk['decode_ms_per_request']:.3f} ms per request ({tk['decode_ms_per_token'] * 1000:.1f} us per "
              f"token), against {tk['step_ms_mean']:.1f} ms per engine step ({tk['steps']} steps)")
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR"))
    if engine.snapshot is not None:
        print()
        print(report.render_block_tables(engine.snapshot, color=color))
    else:
        print("no request with n > 1 or beam search ran: no block-table picture")
    for line in written:
        print(line)
    sys.stdout.flush()
    rejected = [o for o in outputs if not o.ok]
    if outputs and len(rejected) == len(outputs):
        problems.append(f"every request was rejected ({len(rejected)} of {len(outputs)}), e.g. request "
                        f"{rejected[0].request_id}: {rejected[0].error}")
    for line in problems:
        _print_error(line)
    return 1 if problems else 0


def _run(args, ckpt: Path, record: dict) -> int:
    phase("imports")
    jax = _start_jax(args)

    import paged_kv as pk
    from paged_kv.apps.progress import CompileProgress
    from paged_kv.engine.serving import ServingConfig, ServingEngine
    from paged_kv.models import load_hf_checkpoint
    from paged_kv.models.hf_io import CheckpointError
    from paged_kv.models.hf_tokenizer import load_tokenizer

    # Your prompts are encoded (and rendered through the chat template) and checked against the
    # options and the model's config (its context, its heads for --tp), all before the weights load.
    loaded = load_tokenizer(ckpt)
    prep: dict = {}
    with OptionCheck():
        prompts = user_prompts(args, loaded.tokenizer, prep)
    config = _model_config(ckpt)
    if args.tp > 1:
        from paged_kv.models import sharding

        with OptionCheck():
            sharding.check_degree(config, args.tp)
    context, limit = sequence_context(args, config)
    notes = [] if prompts is None else check_prompts(args, prompts, args.block_size, context, limit)
    phase("load")
    try:
        model = load_hf_checkpoint(ckpt)
    except (CheckpointError, OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load checkpoint {str(ckpt)!r}: {first_line(e)}") from None
    vocab = model.config.vocab_size
    tok, as_text, note, tok_desc = _load_tokenizer(ckpt, vocab, loaded)
    if vocab < tok.vocab_size:
        raise ValueError(f"the model's vocabulary has {vocab} ids; the tokenizer ({tok_desc}) has {tok.vocab_size}")
    eos_ids = tuple(tok.eos_ids)
    # A windowed model serves with its KV-cache groups (vLLM's layout: reclaim on). --num-blocks
    # counts blocks of every layer, as without groups: each group gets as many, in blocks of
    # `slots` layers (the same KV bytes when the groups need no padding slots).
    from paged_kv.engine.call_setup import layout_groups
    from paged_kv.models import kv_group_layout

    layout = kv_group_layout(model)
    num_blocks = args.num_blocks if not layout.grouped else 1 + (args.num_blocks - 1) * layout.num_groups
    kv = _kv_pool(model.config, num_blocks, args.block_size, args.kv_dtype, layout if layout.grouped else None)
    num_blocks = kv["blocks"]
    rows = args.max_prefill_rows  # None: ServingConfig resolves it
    width = max(args.n, args.beam_width) if prompts is not None else 1
    # A beam of width k ranks k * (1 + #EOS ids) candidates per row (ServingConfig.top_candidates);
    # the workload's beams have width 4.
    candidates = max(8, (args.beam_width if prompts is not None else 4) * (1 + max(len(eos_ids), 1)))
    with OptionCheck():
        mgr = pk.ManagerConfig(num_blocks=num_blocks, block_size=args.block_size, max_seqs=args.max_seqs,
                               max_blocks_per_seq=-(-context // args.block_size),
                               prefix_caching=not args.no_prefix_caching, groups=layout_groups(layout))
        cfg = ServingConfig(mgr, chunk_size=args.chunk_size,
                            max_prefill_rows=None if rows is None else min(rows, args.max_seqs),
                            top_candidates=candidates, impl=args.impl, decode_steps=args.decode_steps,
                            batch_invariant=args.batch_invariant, kv_dtype=args.kv_dtype)
        if width > cfg.max_prefill_rows:  # a family of n samples or k beams is (re-)admitted in one admission
            cfg = dataclasses.replace(cfg, max_prefill_rows=min(width, args.max_seqs))
    mesh = None
    if args.tp > 1:
        from paged_kv.models import sharding

        mesh = sharding.make_mesh(args.tp)
    engine = ServingEngine(model, cfg, seed=args.seed, mesh=mesh)
    # What the engine allocated (its page spec), so the report states the pages that serve.
    kv.update(kv_dtype=engine.page_spec.kv_dtype, bytes_per_block=engine.bytes_per_block,
              blocks=engine.page_spec.num_blocks, quantized=engine.page_spec.quantized)
    if prompts is not None:
        reqs = prompt_requests(args, prompts, eos_ids)
    else:
        reqs = build_workload(tok, args.requests, args.max_new_tokens, args.arrival_gap, eos_ids)

    print(f"paged-kv: {len(reqs)} requests on {ckpt.name} ({model.config.num_params() / 1e6:.2f}M parameters, "
          f"JAX {jax.__version__} on {jax.default_backend()}); pool of {mgr.num_blocks} blocks x "
          f"{mgr.block_size} tokens, {mgr.max_seqs} rows, chunks of {cfg.chunk_size} in up to {cfg.max_prefill_rows} "
          f"prefill rows, up to {cfg.decode_steps} decode steps per call"
          + (f", tensor-parallel over {args.tp} devices" if mesh is not None else ""), flush=True)
    print(f"KV pages: {kv['kv_dtype']}{' + float32 scales' if kv['quantized'] else ''}, "
          f"{kv['bytes_per_block']:,} bytes per block; a budget of {kv['budget_bytes']:,} bytes "
          f"(--num-blocks {args.num_blocks} in {kv['model_dtype']}) bought {kv['blocks']} blocks = "
          f"{kv['tokens']} tokens", flush=True)
    if layout.grouped:
        kinds = ", ".join(_kind_name(s) for s in layout.group_specs)
        print(f"KV-cache groups: {layout.num_groups} of {layout.slots} layer(s) each ({kinds}); out-of-window "
              f"blocks reclaimed; a block holds {layout.slots} of {model.config.num_layers} layers", flush=True)
    print(f"tokenizer: {tok_desc}; EOS ids {', '.join(map(str, eos_ids)) or 'none'}"
          + ("; prompts rendered through the chat template" if args.chat else ""), flush=True)
    for line in ([note] if note else []) + notes + workload_notes(reqs, prompts, context, limit):
        print(f"note: {line}", flush=True)
    # Every program compiles here, ahead of the first step, one visible line each ("compiling step
    # variant k/2 ... s", ticking on a terminal): serving then never stops for XLA, and the report
    # gives each program's compile seconds apart from serving time.
    phase("compile")
    # matplotlib (the block-table picture at the end) takes ~0.4 s to import: do it beside the
    # compile, which runs in XLA without the GIL for most of its time.
    threading.Thread(target=_import_plotting, name="import-matplotlib", daemon=True).start()
    progress = CompileProgress(live=None if not args.no_progress else False)
    try:
        engine.compile(progress)
    finally:
        progress.end_line()  # an error (or Ctrl-C) mid-compile starts on a line of its own
    base = {"checkpoint": str(ckpt), "seed": args.seed, "kv_pages": kv}
    files = _RunFiles(args, record)
    outputs: list = []
    if prompts is not None:
        def extra_of(done, timing=None):
            return {**base, "prompts": len(reqs), **({"tokenizer": {"description": tok_desc, **timing}} if timing
                                                     else {}),
                    "answers": answers(done, prompts, tok, as_text)}
    else:
        def extra_of(done, timing=None):
            return {**base, "workload": {"requests": args.requests, "max_new_tokens": args.max_new_tokens,
                                         "arrival_gap": args.arrival_gap}}
    # A Ctrl-C from here on writes the report of the requests that finished, marked partial.
    on_interrupt_write(lambda: files.write_partial(engine, list(outputs), extra_of))
    try:
        if prompts is not None:
            timing = stream_prompts(engine, reqs, tok, prompts, prep, outputs)
            return _report(args, engine, outputs, files, tok, as_text, extra_of(outputs, timing), show=print_beams)
        serve_workload(engine, reqs, args, outputs)
        return _report(args, engine, outputs, files, tok, as_text, extra_of(outputs), show=print_outputs)
    finally:
        on_interrupt_write(None)


def _print_error(message: str) -> None:
    """``paged-kv: error: message`` on stderr, after what stdout holds (flushed first: the error
    comes after it, on a line of its own; the progress displays end their lines on the way out)."""
    flush_streams()
    print(f"paged-kv: error: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (see ``build_parser``'s epilog)."""
    started = utc_now()
    install_interrupt_handler()
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_options(args)
    except UsageError as e:
        parser.error(str(e))
    if args.walkthrough:
        from paged_kv.apps.walkthrough import main as walkthrough

        walkthrough()
        return 0
    missing = missing_cli_dependencies()
    if missing:
        _print_error(missing_extra_message(missing))
        return 1
    record = run_record(argv, vars(args), started=started)
    try:
        ckpt = checkpoint_dir(args)
        return _run(args, ckpt, record)
    except UsageError as e:
        parser.error(str(e))
    except KeyboardInterrupt:  # only if the handler above could not be installed
        interrupted_without_handler()
        return INTERRUPTED_STATUS
    except (ValueError, OSError) as e:
        _print_error(first_line(e))
        return 1


# The command line's names that scripts and tests use (their modules: options, workload, prompts).
__all__ = ["BUILTIN_CHECKPOINT", "DEFAULT_OUT_DIR", "TEMPLATES", "build_parser", "build_workload",
           "default_compile_cache", "install_interrupt_handler", "main", "output_paths", "prompt_seed"]
