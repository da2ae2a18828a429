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

A *cohort* (the prompts of one admit call) is prefilled in *pieces*: each prompt is cut at the
multiples of ``chunk_size`` (``C``) from its first uncomputed position on, and a step's ``[P, C]``
chunk batch carries up to ``P = max_prefill_rows`` pieces, handed out round-robin over the
cohort, several of one prompt when the others leave rows free (``serving_step.prefill_pieces``).
The cuts depend on the prompt alone, so a piece computes the same values whatever step and row
carry it. A prompt that shares blocks another prompt of the same call computes
(``shared_tokens``) takes a piece starting at ``lo`` only once every other row has been handed
its positions below ``lo`` (earlier in the same step is enough: each layer writes every piece's
K/V before any piece attends). The next cohort is admitted only after this
one's prefill ends: ``admit`` registers a prompt's full blocks in the prefix cache before their
K/V is written, so no later request may hit them earlier, and a request in the middle of its
prefill is never preempted (its freed blocks would stay cached without their K/V).

With ``decode_steps = K > 1`` one device call runs a *burst* of up to ``K`` decode steps when no
step in between needs the host (no prefill, no beam, blocks for ``K`` more tokens free, the
next arrival of ``run`` at least ``K`` steps away; with requests waiting, a burst also ends after
a step in which a row finished): a ``while_loop`` over the
step, each row feeding the token it sampled and stopping at an EOS id or its budget. The host
then processes each step's outputs in turn, so tokens, log-probs, step counts and admissions
are those of one call per step (``tests/test_serving_bursts.py``).

The step (device, one ``jax.jit``, shapes fixed by ``R``, ``P`` (0 when no prefill chunk runs,
else ``max_prefill_rows``: two compiled variants; a CPU compiles one, whose chunk forward runs on
the narrowest of ``serving_step.prefill_widths(P)`` rows that holds the step's pieces) and
``C = chunk_size``): ``free`` finished or preempted rows ->
``select`` (beam reselection) -> paged prefill forward of the chunk batch ``[P, C]`` -> ``append``
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

Determinism. Sampling keys are ``fold_in(root, request seed, sample index, token index)``
(``sampling`` module docstring), so tokens do not depend on batch composition, rows, preemption,
arrival timing or submission order; a request's default seed is a stable hash of the engine's
seed and its id, recorded in its output for replay. With greedy decoding a run that preempts
gives the tokens of a run with ample blocks.

Modules (this file wires them): ``serving_types`` (config, request, output and statistics types),
``scheduler`` (the host policy described here, no device arrays: testable with a fake device),
``families`` (per-request host state and rules: admission rows, checks, beam ranking),
``serving_step`` (the jitted step, its ``StepInputs`` / ``StepOutputs``, and ``DeviceStep``,
which holds the pages and the block-manager state). ``ServingEngine`` is a ``Scheduler`` whose
device is a ``DeviceStep`` over the model, plus ``run`` (arrivals, streaming).

Tensor parallelism: ``ServingEngine(..., mesh=paged_kv.models.sharding.make_mesh(tp))`` shards the weights
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

Request identity and lifecycle. A request's id (``Request.request_id``, default its submission
number) is unique among the requests waiting or running: ``submit`` refuses a duplicate with a
``ValueError`` naming it (``run``: an output with ``rejected`` True, yielded when the duplicate
arrives, so before the live request's own), and the id is free again once its request has
finished or been aborted. ``abort(request_id)`` ends a waiting or running request and all
its samples or beams (False for an id no such request has): its rows are freed by the next step's
jitted ``free``, as a finished request's (a prompt in the middle of its prefill is prefilled to
the end of its cohort first, because ``admit`` cached its full blocks before their K/V was
written), and its output, finish reason ``"aborted"``, comes out of that step. The other
requests are not touched: their tokens are those of a run where the aborted request stopped at
the same step. A request whose prompt plus ``max_new_tokens`` runs past what a sequence holds
(the context: the pool's ``max_tokens_per_seq`` and the model's positions) stops at the context,
with finish reason ``"length_capped"`` instead of ``"length"`` (as ``generate``'s
``FinishReason.LENGTH_CAPPED`` and ``beam_search``'s ``length_capped``).

Beam search follows ``engine.beam_search`` (same scoring, tie breaking and stopping rules); the
device returns each beam row's ``top_candidates`` best log-probabilities, which always contain
the ``k * (1 + max(#EOS, 1))`` best continuations over all beams, and the host ranks them.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
from flax import nnx

from paged_kv.config import ManagerConfig
from paged_kv.engine import call_setup
from paged_kv.engine.sampling import root_key
from paged_kv.engine.scheduler import Scheduler
from paged_kv.engine.serving_step import DeviceStep, StepInputs, StepOutputs
from paged_kv.engine.serving_types import (
    IMPLS,
    EngineStats,
    Request,
    RequestOutput,
    RequestStats,
    ServingConfig,
    TableSnapshot,
    TokenDelta,
)
from paged_kv.inputs import is_int
from paged_kv.models.page_sizing import allocate_pages, kv_bytes_per_block, page_spec
from paged_kv.models.protocol import model_facts
from paged_kv.pallas_kernels.quant import QuantPages
from paged_kv.state import BlockManagerState, init_state


class ServingEngine:
    """A host scheduler (``Scheduler``, held as ``scheduler``) around one jitted step
    (``DeviceStep``, held as ``device``); see the module docstring.

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

    def __init__(self, model: nnx.Module | tuple[nnx.GraphDef, nnx.State], config: ServingConfig, *, seed: int = 0,
                 mesh: jax.sharding.Mesh | None = None):
        """Args:
          model: an NNX module implementing ``paged_kv.models.protocol.PagedModel`` (``paged_kv.models.Llama``, or
            your own) or its ``(graphdef, state)`` split. When ``config.impl`` resolves to Pallas
            and ``mesh`` is given, a stacked Llama's layer weights are copied once into one array
            per layer (``paged_kv.models.per_layer``; drop your own reference to ``model`` to free
            the stacked copy); otherwise the model runs as given
            (``paged_kv.models.layer_layout.layout_for_impl`` has the table).
          config: the ``ServingConfig``. Its manager may hold a windowed model's KV-cache groups
            (``paged_kv.engine.kv_cache_groups(model)``): the engine then allocates pages of
            ``layout.slots`` layers (``self.layout``) and reclaims out-of-window blocks.
          seed: the engine's sampling seed: a request without a seed gets
            ``sampling.default_seed(seed, request_id)`` (recorded in ``RequestOutput.seed``); a
            request with one samples the same tokens whatever the engine's seed.
          mesh: a ``jax.sharding.Mesh`` with a "tp" axis (``paged_kv.models.sharding.make_mesh``) to run
            tensor-parallel: weights and KV pages are sharded over it (KV heads), the block-manager
            state and step inputs are replicated. None: one device.
        """
        if not isinstance(config, ServingConfig):
            raise ValueError(f"config must be a ServingConfig, got {type(config).__name__}")
        if not is_int(seed) or not 0 <= seed < 2**31:
            raise ValueError(f"seed={seed!r} must be an int in [0, 2**31)")
        mgr = config.manager
        graphdef, weights = call_setup.split_model(model)
        # The model's facts (paged_kv.models.protocol): checked here, before anything is compiled.
        base_config = model_facts((graphdef, weights))
        # A grouped manager (`call_setup.group_layout`): pages of `layout.slots` layers.
        self.layout = call_setup.group_layout((graphdef, weights), mgr)
        # `config.kv_dtype`: int8 / fp8 pages are `QuantPages` (values and float32 scales).
        self.page_spec = page_spec(base_config, mgr.num_blocks, mgr.block_size, layout=self.layout,
                                   kv_dtype=config.kv_dtype)
        pages = allocate_pages(self.page_spec)
        # The execution plan (paged_kv.pallas_kernels.plan), made before anything is traced: it refuses
        # e.g. fp8 on a target that cannot compute it.
        self.plan = call_setup.check_kv_pages(pages, config.impl, config.batch_invariant)
        if mesh is None:
            model_config = base_config
        else:
            graphdef, weights, model_config, pages, mesh = call_setup.place((graphdef, weights), pages, mesh)
        # Pallas kernels over a mesh: one weight array per layer (no slice of a stacked weight in
        # the step, which XLA:GPU would copy every step). The engine then holds only the per-layer
        # copy; the stacked arrays live on only while the caller keeps `model`. On one device the
        # layers stay stacked (`paged_kv.pallas_kernels.layer_matmul` reads them in place).
        graphdef, weights = call_setup.layer_layout(graphdef, weights, config.impl, mesh)
        self.graphdef, self.weights, self.model_config, self.mesh = graphdef, weights, model_config, mesh
        state, self.key = call_setup.replicate_inputs(mesh, init_state(mgr), root_key())
        self.bytes_per_block = kv_bytes_per_block(base_config, mgr.block_size, layout=self.layout,
                                                  kv_dtype=config.kv_dtype)
        self.device = DeviceStep(config, graphdef, weights, pages, state, self.key, mesh)
        self.scheduler = Scheduler(config, self.device, vocab_size=model_config.vocab_size,
                                   max_positions=model_config.max_positions,
                                   eos_token_ids=model_config.eos_token_ids, seed=seed)
        self.compile_table: list[dict] = []  # per program: compile seconds and why (``compile``)

    # ------------------------------------------------------------------ the scheduler's API
    # The engine's public API is the scheduler's, with compilation and ``run`` on top.
    @property
    def config(self) -> ServingConfig:
        return self.scheduler.config

    @property
    def manager(self) -> ManagerConfig:
        """The block manager's ``ManagerConfig``."""
        return self.scheduler.manager

    @property
    def vocab_size(self) -> int:
        return self.scheduler.vocab_size

    @property
    def max_positions(self) -> int:
        return self.scheduler.max_positions

    @property
    def context(self) -> int:
        """Tokens a sequence can hold (the pool's per-sequence limit and the model's positions)."""
        return self.scheduler.context

    @property
    def step_count(self) -> int:
        """Steps run so far."""
        return self.scheduler.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.scheduler.step_count = value

    @property
    def snapshot(self) -> TableSnapshot | None:
        """The block tables of the step where sharing saved the most (``record_tables``)."""
        return self.scheduler.snapshot

    @property
    def idle(self) -> bool:
        """No request is waiting or running, and no aborted prompt is still being prefilled
        (``Scheduler.idle``)."""
        return self.scheduler.idle

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by running sequences after the last step (host copy; no device read)."""
        return self.scheduler.blocks_in_use

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    def check(self, request: Request) -> None:
        """``Scheduler.check``: ``ValueError`` when ``request`` can never run on this engine."""
        self.scheduler.check(request)

    def submit(self, request: Request) -> object:
        """Queues ``request`` (at the back of the waiting queue) after ``check``; returns its id.
        ``ValueError`` when it can never run, or when its id is that of a request still waiting or
        running (the message names the id; ids may be reused once their request has finished or
        been aborted): nothing is queued and the engine is unchanged."""
        self.check(request)
        return self.scheduler.enqueue(request)

    def abort(self, request_id: object) -> bool:
        """``Scheduler.abort``: ends the waiting or running request ``request_id``, all its
        samples or beams; its blocks are freed at the next step (full ones stay in the prefix
        cache) and its output, finish reason ``"aborted"``, comes out of that step (``run``
        yields it, after its last streamed deltas). Returns False, changing nothing, for an id
        no waiting or running request has (unknown, finished, or not yet arrived in ``run``)."""
        return self.scheduler.abort(request_id)

    def reject(self, request: Request, error: str) -> RequestOutput:
        """``Scheduler.reject``: the output of a request that was not accepted."""
        return self.scheduler.reject(request, error)

    def step(self, max_steps: int | None = None) -> list[RequestOutput]:
        """``Scheduler.step``: one scheduler iteration; returns the requests that finished."""
        return self.scheduler.step(max_steps)

    def stats(self) -> EngineStats:
        """Engine statistics so far (prefix-cache counters read from the device)."""
        return self.scheduler.stats()

    @property
    def pages(self) -> jax.Array | QuantPages:
        """The KV pages (a ``jax.Array``, or ``QuantPages`` with ``kv_dtype`` int8 / fp8; replaced by
        every step, which donates it)."""
        return self.device.pages

    @property
    def state(self) -> BlockManagerState:
        """The block-manager state (``BlockManagerState`` of device arrays; donated by every call)."""
        return self.device.state

    # ------------------------------------------------------------------ compilation
    def programs(self) -> list[tuple[str, str, Callable]]:
        """The jitted programs a run calls: ``(name, why it exists, lower)`` where ``lower()``
        returns the program lowered on inputs of its exact shapes (``jax.stages.Lowered``).
        (Frees with no model step left, at the end of a run, run the decode-only variant.)"""
        cfg, mgr = self.config, self.manager
        p, c, r = cfg.max_prefill_rows, cfg.chunk_size, mgr.max_seqs
        decode = (f"free, select, append + paged decode forward of R={r} rows, copy-on-write, fork, "
                  "per-row sampling")
        chunk = f"the paged prefill forward of P={p} prompts x C={c} positions"
        variants = self.device.variants()
        k = len(variants)
        if k == 1:  # on a CPU: the chunk's forward is skipped when a step has none
            steps = [(f"step variant 1/1 (prefill chunk [{p}, {c}] + decode)",
                      f"every step: {decode}; {chunk} before the decode forward, skipped (a cond) on steps "
                      "without a chunk",
                      lambda: self.device.lower_step(p))]
        else:
            steps = [(f"step variant 1/{k} (decode)", f"every step without a prefill chunk: {decode}",
                      lambda: self.device.lower_step(0)),
                     (f"step variant 2/{k} (prefill chunk [{p}, {c}] + decode)",
                      f"steps that also prefill one chunk of a cohort: {chunk} before the decode forward",
                      lambda: self.device.lower_step(p))]
        return steps + [
            ("admit",
             f"each admission: frees, prefix-cache lookup and block allocation for up to {p} prompts of "
             f"{self.scheduler.admit_width} tokens (fixed shape: one compile)",
             lambda: self.device.lower_admit(self.scheduler.admit_width)),
        ]

    def compile(self, progress: Callable[[int, int, str, float | None], None] | None = None) -> list[dict]:
        """Compiles every program of ``programs()`` now (ahead of time: ``lower(...).compile()``),
        so that no step waits for XLA and compile time is measured per program.

        ``progress(k, total, name, seconds)`` is called before each program (``seconds`` None)
        and after it (its compile seconds). The engine's clock starts here when nothing was
        submitted yet, and ``EngineStats.compile_s`` / ``compile_ahead_s`` count this time, so
        ``tokens_per_s`` still excludes it. Returns (and keeps as ``compile_table``) one
        ``{"program", "seconds", "why"}`` per program. With JAX's persistent compilation cache on,
        a program compiled by an earlier run is loaded instead (its seconds are then lowering
        and loading)."""
        import time

        self.scheduler.start_clock()
        progs = self.programs()
        table = []
        for k, (name, why, lower) in enumerate(progs, start=1):
            if progress is not None:
                progress(k, len(progs), name, None)
            t0 = time.perf_counter()
            lower().compile()
            dt = time.perf_counter() - t0
            table.append({"program": name, "seconds": round(dt, 3), "why": why})
            if progress is not None:
                progress(k, len(progs), name, dt)
        self.scheduler.note_compiled_ahead(self.config.max_prefill_rows, sum(t["seconds"] for t in table))
        self.compile_table = table
        return table

    # ------------------------------------------------------------------ the loop
    def run(self, requests: Iterable[Request], arrivals: Sequence[int] | None = None, *,
            max_steps: int | None = None,
            on_step: Callable[[ServingEngine], None] | None = None,
            on_token: Callable[[TokenDelta], None] | None = None) -> Iterator[RequestOutput]:
        """Submits each request when ``step_count`` reaches its arrival step and steps until every
        request has finished; yields outputs as they finish (rejected requests: an output with
        ``error`` set, when they arrive). When nothing runs, the clock jumps to the next arrival.

        Args:
          requests: the workload (any order; submitted by arrival, ties in the given order).
          arrivals: arrival step per request (default: each request's ``arrival``).
          max_steps: stop after this many steps (``RuntimeError`` if work is left).
          on_step: called after each step (progress reporting); after a burst of decode steps
            (``ServingConfig.decode_steps``), once for the burst.
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
                if not is_int(a) or a < 0:
                    raise ValueError(f"run: arrivals[{i}] is {shown(a)}; arrival steps are ints >= 0")
            requests = [dataclasses.replace(q, arrival=int(a)) for q, a in zip(requests, arrivals)]
        if max_steps is not None and (not is_int(max_steps) or max_steps < 1):
            raise ValueError(f"run: max_steps is {shown(max_steps)}; it must be None or an int >= 1")
        if on_step is not None and not callable(on_step):
            raise ValueError(f"run: on_step is {shown(on_step)}; it must be None or a callable taking the engine")
        if on_token is not None and not callable(on_token):
            raise ValueError(f"run: on_token is {shown(on_token)}; it must be None or a callable taking a TokenDelta")

        def stepped(limit: int | None = None) -> list[RequestOutput]:
            done = self.step(limit)
            if on_token is not None:
                host = self.scheduler.host
                deltas, host.deltas = host.deltas, []
                for d in deltas:
                    on_token(d)
            return done

        def serve() -> Iterator[RequestOutput]:
            if on_token is not None:
                self.scheduler.host.deltas = []
            try:
                yield from loop()
            finally:
                self.scheduler.host.deltas = None

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
                # A burst of decode steps must not run past the next arrival or max_steps.
                limits = ([pending[0].arrival - self.step_count] if pending else []) + (
                    [start + max_steps - self.step_count] if max_steps is not None else [])
                yield from stepped(max(1, min(limits)) if limits else None)
                if on_step is not None:
                    on_step(self)
                if max_steps is not None and self.step_count - start >= max_steps:
                    raise RuntimeError(f"run: {max_steps} steps done and requests are left "
                                       f"({self.num_waiting} waiting, {self.num_running} running)")
            yield from stepped()  # flush frees

        return serve()


__all__ = ["EngineStats", "IMPLS", "Request", "RequestOutput", "RequestStats", "ServingConfig", "ServingEngine",
           "StepInputs", "StepOutputs", "TableSnapshot", "TokenDelta"]
