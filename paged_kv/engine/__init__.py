"""The engine: the only layer that uses the block manager, the model and the kernels together.

On-device generation under one ``jax.jit`` (``lax.while_loop``, no host round trip per token):

* ``generate``: greedy / temperature / top-k / top-p sampling, ``n`` answers per prompt sharing
  the prompt's blocks (``fork``; copy-on-write of the partly full last block on first write).
* ``beam_search``: width-k beam search whose candidates share blocks through ``select``.

Example::

    import jax, paged_kv as pk
    from paged_kv.models import allocate_pages, init_model, page_spec, tiny
    from paged_kv import engine

    model = init_model(tiny())
    mgr = pk.ManagerConfig(num_blocks=256, block_size=16, max_seqs=32, max_blocks_per_seq=16)
    pages = allocate_pages(page_spec(model, mgr.num_blocks, mgr.block_size))
    toks, lens = engine.pad_prompts([[1, 2, 3], [4, 5, 6, 7, 8]], width=16)
    params = engine.SamplingParams(max_new_tokens=32, temperature=0.8, top_p=0.95, n=4)
    out, pages, state = engine.generate(model, pages, toks, lens, jax.random.key(0), params, manager=mgr)
    # out.tokens [2, 4, 32], out.logprobs, out.lengths, out.finish_reason, out.stats.{used,shared,copies}
    beams, pages, state = engine.beam_search(model, pages, toks, lens, engine.BeamParams(beam_width=4),
                                             manager=mgr, state=state)

Both donate ``pages`` and ``state``; pass them back in for the next call (new prompts of the
same padded shape reuse the compiled loop: ``pad_prompts`` pads to power-of-two buckets,
``bucket_width``). Both can be called inside the caller's own ``jit``. Answers end at the model's
EOS ids unless the parameters name others (``eos_token_ids``) or none (``ignore_eos=True``):
``with_model_eos`` fills them in on the host, before tracing.

Tensor parallel: pass ``mesh=paged_kv.models.sharding.make_mesh(tp)`` (a ``jax.sharding.Mesh`` with a
"tp" axis, possibly spanning processes); the model and pages are placed on it (or place them once
with ``paged_kv.models.sharding.shard``), the block-manager state and prompts are replicated, and the
loops run unchanged (the kernels per device under ``shard_map``).

Modules: ``sampling`` (parameters, sampler), ``steps`` (chunked prefill and the decode step with
their block-manager side), ``generate``, ``beam_search``, ``call_setup`` (a call's checks, over
``input_checks``, ``placement`` and ``manager_groups``), and the serving loop: ``serving``
(``ServingEngine``, wiring), ``serving_types`` (its config, request, output and statistics types),
``scheduler`` + ``outcomes`` + ``families`` (the host policy, testable without a model),
``serving_step`` (the jitted step and its inputs and outputs).
"""

from paged_kv.engine.beam_search import BeamOutput, beam_search, beam_search_jit, beam_search_loop
from paged_kv.engine.call_setup import bucket_width, kv_cache_groups, manager_config, pad_prompts
from paged_kv.engine.generate import BlockStats, FinishReason, GenerateOutput, generate, generate_jit, generate_loop
from paged_kv.engine.sampling import BeamParams, SamplingParams, filter_logits, sample_tokens, with_model_eos
from paged_kv.engine.serving import Request, RequestOutput, ServingConfig, ServingEngine, TokenDelta

__all__ = [
    "BeamOutput", "BeamParams", "BlockStats", "FinishReason", "GenerateOutput", "SamplingParams", "beam_search",
    "beam_search_jit", "beam_search_loop", "filter_logits", "generate", "generate_jit", "generate_loop",
    "bucket_width", "kv_cache_groups", "manager_config", "pad_prompts", "sample_tokens", "with_model_eos",
    "Request", "RequestOutput", "ServingConfig", "ServingEngine", "TokenDelta",
]
