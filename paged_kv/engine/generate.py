"""Sampling (greedy, temperature, top-k, top-p; ``n`` answers per prompt) as one on-device loop.

Everything runs under one ``jax.jit``: admission and chunked prefill of each prompt *once*,
``fork`` of its table to the other ``n - 1`` samples, then a ``lax.while_loop`` of decode steps
(``append`` -> ``copy_blocks`` -> paged forward -> sampler). A sample that produces an EOS token
or reaches its budget is freed in the same step, so its blocks are back in the free queue at once.
The loop ends when every sample is finished; nothing goes back to the host per token.

Rows: prompt ``b``'s sample ``i`` is block-manager row ``b * n + i`` (rows ``[0, B * n)`` must be
free). With prefix caching on, prompts that repeat cached blocks skip their prefill.

Sampling keys follow the seeding rule of ``engine.sampling``: token ``t`` of sample ``i`` of prompt
``b`` is drawn with ``sample_keys(root_key(), seeds[b], i, t)``, each row with its own key, so a
prompt's samples depend on its seed, not on its row or the batch size. ``seeds`` defaults to
``derive_seeds(key, B)`` and is returned in ``GenerateOutput.seeds``.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from flax import nnx, struct
from numpy.typing import ArrayLike

from paged_kv.config import ManagerConfig
from paged_kv.engine import call_setup
from paged_kv.engine.sampling import (
    SamplingParams,
    derive_seeds,
    is_eos,
    root_key,
    sample_keys,
    sample_tokens,
    with_model_eos,
)
from paged_kv.engine.steps import block_counts, decode, prefill
from paged_kv.models.protocol import in_vocab, model_facts
from paged_kv.reclaim import free
from paged_kv.share import fork
from paged_kv.state import BlockManagerState
from paged_kv.status import Status, code_names


class FinishReason(enum.IntEnum):
    """Why a sequence stopped (``GenerateOutput.finish_reason``)."""

    EOS = 1
    LENGTH = 2
    """Its budget (``max_new_tokens``, per prompt or overall) is used up."""
    NO_BLOCKS = 3
    """The block pool or its block table ran out: the answer is cut short (the on-device loop
    does not preempt; a serving loop would)."""
    REJECTED = 4
    """Admission failed (not enough free blocks for the prompt): nothing generated."""
    BAD_TOKEN = 5
    """The prompt holds a token id outside ``[0, vocab_size)`` (only possible when ``generate``
    runs inside the caller's ``jit``, where ids cannot be checked on the host; otherwise it raises
    ``ValueError``): the prompt is not admitted, nothing is computed or cached, nothing generated."""
    LENGTH_CAPPED = 6
    """It stopped before ``max_new_tokens``, at the last position a sequence holds: the prompt's
    length plus ``max_new_tokens`` runs past the context (``min(max_blocks_per_seq x block_size,
    the model's max_positions)``), which holds ``context - prompt_len + 1`` new tokens (the last
    one needs no KV slot). Never silent: ``LENGTH`` means ``max_new_tokens`` was reached."""

    @classmethod
    def names(cls, codes: ArrayLike) -> list | str:
        """``FinishReason.names(out.finish_reason)``: the name of every code, nested like
        ``tolist()`` (0, a row that never ran, shows as "0")."""
        return code_names(cls, codes)


@struct.dataclass
class BlockStats:
    """Per generation step (``[N]``; step ``s`` produces token ``s``; steps not run hold 0).

    Attributes:
      used: blocks held by any table in the pool while the step runs (after its ``append``;
        step 0: after prefill and ``fork``).
      shared: blocks held by two or more of this call's sequences.
      copies: copy-on-write block copies the step made.
    """

    used: jax.Array
    shared: jax.Array
    copies: jax.Array

    @staticmethod
    def zeros(n: int) -> BlockStats:
        z = jnp.zeros((n,), jnp.int32)
        return BlockStats(used=z, shared=z, copies=z)

    def record(self, step: jax.Array, used: jax.Array, shared: jax.Array, copies: jax.Array) -> BlockStats:
        return BlockStats(used=self.used.at[step].set(used, mode="drop"),
                          shared=self.shared.at[step].set(shared, mode="drop"),
                          copies=self.copies.at[step].set(copies, mode="drop"))


@struct.dataclass
class GenerateOutput:
    """Attributes:
    tokens: int32 ``[B, n, N]`` generated tokens (EOS included), -1 after the end.
    logprobs: float32 ``[B, n, N]`` log-probability of each token under the model (0 after the end).
    lengths: int32 ``[B, n]`` tokens generated.
    finish_reason: int32 ``[B, n]``, a ``FinishReason`` (``BAD_TOKEN``: the prompt had an id
      outside the vocabulary and was skipped).
    stats: ``BlockStats`` per step.
    steps: int32 scalar, steps run (the longest answer).
    seeds: int32 ``[B]`` each prompt's sampling seed (the ``seeds`` argument or the ones derived
      from the key): ``generate`` with ``seeds=`` these gives each prompt the same samples in any
      row and batch (where its logits are the same).
    """

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    finish_reason: jax.Array
    stats: BlockStats
    steps: jax.Array
    seeds: jax.Array | None = None

    def finish_reason_names(self) -> list:
        """``finish_reason`` by name, ``[B][n]`` (``FinishReason.names``): "EOS", "LENGTH", ...
        Reads the device (not under ``jit``)."""
        return FinishReason.names(self.finish_reason)


@struct.dataclass
class _SampleLoop:
    """The while-loop carry. Iteration ``s >= 1`` feeds token ``s - 1`` (``cur``) through one
    decode step and samples token ``s``; token 0 is sampled from the prefill's logits before the
    loop. (A ``lax.cond`` around the decode step instead costs a copy of the pages per step.)"""

    step: jax.Array
    seed: jax.Array  # [R] the seed of each row's prompt
    cur: jax.Array  # [R] the newest token of each row
    live: jax.Array  # [R]
    budget: jax.Array  # [R] tokens this row may generate
    capped: jax.Array  # [R] bool: the context cut ``budget`` below the row's max_new_tokens
    tokens: jax.Array  # [R, N]
    logprobs: jax.Array  # [R, N]
    lengths: jax.Array  # [R]
    finish: jax.Array  # [R]
    stats: BlockStats
    state: BlockManagerState
    pages: jax.Array


def bad_prompts(prompt_tokens: jax.Array, prompt_lens: jax.Array, vocab_size: int) -> jax.Array:
    """bool ``[B]``: prompt ``b`` (int ``[B, L]`` tokens, int32 ``[B]`` lengths) holds an id outside
    ``[0, vocab_size)`` at a position ``< prompt_lens[b]``. One compare per token, on the device."""
    valid = jnp.arange(prompt_tokens.shape[1], dtype=jnp.int32)[None, :] < prompt_lens[:, None]
    return jnp.any(valid & ~in_vocab(prompt_tokens, vocab_size), axis=1)


def _emit(loop: _SampleLoop, logits, rows, release, manager: ManagerConfig, params: SamplingParams) -> _SampleLoop:
    """Sample token ``loop.step`` for the live rows, record it, finish rows at EOS or budget, and
    free finished rows (and ``release`` rows) at once, not at the end of the call."""
    s, live = loop.step, loop.live
    with jax.named_scope("sampling"):
        # One key per row from its prompt's seed, its sample index and the token index, never from
        # the row itself: a prompt draws the same noise in any row and at any batch size.
        keys = None if params.greedy else sample_keys(root_key(), loop.seed, rows % params.n,
                                                      jnp.full(rows.shape, s, jnp.int32))
        tok, logp = sample_tokens(logits, keys, params)
    lengths = loop.lengths + live.astype(jnp.int32)
    eos = live & is_eos(tok, params.eos_token_ids)
    out_of_budget = live & ~eos & (lengths >= loop.budget)
    length = jnp.where(loop.capped, FinishReason.LENGTH_CAPPED, FinishReason.LENGTH)
    done = eos | out_of_budget
    with jax.named_scope("manager_free"):
        state, _ = free(manager, loop.state, jnp.where(done | release, rows, -1))
    return loop.replace(
        state=state, cur=jnp.where(live, tok, 0), live=live & ~done, lengths=lengths,
        tokens=loop.tokens.at[:, s].set(jnp.where(live, tok, -1)),
        logprobs=loop.logprobs.at[:, s].set(jnp.where(live, logp, 0.0)),
        finish=jnp.where(eos, FinishReason.EOS, jnp.where(out_of_budget, length, loop.finish)).astype(jnp.int32))


def generate_loop(graphdef: nnx.GraphDef, weights: nnx.State, pages: jax.Array, state: BlockManagerState,
                  prompt_tokens: jax.Array, prompt_lens: jax.Array, budgets: jax.Array, key: jax.Array,
                  seeds: jax.Array | None = None, *, manager: ManagerConfig, params: SamplingParams, impl: str,
                  chunk_size: int, context: int,
                  mesh: jax.sharding.Mesh | None = None, batch_invariant: bool = False
                  ) -> tuple[GenerateOutput, jax.Array, BlockManagerState]:
    """The traceable body of ``generate`` (arguments already checked; ``seeds`` int32 ``[B]`` or
    None: ``derive_seeds(key, B)``). Returns ``(GenerateOutput, pages, state)``."""
    model = nnx.merge(graphdef, weights)
    params = with_model_eos(params, model_facts(model).eos_token_ids)  # for direct callers (``generate`` did)
    b = prompt_tokens.shape[0]
    n, steps = params.n, params.max_new_tokens
    r = b * n
    rows = jnp.arange(r, dtype=jnp.int32)
    lens = prompt_lens.astype(jnp.int32)
    seeds = derive_seeds(key, b) if seeds is None else seeds.astype(jnp.int32)

    # A prompt with an id outside the vocabulary is not admitted (a padding row for ``admit``):
    # nothing of it is computed, written or registered in the prefix cache.
    bad = bad_prompts(prompt_tokens, lens, model.vocab_size)
    bad_rows = jnp.repeat(bad, n)
    # Each prompt is admitted and prefilled once, into its first sample's row; the others fork it.
    with jax.named_scope("prefill"):
        state, pages, logits, status = prefill(model, pages, manager, state, jnp.where(bad, -1, rows[::n]),
                                               prompt_tokens, lens, chunk_size=chunk_size, impl=impl, mesh=mesh,
                                               batch_invariant=batch_invariant)
    admitted = jnp.repeat(status == Status.OK, n)
    if n > 1:
        is_child = rows % n != 0
        state, _ = fork(manager, state, jnp.where(is_child, (rows // n) * n, -1),
                        jnp.where(is_child & admitted, rows, -1))
    # The context holds ``context - lens + 1`` new tokens (the last needs no KV slot); a budget
    # past it stops there, flagged LENGTH_CAPPED (under the caller's jit it cannot be refused).
    wanted = jnp.clip(budgets.astype(jnp.int32), 1, steps)
    budget = jnp.minimum(wanted, context - lens + 1)
    used, shared = block_counts(manager, state, rows)
    loop = _SampleLoop(
        step=jnp.int32(0), seed=jnp.repeat(seeds, n), cur=jnp.zeros((r,), jnp.int32), live=admitted,
        budget=jnp.repeat(budget, n), capped=jnp.repeat(budget < wanted, n),
        tokens=jnp.full((r, steps), -1, jnp.int32), logprobs=jnp.zeros((r, steps), jnp.float32),
        lengths=jnp.zeros((r,), jnp.int32),
        finish=jnp.where(admitted, 0, jnp.where(bad_rows, FinishReason.BAD_TOKEN, FinishReason.REJECTED)
                         ).astype(jnp.int32),
        stats=BlockStats.zeros(steps).record(0, used, shared, 0), state=state, pages=pages)
    no_release = jnp.zeros((r,), bool)
    loop = _emit(loop, jnp.repeat(logits, n, axis=0), rows, no_release, manager, params)

    @jax.named_scope("decode_step")
    def body(loop: _SampleLoop):
        s = loop.step + 1
        state, pages, logits, st, copies = decode(model, loop.pages, manager, loop.state, rows, loop.cur, loop.live,
                                                  impl=impl, mesh=mesh, batch_invariant=batch_invariant)
        failed = loop.live & (st != Status.OK)
        used, shared = block_counts(manager, state, rows)
        loop = loop.replace(
            step=s, state=state, pages=pages, live=loop.live & ~failed,
            finish=jnp.where(failed, FinishReason.NO_BLOCKS, loop.finish).astype(jnp.int32),
            stats=loop.stats.record(s, used, shared, copies))
        return _emit(loop, logits, rows, failed, manager, params)

    loop = jax.lax.while_loop(lambda loop: (loop.step + 1 < steps) & jnp.any(loop.live), body, loop)
    out = GenerateOutput(
        tokens=loop.tokens.reshape(b, n, steps), logprobs=loop.logprobs.reshape(b, n, steps),
        lengths=loop.lengths.reshape(b, n), finish_reason=loop.finish.reshape(b, n), stats=loop.stats,
        steps=jnp.max(loop.lengths), seeds=seeds)
    return out, loop.pages, loop.state


generate_jit = jax.jit(generate_loop, static_argnames=("graphdef", "manager", "params", "impl", "chunk_size",
                                                       "context", "mesh", "batch_invariant"),
                       donate_argnames=("pages", "state"))
"""``generate_loop`` compiled once per (model graph, manager config, params, shapes); pages and
block-manager state are donated."""


def generate(model: nnx.Module | tuple[nnx.GraphDef, nnx.State], pages: jax.Array, prompt_tokens: ArrayLike,
             prompt_lens: ArrayLike, key: ArrayLike, params: SamplingParams, *, manager: ManagerConfig,
             state: BlockManagerState | None = None, max_new_tokens: ArrayLike | None = None,
             impl: str = "auto", chunk_size: int | None = None, mesh: jax.sharding.Mesh | None = None,
             seeds: ArrayLike | None = None,
             batch_invariant: bool = False) -> tuple[GenerateOutput, jax.Array, BlockManagerState]:
    """Samples ``params.n`` answers for each prompt, all on the device in one jitted loop.

    Args:
      model: an NNX module implementing ``paged_kv.models.protocol.PagedModel`` (``paged_kv.models.Llama``, or your
        own) or its ``(graphdef, state)`` split. When ``impl`` resolves to Pallas and ``mesh`` is
        given, a stacked Llama is converted to ``paged_kv.models.per_layer`` for the call (one copy
        of the layer weights per call, alive while the call runs; pass
        ``paged_kv.models.per_layer(model)`` to pay that once); otherwise it runs as given
        (``paged_kv.models.layer_layout.layout_for_impl`` has the table).
      pages: the KV pages ``[layers, 2, kv_heads, manager.num_blocks, manager.block_size, head_dim]``
        (donated); ``[layout.slots, ...]`` for a grouped manager (``page_spec(model, ...,
        layout=call_setup.group_layout(model, manager))``).
      prompt_tokens: int32 ``[B, L]`` zero-padded prompts (see ``pad_prompts``); ids at positions
        ``< prompt_lens`` must be in ``[0, vocab_size)`` (checked when concrete; under the caller's
        ``jit`` such a prompt is skipped with ``FinishReason.BAD_TOKEN``).
      prompt_lens: int32 ``[B]`` prompt lengths in ``[1, L]``.
      key: a PRNG key (``jax.random.key``: shape ``()``; or a raw uint32 ``[2]`` key), or an int
        seed in ``[0, 2**32)``: it fixes the prompts' seeds when ``seeds`` is None (prompt ``b``
        gets ``sampling.derive_seeds(key, B)[b]``); the same key gives the same tokens (unused
        when greedy or when ``seeds`` is given).
      params: ``SamplingParams`` (static: each distinct value compiles once).
      manager: the block manager's ``ManagerConfig``: the default single full group, or a
        windowed model's KV-cache groups (``paged_kv.engine.kv_cache_groups(model)``; any other
        groups raise ``ValueError``), whose window groups then reclaim out-of-window blocks as
        the samples grow.
      state: the block manager's state (donated), or None for a fresh one. Rows ``[0, B * n)``
        must be free; they are free again on return.
      max_new_tokens: optional int32 ``[B]`` per-prompt budgets (clipped to ``params.max_new_tokens``).
        A prompt whose length plus budget runs past the context stops there with
        ``FinishReason.LENGTH_CAPPED`` (not refused: the lengths may be traced).
      impl: kernel implementation ("auto", "pallas", "interpret", "reference").
      chunk_size: prefill chunk length (default ``min(L, 256)``).
      mesh: a ``jax.sharding.Mesh`` with a "tp" axis to run tensor-parallel (``paged_kv.models.sharding``);
        the model and pages are placed on it (a no-op when ``paged_kv.models.sharding.shard`` already did;
        pages with the model's original KV-head count get replicated heads when tp exceeds it, and
        the returned pages keep that layout). None: the pages' own mesh if they are sharded, else
        one device. The block-manager state and the outputs are replicated.
      seeds: optional int ``[B]`` per-prompt sampling seeds in ``[0, 2**31)``: prompt ``b``'s
        samples are a function of ``seeds[b]``, its sample index and the token index only (the
        seeding rule of ``paged_kv.engine.sampling``), so the same prompt and seed give the same
        samples in any row and batch (where the logits are equal), and the same as a
        ``ServingEngine`` request with ``seed=seeds[b]``. Returned in ``GenerateOutput.seeds``.
      batch_invariant: static. True: every prompt's tokens and log-probs are the same bits
        whatever the other prompts, its row, the batch size and the chunk size, equal to
        ``ServingEngine``'s in the same mode and to ``paged_kv.models.contiguous.score_tokens``
        (docs/batch_invariance.md). On the reference and the Pallas kernels alike, on one device
        or a tensor-parallel mesh; not with quantized pages.

    Returns:
      ``(GenerateOutput, pages, state)``.

    Raises:
      ValueError: bad parameters, shapes or dtypes (token ids, lengths and budgets must be
        integers), a token id outside ``[0, vocab_size)`` (named with its prompt and position), a
        bad key or seeds, more sequences than the manager holds, a prompt longer than the context,
        or a mesh without a "tp" axis or whose size fits no head layout, before anything is
        compiled.

    Callable inside the caller's own ``jit`` (value checks that need concrete arrays are
    then skipped).
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    key = call_setup.check_key(key)
    graphdef, weights, facts, pages, mesh = call_setup.place(model, pages, mesh)
    params = with_model_eos(params, facts.eos_token_ids)  # None: the model's EOS ids, before tracing
    layout = call_setup.group_layout((graphdef, weights), manager)
    req = call_setup.check_call(facts, manager, pages, state, prompt_tokens, prompt_lens,
                                 rows_per_prompt=params.n, what="n", budgets=max_new_tokens,
                                 chunk_size=chunk_size, impl=impl, eos_token_ids=params.eos_token_ids, layout=layout,
                                 top_k=params.top_k, batch_invariant=bool(batch_invariant))
    # Pallas kernels over a tensor-parallel mesh: one weight array per layer, converted here once
    # per call (a copy of the layer weights; pass a `paged_kv.models.per_layer` model to convert once for
    # many calls). On one device the layers stay stacked.
    graphdef, weights = call_setup.layer_layout(graphdef, weights, impl, mesh)
    state = call_setup.initial_state(manager, state)
    b = req.num_prompts
    budgets = jnp.full((b,), params.max_new_tokens, jnp.int32) if max_new_tokens is None else \
        jnp.asarray(max_new_tokens, jnp.int32)
    seeds = call_setup.check_seeds(seeds, b)
    state, toks, lens, budgets, key, seeds = call_setup.replicate_inputs(
        mesh, state, jnp.asarray(prompt_tokens, jnp.int32), jnp.asarray(prompt_lens, jnp.int32), budgets, key, seeds)
    return generate_jit(graphdef, weights, pages, state, toks, lens, budgets, key, seeds, manager=manager,
                        params=params, impl=impl, chunk_size=req.chunk_size, context=req.context, mesh=mesh,
                        batch_invariant=bool(batch_invariant))


__all__ = ["BlockStats", "FinishReason", "GenerateOutput", "bad_prompts", "generate", "generate_jit", "generate_loop"]
