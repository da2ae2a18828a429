"""The serving engine's public value types: its configuration, requests, their outputs and
statistics, streamed token deltas and the block-table snapshot.

Host-only (no jax): ``ServingConfig`` (static, hashable: part of the step's jit key), ``Request``
(checked on construction), ``RequestOutput`` / ``RequestStats`` (what a finished request returns),
``TokenDelta`` (streaming), ``EngineStats`` (engine-wide counters) and ``TableSnapshot`` (the
block tables of one family at one step, for the block-table picture).
"""

from __future__ import annotations

import dataclasses

from paged_kv.config import ManagerConfig
from paged_kv.engine import call_setup
from paged_kv.engine.sampling import BeamParams, SamplingParams
from paged_kv.inputs import is_int
from paged_kv.models.page_sizing import resolve_kv_dtype
from paged_kv.pallas_kernels import IMPLS
from paged_kv.pallas_kernels.plan import ExecutionPlan, check_early, make_plan

MAX_DECODE_STEPS = 256  # a burst's outputs are K steps' worth; this bounds that buffer
# The defaults ``ServingConfig`` resolves when a value is left None (docs/benchmarks.md,
# "Serving engine against the on-device loop", has the measurements behind them).
DEFAULT_CHUNK_SIZE = 16  # C: short prompts pad little; a long one takes several of a step's P rows
PREFILL_TOKENS = 4096  # P * C at most: a step's chunk batch when a whole burst of arrivals prefills
DEFAULT_DECODE_STEPS = 16  # K: decode steps per device call while nothing needs the host

FINISH_REASONS = ("eos", "length", "length_capped", "aborted")
"""Why a sample or beam hypothesis of a serving request ended (``RequestOutput.finish_reasons``,
``TokenDelta.finish_reason``)."""


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """Static configuration of a ``ServingEngine`` (hashable: part of the step's jit key).

    Attributes:
      manager: the block manager's config; ``max_seqs`` is the batch ``R`` of every step.
      chunk_size: prefill positions per piece (the ``C`` of the ``[P, C]`` prefill batch); a
        prompt longer than ``C`` takes several of a step's ``P`` rows while rows are free
        (``serving_step.prefill_pieces``). None (the default): 16.
      max_prefill_rows: prompts per admission (cohort) at most: the ``P`` of the prefill batch
        of a step that runs a chunk (0 otherwise), and the shape of every ``admit`` call. Also the
        widest ``n`` / beam width a request may have (a preempted one is re-admitted as a unit).
        At most ``manager.max_seqs``; None (the default): ``min(manager.max_seqs, 4096 // C)``,
        so that a burst of arrivals filling every row is prefilled in one cohort. On a CPU a
        step's chunk forward runs on the fewest rows of a ladder of widths (8, 32, 128, ... up to
        ``P``) that holds its pieces (``serving_step.prefill_widths``), so a wide ``P`` costs a
        lone late arrival little.
      top_candidates: log-probabilities returned per row for beam search; a beam request needs
        ``k * (1 + max(#EOS ids, 1)) <= top_candidates``.
      impl: kernel implementation (``"auto"``, ``"pallas"``, ``"interpret"``, ``"reference"``).
      record_tables: read the block tables back every step (sharing statistics, the block-table
        picture); costs one ``[R, max_blocks_per_seq]`` transfer per step.
      decode_steps: decode steps one device call may run (``K``; 1: one step per call; None,
        the default: 16). With
        ``K > 1`` a call runs up to ``K`` steps while nothing needs the host between them: no
        prompt is being prefilled, no beam runs, every row's blocks for ``K`` more
        tokens are free, and the next arrival of ``run`` is at least ``K`` steps away (with
        requests waiting for rows, a burst also ends after a step in which a row finished). Rows stop
        on the device at an EOS id or their token budget; the host then processes each step's
        outputs as if they had come one call at a time (same tokens, log-probs and statistics
        per step; a finished row's blocks are freed at the next call instead of the next step).
        Saves the host's per-step work and a dispatch per step; streaming arrives up to ``K``
        tokens at a time (``run`` never runs a burst past the next arrival).
      batch_invariant: every request's tokens and log-probs the same bits whatever its
        batchmates, row, ``max_seqs``, chunking, prefix-cache hits and preemptions, equal to
        ``generate``'s in the same mode and to ``paged_kv.models.contiguous.score_tokens``
        (docs/batch_invariance.md). On the reference and the Pallas kernels alike, on one device
        or a tensor-parallel mesh; not with ``kv_dtype`` int8 / fp8. Costs decode throughput
        (``scripts/bench_batch_invariant.py``).
      kv_dtype: the KV pages' storage dtype: ``"auto"`` (the model's dtype), ``"int8"`` or
        ``"fp8"`` (``"float8_e4m3fn"``): quantized pages (``paged_kv.pallas_kernels.QuantPages``,
        one float32 scale per token and KV head) hold about twice the blocks of bfloat16 pages in
        the same bytes; attention still computes in the model's dtype. Not with
        ``batch_invariant``; fp8 needs compute capability >= 8.9 on the Pallas kernels.
    """

    manager: ManagerConfig
    chunk_size: int | None = None
    max_prefill_rows: int | None = None
    top_candidates: int = 8
    impl: str = "auto"
    record_tables: bool = True
    decode_steps: int | None = None
    batch_invariant: bool = False
    kv_dtype: str = "auto"

    def __post_init__(self):
        if not isinstance(self.manager, ManagerConfig):
            raise ValueError(f"manager must be a ManagerConfig, got {type(self.manager).__name__}")
        # None resolves here, once: the config (a jit key) and everything reporting it hold the
        # values used (``EngineStats``, the CLI's report), never "auto".
        if self.chunk_size is None:
            object.__setattr__(self, "chunk_size", DEFAULT_CHUNK_SIZE)
        if self.decode_steps is None:
            object.__setattr__(self, "decode_steps", DEFAULT_DECODE_STEPS)
        for name, lo in (("chunk_size", 1), ("max_prefill_rows", 1), ("top_candidates", 2), ("decode_steps", 1)):
            v = getattr(self, name)
            if name == "max_prefill_rows" and v is None:
                v = max(1, min(self.manager.max_seqs, PREFILL_TOKENS // self.chunk_size))
                object.__setattr__(self, name, v)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r} must be an int >= {lo}")
        if self.decode_steps > MAX_DECODE_STEPS:
            raise ValueError(f"decode_steps={self.decode_steps} must be <= {MAX_DECODE_STEPS}")
        if self.max_prefill_rows > self.manager.max_seqs:
            raise ValueError(f"max_prefill_rows={self.max_prefill_rows} must be <= manager.max_seqs="
                             f"{self.manager.max_seqs}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} must be one of {IMPLS}")
        for name in ("record_tables", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        if not isinstance(self.kv_dtype, str):
            raise ValueError(f"kv_dtype={self.kv_dtype!r} must be a string: 'auto', 'int8' or 'fp8'")
        # The execution plan's refusals, before anything is built; those that need JAX's backend
        # (which the command line starts after building this config) follow in `plan`.
        check_early(self.impl, batch_invariant=self.batch_invariant,
                    kv_dtype=resolve_kv_dtype(self.kv_dtype, "float32"), block_size=self.manager.block_size)

    @property
    def plan(self) -> ExecutionPlan:
        """The execution plan of this configuration (``paged_kv.pallas_kernels.plan.make_plan``):
        ``impl``, ``batch_invariant``, the KV dtype and the manager's block size. ``ValueError`` for
        a combination the plan's table refuses."""
        return make_plan(self.impl, batch_invariant=self.batch_invariant,
                         kv_dtype=resolve_kv_dtype(self.kv_dtype, "float32"), block_size=self.manager.block_size)


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
      request_id: any hashable label (default: the submission number). An engine refuses a
        request whose id equals that of one it has not finished yet (``ServingEngine.submit``).
      seed: sampling seed in ``[0, 2**31)``: it alone fixes the sampled tokens (with the model,
        prompt and parameters), whatever the engine's seed, batch or submission order. Default:
        ``sampling.default_seed(engine seed, request id)``; ``RequestOutput.seed`` records it.
    """

    prompt: tuple[int, ...]
    params: SamplingParams | BeamParams = SamplingParams()
    salt: int = 0
    arrival: int = 0
    request_id: object = None
    seed: int | None = None

    def __post_init__(self):
        # Vectorised checks (no per-token Python loop): ints, not bools or floats, in [0, 2**31).
        object.__setattr__(self, "prompt", tuple(call_setup.token_ids(self.prompt).tolist()))
        if not isinstance(self.params, (SamplingParams, BeamParams)):
            raise ValueError(f"params must be SamplingParams or BeamParams, got {type(self.params).__name__}")
        if not is_int(self.salt) or not 0 <= self.salt < 2**32:
            raise ValueError(f"salt={self.salt!r} must be an int in [0, 2**32)")
        if not is_int(self.arrival) or self.arrival < 0:
            raise ValueError(f"arrival={self.arrival!r} must be an int >= 0")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**31):
            raise ValueError(f"seed={self.seed!r} must be None or an int in [0, 2**31)")
        try:  # the engine keys its live requests by id (duplicates, ``abort``)
            hash(self.request_id)
        except TypeError:
            raise ValueError(f"request_id={self.request_id!r} must be hashable") from None

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
    """A finished, aborted (``ServingEngine.abort``: its finish reasons say ``"aborted"``) or
    rejected (``rejected`` True, ``error`` set) request.

    Attributes:
      request_id: the request's id. A rejected request keeps the id it was submitted with, which
        may be that of a live request (a duplicate id, refused): ``run`` yields the rejection when
        the duplicate arrives, before the live request's own output, and ``rejected`` tells the
        two apart (``{o.request_id: o for o in outputs if not o.rejected}``).
      request: the request itself.
      tokens: generated tokens: ``n`` samples in sample order, or the beam hypotheses best first.
      logprobs: per sample, each token's log-probability under the model (sampling), or None.
      scores: per beam hypothesis, ``sum_logprobs / length ** length_penalty``, or None.
      finish_reasons: per sample / hypothesis, one of ``FINISH_REASONS``: ``"eos"``, ``"length"``
        (``max_new_tokens`` reached), ``"length_capped"`` (stopped earlier, at the last position a
        sequence holds: prompt + ``max_new_tokens`` ran past the context) or ``"aborted"``
        (``ServingEngine.abort``; a sample that had already ended keeps its own reason).
      stats: ``RequestStats``.
      error: why the request was rejected (then nothing was generated), else None.
      rejected: True for a request that was not accepted (``ServingEngine.reject``; ``run``
        rejects a request that ``submit`` refuses): no tokens, no finish reasons, ``error``
        says why. False for every request that ran.
      seed: the sampling seed used (``Request.seed`` or the default derived from the engine's
        seed and the request id; module ``sampling``): the same request with ``seed=`` this value
        gives the same samples on a fresh engine. Beam search and greedy decoding draw nothing.
        None when rejected.
    """

    request_id: object
    request: Request
    tokens: list[list[int]]
    logprobs: list[list[float]] | None
    scores: list[float] | None
    finish_reasons: list[str]
    stats: RequestStats
    error: str | None = None
    seed: int | None = None
    rejected: bool = False

    @property
    def ok(self) -> bool:
        """The request ran (not ``rejected``)."""
        return not self.rejected


@dataclasses.dataclass(frozen=True)
class TokenDelta:
    """Tokens of one sample of a request that no earlier delta carried (streaming, ``run(...,
    on_token=...)``).

    Attributes:
      request_id: the request's id.
      index: the sample index in ``[0, n)``, or the hypothesis rank (best first) of a beam request.
      tokens: the new token ids, in order (a beam hypothesis: all of it, sent once at the end; may
        be empty on a sample's last delta when it ended without a new token).
      finish_reason: None while the sample goes on; on its last delta one of ``FINISH_REASONS``
        (``RequestOutput.finish_reasons``).
    """

    request_id: object
    index: int
    tokens: tuple[int, ...]
    finish_reason: str | None = None


@dataclasses.dataclass
class EngineStats:
    """Engine-wide statistics (``ServingEngine.stats()``).

    ``chunk_size``, ``max_prefill_rows`` and ``decode_steps`` are the engine's ``ServingConfig``
    values as resolved (its defaults), so that a report says what ran."""

    chunk_size: int = 0
    max_prefill_rows: int = 0
    decode_steps: int = 0
    steps: int = 0
    prefill_steps: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    wall_s: float = 0.0
    step_s: float = 0.0
    compile_s: float = 0.0  # first calls of each shape + compile_ahead_s
    compile_ahead_s: float = 0.0  # ServingEngine.compile (before the first step; not in step_s)
    peak_blocks_used: int = 0
    preemptions: int = 0
    copies: int = 0
    bad_tokens: int = 0  # tokens outside the vocabulary that reached a step (host checks bypassed)
    finished: int = 0
    rejected: int = 0
    aborted: int = 0  # requests ended by ``ServingEngine.abort`` (not counted in ``finished``)
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
    # Where the steps' time goes, in seconds summed over the steps that called the model (each
    # part timed on the host around work the step does anyway: no device sync is added). Their
    # sum is ``step_s`` less the bookkeeping between them; the first call of each shape compiles,
    # so ``device_s`` includes ``compile_s`` less ``compile_ahead_s``' share.
    device_calls: int = 0  # calls of the jitted step (a burst of decode steps is one call)
    schedule_s: float = 0.0  # admission (its ``admit`` call included) and the burst decision
    inputs_s: float = 0.0  # building the step's inputs (``serving_step.build_inputs``)
    device_s: float = 0.0  # the step call until its outputs are on the host: dispatch, compute, copy back
    process_s: float = 0.0  # processing each step's outputs: tokens, finishing, preemption, statistics

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


__all__ = ["FINISH_REASONS", "EngineStats", "IMPLS", "Request", "RequestOutput", "RequestStats", "ServingConfig",
           "TableSnapshot", "TokenDelta"]
