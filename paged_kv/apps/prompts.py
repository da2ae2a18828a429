"""Your prompts (``--prompt``, ``--prompts-file``): encoded (through the chat template with
``--chat``), made into requests with a seed derived from each prompt's content
(``prompt_seed``), served with their answers streamed as they are generated (``stream_prompts``,
``StreamPrinter``), and recorded in the report (``answers``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from paged_kv.apps.interrupt import phase
from paged_kv.apps.options import read_prompts, sampling_params
from paged_kv.apps.workload import short, shown_tokens

if TYPE_CHECKING:  # the engine and models load on first use: `--help` imports no JAX
    import argparse

    from paged_kv.engine.serving import Request, ServingEngine
    from paged_kv.engine.serving_types import RequestOutput, TokenDelta
    from paged_kv.models.hf_tokenizer import HFTokenizer
    from paged_kv.models.tokenizer import ByteTokenizer

    Tokenizer = HFTokenizer | ByteTokenizer


def user_prompts(args: argparse.Namespace, tok: Tokenizer, timing: dict) -> list[tuple[str, list[int]]] | None:
    """(text, token ids) per prompt: with ``--chat`` the text rendered through the chat template
    and encoded without added special tokens (the template carries them), as transformers'
    ``apply_chat_template`` does; else encoded with the checkpoint's special tokens. ``timing``
    receives ``encode_s`` and ``render_s`` (seconds over all prompts)."""
    texts = read_prompts(args)
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


def prompt_seed(run_seed: int, token_ids: Sequence[int]) -> int:
    """The sampling seed of a prompt given without one: a stable hash of the run's ``--seed`` and
    the prompt's token ids (blake2b of ``"{run_seed}:{id},{id},..."``) in ``[0, 2**31)``. A
    function of the prompt's content alone, not its place in the list or the other prompts, and
    the same in every process (Python's ``hash`` is salted per process)."""
    import hashlib

    from paged_kv.engine.sampling import SEED_LIMIT

    text = f"{int(run_seed)}:{','.join(str(int(t)) for t in token_ids)}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") % SEED_LIMIT


def prompt_requests(args: argparse.Namespace, prompts: Sequence[tuple[str, list[int]]],
                    eos_ids: tuple[int, ...] | None) -> list[Request]:
    """Your prompts as requests ``0 .. len - 1``, each seeded by ``prompt_seed``."""
    from paged_kv.engine.serving import Request

    params = sampling_params(args, eos_ids)
    return [Request(ids, params, arrival=0, request_id=i, seed=prompt_seed(args.seed, ids))
            for i, (_, ids) in enumerate(prompts)]


_CONTROL = {c: "\\n" if chr(c) == "\n" else f"\\x{c:02x}" for c in (*range(0x20), 0x7F) if chr(c) != "\t"}
"""C0 controls and DEL (bar tab) -> a visible escape, newline as ``\\n``: generated text never moves
the terminal's cursor or starts an escape sequence, and each answer stays on its own line (a run
of newlines shows as ``\\n\\n...``, not as blank lines)."""


def printable(text: str) -> str:
    """``text`` as the stream prints it (control characters escaped, ``_CONTROL``)."""
    return text.translate(_CONTROL)


class StreamPrinter:
    """Prints answers as their tokens arrive, one answer at a time in (prompt, sample) order: the
    current answer prints live, later ones are decoded as they come and held until their turn.
    Beam requests print their best hypothesis when the search ends (the rest in the summary).
    Each answer is decoded incrementally (``paged_kv.models.hf_tokenizer.stream_decoder``), so a character
    split over several tokens prints once, whole; EOS and special tokens print nothing."""

    def __init__(self, tok: Tokenizer, requests: Sequence[Request], prompts: Sequence[tuple[str, list[int]]],
                 out: TextIO | None = None):
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
                self.titles[(req.request_id, j)] = f"[prompt {req.request_id}, {what}] {short(text, 60)!r} ->"
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

    def on_token(self, delta: TokenDelta) -> None:
        u = (delta.request_id, delta.index)
        if u not in self.decoders or self.cur >= len(self.units):
            return  # a beam hypothesis past the best (printed with the summary), or the stream ended
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

    def on_output(self, out: RequestOutput) -> None:
        """A finished (or rejected) request: all its answers are complete."""
        for u in self.units:
            if u[0] == out.request_id and u not in self.done:
                self._finish(u, f" [rejected: {out.error}]" if out.error else "")

    def end_line(self) -> None:
        """Ends the line of an answer still streaming (before an error is printed)."""
        if 0 <= self.cur < len(self.units):
            self._write("\n")
            self.cur = len(self.units)  # nothing more prints

    def _finish(self, u, tail: str) -> None:
        if self.cur < len(self.units) and self.units[self.cur] == u:
            self._write(tail)
        else:
            self.held[u].append(tail)
        self.done.add(u)
        self._advance()


def stream_prompts(engine: ServingEngine, reqs: Sequence[Request], tok: Tokenizer,
                   prompts: Sequence[tuple[str, list[int]]], prep: dict, outputs: list) -> dict:
    """Serve ``reqs`` (made from ``prompts``; ``prep``: their encode and chat-render seconds)
    streaming their text; appends each output to ``outputs`` as it finishes; returns the
    tokenizer timing for the report."""
    printer = StreamPrinter(tok, reqs, prompts)
    try:
        for out in engine.run(reqs, on_token=printer.on_token):
            outputs.append(out)
            phase("served")
            printer.on_output(out)
    finally:
        printer.end_line()  # an error (or Ctrl-C) mid-answer starts on a line of its own
    st = engine.stats()
    n = max(len(reqs), 1)
    return {
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


def answers(outputs: Sequence[RequestOutput], prompts: Sequence[tuple[str, list[int]]], tok: Tokenizer,
            as_text: bool) -> list[dict]:
    """The report's record of your prompts, in prompt order (those in ``outputs``): per prompt its
    text, token count and seed, and per answer what ``report.answer_entries`` records (token ids,
    log-probabilities or a beam's score, why it ended) and the text (up to the first EOS; None
    where the ids are not all text)."""
    from paged_kv.apps.report import answer_entries

    out = []
    for o in sorted(outputs, key=lambda o: o.request_id):
        text, ids = prompts[o.request_id]
        entry = {"prompt": text, "prompt_tokens": len(ids), "seed": o.seed, "error": o.error, "answers": []}
        for toks, a in zip(o.tokens, answer_entries(o)):
            try:
                decoded = tok.decode(toks, stop_at_eos=True) if as_text else None
            except ValueError:  # an id the tokenizer has no text for
                decoded = None
            entry["answers"].append({**a, "text": decoded})
        out.append(entry)
    return out


def print_beams(outputs: Sequence[RequestOutput], tok: Tokenizer, count: int, *, as_text: bool = True) -> None:
    """After streaming: every hypothesis of the beam requests with its score (the answers of the
    sampled ones were streamed)."""
    for o in sorted(outputs, key=lambda o: o.request_id):  # prompt order (they finish in any order)
        if o.ok and o.request.is_beam:
            print(f"\n[prompt {o.request_id}: beam search, width {o.request.params.beam_width}]")
            for j, toks in enumerate(o.tokens[:count]):
                print(f"    beam {j} (score {o.scores[j]:.3f}): {shown_tokens(tok, toks, 90, as_text=as_text)}")


__all__ = ["StreamPrinter", "answers", "print_beams", "printable", "prompt_requests", "prompt_seed", "stream_prompts",
           "user_prompts"]
