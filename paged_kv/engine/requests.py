"""Checks on a generation request, run in Python before anything is traced or compiled.

Every problem raises ``ValueError`` naming the value and the limit. Shapes are always checked;
values (prompt lengths, which rows are free) are checked when they are concrete arrays, and
skipped when the call is itself being traced inside the caller's ``jit``.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from models.paged import IMPLS, page_spec
from paged_kv.config import ManagerConfig
from paged_kv.state import BlockManagerState, init_state


def _concrete(x) -> np.ndarray | None:
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def split_model(model):
    """``(graphdef, weights)`` from an NNX module or an already split pair."""
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nnx.GraphDef):
        return model
    if isinstance(model, nnx.Module):
        return nnx.split(model)
    raise ValueError(f"model must be an nnx.Module or a (graphdef, state) pair, got {type(model).__name__}")


def place(model, pages, mesh):
    """Resolve the mesh of a call and put the model and pages on it.

    ``mesh`` None: the mesh the pages are already sharded over (``models.sharding.shard``), or none
    (one device: nothing changes). Returns ``(graphdef, weights, model_config, pages, mesh)``; with
    a mesh the model and pages are placed (a no-op when they already are), and ``model_config`` is
    the placed model's (KV heads replicated when tp exceeds them).
    """
    from models import sharding

    graphdef, weights = split_model(model)
    mesh = sharding.mesh_of(pages) if mesh is None else mesh
    if mesh is None:
        config = model.config if hasattr(model, "config") else nnx.merge(graphdef, weights).config
        return graphdef, weights, config, pages, None
    sharding.tp_degree(mesh)
    (graphdef, weights), pages = sharding.shard((graphdef, weights), pages, mesh)
    return graphdef, weights, nnx.merge(graphdef, weights).config, pages, mesh


def replicate_inputs(mesh, *arrays):
    """Arrays (block-manager state, prompts, keys) replicated over ``mesh``, or as given without one.
    Over several processes every process must pass the same values."""
    if mesh is None:
        return arrays
    from models import sharding
    return sharding.replicate(arrays, mesh)


def pad_prompts(prompts, width: int | None = None, multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (int32 ``[B, W]`` zero-padded tokens, int32 ``[B]`` lengths).

    ``W`` is ``width`` or the longest prompt rounded up to ``multiple``; keeping ``W`` fixed
    across calls keeps the compiled loop.
    """
    prompts = [list(p) for p in prompts]
    if not prompts:
        raise ValueError("no prompts")
    longest = max(len(p) for p in prompts)
    w = -(-longest // multiple) * multiple if width is None else width
    if longest > w:
        raise ValueError(f"a prompt has {longest} tokens; width={w}")
    out = np.zeros((len(prompts), w), np.int32)
    for i, p in enumerate(prompts):
        out[i, :len(p)] = p
    return out, np.array([len(p) for p in prompts], np.int32)


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked request: static sizes the loops are compiled for."""

    num_prompts: int
    width: int
    rows_per_prompt: int
    context: int
    chunk_size: int

    @property
    def num_rows(self) -> int:
        return self.num_prompts * self.rows_per_prompt


def check_request(model_config, manager: ManagerConfig, pages, state, prompt_tokens, prompt_lens, *,
                  rows_per_prompt: int, what: str, budgets=None, chunk_size=None, impl: str = "auto",
                  eos_token_ids=(), top_k: int = 0, vocab_needed: int = 1) -> Request:
    """Validates a generate/beam-search call. ``rows_per_prompt`` is n or the beam width."""
    if not isinstance(manager, ManagerConfig):
        raise ValueError(f"manager must be a ManagerConfig, got {type(manager).__name__}")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
    spec = page_spec(model_config, manager.num_blocks, manager.block_size, dtype=getattr(pages, "dtype", None))
    if tuple(np.shape(pages)) != spec.shape:
        raise ValueError(f"pages have shape {tuple(np.shape(pages))}; this model and manager need {spec.shape} "
                         f"(num_blocks={manager.num_blocks}, block_size={manager.block_size})")
    if state is not None and not isinstance(state, BlockManagerState):
        raise ValueError(f"state must be a BlockManagerState or None, got {type(state).__name__}")
    vocab = model_config.vocab_size
    for t in eos_token_ids:
        if t >= vocab:
            raise ValueError(f"eos token id {t} must be < vocab_size={vocab}")
    if top_k > vocab:
        raise ValueError(f"top_k={top_k} must be <= vocab_size={vocab}")
    if vocab_needed > vocab:
        raise ValueError(f"{what} needs {vocab_needed} candidate tokens per step; vocab_size={vocab}")
    shape = tuple(np.shape(prompt_tokens))
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"prompt_tokens must be a non-empty [B, L] array, got shape {shape}")
    b, width = shape
    if tuple(np.shape(prompt_lens)) != (b,):
        raise ValueError(f"prompt_lens must have shape ({b},), got {tuple(np.shape(prompt_lens))}")
    rows = b * rows_per_prompt
    if rows > manager.max_seqs:
        raise ValueError(f"{b} prompts x {rows_per_prompt} ({what}) = {rows} sequences; the manager holds "
                         f"max_seqs={manager.max_seqs}")
    context = min(manager.max_tokens_per_seq, model_config.max_position_embeddings)
    if width > manager.max_tokens_per_seq:
        raise ValueError(f"prompt_tokens width {width} exceeds the {manager.max_tokens_per_seq} tokens a "
                         f"sequence can hold (max_blocks_per_seq={manager.max_blocks_per_seq} x "
                         f"block_size={manager.block_size})")
    lens = _concrete(prompt_lens)
    if lens is not None:
        for i, n in enumerate(lens.tolist()):
            if n < 1 or n > width:
                raise ValueError(f"prompt {i} has length {n}; lengths must be in [1, {width}] (the padded width)")
            if n > context:
                raise ValueError(f"prompt {i} has {n} tokens, longer than the context of {context} tokens "
                                 f"(min of max_blocks_per_seq x block_size = {manager.max_tokens_per_seq} and "
                                 f"max_position_embeddings = {model_config.max_position_embeddings})")
    if budgets is not None:
        if tuple(np.shape(budgets)) != (b,):
            raise ValueError(f"max_new_tokens per prompt must have shape ({b},), got {tuple(np.shape(budgets))}")
        bud = _concrete(budgets)
        if bud is not None and bud.min() < 1:
            raise ValueError(f"max_new_tokens per prompt must be >= 1, got {bud.min()}")
    if state is not None:
        active = _concrete(state.active)
        if active is not None and active[:rows].any():
            busy = np.flatnonzero(active[:rows]).tolist()
            raise ValueError(f"{what} uses sequence rows [0, {rows}); rows {busy[:8]} are already running")
    if chunk_size is None:
        chunk_size = min(width, 256)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be an int >= 1")
    return Request(num_prompts=b, width=width, rows_per_prompt=rows_per_prompt, context=context,
                   chunk_size=int(min(chunk_size, width)))


def initial_state(manager: ManagerConfig, state):
    return init_state(manager) if state is None else state
