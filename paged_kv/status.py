"""Per-sequence status codes returned by every block-manager operation.

Inside ``jit`` nothing can raise, so each operation reports, for each row of its batch, whether it
took effect. A row that did not take effect left the state exactly as it was for that sequence.
"""

import enum


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
