"""The built-in tiny Llama: byte tokenizer, committed checkpoint, and the training script (CPU, fast)."""

import importlib.util
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_kv.models import load_hf_checkpoint
from paged_kv.models.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, ByteTokenizer, decode, encode

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints" / "tiny-llama"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_tiny_llama", ROOT / "scripts" / "train_tiny_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint(CKPT)


@pytest.fixture(scope="module")
def tokenizer():
    return ByteTokenizer.load(CKPT)


# ---------------------------------------------------------------------- tokenizer
@pytest.mark.parametrize("text", ["", "The cow says moo.", "héllo wörld — naïve café", "日本語のテキスト",
                                  "emoji 🙂🚀 and tabs\tand\nnewlines", "\x00 nul byte"])
def test_tokenizer_round_trip(text):
    ids = encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert decode(ids) == text
    with_specials = encode(text, add_bos=True, add_eos=True)
    assert with_specials[0] == BOS_ID and with_specials[-1] == EOS_ID
    assert decode(with_specials) == text


def test_tokenizer_specials_and_errors():
    tok = ByteTokenizer()
    assert tok.vocab_size == VOCAB_SIZE == 259
    assert {PAD_ID, BOS_ID, EOS_ID} == {256, 257, 258}
    assert tok.decode([104, PAD_ID, 105, EOS_ID, 33], stop_at_eos=True) == "hi"
    assert tok.decode([104, PAD_ID, 105, EOS_ID, 33]) == "hi!"
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"  # cut multi-byte character
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([VOCAB_SIZE])
    with pytest.raises(ValueError, match="special ids"):
        ByteTokenizer(pad_id=10)


def test_tokenizer_file_round_trip(tmp_path):
    tok = ByteTokenizer()
    path = tok.save(tmp_path)
    assert json.loads(path.read_text())["special_tokens"] == {"<pad>": 256, "<bos>": 257, "<eos>": 258}
    assert ByteTokenizer.load(tmp_path) == tok
    assert ByteTokenizer.load(path) == tok


# ---------------------------------------------------------------------- committed checkpoint
def test_checkpoint_files_and_config(model, tokenizer):
    names = {p.name for p in CKPT.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert sum(p.stat().st_size for p in CKPT.iterdir()) < 10 * 2 ** 20
    cfg = model.config
    assert tokenizer == ByteTokenizer()
    assert cfg.vocab_size == tokenizer.vocab_size
    assert cfg.bos_token_id == tokenizer.bos_id and cfg.eos_token_ids == (tokenizer.eos_id,)
    assert cfg.num_heads > cfg.num_kv_heads  # GQA
    assert cfg.num_params() < 5_000_000


def test_held_out_loss_well_below_uniform(script, model, tokenizer):
    docs = script.generate_corpus(script.VAL_SEED_OFFSET + 12345, 8)  # a seed the training never used
    rows = [tokenizer.encode(d, add_bos=True, add_eos=True) for d in docs]
    width = max(map(len, rows))
    windows = np.full((len(rows), width), tokenizer.pad_id, np.int32)
    for i, r in enumerate(rows):
        windows[i, :len(r)] = r
    loss = float(jax.jit(lambda w: script.lm_loss(model, w, pad_id=tokenizer.pad_id))(jnp.asarray(windows)))
    uniform = math.log(model.config.vocab_size)
    assert loss < 0.5 * uniform, (loss, uniform)
    assert loss < 1.0, loss  # the committed model reaches about 0.2 nats/byte on held-out text


def test_greedy_continuations_are_sensible(script, model, tokenizer):
    prompts = ["The cow says", "Once upon a time there was a", "After Monday comes"]
    outs = script.greedy_continue(model, tokenizer, prompts, max_new_tokens=24)
    for p, c in zip(prompts, outs):
        assert c and c.isprintable(), (p, c)
        assert c.startswith(" "), (p, c)  # continues the sentence with a new word
    assert outs[0].startswith(" moo"), outs[0]
    assert outs[2].startswith(" Tuesday"), outs[2]


# ---------------------------------------------------------------------- training script
def test_corpus_is_deterministic(script):
    a, b, c = script.generate_corpus(3, 50), script.generate_corpus(3, 50), script.generate_corpus(4, 50)
    assert a == b and a != c
    w = script.pack_documents(a, ByteTokenizer(), 32)
    assert w.shape[1] == 33 and w.dtype == np.int32 and (w < VOCAB_SIZE).all()


def test_train_step_reduces_loss(script):
    from flax import nnx

    cfg = script.model_config(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64, max_positions=64)
    windows = jnp.asarray(script.pack_documents(script.generate_corpus(0, 40), ByteTokenizer(), 32)[:8])
    graphdef, params = nnx.split(script.init_model(cfg, seed=0))
    tx, _ = script.make_optimizer(1e-2, 20, 2, 0.0, 1.0, params)
    opt_state = tx.init(params)
    step = script.make_train_step(graphdef, tx)
    losses = []
    for _ in range(8):
        params, opt_state, loss = step(params, opt_state, windows)
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.5, losses
