"""Byte-level tokenizer: no vocabulary file to download, every string encodable.

Ids 0..255 are the UTF-8 bytes of the text; three special ids follow (PAD 256, BOS 257, EOS 258),
so the vocabulary has 259 entries. `decode` drops special ids and negative ids (the -1 that pads
`generate`'s and `beam_search`'s token rows after each answer's end), and replaces byte sequences
that are not valid UTF-8 (a generation cut in the middle of a multi-byte character) with U+FFFD.

A checkpoint directory carries the tokenizer as `tokenizer.json` (`ByteTokenizer.save` /
`ByteTokenizer.load`), so it describes itself without any other file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
NUM_BYTES = 256
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
VOCAB_SIZE = 259
SPECIAL_TOKENS = {"<pad>": PAD_ID, "<bos>": BOS_ID, "<eos>": EOS_ID}


class ByteTokenizer:
    """UTF-8 bytes plus PAD/BOS/EOS specials."""

    type_name = "byte"

    def __init__(self, pad_id: int = PAD_ID, bos_id: int = BOS_ID, eos_id: int = EOS_ID,
                 vocab_size: int = VOCAB_SIZE):
        ids = (pad_id, bos_id, eos_id)
        if len(set(ids)) != 3 or any(not NUM_BYTES <= i < vocab_size for i in ids):
            raise ValueError(f"special ids {ids} must be distinct and in [{NUM_BYTES}, vocab_size={vocab_size})")
        self.pad_id, self.bos_id, self.eos_id, self.vocab_size = pad_id, bos_id, eos_id, vocab_size

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end a generation (one here; `paged_kv.models.hf_tokenizer.HFTokenizer` may have several)."""
        return (self.eos_id,)

    def describe(self) -> str:
        return f"byte-level ({self.vocab_size} ids)"

    @property
    def special_tokens(self) -> dict[str, int]:
        return {"<pad>": self.pad_id, "<bos>": self.bos_id, "<eos>": self.eos_id}

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = False) -> str:
        """Text of the byte ids; special ids are skipped (or end the text with `stop_at_eos`), and so
        are negative ids: the -1 padding of a generated row (``out.tokens[p, s]``) decodes as is."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if i < 0:  # padding after the answer's end
                continue
            if stop_at_eos and i == self.eos_id:
                break
            if 0 <= i < NUM_BYTES:
                out.append(i)
            elif not NUM_BYTES <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside the vocabulary [0, {self.vocab_size})")
        return out.decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return {"type": self.type_name, "encoding": "utf-8", "num_bytes": NUM_BYTES,
                "vocab_size": self.vocab_size, "special_tokens": self.special_tokens}

    def save(self, directory: str | os.PathLike) -> Path:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        with open(path / TOKENIZER_FILE, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2)
        return path / TOKENIZER_FILE

    @classmethod
    def load(cls, path: str | os.PathLike) -> ByteTokenizer:
        """From a checkpoint directory holding `tokenizer.json`, or from the file itself."""
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        with open(path) as fh:
            d = json.load(fh)
        if d.get("type") != cls.type_name:
            raise ValueError(f"{str(path)!r}: tokenizer type {d.get('type')!r} is not {cls.type_name!r}")
        sp = d["special_tokens"]
        return cls(pad_id=int(sp["<pad>"]), bos_id=int(sp["<bos>"]), eos_id=int(sp["<eos>"]),
                   vocab_size=int(d["vocab_size"]))

    def __eq__(self, other):
        return isinstance(other, ByteTokenizer) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return f"ByteTokenizer(vocab_size={self.vocab_size}, specials={self.special_tokens})"


_DEFAULT = ByteTokenizer()


def encode(text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """UTF-8 byte ids of `text` (with the default special ids)."""
    return _DEFAULT.encode(text, add_bos=add_bos, add_eos=add_eos)


def decode(ids: Iterable[int], *, stop_at_eos: bool = False) -> str:
    """Text of byte ids; specials skipped."""
    return _DEFAULT.decode(ids, stop_at_eos=stop_at_eos)
