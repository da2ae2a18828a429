#!/usr/bin/env python
"""Write a small checkpoint folder laid out as people download them from the Hugging Face hub:
`config.json` + `model.safetensors` of a Llama-family model with random weights, and a real BPE
tokenizer trained here with the `tokenizers` library on the project's corpus
(`scripts/train_tiny_llama.generate_corpus`), saved as `tokenizer.json`, with
`tokenizer_config.json` (special tokens, a chat template) and `generation_config.json` (two EOS ids,
as Llama 3 has).

    python scripts/bpe_checkpoint.py OUT_DIR [--family qwen2] [--vocab 512] [--seed 0]

`--family` is one of `FAMILY_NAMES`: `gemma2` and `gemma3` write Gemma-shaped folders (model_type
`gemma2` / `gemma3_text`: GeGLU, (1 + w) norms, tied scaled embeddings, a 64-token sliding window
on alternating layers; Gemma 2's soft caps, Gemma 3's q/k norms and local RoPE base).

The weights are random, so the answers are not English; everything else (tokenizer, special
tokens, chat template, EOS list, safetensors layout) is what a real checkpoint carries. The tests
(tests/test_tokenizers.py, tests/test_cli.py), and the session in docs/usage.md
build their checkpoints with `write_checkpoint`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BOS, EOS, EOT, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|pad|>"
SPECIALS = [BOS, EOS, EOT, PAD, "<|start_header_id|>", "<|end_header_id|>"]
# A template in the style of Llama 3's: BOS, then each message as a header and its text ended by
# <|eot_id|>; the generation prompt opens an assistant header.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def train_bpe(vocab_size: int = 512, num_docs: int = 2000, seed: int = 0):
    """A byte-level BPE (`tokenizers`) trained on `num_docs` documents of the project's corpus, with
    the special tokens first (ids 0..5) and a post-processor that puts BOS before every prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from scripts.train_tiny_llama import generate_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(generate_corpus(seed, num_docs), trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


FAMILY_NAMES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")
"""`--family` choices (`gemma3` is model_type `gemma3_text`, the text decoder)."""
WINDOW = 64
"""The sliding window of the Gemma folders' local layers (tokens)."""


def family_switches(family: str, num_layers: int, head_dim: int) -> dict:
    """The `LlamaConfig` fields of `family` (one of `FAMILY_NAMES`) beyond the shared shapes."""
    from paged_kv.models import LlamaConfig

    if family not in FAMILY_NAMES:
        raise ValueError(f"family={family!r} must be one of {FAMILY_NAMES}")
    if family in ("gemma2", "gemma3"):
        model_type = "gemma2" if family == "gemma2" else "gemma3_text"
        # Local layers first, then global, alternating (Gemma 2's pattern; Gemma 3 uses 5:1 at scale).
        windows = tuple(WINDOW if i % 2 == 0 else 0 for i in range(num_layers))
        out = dict(model_type=model_type, layer_windows=windows, query_pre_attn_scalar=float(head_dim),
                   **LlamaConfig.gemma_switches(model_type))
        if family == "gemma2":
            out.update(attn_soft_cap=50.0, final_soft_cap=30.0)
        else:
            out.update(rope_theta=1_000_000.0, rope_local_theta=10_000.0)
        return out
    return {"llama": {}, "qwen2": dict(qkv_bias=True), "qwen3": dict(qk_norm=True, head_dim=32),
            "mistral": {}}[family]


def write_checkpoint(out: str | Path, *, family: str = "llama", vocab_size: int = 512, seed: int = 0,
                     hidden_size: int = 64, num_layers: int = 2, chat_template: str | None = CHAT_TEMPLATE,
                     eos: tuple[str, ...] = (EOS, EOT)) -> Path:
    """Write the checkpoint folder `out` (module docstring); returns it. The model has the
    tokenizer's vocabulary and `family`'s switches (`paged_kv.models.config.FAMILIES`)."""
    from paged_kv.models import LlamaConfig, init_model, save_hf_checkpoint

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(vocab_size, seed=seed)
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos_ids = [tok.token_to_id(t) for t in eos]
    switches = {"rope_theta": 10_000.0, "model_type": family, **family_switches(family, num_layers, hidden_size // 4)}
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_layers=num_layers, num_heads=4, num_kv_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=family in ("qwen2", "qwen3", "gemma2", "gemma3"),
                      bos_token_id=tok.token_to_id(BOS), eos_token_ids=tuple(eos_ids), **switches)
    save_hf_checkpoint(init_model(cfg, seed=seed, init_std=0.2), out)
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": eos[0], "pad_token": PAD,
            "model_max_length": cfg.max_position_embeddings}
    if chat_template is not None:
        tcfg["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": eos_ids}, indent=2))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="checkpoint folder to write")
    p.add_argument("--family", choices=FAMILY_NAMES, default="llama")
    p.add_argument("--vocab", type=int, default=512, help="BPE vocabulary size")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    path = write_checkpoint(args.out, family=args.family, vocab_size=args.vocab, seed=args.seed)
    print(f"wrote {path}: " + ", ".join(sorted(f.name for f in path.iterdir())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
