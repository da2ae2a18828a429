"""The command line's options: the parser (``build_parser``, which ``--help`` prints), where the
files go (``output_paths``), and the checks of the options before anything loads
(``check_options``; those that need the checkpoint's config follow with ``check_prompts`` and
``sequence_context``). A problem is a ``UsageError``: one line naming the option, exit status 2
(``paged_kv.apps.cli.main``); a library ``ValueError`` raised by an option's value is named as
the option (``OptionCheck``, ``in_option_terms``).

Imports no JAX (``--help`` answers without it); the library's own checks import it when they run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paged_kv.apps.interrupt import first_line
from paged_kv.apps.workload import short
from paged_kv.checkpoints import BUILTIN as BUILTIN_CHECKPOINT

if TYPE_CHECKING:  # the engine loads on first use: `--help` imports no JAX
    from paged_kv.engine import BeamParams, SamplingParams

DEFAULT_OUT_DIR = "paged-kv-out"
"""Where the main job writes its files unless told otherwise (relative to the current directory)."""
PNG_NAME = "block_tables.png"
JSON_NAME = "report.json"


class UsageError(Exception):
    """A bad combination of options found after parsing: exit 2, like argparse."""


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
        epilog=f"Files go to {DEFAULT_OUT_DIR}/ unless --out-dir, --png or --json say otherwise; a run refuses to "
               "replace the files of an earlier one unless --overwrite. Exit status: 0 done; 1 the run failed (a "
               "checkpoint that cannot be loaded, a file that cannot be written, every request rejected, a missing "
               "package); 2 the options cannot serve (one line naming the option, before anything loads); 130 "
               "interrupted (Ctrl-C; the report then holds the requests that finished, marked partial). How the "
               "block manager, kernels, model and engines work: docs/design.md in the repository.",
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
    g.add_argument("--seed", type=_non_negative, default=0,
                   help="the run's sampling seed (same seed, same outputs). Your prompts: each prompt's seed is "
                        "derived from --seed and the prompt's token ids (blake2b, prompt_seed), not its place in "
                        "the list, so a prompt samples the same answers wherever it stands and whatever else runs "
                        "(bit for bit with --batch-invariant; otherwise where its logits come out the same); the "
                        "same prompt twice samples the same answers (--n for several). The workload: derived from "
                        "--seed and the request number. Each request's seed is in the report")
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
                   help="tokens per sequence at most (prompt + answer), rounded up to whole blocks, then capped by "
                        "the model's context (config.json's max_position_embeddings): a larger value serves the "
                        "model's context, and answers that reach it end early (finish reason 'length_capped')")
    # The three scheduler sizes default to ServingConfig's own (None: it resolves them; the
    # report prints the values used), so the command line serves as the library does.
    g.add_argument("--chunk-size", type=_positive, default=None, metavar="TOKENS",
                   help="prefill positions per piece (default: ServingConfig's, 16)")
    g.add_argument("--max-prefill-rows", type=_positive, default=None, metavar="N",
                   help="prompts admitted (and prefilled) together at most (default: ServingConfig's, "
                        "min(--max-seqs, 4096 / chunk size))")
    g.add_argument("--decode-steps", type=_positive, default=None, metavar="K",
                   help="decode steps one device call may run while nothing needs the host in between "
                        "(ServingConfig.decode_steps; default 16; 1: one call per step, tokens stream one at a time)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    g.add_argument("--tp", type=_positive, default=1, metavar="N",
                   help="tensor-parallel degree: shard the weights and KV heads over N devices "
                        "(on a CPU, N host devices are created); must fit the model's heads")
    g.add_argument("--impl", choices=("auto", "reference", "interpret", "pallas"), default="auto",
                   help="attention/copy kernels: auto = Pallas on GPU, the jnp reference on CPU")
    g.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant decoding (ServingConfig.batch_invariant): each request's tokens and "
                        "log-probs the same bits whatever else runs (docs/batch_invariance.md); plain KV pages "
                        "only (--kv-dtype auto); on the reference kernels (--impl reference, or auto off a GPU) "
                        "the --block-size must divide 128")
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
    g.add_argument("--overwrite", action="store_true",
                   help=f"replace the files of an earlier run at the output paths ({JSON_NAME}, {PNG_NAME}), "
                        "removing its picture when this run draws none, so nothing stale stays beside the new "
                        "report; without it, a run whose report or picture already exists is refused before "
                        "anything loads. Every file is written under a temporary name in its folder, then renamed")
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


def checkpoint_dir(args: argparse.Namespace) -> Path:
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


def read_prompts(args: argparse.Namespace) -> list[str] | None:
    """The ``--prompt`` texts, then the lines of ``--prompts-file``; None when neither is given."""
    if args.prompt is None and args.prompts_file is None:
        return None
    texts = list(args.prompt or [])
    if args.prompts_file is not None:
        try:
            with open(args.prompts_file, encoding="utf-8") as fh:
                texts += [line.rstrip("\r\n") for line in fh if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --prompts-file {args.prompts_file!r}: {first_line(e)}") from None
    if not texts:
        raise ValueError(f"--prompts-file {args.prompts_file!r} holds no prompt (every line is empty)")
    return texts


def sampling_params(args: argparse.Namespace, eos_ids: tuple[int, ...] | None = ()) -> SamplingParams | BeamParams:
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


def sequence_context(args: argparse.Namespace, config: Any) -> tuple[int, str]:
    """(tokens a sequence holds, what sets it): ``--max-seq-len`` rounded up to whole blocks, capped
    by the model's context (``max_position_embeddings``) first."""
    per_seq = -(-args.max_seq_len // args.block_size) * args.block_size  # whole blocks
    max_pos = config.max_position_embeddings
    if max_pos < per_seq:
        return max_pos, f"the model's context (max_position_embeddings={max_pos}, under --max-seq-len " \
                        f"{args.max_seq_len})"
    return per_seq, f"--max-seq-len {args.max_seq_len}"


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


def missing_cli_dependencies() -> list[str]:
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


def missing_extra_message(missing: list[str]) -> str:
    return (f"the command line needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            "installed: pip install 'paged-kv[cli]' (from a checkout of the repository: pip install -e '.[cli]')")


def _check_widths(args) -> None:
    """``--n`` / ``--beam-width`` against ``--max-seqs`` (every answer of a prompt runs as a row of
    its own, all at once), before anything is loaded."""
    for opt, w in (("--n", args.n), ("--beam-width", args.beam_width)):
        if w > args.max_seqs:
            raise ValueError(f"{opt} {w} needs {w} sequences running at once; --max-seqs is {args.max_seqs} "
                             f"(raise --max-seqs to {w} or more, or lower {opt})")


def check_prompts(args: argparse.Namespace, prompts: Sequence[tuple[str, list[int]]],
                  block_size: int, context: int, limit: str) -> list[str]:
    """Your prompts against the pool and the sequence length, in the command line's terms
    (``UsageError`` naming the option), before anything loads; returns notes for answers that
    ``--max-seq-len`` will cut short. ``context``: tokens a sequence can hold; ``limit``: what
    sets it (``--max-seq-len N`` or the model's context)."""
    blocks = args.num_blocks - 1  # block 0 is reserved
    width = max(args.n, args.beam_width)
    cut = []
    for i, (text, ids) in enumerate(prompts):
        n = len(ids)
        if n > context:
            raise UsageError(f"prompt {i} ({short(text, 40)!r}) has {n} tokens; {limit} allows {context} per "
                             f"sequence (prompt + answer): raise --max-seq-len or shorten the prompt")
        longest = min(n + args.max_new_tokens - 1, context)
        need = width * -(-longest // block_size)
        if need > blocks:
            who = f"{width} answers of" if width > 1 else "an answer of"
            capped = f" ({limit} caps them)" if longest < n + args.max_new_tokens - 1 else ""
            raise UsageError(f"prompt {i} ({short(text, 40)!r}): {who} up to {longest} tokens{capped} need up "
                              f"to {need} blocks of {block_size} tokens; --num-blocks {args.num_blocks} gives "
                              f"{blocks} (raise --num-blocks, or lower --max-new-tokens or --n/--beam-width)")
        if n + args.max_new_tokens - 1 > context:  # the engine's cap: context - n + 1 new tokens
            cut.append(i)
    if not cut:
        return []
    return [f"{limit} leaves prompt{'s' if len(cut) > 1 else ''} {', '.join(map(str, cut[:8]))}"
            f"{' ...' if len(cut) > 8 else ''} fewer than --max-new-tokens {args.max_new_tokens} new tokens: "
            "their answers stop at the sequence length (finish reason 'length_capped')"]


# Library argument -> the option that sets it, for a library ValueError raised by an option's
# value (``in_option_terms``). Names with an underscore cannot be prose; the short ones only as
# ``name=value``.
_OPTION_OF = {"num_blocks": "--num-blocks", "block_size": "--block-size", "max_seqs": "--max-seqs",
              "chunk_size": "--chunk-size", "max_prefill_rows": "--max-prefill-rows",
              "decode_steps": "--decode-steps", "batch_invariant": "--batch-invariant", "kv_dtype": "--kv-dtype",
              "max_new_tokens": "--max-new-tokens", "top_k": "--top-k", "top_p": "--top-p",
              "beam_width": "--beam-width", "max_tokens_per_seq": "--max-seq-len"}
_OPTION_OF_ASSIGNED = {"n": "--n", "tp": "--tp", "impl": "--impl", "seed": "--seed", "temperature": "--temperature"}


def in_option_terms(message: str) -> str:
    """A library ``ValueError``'s text with the arguments the command line sets named as its
    options: ``decode_steps=100 must be <= 64`` -> ``--decode-steps 100 must be <= 64``."""
    import re

    def sub(m: re.Match) -> str:
        name, assigned = m[1], m[2]
        return (_OPTION_OF.get(name) or _OPTION_OF_ASSIGNED[name]) + (" " if assigned else "")

    names = "|".join(sorted({*_OPTION_OF, *_OPTION_OF_ASSIGNED}, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.-])({names})\b(=)?")
    return pattern.sub(lambda m: sub(m) if m[1] in _OPTION_OF or m[2] else m[0], message)


class OptionCheck:
    """``with OptionCheck():`` turns a library ``ValueError`` raised by an option's value into a
    ``UsageError`` (exit 2) that names the options (``in_option_terms``)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if kind is not None and issubclass(kind, ValueError) and not issubclass(kind, UsageError):
            raise UsageError(in_option_terms(first_line(err))) from None
        return False


def _check_output_paths(args) -> None:
    """``--png`` / ``--json`` / ``--out-dir`` can be written, and hold no earlier run's files
    unless ``--overwrite`` (``UsageError`` naming the option)."""
    for opt, path in (("--png", args.png), ("--json", args.json)):
        if not path:
            continue
        parent = Path(path).resolve().parent
        if not parent.is_dir():
            raise UsageError(f"{opt} {path!r}: its folder {str(parent)!r} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"{opt} {path!r}: its folder {str(parent)!r} is not writable")
        if Path(path).is_dir():
            raise UsageError(f"{opt} {path!r} is a directory; name a file")
    if not (args.png and args.json):  # some file goes to --out-dir: it must be (or become) a folder
        problem = _out_dir_problem(Path(args.out_dir))
        if problem:
            raise UsageError(f"--out-dir {args.out_dir!r}: {problem}")
    if not args.overwrite:
        png, js = output_paths(args)
        for path, what, opt in ((js, "report", "--json"), (png, "block-table picture", "--png")):
            if path.exists():
                where = f"{opt} {str(path)!r}" if getattr(args, opt[2:]) else f"--out-dir {args.out_dir!r}"
                raise UsageError(f"{where} already holds an earlier run's {what} ({path.name}): pass --overwrite "
                                  "to replace that run's files, or choose another --out-dir")


def check_options(args: argparse.Namespace) -> None:
    """Every check of the options alone, before anything is loaded: ``UsageError`` (exit 2) naming
    the option. The checks that need the checkpoint (its context, heads and chat template) and the
    backend (``--impl pallas``, ``--batch-invariant``'s block size) follow in ``paged_kv.apps.cli``, still
    before the weights load."""
    if args.block_size & (args.block_size - 1):
        raise UsageError(f"--block-size {args.block_size} must be a power of two")
    if args.num_blocks < 2:
        raise UsageError(f"--num-blocks {args.num_blocks} must be >= 2 (block 0 is reserved)")
    if args.max_new_tokens >= args.max_seq_len:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} does not fit --max-seq-len {args.max_seq_len} "
                          f"(prompt + answer, and a prompt has at least one token): at most {args.max_seq_len - 1}")
    from paged_kv.pallas_kernels import plan  # the execution plan's table decides (its refusals, in option terms)

    refused = plan.refusal(args.impl, backend=False, batch_invariant=args.batch_invariant, kv_dtype=args.kv_dtype)
    if refused is not None and refused[0] == "invariant_quant":
        raise UsageError(f"--batch-invariant does not support --kv-dtype {args.kv_dtype} (the batch-invariant "
                          "kernels read plain pages, with no scales): use --kv-dtype auto, or drop --batch-invariant")
    with OptionCheck():  # the pool's and the engine's own checks (sizes, int32 slot indices, ...)
        import paged_kv as pk
        from paged_kv.engine.serving import ServingConfig

        mgr = pk.ManagerConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_seqs=args.max_seqs,
                               max_blocks_per_seq=-(-args.max_seq_len // args.block_size))
        ServingConfig(mgr, chunk_size=args.chunk_size,
                      max_prefill_rows=None if args.max_prefill_rows is None else min(args.max_prefill_rows,
                                                                                      args.max_seqs),
                      impl=args.impl, decode_steps=args.decode_steps, batch_invariant=args.batch_invariant,
                      kv_dtype=args.kv_dtype)
    with OptionCheck():  # your prompts and their sampling options
        if read_prompts(args) is None:
            given = [opt for opt, v, default in (("--chat", args.chat, False), ("--n", args.n, 1),
                                                  ("--beam-width", args.beam_width, 1),
                                                  ("--temperature", args.temperature, 0.0),
                                                  ("--top-p", args.top_p, 1.0), ("--top-k", args.top_k, 0))
                     if v != default]
            if given:
                raise UsageError(f"{given[0]} applies to your prompts: give --prompt TEXT or --prompts-file FILE "
                                  "(the built-in workload has its own sampling options)")
        else:
            sampling_params(args)
            _check_widths(args)
    if not args.walkthrough:  # (which writes no file)
        _check_output_paths(args)


__all__ = ["DEFAULT_OUT_DIR", "JSON_NAME", "PNG_NAME", "OptionCheck", "UsageError", "build_parser", "check_options",
           "check_prompts", "checkpoint_dir", "in_option_terms", "missing_cli_dependencies",
           "missing_extra_message", "output_paths", "read_prompts", "sampling_params", "sequence_context"]
