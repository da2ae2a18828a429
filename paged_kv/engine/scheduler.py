"""The serving engine's host policy: admission, preemption, families and beams, streaming.

``Scheduler`` owns every host-side decision and no device array. Each ``step()`` it admits
waiting families (first come, first served, while rows, prefill rows and blocks allow), builds
one step's ``StepInputs`` (numpy, static shapes), calls ``device.step`` once, and turns the
``StepOutputs`` it gets back into tokens, finished requests, beam reselections and, when an
``append`` found no free block, a preemption of the newest running request.

``device`` is anything with the four methods of ``serving_step.DeviceStep``::

    admit(free_ids [R], ids [A], lens [A], toks [A, W], salts [A]) -> (status [A], cached [A], shared [A], num_free)
    step(inp: StepInputs, prefill_rows: int) -> StepOutputs      # host (numpy) values
    free(free_ids [R]) -> num_free
    cache_stats() -> object with lookups, query_tokens, hit_tokens, evictions

so the policy can be driven by a fake device in tests, without a model (``tests/test_scheduler.py``).
What happens to a step's outputs (tokens to samples, beam ranking, finishing, streaming,
preemption) is ``engine.outcomes.Outcomes``, a collaborator the scheduler holds: both work on one
``families.HostState`` (``Scheduler.host``).
See ``paged_kv.engine.serving`` for the rules themselves (admission, cohorts, preemption, streaming).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from paged_kv.engine import families as F
from paged_kv.engine.families import CohortRow, Family, HostState, Phase, Sample
from paged_kv.engine.outcomes import Outcomes
from paged_kv.engine.sampling import default_seed, with_model_eos
from paged_kv.engine.serving_step import DeviceStep, build_inputs
from paged_kv.engine.serving_types import (
    EngineStats,
    Request,
    RequestOutput,
    RequestStats,
    ServingConfig,
    TableSnapshot,
)
from paged_kv.engine.step_io import EOS_SLOTS, Burst
from paged_kv.status import Status


class Scheduler:
    """Host scheduler of a serving engine (module docstring).

    Args:
      config: the ``ServingConfig``.
      device: the device side (``DeviceStep`` or a fake with the same methods).
      vocab_size, max_positions: the model's facts (request checks, beam tie breaking).
      eos_token_ids: the model's EOS ids, for requests whose parameters leave theirs None
        (``resolve``).
      seed: the engine's sampling seed, which fixes the seeds of requests submitted without one.
    """

    def __init__(self, config: ServingConfig, device: DeviceStep, *, vocab_size: int, max_positions: int,
                 eos_token_ids: tuple[int, ...] = (), seed: int = 0):
        mgr = config.manager
        self.seed = seed
        self.eos_token_ids = tuple(eos_token_ids)
        self.config, self.manager, self.device = config, mgr, device
        self.vocab_size, self.max_positions = vocab_size, max_positions
        self.context = min(mgr.max_tokens_per_seq, max_positions)
        # Every admit call has this fixed width (one compile): the context rounded up to blocks.
        self._admit_width = min(mgr.max_tokens_per_seq, -(-self.context // mgr.block_size) * mgr.block_size)
        self.host = HostState(free_rows=list(range(mgr.max_seqs)))
        st = self.host.stats  # the sizes that ran, as resolved (``EngineStats``)
        st.chunk_size, st.max_prefill_rows, st.decode_steps = (config.chunk_size, config.max_prefill_rows,
                                                               config.decode_steps)
        self.outcomes = Outcomes(self.host, vocab_size)
        self._num_free = mgr.num_blocks - 1
        self._submitted = 0
        self._t_start: float | None = None
        self.snapshot: TableSnapshot | None = None
        self._seen_shapes: set = set()  # shapes whose first call was timed as compiling
        self._compiled_ahead: set = set()  # shapes ServingEngine.compile compiled before any call

    @property
    def step_count(self) -> int:
        """Steps run so far: the engine's clock (``run`` moves it forward to the next arrival when
        nothing runs)."""
        return self.host.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.host.step_count = value

    @property
    def timed_compiles(self) -> frozenset:
        """The program shapes whose first call was timed as compiling (not compiled ahead)."""
        return frozenset(self._seen_shapes)

    def start_clock(self) -> None:
        """Starts the engine's wall clock, unless it runs already."""
        if self._t_start is None:
            self._t_start = time.perf_counter()

    def note_compiled_ahead(self, prefill_rows: int, seconds: float) -> None:
        """``ServingEngine.compile`` compiled the step variants and the admission ahead of any
        call (``seconds`` in all): their first calls are not timed as compiling again."""
        self._compiled_ahead.update({("step", 0), ("step", prefill_rows), ("admit", prefill_rows, self._admit_width)})
        self.host.stats.compile_s += seconds
        self.host.stats.compile_ahead_s += seconds

    @property
    def admit_width(self) -> int:
        """Tokens of every admission's prompt array (fixed: one compile)."""
        return self._admit_width

    # ------------------------------------------------------------------ submission
    def resolve(self, request: Request) -> Request:
        """``request`` with its parameters' EOS ids filled in: the model's when they are None (the
        default; ``sampling.with_model_eos``). The engine keeps, and outputs, the resolved one."""
        params = with_model_eos(request.params, self.eos_token_ids)
        return request if params is request.params else dataclasses.replace(request, params=params)

    def check(self, request: Request) -> None:
        """``ValueError`` when ``request`` can never run on this engine (the message names the
        value and the limit): a prompt token id outside ``[0, vocab_size)`` (e.g. "prompt token id
        259 at position 16 is out of range: ids must be in [0, vocab_size=259)"), a prompt longer
        than the context or the pool, EOS ids or ``top_k`` beyond the vocabulary, a family too wide
        or too large for the pool."""
        F.check_request(self.resolve(request), self.config, context=self.context, vocab_size=self.vocab_size,
                        max_positions=self.max_positions)

    def submit(self, request: Request) -> object:
        """Queues ``request`` (at the back of the waiting queue); returns its id.

        Raises ``ValueError`` if it is invalid for this model (a token id outside ``[0, vocab_size)``)
        or can never fit (prompt longer than the context or the pool, ``n``/beam width too wide,
        its sequences larger than the pool), or if its id is that of a request not finished yet
        (``duplicate_id``); nothing is queued and the engine is unchanged.
        """
        self.check(request)
        return self.enqueue(request)

    def enqueue(self, request: Request) -> object:
        """Queues ``request`` without checking it against the model and pool (``submit`` checks
        first); returns its id. ``ValueError`` naming the id, and nothing changed, when a request
        of that id is waiting or running (``duplicate_id``)."""
        request = self.resolve(request)
        rid = self._submitted if request.request_id is None else request.request_id
        problem = self.duplicate_id(request)
        if problem:
            raise ValueError(problem)
        if self._t_start is None:
            self._t_start = time.perf_counter()
        seq = self._submitted
        self._submitted += 1
        # The seed names the request, not its place in the submission order (``sampling``).
        seed = default_seed(self.seed, rid) if request.seed is None else request.seed
        fam = Family(req=request, rid=rid, seq=seq, seed=seed,
                     budget=F.budget(request, self.context), t_submit=time.perf_counter())
        fam.stats.prompt_tokens = len(request.prompt)
        fam.stats.arrival_step = self.step_count
        if not request.is_beam:
            fam.samples = [Sample() for _ in range(request.params.n)]
        self.host.waiting.append(fam)
        self.host.live[rid] = fam
        return rid

    def duplicate_id(self, request: Request) -> str | None:
        """Why ``request`` may not be queued now because of its id, or None: a request of the same
        id (a ``request_id=None`` request's id is its submission number) is waiting, running or
        preempted. Once that one has finished or been aborted, the id is free again (as vLLM,
        which refuses only live duplicates): ids label requests in flight (outputs, streamed
        deltas, ``abort``), and two live ones would mix their streams."""
        rid = self._submitted if request.request_id is None else request.request_id
        if rid not in self.host.live:
            return None
        why = (f" (request_id=None takes the submission number {rid} as its id; give every request an id, "
               "or none)" if request.request_id is None else "")
        return (f"request id {rid!r} is already in use by a request that has not finished{why}; ids may be reused "
                "once a request has finished or been aborted")

    def abort(self, request_id: object) -> bool:
        """Ends the waiting or running request ``request_id`` (all its samples / beams) now.

        Returns True, and its output (finish reason ``"aborted"`` for every sample that had not
        ended; a beam request's live beams join its hypotheses as ``"aborted"``) comes out of the
        next ``step`` with its last streamed deltas; its rows are freed by that step's jitted
        ``free``, as a finished request's (``Outcomes.abort``: a prompt in the middle of its
        prefill is freed when its cohort's prefill ends). Returns False, and changes nothing,
        for an id that no waiting or running request has: unknown, already finished (or aborted),
        or not yet submitted (a ``run`` request before its arrival step)."""
        try:
            fam = self.host.live.get(request_id)
        except TypeError:  # unhashable: no request has it
            return False
        if fam is None:
            return False
        self.outcomes.abort(fam)
        return True

    def reject(self, request: Request, error: str) -> RequestOutput:
        """The output of a request that was not accepted (counted in the statistics)."""
        self.host.stats.rejected += 1
        return RequestOutput(request_id=request.request_id, request=request, tokens=[], logprobs=None, scores=None,
                             finish_reasons=[], stats=RequestStats(prompt_tokens=len(request.prompt),
                                                                   arrival_step=self.step_count), error=error,
                             rejected=True)

    @property
    def idle(self) -> bool:
        """No request is waiting or running, and no prompt is being prefilled (an aborted
        request's prompt is prefilled to its end before its rows are freed)."""
        return not self.host.waiting and not self.host.running and not self.host.cohort

    @property
    def num_waiting(self) -> int:
        return len(self.host.waiting)

    @property
    def num_running(self) -> int:
        return len(self.host.running)

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by running sequences after the last step (host copy; no device read)."""
        return self.manager.num_blocks - 1 - self._num_free

    @property
    def preemptions(self) -> int:
        return self.host.stats.preemptions

    # ------------------------------------------------------------------ admission
    def _try_admit(self) -> None:
        if self.host.cohort or not self.host.waiting:
            return
        mgr, cfg = self.manager, self.config
        picked = F.pick_admissions(self.host.waiting, mgr, cfg.max_prefill_rows, num_free=self._num_free,
                                   running_rows=sum(len(f.rows) for f in self.host.running.values()),
                                   free_rows=len(self.host.free_rows), anything_running=bool(self.host.running))
        if not picked:
            return
        # Rows for each family; the admitted row of a new family is its first row.
        plan = []  # (family, row, index, tokens)
        fam_rows: dict[int, list[int]] = {}
        for fam, entries in picked:
            rows = [self.host.free_rows.pop(0) for _ in range(F.rows_needed(fam, entries))]
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
        status, cached, shared, num_free = self.device.admit(free_ids, ids, lens, toks, salts)
        self._note_compile(("admit", a, width), t0)
        self._num_free = int(num_free)
        status = status.tolist()  # Python ints: a numpy scalar against an IntEnum costs ~5 us a row
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
                cohort.append(CohortRow(row=row, family=fam, index=idx, tokens=np.asarray(t, np.int32),
                                        start=min(start, len(t) - 1), fork_to=[], discard=True,
                                        reads_cohort=int(shared[i]) > 0))
                continue
            fam.stats.cached_prompt_tokens += int(cached[i])
            fam.stats.shared_prompt_tokens += int(shared[i])
            new_n = (not fam.req.is_beam) and all(not s.tokens for s in fam.samples)
            fork_to = fam_rows[fam.seq][1:] if new_n else []
            cohort.append(CohortRow(row=row, family=fam, index=idx, tokens=np.asarray(t, np.int32),
                                    start=min(start, len(t) - 1), fork_to=fork_to, reads_cohort=int(shared[i]) > 0))
        for fam, _ in picked:
            if fam.seq in failed:
                self.host.free_rows.extend(r for r in fam_rows[fam.seq] if r not in kept_rows)
                continue
            self.host.waiting.remove(fam)
            fam.phase = Phase.RUNNING
            fam.rows = fam_rows[fam.seq]
            fam.stats.admissions += 1
            self.host.stats.admissions += 1
            self.host.running[fam.seq] = fam
            for j, row in enumerate(fam.rows):
                self.host.row_owner[row] = (fam, j)
        self.host.free_rows.sort()
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
        if not cohort and not self.host.running:
            # Even alone the head did not fit: it never will (check() should have caught it).
            fam = self.host.waiting.popleft()
            self.host.live.pop(fam.rid, None)
            self.host.finished.append(self.reject(fam.req, "request does not fit the block pool"))
        self.host.cohort = cohort

    def _take_frees(self) -> np.ndarray:
        r = self.manager.max_seqs
        ids = np.full((r,), -1, np.int32)
        ids[:len(self.host.to_free)] = self.host.to_free
        self.host.to_free = []
        return ids

    # ------------------------------------------------------------------ one step
    def step(self, max_steps: int | None = None) -> list[RequestOutput]:
        """One scheduler iteration: admit if possible, run one device call, process its results
        (sample / beam bookkeeping, finishing, preemption). Returns the requests that finished.

        The call runs one step, or a burst of up to ``decode_steps`` and at most ``max_steps``
        decode steps when nothing needs the host between them (``_burst_length``); each step's
        outputs are processed in turn, as if they had come one call at a time."""
        t0 = time.perf_counter()
        if self._t_start is None:
            self._t_start = t0
        self._try_admit()
        cfg = self.config
        if not (self.host.cohort or self.host.pending):
            if self.host.to_free:
                self._num_free = int(self.device.free(self._take_frees()))
            self._refresh_cache_stats()
            return self._drain(t0)
        burst = self._burst_length(max_steps)
        t_inputs = time.perf_counter()
        inp, pf = build_inputs(cfg, self._take_frees(), self.host.select, self.host.pending, self.host.cohort,
                               self.host.running.values(), burst.steps, burst.stop_on_finish)
        self.host.select = []
        prefill_rows = cfg.max_prefill_rows if pf else 0
        t1 = time.perf_counter()
        outs = self.device.step(inp, prefill_rows)
        t_process = time.perf_counter()
        self._note_compile(("step", prefill_rows), t1)
        st = self.host.stats
        st.device_calls += 1
        st.schedule_s += t_inputs - t0
        st.inputs_s += t1 - t_inputs
        st.device_s += t_process - t1
        outs = outs if isinstance(outs, list) else [outs]
        # A burst's steps at once when nothing needs them one by one (``Outcomes.process_burst``;
        # the sharing statistics of ``record_tables`` count only families of two rows or more).
        at_once = (len(outs) > 1 and pf is None
                   and not (cfg.record_tables and any(f.width > 1 for f in self.host.running.values()))
                   and self.outcomes.process_burst(outs))
        for i, out in enumerate(outs):
            st.steps += 1
            st.copies += int(out.copies)
            st.bad_tokens += int(out.bad_tokens)
            self._num_free = int(out.num_free)
            st.peak_blocks_used = max(st.peak_blocks_used, self.manager.num_blocks - 1 - self._num_free)
            if at_once:
                continue
            self.step_count += 1
            self.outcomes.process(out, pf if i == 0 else None)
            if cfg.record_tables:
                self.snapshot = F.record_sharing(st, self.snapshot, self.host.running.values(),
                                                 self.host.row_owner, out, self.manager.block_size, self.step_count)
        st.process_s += time.perf_counter() - t_process
        return self._drain(t0)

    def _burst_length(self, max_steps: int | None) -> Burst:
        """Decode steps the next call may run: 1, or up to ``decode_steps`` (and ``max_steps``)
        when no step in between needs the host: nothing is prefilled, no beam (its reselection
        is the host's) or pending reselection, every row's EOS ids fit
        the device's check, and the free blocks cover every decoding row's next blocks (its
        tokens' blocks plus one for a copy-on-write), so no ``append`` can fail inside it. With
        requests waiting, ``stop_on_finish``: the burst then ends after a step in which a row
        finished, where one call per step would try the admission again."""
        k = self.config.decode_steps
        if max_steps is not None:
            k = min(k, max_steps)
        if k <= 1 or self.host.cohort or self.host.select or not self.host.pending:
            return Burst(1)
        bs, need = self.manager.block_size, 0
        for fam in self.host.running.values():
            if fam.req.is_beam or len(fam.req.params.eos_token_ids) > EOS_SLOTS:
                return Burst(1)
            shared = fam.req.params.n > 1  # forked samples may share their last, partial block
            for s in fam.samples:
                if s.row is None or s.row not in self.host.pending:
                    continue
                # The cache holds the prompt and every token but the one fed next (at most this
                # many; one fewer after a re-admission): blocks for k more, one more to copy. A
                # row stops on the device at its budget, so it appends no more than what is left
                # of that (a pool sized for the requests' budgets still runs whole bursts).
                hi = len(fam.req.prompt) + len(s.tokens)
                steps = max(1, min(k, fam.budget - len(s.tokens)))
                need += -(-(hi + steps) // bs) - -(-(hi - 1) // bs) + shared
        if need > self._num_free:
            return Burst(1)
        # Waiting requests did not fit now (``_try_admit`` ran first); only a row that finishes
        # can make room (blocks only shrink otherwise), so the burst ends after such a step.
        return Burst(k, stop_on_finish=bool(self.host.waiting))

    def _note_compile(self, key, t0: float) -> None:
        # The first call of each shape compiles: its time is reported apart from the throughput.
        if key not in self._seen_shapes and key not in self._compiled_ahead:
            self._seen_shapes.add(key)
            self.host.stats.compile_s += time.perf_counter() - t0

    def _drain(self, t0: float) -> list[RequestOutput]:
        now = time.perf_counter()
        self.host.stats.step_s += now - t0
        if self._t_start is not None:
            self.host.stats.wall_s = now - self._t_start
        done, self.host.finished = self.host.finished, []
        return done

    # ------------------------------------------------------------------ statistics
    def _refresh_cache_stats(self) -> None:
        cs = self.device.cache_stats()
        st = self.host.stats
        st.cache_lookups, st.cache_query_tokens = int(cs.lookups), int(cs.query_tokens)
        st.cache_hit_tokens, st.cache_evictions = int(cs.hit_tokens), int(cs.evictions)

    def stats(self) -> EngineStats:
        """Engine statistics so far (prefix-cache counters read from the device)."""
        self._refresh_cache_stats()
        return dataclasses.replace(self.host.stats)
