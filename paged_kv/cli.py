"""``python -m paged_kv`` / ``paged-kv``: serve a ready-made workload and report on the KV cache.

The workload mixes prompts from the built-in tiny model's domain (stories, animal facts, Q&A,
counting, days, sums): some share a Q&A preamble (prefix-cache hits), some ask for ``n = 4``
parallel samples, some for beam search of width 4, all arriving over time into a block pool small
enough that requests get preempted and re-admitted. It ends with a report (throughput, peak
blocks, KV memory saved by sharing, prefix-cache hit rate, preemptions) and a picture of one
request family's block tables, in the terminal and as a PNG. The files (the report as JSON and
the PNG) go to an output folder, ``paged-kv-out/`` by default (``--out-dir``), created if missing.

    python -m paged_kv                       # the built-in checkpoints/tiny-llama
    python -m paged_kv --checkpoint DIR      # any Hugging Face Llama directory (byte-level prompts)
    python -m paged_kv --out-dir runs/a      # write report.json and block_tables.png there
    python -m paged_kv --walkthrough         # the block-manager walkthrough instead

How the library works: ``docs/design.md``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

BUILTIN_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-llama"

DEFAULT_OUT_DIR = "paged-kv-out"
"""Where the main job writes its files unless told otherwise (relative to the current directory)."""
PNG_NAME = "block_tables.png"
JSON_NAME = "report.json"

PREAMBLE = ("Q: What does the cow say? A: The cow says moo. "
            "Q: Where does the duck live? A: The duck lives in the pond. ")

# (prompt, kind): kind is "greedy", "sample" (one answer, temperature 0.7), "n4" (four answers,
# temperature 0.8, top-p 0.95) or "beam4" (beam search of width 4).
TEMPLATES = [
    ("Once upon a time there was a", "greedy"),
    (PREAMBLE + "Q: What color is a banana? A:", "greedy"),
    ("The cow says", "n4"),
    ("Let us count: 12, 13,", "greedy"),
    (PREAMBLE + "Q: Where does the owl live? A:", "sample"),
    ("The cow says", "beam4"),
    ("After Monday comes", "greedy"),
    (PREAMBLE + "Q: What day comes after Friday? A:", "greedy"),
    ("Once upon a time there was a brave lion named Rosa.", "n4"),
    ("3 plus 4 is", "greedy"),
    (PREAMBLE + "Q: What does the lion say? A:", "beam4"),
    ("Count with me: two, three,", "sample"),
]


# ---------------------------------------------------------------------------- Ctrl-C
# Python turns SIGINT into KeyboardInterrupt, which only surfaces between bytecodes: a Ctrl-C while
# XLA compiles waits for the compiler, and unwinding with XLA threads still at work can crash the
# interpreter on the way out (a segmentation fault seconds after "interrupted"); during imports it
# prints a long traceback. Instead the CLI exits at once: the C-level signal handler writes to a
# wakeup pipe that a watcher thread reads (it runs even while the main thread is inside XLA), and
# the Python-level handler covers the main thread; whichever comes first flushes the output, prints
# one line and leaves through ``os._exit(130)`` (no interpreter teardown to crash in).

INTERRUPTED_STATUS = 130
_exit_lock = threading.Lock()
_installed = False


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream, a reentrant flush from the signal handler
            pass


def _interrupted() -> None:
    if not _exit_lock.acquire(blocking=False):  # the other path is already exiting
        while True:
            time.sleep(1)
    flusher = threading.Thread(target=_flush_streams, daemon=True)  # a stuck pipe must not hold us
    flusher.start()
    flusher.join(1.0)
    try:
        os.write(2, (b"\n" if os.isatty(2) else b"") + b"paged-kv: interrupted\n")  # (past a progress bar)
    finally:
        os._exit(INTERRUPTED_STATUS)


def _on_sigint(signum, frame) -> None:
    _interrupted()


def _watch_wakeup_fd(fd: int) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT in data:
            _interrupted()


def install_interrupt_handler() -> None:
    """Ctrl-C (SIGINT) ends the program at once: flush stdout/stderr, print ``paged-kv:
    interrupted`` and exit with status 130, whatever the main thread is doing (importing JAX,
    compiling, rendering the report). Idempotent; only from the main thread. Cheap: it imports
    nothing, so it can run before JAX is imported."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed = True
    signal.signal(signal.SIGINT, _on_sigint)
    _phase("import")  # (the test hook; announced before the wakeup pipe is set: a signal now still exits)
    try:
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (OSError, ValueError):  # no pipes here: the Python-level handler alone
        return
    threading.Thread(target=_watch_wakeup_fd, args=(r,), name="paged-kv-sigint", daemon=True).start()


# Test hook (not an option): with PAGED_KV_TEST_PHASE=NAME the CLI announces phase NAME on stderr
# when it reaches it ("paged-kv: test phase NAME ..."), so that a test can send SIGINT at a known
# point; with PAGED_KV_TEST_PHASE=NAME:wait it then waits there (up to a minute) for the signal.
_PHASE_ENV = "PAGED_KV_TEST_PHASE"


def _phase(name: str) -> None:
    want = os.environ.get(_PHASE_ENV, "")
    if want.split(":")[0] != name:
        return
    sys.stderr.write(f"paged-kv: test phase {name} (jax imported: {'jax' in sys.modules})\n")
    sys.stderr.flush()
    if want.endswith(":wait"):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)


# ---------------------------------------------------------------------------- options
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where there is none to show (None, or False for a flag)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _int_at_least(low: int):
    """An argparse type: an integer ``>= low``, else a one-line error naming the value."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} must be >= {low}")
        return v
    parse.__name__ = f"integer >= {low}"
    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="paged-kv",
        description="Serve a ready-made workload through the paged KV cache (host scheduler, one jitted step, "
                    "preemption by recompute, prefix caching, parallel sampling and beam search) and report "
                    "tokens/s, peak blocks, KV memory saved by sharing, prefix-cache hit rate and preemptions, "
                    "with a picture of one request family's block tables.",
        epilog=f"Files go to {DEFAULT_OUT_DIR}/ unless --out-dir, --png or --json say otherwise. How the block "
               "manager, kernels, model and engines work: docs/design.md in the repository.",
        formatter_class=_HelpFormatter)
    g = p.add_argument_group("model and workload")
    g.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="Hugging Face Llama checkpoint directory (config.json + safetensors); prompts are UTF-8 "
                        "bytes, so the vocabulary needs >= 259 ids, and answers print as token ids where the "
                        "checkpoint has no byte-level tokenizer.json to decode them. Default: the built-in "
                        "checkpoints/tiny-llama")
    g.add_argument("--requests", type=_positive, default=24, metavar="N",
                   help="requests in the workload (the 12 templates repeat)")
    g.add_argument("--max-new-tokens", type=_positive, default=48, metavar="N",
                   help="generated tokens per answer at most (an answer also ends at the EOS token)")
    g.add_argument("--arrival-gap", type=_non_negative, default=2, metavar="STEPS",
                   help="engine steps between two arrivals (0: all at once)")
    g.add_argument("--seed", type=_non_negative, default=0, help="sampling seed (same seed, same outputs)")
    g = p.add_argument_group("KV cache and scheduler")
    g.add_argument("--num-blocks", type=_positive, default=64, metavar="N",
                   help="KV blocks in the pool (block 0 is reserved); small pools force preemptions")
    g.add_argument("--block-size", type=_positive, default=16, metavar="TOKENS",
                   help="tokens per block (a power of two)")
    g.add_argument("--max-seqs", type=_positive, default=32, metavar="N",
                   help="sequences running at once (rows of every step; a request holds n or beam-width rows)")
    g.add_argument("--max-seq-len", type=_positive, default=256, metavar="TOKENS",
                   help="tokens per sequence at most (prompt + answer; rounded up to whole blocks, capped by the "
                        "model's context)")
    g.add_argument("--chunk-size", type=_positive, default=64, metavar="TOKENS",
                   help="prefill positions per step")
    g.add_argument("--max-prefill-rows", type=_positive, default=8, metavar="N",
                   help="prompts admitted (and prefilled) together at most")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    g.add_argument("--tp", type=_positive, default=1, metavar="N",
                   help="tensor-parallel degree: shard the weights and KV heads over N devices "
                        "(on a CPU, N host devices are created); must fit the model's heads")
    g.add_argument("--impl", choices=("auto", "reference", "interpret", "pallas"), default="auto",
                   help="attention/copy kernels: auto = Pallas on GPU, the jnp reference on CPU")
    g = p.add_argument_group("output")
    g.add_argument("--show", type=_non_negative, default=4, metavar="N",
                   help="decoded outputs to print (a greedy answer, parallel samples, a beam search)")
    g.add_argument("--out-dir", metavar="DIR", default=DEFAULT_OUT_DIR,
                   help=f"folder for the output files ({JSON_NAME}, the report; {PNG_NAME}, the block-table "
                        "picture); created if missing")
    g.add_argument("--png", metavar="PATH", default=None,
                   help=f"write the block-table picture here instead of DIR/{PNG_NAME}")
    g.add_argument("--json", metavar="PATH", default=None,
                   help=f"write the report JSON here instead of DIR/{JSON_NAME}")
    g.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the terminal block tables by reference count")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("compilation")
    g.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="JAX's persistent compilation cache: a later run loads the compiled programs instead of "
                        "compiling them again (default: $XDG_CACHE_HOME/paged-kv/jax, else ~/.cache/paged-kv/jax)")
    g.add_argument("--no-compile-cache", action="store_true", help="compile everything, cache nothing")
    p.add_argument("--walkthrough", action="store_true",
                   help="run the block-manager walkthrough (the worked examples of docs/design.md) instead of "
                        "the workload")
    return p


def output_paths(args) -> tuple[Path, Path]:
    """(PNG path, JSON path): ``--png``/``--json`` where given, else files in ``--out-dir``."""
    out = Path(args.out_dir)
    return (Path(args.png) if args.png else out / PNG_NAME,
            Path(args.json) if args.json else out / JSON_NAME)


def build_workload(tokenizer, num_requests: int, max_new_tokens: int, arrival_gap: int, eos_id: int):
    """The ready-made requests (ids ``0 .. num_requests - 1``, arrival ``i * arrival_gap``)."""
    from paged_kv.engine import BeamParams, SamplingParams
    from paged_kv.engine.serving import Request

    eos = (eos_id,)
    kinds = {
        "greedy": SamplingParams(max_new_tokens=max_new_tokens, eos_token_ids=eos),
        "sample": SamplingParams(max_new_tokens=max_new_tokens, temperature=0.7, eos_token_ids=eos),
        "n4": SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, top_p=0.95, n=4, eos_token_ids=eos),
        "beam4": BeamParams(beam_width=4, max_new_tokens=max_new_tokens, eos_token_ids=eos),
    }
    reqs = []
    for i in range(num_requests):
        text, kind = TEMPLATES[i % len(TEMPLATES)]
        reqs.append(Request(tokenizer.encode(text, add_bos=True), kinds[kind], arrival=i * arrival_gap,
                            request_id=i))
    return reqs


def _short(text: str, limit: int = 60) -> str:
    text = text.replace(PREAMBLE, "<Q&A preamble> ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(req) -> str:
    p = req.params
    if req.is_beam:
        return f"beam search, width {p.beam_width}"
    if p.temperature == 0:
        return "greedy" if p.n == 1 else f"greedy, n={p.n}"
    return (f"n={p.n}, " if p.n > 1 else "") + f"temperature {p.temperature:g}" + \
        (f", top-p {p.top_p:g}" if p.top_p < 1 else "")


def _pick_outputs(outputs, count: int):
    """A greedy answer, a parallel-sampling request and a beam request with the same prompt, then others."""
    ok = [o for o in outputs if o.ok]
    picked = []
    greedy = [o for o in ok if not o.request.is_beam and o.request.width == 1 and o.request.params.temperature == 0]
    beams = [o for o in ok if o.request.is_beam]
    multi = [o for o in ok if not o.request.is_beam and o.request.width > 1]
    if greedy:
        picked.append(greedy[0])
    if beams:
        twin = [o for o in multi if o.request.prompt == beams[0].request.prompt]
        picked += (twin[:1] or multi[:1]) + [beams[0]]
    elif multi:
        picked.append(multi[0])
    picked += [o for o in ok if o not in picked]
    return picked[:count]


def _shown_tokens(tokenizer, ids, limit: int, *, as_text: bool = True) -> str:
    """Text of ``ids`` (quoted) when ``tokenizer`` can decode them, else the token ids themselves
    (a model whose vocabulary is not byte-level generates ids the byte tokenizer has no text for)."""
    ids = [int(t) for t in ids]
    if tokenizer is not None and as_text:
        try:
            return repr(_short(tokenizer.decode(ids, stop_at_eos=True), limit))
        except (ValueError, TypeError, OverflowError):
            pass
    eos = getattr(tokenizer, "eos_id", None)
    if eos in ids:
        ids = ids[: ids.index(eos)]
    text = " ".join(map(str, ids))
    return f"token ids [{text if len(text) <= limit else text[: limit - 3] + '...'}]"


def _print_outputs(outputs, tokenizer, count: int, *, as_text: bool = True) -> None:
    """A few answers; ``as_text=False`` (or ids the tokenizer cannot decode): token ids."""
    for o in _pick_outputs(outputs, count):
        prompt = _shown_tokens(tokenizer, o.request.prompt, 60)
        print(f"\n[request {o.request_id}: {_describe(o.request)}; {o.stats.preemptions} preemptions, "
              f"{o.stats.cached_prompt_tokens} prompt tokens from cache]  {prompt}")
        for j, toks in enumerate(o.tokens):
            text = _shown_tokens(tokenizer, toks, 90, as_text=as_text)
            tag = f"beam {j} (score {o.scores[j]:.3f})" if o.scores is not None else f"sample {j}"
            print(f"    {tag}: {text}")


def _checkpoint_dir(args) -> Path:
    """The checkpoint directory, checked before anything is loaded (``ValueError`` otherwise)."""
    if args.checkpoint is None:
        if not BUILTIN_CHECKPOINT.is_dir():
            raise ValueError(f"checkpoint directory {str(BUILTIN_CHECKPOINT)!r} does not exist (built-in model "
                             "missing; pass --checkpoint DIR)")
        return BUILTIN_CHECKPOINT
    ckpt = Path(args.checkpoint)
    if ckpt.is_dir():
        return ckpt
    if ckpt.exists():
        hint = (f"; did you mean --checkpoint {str(ckpt.parent)!r}?"
                if ckpt.name == "config.json" or ckpt.suffix in (".safetensors", ".json") else "")
        raise ValueError(f"checkpoint {str(ckpt)!r} is a file, not a directory (pass the directory that holds "
                         f"config.json and the safetensors{hint})")
    raise ValueError(f"checkpoint directory {str(ckpt)!r} does not exist")


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
        print(f"paged-kv: note: no compilation cache ({_first_line(e)})", file=sys.stderr)
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
    if args.impl == "pallas" and jax.default_backend() != "gpu":
        raise _UsageError(f"--impl pallas needs a GPU (the Pallas kernels compile through Triton); JAX runs on "
                          f"{jax.default_backend()} here: use --impl auto, reference or interpret")
    return jax


class _UsageError(Exception):
    """A bad combination of options found after parsing: exit 2, like argparse."""


def _load_tokenizer(ckpt: Path, vocab_size: int):
    """(tokenizer, answers as text, note): the checkpoint's byte-level ``tokenizer.json``, else the
    byte tokenizer for the prompts with answers printed as token ids where they are not bytes."""
    from models.tokenizer import TOKENIZER_FILE, ByteTokenizer

    path = ckpt / TOKENIZER_FILE
    if path.is_file():
        try:
            return ByteTokenizer.load(ckpt), True, None
        except (ValueError, KeyError, TypeError, OSError) as e:
            return ByteTokenizer(), False, (f"{TOKENIZER_FILE} is not a byte-level tokenizer ({_first_line(e)}): "
                                            "prompts go in as UTF-8 bytes, answers are printed as token ids")
    tok = ByteTokenizer()
    note = None
    if vocab_size != tok.vocab_size:
        note = (f"no {TOKENIZER_FILE} and a vocabulary of {vocab_size} ids: prompts go in as UTF-8 bytes, answers "
                f"are printed as text where every id is a byte-level one, else as token ids")
    return tok, True, note


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _run(args, ckpt: Path) -> int:
    _phase("imports")
    jax = _start_jax(args)

    import paged_kv as pk
    from models import load_hf_checkpoint
    from models.hf_io import CheckpointError
    from paged_kv import report
    from paged_kv.engine.serving import ServingConfig, ServingEngine

    _phase("load")
    try:
        model = load_hf_checkpoint(ckpt)
    except (CheckpointError, OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load checkpoint {str(ckpt)!r}: {_first_line(e)}") from None
    vocab = model.config.vocab_size
    tok, as_text, note = _load_tokenizer(ckpt, vocab)
    if vocab < tok.vocab_size:
        raise ValueError(f"the model's vocabulary has {vocab} ids; byte-level prompts need {tok.vocab_size}")
    context = min(args.max_seq_len, model.config.max_position_embeddings)
    mgr = pk.ManagerConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_seqs=args.max_seqs,
                           max_blocks_per_seq=-(-context // args.block_size),
                           prefix_caching=not args.no_prefix_caching)
    cfg = ServingConfig(mgr, chunk_size=args.chunk_size, max_prefill_rows=min(args.max_prefill_rows, args.max_seqs),
                        impl=args.impl)
    mesh = None
    if args.tp > 1:
        from models import sharding

        sharding.check_degree(model.config, args.tp)
        mesh = sharding.make_mesh(args.tp)
    engine = ServingEngine(model, cfg, seed=args.seed, mesh=mesh)
    reqs = build_workload(tok, args.requests, args.max_new_tokens, args.arrival_gap, tok.eos_id)

    print(f"paged-kv: {len(reqs)} requests on {ckpt.name} ({model.config.num_params() / 1e6:.2f}M parameters, "
          f"JAX {jax.__version__} on {jax.default_backend()}); pool of {mgr.num_blocks} blocks x "
          f"{mgr.block_size} tokens, {mgr.max_seqs} rows, chunks of {cfg.chunk_size}"
          + (f", tensor-parallel over {args.tp} devices" if mesh is not None else ""), flush=True)
    if note:
        print(f"note: {note}", flush=True)
    print("the first step of each shape compiles (about a minute on a 2-core CPU) ...", flush=True)
    from tqdm import tqdm

    bar = tqdm(total=len(reqs), unit="req", desc="serving", file=sys.stderr, disable=args.no_progress,
               dynamic_ncols=True)

    def on_step(eng):
        if eng.step_count % 5 == 0:
            bar.set_postfix(step=eng.step_count, running=eng.num_running, waiting=eng.num_waiting,
                            blocks=eng.blocks_in_use, preempted=eng.preemptions, refresh=False)
            bar.refresh()

    _phase("compile")  # the first step compiles
    outputs = []
    for out in engine.run(reqs, on_step=on_step):  # streamed as each request finishes
        outputs.append(out)
        bar.update(1)
        if out.error is not None:
            bar.write(f"request {out.request_id:>3} rejected: {out.error}")
            continue
        st = out.stats
        ttft = "–" if st.time_to_first_token_s is None else f"{st.time_to_first_token_s:.2f} s"
        bar.write(f"request {out.request_id:>3} done at step {st.finish_step:4d}: {_describe(out.request):<34} "
                  f"{st.prompt_tokens:4d} prompt tokens, {st.cached_prompt_tokens:3d} tokens from cache in "
                  f"{st.admissions} admission{'s' if st.admissions > 1 else ''}, "
                  f"{st.generated_tokens:4d} generated, {st.preemptions} preemptions, "
                  f"first token after {ttft}")
    bar.close()

    _phase("report")
    rep = report.build_report(engine, outputs, extra={"checkpoint": str(ckpt), "seed": args.seed,
                                                      "workload": {"requests": args.requests,
                                                                   "max_new_tokens": args.max_new_tokens,
                                                                   "arrival_gap": args.arrival_gap}})
    # The files first: nothing printed below can lose them. Their folder (--out-dir) is created
    # only now, so a run that fails early leaves nothing behind.
    png_path, json_path = output_paths(args)
    written, problems = [], []
    try:
        written.append(f"report JSON: {report.save_report_json(rep, json_path)}")
    except (OSError, ValueError, TypeError) as e:
        problems.append(f"cannot write the report JSON {str(json_path)!r}: {_first_line(e)}")
    if engine.snapshot is not None:
        try:
            written.append(f"block-table picture: {report.save_block_tables_png(engine.snapshot, png_path)}")
        except (OSError, ValueError) as e:
            problems.append(f"cannot write the block-table picture {str(png_path)!r}: {_first_line(e)}")

    if args.show:
        _print_outputs(outputs, tok, args.show, as_text=as_text)
    print()
    print(report.format_report(rep))
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
        print(f"paged-kv: error: {line}", file=sys.stderr)
    return 1 if problems else 0


def _out_dir_problem(out: Path) -> str | None:
    """Why ``out`` cannot be the output folder (it or an ancestor is a file), else None. It is
    created only when the files are written."""
    for p in (out.resolve(), *out.resolve().parents):
        if p.exists():
            if p.is_dir():
                return None
            return "is not a directory" if p == out.resolve() else f"{str(p)!r} is a file, not a directory"
    return None


def main(argv=None) -> int:
    install_interrupt_handler()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.block_size & (args.block_size - 1):
        parser.error(f"--block-size {args.block_size} must be a power of two")
    if args.num_blocks < 2:
        parser.error(f"--num-blocks {args.num_blocks} must be >= 2 (block 0 is reserved)")
    for path in (args.png, args.json):
        if path and not Path(path).resolve().parent.is_dir():
            parser.error(f"directory of {path!r} does not exist")
    if not (args.png and args.json):  # some file goes to --out-dir: it must be (or become) a folder
        problem = _out_dir_problem(Path(args.out_dir))
        if problem:
            parser.error(f"--out-dir {args.out_dir!r}: {problem}")
    try:  # the pool's own checks (sizes, int32 slot indices), before anything is loaded
        import paged_kv as pk

        pk.ManagerConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_seqs=args.max_seqs,
                         max_blocks_per_seq=-(-args.max_seq_len // args.block_size))
    except ValueError as e:
        parser.error(str(e))
    if args.walkthrough:
        from paged_kv.walkthrough import main as walkthrough

        walkthrough()
        return 0
    try:
        ckpt = _checkpoint_dir(args)
        return _run(args, ckpt)
    except _UsageError as e:
        parser.error(str(e))
    except KeyboardInterrupt:  # only if the handler above could not be installed
        print("paged-kv: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    except (ValueError, OSError) as e:
        print(f"paged-kv: error: {_first_line(e)}", file=sys.stderr)
        return 1


__all__ = ["DEFAULT_OUT_DIR", "TEMPLATES", "build_parser", "build_workload", "default_compile_cache",
           "install_interrupt_handler", "main", "output_paths"]
