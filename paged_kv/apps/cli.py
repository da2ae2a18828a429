"""``python -m paged_kv`` / ``paged-kv``: serve a ready-made workload and report on the KV cache.

The workload mixes prompts from the built-in tiny model's domain (stories, animal facts, Q&A,
counting, days, sums): some share a Q&A preamble (prefix-cache hits), some ask for ``n = 4``
parallel samples, some for beam search of width 4, all arriving over time into a block pool small
enough that requests get preempted and re-admitted. It ends with a report (throughput, peak
blocks, KV memory saved by sharing, prefix-cache hit rate, preemptions) and a picture of one
request family's block tables, in the terminal and as a PNG. The files (the report as JSON and
the PNG) go to an output folder, ``paged-kv-out/`` by default (``--out-dir``), created if missing.

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

How the library works: ``docs/design.md``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paged_kv.checkpoints import BUILTIN as BUILTIN_CHECKPOINT

if TYPE_CHECKING:  # the engine and models load on first use: `--help` imports no JAX
    from paged_kv.engine.serving import Request
    from paged_kv.models.hf_tokenizer import HFTokenizer
    from paged_kv.models.tokenizer import ByteTokenizer

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


def _float_in(low: float, high: float, *, low_open: bool = False):
    """An argparse type: a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (low < v if low_open else low <= v) or not v <= high:
            raise argparse.ArgumentTypeError(f"{v:g} must be in {'(' if low_open else '['}{low:g}, {high:g}]")
        return v
    parse.__name__ = "number"
    return parse


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
                   help="Hugging Face checkpoint directory (config.json + safetensors) of a llama, qwen2, qwen3, "
                        "mistral, gemma2 or gemma3_text (Gemma3ForCausalLM) model; its tokenizer.json (with "
                        "tokenizer_config.json and generation_config.json for the special tokens) tokenizes the "
                        "prompts; without one, prompts are UTF-8 bytes (the vocabulary then needs >= 259 ids) and "
                        "answers that are not bytes print as token ids. "
                        "Default: the built-in checkpoints/tiny-llama")
    g.add_argument("--requests", type=_positive, default=24, metavar="N",
                   help="requests in the workload (the 12 templates repeat)")
    g.add_argument("--max-new-tokens", type=_positive, default=48, metavar="N",
                   help="generated tokens per answer at most (an answer also ends at the EOS token)")
    g.add_argument("--arrival-gap", type=_non_negative, default=2, metavar="STEPS",
                   help="engine steps between two arrivals (0: all at once)")
    g.add_argument("--seed", type=_non_negative, default=0, help="sampling seed (same seed, same outputs)")
    g = p.add_argument_group("your prompts (instead of the workload; the answers stream as they are generated)")
    g.add_argument("--prompt", action="append", metavar="TEXT", default=None,
                   help="a prompt to serve (repeat the option for several)")
    g.add_argument("--prompts-file", metavar="FILE", default=None,
                   help="a UTF-8 text file of prompts, one per line (empty lines skipped)")
    g.add_argument("--chat", action="store_true",
                   help="render each prompt as a user message through the checkpoint's chat template "
                        "(tokenizer_config.json's chat_template), with the assistant's turn opened")
    g.add_argument("--n", type=_positive, default=1, metavar="N", help="answers per prompt (parallel sampling)")
    g.add_argument("--beam-width", type=_positive, default=1, metavar="K",
                   help="beam search of width K (K > 1) instead of sampling; returns K hypotheses")
    g.add_argument("--temperature", type=_float_in(0.0, 100.0), default=0.0, metavar="T",
                   help="sampling temperature; 0 is greedy decoding")
    g.add_argument("--top-p", type=_float_in(0.0, 1.0, low_open=True), default=1.0, metavar="P",
                   help="nucleus sampling: keep the most likely tokens whose probability reaches P")
    g.add_argument("--top-k", type=_non_negative, default=0, metavar="K",
                   help="keep the K most likely tokens (0: all)")
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
    g.add_argument("--decode-steps", type=_positive, default=8, metavar="K",
                   help="decode steps one device call may run while nothing needs the host in between "
                        "(ServingConfig.decode_steps; 1: one call per step, tokens stream one at a time)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    g.add_argument("--tp", type=_positive, default=1, metavar="N",
                   help="tensor-parallel degree: shard the weights and KV heads over N devices "
                        "(on a CPU, N host devices are created); must fit the model's heads")
    g.add_argument("--impl", choices=("auto", "reference", "interpret", "pallas"), default="auto",
                   help="attention/copy kernels: auto = Pallas on GPU, the jnp reference on CPU")
    g.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant decoding (ServingConfig.batch_invariant): each request's tokens and "
                        "log-probs the same bits whatever else runs; the reference kernels only")
    g.add_argument("--kv-dtype", choices=("auto", "int8", "fp8"), default="auto",
                   help="KV page dtype (ServingConfig.kv_dtype): auto = the model's; int8 / fp8 store one byte "
                        "per element plus a float32 scale per token and KV head, and the KV memory of "
                        "--num-blocks blocks in the model's dtype buys about 2x (bf16) to 4x (float32) the "
                        "blocks; fp8 needs compute capability >= 8.9 on a GPU")
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
    g.add_argument("--verbose", action="store_true",
                   help="the built-in workload: one line per finished request (step, cache hits, preemptions, "
                        "first-token time) above the report")
    g = p.add_argument_group("compilation")
    g.add_argument("--compile-cache", metavar="DIR", default=None,
                   help="JAX's persistent compilation cache: a later run loads the compiled programs instead of "
                        "compiling them again (default: $XDG_CACHE_HOME/paged-kv/jax, else ~/.cache/paged-kv/jax)")
    g.add_argument("--no-compile-cache", action="store_true", help="compile everything, cache nothing")
    p.add_argument("--walkthrough", action="store_true",
                   help="run the block-manager walkthrough (the worked examples of docs/design.md) instead of "
                        "the workload")
    return p


def output_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """(PNG path, JSON path): ``--png``/``--json`` where given, else files in ``--out-dir``."""
    out = Path(args.out_dir)
    return (Path(args.png) if args.png else out / PNG_NAME,
            Path(args.json) if args.json else out / JSON_NAME)


def build_workload(tokenizer: ByteTokenizer | HFTokenizer, num_requests: int, max_new_tokens: int, arrival_gap: int,
                   eos_id: int | Sequence[int]) -> list[Request]:
    """The ready-made requests (ids ``0 .. num_requests - 1``, arrival ``i * arrival_gap``).
    ``eos_id``: the EOS id, or a sequence of them (every one ends an answer)."""
    from paged_kv.engine import BeamParams, SamplingParams
    from paged_kv.engine.serving import Request

    eos = tuple(int(t) for t in eos_id) if isinstance(eos_id, (list, tuple)) else (int(eos_id),)
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


def _workload_notes(reqs, prompts, context: int, args) -> list[str]:
    """The built-in workload's requests that cannot run (said before compiling; they are still
    submitted, and rejected with the engine's reason)."""
    if prompts is not None:
        return []
    long = [q for q in reqs if len(q.prompt) > context]
    if not long:
        return []
    return [f"{len(long)} of {len(reqs)} requests have prompts longer than the {context} tokens a sequence holds "
            f"(--max-seq-len {args.max_seq_len}): they will be rejected"]


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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# ---------------------------------------------------------------------------- your prompts
def _read_prompts(args) -> list[str] | None:
    """The ``--prompt`` texts, then the lines of ``--prompts-file``; None when neither is given."""
    if args.prompt is None and args.prompts_file is None:
        return None
    texts = list(args.prompt or [])
    if args.prompts_file is not None:
        try:
            with open(args.prompts_file, encoding="utf-8") as fh:
                texts += [line.rstrip("\r\n") for line in fh if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --prompts-file {args.prompts_file!r}: {_first_line(e)}") from None
    if not texts:
        raise ValueError(f"--prompts-file {args.prompts_file!r} holds no prompt (every line is empty)")
    return texts


def _user_prompts(args, tok, timing: dict) -> list[tuple[str, list[int]]] | None:
    """(text, token ids) per prompt: with ``--chat`` the text rendered through the chat template
    and encoded without added special tokens (the template carries them), as transformers'
    ``apply_chat_template`` does; else encoded with the checkpoint's special tokens. ``timing``
    receives ``encode_s`` and ``render_s`` (seconds over all prompts)."""
    texts = _read_prompts(args)
    if texts is None:
        return None
    out = []
    timing.update(encode_s=0.0, render_s=0.0)
    if args.chat:
        if getattr(tok, "chat_template", None) is None:
            raise ValueError("--chat: the checkpoint has no chat template (tokenizer_config.json's chat_template)")
        tok.compile_chat_template()  # imports jinja2 and compiles the template once, outside the timing
    for text in texts:
        t0 = time.perf_counter()
        if args.chat:
            text_in = tok.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        t1 = time.perf_counter()
        ids = tok.encode(text_in, add_bos=False) if args.chat else tok.encode(text, add_bos=True)
        t2 = time.perf_counter()
        timing["render_s"] += t1 - t0
        timing["encode_s"] += t2 - t1
        if not ids:
            raise ValueError(f"prompt {text!r} has no tokens")
        out.append((text, ids))
    return out


def _sampling_params(args, eos_ids=()):
    """The ``SamplingParams`` or ``BeamParams`` of ``--n``, ``--beam-width``, ``--temperature``,
    ``--top-p``, ``--top-k`` and ``--max-new-tokens`` (``ValueError`` for a bad combination)."""
    from paged_kv.engine import BeamParams, SamplingParams

    if args.beam_width > 1:
        sampled = [f"{name} {v:g}" for name, v, default in (("--n", args.n, 1), ("--temperature", args.temperature, 0),
                                                             ("--top-p", args.top_p, 1), ("--top-k", args.top_k, 0))
                   if v != default]
        if sampled:
            raise ValueError(f"--beam-width {args.beam_width} is beam search; it takes no sampling option "
                             f"({', '.join(sampled)})")
        return BeamParams(beam_width=args.beam_width, max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids)
    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, n=args.n, eos_token_ids=eos_ids)


def _prompt_requests(args, prompts, eos_ids):
    from paged_kv.engine.serving import Request

    params = _sampling_params(args, eos_ids)
    return [Request(ids, params, arrival=0, request_id=i) for i, (_, ids) in enumerate(prompts)]


_CONTROL = {c: "\\n" if chr(c) == "\n" else f"\\x{c:02x}" for c in (*range(0x20), 0x7F) if chr(c) != "\t"}
"""C0 controls and DEL (bar tab) -> a visible escape, newline as ``\\n``: generated text never moves
the terminal's cursor or starts an escape sequence, and each answer stays on its own line (a run
of newlines shows as ``\\n\\n...``, not as blank lines)."""


def printable(text: str) -> str:
    """``text`` as the stream prints it (control characters escaped, ``_CONTROL``)."""
    return text.translate(_CONTROL)


class _StreamPrinter:
    """Prints answers as their tokens arrive, one answer at a time in (prompt, sample) order: the
    current answer prints live, later ones are decoded as they come and held until their turn.
    Beam requests print their best hypothesis when the search ends (the rest in the summary).
    Each answer is decoded incrementally (``paged_kv.models.hf_tokenizer.stream_decoder``), so a character
    split over several tokens prints once, whole; EOS and special tokens print nothing."""

    def __init__(self, tok, requests, prompts, out=None):
        from paged_kv.models.hf_tokenizer import stream_decoder

        self.out = out or sys.stdout
        self.tok = tok
        self.units = []  # (request id, sample index)
        self.titles = {}
        for req, (text, _) in zip(requests, prompts):
            width = 1 if req.is_beam else req.params.n
            for j in range(width):
                self.units.append((req.request_id, j))
                what = "best beam" if req.is_beam else (f"sample {j}" if width > 1 else "answer")
                self.titles[(req.request_id, j)] = f"[prompt {req.request_id}, {what}] {_short(text, 60)!r} ->"
        self.decoders = {u: stream_decoder(tok) for u in self.units}
        self.eos = {int(t) for t in tok.eos_ids}
        self.held = {u: [] for u in self.units}
        self.done: set = set()
        self.cur = -1
        self.decode_s = 0.0
        self.tokens = 0
        self._advance()

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def _advance(self) -> None:
        while self.cur < 0 or (self.cur < len(self.units) and self.units[self.cur] in self.done):
            if self.cur >= 0:
                self._write("\n")
            self.cur += 1
            if self.cur < len(self.units):
                u = self.units[self.cur]
                self._write(self.titles[u] + " " + "".join(self.held.pop(u)))

    def on_token(self, delta) -> None:
        u = (delta.request_id, delta.index)
        if u not in self.decoders:
            return  # a beam hypothesis past the best: printed with the summary
        t0 = time.perf_counter()
        text = printable("".join(self.decoders[u].push(t) for t in delta.tokens if int(t) not in self.eos))
        self.decode_s += time.perf_counter() - t0
        self.tokens += len(delta.tokens)
        if self.cur < len(self.units) and self.units[self.cur] == u:
            if text:
                self._write(text)
        else:
            self.held[u].append(text)
        if delta.finish_reason is not None:
            t0 = time.perf_counter()
            rest = printable(self.decoders[u].finish())  # an incomplete character at the end prints as U+FFFD
            self.decode_s += time.perf_counter() - t0
            self._finish(u, f"{rest} [{delta.finish_reason}]")

    def on_output(self, out) -> None:
        """A finished (or rejected) request: all its answers are complete."""
        for u in self.units:
            if u[0] == out.request_id and u not in self.done:
                self._finish(u, f" [rejected: {out.error}]" if out.error else "")

    def _finish(self, u, tail: str) -> None:
        if self.cur < len(self.units) and self.units[self.cur] == u:
            self._write(tail)
        else:
            self.held[u].append(tail)
        self.done.add(u)
        self._advance()


def _stream_prompts(engine, reqs, tok, prompts, prep: dict):
    """Serve ``reqs`` (made from ``prompts``; ``prep``: their encode and chat-render seconds)
    streaming their text; returns (outputs, tokenizer timing for the report)."""
    printer = _StreamPrinter(tok, reqs, prompts)
    outputs = []
    for out in engine.run(reqs, on_token=printer.on_token):
        outputs.append(out)
        printer.on_output(out)
    st = engine.stats()
    n = max(len(reqs), 1)
    return outputs, {
        "requests": len(reqs), "steps": st.steps,
        "encode_ms_per_request": 1000 * prep["encode_s"] / n,
        "chat_render_ms_per_request": 1000 * prep["render_s"] / n,
        "decode_ms_per_request": 1000 * printer.decode_s / n,
        "decode_ms_per_token": 1000 * printer.decode_s / max(printer.tokens, 1),
        "streamed_tokens": printer.tokens,
        # Steady-state step time: the wall time of all steps less the first call of each shape.
        "step_ms_mean": 1000 * (st.step_s - (st.compile_s - st.compile_ahead_s)) / max(
            st.steps - sum(1 for k in engine.scheduler.timed_compiles if k[0] == "step"), 1),
    }


def _answers(outputs, prompts, tok, as_text: bool) -> list[dict]:
    """The report's record of your prompts: per prompt its text, token count, and per answer the
    token ids, the text (up to the first EOS; None where the ids are not all text) and why it ended."""
    out = []
    for o in sorted(outputs, key=lambda o: o.request_id):
        text, ids = prompts[o.request_id]
        entry = {"prompt": text, "prompt_tokens": len(ids), "error": o.error, "answers": []}
        for j, toks in enumerate(o.tokens):
            try:
                decoded = tok.decode(toks, stop_at_eos=True) if as_text else None
            except ValueError:  # an id the tokenizer has no text for
                decoded = None
            entry["answers"].append({"tokens": [int(t) for t in toks], "text": decoded,
                                     "finish_reason": o.finish_reasons[j],
                                     **({"score": float(o.scores[j])} if o.scores is not None else {})})
        out.append(entry)
    return out


def _print_beams(outputs, tok, count: int, *, as_text: bool = True) -> None:
    """After streaming: every hypothesis of the beam requests with its score (the answers of the
    sampled ones were streamed)."""
    for o in sorted(outputs, key=lambda o: o.request_id):  # prompt order (they finish in any order)
        if o.ok and o.request.is_beam:
            print(f"\n[prompt {o.request_id}: beam search, width {o.request.params.beam_width}]")
            for j, toks in enumerate(o.tokens[:count]):
                print(f"    beam {j} (score {o.scores[j]:.3f}): {_shown_tokens(tok, toks, 90, as_text=as_text)}")


def _import_plotting() -> None:
    """Imports matplotlib's Agg backend and pyplot (``report.save_block_tables_png`` then finds
    them loaded). A failure here only means the import happens, and fails visibly, later."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot
    except Exception:  # reported by the real import at the end
        pass


def _run(args, ckpt: Path) -> int:
    _phase("imports")
    jax = _start_jax(args)

    import paged_kv as pk
    from paged_kv.apps.progress import CompileProgress
    from paged_kv.engine.serving import ServingConfig, ServingEngine
    from paged_kv.models import load_hf_checkpoint
    from paged_kv.models.hf_io import CheckpointError
    from paged_kv.models.hf_tokenizer import load_tokenizer

    # Your prompts are encoded (and rendered through the chat template) and checked against the
    # options first, before the model loads; against the model's own context after, still before
    # anything compiles.
    loaded = load_tokenizer(ckpt)
    prep: dict = {}
    prompts = _user_prompts(args, loaded.tokenizer, prep)
    per_seq = -(-args.max_seq_len // args.block_size) * args.block_size  # whole blocks
    notes = []
    if prompts is not None:
        notes = _check_prompts(args, prompts, args.block_size, per_seq, f"--max-seq-len {args.max_seq_len}")
    _phase("load")
    try:
        model = load_hf_checkpoint(ckpt)
    except (CheckpointError, OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot load checkpoint {str(ckpt)!r}: {_first_line(e)}") from None
    vocab = model.config.vocab_size
    tok, as_text, note, tok_desc = _load_tokenizer(ckpt, vocab, loaded)
    if vocab < tok.vocab_size:
        raise ValueError(f"the model's vocabulary has {vocab} ids; the tokenizer ({tok_desc}) has {tok.vocab_size}")
    eos_ids = tuple(tok.eos_ids)
    max_pos = model.config.max_position_embeddings
    if prompts is not None and max_pos < per_seq:
        notes = _check_prompts(args, prompts, args.block_size, max_pos,
                               f"the model's context (max_position_embeddings={max_pos})")
    context = min(args.max_seq_len, max_pos)
    # A windowed model serves with its KV-cache groups (vLLM's layout: reclaim on). --num-blocks
    # counts blocks of every layer, as without groups: each group gets as many, in blocks of
    # `slots` layers (the same KV bytes when the groups need no padding slots).
    from paged_kv.engine.call_setup import layout_groups
    from paged_kv.models import kv_group_layout

    layout = kv_group_layout(model)
    num_blocks = args.num_blocks if not layout.grouped else 1 + (args.num_blocks - 1) * layout.num_groups
    kv = _kv_pool(model.config, num_blocks, args.block_size, args.kv_dtype, layout if layout.grouped else None)
    num_blocks = kv["blocks"]
    mgr = pk.ManagerConfig(num_blocks=num_blocks, block_size=args.block_size, max_seqs=args.max_seqs,
                           max_blocks_per_seq=-(-context // args.block_size),
                           prefix_caching=not args.no_prefix_caching, groups=layout_groups(layout))
    rows = args.max_prefill_rows
    if prompts is not None:  # a family of n samples or k beams is (re-)admitted in one admission
        rows = max(rows, args.n, args.beam_width)
    # A beam of width k ranks k * (1 + #EOS ids) candidates per row (ServingConfig.top_candidates);
    # the workload's beams have width 4.
    candidates = max(8, (args.beam_width if prompts is not None else 4) * (1 + max(len(eos_ids), 1)))
    cfg = ServingConfig(mgr, chunk_size=args.chunk_size, max_prefill_rows=min(rows, args.max_seqs),
                        top_candidates=candidates, impl=args.impl, decode_steps=args.decode_steps,
                        batch_invariant=args.batch_invariant, kv_dtype=args.kv_dtype)
    mesh = None
    if args.tp > 1:
        from paged_kv.models import sharding

        sharding.check_degree(model.config, args.tp)
        mesh = sharding.make_mesh(args.tp)
    engine = ServingEngine(model, cfg, seed=args.seed, mesh=mesh)
    # What the engine allocated (its page spec), so the report states the pages that serve.
    kv.update(kv_dtype=engine.page_spec.kv_dtype, bytes_per_block=engine.bytes_per_block,
              blocks=engine.page_spec.num_blocks, quantized=engine.page_spec.quantized)
    if prompts is not None:
        reqs = _prompt_requests(args, prompts, eos_ids)
    else:
        reqs = build_workload(tok, args.requests, args.max_new_tokens, args.arrival_gap, eos_ids)

    print(f"paged-kv: {len(reqs)} requests on {ckpt.name} ({model.config.num_params() / 1e6:.2f}M parameters, "
          f"JAX {jax.__version__} on {jax.default_backend()}); pool of {mgr.num_blocks} blocks x "
          f"{mgr.block_size} tokens, {mgr.max_seqs} rows, chunks of {cfg.chunk_size}"
          + (f", tensor-parallel over {args.tp} devices" if mesh is not None else ""), flush=True)
    print(f"KV pages: {kv['kv_dtype']}{' + float32 scales' if kv['quantized'] else ''}, "
          f"{kv['bytes_per_block']:,} bytes per block; a budget of {kv['budget_bytes']:,} bytes "
          f"(--num-blocks {args.num_blocks} in {kv['model_dtype']}) bought {kv['blocks']} blocks = "
          f"{kv['tokens']} tokens", flush=True)
    if layout.grouped:
        kinds = ", ".join(f"window {w}" if w else "full" for w in layout.group_windows)
        print(f"KV-cache groups: {layout.num_groups} of {layout.slots} layer(s) each ({kinds}); out-of-window "
              f"blocks reclaimed; a block holds {layout.slots} of {model.config.num_layers} layers", flush=True)
    print(f"tokenizer: {tok_desc}; EOS ids {', '.join(map(str, eos_ids)) or 'none'}"
          + ("; prompts rendered through the chat template" if args.chat else ""), flush=True)
    for line in ([note] if note else []) + notes + _workload_notes(reqs, prompts, min(per_seq, max_pos), args):
        print(f"note: {line}", flush=True)
    # Every program compiles here, ahead of the first step, one visible line each ("compiling step
    # variant k/2 ... s", ticking on a terminal): serving then never stops for XLA, and the report
    # gives each program's compile seconds apart from serving time.
    _phase("compile")
    # matplotlib (the block-table picture at the end) takes ~0.4 s to import: do it beside the
    # compile, which runs in XLA without the GIL for most of its time.
    threading.Thread(target=_import_plotting, name="import-matplotlib", daemon=True).start()
    engine.compile(CompileProgress(live=None if not args.no_progress else False))
    if prompts is not None:
        outputs, timing = _stream_prompts(engine, reqs, tok, prompts, prep)
        extra = {"prompts": len(reqs), "tokenizer": {"description": tok_desc, **timing}, "kv_pages": kv,
                 "answers": _answers(outputs, prompts, tok, as_text)}
        return _report(args, engine, outputs, ckpt, tok, as_text, extra, show=_print_beams)
    from tqdm import tqdm

    from paged_kv.apps.progress import BAR_STEADY, BAR_WARMING, SteadyRate

    bar = tqdm(total=len(reqs), unit="req", desc="serving", file=sys.stderr, disable=args.no_progress,
               dynamic_ncols=True, bar_format=BAR_WARMING)
    rate = SteadyRate()

    def on_step(eng):
        if not rate.steady and rate.observe(time.perf_counter()):
            bar.bar_format = BAR_STEADY  # an ETA only now: steps run at a steady rate
        if eng.step_count % 5 == 0:
            bar.set_postfix(step=eng.step_count, running=eng.num_running, waiting=eng.num_waiting,
                            blocks=eng.blocks_in_use, preempted=eng.preemptions, refresh=False)
            bar.refresh()

    outputs = []
    for out in engine.run(reqs, on_step=on_step):  # streamed as each request finishes
        outputs.append(out)
        bar.update(1)
        if out.error is not None:
            bar.write(f"request {out.request_id:>3} rejected: {out.error}")
            continue
        if not args.verbose:
            continue
        st = out.stats
        ttft = "–" if st.time_to_first_token_s is None else f"{st.time_to_first_token_s:.2f} s"
        bar.write(f"request {out.request_id:>3} done at step {st.finish_step:4d}: {_describe(out.request):<34} "
                  f"{st.prompt_tokens:4d} prompt tokens, {st.cached_prompt_tokens:3d} tokens from cache in "
                  f"{st.admissions} admission{'s' if st.admissions > 1 else ''}, "
                  f"{st.generated_tokens:4d} generated, {st.preemptions} preemptions, "
                  f"first token after {ttft}")
    bar.close()

    extra = {"workload": {"requests": args.requests, "max_new_tokens": args.max_new_tokens,
                          "arrival_gap": args.arrival_gap}, "kv_pages": kv}
    return _report(args, engine, outputs, ckpt, tok, as_text, extra, show=_print_outputs)


def _report(args, engine, outputs, ckpt: Path, tok, as_text: bool, extra: dict, *, show) -> int:
    """The report, its files and the answers (``show(outputs, tok, count, as_text=...)``); the exit status."""
    from paged_kv.apps import report

    _phase("report")
    rep = report.build_report(engine, outputs, extra={"checkpoint": str(ckpt), "seed": args.seed, **extra})
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
        print(f"paged-kv: error: {line}", file=sys.stderr)
    return 1 if problems else 0


def _out_dir_problem(out: Path) -> str | None:
    """Why ``out`` cannot be the output folder (it or an ancestor is a file, or the folder it is or
    would be created in is not writable), else None. It is created only when the files are written,
    so this is checked first: a run must not end with its report lost."""
    for p in (out.resolve(), *out.resolve().parents):
        if p.exists():
            if not p.is_dir():
                return "is not a directory" if p == out.resolve() else f"{str(p)!r} is a file, not a directory"
            if not os.access(p, os.W_OK | os.X_OK):
                return ("is not writable" if p == out.resolve()
                        else f"cannot be created: {str(p)!r} is not writable")
            return None
    return None


def _missing_cli_dependencies() -> list[str]:
    """The command line's own dependencies (the ``cli`` extra) that are not installed. Looked up,
    not imported: matplotlib alone takes ~0.4 s to import."""
    import importlib.util

    missing = []
    for name in ("tqdm", "matplotlib"):
        try:
            found = sys.modules[name] is not None if name in sys.modules else \
                importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _check_widths(args) -> None:
    """``--n`` / ``--beam-width`` against ``--max-seqs`` (every answer of a prompt runs as a row of
    its own, all at once), before anything is loaded."""
    for opt, w in (("--n", args.n), ("--beam-width", args.beam_width)):
        if w > args.max_seqs:
            raise ValueError(f"{opt} {w} needs {w} sequences running at once; --max-seqs is {args.max_seqs} "
                             f"(raise --max-seqs to {w} or more, or lower {opt})")


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


def _check_prompts(args, prompts, block_size: int, context: int, limit: str) -> list[str]:
    """Your prompts against the pool and the sequence length, in the command line's terms
    (``ValueError`` naming the option), before anything compiles; returns notes for answers that
    ``--max-seq-len`` will cut short. ``context``: tokens a sequence can hold; ``limit``: what
    sets it (``--max-seq-len N`` or the model's context)."""
    blocks = args.num_blocks - 1  # block 0 is reserved
    width = max(args.n, args.beam_width)
    cut = []
    for i, (text, ids) in enumerate(prompts):
        n = len(ids)
        if n > context:
            raise ValueError(f"prompt {i} ({_short(text, 40)!r}) has {n} tokens; {limit} allows {context} per "
                             f"sequence (prompt + answer): raise --max-seq-len or shorten the prompt")
        longest = min(n + args.max_new_tokens - 1, context)
        need = width * -(-longest // block_size)
        if need > blocks:
            who = f"{width} answers of" if width > 1 else "an answer of"
            raise ValueError(f"prompt {i} ({_short(text, 40)!r}): {who} up to {longest} tokens need up to {need} "
                             f"blocks of {block_size} tokens; --num-blocks {args.num_blocks} gives {blocks} "
                             f"(raise --num-blocks, or lower --max-new-tokens or --n/--beam-width)")
        if n + args.max_new_tokens - 1 > context:  # the engine's cap: context - n + 1 new tokens
            cut.append(i)
    if not cut:
        return []
    return [f"{limit} leaves prompt{'s' if len(cut) > 1 else ''} {', '.join(map(str, cut[:8]))}"
            f"{' ...' if len(cut) > 8 else ''} fewer than --max-new-tokens {args.max_new_tokens} new tokens: "
            "their answers stop at the sequence length (finish reason 'length_capped')"]


def main(argv: Sequence[str] | None = None) -> int:
    install_interrupt_handler()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.block_size & (args.block_size - 1):
        parser.error(f"--block-size {args.block_size} must be a power of two")
    if args.num_blocks < 2:
        parser.error(f"--num-blocks {args.num_blocks} must be >= 2 (block 0 is reserved)")
    if args.max_new_tokens >= args.max_seq_len:
        parser.error(f"--max-new-tokens {args.max_new_tokens} does not fit --max-seq-len {args.max_seq_len} "
                     f"(prompt + answer, and a prompt has at least one token): at most {args.max_seq_len - 1}")
    for path in (args.png, args.json):
        if path and not Path(path).resolve().parent.is_dir():
            parser.error(f"directory of {path!r} does not exist")
        if path and not os.access(Path(path).resolve().parent, os.W_OK | os.X_OK):
            parser.error(f"directory of {path!r} is not writable")
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
    try:  # your prompts and their sampling options, before anything is loaded
        if _read_prompts(args) is None:
            given = [opt for opt, v, default in (("--chat", args.chat, False), ("--n", args.n, 1),
                                                  ("--beam-width", args.beam_width, 1),
                                                  ("--temperature", args.temperature, 0.0),
                                                  ("--top-p", args.top_p, 1.0), ("--top-k", args.top_k, 0))
                     if v != default]
            if given:
                parser.error(f"{given[0]} applies to your prompts: give --prompt TEXT or --prompts-file FILE "
                             "(the built-in workload has its own sampling options)")
        else:
            _sampling_params(args)
            _check_widths(args)
    except ValueError as e:
        parser.error(str(e))
    if not args.walkthrough:
        missing = _missing_cli_dependencies()
        if missing:
            print(f"paged-kv: error: the command line needs {' and '.join(missing)}, which "
                  f"{'is' if len(missing) == 1 else 'are'} not installed: pip install 'paged-kv[cli]'",
                  file=sys.stderr)
            return 1
    if args.walkthrough:
        from paged_kv.apps.walkthrough import main as walkthrough

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
