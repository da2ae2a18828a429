"""The serving engine's device side: the jitted step of static shapes, the ``admit`` program,
and ``DeviceStep``, which holds the device arrays and calls them.

The step (one ``jax.jit``; shapes fixed by ``R = max_seqs``, ``P`` (``max_prefill_rows``, or 0
for the decode-only variant a GPU compiles; a CPU serves every step with the P variant) and
``C = chunk_size``): ``free`` finished or preempted rows -> ``select`` (beam reselection) ->
``append`` one token per decoding row (the three as one call, ``fused.free_select_append``) ->
paged prefill forward of one cohort chunk ``[P, C]`` -> ``copy_blocks`` for copy-on-write, paged
decode forward ``[R]`` -> ``fork`` the samples of prompts
whose prefill ended -> per-row sampling (greedy / temperature / top-k / top-p, each row with its
own parameters and key) and the top candidates for beams. Padding rows use sequence id -1. The
inputs travel as two packed arrays and the outputs come back as one (``engine.step_io``).

``DeviceStep`` is what the host scheduler (``engine.scheduler``) talks to: ``admit``, ``step``,
``free`` and ``cache_stats`` take and return host (numpy) values, so a test can hand the
scheduler a fake device with the same four methods and no model.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_kv.admission import AdmitResult, admit
from paged_kv.config import ManagerConfig
from paged_kv.engine import call_setup
from paged_kv.engine.families import CohortRow, Family
from paged_kv.engine.sampling import sample_keys, sample_rows
from paged_kv.engine.serving_types import ServingConfig
from paged_kv.engine.step_io import (
    EOS_SLOTS,
    Interned,
    StepInputs,
    StepOutputs,
    intern,
    output_layout,
    pack_inputs,
    pack_outputs,
    unpack_burst,
    unpack_inputs,
    unpack_outputs,
)
from paged_kv.engine.steps import decode_appended
from paged_kv.fused import free_select_append
from paged_kv.models.paged import make_paged_batch, paged_forward
from paged_kv.models.protocol import in_vocab
from paged_kv.pallas_kernels.invariant import log_softmax as invariant_log_softmax
from paged_kv.pallas_kernels.quant import QuantPages
from paged_kv.reclaim import free
from paged_kv.scan import per_platform, target_of
from paged_kv.share import fork
from paged_kv.state import BlockManagerState, CacheStats
from paged_kv.status import Status


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static part of a step's jit key."""

    config: ServingConfig
    prefill_rows: int  # P: 0 when no prefill chunk runs this step
    mesh: object = None  # a jax.sharding.Mesh with a "tp" axis, or None (one device)
    # The chunk's forward runs under a ``cond`` that skips it when every prefill row is padding
    # (set where one variant serves every step: ``single_step_variant``).
    skip_empty_chunk: bool = False


def _unless_padding(target: str, ids: jax.Array, op, state: BlockManagerState) -> BlockManagerState:
    """``op(state)`` when some row of ``ids`` (int32 [R]) is not padding, else ``state`` as is.

    Most steps free, select and fork nothing; the op on all-padding rows leaves the state
    unchanged anyway, so the ``lax.cond`` gives the same state and saves the op's gathers and
    scatters over R rows on those steps (the CPU runs only the branch taken). No KV page passes
    through the cond. On other backends the op runs unconditionally: XLA:GPU reads a
    conditional's predicate on the host (a device-to-host sync per step), which costs more than
    the op's few small gathers (the GPU compile gate counts a step's conditionals)."""
    def skip_if_padding(state):
        return jax.lax.cond(jnp.any(ids >= 0), op, lambda s: s, state)
    return per_platform(target, state, cpu=skip_if_padding, default=op)


def step_fn(graphdef: nnx.GraphDef, weights: nnx.State, pages: jax.Array, state: BlockManagerState, key: jax.Array,
            inp: StepInputs, *, shape: StepShape
            ) -> tuple[jax.Array, BlockManagerState, StepOutputs | tuple[StepOutputs, jax.Array]]:
    """One step; with ``decode_steps = K > 1`` a burst of up to ``K`` (``_burst``), whose outputs
    have a leading axis of K steps and come with the number of steps run. ``key``: the sampling
    root key (``sampling.root_key()``) each row's seed, sample and token index are folded into."""
    if shape.config.decode_steps == 1:
        return _step(graphdef, weights, pages, state, key, inp, shape)
    return _burst(graphdef, weights, pages, state, key, inp, shape)


def _burst(graphdef, weights, pages, state: BlockManagerState, key, inp: StepInputs, shape: StepShape):
    """Up to ``K = decode_steps`` steps in one ``while_loop`` over ``_step`` (traced once).

    Step 0 takes ``inp`` as it is; every later step decodes only: no free, select, fork or
    prefill piece, each row feeding the token it sampled, with ``token_idx`` one further (so the
    same sampling keys as one call per step). A row stops after an EOS id (``inp.eos``), at its
    budget (``inp.left``) or on a status other than OK. The loop ends after ``inp.n_steps``
    steps, when no row decodes, after a step in which a row finished when ``inp.stop_on_finish``
    (requests wait for rows), or after a step where some row found no free block (the host
    preempts; the scheduler runs bursts only when the blocks suffice). Returns ``(pages, state,
    (outputs with a leading [K] axis, steps run))``; entries past the steps run are zeros."""
    cfg = shape.config
    k, r = cfg.decode_steps, cfg.manager.max_seqs
    n = jnp.clip(inp.n_steps[0], 1, k)
    # Requests are waiting: the burst ends after a step in which a row finished (its row and
    # blocks may admit one at the next call, as they would at the next step).
    stop_on_finish = inp.stop_on_finish[0]
    pad = jnp.full((r,), -1, jnp.int32)
    no_pf = jnp.full_like(inp.pf_rows, -1)

    def body(carry):
        i, pages, state, cur, bufs, stop = carry
        pages, state, out = _step(graphdef, weights, pages, state, key, cur, shape)
        bufs = jax.tree.map(lambda b, x: b.at[i].set(x), bufs, out)
        done = jnp.any(out.tokens[None, :] == cur.eos, axis=0) | (cur.left <= 1) | (out.status != Status.OK)
        live = cur.dec_live & ~done
        failed = jnp.any(cur.dec_live & (out.status == Status.NO_FREE_BLOCKS))
        nxt = cur.replace(free_ids=pad, sel_dst=pad, sel_parent=pad, fork_src=pad, fork_dst=pad,
                          logit_src=jnp.arange(r, dtype=jnp.int32), pf_rows=no_pf,
                          pf_lens=jnp.zeros_like(cur.pf_lens), dec_tokens=jnp.where(live, out.tokens, 0),
                          dec_live=live, token_idx=cur.token_idx + 1, left=cur.left - 1)
        finished = jnp.any(cur.dec_live & done)
        return i + 1, pages, state, nxt, bufs, failed | ~jnp.any(live) | (stop_on_finish & finished)

    def cond(carry):
        i, *_, stop = carry
        return (i < n) & ~stop

    # The outputs' shapes are static (``output_layout``): no second trace of the step to find them.
    bufs = StepOutputs(**{name: jnp.zeros((k,) + shp, dt) for name, shp, dt in output_layout(cfg)})
    i, pages, state, _, bufs, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), pages, state, inp, bufs,
                                                                 jnp.bool_(False)))
    return pages, state, (bufs, i)


def _step(graphdef, weights, pages, state: BlockManagerState, key, inp: StepInputs, shape: StepShape):
    cfg = shape.config
    mgr = cfg.manager
    model = nnx.merge(graphdef, weights)
    r = mgr.max_seqs
    rows = jnp.arange(r, dtype=jnp.int32)
    dec_ids = jnp.where(inp.dec_live, rows, -1)
    dec_tokens = inp.dec_tokens.astype(jnp.int32) if mgr.prefix_caching else None
    pf_rows = inp.pf_rows if shape.prefill_rows else jnp.zeros((0,), jnp.int32)

    # Free, select and the decode rows' append (its bookkeeping only) run before the prefill
    # forward, as one call (on a GPU one host sync for the three). The prefill chunk's tables are
    # read between select and append; the forward does not touch the manager's state, and the
    # pages are written prefill first, then the copies and the decode forward.
    # Named scopes only label the HLO (scripts/profile_decode.py attributes time by them).
    with jax.named_scope("manager_free_select_append"):
        state, _, _, res, pf_tables = free_select_append(mgr, state, inp.free_ids, inp.sel_dst, inp.sel_parent,
                                                         dec_ids, dec_tokens, pf_rows)
    pf_logits = None
    vocab = model.vocab_size
    bad_tokens = jnp.sum(~in_vocab(inp.dec_tokens, vocab) & inp.dec_live, dtype=jnp.int32)
    if shape.prefill_rows:
        pr = inp.pf_rows
        valid = pr >= 0
        q_lens = jnp.where(valid, inp.pf_lens, 0)
        fed = jnp.arange(cfg.chunk_size, dtype=jnp.int32)[None, :] < q_lens[:, None]
        bad_tokens += jnp.sum(~in_vocab(inp.pf_tokens, vocab) & fed, dtype=jnp.int32)
        p = pr.shape[0]

        def prefill(width: int):
            # The forward of the chunk batch's first ``width`` rows (the pieces come first,
            # padding after them: ``build_inputs``); the other rows' logits are zeros.
            def run(pages):
                tables = pf_tables[:, :width] if pf_tables.ndim == 3 else pf_tables[:width]  # [G, P, M] grouped
                batch = make_paged_batch(tables, inp.pf_start[:width], q_lens[:width], cfg.chunk_size,
                                         mgr.block_size)
                logits, pages = paged_forward(model, pages, batch, inp.pf_tokens[:width], impl=cfg.impl,
                                              last_only=True, mesh=shape.mesh, batch_invariant=cfg.batch_invariant)
                logits = logits.astype(jnp.float32)
                if width < p:
                    logits = jnp.concatenate([logits, jnp.zeros((p - width, vocab), jnp.float32)])
                return logits, pages
            return run

        def skipped(pages):
            return jnp.zeros((p, vocab), jnp.float32), pages

        with jax.named_scope("prefill_chunk"):
            if shape.skip_empty_chunk:
                # One variant serves every step (``single_step_variant``): a step without a chunk
                # (every ``pf_rows`` -1) skips the forward, and a step with ``n`` pieces runs it
                # on the narrowest width of ``prefill_widths(P)`` that holds them (XLA:CPU runs
                # only the branch taken), so a wide ``P`` costs a lone late arrival a narrow
                # forward. The pages pass through the switch in place
                # (tests/test_serving_variants.py checks the step for page-sized copies).
                # Chosen by a static flag, not ``per_platform``, which would trace the forward
                # twice (once per form) and cost a warm start about a second.
                widths = prefill_widths(p)
                if len(widths) == 1:  # P <= 8: the forward or nothing
                    pf_logits, pages = jax.lax.cond(jnp.any(valid), prefill(p), skipped, pages)
                else:
                    n = jnp.sum(valid, dtype=jnp.int32)
                    branch = jnp.where(n == 0, 0, 1 + jnp.sum(n > jnp.asarray(widths[:-1], jnp.int32)))
                    pf_logits, pages = jax.lax.switch(branch, [skipped, *(prefill(w) for w in widths)], pages)
            else:
                pf_logits, pages = prefill(p)(pages)

    state, pages, logits, status, copies = decode_appended(model, pages, mgr, state, rows, inp.dec_tokens, res,
                                                           impl=cfg.impl, mesh=shape.mesh,
                                                           batch_invariant=cfg.batch_invariant)
    if pf_logits is not None:
        # A row may have several pieces in the chunk (``prefill_pieces``): its logits are its last
        # piece's (the one with the largest start), the only one that can end the prompt.
        pr, st = inp.pf_rows, inp.pf_start
        later = (pr[None, :] == pr[:, None]) & (st[None, :] > st[:, None]) & (pr[None, :] >= 0)
        last = (pr >= 0) & ~jnp.any(later, axis=1)
        logits = logits.at[jnp.where(last, pr, r)].set(pf_logits, mode="drop")
    with jax.named_scope("manager_fork"):
        state = _unless_padding(mgr.target, inp.fork_dst, lambda s: fork(mgr, s, inp.fork_src, inp.fork_dst)[0], state)
    with jax.named_scope("sampling"):
        logits = logits[jnp.clip(inp.logit_src, 0, r - 1)]
        def row_keys():  # the seeding rule (``sampling`` module docstring): nothing of the row
            return sample_keys(key, inp.seed, inp.sample_idx, inp.token_idx)
        # The keys as a function: ``sample_rows`` derives them only where a row draws (on a CPU,
        # a greedy step skips the draw and with it the three fold-ins' loops, ~200 instructions).
        tokens, logp = sample_rows(logits, row_keys, inp.temperature, inp.top_k, inp.top_p, target=mgr.target)
        def top(x):
            logp = invariant_log_softmax(x) if cfg.batch_invariant else jax.nn.log_softmax(x, axis=-1)
            lp, ids = jax.lax.top_k(logp, cfg.top_candidates)
            return lp, ids.astype(jnp.int32)

        def no_top(x):  # no beam row this step: nobody reads the top candidates
            return (jnp.zeros((r, cfg.top_candidates), jnp.float32), jnp.zeros((r, cfg.top_candidates), jnp.int32))

        if inp.beam is None:
            top_lp, top_ids = top(logits)
        else:  # on a CPU, skip the log-softmax and top-k of [R, V] when no row is a beam
            top_lp, top_ids = per_platform(mgr.target, logits,
                                           cpu=lambda x: jax.lax.cond(jnp.any(inp.beam), top, no_top, x), default=top)
    if cfg.record_tables:
        tables = state.block_tables
        out_tables, out_n, out_refs = tables, state.num_tokens, state.ref_count[tables]
    else:
        out_tables = out_refs = jnp.zeros((0, 0), jnp.int32)
        out_n = jnp.zeros((0,), jnp.int32)
    out = StepOutputs(tokens=tokens, logprobs=logp, top_logprobs=top_lp, top_ids=top_ids,
                      status=status, num_free=state.queue.num_free, copies=copies, tables=out_tables,
                      num_tokens=out_n, refs=out_refs, bad_tokens=bad_tokens)
    return pages, state, out


step_jit = jax.jit(step_fn, static_argnames=("graphdef", "shape"), donate_argnames=("pages", "state"))
"""The step on ``StepInputs`` / ``StepOutputs`` pytrees (18 input and 11 output arrays)."""


def packed_step_fn(model: Interned, weight_leaves: tuple[jax.Array, ...], pages: jax.Array, state: BlockManagerState,
                   key: jax.Array, rows: jax.Array, pf: jax.Array | None, *,
                   shape: StepShape) -> tuple[jax.Array, BlockManagerState, jax.Array]:
    """``step_fn`` on ``pack_inputs``' arrays, returning ``(pages, state, pack_outputs(...))``.
    ``model`` holds ``(graphdef, treedef of the weights)`` and ``weight_leaves`` the weights' arrays
    (a tuple flattens in C++; an ``nnx.State`` in Python, every call)."""
    graphdef, weights_def = model.value
    weights = jax.tree.unflatten(weights_def, weight_leaves)
    pages, state, out = step_fn(graphdef, weights, pages, state, key, unpack_inputs(rows, pf), shape=shape)
    if shape.config.decode_steps == 1:
        return pages, state, pack_outputs(shape.config, out)
    out, steps = out  # a burst: K steps' outputs, then how many ran
    return pages, state, jnp.concatenate([pack_outputs(shape.config, out), steps[None]])


packed_step_jit = jax.jit(packed_step_fn, static_argnames=("model", "shape"), donate_argnames=("pages", "state"))
"""What ``DeviceStep`` calls: the step on packed inputs and outputs."""


def admit_fn(manager: ManagerConfig, state: BlockManagerState, free_ids: jax.Array, seq_ids: jax.Array,
             lens: jax.Array, tokens: jax.Array, salts: jax.Array) -> tuple[BlockManagerState, AdmitResult, jax.Array]:
    state, _ = free(manager, state, free_ids)
    state, res = admit(manager, state, seq_ids, lens, tokens if manager.prefix_caching else None, salts)
    return state, res, state.queue.num_free


admit_jit = jax.jit(admit_fn, static_argnums=0, donate_argnums=1)

def prefill_pieces(cohort: Sequence[CohortRow], chunk_size: int, max_pieces: int) -> list:
    """The prefill pieces of the next step: ``(cohort row, first position, length)`` each, at
    most ``max_pieces`` (the ``P`` rows of the step's ``[P, C]`` chunk batch).

    A row's prompt is cut at the multiples of ``chunk_size`` (``C``), from its first uncomputed
    position ``CohortRow.done`` on: the cuts depend on the row's own prompt and cached prefix
    only, never on its neighbours, so each piece computes the same values whichever step and
    batch row carry it. The pieces are handed out round-robin over the cohort (one per row that
    has any left, then a second round, ...), so short prompts finish first and a long prompt
    takes whatever rows the others leave free: a step's ``P x C`` positions serve several
    pieces of one prompt when nothing else needs them. Several pieces of one row in one step are
    consecutive; each layer writes every piece's K/V before any piece attends, and attention is
    causal by position, so a later piece reads the earlier ones as it would in a later step.

    A row whose prompt shares blocks that another cohort row computes (``CohortRow.reads_cohort``)
    may take a piece starting at position ``lo`` only once every other row has been handed its
    positions below ``lo`` (in an earlier step, or earlier in this one: its K/V is then written
    in the same layer pass before anything attends): the rule of the aligned chunks, where every
    row computed chunk ``c`` in the same step. Rows without shared blocks, and the waiting row with
    the smallest ``lo``, are always free to go, so the cohort never stalls.
    """
    pieces, done = [], {id(cr): cr.done for cr in cohort}

    def ready(cr, lo):
        return not cr.reads_cohort or all(done[id(o)] >= min(lo, len(o.tokens)) for o in cohort if o is not cr)

    while len(pieces) < max_pieces:
        took = False
        for cr in cohort:
            lo, n = done[id(cr)], len(cr.tokens)
            if lo >= n or len(pieces) == max_pieces or not ready(cr, lo):
                continue
            q = min((lo // chunk_size + 1) * chunk_size, n) - lo
            pieces.append((cr, lo, q))
            done[id(cr)] = lo + q
            took = True
        if not took:
            break
    return pieces


def build_inputs(config: ServingConfig, free_ids: np.ndarray, select_pairs: Sequence[tuple[int, int]], pending: dict,
                 cohort: Sequence[CohortRow], running: Iterable[Family], n_steps: int = 1,
                 stop_on_finish: bool = False) -> tuple[StepInputs, tuple | None]:
    """A step's ``StepInputs`` (numpy) from the scheduler's host state.

    Args:
      free_ids: int32 [R] rows to free (-1 pads); select_pairs: ``(dst, parent)`` beam reselections.
      pending: row -> token each decoding row feeds.
      cohort: the ``CohortRow`` s being prefilled (``prefill_pieces`` cuts this step's pieces from
        them; empty or all done: no prefill chunk, P = 0).
      running: the running ``Family`` s (per-row sampling parameters and key parts).
      n_steps: decode steps the call may run (a burst when > 1: ``ServingConfig.decode_steps``);
      stop_on_finish: the burst ends after a step in which a row finished (requests wait).
    Returns ``(inputs, pf)``: ``pf`` is None without a chunk, else ``(rows [P], tokens [P, C],
    start [P], lens [P], ends, owners)`` over the pieces (padding after them): ``ends[i]`` is true
    when piece ``i`` ends its row's prompt and ``owners[i]`` is its ``CohortRow``.
    """
    r = config.manager.max_seqs
    i32 = lambda fill=-1: np.full((r,), fill, np.int32)
    sel_dst, sel_parent = i32(), i32()
    for i, (d, p) in enumerate(select_pairs):
        sel_dst[i], sel_parent[i] = d, p
    dec_tokens, dec_live = i32(0), np.zeros((r,), bool)
    for row, tok in pending.items():
        dec_tokens[row], dec_live[row] = tok, True
    fork_src, fork_dst, logit_src = i32(), i32(), np.arange(r, dtype=np.int32)
    temperature, top_p = np.zeros((r,), np.float32), np.ones((r,), np.float32)
    top_k, seed, sample_idx, token_idx = i32(0), i32(0), i32(0), i32(0)
    left, eos = i32(0), np.full((EOS_SLOTS, r), -1, np.int32)
    pf = None
    pieces = prefill_pieces(cohort, config.chunk_size, config.max_prefill_rows)
    if pieces:
        size = config.chunk_size
        rows_, toks_, start_, lens_, ends = [], [], [], [], []
        nf = 0
        for cr, lo, q in pieces:
            n = len(cr.tokens)
            part = np.zeros((size,), np.int32)
            part[:q] = cr.tokens[lo:lo + q]
            rows_.append(cr.row)
            toks_.append(part)
            start_.append(lo)
            lens_.append(q)
            end = lo + q == n
            ends.append(end)
            if end:
                for dst in cr.fork_to:
                    fork_src[nf], fork_dst[nf] = cr.row, dst
                    logit_src[dst] = cr.row
                    nf += 1
        pad = config.max_prefill_rows - len(rows_)
        pf = (np.array(rows_ + [-1] * pad, np.int32),
              np.stack(toks_ + [np.zeros((size,), np.int32)] * pad),
              np.array(start_ + [0] * pad, np.int32), np.array(lens_ + [0] * pad, np.int32), ends,
              [cr for cr, _, _ in pieces])
    # Per-row sampling parameters and key parts.
    beam = np.zeros((r,), bool)
    for fam in running:
        if fam.req.is_beam:
            beam[fam.rows] = True
            continue
        prm = fam.req.params
        for idx, s in enumerate(fam.samples):
            rows = [s.row] if s.row is not None else []
            for row in rows:
                temperature[row], top_k[row], top_p[row] = prm.temperature, prm.top_k, prm.top_p
                seed[row], sample_idx[row], token_idx[row] = fam.seed, idx, len(s.tokens)
                left[row] = fam.budget - len(s.tokens)
                ids = prm.eos_token_ids[:EOS_SLOTS]
                eos[:len(ids), row] = ids
    pf_arrays = pf[:4] if pf else (np.full((1,), -1, np.int32), np.zeros((1, config.chunk_size), np.int32),
                                   np.zeros((1,), np.int32), np.zeros((1,), np.int32))
    inp = StepInputs(free_ids=free_ids, sel_dst=sel_dst, sel_parent=sel_parent, pf_rows=pf_arrays[0],
                     pf_tokens=pf_arrays[1], pf_start=pf_arrays[2], pf_lens=pf_arrays[3], dec_tokens=dec_tokens,
                     dec_live=dec_live, fork_src=fork_src, fork_dst=fork_dst, logit_src=logit_src,
                     temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, sample_idx=sample_idx,
                     token_idx=token_idx, beam=beam, left=left, eos=eos, n_steps=i32(n_steps),
                     stop_on_finish=np.full((r,), stop_on_finish, bool))
    return inp, pf


def prefill_widths(prefill_rows: int) -> tuple[int, ...]:
    """The chunk-batch widths a CPU step chooses from (``_step``): 8, 32, 128, ... (times 4) below
    ``prefill_rows`` (``P``), then ``P`` itself. Each is one more trace of the forward in the
    step program (more compile time), so the ladder is geometric: a step's forward runs on at
    most 4x the rows its pieces need."""
    widths, w = [], 8
    while w < prefill_rows:
        widths.append(w)
        w *= 4
    return (*widths, prefill_rows)


def single_step_variant(pages: jax.Array | QuantPages) -> bool:
    """Whether one step program serves every step (pages, or ``QuantPages``' arrays, on CPU devices).

    XLA:CPU runs only the taken branch of a ``cond``, so skipping the prefill forward of a step
    without a chunk costs nothing, and the second variant would only add its compile (about half
    the main job's cold start). XLA:GPU reads a ``cond``'s predicate on the host (a sync per
    step), so there the decode-only steps keep a program without the prefill."""
    return all(d.platform == "cpu" for leaf in jax.tree.leaves(pages) for d in leaf.devices())


class DeviceStep:
    """The device arrays of a serving engine and the three programs that update them.

    Holds the model (``graphdef`` static, ``weights``), the KV ``pages``, the block-manager
    ``state`` and the sampling root ``key`` (``sampling.root_key()``); ``pages`` and ``state`` are
    donated to every call and replaced by its results. Every method takes and returns host (numpy / int) values: the
    scheduler never sees a ``jax.Array``.
    """

    def __init__(self, config: ServingConfig, graphdef: nnx.GraphDef, weights: nnx.State, pages: jax.Array,
                 state: BlockManagerState, key: jax.Array, mesh: jax.sharding.Mesh | None = None):
        if config.manager.target == "auto":
            # The platform the programs run on, when this process can only lower them there: then
            # only that form of each operation is traced (``scan.target_of``), and the target,
            # part of every jit key through the config, keeps a trace from serving another.
            target = target_of(*jax.tree.leaves(pages))
            config = dataclasses.replace(config, manager=dataclasses.replace(config.manager, target=target))
        self.config, self.graphdef, self.weights, self.pages, self.state, self.key, self.mesh = (
            config, graphdef, weights, pages, state, key, mesh)
        p = config.max_prefill_rows
        self.single_variant = single_step_variant(pages)
        # On a CPU one program serves every step: a step without a chunk runs the prefill variant
        # with every prefill row padding, and its forward is skipped (``step_fn``).
        one = self.single_variant
        self._shapes = {q: StepShape(config, p if one else q, mesh, skip_empty_chunk=one) for q in (0, p)}
        # The padding chunk such a step feeds (built once: the host does not rebuild it per step).
        self._no_chunk = dict(pf_rows=np.full((p,), -1, np.int32), pf_tokens=np.zeros((p, config.chunk_size), np.int32),
                              pf_start=np.zeros((p,), np.int32), pf_lens=np.zeros((p,), np.int32))
        leaves, weights_def = jax.tree.flatten(weights)
        self._model, self._weight_leaves = intern((graphdef, weights_def)), tuple(leaves)

    def variants(self) -> tuple[int, ...]:
        """The step variants a run compiles, by prefill rows P: ``(P,)`` on a CPU, else ``(0, P)``."""
        p = self.config.max_prefill_rows
        return (p,) if self.single_variant else (0, p)

    def admit(self, free_ids: np.ndarray, ids: np.ndarray, lens: np.ndarray, toks: np.ndarray, salts: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Frees ``free_ids`` [R], then admits ``ids`` [A] (``lens`` [A], ``toks`` [A, W],
        ``salts`` uint32 [A]). Returns host ``(status [A], cached_tokens [A], shared_tokens [A],
        num_free)``."""
        args = call_setup.replicate_inputs(self.mesh, free_ids, ids, lens, toks, salts)
        self.state, res, num_free = admit_jit(self.config.manager, self.state, *args)
        return jax.device_get((res.status, res.cached_tokens, res.shared_tokens, num_free))

    def step(self, inp: StepInputs, prefill_rows: int) -> StepOutputs | list[StepOutputs]:
        """One step (``prefill_rows`` is P: 0 or ``max_prefill_rows``); returns host outputs: with
        ``decode_steps > 1`` a list, one per step the call ran (``inp.n_steps`` at most)."""
        if self.single_variant and not prefill_rows:
            inp = inp.replace(**self._no_chunk)
        args = call_setup.replicate_inputs(self.mesh, *pack_inputs(inp))
        self.pages, self.state, flat = packed_step_jit(self._model, self._weight_leaves, self.pages, self.state,
                                                       self.key, *args, shape=self._shapes[prefill_rows])
        # ``np.asarray`` of the one result array: a quarter of ``jax.device_get``'s cost per step.
        flat = np.asarray(flat)
        if self.config.decode_steps == 1:
            return unpack_outputs(self.config, flat)
        return unpack_burst(self.config, flat[:-1], int(flat[-1]))  # a burst: the steps it ran

    # -- ahead-of-time compilation (``ServingEngine.compile``) -------------------------------
    def lower_step(self, prefill_rows: int) -> jax.stages.Lowered:
        """The step variant with ``prefill_rows`` (0 or P) lowered on example inputs of its exact
        shapes and placement; ``.compile()`` fills the cache the ``step`` calls hit."""
        inp, _ = build_inputs(self.config, np.full((self.config.manager.max_seqs,), -1, np.int32), (), {}, (), ())
        if self._shapes[prefill_rows].prefill_rows:
            inp = inp.replace(**self._no_chunk)
        args = call_setup.replicate_inputs(self.mesh, *pack_inputs(inp))
        return packed_step_jit.lower(self._model, self._weight_leaves, self.pages, self.state, self.key, *args,
                                     shape=self._shapes[prefill_rows])

    def lower_admit(self, width: int) -> jax.stages.Lowered:
        """The ``admit`` program for ``max_prefill_rows`` prompts of ``width`` tokens, lowered."""
        r, a = self.config.manager.max_seqs, self.config.max_prefill_rows
        args = call_setup.replicate_inputs(self.mesh, np.full((r,), -1, np.int32), np.full((a,), -1, np.int32),
                                          np.zeros((a,), np.int32), np.zeros((a, width), np.int32),
                                          np.zeros((a,), np.uint32))
        return admit_jit.lower(self.config.manager, self.state, *args)

    def free(self, free_ids: np.ndarray) -> int:
        """Frees ``free_ids`` [R] (-1 pads); returns the free block count.

        Runs the decode-only step variant with no row decoding (its first op is this ``free``;
        nothing else changes the state): one program fewer to compile than a ``free`` of its own,
        for the cost of one step's forward over idle rows at the end of a run."""
        inp, _ = build_inputs(self.config, np.asarray(free_ids, np.int32), (), {}, (), ())
        out = self.step(inp, 0)
        return int((out[-1] if isinstance(out, list) else out).num_free)

    def cache_stats(self) -> CacheStats:
        """The prefix cache's counters (host ints: lookups, query_tokens, hit_tokens, evictions)."""
        return jax.device_get(self.state.cache.stats)


__all__ = ["DeviceStep", "StepInputs", "StepOutputs", "StepShape", "admit_jit", "build_inputs", "packed_step_fn",
           "packed_step_jit", "prefill_pieces", "single_step_variant", "step_fn", "step_jit"]
