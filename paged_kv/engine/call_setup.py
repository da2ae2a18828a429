"""Setting up a call of ``generate`` / ``beam_search`` (and the serving engine): checks of its
inputs, run in Python before anything is traced or compiled (``check_call`` returns the
``CallShape`` the loops are compiled for), and the placement of the model, pages and inputs on a
mesh (``place``, ``layer_layout``, ``replicate_inputs``).

Every problem raises ``ValueError`` naming the value and the limit. Shapes are always checked;
values (prompt lengths, which rows are free) are checked when they are concrete arrays, and
skipped when the call is itself being traced inside the caller's ``jit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from numpy.typing import ArrayLike

from paged_kv.config import DEFAULT_GROUPS, Group, ManagerConfig
from paged_kv.inputs import is_int
from paged_kv.models.paged import KVGroupLayout, kv_group_layout, layer_windows, page_spec
from paged_kv.models.protocol import ModelFacts, model_facts
from paged_kv.pallas_kernels import IMPLS
from paged_kv.pallas_kernels.quant import QuantPages, is_quant
from paged_kv.state import BlockManagerState, init_state

TOKEN_LIMIT = 2**31
"""Token ids are int32 on the device: without a vocabulary to check against, ids must be < 2**31."""


def _concrete(x) -> np.ndarray | None:
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _dtype_of(x) -> np.dtype | None:
    """The dtype ``x`` has or would get as an array (None when it cannot be one: ragged, junk)."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None:
        return np.dtype(dtype)
    try:
        return np.asarray(x).dtype
    except (ValueError, TypeError, OverflowError):
        return None


def check_int_dtype(name: str, x: ArrayLike) -> None:
    """``ValueError`` unless ``x`` (an array, a tracer or nested lists) holds integers (not bool).

    Works on tracers too: only the dtype is read."""
    dtype = _dtype_of(x)
    if dtype is None or dtype.kind not in "iu":
        what = "ragged or non-numeric values" if dtype is None or dtype.kind == "O" else f"dtype {dtype}"
        raise ValueError(f"{name} must be integers (int32), got {what}")


def _limit_text(vocab_size: int | None) -> str:
    return f"[0, vocab_size={vocab_size})" if vocab_size is not None else "[0, 2**31)"


def _first_bad_element(items) -> tuple[int, object] | None:
    """Position and value of the first element that is not a Python/NumPy int (bools excluded).
    Python-level loop: only run on the error path."""
    for pos, t in enumerate(items):
        if not is_int(t):
            return pos, t
    return None


def token_ids(tokens: ArrayLike, *, what: str = "prompt", vocab_size: int | None = None) -> np.ndarray:
    """Checks one prompt's token ids on the host; returns them as int32 ``[L]`` (L >= 1).

    ``tokens``: a sequence of Python/NumPy ints, or a 1-D integer NumPy/JAX array (concrete).
    Every id must be in ``[0, vocab_size)`` (``[0, 2**31)`` when ``vocab_size`` is None).

    Raises ``ValueError`` naming the offending id, its position and the limit: for None, strings,
    mappings, nested lists, bools, floats (4.7, a float array), ids out of range. The checks are
    vectorised (NumPy) except the type scan of a Python list, which runs in C (``map(type, ...)``).
    """
    hi = TOKEN_LIMIT if vocab_size is None else int(vocab_size)
    if isinstance(tokens, jax.core.Tracer):
        raise ValueError(f"{what} token ids must be concrete values, not traced inside jit")
    if tokens is None or isinstance(tokens, (str, bytes, dict, set, frozenset)) or np.isscalar(tokens):
        raise ValueError(f"{what} must be a sequence of int token ids, got {type(tokens).__name__}: {tokens!r:.60}")
    if isinstance(tokens, (np.ndarray, jax.Array)):
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"{what} must be a 1-D sequence of token ids, got an array of shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{what} token ids must be integers, got an array of dtype {arr.dtype}")
    else:
        try:
            items = list(tokens)
        except TypeError:
            raise ValueError(f"{what} must be a sequence of int token ids, got {type(tokens).__name__}") from None
        allowed = all(issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_))
                      for t in set(map(type, items)))
        if not allowed:
            pos, t = _first_bad_element(items)
            raise ValueError(f"{what} token {t!r:.60} at position {pos} is a {type(t).__name__}, not an int "
                             f"token id in {_limit_text(vocab_size)}")
        try:
            arr = np.asarray(items, dtype=np.int64)
        except OverflowError:  # a Python int beyond int64: find it (error path)
            pos, t = next((i, t) for i, t in enumerate(items) if not 0 <= t < hi)
            raise ValueError(f"{what} token id {t} at position {pos} is out of range: ids must be in "
                             f"{_limit_text(vocab_size)}") from None
    if arr.size == 0:
        raise ValueError(f"{what} is empty; it needs at least 1 token")
    bad = (arr < 0) | (arr >= hi)
    if bad.any():
        pos = int(np.argmax(bad))
        raise ValueError(f"{what} token id {arr[pos]} at position {pos} is out of range: ids must be in "
                         f"{_limit_text(vocab_size)}")
    return arr.astype(np.int32)


def check_padded_tokens(prompt_tokens: ArrayLike, prompt_lens: ArrayLike, vocab_size: int) -> None:
    """Host check of padded prompts (concrete int ``[B, L]`` and lengths ``[B]``, already shape-
    and length-checked): every id at a position ``< prompt_lens[b]`` must be in ``[0, vocab_size)``.
    Padding positions are not checked (the model looks any out-of-range id up as a safe one)."""
    toks, lens = np.asarray(prompt_tokens), np.asarray(prompt_lens)
    valid = np.arange(toks.shape[1])[None, :] < lens[:, None]
    bad = valid & ((toks < 0) | (toks >= vocab_size))
    if bad.any():
        b, pos = np.argwhere(bad)[0].tolist()
        raise ValueError(f"prompt {b} token id {toks[b, pos]} at position {pos} is out of range: ids must be in "
                         f"[0, vocab_size={vocab_size})")


SEED_LIMIT = 2**32


def check_key(key: ArrayLike) -> jax.Array | np.ndarray:
    """A PRNG key for ``generate``: a typed key (``jax.random.key``, shape ``()``), a raw uint32
    ``[2]`` key (``jax.random.PRNGKey``), or an int seed in ``[0, 2**32)`` (made into a key; the
    only case that touches the device). ``ValueError`` for anything else (bools, floats, negative
    or too large seeds, other shapes), before anything is compiled."""
    if isinstance(key, (bool, np.bool_)) or key is None:
        raise ValueError(f"key={key!r} must be a PRNG key (jax.random.key(seed)) or an int seed in [0, 2**32)")
    if isinstance(key, (int, np.integer)):
        if not 0 <= key < SEED_LIMIT:
            raise ValueError(f"seed={key!r} must be an int in [0, 2**32)")
        return jax.random.key(int(key))
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if tuple(key.shape) != ():
            raise ValueError(f"key must be one PRNG key (shape ()), got shape {tuple(key.shape)}")
        return key
    if dtype is not None and np.dtype(dtype) == np.uint32 and tuple(np.shape(key)) == (2,):
        return key
    raise ValueError(f"key must be a PRNG key (jax.random.key(seed)), a raw uint32 [2] key or an int seed in "
                     f"[0, 2**32), got {type(key).__name__}"
                     + (f" of dtype {dtype} and shape {tuple(np.shape(key))}" if dtype is not None
                        else f" {key!r:.40}"))


def check_seeds(seeds: ArrayLike | None, num_prompts: int) -> jax.Array | None:
    """``generate``'s per-prompt sampling seeds: None (derived from the key), or integers (not
    bools or floats) of shape ``[num_prompts]`` in ``[0, 2**31)`` (the range is checked when the
    values are concrete). Returns int32 ``[num_prompts]`` or None; ``ValueError`` otherwise."""
    if seeds is None:
        return None
    if not hasattr(seeds, "dtype"):
        try:
            seeds = np.asarray(seeds)
        except (TypeError, ValueError):
            raise ValueError(f"seeds must be ints [{num_prompts}], got {seeds!r:.40}") from None
    dtype = np.dtype(seeds.dtype) if not jax.dtypes.issubdtype(seeds.dtype, jax.dtypes.prng_key) else None
    if dtype is None or dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
        raise ValueError(f"seeds must be integers, got dtype {seeds.dtype}")
    if tuple(np.shape(seeds)) != (num_prompts,):
        raise ValueError(f"seeds must have shape ({num_prompts},) (one per prompt), got {tuple(np.shape(seeds))}")
    host = _concrete(seeds)
    if host is not None:
        bad = (host < 0) | (host >= 2**31)
        if bad.any():
            b = int(np.argmax(bad))
            raise ValueError(f"seeds[{b}]={int(host[b])} must be an int in [0, 2**31)")
    return jax.numpy.asarray(seeds, np.int32)


def split_model(model: nnx.Module | tuple[nnx.GraphDef, nnx.State]) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, weights)`` from an NNX module or an already split pair."""
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nnx.GraphDef):
        return model
    if isinstance(model, nnx.Module):
        return nnx.split(model)
    raise ValueError(f"model must be an nnx.Module or a (graphdef, state) pair, got {type(model).__name__}")


def place(model: nnx.Module | tuple[nnx.GraphDef, nnx.State], pages: jax.Array, mesh: jax.sharding.Mesh | None
          ) -> tuple[nnx.GraphDef, nnx.State, ModelFacts, jax.Array, jax.sharding.Mesh | None]:
    """Resolve the mesh of a call and put the model and pages on it.

    ``mesh`` None: the mesh the pages are already sharded over (``paged_kv.models.sharding.shard``), or none
    (one device: nothing changes). Returns ``(graphdef, weights, facts, pages, mesh)``; with a mesh
    the model and pages are placed (a no-op when they already are), and ``facts`` (the model's
    ``paged_kv.models.protocol.ModelFacts``) are the placed model's (KV heads replicated when tp exceeds them).
    ValueError, before anything is traced, when the model does not implement the protocol.
    """
    from paged_kv.models import sharding

    graphdef, weights = split_model(model)
    facts = model_facts(model if isinstance(model, nnx.Module) else (graphdef, weights))
    mesh = sharding.mesh_of(pages) if mesh is None else mesh
    if mesh is None:
        return graphdef, weights, facts, pages, None
    sharding.tp_degree(mesh)
    (graphdef, weights), pages = sharding.shard((graphdef, weights), pages, mesh)
    return graphdef, weights, model_facts((graphdef, weights)), pages, mesh


def layer_layout(graphdef: nnx.GraphDef, weights: nnx.State, impl: str,
                 mesh: jax.sharding.Mesh | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, weights)`` in the layer layout for ``impl`` and ``mesh``
    (``paged_kv.models.paged.layout_for_impl``): a stacked Llama becomes one array per layer when the
    kernels are Pallas over a tensor-parallel mesh, so the jitted programs hold no slice of a
    stacked weight (XLA:GPU copies each one on every step); on one device the layers stay
    stacked (the Pallas matmul reads them in place). Outside ``jit`` only; a conversion copies
    the decoder-layer weights once, so callers rebind their ``weights`` to the result and keep no
    reference to the stacked ones. Call after ``impl`` is checked (an unknown ``impl`` must
    raise before anything is copied)."""
    from paged_kv.models.paged import layout_for_impl
    return layout_for_impl((graphdef, weights), impl, mesh)


def replicate_inputs(mesh: jax.sharding.Mesh | None, *arrays: Any) -> tuple[Any, ...]:
    """Arrays (block-manager state, prompts, keys) replicated over ``mesh``, or as given without one.
    Over several processes every process must pass the same values."""
    if mesh is None:
        return arrays
    from paged_kv.models import sharding
    return sharding.replicate(arrays, mesh)


MIN_BUCKET = 16
"""The narrowest width ``pad_prompts`` pads to by default (one block of the usual size)."""


def bucket_width(longest: int, multiple: int = 1, max_width: int | None = None) -> int:
    """The padded width for a longest prompt of ``longest`` tokens: the smallest power of two
    ``>= max(longest, MIN_BUCKET)``, rounded up to ``multiple``, at most ``max_width``.

    Why powers of two: the width is a static shape of ``generate`` / ``beam_search``, so every
    distinct width compiles the loop anew; powers of two make that one compile per bucket
    (``log2`` of the context: 6 buckets up to 512 tokens) while a prompt's padding stays below
    its own length (the prefill forward computes the padded width at most twice over; it skips
    chunks past the longest prompt). Multiples of the block size would pad less but compile up
    to ``context / block_size`` programs (32 for 512 tokens in blocks of 16)."""
    w = max(MIN_BUCKET, 1 << max(int(longest) - 1, 0).bit_length())
    w = -(-w // multiple) * multiple
    return w if max_width is None else max(int(longest), min(w, int(max_width)))


def pad_prompts(prompts: Sequence[ArrayLike], width: int | None = None, multiple: int = 1, *,
                vocab_size: int | None = None, max_width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (int32 ``[B, W]`` zero-padded tokens, int32 ``[B]`` lengths).

    ``W`` is ``width`` when given; by default the longest prompt's bucket (``bucket_width``: the
    next power of two from ``MIN_BUCKET`` = 16 on, rounded up to ``multiple``, capped at
    ``max_width``), so that calls with prompts of different lengths share one compiled loop per
    bucket. Pass ``max_width=manager.max_tokens_per_seq`` when that is not a power of two (a
    width beyond what a sequence holds is refused). Each prompt is checked by ``token_ids``: ints
    (not bools or floats) in ``[0, vocab_size)`` (``[0, 2**31)`` when ``vocab_size`` is None;
    ``generate`` and ``beam_search`` check against the model's vocabulary again); a bad id raises
    ``ValueError`` naming the prompt, the id, its position and the limit.
    """
    if prompts is None or isinstance(prompts, (str, bytes)) or np.isscalar(prompts):
        raise ValueError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}")
    for name, v in (("width", width), ("multiple", multiple), ("max_width", max_width)):
        if v is not None and (not is_int(v) or v < 1):
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    if vocab_size is not None and (not is_int(vocab_size) or vocab_size < 1):
        raise ValueError(f"vocab_size={vocab_size!r} must be an int >= 1")
    try:
        prompts = [token_ids(p, what=f"prompt {i}", vocab_size=vocab_size) for i, p in enumerate(prompts)]
    except TypeError:
        raise ValueError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}") from None
    if not prompts:
        raise ValueError("no prompts")
    longest = max(len(p) for p in prompts)
    if max_width is not None and longest > max_width:
        raise ValueError(f"a prompt has {longest} tokens; max_width={max_width}")
    w = bucket_width(longest, multiple, max_width) if width is None else int(width)
    if longest > w:
        raise ValueError(f"a prompt has {longest} tokens; width={w}")
    out = np.zeros((len(prompts), w), np.int32)
    for i, p in enumerate(prompts):
        out[i, :len(p)] = p
    return out, np.array([len(p) for p in prompts], np.int32)


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


def layout_groups(layout: KVGroupLayout) -> tuple[Group, ...]:
    """The ``ManagerConfig.groups`` of a ``KVGroupLayout``: ``Group("window", w)`` for a group
    window ``w >= 1``, ``Group("full")`` for 0."""
    return tuple(Group("window", w) if w else Group("full") for w in layout.group_windows)


def kv_cache_groups(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | Any) -> tuple[Group, ...]:
    """The KV-cache groups to build a windowed ``model``'s manager with
    (``ManagerConfig(groups=kv_cache_groups(model))``): those of
    ``paged_kv.models.kv_group_layout(model)``, vLLM 0.33's layer grouping. ``(Group("full"),)``
    for a model without windows. ``model``: anything ``kv_group_layout`` takes (a model, its
    split, a ``LlamaConfig``, per-layer windows), or a ``KVGroupLayout``."""
    return layout_groups(model if isinstance(model, KVGroupLayout) else kv_group_layout(model))


def group_layout(model: nnx.Module | tuple[nnx.GraphDef, nnx.State] | Any, manager: ManagerConfig
                 ) -> KVGroupLayout | None:
    """The pages' ``KVGroupLayout`` for a grouped ``manager``: ``kv_group_layout(model)``, whose
    groups must equal ``manager.groups`` (else ``ValueError`` naming both); None for the default
    single full group (pages of every layer, as without groups: a windowed model then keeps one
    full table per sequence and never reclaims)."""
    if not isinstance(manager, ManagerConfig):
        raise ValueError(f"manager must be a ManagerConfig, got {type(manager).__name__}")
    if manager.groups == DEFAULT_GROUPS:
        return None
    windows = layer_windows(model)
    layout = kv_group_layout(windows)
    if layout_groups(layout) != manager.groups:
        raise ValueError(f"manager groups={manager.groups!r} differ from the model's KV-cache groups "
                         f"{layout_groups(layout)!r} (paged_kv.engine.kv_cache_groups(model); layer windows "
                         f"{windows})")
    return layout


def check_kv_pages(pages: jax.Array | QuantPages, impl: str, batch_invariant: bool = False) -> None:
    """The engines' check of their pages before tracing
    (``paged_kv.pallas_kernels.validate.check_kv_options``): quantized pages with
    ``batch_invariant=True``, or in a dtype a Pallas ``impl``'s target cannot compute, are refused.

    Raises:
      ValueError: naming the pages' dtype and ``batch_invariant``, or the dtype and the target.
    """
    from paged_kv.pallas_kernels.validate import check_kv_options
    check_kv_options(pages.dtype, impl, batch_invariant)


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
