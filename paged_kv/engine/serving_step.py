"""The serving engine's device side: one jitted step of static shapes (two variants), the
``admit`` program, and ``DeviceStep``, which holds the device arrays and calls them.

The step (one ``jax.jit``; shapes fixed by ``R = max_seqs``, ``P`` (0 when no prefill chunk runs,
else ``max_prefill_rows``: two compiled variants) and ``C = chunk_size``): ``free`` finished or
preempted rows -> ``select`` (beam reselection) -> paged prefill forward of one cohort chunk
``[P, C]`` -> ``append`` one token per decoding row, ``copy_blocks`` for copy-on-write, paged
decode forward ``[R]`` -> ``fork`` the samples of prompts whose prefill ended -> per-row sampling
(greedy / temperature / top-k / top-p, each row with its own parameters and key) and the top
candidates for beams. Padding rows use sequence id -1. The host reads back a few ``[R]`` arrays
per step (``StepOutputs``), in one ``device_get``.

``DeviceStep`` is what the host scheduler (``engine.scheduler``) talks to: ``admit``, ``step``,
``free`` and ``cache_stats`` take and return host (numpy) values, so a test can hand the
scheduler a fake device with the same four methods and no model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from models.llama import in_vocab
from models.paged import make_paged_batch, paged_forward
from paged_kv.admission import admit
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.engine import requests as _requests
from paged_kv.engine.sampling import sample_rows
from paged_kv.engine.serving_types import ServingConfig
from paged_kv.allocate import AppendResult, append
from paged_kv.engine.steps import decode_appended
from paged_kv.reclaim import free
from paged_kv.scan import per_platform
from paged_kv.share import fork, select
from paged_kv.share import free_select_append as share_free_select_append
from paged_kv.state import BlockManagerState


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The static part of a step's jit key."""

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


def _unless_padding(ids: jax.Array, op, state: BlockManagerState) -> BlockManagerState:
    """``op(state)`` when some row of ``ids`` (int32 [R]) is not padding, else ``state`` as is.

    Most steps free, select and fork nothing; the op on all-padding rows leaves the state
    unchanged anyway, so the ``lax.cond`` gives the same state and saves the op's gathers and
    scatters over R rows on those steps (the CPU runs only the branch taken). No KV page passes
    through the cond. On other backends the op runs unconditionally: XLA:GPU reads a
    conditional's predicate on the host (a device-to-host sync per step), which costs more than
    the op's few small gathers (the GPU compile gate counts a step's conditionals)."""
    def skip_if_padding(state):
        return jax.lax.cond(jnp.any(ids >= 0), op, lambda s: s, state)
    return per_platform(state, cpu=skip_if_padding, default=op)


def step_fn(graphdef, weights, pages, state: BlockManagerState, key, inp: StepInputs, *, shape: StepShape):
    cfg = shape.config
    mgr = cfg.manager
    model = nnx.merge(graphdef, weights)
    r = mgr.max_seqs
    rows = jnp.arange(r, dtype=jnp.int32)
    dec_ids = jnp.where(inp.dec_live, rows, -1)
    dec_tokens = inp.dec_tokens.astype(jnp.int32) if mgr.prefix_caching else None
    pf_rows = inp.pf_rows if shape.prefill_rows else jnp.zeros((0,), jnp.int32)

    def tables_of(state):
        return jnp.where((pf_rows >= 0)[:, None], state.block_tables[jnp.clip(pf_rows, 0, r - 1)], NULL_BLOCK)

    def free_and_select(state):
        state = _unless_padding(inp.free_ids, lambda s: free(mgr, s, inp.free_ids)[0], state)
        state = _unless_padding(inp.sel_dst, lambda s: select(mgr, s, inp.sel_dst, inp.sel_parent)[0], state)
        # The decode rows' append comes after the prefill forward here (``appended`` below); the
        # result is a placeholder the CPU program never reads.
        placeholder = AppendResult(status=dec_ids, slots=dec_ids, copy_src=dec_ids, copy_dst=dec_ids,
                                   num_copies=jnp.int32(0))
        return state, placeholder, tables_of(state)

    def free_select_append(state):
        # On a GPU the decode rows' append (its bookkeeping only) runs before the prefill
        # forward, with free and select: one host sync for the three
        # (``share.free_select_append``). The prefill chunk's tables are still read between
        # select and append, the forward does not touch the manager's state, and the pages are
        # written in the same order (prefill, then the copies and the decode forward), so every
        # state and output is the same as in the CPU order.
        state, _, _, res, tables = share_free_select_append(mgr, state, inp.free_ids, inp.sel_dst, inp.sel_parent,
                                                            dec_ids, dec_tokens, pf_rows)
        return state, res, tables

    # Named scopes only label the HLO (scripts/profile_decode.py attributes time by them).
    with jax.named_scope("manager_free_select"):
        state, res, pf_tables = per_platform(state, cpu=free_and_select, default=free_select_append)
    pf_logits = None
    vocab = model.vocab_size
    bad_tokens = jnp.sum(~in_vocab(inp.dec_tokens, vocab) & inp.dec_live, dtype=jnp.int32)
    if shape.prefill_rows:
        pr = inp.pf_rows
        valid = pr >= 0
        q_lens = jnp.where(valid, inp.pf_lens, 0)
        fed = jnp.arange(cfg.chunk_size, dtype=jnp.int32)[None, :] < q_lens[:, None]
        bad_tokens += jnp.sum(~in_vocab(inp.pf_tokens, vocab) & fed, dtype=jnp.int32)
        batch = make_paged_batch(pf_tables, inp.pf_start, q_lens, cfg.chunk_size, mgr.block_size)
        with jax.named_scope("prefill_chunk"):
            pf_logits, pages = paged_forward(model, pages, batch, inp.pf_tokens, impl=cfg.impl, last_only=True,
                                             mesh=shape.mesh)

    def appended(state, res):
        with jax.named_scope("manager_append"):
            return append(mgr, state, dec_ids, dec_tokens)

    state, res = per_platform(state, res, cpu=appended, default=lambda state, res: (state, res))
    state, pages, logits, status, copies = decode_appended(model, pages, mgr, state, rows, inp.dec_tokens, res,
                                                           impl=cfg.impl, mesh=shape.mesh)
    if pf_logits is not None:
        logits = logits.at[jnp.where(inp.pf_rows >= 0, inp.pf_rows, r)].set(pf_logits, mode="drop")
    with jax.named_scope("manager_fork"):
        state = _unless_padding(inp.fork_dst, lambda s: fork(mgr, s, inp.fork_src, inp.fork_dst)[0], state)
    with jax.named_scope("sampling"):
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


step_jit = jax.jit(step_fn, static_argnames=("graphdef", "shape"), donate_argnames=("pages", "state"))


def admit_fn(manager: ManagerConfig, state, free_ids, seq_ids, lens, tokens, salts):
    state, _ = free(manager, state, free_ids)
    state, res = admit(manager, state, seq_ids, lens, tokens if manager.prefix_caching else None, salts)
    return state, res, state.queue.num_free


admit_jit = jax.jit(admit_fn, static_argnums=0, donate_argnums=1)

def build_inputs(config: ServingConfig, free_ids: np.ndarray, select_pairs, pending: dict, cohort, chunk: int,
                 running) -> tuple[StepInputs, tuple | None]:
    """A step's ``StepInputs`` (numpy) from the scheduler's host state.

    Args:
      free_ids: int32 [R] rows to free (-1 pads); select_pairs: ``(dst, parent)`` beam reselections.
      pending: row -> token each decoding row feeds.
      cohort: the ``CohortRow`` s being prefilled (empty: no prefill chunk, P = 0); chunk: its chunk index.
      running: the running ``Family`` s (per-row sampling parameters and key parts).
    Returns ``(inputs, pf)``: ``pf`` is None without a chunk, else ``(rows [P], tokens [P, C],
    start [P], lens [P], ends)`` with ``ends[i]`` true when cohort row ``i``'s prefill ends here.
    """
    r = config.manager.max_seqs
    i32 = lambda fill=-1: np.full((r,), fill, np.int32)  # noqa: E731
    sel_dst, sel_parent = i32(), i32()
    for i, (d, p) in enumerate(select_pairs):
        sel_dst[i], sel_parent[i] = d, p
    dec_tokens, dec_live = i32(0), np.zeros((r,), bool)
    for row, tok in pending.items():
        dec_tokens[row], dec_live[row] = tok, True
    fork_src, fork_dst, logit_src = i32(), i32(), np.arange(r, dtype=np.int32)
    temperature, top_p = np.zeros((r,), np.float32), np.ones((r,), np.float32)
    top_k, seed, sample_idx, token_idx = i32(0), i32(0), i32(0), i32(0)
    pf = None
    if cohort:
        c, size = chunk, config.chunk_size
        rows_, toks_, start_, lens_, ends = [], [], [], [], []
        nf = 0
        for cr in cohort:
            n = len(cr.tokens)
            lo = max(c * size, cr.start)
            q = max(0, min((c + 1) * size, n) - lo) if lo < n else 0
            part = np.zeros((size,), np.int32)
            part[:q] = cr.tokens[lo:lo + q]
            rows_.append(cr.row if q > 0 else -1)
            toks_.append(part)
            start_.append(min(lo, n))
            lens_.append(q)
            end = q > 0 and lo + q == n
            ends.append(end)
            if end:
                for dst in cr.fork_to:
                    fork_src[nf], fork_dst[nf] = cr.row, dst
                    logit_src[dst] = cr.row
                    nf += 1
        pad = config.max_prefill_rows - len(rows_)
        pf = (np.array(rows_ + [-1] * pad, np.int32),
              np.stack(toks_ + [np.zeros((size,), np.int32)] * pad),
              np.array(start_ + [0] * pad, np.int32), np.array(lens_ + [0] * pad, np.int32), ends)
    # Per-row sampling parameters and key parts.
    for fam in running:
        if fam.req.is_beam:
            continue
        prm = fam.req.params
        for idx, s in enumerate(fam.samples):
            rows = [s.row] if s.row is not None else []
            for row in rows:
                temperature[row], top_k[row], top_p[row] = prm.temperature, prm.top_k, prm.top_p
                seed[row], sample_idx[row], token_idx[row] = fam.seed, idx, len(s.tokens)
    pf_arrays = pf[:4] if pf else (np.full((1,), -1, np.int32), np.zeros((1, config.chunk_size), np.int32),
                                   np.zeros((1,), np.int32), np.zeros((1,), np.int32))
    inp = StepInputs(free_ids=free_ids, sel_dst=sel_dst, sel_parent=sel_parent, pf_rows=pf_arrays[0],
                     pf_tokens=pf_arrays[1], pf_start=pf_arrays[2], pf_lens=pf_arrays[3], dec_tokens=dec_tokens,
                     dec_live=dec_live, fork_src=fork_src, fork_dst=fork_dst, logit_src=logit_src,
                     temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, sample_idx=sample_idx,
                     token_idx=token_idx)
    return inp, pf


class DeviceStep:
    """The device arrays of a serving engine and the three programs that update them.

    Holds the model (``graphdef`` static, ``weights``), the KV ``pages``, the block-manager
    ``state`` and the sampling ``key``; ``pages`` and ``state`` are donated to every call and
    replaced by its results. Every method takes and returns host (numpy / int) values: the
    scheduler never sees a ``jax.Array``.
    """

    def __init__(self, config: ServingConfig, graphdef, weights, pages, state: BlockManagerState, key, mesh=None):
        self.config, self.graphdef, self.weights, self.pages, self.state, self.key, self.mesh = (
            config, graphdef, weights, pages, state, key, mesh)
        self._shapes = {p: StepShape(config, p, mesh) for p in (0, config.max_prefill_rows)}

    def admit(self, free_ids, ids, lens, toks, salts):
        """Frees ``free_ids`` [R], then admits ``ids`` [A] (``lens`` [A], ``toks`` [A, W],
        ``salts`` uint32 [A]). Returns host ``(status [A], cached_tokens [A], shared_tokens [A],
        num_free)``."""
        args = _requests.replicate_inputs(self.mesh, free_ids, ids, lens, toks, salts)
        self.state, res, num_free = admit_jit(self.config.manager, self.state, *args)
        return jax.device_get((res.status, res.cached_tokens, res.shared_tokens, num_free))

    def step(self, inp: StepInputs, prefill_rows: int) -> StepOutputs:
        """One step (``prefill_rows`` is P: 0 or ``max_prefill_rows``); returns host outputs."""
        if self.mesh is not None:
            (inp,) = _requests.replicate_inputs(self.mesh, inp)
        self.pages, self.state, out = step_jit(self.graphdef, self.weights, self.pages, self.state, self.key,
                                               inp, shape=self._shapes[prefill_rows])
        return jax.device_get(out)

    # -- ahead-of-time compilation (``ServingEngine.compile``) -------------------------------
    def lower_step(self, prefill_rows: int):
        """The step variant with ``prefill_rows`` (0 or P) lowered on example inputs of its exact
        shapes and placement; ``.compile()`` fills the cache the ``step`` calls hit."""
        inp, _ = build_inputs(self.config, np.full((self.config.manager.max_seqs,), -1, np.int32), (), {}, (), 0, ())
        if prefill_rows:
            p, c = prefill_rows, self.config.chunk_size
            inp = inp.replace(pf_rows=np.full((p,), -1, np.int32), pf_tokens=np.zeros((p, c), np.int32),
                              pf_start=np.zeros((p,), np.int32), pf_lens=np.zeros((p,), np.int32))
        if self.mesh is not None:
            (inp,) = _requests.replicate_inputs(self.mesh, inp)
        return step_jit.lower(self.graphdef, self.weights, self.pages, self.state, self.key, inp,
                              shape=self._shapes[prefill_rows])

    def lower_admit(self, width: int):
        """The ``admit`` program for ``max_prefill_rows`` prompts of ``width`` tokens, lowered."""
        r, a = self.config.manager.max_seqs, self.config.max_prefill_rows
        args = _requests.replicate_inputs(self.mesh, np.full((r,), -1, np.int32), np.full((a,), -1, np.int32),
                                          np.zeros((a,), np.int32), np.zeros((a, width), np.int32),
                                          np.zeros((a,), np.uint32))
        return admit_jit.lower(self.config.manager, self.state, *args)

    def free(self, free_ids) -> int:
        """Frees ``free_ids`` [R] (-1 pads); returns the free block count.

        Runs the decode-only step variant with no row decoding (its first op is this ``free``;
        nothing else changes the state): one program fewer to compile than a ``free`` of its own,
        for the cost of one step's forward over idle rows at the end of a run."""
        inp, _ = build_inputs(self.config, np.asarray(free_ids, np.int32), (), {}, (), 0, ())
        return int(self.step(inp, 0).num_free)

    def cache_stats(self):
        """The prefix cache's counters (host ints: lookups, query_tokens, hit_tokens, evictions)."""
        return jax.device_get(self.state.cache.stats)


__all__ = ["DeviceStep", "StepInputs", "StepOutputs", "StepShape", "admit_jit", "build_inputs", "step_fn", "step_jit"]
