"""Flax NNX Llama 3 family decoder that runs over the paged KV cache (`pallas_kernels`) or a
contiguous baseline cache, and loads/saves Hugging Face Llama checkpoints.

Any model that implements `paged_kv.models.protocol.PagedModel` runs through the paged cache and the engines;
the Llama is one (docs/own_model.md, examples/gpt2.py).

Modules: `protocol` (the model protocol: PagedModel, AttentionBackend, ModelFacts, model_facts),
`config` (LlamaConfig, presets, RoPE frequencies), `llama` (NNX modules), `paged` (paged forward and
jitted steps, block copies), `paged_batch` (PagedBatch metadata), `paged_attention` (the paged cache's
attention backend), `layer_layout` (stacked or per-layer, per impl and mesh), `kv_groups`
(KVGroupLayout), `page_sizing` (KVPageSpec, page bytes, allocation), `contiguous` (baseline cache path;
`plain_forward` and `score_tokens`, the training side's log-probs, docs/batch_invariance.md), `hf_io`
(safetensors checkpoints of the llama, qwen2, qwen3 and mistral families, every tensor checked
before loading), `tokenizer` (bytes) and `hf_tokenizer` (a checkpoint's own `tokenizer.json`, special
ids, chat template, streamed decoding), `generate` (host greedy loops for tests and benchmarks), `sharding`
(tensor parallelism over a `jax.sharding.Mesh`: placing a model and its pages, sharded loading, KV
capacity per device) over `tp_layout` (which axis of each weight and of the pages is split).
"""

from paged_kv.models import sharding
from paged_kv.models.config import (
    LinearRopeScaling,
    Llama3RopeScaling,
    LlamaConfig,
    llama31_8b,
    llama32_1b,
    rope_inv_freq,
    tiny,
)
from paged_kv.models.contiguous import (
    contiguous_forward,
    contiguous_step,
    init_contiguous_cache,
    plain_forward,
    score_tokens,
)
from paged_kv.models.generate import greedy_generate_contiguous, greedy_generate_paged
from paged_kv.models.hf_io import CheckpointError, hf_state_dict, load_hf_checkpoint, save_hf_checkpoint
from paged_kv.models.kv_groups import KVGroupLayout, kv_group_layout, layer_specs, layer_windows
from paged_kv.models.layer_layout import layout_for_impl
from paged_kv.models.llama import (
    Llama,
    abstract_model,
    in_vocab,
    init_model,
    is_per_layer,
    per_layer,
    safe_tokens,
    stacked,
)
from paged_kv.models.page_sizing import (
    KVPageSpec,
    allocate_pages,
    kv_bytes_per_block,
    kv_bytes_per_token,
    page_spec,
    page_spec_for_budget,
)
from paged_kv.models.paged import paged_decode_step, paged_forward, paged_prefill_step
from paged_kv.models.paged_batch import PagedBatch, compute_slots, make_paged_batch
from paged_kv.models.protocol import AttentionBackend, ModelFacts, PagedModel, model_facts

__all__ = [
    "AttentionBackend", "CheckpointError", "KVGroupLayout", "KVPageSpec", "LinearRopeScaling", "Llama",
    "Llama3RopeScaling", "LlamaConfig", "ModelFacts", "PagedBatch", "PagedModel", "model_facts",
    "abstract_model", "allocate_pages", "compute_slots", "contiguous_forward", "contiguous_step",
    "greedy_generate_contiguous", "greedy_generate_paged", "hf_state_dict", "in_vocab", "init_contiguous_cache",
    "init_model", "is_per_layer", "kv_bytes_per_block", "kv_group_layout", "layer_specs", "layer_windows",
    "layout_for_impl", "kv_bytes_per_token", "llama31_8b", "llama32_1b",
    "load_hf_checkpoint", "make_paged_batch", "page_spec", "page_spec_for_budget",
    "paged_decode_step", "paged_forward", "paged_prefill_step", "per_layer", "plain_forward", "rope_inv_freq",
    "safe_tokens", "save_hf_checkpoint", "score_tokens",
    "sharding", "stacked", "tiny",
]
