"""The two model steps of the on-device loops, each with its block-manager side.

* ``prefill``: ``admit`` the prompts (prefix-cache hits are skipped), then run them through the
  paged prefill path in chunks of ``chunk_size`` positions under one ``lax.fori_loop``. K/V go
  straight into the pages; activations exist for one chunk at a time, so a long prompt never
  needs a second full-size buffer. Chunk ``c`` covers absolute positions
  ``[c * chunk_size, (c + 1) * chunk_size)`` for every row, so a row that shares blocks another
  row of the same call computes (``AdmitResult.shared_tokens``) reads them in the same step they
  are written (all K/V of a layer are written before that layer attends).
* ``decode``: ``append`` one token per live row (lazy allocation, copy-on-write list), run the
  copies with ``copy_blocks`` *before* the K/V write, then one paged decode forward.

Both are traceable functions (no jit of their own); the loops in ``generate``/``beam_search``
call them under one ``jax.jit``.

With KV-cache groups (``ManagerConfig.grouped``, a windowed model's ``call_setup.group_layout``) both pass
every group's tables (``[G, B, M]``) and slots to the forward, which maps each layer to its
group, and ``decode`` applies every group's copy-on-write copies (``append``'s ``[B, G]``); the
grouped ``append`` has already reclaimed the blocks that left each window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from paged_kv.admission import admit
from paged_kv.allocate import AppendResult, append
from paged_kv.batch import blocks_held
from paged_kv.config import NULL_BLOCK, ManagerConfig
from paged_kv.models.paged import PagedBatch, copy_blocks, make_paged_batch, paged_forward
from paged_kv.state import BlockManagerState
from paged_kv.status import Status


def prefill(model: nnx.Module, pages: jax.Array, config: ManagerConfig, state: BlockManagerState,
            seq_ids: jax.Array, prompt_tokens: jax.Array, prompt_lens: jax.Array, *, chunk_size: int, impl: str,
            mesh: jax.sharding.Mesh | None = None, batch_invariant: bool = False
            ) -> tuple[BlockManagerState, jax.Array, jax.Array, jax.Array]:
    """Admit and prefill prompts. Returns (state, pages, logits float32 [B, V] at each prompt's
    last token, admission status int32 [B]). Rows that were not admitted get garbage logits and
    write only into the null block. ``mesh``: see ``paged_kv.models.paged.paged_forward``."""
    b, length = prompt_tokens.shape
    bs = config.block_size
    prompt_tokens = prompt_tokens.astype(jnp.int32)
    lens = prompt_lens.astype(jnp.int32)
    state, res = admit(config, state, seq_ids, lens, prompt_tokens if config.prefix_caching else None)
    ok = res.status == Status.OK
    start = jnp.where(ok, res.cached_tokens + res.shared_tokens, lens)  # < lens for admitted rows
    lens = jnp.where(ok, lens, 0)
    tables = row_tables(config, state, seq_ids)
    num_chunks = -(-length // chunk_size)
    padded = jnp.pad(prompt_tokens, ((0, 0), (0, num_chunks * chunk_size - length + chunk_size)))
    offsets = jnp.arange(chunk_size, dtype=jnp.int32)[None, :]
    vocab = model.vocab_size

    def chunk(c, carry):
        pages, last = carry
        lo = c * chunk_size
        q_start = jnp.clip(jnp.maximum(lo, start), 0, lens)
        q_lens = jnp.clip(jnp.minimum(lo + chunk_size, lens) - q_start, 0, chunk_size)
        toks = jnp.take_along_axis(padded, q_start[:, None] + offsets, axis=1)
        batch = make_paged_batch(tables, q_start, q_lens, chunk_size, bs)
        logits, pages = paged_forward(model, pages, batch, toks, impl=impl, last_only=True, mesh=mesh,
                                      batch_invariant=batch_invariant)
        ends_here = (q_lens > 0) & (q_start + q_lens == lens)
        return pages, jnp.where(ends_here[:, None], logits, last)

    # Skip chunks that only hold cached positions (or no prompt at all).
    first = jnp.min(jnp.where(ok, start, length)) // chunk_size
    last_chunk = -(-jnp.max(lens) // chunk_size)
    pages, logits = lax.fori_loop(first, jnp.maximum(first, last_chunk), chunk,
                                  (pages, jnp.zeros((b, vocab), jnp.float32)))
    return state, pages, logits, res.status


def decode(model: nnx.Module, pages: jax.Array, config: ManagerConfig, state: BlockManagerState,
           seq_ids: jax.Array, tokens: jax.Array, live: jax.Array, *, impl: str,
           mesh: jax.sharding.Mesh | None = None, batch_invariant: bool = False
           ) -> tuple[BlockManagerState, jax.Array, jax.Array, jax.Array, jax.Array]:
    """One token per live row (``seq_ids[r]`` running, ``tokens[r]`` the token to feed).

    Returns (state, pages, logits float32 [R, V], append status int32 [R] (PADDING where not
    live), copies made int32 scalar). Rows whose append failed attend to nothing and write only
    into the null block. With a ``mesh`` (see ``paged_kv.models.paged.paged_forward``) the block copies run
    per device: each holds every block for its own KV heads.
    """
    ids = jnp.where(live, seq_ids, -1)
    with jax.named_scope("manager_append"):
        state, res = append(config, state, ids, tokens.astype(jnp.int32) if config.prefix_caching else None)
    return decode_appended(model, pages, config, state, seq_ids, tokens, res, impl=impl, mesh=mesh,
                           batch_invariant=batch_invariant)


def decode_appended(model: nnx.Module, pages: jax.Array, config: ManagerConfig, state: BlockManagerState,
                    seq_ids: jax.Array, tokens: jax.Array, res: AppendResult, *, impl: str,
                    mesh: jax.sharding.Mesh | None = None, batch_invariant: bool = False
                    ) -> tuple[BlockManagerState, jax.Array, jax.Array, jax.Array, jax.Array]:
    """``decode`` after its ``append``: ``res`` (an ``AppendResult`` of ``[R]`` rows) is what
    ``append`` of ``seq_ids`` (``-1`` where not live) returned and ``state`` the state after it.
    The same returns as ``decode``."""
    with jax.named_scope("block_copy"):
        # Grouped: [R, G] copies, one list (a block belongs to one group; its page slice holds
        # that group's layers, so copying the block copies all of them).
        src, dst = (res.copy_src.reshape(-1), res.copy_dst.reshape(-1)) if config.grouped else \
            (res.copy_src, res.copy_dst)
        pages = copy_blocks(pages, src, dst, impl=impl, mesh=mesh)
    ok = res.status == Status.OK
    sid = jnp.clip(seq_ids, 0, config.max_seqs - 1)
    n = jnp.where(ok, state.num_tokens[sid], 0)
    batch = PagedBatch(
        block_tables=row_tables(config, state, seq_ids),
        q_start=jnp.maximum(n - 1, 0),
        q_lens=ok.astype(jnp.int32),
        slots=res.slots.T[:, :, None] if config.grouped else res.slots[:, None],
        lengths=n,
    )
    logits, pages = paged_forward(model, pages, batch, tokens.astype(jnp.int32), impl=impl, mesh=mesh,
                                  batch_invariant=batch_invariant)
    return state, pages, logits, res.status, res.num_copies


def row_tables(config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array) -> jax.Array:
    """The tables of rows ``seq_ids`` (int32 ``[B]``, clipped into range): int32 ``[B, M]``, or
    every group's, int32 ``[G, B, M]``, with groups (``ManagerConfig.grouped``)."""
    sid = jnp.clip(seq_ids, 0, config.max_seqs - 1)
    return state.tables[:, sid] if config.grouped else state.block_tables[sid]


def block_counts(config: ManagerConfig, state: BlockManagerState, seq_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(blocks in use in the whole pool, blocks shared among ``seq_ids``' tables), int32 scalars.

    In use is O(1): every allocatable block not in the free queue. Shared is O(R * M), batch
    scale: a block held by ``r > 1`` of these tables appears ``r`` times and adds ``1 / r`` each
    time (exact when no other sequence holds the same block). With groups, every group's table
    counts (a block belongs to one group); a window table's null prefix holds nothing.
    """
    used = config.num_blocks - 1 - state.queue.num_free
    sid = jnp.clip(seq_ids, 0, config.max_seqs - 1)
    held = jnp.where(state.active[sid] & (seq_ids >= 0), blocks_held(config, state.num_tokens[sid]), 0)
    j = jnp.arange(config.max_blocks_per_seq, dtype=jnp.int32)[None, :]
    if config.grouped:
        tables = state.tables[:, sid]
        r = state.ref_count[tables].astype(jnp.float32)
        mine = (j < held[:, None])[None] & (tables != NULL_BLOCK) & (r > 1)
        share = jnp.where(mine, 1.0 / jnp.maximum(r, 1.0), 0.0)
        return used.astype(jnp.int32), jnp.round(jnp.sum(share)).astype(jnp.int32)
    tables = state.block_tables[sid]
    r = state.ref_count[tables].astype(jnp.float32)
    share = jnp.where((j < held[:, None]) & (r > 1), 1.0 / jnp.maximum(r, 1.0), 0.0)
    return used.astype(jnp.int32), jnp.round(jnp.sum(share)).astype(jnp.int32)
