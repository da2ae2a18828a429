"""Setting up a call of ``generate`` / ``beam_search`` (and the serving engine): ``check_call``
checks a call's model, manager, pages and prompts in Python before anything is traced or
compiled and returns the ``CallShape`` the loops are compiled for.

Its parts live in modules of one concern each, whose names this module also exports (the engines
call them as ``call_setup.<name>``): ``input_checks`` (token ids, keys, seeds, ``pad_prompts``),
``placement`` (``place``, ``layer_layout``, ``replicate_inputs``) and ``manager_groups`` (the
manager's KV-cache groups of a model: ``kv_cache_groups``, ``group_layout``).

Every problem raises ``ValueError`` naming the value and the limit. Shapes are always checked;
values (prompt lengths, which rows are free) are checked when they are concrete arrays, and
skipped when the call is itself being traced inside the caller's ``jit``.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from numpy.typing import ArrayLike

from paged_kv.config import ManagerConfig
from paged_kv.engine.input_checks import (
    SEED_LIMIT,
    TOKEN_LIMIT,
    _concrete,
    bucket_width,
    check_int_dtype,
    check_key,
    check_padded_tokens,
    check_seeds,
    pad_prompts,
    token_ids,
)
from paged_kv.engine.manager_groups import group_layout, kv_cache_groups, layout_groups, manager_config
from paged_kv.engine.placement import layer_layout, place, replicate_inputs, split_model
from paged_kv.inputs import is_int
from paged_kv.models.kv_groups import KVGroupLayout
from paged_kv.models.page_sizing import page_spec
from paged_kv.models.protocol import ModelFacts, model_facts
from paged_kv.pallas_kernels import IMPLS
from paged_kv.pallas_kernels.plan import ExecutionPlan, make_plan
from paged_kv.pallas_kernels.quant import QuantPages, is_quant
from paged_kv.state import BlockManagerState, init_state


@dataclasses.dataclass(frozen=True)
class CallShape:
    """A checked call's static sizes, the ones the loops are compiled for (not a serving
    ``Request``)."""

    num_prompts: int
    width: int
    rows_per_prompt: int
    context: int
    chunk_size: int

    @property
    def num_rows(self) -> int:
        return self.num_prompts * self.rows_per_prompt


def check_kv_pages(pages: jax.Array | QuantPages, impl: str, batch_invariant: bool = False) -> ExecutionPlan:
    """The engines' execution plan for their pages, made before tracing
    (``paged_kv.pallas_kernels.plan.make_plan`` with the pages' dtype and block size): quantized
    pages with ``batch_invariant=True``, a dtype a Pallas ``impl``'s target cannot compute, or a
    block size the batch-invariant reference cannot step over are refused.

    Raises:
      ValueError: one line naming the combination and what is supported (a row of the plan's table).
    """
    return make_plan(impl, batch_invariant=batch_invariant, kv_dtype=pages.dtype, block_size=pages.shape[4])


def check_call(facts: ModelFacts, manager: ManagerConfig, pages: jax.Array, state: BlockManagerState | None,
               prompt_tokens: ArrayLike, prompt_lens: ArrayLike, *, rows_per_prompt: int, what: str,
               budgets: ArrayLike | None = None, chunk_size: int | None = None, impl: str = "auto",
               eos_token_ids: tuple[int, ...] = (), top_k: int = 0, vocab_needed: int = 1,
               layout: KVGroupLayout | None = None, batch_invariant: bool = False) -> CallShape:
    """Validates a generate/beam-search call. ``rows_per_prompt`` is n or the beam width.
    ``pages``: plain pages or ``QuantPages`` (``check_kv_pages`` with ``impl`` and
    ``batch_invariant``).
    ``layout``: ``group_layout(model, manager)`` (required for a grouped manager: the pages then
    hold ``layout.slots`` layer slots).

    Shapes and dtypes are always checked (``prompt_tokens`` int ``[B, L]``, ``prompt_lens`` int
    ``[B]``, ``budgets`` int ``[B]``); values (lengths, token ids ``< vocab_size`` at positions
    ``< prompt_lens``, budgets, busy rows) when the arrays are concrete. Inside the caller's ``jit``
    an out-of-vocabulary id cannot be caught here: the loops flag its row instead."""
    facts = model_facts(facts)  # ModelFacts from ``place`` (a model or a LlamaConfig also works)
    if not isinstance(manager, ManagerConfig):
        raise ValueError(f"manager must be a ManagerConfig, got {type(manager).__name__}")
    if manager.grouped and (layout is None or layout_groups(layout) != manager.groups):
        raise ValueError(f"manager groups={manager.groups!r} need the model's KVGroupLayout with those groups, "
                         f"got {layout!r} (call_setup.group_layout)")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    spec = page_spec(facts, manager.num_blocks, manager.block_size, dtype=getattr(pages, "dtype", None),
                     layout=layout)
    shape = tuple(pages.shape) if is_quant(pages) else tuple(np.shape(pages))
    if shape != spec.shape:
        raise ValueError(f"pages have shape {shape}; this model and manager need {spec.shape} "
                         f"(num_blocks={manager.num_blocks}, block_size={manager.block_size})")
    if is_quant(pages) and tuple(np.shape(pages.scales)) != spec.shape[:-1]:
        raise ValueError(f"quantized pages' scales have shape {tuple(np.shape(pages.scales))}; their values "
                         f"{spec.shape} need {spec.shape[:-1]}")
    check_kv_pages(pages, impl, batch_invariant)
    if state is not None and not isinstance(state, BlockManagerState):
        raise ValueError(f"state must be a BlockManagerState or None, got {type(state).__name__}")
    vocab = facts.vocab_size
    for t in eos_token_ids:
        if t >= vocab:
            raise ValueError(f"eos token id {t} must be < vocab_size={vocab}")
    if top_k > vocab:
        raise ValueError(f"top_k={top_k} must be <= vocab_size={vocab}")
    if vocab_needed > vocab:
        raise ValueError(f"{what} needs {vocab_needed} candidate tokens per step; vocab_size={vocab}")
    try:
        shape = tuple(np.shape(prompt_tokens))
    except (ValueError, TypeError):  # ragged nested lists
        raise ValueError("prompt_tokens must be a non-empty [B, L] integer array (see pad_prompts), got ragged "
                         "or non-numeric values") from None
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"prompt_tokens must be a non-empty [B, L] array, got shape {shape}")
    check_int_dtype("prompt_tokens", prompt_tokens)
    check_int_dtype("prompt_lens", prompt_lens)
    b, width = shape
    if tuple(np.shape(prompt_lens)) != (b,):
        raise ValueError(f"prompt_lens must have shape ({b},), got {tuple(np.shape(prompt_lens))}")
    rows = b * rows_per_prompt
    if rows > manager.max_seqs:
        raise ValueError(f"{b} prompts x {rows_per_prompt} ({what}) = {rows} sequences; the manager holds "
                         f"max_seqs={manager.max_seqs}")
    context = min(manager.max_tokens_per_seq, facts.max_positions)
    if width > manager.max_tokens_per_seq:
        raise ValueError(f"prompt_tokens width {width} exceeds the {manager.max_tokens_per_seq} tokens a "
                         f"sequence can hold (max_blocks_per_seq={manager.max_blocks_per_seq} x "
                         f"block_size={manager.block_size}); pad with pad_prompts(..., "
                         f"max_width={manager.max_tokens_per_seq})")
    lens = _concrete(prompt_lens)
    if lens is not None:
        for i, n in enumerate(lens.tolist()):
            if n < 1 or n > width:
                raise ValueError(f"prompt {i} has length {n}; lengths must be in [1, {width}] (the padded width)")
            if n > context:
                raise ValueError(f"prompt {i} has {n} tokens, longer than the context of {context} tokens "
                                 f"(min of max_blocks_per_seq x block_size = {manager.max_tokens_per_seq} and "
                                 f"the model's max_positions = {facts.max_positions})")
        toks = _concrete(prompt_tokens)
        if toks is not None:
            check_padded_tokens(toks, lens, vocab)
    if budgets is not None:
        if tuple(np.shape(budgets)) != (b,):
            raise ValueError(f"max_new_tokens per prompt must have shape ({b},), got {tuple(np.shape(budgets))}")
        check_int_dtype("max_new_tokens per prompt", budgets)
        bud = _concrete(budgets)
        if bud is not None and bud.min() < 1:
            raise ValueError(f"max_new_tokens per prompt must be >= 1, got {bud.min()}")
        if bud is not None and bud.max() >= TOKEN_LIMIT:
            raise ValueError(f"max_new_tokens per prompt must be < 2**31 (int32), got {bud.max()}")
    if state is not None:
        active = _concrete(state.active)
        if active is not None and active[:rows].any():
            busy = np.flatnonzero(active[:rows]).tolist()
            raise ValueError(f"{what} uses sequence rows [0, {rows}); rows {busy[:8]} are already running")
    if chunk_size is None:
        chunk_size = min(width, 256)
    if not is_int(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be an int >= 1")
    return CallShape(num_prompts=b, width=width, rows_per_prompt=rows_per_prompt, context=context,
                   chunk_size=int(min(chunk_size, width)))


def initial_state(manager: ManagerConfig, state: BlockManagerState | None) -> BlockManagerState:
    return init_state(manager) if state is None else state

__all__ = [
    "SEED_LIMIT", "TOKEN_LIMIT", "CallShape", "bucket_width", "check_call", "check_int_dtype", "check_key",
    "check_kv_pages", "check_padded_tokens", "check_seeds", "group_layout", "initial_state", "kv_cache_groups",
    "layer_layout", "layout_groups", "manager_config", "pad_prompts", "place", "replicate_inputs", "split_model",
    "token_ids",
]
