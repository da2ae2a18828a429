"""A checkpoint's own Hugging Face tokenizer, read with the `tokenizers` library (the one
transformers' fast tokenizers wrap), and the choice between it and the byte tokenizer.

Files read from a checkpoint directory (nothing is downloaded):

* `tokenizer.json`: the tokenizer itself (BPE, Unigram, WordPiece ... with its normaliser,
  pre-tokeniser, post-processor and decoder); encoded and decoded by `tokenizers.Tokenizer`.
* `tokenizer_config.json` (optional): `bos_token` / `eos_token` (strings, or `{"content": ...}`),
  `add_bos_token`, `chat_template` (a string, or a list of named templates: "default" is used).
* `generation_config.json` (optional): `bos_token_id` and `eos_token_id` (an int or a list: every
  id of the list ends a generation); these take precedence over `config.json`'s and the tokenizer's.

Special tokens when encoding a prompt follow transformers: the post-processor of `tokenizer.json`
adds them (Llama 3's template puts `<|begin_of_text|>` first); an explicit `add_bos_token` in
`tokenizer_config.json` has the last word (true: a BOS id is put first if the post-processor did
not; false: a leading BOS is dropped). Chat prompts (`render_chat`) carry their special tokens in
the template and are encoded without adding any, as `apply_chat_template` does.

`load_tokenizer(directory)` picks what the checkpoint ships: the byte tokenizer for a
`tokenizer.json` of type "byte" (the built-in model), this one for a Hugging Face `tokenizer.json`,
and the byte tokenizer (prompts as UTF-8 bytes) when there is none.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from paged_kv.models.hf_format import checkpoint_token_ids, read_json_object as _read_json
from paged_kv.models.tokenizer import TOKENIZER_FILE, ByteTokenizer

if TYPE_CHECKING:  # tokenizers loads on first use (HFTokenizer.load)
    import tokenizers

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class StreamDecoder:
    """Incremental detokenisation of one sequence: `push(token_id)` returns the text that token
    completes ("" while a multi-byte character or a merged piece is still incomplete), and
    `finish()` what is still held when the sequence ends (an incomplete character: U+FFFD, as
    `decode` shows it), so that all the pieces joined equal `decode` of all the ids. Special tokens
    print nothing."""

    def __init__(self, tokenizer: HFTokenizer):
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self._sent = 0  # characters returned so far

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        piece = self._stream.step(self._tok.backend, int(token_id)) or ""
        self._sent += len(piece)
        return piece

    def finish(self) -> str:
        whole = self._tok.backend.decode(self._ids, skip_special_tokens=True)
        rest = whole[self._sent:]
        self._sent = len(whole)
        return rest


class ByteStreamDecoder:
    """`StreamDecoder` for the byte tokenizer: UTF-8 decoded incrementally, specials skipped."""

    def __init__(self, tokenizer: ByteTokenizer):
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        t = int(token_id)
        return self._utf8.decode(bytes([t])) if 0 <= t < 256 else ""

    def finish(self) -> str:
        """An incomplete character still held, as U+FFFD (what `decode` shows)."""
        return self._utf8.decode(b"", final=True)


class HFTokenizer:
    """A checkpoint's `tokenizer.json` through `tokenizers.Tokenizer` (module docstring).

    Attributes:
      backend: the `tokenizers.Tokenizer`.
      vocab_size: ids it knows, added tokens included.
      bos_id: the BOS id or None; eos_ids: every id that ends a generation (may be empty).
      add_bos_token: `tokenizer_config.json`'s flag, or None when it leaves BOS to the post-processor.
      chat_template: the template string, or None.
      special_tokens: the special tokens' strings (`bos_token`, `eos_token`, `pad_token`,
        `unk_token`) as the chat template sees them.
    """

    type_name = "hf"

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_id: int | None, eos_ids: Sequence[int],
                 add_bos_token: bool | None = None, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None, kind: str = "?"):
        self.backend = backend
        self.kind = kind
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @property
    def eos_id(self) -> int | None:
        """The first EOS id (None when the checkpoint names none)."""
        return self.eos_ids[0] if self.eos_ids else None

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Token ids of `text`; `add_bos`: with the special tokens the checkpoint adds to a prompt
        (module docstring), else none (a rendered chat prompt carries its own)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids = list(self.backend.encode(text, add_special_tokens=add_bos).ids)
        if add_bos and self.add_bos_token is not None and self.bos_id is not None:
            starts = bool(ids) and ids[0] == self.bos_id
            if self.add_bos_token and not starts:
                ids.insert(0, self.bos_id)
            elif not self.add_bos_token and starts:
                ids.pop(0)
        return ids

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = False) -> str:
        """Text of `ids`, special tokens and negative ids (the -1 padding of a generated row) skipped;
        with `stop_at_eos`, only the ids before the first EOS."""
        ids = [int(i) for i in ids if int(i) >= 0]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside the vocabulary [0, {self.vocab_size})")
        if stop_at_eos:
            cut = next((k for k, i in enumerate(ids) if i in self.eos_ids), len(ids))
            ids = ids[:cut]
        return self.backend.decode(ids, skip_special_tokens=True)

    def stream(self) -> StreamDecoder:
        """A fresh incremental decoder for one sequence."""
        return StreamDecoder(self)

    def describe(self) -> str:
        """One line for a run's header: the file, the tokenizer model (BPE, ...) and the vocabulary."""
        return f"{TOKENIZER_FILE} ({self.kind}, {self.vocab_size} ids) through tokenizers"

    # ------------------------------------------------------------------ chat
    def compile_chat_template(self) -> None:
        """Compile the chat template now (it is compiled once and kept); ValueError for a template
        jinja2 cannot parse, or none."""
        import jinja2

        if self.chat_template is None:
            raise ValueError(f"the checkpoint's {TOKENIZER_CONFIG_FILE} has no chat_template")
        try:
            _compiled_template(self.chat_template)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat_template: {e}") from None

    def render_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        """`messages` ([{"role": ..., "content": ...}, ...]) through the checkpoint's `chat_template`
        (`render_chat_template`); ValueError when the checkpoint has none."""
        if self.chat_template is None:
            raise ValueError(f"the checkpoint's {TOKENIZER_CONFIG_FILE} has no chat_template")
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens)

    def __repr__(self):
        return f"HFTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids})"

    # ------------------------------------------------------------------ files
    @classmethod
    def load(cls, directory: str | os.PathLike) -> HFTokenizer:
        """From a checkpoint directory holding a Hugging Face `tokenizer.json` (module docstring)."""
        from tokenizers import Tokenizer

        path = Path(directory)
        try:
            backend = Tokenizer.from_file(str(path / TOKENIZER_FILE))
        except Exception as e:  # the library raises its own exception type for a malformed file
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"{str(path / TOKENIZER_FILE)!r} is not a tokenizers file: {first}") from None
        tcfg = _read_json(path / TOKENIZER_CONFIG_FILE)
        vocab = int(backend.get_vocab_size(with_added_tokens=True))
        special = {k: t for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                   if (t := _token_text(tcfg.get(k))) is not None}

        def by_text(name: str) -> tuple[int, ...]:
            text = special.get(name)
            if text is None:
                return ()
            tid = backend.token_to_id(text)
            if tid is None:
                raise ValueError(f"{TOKENIZER_CONFIG_FILE}: {name}={text!r} is not a token of {TOKENIZER_FILE}")
            return (tid,)

        # generation_config.json first (what transformers.generate stops on), then config.json
        # (`checkpoint_token_ids`, as the model's loader reads them), then the tokenizer's strings.
        eos = checkpoint_token_ids(path, "eos_token_id", vocab) or by_text("eos_token")
        bos = checkpoint_token_ids(path, "bos_token_id", vocab) or by_text("bos_token")
        add_bos = tcfg.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ValueError(f"{TOKENIZER_CONFIG_FILE}: add_bos_token={add_bos!r} must be true, false or absent")
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{TOKENIZER_CONFIG_FILE}: chat_template must be a string")
        kind = type(backend.model).__name__  # BPE, Unigram, WordPiece, WordLevel
        return cls(backend, bos_id=bos[0] if bos else None, eos_ids=eos, add_bos_token=add_bos,
                   chat_template=template, special_tokens=special, kind=kind)


# ---------------------------------------------------------------------------- chat templates
@functools.lru_cache(maxsize=8)
def _compiled_template(template: str):
    """The template compiled in transformers' environment (`render_chat_template`), once per string."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat_template(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                         special_tokens: dict[str, str] | None = None) -> str:
    """Render a Hugging Face chat template with jinja2 in the environment transformers uses for
    `apply_chat_template`: a sandbox (a template is code from the checkpoint: it may not reach
    Python objects), `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson`
    filter that keeps non-ASCII text, and the globals `raise_exception(message)` and
    `strftime_now(format)`. The template sees `messages`, `add_generation_prompt` and the special
    tokens' strings (`bos_token`, `eos_token`, ...)."""
    import jinja2

    if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ValueError("messages must be a list of {'role': str, 'content': ...} dicts")
    try:
        return _compiled_template(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               **(special_tokens or {}))
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat_template: {e}") from None


# ---------------------------------------------------------------------------- the choice
class LoadedTokenizer(NamedTuple):
    """What `load_tokenizer` returns: unpacks as ``tok, description = load_tokenizer(path)``."""

    tokenizer: ByteTokenizer | HFTokenizer
    description: str
    """One line naming the choice (the CLI prints it)."""


def load_tokenizer(directory: str | os.PathLike) -> LoadedTokenizer:
    """``LoadedTokenizer(tokenizer, description)`` for a checkpoint directory: `ByteTokenizer` for a `tokenizer.json`
    of type "byte", `HFTokenizer` for a Hugging Face one, `ByteTokenizer` (UTF-8 prompts) when the
    checkpoint ships no tokenizer. The description names the choice (the CLI prints it)."""
    path = Path(directory)
    file = path / TOKENIZER_FILE
    if not file.is_file():
        return LoadedTokenizer(ByteTokenizer(), f"byte-level (UTF-8; the checkpoint has no {TOKENIZER_FILE})")
    # The byte tokenizer's file is a few lines; a Hugging Face one is larger than this (its byte
    # alphabet alone), often megabytes: only a small file is parsed here to tell them apart.
    small = file.stat().st_size < 64 * 1024
    if small and _read_json(file).get("type") == ByteTokenizer.type_name:
        return LoadedTokenizer(ByteTokenizer.load(path), f"byte-level ({TOKENIZER_FILE} of type 'byte')")
    tok = HFTokenizer.load(path)
    return LoadedTokenizer(tok, tok.describe())


def stream_decoder(tokenizer: ByteTokenizer | HFTokenizer) -> ByteStreamDecoder | StreamDecoder:
    """A fresh incremental decoder (`push(id) -> str`) for either tokenizer."""
    if isinstance(tokenizer, ByteTokenizer):
        return ByteStreamDecoder(tokenizer)
    return tokenizer.stream()


__all__ = ["ByteStreamDecoder", "HFTokenizer", "LoadedTokenizer", "StreamDecoder", "load_tokenizer",
           "render_chat_template", "stream_decoder"]
