"""Host-side state of the requests a serving engine runs, and the per-family rules that need no
device: which rows a (re-)admission takes, the request checks, beam ranking (the algorithm of
``engine.beam_search``), the finished output and the sharing statistics.

A *family* is one request with its ``n`` samples or ``k`` beams; it holds one row of the batch per
sample / beam while it runs. A *cohort row* is one prompt of an ``admit`` call being prefilled.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from collections.abc import Iterable, Sequence

import numpy as np

from paged_kv.config import ManagerConfig
from paged_kv.engine import call_setup
from paged_kv.engine.sampling import BeamParams, SamplingParams, check_vocab
from paged_kv.engine.serving_types import (
    EngineStats,
    Request,
    RequestOutput,
    RequestStats,
    ServingConfig,
    TableSnapshot,
)
from paged_kv.engine.step_io import StepOutputs


class Phase(enum.Enum):
    WAITING = 0
    RUNNING = 1
    DONE = 2


@dataclasses.dataclass(eq=False)  # identity: two samples with equal contents are still two (``index``)
class Sample:
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: str | None = None
    row: int | None = None
    streamed: int = 0  # tokens[:streamed] were sent as TokenDelta (streaming never resends them)


@dataclasses.dataclass
class Beam:
    tokens: list[int]
    score: float  # sum of log-probabilities
    row: int | None = None


@dataclasses.dataclass
class Family:
    """A request's host-side state (its samples or beams, rows, statistics)."""

    req: Request
    rid: object
    seq: int  # submission number: larger is newer
    seed: int
    budget: int
    phase: Phase = Phase.WAITING
    samples: list[Sample] = dataclasses.field(default_factory=list)
    beams: list[Beam] = dataclasses.field(default_factory=list)
    pool: list[tuple[float, float, list[int], int]] = dataclasses.field(default_factory=list)
    rows: list[int] = dataclasses.field(default_factory=list)  # rows held (reserved included)
    prefilling: set = dataclasses.field(default_factory=set)  # rows still in the cohort
    stats: RequestStats = dataclasses.field(default_factory=RequestStats)
    t_submit: float = 0.0
    aborted: bool = False  # ended by ``Scheduler.abort``

    @property
    def width(self) -> int:
        return self.req.width

    @property
    def capped(self) -> bool:
        """The context cut the budget below ``max_new_tokens`` (see ``budget``)."""
        return self.budget < self.req.params.max_new_tokens

    def length_reason(self) -> str:
        """The finish reason of a sample / hypothesis that used up its budget: ``"length"``, or
        ``"length_capped"`` when that budget is the context's, not ``max_new_tokens``."""
        return "length_capped" if self.capped else "length"


@dataclasses.dataclass
class CohortRow:
    row: int
    family: Family
    index: int  # sample / beam index
    tokens: np.ndarray
    start: int  # first position to compute (after cached/shared blocks)
    fork_to: list[int]  # rows forked from this one when its prefill ends (a new n > 1 request)
    discard: bool = False  # prefilled only so that its cached blocks hold their K/V; then freed
    # Its prompt shares blocks that another row of the same cohort computes (``admit``'s
    # ``shared_tokens``): it may not run ahead of them (``serving_step.prefill_pieces``).
    reads_cohort: bool = False
    # First position not yet computed: ``start`` at admission, the prompt's length when done.
    done: int = dataclasses.field(init=False)

    def __post_init__(self):
        self.done = self.start



@dataclasses.dataclass
class HostState:
    """The serving scheduler's host state, one object that ``Scheduler`` (admission, steps) and
    ``Outcomes`` (what a step's outputs do) both hold: neither reaches into the other's attributes.

    Attributes:
      waiting: families waiting for admission, in order (preempted ones at the front).
      running: running families by submission number (``Family.seq``).
      free_rows: rows no family holds, sorted; row_owner: row -> (family, sample/beam index).
      pending: row -> the token it feeds at the next step (the rows that decode).
      results: beam row -> its top ``(logprobs, ids)``, until every beam of its family has them.
      select: ``(dst, parent)`` beam reselections for the next step; to_free: rows to free then.
      cohort: the ``CohortRow`` s being prefilled.
      live: request id -> its family, for every family waiting or running (ids are unique among
        them: ``Scheduler.enqueue`` refuses a duplicate; ``abort`` looks them up).
      stats: the engine's ``EngineStats``; finished: outputs not yet returned by ``step``.
      deltas: streamed ``TokenDelta`` s of the step, or None when nobody streams.
      step_count: steps run so far (the engine's clock).
    """

    free_rows: list[int]
    waiting: collections.deque = dataclasses.field(default_factory=collections.deque)
    running: dict[int, Family] = dataclasses.field(default_factory=dict)
    row_owner: dict[int, tuple[Family, int]] = dataclasses.field(default_factory=dict)
    pending: dict[int, int] = dataclasses.field(default_factory=dict)
    results: dict[int, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)
    select: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    to_free: list[int] = dataclasses.field(default_factory=list)
    cohort: list[CohortRow] = dataclasses.field(default_factory=list)
    live: dict[object, Family] = dataclasses.field(default_factory=dict)
    stats: EngineStats = dataclasses.field(default_factory=EngineStats)
    finished: list[RequestOutput] = dataclasses.field(default_factory=list)
    deltas: list | None = None
    step_count: int = 0


# ---------------------------------------------------------------------------- admission rules
def budget(request: Request, context: int) -> int:
    """Tokens the request may generate per sample: ``max_new_tokens``, capped by the context
    (``context - len(prompt) + 1``: every token but the last one needs a KV slot). A sample that
    stops at a cap below ``max_new_tokens`` ends with ``"length_capped"``, not ``"length"``."""
    return max(1, min(request.params.max_new_tokens, context - len(request.prompt) + 1))


def admission_rows(fam: Family) -> list[tuple[int, list[int], list[int]]]:
    """(index, tokens, fork targets) per row to admit: one row for a new request, one per
    unfinished sample / beam for a preempted one (its generated tokens appended to the prompt)."""
    p = list(fam.req.prompt)
    if fam.req.is_beam:
        if not fam.beams:
            return [(0, p, [])]
        return [(i, p + b.tokens, []) for i, b in enumerate(fam.beams)]
    if all(not s.tokens for s in fam.samples):
        return [(0, p, [])]
    return [(i, p + s.tokens, []) for i, s in enumerate(fam.samples) if s.finish is None]


def rows_needed(fam: Family, entries: list) -> int:
    """Rows an admission of ``fam`` takes: its width (a new request reserves the rows its samples
    fork into; beams always hold ``k``), or one per unfinished sample of a preempted one."""
    if fam.req.is_beam:
        return fam.width
    return len(entries) if any(s.tokens for s in fam.samples) else fam.width


def pick_admissions(waiting: Iterable[Family], manager: ManagerConfig, max_prefill_rows: int, *, num_free: int,
                    running_rows: int, free_rows: int, anything_running: bool) -> list[tuple[Family, list]]:
    """The waiting families one ``admit`` call takes, from the front of the queue (first come,
    first served), with their ``admission_rows``: while they fit the free rows, ``max_prefill_rows``
    prompts, and their prompts' blocks (counted as if nothing were cached) within the free blocks
    minus one block per running row (headroom for the next decode steps). When nothing else runs,
    the head is taken even if the block estimate says no: prefix-cache hits may make it fit."""
    budget = num_free - running_rows
    picked: list[tuple[Family, list]] = []
    n_rows = blocks = 0
    for fam in waiting:
        entries = admission_rows(fam)
        need_rows = rows_needed(fam, entries)
        need_blocks = sum(manager.blocks_for(len(t)) for _, t, _ in entries)
        if (n_rows + need_rows > free_rows or len(entries) + sum(len(e) for _, e in picked) > max_prefill_rows
                or blocks + need_blocks > budget):
            if not picked and not anything_running and n_rows + need_rows <= free_rows:
                picked.append((fam, entries))
            break
        picked.append((fam, entries))
        n_rows += need_rows
        blocks += need_blocks
    return picked


def check_request(request: Request, config: ServingConfig, *, context: int, vocab_size: int,
                  max_positions: int) -> None:
    """``ValueError`` when ``request`` can never run (see ``ServingEngine.check``)."""
    if not isinstance(request, Request):
        raise ValueError(f"expected a Request, got {type(request).__name__}")
    mgr, cfg = config.manager, config
    # Token ids outside the vocabulary would embed as garbage and poison the KV blocks (and
    # the prefix cache) other requests read: reject them with the id, position and limit.
    call_setup.token_ids(request.prompt, vocab_size=vocab_size)
    n = len(request.prompt)
    if n > context:
        raise ValueError(
            f"prompt has {n} tokens, more than the {context} a sequence can hold (min of "
            f"max_blocks_per_seq x block_size = {mgr.max_tokens_per_seq} and the model's max_positions = "
            f"{max_positions})")
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
        if t >= vocab_size:
            raise ValueError(f"eos token id {t} must be < vocab_size={vocab_size}")
    if isinstance(p, SamplingParams):
        check_vocab(p.eos_token_ids, p.top_k, vocab_size)
    else:
        c = w * (1 + max(len(p.eos_token_ids), 1))
        if c > cfg.top_candidates:
            raise ValueError(f"beam_width={w} with {len(p.eos_token_ids)} EOS ids needs {c} candidates per "
                             f"row; top_candidates={cfg.top_candidates}")
        if c > vocab_size:
            raise ValueError(f"beam search needs {c} candidates; vocab_size={vocab_size}")
    # The whole family must fit the pool alone, even with no sharing, or preempting everything
    # else would still not let it finish.
    longest = min(n + budget(request, context) - 1, context)
    worst = w * mgr.blocks_for(longest)
    if worst > mgr.num_blocks - 1:
        raise ValueError(f"{what}={w} sequences of up to {longest} tokens need up to {worst} blocks; the pool "
                         f"has only {mgr.num_blocks - 1} allocatable blocks")


# ---------------------------------------------------------------------------- beam search (host)
def rank_beams(live: list[Beam], results: Sequence[tuple[np.ndarray, np.ndarray]], params: BeamParams,
               vocab_size: int) -> tuple[list[tuple[float, list[int], int]], list[tuple[float, int, int]], int]:
    """One beam-search step over the device's top candidates (``engine.beam_search``'s rules).

    Args:
      live: the family's live beams (before this step's token).
      results: per live beam, ``(logprobs [K], ids [K])``: the row's ``top_candidates`` best.
    Returns ``(finished, keep, length)``: ``finished`` the new ``(sum_logprobs, tokens, length)``
    hypotheses that end with EOS among the best ``k``; ``keep`` the best ``k`` non-EOS
    ``(sum_logprobs, parent index, token)``; ``length`` the hypotheses' length after this step.
    Ties break by (parent, token), as ``beam_search`` does.
    """
    k = params.beam_width
    cands = []
    for i, (b, (lp, ids)) in enumerate(zip(live, results)):
        for val, tok in zip(lp.tolist(), ids.tolist()):
            if math.isfinite(val):
                cands.append((b.score + val, i, int(tok)))
    cands.sort(key=lambda c: (-c[0], c[1] * vocab_size + c[2]))
    cands = cands[:k * (1 + max(len(params.eos_token_ids), 1))]
    length = len(live[0].tokens) + 1
    eos_ids = set(params.eos_token_ids)
    finished = [(val, live[i].tokens + [tok], length) for rank, (val, i, tok) in enumerate(cands)
                if tok in eos_ids and rank < k]
    keep = [(val, i, tok) for val, i, tok in cands if tok not in eos_ids][:k]
    return finished, keep, length


def merge_pool(fam: Family, finished: Iterable[tuple[float, list[int], int]], penalty: float) -> None:
    """Adds ``(sum_logprobs, tokens, length)`` hypotheses to the family's best-``k`` pool, scored
    ``sum_logprobs / length ** penalty``."""
    k = fam.req.params.beam_width
    entries = list(fam.pool)
    for total, toks, length in finished:
        entries.append((total / max(length, 1) ** penalty, total, toks, length))
    entries.sort(key=lambda e: -e[0])  # stable: earlier entries first on ties
    fam.pool = entries[:k]


# ---------------------------------------------------------------------------- outputs, statistics
def family_output(fam: Family) -> RequestOutput:
    """The ``RequestOutput`` of a finished family (its samples, or its beam pool best first)."""
    if fam.req.is_beam:
        eos = set(fam.req.params.eos_token_ids)
        tokens = [list(t) for _, _, t, _ in fam.pool]
        # A hypothesis without EOS was cut: by the budget, or by ``abort`` (live beams then join).
        cut = "aborted" if fam.aborted else fam.length_reason()
        out = RequestOutput(request_id=fam.rid, request=fam.req, tokens=tokens, logprobs=None,
                            scores=[float(s) for s, *_ in fam.pool],
                            finish_reasons=["eos" if t and t[-1] in eos else cut for t in tokens],
                            stats=fam.stats, seed=fam.seed)
    else:
        out = RequestOutput(request_id=fam.rid, request=fam.req, tokens=[list(s.tokens) for s in fam.samples],
                            logprobs=[list(s.logprobs) for s in fam.samples], scores=None,
                            finish_reasons=[s.finish for s in fam.samples], stats=fam.stats, seed=fam.seed)
    out.stats.generated_tokens = sum(len(t) for t in out.tokens)
    return out


def record_sharing(st: EngineStats, snapshot: TableSnapshot | None, running: Iterable[Family],
                   row_owner: dict[int, tuple[Family, int]], out: StepOutputs, block_size: int,
                   step: int) -> TableSnapshot | None:
    """Adds one step's block sharing of the ``n > 1`` / beam families to ``st``; returns the
    snapshot of the family saving the most blocks so far (``out``: host ``StepOutputs`` with
    ``tables``, ``refs`` [R, M] and ``num_tokens`` [R])."""
    bs = block_size
    for fam in running:
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
        if snapshot is None or saved > snapshot.saved_blocks:
            kind = "beam" if fam.req.is_beam else "sample"
            labels = [f"{kind} {row_owner[r][1]}" for r in rows]
            snapshot = TableSnapshot(
                request_id=fam.rid, kind=kind, step=step, labels=labels,
                blocks=[out.tables[r, :held[r]].tolist() for r in rows],
                refs=[out.refs[r, :held[r]].tolist() for r in rows],
                num_tokens=[int(out.num_tokens[r]) for r in rows], saved_blocks=saved)
    return snapshot
