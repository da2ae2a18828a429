"""A serving loop: requests arrive over time, a host scheduler admits, preempts and streams them,
and every model step is one call of one jitted step function of static shapes.

Pieces:

* ``Request``: prompt token ids, ``SamplingParams`` (``n`` samples) or ``BeamParams`` (beam
  width ``k``), a prefix-cache salt, an arrival step and an optional seed.
* ``ServingEngine``: owns the model, the KV pages, the ``ManagerConfig`` and the block-manager
  state. ``submit(request)`` queues a request (``ValueError`` when it can never fit);
  ``step()`` runs one scheduler iteration and returns the requests that finished;
  ``run(requests)`` submits them at their arrival steps and yields outputs as they finish.

Rows. The block manager's ``max_seqs`` rows are the batch ``R`` of every step. A request family
holds ``n`` (sampling) or ``k`` (beam) rows while it runs.

Admission (host). When no prefill is in progress, the scheduler takes waiting families from the
front of the queue, first come first served, while they fit: free rows, at most
``max_prefill_rows`` prompts, and the prompts' blocks (counted as if nothing were cached) within
the free blocks minus one block per running row (headroom for the next decode steps). One jitted
``admit`` call (prefix-cache lookup first) starts them (the estimate is an upper bound of what
``admit`` takes, so it does not fail; if it ever did for part of a re-admitted family, the admitted
rows are still prefilled, so that their cached blocks hold K/V, and then freed); when nothing else runs, the head of the
queue is tried even if the estimate says no, since cache hits may make it fit. A new request is
admitted into one row (its ``n`` samples ``fork`` that row when its prefill ends, its ``k``
beams ``select`` it); a preempted one into one row per unfinished sample or beam, each with its
generated tokens appended to the prompt.

A *cohort* (the prompts of one admit call) is prefilled in chunks of ``chunk_size`` positions
aligned across its rows (chunk ``c`` covers positions ``[c * C, (c + 1) * C)`` of every row), so
a prompt that shares blocks another prompt of the same call computes (``shared_tokens``) reads
them in the same forward pass that writes them. The next cohort is admitted only after this
one's prefill ends: ``admit`` registers a prompt's full blocks in the prefix cache before their
K/V is written, so no later request may hit them earlier, and a request in the middle of its
prefill is never preempted (its freed blocks would stay cached without their K/V).

The step (device, one ``jax.jit``, shapes fixed by ``R``, ``P`` (0 when no prefill chunk runs,
else ``max_prefill_rows``: two compiled variants) and ``C = chunk_size``): ``free`` finished or preempted rows ->
``select`` (beam reselection) -> paged prefill forward of one cohort chunk ``[P, C]`` -> ``append``
one token per decoding row, ``copy_blocks`` for copy-on-write, paged decode forward ``[R]`` ->
``fork`` the samples of prompts whose prefill ended -> per-row sampling (greedy / temperature /
top-k / top-p, each row with its own parameters and key) and the top candidates for beams.
Padding rows use sequence id -1. The host reads back a few ``[R]`` arrays per step.

Preemption by recompute. ``append`` is atomic per row: a row that finds no free block reports
``Status.NO_FREE_BLOCKS`` and keeps its token for the next step. The scheduler then preempts the
newest running request (by arrival; not one in the middle of its prefill): its rows are freed
(their full blocks stay cached) and it goes back to the front of the waiting queue with its
generated tokens; re-admission recomputes them, mostly from prefix-cache hits. A beam request is
preempted as a unit.

Determinism. Sampling keys are ``fold_in(seed, request seed, sample index, token index)``, so
tokens do not depend on batch composition, preemption or arrival timing; with greedy decoding a
run that preempts gives the tokens of a run with ample blocks.

Tensor parallelism: ``ServingEngine(..., mesh=models.sharding.make_mesh(tp))`` shards the weights
and the KV pages over the mesh's "tp" axis (KV heads) and replicates the block-manager state and
the step inputs; the step is the same function (the forward and the copy-on-write copies run per
device under ``shard_map``), and the host still reads back only the small per-row outputs.

Streaming: ``run(requests, on_token=callback)`` calls ``callback(TokenDelta)`` after each step
with every token generated in it, per request and sample, in order; each token is sent exactly
once, however often its request is preempted and re-admitted (re-admission recomputes the
generated tokens' K/V; it does not generate them again). A sample's last delta carries its
``finish_reason``. Beam hypotheses are not final until the search ends (beams are reselected
every step), so a beam request sends each returned hypothesis whole, in one delta, when it
finishes.

Beam search follows ``engine.beam_search`` (same scoring, tie breaking and stopping rules); the
device returns each beam row's ``top_candidates`` best log-probabilities, which always contain
the ``k * (1 + max(#EOS, 1))`` best continuations over all beams, and the host ranks them.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import time
from typing import Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from models.llama import in_vocab
from models.paged import allocate_pages, kv_bytes_per_block, make_paged_batch, page_spec, paged_forward
from models.protocol import model_facts
from paged_kv.admission import admit
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.engine import requests as _requests
from paged_kv.engine.sampling import BeamParams, SamplingParams, check_vocab, sample_rows
from paged_kv.engine.steps import decode
from paged_kv.reclaim import free
from paged_kv.share import fork, select
from paged_kv.state import BlockManagerState, init_state
from paged_kv.status import Status

IMPLS = ("auto", "pallas", "interpret", "reference")


# ---------------------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """Static configuration of a ``ServingEngine`` (hashable: part of the step's jit key).

    Attributes:
      manager: the block manager's config; ``max_seqs`` is the batch ``R`` of every step.
      chunk_size: prefill positions per step (the ``C`` of the ``[P, C]`` prefill batch).
      max_prefill_rows: prompts per admission (cohort) at most: the ``P`` of the prefill batch
        of a step that runs a chunk (0 otherwise), and the shape of every ``admit`` call. Also the
        widest ``n`` / beam width a request may have (a preempted one is re-admitted as a unit).
      top_candidates: log-probabilities returned per row for beam search; a beam request needs
        ``k * (1 + max(#EOS ids, 1)) <= top_candidates``.
      impl: kernel implementation (``"auto"``, ``"pallas"``, ``"interpret"``, ``"reference"``).
      record_tables: read the block tables back every step (sharing statistics, the block-table
        picture); costs one ``[R, max_blocks_per_seq]`` transfer per step.
    """

    manager: ManagerConfig
    chunk_size: int = 64
    max_prefill_rows: int = 8
    top_candidates: int = 8
    impl: str = "auto"
    record_tables: bool = True

    def __post_init__(self):
        if not isinstance(self.manager, ManagerConfig):
            raise ValueError(f"manager must be a ManagerConfig, got {type(self.manager).__name__}")
        for name, lo in (("chunk_size", 1), ("max_prefill_rows", 1), ("top_candidates", 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r} must be an int >= {lo}")
        if self.max_prefill_rows > self.manager.max_seqs:
            raise ValueError(f"max_prefill_rows={self.max_prefill_rows} must be <= manager.max_seqs="
                             f"{self.manager.max_seqs}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} must be one of {IMPLS}")
        if not isinstance(self.record_tables, bool):
            raise ValueError(f"record_tables={self.record_tables!r} must be a bool")


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class Request:
    """One request.

    Attributes:
      prompt: token ids, at least one: a sequence of ints (not bools or floats) or a 1-D integer
        array, each in ``[0, 2**31)``; stored as a tuple of ints. ``ServingEngine.submit`` checks
        them against the model's vocabulary (``[0, vocab_size)``).
      params: ``SamplingParams`` (``n`` samples, greedy when ``temperature == 0``) or
        ``BeamParams`` (beam search of width ``beam_width``).
      salt: prefix-cache salt in ``[0, 2**32)``: requests share cached blocks only with equal salts.
      arrival: the engine step at which ``ServingEngine.run`` submits it (>= 0).
      request_id: any hashable label (default: the submission number).
      seed: sampling seed (default: the submission number); with the engine's seed it fixes the
        sampled tokens.
    """

    prompt: tuple[int, ...]
    params: SamplingParams | BeamParams = SamplingParams()
    salt: int = 0
    arrival: int = 0
    request_id: object = None
    seed: int | None = None

    def __post_init__(self):
        # Vectorised checks (no per-token Python loop): ints, not bools or floats, in [0, 2**31).
        object.__setattr__(self, "prompt", tuple(_requests.token_ids(self.prompt).tolist()))
        if not isinstance(self.params, (SamplingParams, BeamParams)):
            raise ValueError(f"params must be SamplingParams or BeamParams, got {type(self.params).__name__}")
        if not _is_int(self.salt) or not 0 <= self.salt < 2**32:
            raise ValueError(f"salt={self.salt!r} must be an int in [0, 2**32)")
        if not _is_int(self.arrival) or self.arrival < 0:
            raise ValueError(f"arrival={self.arrival!r} must be an int >= 0")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**31):
            raise ValueError(f"seed={self.seed!r} must be None or an int in [0, 2**31)")

    @property
    def is_beam(self) -> bool:
        return isinstance(self.params, BeamParams)

    @property
    def width(self) -> int:
        """Rows the request holds while it runs: ``n`` or the beam width."""
        return self.params.beam_width if self.is_beam else self.params.n


@dataclasses.dataclass
class RequestStats:
    """Per-request statistics (``RequestOutput.stats``).

    Attributes:
      prompt_tokens: tokens of the original prompt.
      cached_prompt_tokens: prompt tokens served from the prefix cache, over all admissions
        (a re-admission after preemption counts its recomputed tokens too).
      shared_prompt_tokens: prompt tokens whose blocks another prompt of the same admission
        computed.
      admissions: 1 + re-admissions after preemption.
      preemptions: times the request was preempted.
      generated_tokens: tokens generated, over all samples / the returned beam hypotheses.
      arrival_step, first_token_step, finish_step: engine steps.
      time_to_first_token_s: wall time from submission to the first generated token.
      latency_s: wall time from submission to the end.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    shared_prompt_tokens: int = 0
    admissions: int = 0
    preemptions: int = 0
    generated_tokens: int = 0
    arrival_step: int = 0
    first_token_step: int | None = None
    finish_step: int | None = None
    time_to_first_token_s: float | None = None
    latency_s: float | None = None


@dataclasses.dataclass
class RequestOutput:
    """A finished (or rejected) request.

    Attributes:
      request_id: the request's id.
      request: the request itself.
      tokens: generated tokens: ``n`` samples in sample order, or the beam hypotheses best first.
      logprobs: per sample, each token's log-probability under the model (sampling), or None.
      scores: per beam hypothesis, ``sum_logprobs / length ** length_penalty``, or None.
      finish_reasons: per sample / hypothesis, ``"eos"`` or ``"length"``.
      stats: ``RequestStats``.
      error: why the request was rejected (then nothing was generated), else None.
    """

    request_id: object
    request: Request
    tokens: list[list[int]]
    logprobs: list[list[float]] | None
    scores: list[float] | None
    finish_reasons: list[str]
    stats: RequestStats
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass(frozen=True)
class TokenDelta:
    """Tokens of one sample of a request that no earlier delta carried (streaming, ``run(...,
    on_token=...)``).

    Attributes:
      request_id: the request's id.
      index: the sample index in ``[0, n)``, or the hypothesis rank (best first) of a beam request.
      tokens: the new token ids, in order (a beam hypothesis: all of it, sent once at the end; may
        be empty on a sample's last delta when it ended without a new token).
      finish_reason: None while the sample goes on; ``"eos"`` or ``"length"`` on its last delta.
    """

    request_id: object
    index: int
    tokens: tuple[int, ...]
    finish_reason: str | None = None


# ---------------------------------------------------------------------------- the jitted step
@dataclasses.dataclass(frozen=True)
class _StepShape:
    config: ServingConfig
    prefill_rows: int  # P: 0 when no prefill chunk runs this step
    mesh: object = None  # a jax.sharding.Mesh with a "tp" axis, or None (one device)


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
    tables: int32 [R, M] block tables, num_tokens int32 [R], refs int32 [R, M] reference count of
      each table entry (only with ``record_tables``; else [0]-sized).
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


def _step_fn(graphdef, weights, pages, state: BlockManagerState, key, inp: StepInputs, *, shape: _StepShape):
    cfg = shape.config
    mgr = cfg.manager
    model = nnx.merge(graphdef, weights)
    r = mgr.max_seqs
    rows = jnp.arange(r, dtype=jnp.int32)
    state, _ = free(mgr, state, inp.free_ids)
    state, _ = select(mgr, state, inp.sel_dst, inp.sel_parent)
    pf_logits = None
    vocab = model.vocab_size
    bad_tokens = jnp.sum(~in_vocab(inp.dec_tokens, vocab) & inp.dec_live, dtype=jnp.int32)
    if shape.prefill_rows:
        pr = inp.pf_rows
        valid = pr >= 0
        tables = jnp.where(valid[:, None], state.block_tables[jnp.clip(pr, 0, r - 1)], NULL_BLOCK)
        q_lens = jnp.where(valid, inp.pf_lens, 0)
        fed = jnp.arange(cfg.chunk_size, dtype=jnp.int32)[None, :] < q_lens[:, None]
        bad_tokens += jnp.sum(~in_vocab(inp.pf_tokens, vocab) & fed, dtype=jnp.int32)
        batch = make_paged_batch(tables, inp.pf_start, q_lens, cfg.chunk_size, mgr.block_size)
        pf_logits, pages = paged_forward(model, pages, batch, inp.pf_tokens, impl=cfg.impl, last_only=True,
                                         mesh=shape.mesh)
    state, pages, logits, status, copies = decode(model, pages, mgr, state, rows, inp.dec_tokens, inp.dec_live,
                                                  impl=cfg.impl, mesh=shape.mesh)
    if pf_logits is not None:
        logits = logits.at[jnp.where(inp.pf_rows >= 0, inp.pf_rows, r)].set(pf_logits, mode="drop")
    state, _ = fork(mgr, state, inp.fork_src, inp.fork_dst)
    logits = logits[jnp.clip(inp.logit_src, 0, r - 1)]
    keys = jax.vmap(lambda s, i, t: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, s), i), t))(
        inp.seed, inp.sample_idx, inp.token_idx)
    tokens, logp = sample_rows(logits, keys, inp.temperature, inp.top_k, inp.top_p)
    top_lp, top_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), cfg.top_candidates)
    if cfg.record_tables:
        tables = state.block_tables
        out_tables, out_n, out_refs = tables, state.num_tokens, state.ref_count[tables]
    else:
        out_tables = out_refs = jnp.zeros((0, 0), jnp.int32)
        out_n = jnp.zeros((0,), jnp.int32)
    out = StepOutputs(tokens=tokens, logprobs=logp, top_logprobs=top_lp, top_ids=top_ids.astype(jnp.int32),
                      status=status, num_free=state.queue.num_free, copies=copies, tables=out_tables,
                      num_tokens=out_n, refs=out_refs, bad_tokens=bad_tokens)
    return pages, state, out


_step_jit = jax.jit(_step_fn, static_argnames=("graphdef", "shape"), donate_argnames=("pages", "state"))


def _admit_fn(manager: ManagerConfig, state, free_ids, seq_ids, lens, tokens, salts):
    state, _ = free(manager, state, free_ids)
    state, res = admit(manager, state, seq_ids, lens, tokens if manager.prefix_caching else None, salts)
    return state, res, state.queue.num_free


_admit_jit = jax.jit(_admit_fn, static_argnums=0, donate_argnums=1)


def _free_fn(manager: ManagerConfig, state, free_ids):
    state, _ = free(manager, state, free_ids)
    return state, state.queue.num_free


_free_jit = jax.jit(_free_fn, static_argnums=0, donate_argnums=1)


# ---------------------------------------------------------------------------- host-side state
class _Phase(enum.Enum):
    WAITING = 0
    RUNNING = 1
    DONE = 2


@dataclasses.dataclass
class _Sample:
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: str | None = None
    row: int | None = None
    streamed: int = 0  # tokens[:streamed] were sent as TokenDelta (streaming never resends them)


@dataclasses.dataclass
class _Beam:
    tokens: list[int]
    score: float  # sum of log-probabilities
    row: int | None = None


@dataclasses.dataclass
class _Family:
    """A request's host-side state (its samples or beams, rows, statistics)."""

    req: Request
    rid: object
    seq: int  # submission number: larger is newer
    seed: int
    budget: int
    phase: _Phase = _Phase.WAITING
    samples: list[_Sample] = dataclasses.field(default_factory=list)
    beams: list[_Beam] = dataclasses.field(default_factory=list)
    pool: list[tuple[float, float, list[int], int]] = dataclasses.field(default_factory=list)
    rows: list[int] = dataclasses.field(default_factory=list)  # rows held (reserved included)
    prefilling: set = dataclasses.field(default_factory=set)  # rows still in the cohort
    stats: RequestStats = dataclasses.field(default_factory=RequestStats)
    t_submit: float = 0.0

    @property
    def width(self) -> int:
        return self.req.width


@dataclasses.dataclass
class _CohortRow:
    row: int
    family: _Family
    index: int  # sample / beam index
    tokens: np.ndarray
    start: int  # first position to compute (after cached/shared blocks)
    fork_to: list[int]  # rows forked from this one when its prefill ends (a new n > 1 request)
    discard: bool = False  # prefilled only so that its cached blocks hold their K/V; then freed


@dataclasses.dataclass
class EngineStats:
    """Engine-wide statistics (``ServingEngine.stats()``)."""

    steps: int = 0
    prefill_steps: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    wall_s: float = 0.0
    step_s: float = 0.0
    compile_s: float = 0.0
    peak_blocks_used: int = 0
    preemptions: int = 0
    copies: int = 0
    bad_tokens: int = 0  # tokens outside the vocabulary that reached a step (host checks bypassed)
    finished: int = 0
    rejected: int = 0
    admissions: int = 0
    cache_lookups: int = 0
    cache_query_tokens: int = 0
    cache_hit_tokens: int = 0
    cache_evictions: int = 0
    # Block-steps held by n > 1 / beam families: with sharing (distinct blocks) and without
    # (sum over rows of ceil(tokens / block_size)), summed over steps; and the peaks.
    sampling_blocks_shared: int = 0
    sampling_blocks_unshared: int = 0
    beam_blocks_shared: int = 0
    beam_blocks_unshared: int = 0
    peak_sampling_saved: int = 0
    peak_beam_saved: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens (samples, and every beam's token each step) per second of wall time
        since the first submission, not counting the first call of each step shape (compilation)."""
        t = self.wall_s - self.compile_s
        return self.generated_tokens / t if t > 0 else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.cache_hit_tokens / self.cache_query_tokens if self.cache_query_tokens else 0.0


@dataclasses.dataclass
class TableSnapshot:
    """The block tables of one request family at one step (for the block-table picture).

    Attributes:
      request_id, kind ("sample" or "beam"), step.
      labels: one per row ("sample 0", "beam 2", ...).
      blocks: per row, the physical block ids it holds, first block first.
      refs: per row, each block's reference count in the whole pool at that step.
      num_tokens: per row, tokens with a KV slot.
      saved_blocks: blocks saved by sharing at that step (unshared - shared).
    """

    request_id: object
    kind: str
    step: int
    labels: list[str]
    blocks: list[list[int]]
    refs: list[list[int]]
    num_tokens: list[int]
    saved_blocks: int


# ---------------------------------------------------------------------------- the engine
class ServingEngine:
    """A host scheduler around one jitted step (see the module docstring).

    Example::

        engine = ServingEngine(model, ServingConfig(ManagerConfig(num_blocks=64, block_size=16,
                                                                  max_seqs=16, max_blocks_per_seq=32)))
        reqs = [Request(tok.encode("The cow says"), SamplingParams(max_new_tokens=32, n=4,
                                                                   temperature=0.8), arrival=0),
                Request(tok.encode("Q: What do bees make?"), BeamParams(beam_width=4), arrival=3)]
        for out in engine.run(reqs):
            print(out.request_id, out.tokens[0], out.stats.preemptions)
        print(engine.stats().tokens_per_s)
    """

    def __init__(self, model, config: ServingConfig, *, seed: int = 0, mesh=None):
        """Args:
          model: an NNX module implementing ``models.protocol.PagedModel`` (``models.Llama``, or
            your own) or its ``(graphdef, state)`` split.
          config: the ``ServingConfig``.
          seed: the engine's sampling seed (with each request's seed, it fixes sampled tokens).
          mesh: a ``jax.sharding.Mesh`` with a "tp" axis (``models.sharding.make_mesh``) to run
            tensor-parallel: weights and KV pages are sharded over it (KV heads), the block-manager
            state and step inputs are replicated. None: one device.
        """
        if not isinstance(config, ServingConfig):
            raise ValueError(f"config must be a ServingConfig, got {type(config).__name__}")
        if not _is_int(seed) or not 0 <= seed < 2**31:
            raise ValueError(f"seed={seed!r} must be an int in [0, 2**31)")
        self.config = config
        mgr = config.manager
        self.manager = mgr
        graphdef, weights = _requests.split_model(model)
        # The model's facts (models.protocol): checked here, before anything is compiled.
        base_config = model_facts((graphdef, weights))
        pages = allocate_pages(page_spec(base_config, mgr.num_blocks, mgr.block_size))
        if mesh is None:
            self.graphdef, self.weights, self.model_config, self.pages = graphdef, weights, base_config, pages
        else:
            self.graphdef, self.weights, self.model_config, self.pages, mesh = _requests.place(
                (graphdef, weights), pages, mesh)
        self.mesh = mesh
        self.state, self.key = _requests.replicate_inputs(mesh, init_state(mgr), jax.random.key(seed))
        self.context = min(mgr.max_tokens_per_seq, self.model_config.max_positions)
        self.bytes_per_block = kv_bytes_per_block(base_config, mgr.block_size)
        self._admit_width = min(mgr.max_tokens_per_seq, -(-self.context // mgr.block_size) * mgr.block_size)
        self._waiting: collections.deque[_Family] = collections.deque()
        self._running: dict[int, _Family] = {}  # by seq
        self._free_rows: list[int] = list(range(mgr.max_seqs))
        self._row_owner: dict[int, tuple[_Family, int]] = {}
        self._pending: dict[int, int] = {}  # row -> token to feed next step
        self._results: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # beam row -> top (logprobs, ids)
        self._select: list[tuple[int, int]] = []  # (dst, parent) for the next step
        self._to_free: list[int] = []
        self._cohort: list[_CohortRow] = []
        self._chunk = 0
        self._chunk_end = 0
        self._num_free = mgr.num_blocks - 1
        self._submitted = 0
        self._finished: list[RequestOutput] = []
        self._stats = EngineStats()
        self._t_start: float | None = None
        self.step_count = 0
        self.snapshot: TableSnapshot | None = None
        self._seen_shapes: set = set()
        self._deltas: list[TokenDelta] | None = None  # collected only while run() streams

    # ------------------------------------------------------------------ submission
    def check(self, request: Request) -> None:
        """``ValueError`` when ``request`` can never run on this engine (the message names the
        value and the limit): a prompt token id outside ``[0, vocab_size)`` (e.g. "prompt token id
        259 at position 16 is out of range: ids must be in [0, vocab_size=259)"), a prompt longer
        than the context or the pool, EOS ids or ``top_k`` beyond the vocabulary, a family too wide
        or too large for the pool."""
        if not isinstance(request, Request):
            raise ValueError(f"expected a Request, got {type(request).__name__}")
        mgr, cfg = self.manager, self.config
        # Token ids outside the vocabulary would embed as garbage and poison the KV blocks (and
        # the prefix cache) other requests read: reject them with the id, position and limit.
        _requests.token_ids(request.prompt, vocab_size=self.model_config.vocab_size)
        n = len(request.prompt)
        if n > self.context:
            raise ValueError(
                f"prompt has {n} tokens, more than the {self.context} a sequence can hold (min of "
                f"max_blocks_per_seq x block_size = {mgr.max_tokens_per_seq} and the model's max_positions = "
                f"{self.model_config.max_positions})")
        need = mgr.blocks_for(n)
        if need > mgr.num_blocks - 1:
            raise ValueError(f"prompt has {n} tokens = {need} blocks; the pool has only {mgr.num_blocks - 1} "
                             f"allocatable blocks")
        w = request.width
        what = "beam_width" if request.is_beam else "n"
        if w > cfg.max_prefill_rows:
            raise ValueError(f"{what}={w} exceeds max_prefill_rows={cfg.max_prefill_rows} (rows one "
                             f"admission can re-admit after a preemption)")
        p = request.params
        for t in p.eos_token_ids:
            if t >= self.model_config.vocab_size:
                raise ValueError(f"eos token id {t} must be < vocab_size={self.model_config.vocab_size}")
        if isinstance(p, SamplingParams):
            check_vocab(p.eos_token_ids, p.top_k, self.model_config.vocab_size)
        else:
            c = w * (1 + max(len(p.eos_token_ids), 1))
            if c > cfg.top_candidates:
                raise ValueError(f"beam_width={w} with {len(p.eos_token_ids)} EOS ids needs {c} candidates per "
                                 f"row; top_candidates={cfg.top_candidates}")
            if c > self.model_config.vocab_size:
                raise ValueError(f"beam search needs {c} candidates; vocab_size={self.model_config.vocab_size}")
        # The whole family must fit the pool alone, even with no sharing, or preempting everything
        # else would still not let it finish.
        longest = min(n + self._budget(request) - 1, self.context)
        worst = w * mgr.blocks_for(longest)
        if worst > mgr.num_blocks - 1:
            raise ValueError(f"{what}={w} sequences of up to {longest} tokens need up to {worst} blocks; the pool "
                             f"has only {mgr.num_blocks - 1} allocatable blocks")

    def _budget(self, request: Request) -> int:
        return max(1, min(request.params.max_new_tokens, self.context - len(request.prompt) + 1))

    def submit(self, request: Request) -> object:
        """Queues ``request`` (at the back of the waiting queue); returns its id.

        Raises ``ValueError`` if it is invalid for this model (a token id outside ``[0, vocab_size)``)
        or can never fit (prompt longer than the context or the pool, ``n``/beam width too wide,
        its sequences larger than the pool); nothing is queued and the engine is unchanged.
        """
        self.check(request)
        if self._t_start is None:
            self._t_start = time.perf_counter()
        seq = self._submitted
        self._submitted += 1
        rid = seq if request.request_id is None else request.request_id
        fam = _Family(req=request, rid=rid, seq=seq, seed=seq if request.seed is None else request.seed,
                      budget=self._budget(request), t_submit=time.perf_counter())
        fam.stats.prompt_tokens = len(request.prompt)
        fam.stats.arrival_step = self.step_count
        if not request.is_beam:
            fam.samples = [_Sample() for _ in range(request.params.n)]
        self._waiting.append(fam)
        return rid

    def reject(self, request: Request, error: str) -> RequestOutput:
        """The output of a request that was not accepted (counted in the statistics)."""
        self._stats.rejected += 1
        rid = request.request_id
        return RequestOutput(request_id=rid, request=request, tokens=[], logprobs=None, scores=None,
                             finish_reasons=[], stats=RequestStats(prompt_tokens=len(request.prompt),
                                                                   arrival_step=self.step_count), error=error)

    @property
    def idle(self) -> bool:
        """No request is waiting or running."""
        return not self._waiting and not self._running

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by running sequences after the last step (host copy; no device read)."""
        return self.manager.num_blocks - 1 - self._num_free

    @property
    def preemptions(self) -> int:
        return self._stats.preemptions

    # ------------------------------------------------------------------ admission
    def _admission_rows(self, fam: _Family) -> list[tuple[int, list[int], list[int]]]:
        """(index, tokens, fork targets) per row to admit: one row for a new request, one per
        unfinished sample / beam for a preempted one."""
        p = list(fam.req.prompt)
        if fam.req.is_beam:
            if not fam.beams:
                return [(0, p, [])]
            return [(i, p + b.tokens, []) for i, b in enumerate(fam.beams)]
        if all(not s.tokens for s in fam.samples):
            return [(0, p, [])]
        return [(i, p + s.tokens, []) for i, s in enumerate(fam.samples) if s.finish is None]

    def _rows_needed(self, fam: _Family, entries) -> int:
        if fam.req.is_beam:
            return fam.width
        return len(entries) if any(s.tokens for s in fam.samples) else fam.width

    def _try_admit(self) -> None:
        if self._cohort or not self._waiting:
            return
        mgr, cfg = self.manager, self.config
        running_rows = sum(len(f.rows) for f in self._running.values())
        budget = self._num_free - running_rows
        rows_left = len(self._free_rows)
        picked: list[tuple[_Family, list]] = []
        n_rows = blocks = 0
        for fam in self._waiting:
            entries = self._admission_rows(fam)
            need_rows = self._rows_needed(fam, entries)
            need_blocks = sum(mgr.blocks_for(len(t)) for _, t, _ in entries)
            if (n_rows + need_rows > rows_left or len(entries) + sum(len(e) for _, e in picked) > cfg.max_prefill_rows
                    or blocks + need_blocks > budget):
                if not picked and not self._running:
                    # Nothing else runs: try the head anyway (prefix-cache hits may make it fit).
                    if n_rows + need_rows <= rows_left:
                        picked.append((fam, entries))
                break
            picked.append((fam, entries))
            n_rows += need_rows
            blocks += need_blocks
        if not picked:
            return
        # Rows for each family; the admitted row of a new family is its first row.
        plan = []  # (family, row, index, tokens)
        fam_rows: dict[int, list[int]] = {}
        for fam, entries in picked:
            rows = [self._free_rows.pop(0) for _ in range(self._rows_needed(fam, entries))]
            fam_rows[fam.seq] = rows
            for j, (idx, toks, _) in enumerate(entries):
                plan.append((fam, rows[j], idx, toks))
        # Fixed shapes (every admission compiles once): max_prefill_rows prompts of the context.
        a = cfg.max_prefill_rows
        width = self._admit_width
        ids = np.full((a,), -1, np.int32)
        lens = np.zeros((a,), np.int32)
        toks = np.zeros((a, width), np.int32)
        salts = np.zeros((a,), np.uint32)
        for i, (fam, row, _, t) in enumerate(plan):
            ids[i], lens[i], salts[i] = row, len(t), fam.req.salt
            toks[i, :len(t)] = t
        free_ids = self._take_frees()
        t0 = time.perf_counter()
        args = _requests.replicate_inputs(self.mesh, free_ids, ids, lens, toks, salts)
        self.state, res, num_free = _admit_jit(mgr, self.state, *args)
        status, cached, shared, num_free = jax.device_get((res.status, res.cached_tokens, res.shared_tokens,
                                                           num_free))
        self._note_compile(("admit", a, width), t0)
        self._num_free = int(num_free)
        failed = {fam.seq for i, (fam, *_) in enumerate(plan) if status[i] != Status.OK}
        # Admission is first come, first served: once a prompt fails, every later one fails, but
        # the first rows of a re-admitted family may already be in. Such a family goes back to the
        # queue; its admitted rows are still prefilled (``admit`` cached their full blocks, which
        # must not stay cached without their K/V), then freed: a later re-admission hits them.
        cohort = []
        kept_rows = set()
        for i, (fam, row, idx, t) in enumerate(plan):
            if status[i] != Status.OK:
                continue
            start = int(cached[i]) + int(shared[i])
            if fam.seq in failed:
                kept_rows.add(row)
                cohort.append(_CohortRow(row=row, family=fam, index=idx, tokens=np.asarray(t, np.int32),
                                         start=min(start, len(t) - 1), fork_to=[], discard=True))
                continue
            fam.stats.cached_prompt_tokens += int(cached[i])
            fam.stats.shared_prompt_tokens += int(shared[i])
            new_n = (not fam.req.is_beam) and all(not s.tokens for s in fam.samples)
            fork_to = fam_rows[fam.seq][1:] if new_n else []
            cohort.append(_CohortRow(row=row, family=fam, index=idx, tokens=np.asarray(t, np.int32),
                                     start=min(start, len(t) - 1), fork_to=fork_to))
        for fam, _ in picked:
            if fam.seq in failed:
                self._free_rows.extend(r for r in fam_rows[fam.seq] if r not in kept_rows)
                continue
            self._waiting.remove(fam)
            fam.phase = _Phase.RUNNING
            fam.rows = fam_rows[fam.seq]
            fam.stats.admissions += 1
            self._stats.admissions += 1
            self._running[fam.seq] = fam
            for j, row in enumerate(fam.rows):
                self._row_owner[row] = (fam, j)
        self._free_rows.sort()
        for c in cohort:
            if c.discard:
                continue
            c.family.prefilling.add(c.row)
            if c.family.req.is_beam:
                b = c.family.beams[c.index] if c.family.beams else None
                if b is not None:
                    b.row = c.row
            else:
                c.family.samples[c.index].row = c.row
                for j, dst in enumerate(c.fork_to, start=1):  # forked when the prefill ends
                    c.family.samples[j].row = dst
        if not cohort and not self._running:
            # Even alone the head did not fit: it never will (check() should have caught it).
            fam = self._waiting.popleft()
            self._finished.append(self.reject(fam.req, "request does not fit the block pool"))
        self._cohort = cohort
        if cohort:
            size = self.config.chunk_size
            self._chunk = min(c.start for c in cohort) // size
            self._chunk_end = -(-max(len(c.tokens) for c in cohort) // size)

    def _take_frees(self) -> np.ndarray:
        r = self.manager.max_seqs
        ids = np.full((r,), -1, np.int32)
        ids[:len(self._to_free)] = self._to_free
        self._to_free = []
        return ids

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: admit if possible, run one jitted step, process its results
        (sample / beam bookkeeping, finishing, preemption). Returns the requests that finished."""
        t0 = time.perf_counter()
        if self._t_start is None:
            self._t_start = t0
        self._try_admit()
        cfg = self.config
        has_work = bool(self._cohort or self._pending)
        if not has_work:
            if self._to_free:
                (free_ids,) = _requests.replicate_inputs(self.mesh, self._take_frees())
                self.state, num_free = _free_jit(self.manager, self.state, free_ids)
                self._num_free = int(num_free)
            self._refresh_cache_stats()
            return self._drain(t0)
        inp, pf = self._inputs()
        shape = _StepShape(cfg, len(pf[0]) if pf else 0, self.mesh)
        if self.mesh is not None:
            (inp,) = _requests.replicate_inputs(self.mesh, inp)
        t1 = time.perf_counter()
        self.pages, self.state, out = _step_jit(self.graphdef, self.weights, self.pages, self.state, self.key,
                                                inp, shape=shape)
        out = jax.device_get(out)
        self._note_compile(("step", shape.prefill_rows), t1)
        self.step_count += 1
        st = self._stats
        st.steps += 1
        st.copies += int(out.copies)
        st.bad_tokens += int(out.bad_tokens)
        self._num_free = int(out.num_free)
        st.peak_blocks_used = max(st.peak_blocks_used, self.manager.num_blocks - 1 - self._num_free)
        self._process(out, pf)
        if cfg.record_tables:
            self._record_sharing(out)
        return self._drain(t0)

    def _note_compile(self, key, t0: float) -> None:
        # The first call of each shape compiles: its time is reported apart from the throughput.
        if key not in self._seen_shapes:
            self._seen_shapes.add(key)
            self._stats.compile_s += time.perf_counter() - t0

    def _drain(self, t0: float) -> list[RequestOutput]:
        now = time.perf_counter()
        self._stats.step_s += now - t0
        if self._t_start is not None:
            self._stats.wall_s = now - self._t_start
        done, self._finished = self._finished, []
        return done

    def _inputs(self):
        r, cfg = self.manager.max_seqs, self.config
        i32 = lambda fill=-1: np.full((r,), fill, np.int32)  # noqa: E731
        free_ids = self._take_frees()
        sel_dst, sel_parent = i32(), i32()
        for i, (d, p) in enumerate(self._select):
            sel_dst[i], sel_parent[i] = d, p
        self._select = []
        dec_tokens, dec_live = i32(0), np.zeros((r,), bool)
        for row, tok in self._pending.items():
            dec_tokens[row], dec_live[row] = tok, True
        fork_src, fork_dst, logit_src = i32(), i32(), np.arange(r, dtype=np.int32)
        temperature, top_p = np.zeros((r,), np.float32), np.ones((r,), np.float32)
        top_k, seed, sample_idx, token_idx = i32(0), i32(0), i32(0), i32(0)
        pf = None
        if self._cohort:
            c, size = self._chunk, cfg.chunk_size
            rows_, toks_, start_, lens_, ends = [], [], [], [], []
            nf = 0
            for cr in self._cohort:
                n = len(cr.tokens)
                lo = max(c * size, cr.start)
                q = max(0, min((c + 1) * size, n) - lo) if lo < n else 0
                chunk = np.zeros((size,), np.int32)
                chunk[:q] = cr.tokens[lo:lo + q]
                rows_.append(cr.row if q > 0 else -1)
                toks_.append(chunk)
                start_.append(min(lo, n))
                lens_.append(q)
                end = q > 0 and lo + q == n
                ends.append(end)
                if end:
                    for dst in cr.fork_to:
                        fork_src[nf], fork_dst[nf] = cr.row, dst
                        logit_src[dst] = cr.row
                        nf += 1
            pad = cfg.max_prefill_rows - len(rows_)
            pf = (np.array(rows_ + [-1] * pad, np.int32),
                  np.stack(toks_ + [np.zeros((size,), np.int32)] * pad),
                  np.array(start_ + [0] * pad, np.int32), np.array(lens_ + [0] * pad, np.int32), ends)
        # Per-row sampling parameters and key parts.
        for fam in self._running.values():
            if fam.req.is_beam:
                continue
            prm = fam.req.params
            for idx, s in enumerate(fam.samples):
                rows = [s.row] if s.row is not None else []
                for row in rows:
                    temperature[row], top_k[row], top_p[row] = prm.temperature, prm.top_k, prm.top_p
                    seed[row], sample_idx[row], token_idx[row] = fam.seed, idx, len(s.tokens)
        pf_arrays = pf[:4] if pf else (np.full((1,), -1, np.int32), np.zeros((1, cfg.chunk_size), np.int32),
                                       np.zeros((1,), np.int32), np.zeros((1,), np.int32))
        inp = StepInputs(free_ids=free_ids, sel_dst=sel_dst, sel_parent=sel_parent, pf_rows=pf_arrays[0],
                         pf_tokens=pf_arrays[1], pf_start=pf_arrays[2], pf_lens=pf_arrays[3], dec_tokens=dec_tokens,
                         dec_live=dec_live, fork_src=fork_src, fork_dst=fork_dst, logit_src=logit_src,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, sample_idx=sample_idx,
                         token_idx=token_idx)
        return inp, pf

    # ------------------------------------------------------------------ results
    def _process(self, out: StepOutputs, pf) -> None:
        now = time.perf_counter()
        st = self._stats
        produced: list[int] = []  # rows whose logits are valid this step
        # Decoding rows.
        failed = []
        for row in list(self._pending):
            if out.status[row] == Status.OK:
                del self._pending[row]
                produced.append(row)
            elif out.status[row] == Status.TABLE_FULL:  # cannot happen within the budget; end the row
                del self._pending[row]
                fam, _ = self._row_owner[row]
                self._end_row_table_full(fam, row)
            else:
                failed.append(row)
        # Rows whose prefill ended.
        if pf is not None:
            st.prefill_steps += 1
            st.prefill_tokens += int(np.sum(pf[3]))
            ends = pf[4]
            for cr, end in zip(list(self._cohort), ends):
                if not end:
                    continue
                if cr.discard:
                    self._to_free.append(cr.row)
                    self._free_rows.append(cr.row)
                    self._free_rows.sort()
                    continue
                produced.append(cr.row)
                produced.extend(cr.fork_to)
                cr.family.prefilling.discard(cr.row)
            self._chunk += 1
            if self._chunk >= self._chunk_end:
                self._cohort = []
        beam_fams = {}
        for row in produced:
            owner = self._row_owner.get(row)
            if owner is None or owner[0].phase is not _Phase.RUNNING:
                continue  # released while processing this step (its request ended)
            fam = owner[0]
            if fam.req.is_beam:
                self._results[row] = (out.top_logprobs[row], out.top_ids[row])
                beam_fams[fam.seq] = fam
            else:
                self._emit_sample(fam, row, int(out.tokens[row]), float(out.logprobs[row]), now)
        for fam in beam_fams.values():
            self._maybe_choose(fam, now)
        if failed:
            self._preempt_newest()

    def _first_token(self, fam: _Family, now: float) -> None:
        if fam.stats.first_token_step is None:
            fam.stats.first_token_step = self.step_count
            fam.stats.time_to_first_token_s = now - fam.t_submit

    def _emit_sample(self, fam: _Family, row: int, tok: int, logp: float, now: float) -> None:
        s = next(s for s in fam.samples if s.row == row)
        self._first_token(fam, now)
        s.tokens.append(tok)
        s.logprobs.append(logp)
        self._stats.generated_tokens += 1
        eos = tok in fam.req.params.eos_token_ids
        if eos or len(s.tokens) >= fam.budget:
            s.finish = "eos" if eos else "length"
            s.row = None
            self._stream_sample(fam, s)
            self._release_row(fam, row)
            if all(x.finish is not None for x in fam.samples):
                self._finish(fam, now)
        else:
            self._stream_sample(fam, s)
            self._pending[row] = tok

    def _stream_sample(self, fam: _Family, s: _Sample) -> None:
        """Queue the sample's tokens not yet streamed (with its finish reason once it ended)."""
        if self._deltas is None:
            return
        new = tuple(s.tokens[s.streamed:])
        if new or s.finish is not None:
            self._deltas.append(TokenDelta(fam.rid, fam.samples.index(s), new, s.finish))
            s.streamed = len(s.tokens)

    def _end_row_table_full(self, fam: _Family, row: int) -> None:
        now = time.perf_counter()
        if fam.req.is_beam:
            self._finish_beams(fam, now, final=True)
            return
        s = next(s for s in fam.samples if s.row == row)
        s.finish, s.row = "length", None
        self._stream_sample(fam, s)
        self._release_row(fam, row)
        if all(x.finish is not None for x in fam.samples):
            self._finish(fam, now)

    def _release_row(self, fam: _Family, row: int) -> None:
        self._to_free.append(row)
        self._pending.pop(row, None)
        self._results.pop(row, None)
        self._row_owner.pop(row, None)
        if row in fam.rows:
            fam.rows.remove(row)
        self._free_rows.append(row)
        self._free_rows.sort()

    # -- beam search (host side; the algorithm of engine.beam_search) -------------------------
    def _maybe_choose(self, fam: _Family, now: float) -> None:
        p: BeamParams = fam.req.params
        k = p.beam_width
        live = fam.beams if fam.beams else [_Beam(tokens=[], score=0.0, row=fam.rows[0])]
        if any(b.row not in self._results for b in live):
            return  # some beam still waits for its forward (prefill or a retried append)
        self._first_token(fam, now)
        v = self.model_config.vocab_size
        cands = []
        for i, b in enumerate(live):
            lp, ids = self._results.pop(b.row)
            for val, tok in zip(lp.tolist(), ids.tolist()):
                if math.isfinite(val):
                    cands.append((b.score + val, i, int(tok)))
        cands.sort(key=lambda c: (-c[0], c[1] * v + c[2]))
        c = k * (1 + max(len(p.eos_token_ids), 1))
        cands = cands[:c]
        length = len(live[0].tokens) + 1
        eos_ids = set(p.eos_token_ids)
        finished = [(val, live[i].tokens + [tok], length) for rank, (val, i, tok) in enumerate(cands)
                    if tok in eos_ids and rank < k]
        keep = [(val, i, tok) for val, i, tok in cands if tok not in eos_ids][:k]
        if length >= fam.budget:
            finished += [(val, live[i].tokens + [tok], length) for val, i, tok in keep]
        self._merge_pool(fam, finished, p.length_penalty)
        self._stats.generated_tokens += len(keep)
        if length >= fam.budget or len(fam.pool) >= k or len(keep) < k:
            fam.beams = [_Beam(live[i].tokens + [tok], val) for val, i, tok in keep]
            self._finish_beams(fam, now, final=False)
            return
        # New beams take rows: beam j -> fam.rows[j]; its table is its parent's (select next step).
        parents = [live[i].row for _, i, _ in keep]
        fam.beams = [_Beam(live[i].tokens + [tok], val, row=fam.rows[j]) for j, (val, i, tok) in enumerate(keep)]
        for j, b in enumerate(fam.beams):
            self._select.append((b.row, parents[j]))
            self._pending[b.row] = b.tokens[-1]

    @staticmethod
    def _merge_pool(fam: _Family, finished, penalty: float) -> None:
        k = fam.req.params.beam_width
        entries = list(fam.pool)
        for total, toks, length in finished:
            entries.append((total / max(length, 1) ** penalty, total, toks, length))
        entries.sort(key=lambda e: -e[0])  # stable: earlier entries first on ties
        fam.pool = entries[:k]

    def _finish_beams(self, fam: _Family, now: float, *, final: bool) -> None:
        if final:  # out of table: the live beams are hypotheses of their current length
            p = fam.req.params
            self._merge_pool(fam, [(b.score, b.tokens, len(b.tokens)) for b in fam.beams if b.tokens],
                             p.length_penalty)
        for row in list(fam.rows):
            self._release_row(fam, row)
        self._finish(fam, now)

    # -- finishing and preemption ---------------------------------------------------------
    def _finish(self, fam: _Family, now: float) -> None:
        for row in list(fam.rows):  # reserved rows never used (a sample family finishing early)
            self._release_row(fam, row)
        fam.phase = _Phase.DONE
        self._running.pop(fam.seq, None)
        fam.stats.finish_step = self.step_count
        fam.stats.latency_s = now - fam.t_submit
        self._stats.finished += 1
        if fam.req.is_beam:
            eos = set(fam.req.params.eos_token_ids)
            tokens = [list(t) for _, _, t, _ in fam.pool]
            out = RequestOutput(request_id=fam.rid, request=fam.req, tokens=tokens, logprobs=None,
                                scores=[float(s) for s, *_ in fam.pool],
                                finish_reasons=["eos" if t and t[-1] in eos else "length" for t in tokens],
                                stats=fam.stats)
        else:
            out = RequestOutput(request_id=fam.rid, request=fam.req, tokens=[list(s.tokens) for s in fam.samples],
                                logprobs=[list(s.logprobs) for s in fam.samples], scores=None,
                                finish_reasons=[s.finish for s in fam.samples], stats=fam.stats)
        out.stats.generated_tokens = sum(len(t) for t in out.tokens)
        if self._deltas is not None and fam.req.is_beam:
            self._deltas.extend(TokenDelta(fam.rid, j, tuple(t), reason)
                                for j, (t, reason) in enumerate(zip(out.tokens, out.finish_reasons)))
        self._finished.append(out)

    def _preempt_newest(self) -> None:
        """Preempt the newest running request that is not in the middle of its prefill."""
        cands = [f for f in self._running.values() if not f.prefilling]
        if not cands:
            return
        fam = max(cands, key=lambda f: f.seq)
        for row in list(fam.rows):
            self._release_row(fam, row)
        for s in fam.samples:
            s.row = None
        for b in fam.beams:
            b.row = None
        self._select = [(d, p) for d, p in self._select if self._row_owner.get(d, (None,))[0] is not None]
        fam.phase = _Phase.WAITING
        fam.stats.preemptions += 1
        self._stats.preemptions += 1
        self._running.pop(fam.seq)
        # Front of the queue, but behind older preempted requests already there.
        i = 0
        while i < len(self._waiting) and self._waiting[i].stats.preemptions > 0 and self._waiting[i].seq < fam.seq:
            i += 1
        self._waiting.insert(i, fam)

    # ------------------------------------------------------------------ statistics
    def _record_sharing(self, out: StepOutputs) -> None:
        bs = self.manager.block_size
        st = self._stats
        for fam in self._running.values():
            if fam.width < 2:
                continue
            rows = [r for r in fam.rows if r not in fam.prefilling and int(out.num_tokens[r]) > 0]
            if len(rows) < 2:
                continue
            held = {r: -(-int(out.num_tokens[r]) // bs) for r in rows}
            unshared = sum(held.values())
            blocks = {int(b) for r in rows for b in out.tables[r, :held[r]]}
            shared = len(blocks)
            saved = unshared - shared
            if fam.req.is_beam:
                st.beam_blocks_shared += shared
                st.beam_blocks_unshared += unshared
                st.peak_beam_saved = max(st.peak_beam_saved, saved)
            else:
                st.sampling_blocks_shared += shared
                st.sampling_blocks_unshared += unshared
                st.peak_sampling_saved = max(st.peak_sampling_saved, saved)
            if self.snapshot is None or saved > self.snapshot.saved_blocks:
                kind = "beam" if fam.req.is_beam else "sample"
                labels = []
                for r in rows:
                    _, j = self._row_owner[r]
                    labels.append(f"{kind} {j}")
                self.snapshot = TableSnapshot(
                    request_id=fam.rid, kind=kind, step=self.step_count, labels=labels,
                    blocks=[out.tables[r, :held[r]].tolist() for r in rows],
                    refs=[out.refs[r, :held[r]].tolist() for r in rows],
                    num_tokens=[int(out.num_tokens[r]) for r in rows], saved_blocks=saved)

    def _refresh_cache_stats(self) -> None:
        cs = jax.device_get(self.state.cache.stats)
        st = self._stats
        st.cache_lookups, st.cache_query_tokens = int(cs.lookups), int(cs.query_tokens)
        st.cache_hit_tokens, st.cache_evictions = int(cs.hit_tokens), int(cs.evictions)

    def stats(self) -> EngineStats:
        """Engine statistics so far (prefix-cache counters read from the state)."""
        self._refresh_cache_stats()
        return dataclasses.replace(self._stats)

    # ------------------------------------------------------------------ the loop
    def run(self, requests: Iterable[Request], arrivals: Sequence[int] | None = None, *,
            max_steps: int | None = None,
            on_step: Callable[["ServingEngine"], None] | None = None,
            on_token: Callable[[TokenDelta], None] | None = None) -> Iterator[RequestOutput]:
        """Submits each request when ``step_count`` reaches its arrival step and steps until every
        request has finished; yields outputs as they finish (rejected requests: an output with
        ``error`` set, when they arrive). When nothing runs, the clock jumps to the next arrival.

        Args:
          requests: the workload (any order; submitted by arrival, ties in the given order).
          arrivals: arrival step per request (default: each request's ``arrival``).
          max_steps: stop after this many steps (``RuntimeError`` if work is left).
          on_step: called after each step (progress reporting).
          on_token: streaming: called with each ``TokenDelta`` of a step (module docstring), after
            the step and before the outputs of the requests it finished are yielded.

        The arguments are checked when ``run`` is called, before any step: ``ValueError`` naming
        the bad value (requests that are not ``Request`` objects, arrivals that are not ints >= 0
        or not one per request, ``max_steps`` not an int >= 1, ``on_step`` not callable).
        """
        def shown(v) -> str:
            text = "None" if v is None else f"{type(v).__name__} {v!r}"
            return text if len(text) <= 70 else text[:67] + "..."

        def listed(values, name: str, of: str) -> list:
            if values is None or isinstance(values, (str, bytes, dict, Request)) or not hasattr(values, "__iter__"):
                raise ValueError(f"run: {name} must be a sequence of {of}, got {shown(values)}")
            try:
                return list(values)
            except TypeError as e:  # a 0-d array, say
                raise ValueError(f"run: {name} must be a sequence of {of}, got {shown(values)} ({e})") from None

        requests = listed(requests, "requests", "Request objects")
        for i, q in enumerate(requests):
            if not isinstance(q, Request):
                raise ValueError(f"run: requests[{i}] is {shown(q)}, not a Request")
        if arrivals is not None:
            arrivals = listed(arrivals, "arrivals", "ints >= 0 (one arrival step per request)")
            if len(arrivals) != len(requests):
                raise ValueError(f"run: {len(arrivals)} arrival steps for {len(requests)} requests")
            for i, a in enumerate(arrivals):
                if not _is_int(a) or a < 0:
                    raise ValueError(f"run: arrivals[{i}] is {shown(a)}; arrival steps are ints >= 0")
            requests = [dataclasses.replace(q, arrival=int(a)) for q, a in zip(requests, arrivals)]
        if max_steps is not None and (not _is_int(max_steps) or max_steps < 1):
            raise ValueError(f"run: max_steps is {shown(max_steps)}; it must be None or an int >= 1")
        if on_step is not None and not callable(on_step):
            raise ValueError(f"run: on_step is {shown(on_step)}; it must be None or a callable taking the engine")
        if on_token is not None and not callable(on_token):
            raise ValueError(f"run: on_token is {shown(on_token)}; it must be None or a callable taking a TokenDelta")

        def stepped() -> list[RequestOutput]:
            done = self.step()
            if on_token is not None:
                deltas, self._deltas = self._deltas, []
                for d in deltas:
                    on_token(d)
            return done

        def serve() -> Iterator[RequestOutput]:
            if on_token is not None:
                self._deltas = []
            try:
                yield from loop()
            finally:
                self._deltas = None

        def loop() -> Iterator[RequestOutput]:
            pending = collections.deque(sorted(requests, key=lambda q: q.arrival))
            start = self.step_count
            while pending or not self.idle:
                while pending and pending[0].arrival <= self.step_count:
                    req = pending.popleft()
                    try:
                        self.submit(req)
                    except ValueError as e:
                        yield self.reject(req, str(e))
                if self.idle:
                    if pending:
                        self.step_count = pending[0].arrival  # nothing to do until then
                    continue
                yield from stepped()
                if on_step is not None:
                    on_step(self)
                if max_steps is not None and self.step_count - start >= max_steps:
                    raise RuntimeError(f"run: {max_steps} steps done and requests are left "
                                       f"({self.num_waiting} waiting, {self.num_running} running)")
            yield from stepped()  # flush frees

        return serve()


__all__ = ["EngineStats", "Request", "RequestOutput", "RequestStats", "ServingConfig", "ServingEngine",
           "StepInputs", "StepOutputs", "TableSnapshot", "TokenDelta"]
