"""What the serving step takes and returns (``StepInputs``, ``StepOutputs``) and how they travel
between host and device: packed into a few int32 arrays, since a jitted call pays per argument
and ``device_get`` per result array (``pack_inputs`` / ``unpack_inputs``, ``pack_outputs`` /
``unpack_outputs``), plus ``intern`` for the step's static model argument."""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from paged_kv.engine.serving_types import ServingConfig


@struct.dataclass
class StepInputs:
    """One step's inputs (R = ``max_seqs`` rows, P prefill rows, C = ``chunk_size``); -1 pads ids.

    Attributes:
      free_ids: int32 [R] rows to free first (finished or preempted).
      sel_dst, sel_parent: int32 [R] beam reselection: row ``sel_dst[i]`` takes ``sel_parent[i]``'s table.
      pf_rows: int32 [P] rows of the cohort chunk; pf_tokens int32 [P, C] their tokens at
        positions ``pf_start .. pf_start + pf_lens - 1``; pf_start, pf_lens int32 [P].
      dec_tokens: int32 [R] token each decoding row feeds; dec_live bool [R].
      fork_src, fork_dst: int32 [R] samples forked after the forward (prefill just ended).
      logit_src: int32 [R] the row whose logits each row samples from (a forked sample: its source).
      temperature, top_p: float32 [R]; top_k int32 [R] per-row sampling parameters (0: greedy / all).
      seed, sample_idx, token_idx: int32 [R] the parts of each row's sampling key.
      beam: bool [R] rows of beam families (the only rows whose top candidates the host reads),
        or None: the top candidates of every row are computed.
      left: int32 [R] tokens each decoding row may still generate, this step's included (its
        budget); eos: int32 [EOS_SLOTS, R] its request's EOS ids (-1 pads); n_steps: int32 [R]
        (every entry the same, >= 1) decode steps this call may run (``ServingConfig.decode_steps``):
        the rows stop on the device at an EOS or their budget; stop_on_finish: bool [R] (every
        entry the same) true when requests wait, so that the call ends after a step in which a
        row finished (its row and blocks may admit one). Both read only when ``decode_steps > 1``.
    """

    free_ids: jax.Array
    sel_dst: jax.Array
    sel_parent: jax.Array
    pf_rows: jax.Array
    pf_tokens: jax.Array
    pf_start: jax.Array
    pf_lens: jax.Array
    dec_tokens: jax.Array
    dec_live: jax.Array
    fork_src: jax.Array
    fork_dst: jax.Array
    logit_src: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    sample_idx: jax.Array
    token_idx: jax.Array
    beam: jax.Array | None = None
    left: jax.Array | None = None
    eos: jax.Array | None = None
    n_steps: jax.Array | None = None
    stop_on_finish: jax.Array | None = None


class Burst(NamedTuple):
    """How many decode steps the next call may run, and whether it ends after a step in which a
    row finished (``StepInputs.n_steps`` and ``stop_on_finish``)."""

    steps: int = 1
    stop_on_finish: bool = False


EOS_SLOTS = 4
"""EOS ids per row the device checks in a burst of decode steps (a request with more runs one
step per call)."""


@struct.dataclass
class StepOutputs:
    """Attributes:
    tokens: int32 [R] sampled token per row; logprobs float32 [R] its log-probability.
    top_logprobs: float32 [R, K]; top_ids int32 [R, K]: each row's K best continuations (beams).
    status: int32 [R] ``append`` status (PADDING for rows that did not decode).
    num_free: int32 free blocks after the step; copies: int32 copy-on-write copies made.
    bad_tokens: int32 tokens fed this step (prefill or decode) outside the vocabulary: 0 unless
      the host checks were bypassed; the model looked them up as a safe id (no NaN K/V), and
      ``EngineStats.bad_tokens`` counts them.
    tables: int32 [R, M] block tables (group 0's with KV-cache groups), num_tokens int32 [R],
      refs int32 [R, M] reference count of each table entry (only with ``record_tables``; else
      [0]-sized).
    """

    tokens: jax.Array
    logprobs: jax.Array
    top_logprobs: jax.Array
    top_ids: jax.Array
    status: jax.Array
    num_free: jax.Array
    copies: jax.Array
    tables: jax.Array
    num_tokens: jax.Array
    refs: jax.Array
    bad_tokens: jax.Array


# -- the step as the engine calls it: a few packed arrays in, one out -------------------------
# A jitted call takes a few microseconds per argument array (a host-to-device transfer each) and
# ``device_get`` as much per result array; over 18 inputs and 11 outputs that was ~0.3 ms of a
# ~2.5 ms step at R = 32. So ``DeviceStep`` sends the [R] fields as one int32 array and the
# prefill chunk as another, and reads the outputs back as one int32 vector. Float fields travel
# as their bits (``view`` / ``bitcast_convert_type``), so nothing is rounded.

ROW_LAYOUT: tuple[tuple[str, type, int], ...] = (
    ("free_ids", np.int32, 1), ("sel_dst", np.int32, 1), ("sel_parent", np.int32, 1), ("dec_tokens", np.int32, 1),
    ("dec_live", np.bool_, 1), ("fork_src", np.int32, 1), ("fork_dst", np.int32, 1), ("logit_src", np.int32, 1),
    ("temperature", np.float32, 1), ("top_k", np.int32, 1), ("top_p", np.float32, 1), ("seed", np.int32, 1),
    ("sample_idx", np.int32, 1), ("token_idx", np.int32, 1), ("beam", np.bool_, 1), ("left", np.int32, 1),
    ("n_steps", np.int32, 1), ("stop_on_finish", np.bool_, 1), ("eos", np.int32, EOS_SLOTS))
"""The packed rows array, declared once: ``(field, dtype, rows)`` per ``StepInputs`` field of shape
[R] (rows 1) or [rows, R], in the order of the array's first axis. ``pack_rows`` and
``unpack_rows`` both follow it, so a new field is one entry here (int32, bool or float32)."""

PREFILL_FIELDS = ("pf_tokens", "pf_rows", "pf_start", "pf_lens")
"""The fields of the packed prefill array: int32 [P, C] tokens, then three int32 [P] columns."""

ROW_FIELDS = tuple(name for name, _, _ in ROW_LAYOUT if name != "eos")
"""The [R] fields of ``ROW_LAYOUT``, in order."""


def pack_rows(values: StepInputs | dict[str, np.ndarray], layout: tuple[tuple[str, type, int], ...] = ROW_LAYOUT
              ) -> np.ndarray:
    """int32 ``[sum(rows), R]``: each field of ``layout`` (``values[name]``, or an attribute) as
    int32 rows; float32 travels as its bits (nothing is rounded), bool as 0/1."""
    get = values.__getitem__ if isinstance(values, dict) else functools.partial(getattr, values)
    parts = []
    for name, dtype, n in layout:
        x = np.asarray(get(name), dtype)
        x = x.view(np.int32) if dtype == np.float32 else x.astype(np.int32)
        parts.append(x.reshape(n, -1))
    return np.concatenate(parts)


def unpack_rows(rows: jax.Array, layout: tuple[tuple[str, type, int], ...] = ROW_LAYOUT) -> dict[str, jax.Array]:
    """The traced inverse of ``pack_rows``: field name -> array of its dtype ([R], or [rows, R])."""
    out, at = {}, 0
    for name, dtype, n in layout:
        x = rows[at:at + n]
        at += n
        if dtype == np.float32:
            x = jax.lax.bitcast_convert_type(x, jnp.float32)
        elif dtype == np.bool_:
            x = x != 0
        out[name] = x[0] if n == 1 else x
    return out


def _check_layout() -> None:
    fields = set(StepInputs.__dataclass_fields__)
    declared = {name for name, _, _ in ROW_LAYOUT} | set(PREFILL_FIELDS)
    if fields != declared:  # at import: a StepInputs field the packing does not carry fails loudly
        raise AssertionError(f"StepInputs fields not in ROW_LAYOUT/PREFILL_FIELDS: {sorted(fields - declared)}; "
                             f"declared but not fields: {sorted(declared - fields)}")


_check_layout()


def pack_inputs(inp: StepInputs) -> tuple[np.ndarray, np.ndarray]:
    """Host ``StepInputs`` -> (``pack_rows``: int32 [rows of ``ROW_LAYOUT``, R], int32 [P, C + 3]:
    each prefill row's tokens, then its row, start and length)."""
    pf = np.concatenate([np.asarray(inp.pf_tokens, np.int32),
                         np.stack([inp.pf_rows, inp.pf_start, inp.pf_lens], axis=1).astype(np.int32)], axis=1)
    return pack_rows(inp), pf


def unpack_inputs(rows: jax.Array, pf: jax.Array) -> StepInputs:
    """The traced inverse of ``pack_inputs``."""
    c = pf.shape[1] - 3
    return StepInputs(pf_tokens=pf[:, :c], pf_rows=pf[:, c], pf_start=pf[:, c + 1], pf_lens=pf[:, c + 2],
                      **unpack_rows(rows))


def output_layout(config: ServingConfig) -> list[tuple[str, tuple[int, ...], type]]:
    """(field, shape, dtype) of each ``StepOutputs`` field, in the order of the packed vector."""
    r, k, m = config.manager.max_seqs, config.top_candidates, config.manager.max_blocks_per_seq
    rec = config.record_tables
    i32, f32 = np.int32, np.float32
    return [("tokens", (r,), i32), ("logprobs", (r,), f32), ("top_logprobs", (r, k), f32), ("top_ids", (r, k), i32),
            ("status", (r,), i32), ("num_free", (), i32), ("copies", (), i32),
            ("tables", (r, m) if rec else (0, 0), i32), ("num_tokens", (r,) if rec else (0,), i32),
            ("refs", (r, m) if rec else (0, 0), i32), ("bad_tokens", (), i32)]


def pack_outputs(config: ServingConfig, out: StepOutputs) -> jax.Array:
    """``StepOutputs`` -> one int32 vector (``output_layout``'s order; floats as their bits). With
    a leading axis of K steps on every field (a burst, ``decode_steps > 1``) the vector holds
    the K steps' vectors one after the other."""
    parts = []
    lead = out.tokens.shape[:-1]  # () for one step, (K,) for a burst
    for name, shape, dtype in output_layout(config):
        x = getattr(out, name)
        assert x.shape == lead + shape and x.dtype == dtype, (name, x.shape, x.dtype, shape, dtype)  # at trace time
        parts.append((jax.lax.bitcast_convert_type(x, jnp.int32) if dtype == np.float32 else x).reshape(lead + (-1,)))
    return jnp.concatenate(parts, axis=-1).reshape(-1)


@functools.lru_cache(maxsize=64)
def _output_slices(config: ServingConfig) -> tuple:
    """(field, start, stop, shape, dtype) per field of the packed vector (computed once per config:
    the host unpacks one every step)."""
    out, at = [], 0
    for name, shape, dtype in output_layout(config):
        n = math.prod(shape)
        out.append((name, at, at + n, shape, dtype))
        at += n
    return tuple(out)


def unpack_outputs(config: ServingConfig, flat: np.ndarray) -> StepOutputs:
    """Host inverse of ``pack_outputs`` for one step (numpy views into ``flat``; scalars as numpy
    0-d arrays)."""
    return StepOutputs(**{name: flat[lo:hi].view(dtype).reshape(shape)
                          for name, lo, hi, shape, dtype in _output_slices(config)})


def unpack_burst(config: ServingConfig, flat: np.ndarray, steps: int) -> list[StepOutputs]:
    """The first ``steps`` steps' ``StepOutputs`` of a burst's packed vector (``pack_outputs`` of
    K steps; views into ``flat``)."""
    size = _output_slices(config)[-1][2]
    return [unpack_outputs(config, flat[i * size:(i + 1) * size]) for i in range(steps)]


class Interned:
    """A static jit argument that is hashed and compared in full once, when interned.

    jit hashes its static arguments on every call and, on a cache hit, compares them with the
    cached key: for an NNX ``GraphDef`` (and the weights' tree structure) that is tens of
    microseconds of Python per step. ``intern`` returns one canonical holder per distinct value,
    so a step's lookup costs a stored hash and an identity check, and engines over equal models
    still share one compiled step."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: Hashable):
        self.value, self._hash = value, hash(value)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, Interned) and self.value == other.value)


_INTERNED: dict = {}


def intern(value: Hashable) -> Interned:
    """The canonical ``Interned`` holder of ``value`` (hashable)."""
    return _INTERNED.setdefault(value, Interned(value))


__all__ = ["EOS_SLOTS", "PREFILL_FIELDS", "ROW_FIELDS", "ROW_LAYOUT", "Burst", "Interned", "StepInputs", "StepOutputs",
           "intern", "output_layout", "pack_inputs", "pack_outputs", "pack_rows", "unpack_burst", "unpack_inputs",
           "unpack_outputs", "unpack_rows"]
