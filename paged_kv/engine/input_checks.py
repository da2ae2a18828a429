"""Host checks of a call's inputs, run in Python before anything is traced or compiled: token
ids (one prompt, or padded prompts against a vocabulary), PRNG keys and per-prompt seeds, and
the padding of prompts into the ``[B, W]`` array the compiled loops take.

Every problem raises ``ValueError`` naming the value and the limit. Shapes and dtypes are always
checked; values when they are concrete arrays, and skipped when the call is itself being traced
inside the caller's ``jit``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from numpy.typing import ArrayLike

from paged_kv.inputs import is_int

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
