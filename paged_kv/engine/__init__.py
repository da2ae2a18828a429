"""The engine: the only layer that uses the block manager, the model and the kernels together.

On-device generation under one ``jax.jit`` (``lax.while_loop``, no host round trip per token):

* ``generate``: greedy / temperature / top-k / top-p sampling, ``n`` answers per prompt sharing
  the prompt's blocks (``fork``; copy-on-write of the partly full last block on first write).
* ``beam_search``: width-k beam search whose candidates share blocks through ``select``.

Modules: ``sampling`` (parameters, sampler), ``steps`` (chunked prefill and the decode step with
their block-manager side), ``generate``, ``beam_search``, ``requests`` (request checks).
"""

from paged_kv.engine.beam_search import BeamOutput, beam_search, beam_search_jit, beam_search_loop
from paged_kv.engine.generate import BlockStats, FinishReason, GenerateOutput, generate, generate_jit, generate_loop
from paged_kv.engine.requests import pad_prompts
from paged_kv.engine.sampling import BeamParams, SamplingParams, filter_logits, sample_tokens

__all__ = [
    "BeamOutput", "BeamParams", "BlockStats", "FinishReason", "GenerateOutput", "SamplingParams", "beam_search",
    "beam_search_jit", "beam_search_loop", "filter_logits", "generate", "generate_jit", "generate_loop",
    "pad_prompts", "sample_tokens",
]
