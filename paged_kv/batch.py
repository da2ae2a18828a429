"""Shared helpers for batched operations: row checks and block-table views.

An operation's batch is an int32 ``[B]`` array of sequence ids (rows of the block-table array);
negative ids are padding, so callers can keep ``B`` fixed and never retrace.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from paged_kv.config import ManagerConfig
from paged_kv.scan import per_platform, prefix_sum
from paged_kv.state import BlockManagerState
from paged_kv.status import Status

T = TypeVar("T")


def check_rows(
    config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array, *, must_be_active: bool
) -> tuple[jax.Array, jax.Array]:
    """Status of each row before the operation's own checks.

    Returns:
      status: int32 ``[B]``: PADDING for ids < 0; BAD_SEQUENCE for ids out of range, repeated
        (every occurrence after the first) or whose ``active`` flag is not ``must_be_active``;
        OK otherwise.
      sid: int32 ``[B]``, the ids clipped into range, safe to gather with.
    """
    s = config.max_seqs
    seq_ids = seq_ids.astype(jnp.int32)
    in_range = (seq_ids >= 0) & (seq_ids < s)
    sid = jnp.clip(seq_ids, 0, s - 1)
    wrong_state = state.active[sid] != must_be_active
    bad = ~in_range | ~first_occurrence(seq_ids, s) | wrong_state
    status = jnp.where(seq_ids < 0, Status.PADDING, jnp.where(bad, Status.BAD_SEQUENCE, Status.OK))
    return status.astype(jnp.int32), sid


def refuse_spans(state: BlockManagerState, status: jax.Array, sid: jax.Array) -> jax.Array:
    """``status`` (int32 ``[B]``) with ``BAD_LENGTH`` for rows of ``sid`` (int32 ``[B]``) that
    hold uncommitted tokens or reserved blocks (``BlockManagerState.spans``): ``append`` adds a
    committed token right after the row's last one, which such a row must do with
    ``spans.extend`` (and ``commit``) instead."""
    busy = jnp.any(state.spans[sid] != 0, axis=1)
    return jnp.where((status == Status.OK) & busy, Status.BAD_LENGTH, status).astype(jnp.int32)


def held_columns(config: ManagerConfig, state: BlockManagerState, sid: jax.Array) -> jax.Array:
    """int32 ``[B]``: table columns rows ``sid`` (int32 ``[B]``) hold in each group: their
    tokens' blocks plus their reserved ones."""
    return blocks_held(config, state.num_tokens[sid]) + state.spans[sid, 1]


def first_come_first_served(need: jax.Array, num_free: jax.Array) -> jax.Array:
    """bool ``[B]``: rows whose need (int32 ``[B]`` blocks) fits when rows are served in batch
    order without overtaking."""
    return prefix_sum(need) <= num_free


def start_rows(
    state: BlockManagerState,
    target: jax.Array,
    tables: jax.Array,
    num_tokens: jax.Array,
    chain: jax.Array | None = None,
    salt: jax.Array | None = None,
) -> BlockManagerState:
    """Writes rows ``target`` (int32 ``[B]``; ``max_seqs`` drops a row) as running sequences with
    block tables ``tables`` (int32 ``[B, max_blocks_per_seq]``) and ``num_tokens`` (int32 ``[B]``),
    plus, with prefix caching, their chain states (uint32 ``[B, 2]``) and salts (uint32 ``[B]``).
    Reference counts and the free queue are the caller's."""
    state = state.replace(
        block_tables=state.block_tables.at[target].set(tables, mode="drop"),
        num_tokens=state.num_tokens.at[target].set(num_tokens, mode="drop"),
        active=state.active.at[target].set(True, mode="drop"),
    )
    if chain is not None:
        state = state.replace(seq_chain=state.seq_chain.at[target].set(chain, mode="drop"),
                              seq_salt=state.seq_salt.at[target].set(salt, mode="drop"))
    return state


def first_occurrence(ids: jax.Array, size: int) -> jax.Array:
    """bool ``[B]``: whether each id in ``[0, size)`` is its first occurrence in the batch.

    O(B) scatters into a ``[size]`` array; ``size`` is ``max_seqs``, a batch-scale number.
    """
    b = ids.shape[0]
    lanes = jnp.arange(b, dtype=jnp.int32)
    in_range = (ids >= 0) & (ids < size)
    first = jnp.full((size,), b, jnp.int32).at[jnp.where(in_range, ids, size)].min(lanes, mode="drop")
    return first[jnp.clip(ids, 0, size - 1)] == lanes


def take_status(config: ManagerConfig, state: BlockManagerState, dst_ids: jax.Array, src_ids: jax.Array,
                dst_must_be_free: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """fork/select's row checks: ``(dst, src, status)``, the int32 ``[B]`` ids clipped into
    ``[0, max_seqs)`` and the int32 ``[B]`` statuses. Destinations are distinct rows (fork: not
    running); sources may repeat but must be running, with no uncommitted token; a ``-1``
    destination is padding."""
    s = config.max_seqs
    dst_ids = dst_ids.astype(jnp.int32)
    src_ids = src_ids.astype(jnp.int32)
    dst, src = jnp.clip(dst_ids, 0, s - 1), jnp.clip(src_ids, 0, s - 1)
    bad_dst = (dst_ids >= s) | ~first_occurrence(dst_ids, s)
    if dst_must_be_free:
        bad_dst |= state.active[dst]
    # A source with uncommitted tokens (``spans``) is refused: its drafts' blocks stay its own, so
    # no block holding a draft is ever shared, and none is ever cached.
    bad_src = (src_ids < 0) | (src_ids >= s) | ~state.active[src] | (state.spans[src, 0] > 0)
    status = jnp.where(
        dst_ids < 0, Status.PADDING, jnp.where(bad_dst | bad_src, Status.BAD_SEQUENCE, Status.OK)
    ).astype(jnp.int32)
    return dst, src, status


def blocks_held(config: ManagerConfig, num_tokens: jax.Array) -> jax.Array:
    """int32 ``[...]``: ``ceil(num_tokens / block_size)``, the blocks a sequence holds."""
    return (num_tokens + config.block_size - 1) // config.block_size


def tail_first(tables: jax.Array, num_blocks: jax.Array, mask: jax.Array, first: jax.Array | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """Flattens block-table rows into release order: row by row, each row last block first.

    Args:
      tables: int32 ``[B, M]`` rows of block ids.
      num_blocks: int32 ``[B]`` blocks held by each row (its columns end there).
      mask: bool ``[B]`` rows to include.
      first: optional int32 ``[B]`` first column of each row to include (a window group's null
        prefix ends there); 0 when not given.

    Returns:
      blocks int32 ``[B * M]`` and valid bool ``[B * M]``.
    """
    m = tables.shape[1]
    j = jnp.arange(m, dtype=jnp.int32)[None, :]
    col = num_blocks[:, None] - 1 - j
    valid = mask[:, None] & (col >= (0 if first is None else first[:, None]))
    blocks = jnp.take_along_axis(tables, jnp.clip(col, 0, m - 1), axis=1)
    return blocks.reshape(-1), valid.reshape(-1)


def width_buckets(max_blocks_per_seq: int) -> list[int]:
    """Static table widths an operation may restrict itself to: powers of two from 16, and the
    full width."""
    widths = [w for w in (1 << k for k in range(4, 31)) if w < max_blocks_per_seq]
    return widths + [max_blocks_per_seq]


def by_width(config: ManagerConfig, needed: jax.Array, fn: Callable[..., T], *operands: Any) -> T:
    """Calls ``fn(width, *operands)`` with the smallest bucket ``width >= needed`` on a CPU, with
    the full width elsewhere (chosen when the program is lowered, per platform).

    Operations that touch every held block (fork, select, free) would otherwise pay for all
    ``max_blocks_per_seq`` columns of each row even when sequences are short; on XLA:CPU a
    ``lax.switch`` over a few static widths makes their cost follow the longest sequence in the
    batch instead. On a GPU the full ``[B, max_blocks_per_seq]`` width is one cheap elementwise
    pass, while the switch is a ``conditional`` whose branch index the host reads back (a
    device-to-host sync per call, measured by the GPU compile gate,
    ``scripts/gate/gpu_compile.py``): there the full width is taken directly. Every width ``>=
    needed`` gives the same result.

    Args:
      needed: int32 scalar, the most table columns any row of the batch uses.
    """
    m = config.max_blocks_per_seq
    widths = width_buckets(m)
    if len(widths) == 1:
        return fn(widths[0], *operands)

    def bucketed(*ops):
        index = jnp.sum(needed > jnp.asarray(widths[:-1], jnp.int32))
        return lax.switch(index, [functools.partial(fn, w) for w in widths], *ops)

    return per_platform(config.target, *operands, cpu=bucketed, default=functools.partial(fn, m))


def check_lengths(config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array, prompt_lens: jax.Array,
                  max_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``check_rows`` for free rows to start, then ``BAD_LENGTH`` for a prompt length outside
    ``[1, min(max_tokens_per_seq, max_len)]``. Returns ``(status, sid, lens)``: int32 ``[B]``
    each (``lens`` the lengths as int32)."""
    status, sid = check_rows(config, state, seq_ids, must_be_active=False)
    lens = prompt_lens.astype(jnp.int32)
    bad = (lens < 1) | (lens > min(config.max_tokens_per_seq, max_len))
    status = jnp.where((status == Status.OK) & bad, Status.BAD_LENGTH, status)
    return status, sid, lens
