"""Beam search as one on-device loop, candidates sharing KV blocks through ``select``.

Prompt ``b`` owns block-manager rows ``b * k .. b * k + k - 1`` (k = beam width). The prompt is
admitted and prefilled once into row ``b * k``; each step every row takes the table of the
candidate it continues (``select``: all rows switch at once, a path nobody continues is released,
blocks back to the free queue), then ``append`` gives each beam a slot for its new token
(copy-on-write where beams share a partly full last block) and one paged decode step scores the
next tokens. A prompt that is done frees its rows at once.

Algorithm (per prompt, deterministic, float32 log-probabilities of the model's raw logits):
  1. The k live beams start as one (the others score -inf, so step 0 expands only the prompt).
  2. Each step, the ``C = k * (1 + max(#EOS ids, 1))`` best (beam score + token log-prob) over all
     ``k * V`` continuations are ranked (ties: lower beam, then lower token id, first). Those
     ending in an EOS token *and ranked among the first k* become finished hypotheses of
     ``length`` = tokens generated (EOS included), scored ``sum_logprobs / length ** length_penalty``;
     the k best non-EOS continuations become the new beams.
  3. A prompt is done when it holds k finished hypotheses (early stopping, as ``transformers``'
     ``early_stopping=True``) or when its budget (``max_new_tokens``, overall or per prompt, or the
     context when prompt + ``max_new_tokens`` runs past it: then ``length_capped`` is set) is used:
     the last step's k beams are then finished hypotheses too.
  4. The k best finished hypotheses are returned, best first (ties: the earlier one first).
If the block pool runs out, the prompt stops there: its live beams join the finished hypotheses
at their current length and ``out_of_blocks`` is set.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct
from numpy.typing import ArrayLike

from paged_kv.config import ManagerConfig
from paged_kv.engine import call_setup
from paged_kv.engine.generate import BlockStats, bad_prompts
from paged_kv.engine.sampling import BeamParams, is_eos, with_model_eos
from paged_kv.engine.steps import block_counts, decode, prefill
from paged_kv.models.protocol import model_facts
from paged_kv.pallas_kernels.invariant import log_softmax as invariant_log_softmax
from paged_kv.reclaim import free
from paged_kv.share import select
from paged_kv.state import BlockManagerState
from paged_kv.status import Status

NEG_INF = -jnp.inf


@struct.dataclass
class BeamOutput:
    """Attributes:
    tokens: int32 ``[B, k, N]`` the k best hypotheses, best first; -1 after each one's end.
    lengths: int32 ``[B, k]`` generated tokens (EOS included); 0 for an empty slot.
    scores: float32 ``[B, k]`` ``sum_logprobs / length ** length_penalty`` (-inf: empty slot).
    sum_logprobs: float32 ``[B, k]``.
    out_of_blocks: bool ``[B]`` the prompt was cut short (or not admitted) for lack of blocks.
    stats: ``BlockStats`` per step.
    steps: int32 scalar, the longest returned hypothesis.
    length_capped: bool ``[B]`` the search ran to the context before ``max_new_tokens``: the
      prompt's length plus its ``max_new_tokens`` runs past what a sequence holds (``context -
      prompt_len + 1`` new tokens), so hypotheses without EOS stop shorter (never silently).
    bad_tokens: bool ``[B]`` the prompt held a token id outside ``[0, vocab_size)`` (only possible
      under the caller's ``jit``; otherwise ``beam_search`` raises ``ValueError``): it was not
      admitted, nothing was computed or cached, and its hypotheses are empty.
    """

    tokens: jax.Array
    lengths: jax.Array
    scores: jax.Array
    sum_logprobs: jax.Array
    out_of_blocks: jax.Array
    stats: BlockStats
    steps: jax.Array
    bad_tokens: jax.Array
    length_capped: jax.Array


@struct.dataclass
class _BeamLoop:
    """The while-loop carry. Iteration ``s >= 1`` feeds the beams' token ``s - 1`` through one
    decode step, chooses token ``s`` and reselects the block tables; step 0 chooses from the
    prefill's logits before the loop."""

    step: jax.Array
    cur: jax.Array  # [B * k] each beam's newest token
    done: jax.Array  # [B]
    out_of_blocks: jax.Array  # [B]
    length_capped: jax.Array  # [B] stopped at a budget the context cut
    beam_scores: jax.Array  # [B, k] sum of log-probs
    beam_tokens: jax.Array  # [B, k, N]
    pool_scores: jax.Array  # [B, k] normalized, descending
    pool_sums: jax.Array  # [B, k]
    pool_tokens: jax.Array  # [B, k, N]
    pool_lens: jax.Array  # [B, k]
    stats: BlockStats
    state: BlockManagerState
    pages: jax.Array


def _normalize(sums, length, penalty: float):
    return sums / jnp.maximum(length, 1).astype(jnp.float32) ** penalty


def _merge(loop: _BeamLoop, sums, tokens, lengths, mask, penalty: float) -> _BeamLoop:
    """Keep the k best of the pool plus the masked candidates ``[B, X]`` (pool entries first)."""
    k = loop.pool_scores.shape[1]
    scores = jnp.where(mask, _normalize(sums, lengths, penalty), NEG_INF)
    all_scores = jnp.concatenate([loop.pool_scores, scores], axis=1)
    all_sums = jnp.concatenate([loop.pool_sums, jnp.where(mask, sums, NEG_INF)], axis=1)
    all_tokens = jnp.concatenate([loop.pool_tokens, tokens], axis=1)
    all_lens = jnp.concatenate([loop.pool_lens, jnp.where(mask, lengths, 0)], axis=1)
    best, idx = jax.lax.top_k(all_scores, k)
    return loop.replace(pool_scores=best, pool_sums=jnp.take_along_axis(all_sums, idx, axis=1),
                        pool_tokens=jnp.take_along_axis(all_tokens, idx[:, :, None], axis=1),
                        pool_lens=jnp.where(jnp.isfinite(best), jnp.take_along_axis(all_lens, idx, axis=1), 0))


def _choose(loop: _BeamLoop, logp, step, active, budget, capped, params: BeamParams):
    """One beam step for the ``active`` prompts. logp float32 ``[B, k, V]``; ``capped`` bool
    ``[B]``: the context cut ``budget`` below ``max_new_tokens``.

    Returns (loop with beams and pool updated, parents int32 [B, k], new tokens int32 [B, k],
    finished bool [B]: prompts done after this step)."""
    b, k, v = logp.shape
    c = k * (1 + max(len(params.eos_token_ids), 1))
    cand = (loop.beam_scores[:, :, None] + logp).reshape(b, k * v)
    vals, idx = jax.lax.top_k(cand, c)  # ties: lower flat index first
    parent, tok = idx // v, idx % v
    eos = is_eos(tok, params.eos_token_ids)
    rank = jnp.arange(c, dtype=jnp.int32)[None, :]
    length = step + 1
    hist = jnp.take_along_axis(loop.beam_tokens, parent[:, :, None], axis=1).at[:, :, step].set(tok)
    ok = active[:, None] & jnp.isfinite(vals)
    loop = _merge(loop, vals, hist, jnp.full((b, c), length, jnp.int32), ok & eos & (rank < k), params.length_penalty)
    # The k best non-EOS continuations, in rank order.
    order = jnp.argsort(jnp.where(eos, c + rank, rank), axis=1)[:, :k]
    new_scores = jnp.take_along_axis(vals, order, axis=1)
    new_parent = jnp.take_along_axis(parent, order, axis=1)
    new_tok = jnp.take_along_axis(tok, order, axis=1)
    new_hist = jnp.take_along_axis(hist, order[:, :, None], axis=1)
    last = active & (length >= budget)
    loop = _merge(loop, new_scores, new_hist, jnp.full((b, k), length, jnp.int32),
                  last[:, None] & jnp.isfinite(new_scores), params.length_penalty)
    full = jnp.all(jnp.isfinite(loop.pool_scores), axis=1)
    finished = active & (last | full)
    keep = active[:, None]
    loop = loop.replace(beam_scores=jnp.where(keep, new_scores, loop.beam_scores),
                        beam_tokens=jnp.where(keep[:, :, None], new_hist, loop.beam_tokens),
                        length_capped=loop.length_capped | (last & capped))
    return loop, new_parent, new_tok, finished


def _reselect(loop: _BeamLoop, manager: ManagerConfig, parents, tokens, finished, active, release,
              k: int) -> _BeamLoop:
    """Block-manager side of a step: continuing prompts' rows take their parents' tables; finished
    prompts (and ``release``: those that ran out of blocks) free their rows at once."""
    b = parents.shape[0]
    rows = jnp.arange(b * k, dtype=jnp.int32).reshape(b, k)
    going = (active & ~finished)[:, None]
    state, _ = select(manager, loop.state, jnp.where(going, rows, -1).reshape(-1),
                      jnp.where(going, rows[:, :1] + parents, -1).reshape(-1))
    state, _ = free(manager, state, jnp.where((finished | release)[:, None], rows, -1).reshape(-1))
    return loop.replace(state=state, done=loop.done | finished,
                        cur=jnp.where(going, tokens, 0).reshape(-1).astype(jnp.int32))


def beam_search_loop(graphdef: nnx.GraphDef, weights: nnx.State, pages: jax.Array, state: BlockManagerState,
                     prompt_tokens: jax.Array, prompt_lens: jax.Array, *, manager: ManagerConfig, params: BeamParams,
                     impl: str, chunk_size: int, context: int, mesh: jax.sharding.Mesh | None = None,
                     budgets: jax.Array | None = None, batch_invariant: bool = False
                     ) -> tuple[BeamOutput, jax.Array, BlockManagerState]:
    """The traceable body of ``beam_search`` (arguments already checked; ``budgets``: optional
    int32 ``[B]`` per-prompt ``max_new_tokens``). Returns ``(BeamOutput, pages, state)``."""
    model = nnx.merge(graphdef, weights)
    params = with_model_eos(params, model_facts(model).eos_token_ids)  # for direct callers (``beam_search`` did)
    b = prompt_tokens.shape[0]
    k, steps = params.beam_width, params.max_new_tokens
    rows = jnp.arange(b * k, dtype=jnp.int32)
    lens = prompt_lens.astype(jnp.int32)
    wanted = jnp.int32(steps) if budgets is None else jnp.clip(budgets.astype(jnp.int32), 1, steps)
    # The context holds ``context - lens + 1`` new tokens; a budget past it is cut, and flagged.
    budget = jnp.minimum(wanted, context - lens + 1)
    capped = budget < wanted

    # A prompt with an id outside the vocabulary is not admitted (nothing computed or cached).
    bad = bad_prompts(prompt_tokens, lens, model.vocab_size)
    # Each prompt is admitted and prefilled once, into its first beam's row; step 0's ``select``
    # gives the other beams its table.
    state, pages, logits, status = prefill(model, pages, manager, state, jnp.where(bad, -1, rows[::k]),
                                           prompt_tokens, lens, chunk_size=chunk_size, impl=impl, mesh=mesh,
                                               batch_invariant=batch_invariant)
    admitted = status == Status.OK
    used, shared = block_counts(manager, state, rows)
    first = jnp.where(jnp.arange(k) == 0, 0.0, NEG_INF).astype(jnp.float32)
    loop = _BeamLoop(
        step=jnp.int32(0), cur=jnp.zeros((b * k,), jnp.int32), done=~admitted, out_of_blocks=~admitted & ~bad,
        length_capped=jnp.zeros((b,), bool),
        beam_scores=jnp.broadcast_to(first, (b, k)), beam_tokens=jnp.full((b, k, steps), -1, jnp.int32),
        pool_scores=jnp.full((b, k), NEG_INF, jnp.float32), pool_sums=jnp.full((b, k), NEG_INF, jnp.float32),
        pool_tokens=jnp.full((b, k, steps), -1, jnp.int32), pool_lens=jnp.zeros((b, k), jnp.int32),
        stats=BlockStats.zeros(steps).record(0, used, shared, 0), state=state, pages=pages)
    log_softmax = invariant_log_softmax if batch_invariant else (lambda x: jax.nn.log_softmax(x, axis=-1))
    logp = jnp.broadcast_to(log_softmax(logits)[:, None], (b, k, logits.shape[-1]))
    loop, parents, toks, finished = _choose(loop, logp, 0, admitted, budget, capped, params)
    loop = _reselect(loop, manager, parents, toks, finished, admitted, jnp.zeros((b,), bool), k)

    def body(loop: _BeamLoop):
        s = loop.step + 1
        active = ~loop.done
        live = jnp.repeat(active, k)
        state, pages, logits, st, copies = decode(model, loop.pages, manager, loop.state, rows, loop.cur, live,
                                                  impl=impl, mesh=mesh, batch_invariant=batch_invariant)
        used, shared = block_counts(manager, state, rows)
        loop = loop.replace(step=s, state=state, pages=pages, stats=loop.stats.record(s, used, shared, copies))
        # A prompt that ran out of blocks stops: its beams are hypotheses of their current length.
        failed = active & jnp.any((live & (st != Status.OK)).reshape(b, k), axis=1)
        loop = _merge(loop, loop.beam_scores, loop.beam_tokens, jnp.full((b, k), s, jnp.int32),
                      failed[:, None] & jnp.isfinite(loop.beam_scores), params.length_penalty)
        loop = loop.replace(done=loop.done | failed, out_of_blocks=loop.out_of_blocks | failed)
        active = active & ~failed
        logp = log_softmax(logits).reshape(b, k, -1)
        loop, parents, toks, finished = _choose(loop, logp, s, active, budget, capped, params)
        return _reselect(loop, manager, parents, toks, finished, active, failed, k)

    loop = jax.lax.while_loop(lambda loop: (loop.step + 1 < steps) & ~jnp.all(loop.done), body, loop)
    out = BeamOutput(tokens=loop.pool_tokens, lengths=loop.pool_lens, scores=loop.pool_scores,
                     sum_logprobs=loop.pool_sums, out_of_blocks=loop.out_of_blocks, stats=loop.stats,
                     steps=jnp.max(loop.pool_lens), bad_tokens=bad, length_capped=loop.length_capped)
    return out, loop.pages, loop.state


beam_search_jit = jax.jit(beam_search_loop, static_argnames=("graphdef", "manager", "params", "impl", "chunk_size",
                                                             "context", "mesh", "batch_invariant"),
                          donate_argnames=("pages", "state"))


def beam_search(model: nnx.Module | tuple[nnx.GraphDef, nnx.State], pages: jax.Array, prompt_tokens: ArrayLike,
                prompt_lens: ArrayLike, params: BeamParams, *, manager: ManagerConfig,
                state: BlockManagerState | None = None, max_new_tokens: ArrayLike | None = None, impl: str = "auto",
                chunk_size: int | None = None, mesh: jax.sharding.Mesh | None = None,
                batch_invariant: bool = False) -> tuple[BeamOutput, jax.Array, BlockManagerState]:
    """Beam search of width ``params.beam_width`` for each prompt, on the device in one jitted loop.

    Arguments as in ``generate`` (no key: beam search is deterministic; ``mesh`` likewise runs it
    tensor-parallel; ``batch_invariant`` as there;
    ``max_new_tokens``: optional int32 ``[B]`` per-prompt budgets, clipped to
    ``params.max_new_tokens``, which sizes the outputs; a prompt whose length plus budget runs past
    the context stops there, with ``BeamOutput.length_capped`` set); rows ``[0, B * k)`` of the block manager
    must be free and are free again on return. Returns ``(BeamOutput, pages, state)``.

    ``prompt_tokens``: int32 ``[B, L]``; ids at positions ``< prompt_lens`` must be in
    ``[0, vocab_size)`` (checked when concrete; under the caller's ``jit`` such a prompt is skipped
    and flagged in ``BeamOutput.bad_tokens``).

    Raises:
      ValueError: bad parameters, shapes or dtypes, a token id outside ``[0, vocab_size)`` (named
        with its prompt and position), ``B * k`` more sequences than ``manager.max_seqs``, a
        prompt longer than the context, a vocabulary smaller than the candidates per step, or a
        bad mesh, before anything is compiled.
    """
    if not isinstance(params, BeamParams):
        raise ValueError(f"params must be a BeamParams, got {type(params).__name__}")
    graphdef, weights, facts, pages, mesh = call_setup.place(model, pages, mesh)
    params = with_model_eos(params, facts.eos_token_ids)  # None: the model's EOS ids, before tracing
    layout = call_setup.group_layout((graphdef, weights), manager)
    k = params.beam_width
    req = call_setup.check_call(facts, manager, pages, state, prompt_tokens, prompt_lens,
                                 rows_per_prompt=k, what="beam_width", budgets=max_new_tokens,
                                 chunk_size=chunk_size, impl=impl, eos_token_ids=params.eos_token_ids, layout=layout,
                                 vocab_needed=k * (1 + max(len(params.eos_token_ids), 1)),
                                 batch_invariant=bool(batch_invariant))
    # Pallas kernels over a mesh: one weight array per layer (as in `generate`).
    graphdef, weights = call_setup.layer_layout(graphdef, weights, impl, mesh)
    state = call_setup.initial_state(manager, state)
    budgets = jnp.full((req.num_prompts,), params.max_new_tokens, jnp.int32) if max_new_tokens is None else \
        jnp.asarray(max_new_tokens, jnp.int32)
    state, toks, lens, budgets = call_setup.replicate_inputs(mesh, state, jnp.asarray(prompt_tokens, jnp.int32),
                                                           jnp.asarray(prompt_lens, jnp.int32), budgets)
    return beam_search_jit(graphdef, weights, pages, state, toks, lens, manager=manager, params=params, impl=impl,
                           chunk_size=req.chunk_size, context=req.context, mesh=mesh, budgets=budgets,
                           batch_invariant=bool(batch_invariant))


__all__ = ["BeamOutput", "beam_search", "beam_search_jit", "beam_search_loop"]
