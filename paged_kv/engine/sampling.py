"""Sampling parameters and the token sampler used by the on-device loops.

``SamplingParams`` and ``BeamParams`` are frozen, hashable dataclasses (static ``jax.jit``
arguments, so two equal parameter sets share one compiled loop), validated on construction: a bad
value raises ``ValueError`` naming the field, the value and the limit, before anything is traced.

``sample_tokens`` turns float32 logits into one token per row: greedy (``temperature == 0``),
or temperature, then top-k, then top-p (nucleus) filtering and a categorical draw with an explicit
PRNG key. The log-probability returned is that of the chosen token under the model's own
distribution (``log_softmax`` of the raw logits), not of the filtered one, as vLLM reports it.

Seeding rule (both engines). A sample's randomness is a function of its request's seed, its
sample index and its token index only, never of its row, its batchmates, the batch size or the
order of submission: token ``t`` (0 for the first generated token) of sample ``i`` (of ``n``) of
a request or prompt whose seed is ``s`` is drawn with the key
``fold_in(fold_in(fold_in(root_key(), s), i), t)`` (``sample_keys``), each row with its own key
and its own noise (``sample_tokens``, ``sample_rows``). Seeds are ints in ``[0, 2**31)``:

* ``ServingEngine``: ``Request.seed``, or by default ``default_seed(engine seed, request id)``, a
  stable hash (not Python's salted ``hash``); ``RequestOutput.seed`` records the one used, and
  the same request with that seed gives the same samples on any engine, alone or in any batch.
* ``generate``: ``seeds[b]`` for prompt ``b``, or by default ``derive_seeds(key, B)[b]``, a
  function of the call's key and ``b``; ``GenerateOutput.seeds`` records them. Permuting the
  prompts permutes the derived seeds' owners, so pass ``seeds`` (e.g. the recorded ones) to give a
  prompt the same samples in another row or batch.

The same seed gives the same tokens in both engines wherever their logits are equal.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import jax
import jax.numpy as jnp

from paged_kv.inputs import is_int, is_real
from paged_kv.pallas_kernels.invariant import log_softmax as invariant_log_softmax
from paged_kv.scan import per_platform

INT32_LIMIT = 2**31
SEED_LIMIT = 2**31
"""Sampling seeds lie in ``[0, SEED_LIMIT)`` (int32 on the device)."""
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 1e6
"""A non-zero temperature must lie in ``[MIN_TEMPERATURE, MAX_TEMPERATURE]``: far below, float32
``logits / temperature`` overflows to inf (inf - inf = NaN in the softmax); far above, every token
is equally likely and the value is almost certainly a mistake. Use 0 for greedy decoding."""


def _check_count(name: str, value, minimum: int) -> None:
    """An int (not a bool, not a float) in ``[minimum, 2**31)`` (int32 on the device)."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    if value >= INT32_LIMIT:
        raise ValueError(f"{name}={value!r} must be an int in [{minimum}, 2**31)")


def _eos_tuple(value) -> tuple[int, ...] | None:
    if value is None:  # the model's (``with_model_eos``)
        return None
    if is_int(value):
        value = (value,)
    try:
        eos = tuple(value)
    except TypeError:
        raise ValueError(f"eos_token_ids={value!r} must be an int or a sequence of ints") from None
    for t in eos:
        if not is_int(t) or t < 0:
            raise ValueError(f"eos_token_ids: {t!r} must be an int >= 0")
    return tuple(int(t) for t in eos)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample answers.

    Attributes:
      max_new_tokens: generated tokens per answer at most (int in ``[1, 2**31)``; EOS included);
        also the size of the output buffers.
      temperature: 0 for greedy decoding (argmax), else logits are divided by it (a float in
        ``[1e-6, 1e6]``; NaN and inf are rejected).
      top_k: keep the ``top_k`` most likely tokens; 0 keeps all (int >= 0; ``<= vocab_size`` is
        checked where the model is known).
      top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p``;
        in (0, 1], 1 keeps all (NaN rejected).
      n: answers per prompt (int >= 1, not a bool or float). The prompt is prefilled once and its
        blocks are shared.
      eos_token_ids: an answer ends after sampling any of these tokens (the EOS is kept); ints
        >= 0 (``< vocab_size`` checked where the model is known). None (the default): the
        model's own EOS ids (``PagedModel.eos_token_ids``: a checkpoint's
        ``generation_config.json``, else its ``config.json``), filled in by every engine before
        anything is traced (``with_model_eos``); ``()`` stops at no token.
      ignore_eos: True: generate ``max_new_tokens`` whatever is sampled (as vLLM's
        ``ignore_eos``); ``eos_token_ids`` must then be None or empty.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 1
    eos_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        _check_count("max_new_tokens", self.max_new_tokens, 1)
        t = self.temperature
        if not is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r} must be a finite float >= 0 (0: greedy)")
        if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
            raise ValueError(f"temperature={t!r} must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
        _check_count("top_k", self.top_k, 0)
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:  # NaN fails the comparison too
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        _check_count("n", self.n, 1)
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "n", int(self.n))
        _check_eos(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class BeamParams:
    """Beam-search parameters.

    Attributes:
      beam_width: k, live candidates per prompt and hypotheses returned (>= 1).
      max_new_tokens: generated tokens per hypothesis at most (>= 1).
      length_penalty: a finished hypothesis of ``length`` generated tokens (EOS included) scores
        ``sum_logprobs / length ** length_penalty`` (finite float).
      eos_token_ids: a candidate that samples one of these is finished; None (the default): the
        model's EOS ids, as ``SamplingParams.eos_token_ids``.
      ignore_eos: True: no token finishes a candidate (``eos_token_ids`` None or empty).
    """

    beam_width: int = 4
    max_new_tokens: int = 16
    length_penalty: float = 1.0
    eos_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        _check_count("beam_width", self.beam_width, 1)
        _check_count("max_new_tokens", self.max_new_tokens, 1)
        if not is_real(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty={self.length_penalty!r} must be a finite float")
        object.__setattr__(self, "beam_width", int(self.beam_width))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "length_penalty", float(self.length_penalty))
        _check_eos(self)


def _check_eos(params: SamplingParams | BeamParams) -> None:
    """Normalises ``eos_token_ids`` (a tuple of ints, or None) and checks ``ignore_eos``."""
    eos = _eos_tuple(params.eos_token_ids)
    if not isinstance(params.ignore_eos, bool):
        raise ValueError(f"ignore_eos={params.ignore_eos!r} must be a bool")
    if params.ignore_eos and eos:
        raise ValueError(f"ignore_eos=True with eos_token_ids={eos!r}: give one or the other")
    object.__setattr__(params, "eos_token_ids", () if params.ignore_eos else eos)


def with_model_eos(params: SamplingParams | BeamParams, model_eos: tuple[int, ...]) -> SamplingParams | BeamParams:
    """``params`` with ``eos_token_ids`` filled in: the model's ids (``model_eos``) when None, as
    given otherwise (``()`` with ``ignore_eos``). Every engine calls it once, on the host, before
    tracing, so the compiled loops only ever see a tuple, and ``SamplingParams()`` and
    ``SamplingParams(eos_token_ids=<the model's ids>)`` share one compiled program."""
    if params.eos_token_ids is not None:
        return params
    return dataclasses.replace(params, eos_token_ids=tuple(model_eos))


def check_vocab(eos_token_ids: tuple[int, ...], top_k: int, vocab_size: int) -> None:
    """ValueError when EOS ids or top_k do not fit the model's vocabulary."""
    for t in eos_token_ids:
        if t >= vocab_size:
            raise ValueError(f"eos token id {t} must be < vocab_size={vocab_size}")
    if top_k > vocab_size:
        raise ValueError(f"top_k={top_k} must be <= vocab_size={vocab_size}")


def filter_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature, then top-k, then top-p on float32 logits ``[..., V]``; dropped tokens get -inf.

    Ties at a top-k/top-p threshold are all kept (the threshold is a logit value). The filters
    are ``filter_rows``' (the serving loop's per-row form), with every row's parameters the same;
    with neither filter on, nothing is sorted.
    """
    x = logits.astype(jnp.float32) / params.temperature
    v = x.shape[-1]
    if not (0 < params.top_k < v or params.top_p < 1.0):
        return x
    rows = x.reshape(-1, v)
    r = rows.shape[0]
    out = filter_rows(rows, jnp.ones((r,), jnp.float32), jnp.full((r,), params.top_k, jnp.int32),
                      jnp.full((r,), params.top_p, jnp.float32))
    return out.reshape(x.shape)


def sample_tokens(logits: jax.Array, key: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """float32 logits ``[R, V]`` -> (int32 tokens ``[R]``, float32 log-probabilities ``[R]``).

    ``key``: typed PRNG keys ``[R]``, one per row (``sample_keys``): row ``r`` draws with
    ``key[r]`` alone, so its token depends only on its logits and its key, not on its position
    in the batch or on the other rows (the engines' form). Or one key (shape ``()``, or a raw
    uint32 ``[2]`` key): the whole batch then draws one ``[R, V]`` noise array, so rows differ
    from one another but a row's noise depends on its position and on ``R``.
    """
    logits = logits.astype(jnp.float32)
    if params.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    elif _per_row(key, logits):
        tokens = jax.vmap(jax.random.categorical)(key, filter_logits(logits, params)).astype(jnp.int32)
    else:
        tokens = jax.random.categorical(key, filter_logits(logits, params), axis=-1).astype(jnp.int32)
    return tokens, _logprob_of(logits, tokens)


def _per_row(key: jax.Array, logits: jax.Array) -> bool:
    """``key`` holds one typed key per row of ``logits`` (``[R]``), not one key for the batch."""
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    if typed and key.ndim == 1 and logits.ndim == 2 and key.shape[0] == logits.shape[0]:
        return True
    if (typed and key.ndim == 0) or (not typed and key.shape == (2,)):
        return False
    raise ValueError(f"key must be one PRNG key or typed keys [R] for logits {logits.shape}, got {key.dtype}"
                     f" of shape {key.shape}")


def root_key() -> jax.Array:
    """The key every sampling seed is folded into (``jax.random.key(0)``; module docstring)."""
    return jax.random.key(0)


def sample_keys(root: jax.Array, seed: jax.Array, sample_idx: jax.Array, token_idx: jax.Array) -> jax.Array:
    """Typed PRNG keys ``[R]``: ``fold_in(fold_in(fold_in(root, seed), sample_idx), token_idx)`` per
    row, for int32 ``[R]`` seeds, sample indices and token indices (the seeding rule: a key names
    a request's seed, sample and token, nothing of the row or batch). ``root``: ``root_key()``."""
    return jax.vmap(lambda s, i, t: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(root, s), i), t))(
        seed, sample_idx, token_idx)


def derive_seeds(key: jax.Array, num: int) -> jax.Array:
    """int32 ``[num]`` seeds in ``[0, 2**31)``: seed ``b`` is the top 31 bits of
    ``bits(fold_in(key, b))``, a function of the key and ``b`` alone (``generate``'s default:
    ``b`` is the prompt's index, so a prompt keeps its seed whatever the batch size)."""
    bits = jax.vmap(lambda b: jax.random.bits(jax.random.fold_in(key, b), (), jnp.uint32))(jnp.arange(num))
    return (bits >> 1).astype(jnp.int32)


def default_seed(engine_seed: int, request_id: object) -> int:
    """The seed of a request submitted without one: a stable hash of the engine's seed and the
    request id (blake2b of ``f"{engine_seed}:{request_id!r}"``, integer ids as Python ints), in
    ``[0, 2**31)``. Python's ``hash`` is salted per process and would not replay; an id whose
    ``repr`` is not stable across processes (an object shown by its address) gives a seed that
    only holds for the process, but ``RequestOutput.seed`` records it either way."""
    if is_int(request_id):
        request_id = int(request_id)
    digest = hashlib.blake2b(f"{engine_seed}:{request_id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT


def _logprob_of(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """float32 ``[R]``: log-probability of ``tokens`` (int32 ``[R]``) under raw ``logits`` ``[R, V]``.
    The normaliser is summed in a fixed order, so a row's value never depends on the others
    (``jax.nn.log_softmax`` on XLA:CPU changed bits at R >= 16, V = 259); the training side's
    ``paged_kv.models.contiguous.score_tokens`` uses the same function."""
    logp = invariant_log_softmax(logits)
    return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def filter_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``filter_logits`` with per-row parameters (the serving loop's rows each have their own):
    float32 logits [R, V], temperature float32 [R] (rows <= 0 are left unscaled), top_k int32 [R]
    (0: all), top_p float32 [R] (1: all) -> float32 [R, V] with dropped tokens at -inf. Temperature,
    then top-k, then top-p; ties at a threshold are kept."""
    logits = logits.astype(jnp.float32)
    v = logits.shape[-1]
    x = logits / jnp.where(temperature <= 0, 1.0, temperature)[:, None]
    desc = -jnp.sort(-x, axis=-1)  # one sort serves both filters
    kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=1)
    kth = jnp.where((top_k > 0)[:, None], kth, -jnp.inf)
    x = jnp.where(x < kth, -jnp.inf, x)
    desc = jnp.where(desc < kth, -jnp.inf, desc)  # still sorted
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of strictly better tokens
    # The best token always (even top_p <= 0); a row with top_p >= 1 keeps every token, as
    # ``filter_logits`` does by skipping the filter (a cumulative sum rounded up to 1 must not
    # drop its least likely tokens, nor make a row's result depend on whether it runs).
    keep = (before < top_p[:, None]) | (top_p >= 1.0)[:, None] | (jnp.arange(v) == 0)
    threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x < threshold, -jnp.inf, x)


def _skip_on_cpu_unless(target: str, pred: jax.Array, fn, otherwise, operand):
    """``fn(operand)``; on a CPU, ``otherwise(operand)`` instead when ``pred`` is False. Both give
    the same result whenever ``pred`` is False, so this only saves work (``scan.per_platform``:
    a CPU runs the ``cond`` for free, a GPU would read its predicate on the host every step)."""
    return per_platform(target, operand, cpu=lambda x: jax.lax.cond(pred, fn, otherwise, x), default=fn)


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array,
                top_p: jax.Array, *, target: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Per-row sampling: float32 logits [R, V], keys [R] (typed PRNG keys, or a function of no
    arguments returning them: then they are derived only where a row draws), temperature float32 [R]
    (0: greedy), top_k int32 [R], top_p float32 [R] -> (int32 tokens [R], float32 log-probabilities
    [R] of the chosen tokens under the model's raw distribution, as ``sample_tokens``).

    Each row draws with its own key, so a row's token does not depend on the other rows. On a CPU
    a step whose rows are all greedy skips the draw, and one whose rows use neither top-k nor
    top-p skips the sort (the results are the same either way). ``target``: which form to trace,
    as ``ManagerConfig.target``."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def scaled(x):
        return x / jnp.where(temperature <= 0, 1.0, temperature)[:, None]

    def draw(x):
        filtered = _skip_on_cpu_unless(target, jnp.any((top_k > 0) | (top_p < 1.0)),
                                       lambda y: filter_rows(y, temperature, top_k, top_p), scaled, x)
        row_keys = keys() if callable(keys) else keys
        drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row))(row_keys, filtered)
        return jnp.where(temperature <= 0, greedy, drawn).astype(jnp.int32)

    tokens = _skip_on_cpu_unless(target, jnp.any(temperature > 0), draw, lambda x: greedy, logits)
    return tokens, _logprob_of(logits, tokens)


def is_eos(tokens: jax.Array, eos_token_ids: tuple[int, ...]) -> jax.Array:
    """bool, same shape as ``tokens``: the token is one of ``eos_token_ids``."""
    out = jnp.zeros(tokens.shape, bool)
    for t in eos_token_ids:
        out = out | (tokens == t)
    return out
