"""Per-sequence status codes returned by every block-manager operation.

Inside ``jit`` nothing can raise, so each operation reports, for each row of its batch, whether it
took effect. A row that did not take effect left the state exactly as it was for that sequence.

The codes come back from ``jit`` as int32 arrays; ``Status.names(codes)`` names them (nested
lists, like ``tolist()``), and ``BlockManager`` returns them as a ``StatusArray``: an int32 numpy
array that compares and indexes as one and prints the names.
"""

from __future__ import annotations

import enum

import numpy as np
from numpy.typing import ArrayLike


def code_names(kind: type[enum.IntEnum], codes: ArrayLike) -> list | str:
    """The names of ``kind`` for every code of ``codes`` (an int, or an array of any shape from
    ``jit``: nested lists like ``tolist()``); a code ``kind`` does not define shows as its number."""
    def name(c: int) -> str:
        try:
            return kind(c).name
        except ValueError:
            return str(c)

    arr = np.asarray(codes)
    if arr.ndim == 0:
        return name(int(arr))

    def walk(x):
        return [walk(v) for v in x] if isinstance(x, list) else name(x)

    return walk(arr.tolist())


class Status(enum.IntEnum):
    OK = 0
    NO_FREE_BLOCKS = 1
    """The pool could not supply the blocks this row needs: the scheduler should preempt."""
    TABLE_FULL = 2
    """The sequence already holds ``max_blocks_per_seq`` blocks and the next token needs another."""
    BAD_SEQUENCE = 3
    """Sequence id out of range, repeated in the batch, not running (append/free/fork source) or
    already running (admit/fork destination)."""
    BAD_LENGTH = 4
    """Prompt length < 1 or longer than ``max_tokens_per_seq`` (or the token array)."""
    PADDING = 5
    """A padding row (sequence id < 0): ignored."""

    @classmethod
    def names(cls, codes: ArrayLike) -> list | str:
        """``Status.names(out.status)``: the name of every code (``code_names``)."""
        return code_names(cls, codes)


class StatusArray(np.ndarray):
    """An int32 numpy array of ``Status`` codes that prints their names
    (``StatusArray([OK, NO_FREE_BLOCKS])``); arithmetic and comparisons give plain arrays, and
    ``names`` lists the names. Elements compare equal to ``Status`` members and to ints."""

    def __new__(cls, codes):
        return np.asarray(codes, dtype=np.int32).view(cls)

    def __array_wrap__(self, obj, context=None, return_scalar=False):  # ufunc results: plain arrays
        obj = np.asarray(obj).view(np.ndarray)
        return obj[()] if return_scalar else obj

    @property
    def names(self) -> list | str:
        return Status.names(self.view(np.ndarray))

    def __repr__(self) -> str:
        if self.dtype.kind not in "iu":
            return repr(self.view(np.ndarray))
        return f"StatusArray({str(self.names).replace(chr(39), '')})"

    def __str__(self) -> str:
        if self.dtype.kind not in "iu":
            return str(self.view(np.ndarray))
        return str(self.names).replace("'", "").replace(",", "")


__all__ = ["Status", "StatusArray", "code_names"]
