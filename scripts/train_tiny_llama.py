#!/usr/bin/env python
"""Train the project's built-in tiny Llama on a generated corpus, on a CPU, in a few minutes.

The corpus is produced here by a seeded generator (no data files, nothing downloaded): short
templated English documents with a clear structure, so a byte-level model learns them quickly and
its continuations are visibly sensible:

  * little stories that keep using the names, animals and objects they introduced,
  * fixed facts (what each animal says, the colour of each fruit, the day after each day),
  * questions and answers about those facts,
  * counting runs and small additions.

Documents are `<bos> text <eos>`, concatenated and cut into windows of `seq_len + 1` tokens. The
model (`paged_kv.models.Llama`, byte tokenizer of `paged_kv.models.tokenizer`) is trained with AdamW (linear warmup,
cosine decay, gradient clipping) by one jitted step over the parameter state (`nnx.split` /
`nnx.merge`); validation loss is measured on documents generated from a different seed. At the end
the checkpoint (`config.json`, `model.safetensors`, `tokenizer.json`) is written with
`paged_kv.models.save_hf_checkpoint`, a few greedy continuations are printed and the curves go to a JSON file.

    python scripts/train_tiny_llama.py --steps 500 --out checkpoints/tiny-llama

Training needs the ``bench`` extra (optax: ``pip install -e '.[bench]'``); ``generate_corpus``
(which scripts/bpe_checkpoint.py and the tests use) needs only the library.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_kv.models import LlamaConfig, greedy_generate_contiguous, init_model, save_hf_checkpoint
from paged_kv.models.tokenizer import ByteTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.run_record import record, utc_now

if TYPE_CHECKING:  # annotations only: optax is imported (by _optax) only to train
    import optax

TRAIN_SEED_OFFSET = 0
VAL_SEED_OFFSET = 1_000_003

# ---------------------------------------------------------------------- corpus
NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Henry", "Ivy", "Jack", "Lily", "Max",
         "Nora", "Oscar", "Rosa", "Sam", "Tom", "Zoe"]
PRONOUN = {"Anna": "she", "Ben": "he", "Clara": "she", "David": "he", "Emma": "she", "Felix": "he",
           "Grace": "she", "Henry": "he", "Ivy": "she", "Jack": "he", "Lily": "she", "Max": "he",
           "Nora": "she", "Oscar": "he", "Rosa": "she", "Sam": "he", "Tom": "he", "Zoe": "she"}
ANIMAL_SOUNDS = {"cat": "meow", "dog": "woof", "cow": "moo", "duck": "quack", "sheep": "baa", "pig": "oink",
                 "horse": "neigh", "owl": "hoot", "frog": "ribbit", "lion": "roar", "mouse": "squeak",
                 "bee": "buzz"}
ANIMAL_HOMES = {"cat": "house", "dog": "garden", "cow": "field", "duck": "pond", "sheep": "meadow",
                "pig": "farm", "horse": "stable", "owl": "tree", "frog": "pond", "lion": "jungle",
                "mouse": "barn", "bee": "hive"}
FRUIT_COLORS = {"banana": "yellow", "apple": "red", "orange": "orange", "lemon": "yellow", "lime": "green",
                "plum": "purple", "cherry": "red", "grape": "purple", "pear": "green", "peach": "pink",
                "blueberry": "blue", "kiwi": "brown"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black", "pink", "brown"]
ADJECTIVES = ["little", "happy", "brave", "sleepy", "curious", "kind", "tiny", "clever", "funny", "quiet"]
OBJECTS = ["ball", "kite", "hat", "box", "book", "cup", "boat", "drum", "key", "shell", "star", "sock"]
PLACES = ["park", "forest", "garden", "village", "beach", "river", "hill", "school", "market", "library"]
ACTIVITIES = ["play with a ball", "read books", "sing songs", "draw pictures", "climb trees", "run fast",
              "eat apples", "look at the stars", "build sand castles", "dance in the rain"]
FEELINGS = ["happy", "glad", "excited", "proud", "surprised"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _story(r: random.Random) -> str:
    name, friend = r.sample(NAMES, 2)
    he, adj, animal = PRONOUN[name], r.choice(ADJECTIVES), r.choice(list(ANIMAL_SOUNDS))
    color, obj, place = r.choice(COLORS), r.choice(OBJECTS), r.choice(PLACES)
    s = [f"Once upon a time there was {_a(adj)} {animal} named {name}.",
         f"{name} lived near the {place} and liked to {r.choice(ACTIVITIES)}.",
         f"One day, {name} found {_a(color)} {obj} in the {place}.",
         f"{he.capitalize()} said, \"{ANIMAL_SOUNDS[animal].capitalize()}! What {_a(color)} {obj}!\""]
    ending = r.randrange(3)
    if ending == 0:
        s.append(f"{name} gave the {color} {obj} to {friend}, and {friend} was {r.choice(FEELINGS)}.")
    elif ending == 1:
        s.append(f"{name} took the {color} {obj} home and kept it safe.")
    else:
        s.append(f"{name} and {friend} played with the {color} {obj} until the sun went down.")
    s.append("The end.")
    return " ".join(s)


def _animal_facts(r: random.Random) -> str:
    animals = r.sample(list(ANIMAL_SOUNDS), r.randint(2, 4))
    return " ".join(f"The {a} says {ANIMAL_SOUNDS[a]}. The {a} lives in the {ANIMAL_HOMES[a]}." for a in animals)


def _fruit_facts(r: random.Random) -> str:
    fruits = r.sample(list(FRUIT_COLORS), r.randint(2, 4))
    return " ".join(f"{_a(f).capitalize()} is {FRUIT_COLORS[f]}." for f in fruits)


def _days(r: random.Random) -> str:
    if r.random() < 0.5:
        i = r.randrange(7)
        return " ".join(f"After {DAYS[(i + k) % 7]} comes {DAYS[(i + k + 1) % 7]}." for k in range(r.randint(2, 4)))
    i = r.randrange(12)
    return " ".join(f"After {MONTHS[(i + k) % 12]} comes {MONTHS[(i + k + 1) % 12]}." for k in range(r.randint(2, 4)))


def _qa(r: random.Random) -> str:
    out = []
    for _ in range(r.randint(2, 3)):
        kind = r.randrange(4)
        if kind == 0:
            a = r.choice(list(ANIMAL_SOUNDS))
            out.append(f"Q: What does the {a} say? A: The {a} says {ANIMAL_SOUNDS[a]}.")
        elif kind == 1:
            f = r.choice(list(FRUIT_COLORS))
            out.append(f"Q: What color is {_a(f)}? A: {_a(f).capitalize()} is {FRUIT_COLORS[f]}.")
        elif kind == 2:
            a = r.choice(list(ANIMAL_HOMES))
            out.append(f"Q: Where does the {a} live? A: The {a} lives in the {ANIMAL_HOMES[a]}.")
        else:
            i = r.randrange(7)
            out.append(f"Q: What day comes after {DAYS[i]}? A: {DAYS[(i + 1) % 7]} comes after {DAYS[i]}.")
    return " ".join(out)


def _counting(r: random.Random) -> str:
    if r.random() < 0.5:
        start, n = r.randint(1, 40), r.randint(6, 10)
        return "Let us count: " + ", ".join(str(start + k) for k in range(n)) + "."
    k = r.randint(2, 4)
    start = r.randint(0, 10 - k)
    return "Count with me: " + ", ".join(NUMBER_WORDS[start + i] for i in range(k + 1)) + "."


def _arithmetic(r: random.Random) -> str:
    out = []
    for _ in range(r.randint(2, 4)):
        a, b = r.randint(0, 9), r.randint(0, 9)
        out.append(f"{a} plus {b} is {a + b}.")
    return " ".join(out)


GENERATORS = [(_story, 3), (_animal_facts, 2), (_fruit_facts, 1), (_days, 1), (_qa, 2), (_counting, 2),
              (_arithmetic, 2)]


def generate_corpus(seed: int, num_docs: int) -> list[str]:
    """`num_docs` documents from a generator seeded with `seed` (same seed, same corpus)."""
    r = random.Random(seed)
    fns, weights = zip(*GENERATORS)
    return [r.choices(fns, weights)[0](r) for _ in range(num_docs)]


def pack_documents(docs: list[str], tokenizer: ByteTokenizer, seq_len: int) -> np.ndarray:
    """`<bos> doc <eos>` for every document, concatenated and cut into int32[N, seq_len + 1] windows
    (consecutive windows share no token; the tail that does not fill a window is dropped)."""
    ids: list[int] = []
    for d in docs:
        ids.extend(tokenizer.encode(d, add_bos=True, add_eos=True))
    n = len(ids) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"corpus of {len(ids)} tokens is shorter than one window of {seq_len + 1}")
    return np.asarray(ids[:n * (seq_len + 1)], np.int32).reshape(n, seq_len + 1)


# ---------------------------------------------------------------------- model and loss
def model_config(hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                 intermediate: int = 384, max_positions: int = 512,
                 tokenizer: ByteTokenizer | None = None) -> LlamaConfig:
    tok = tokenizer or ByteTokenizer()
    return LlamaConfig(vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, rope_theta=10_000.0,
                       max_position_embeddings=max_positions, tie_word_embeddings=False, dtype="float32",
                       bos_token_id=tok.bos_id, eos_token_ids=(tok.eos_id,))


def causal_attend(layer, q, k, v, cache):
    """Full-sequence causal GQA attention, no cache (the `attend` of `paged_kv.models.Llama` for training)."""
    b, t, qh, e = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, qh // kvh, e).astype(jnp.float32)
    s = jnp.einsum("btkge,bske->bkgts", qg, k.astype(jnp.float32)) * (e ** -0.5)
    mask = jnp.tril(jnp.ones((t, t), bool))
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgts,bske->btkge", p, v.astype(jnp.float32)).reshape(b, t, qh, e)
    return out.astype(q.dtype), cache


def sequence_logits(model, tokens: jax.Array) -> jax.Array:
    """float32 logits [B, T, V] of a plain causal forward over tokens int32[B, T] at positions 0..T-1."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, _ = model(tokens, positions, None, causal_attend)
    return model.logits(hidden)


def _optax():
    """optax (the 'bench' extra), imported only to train: the corpus needs none of it."""
    try:
        import optax
    except ImportError:
        sys.exit("train_tiny_llama.py needs the 'bench' extra (missing: optax): "
                 "pip install -e '.[bench]' in the checkout")
    return optax


def lm_loss(model, windows: jax.Array, pad_id: int | None = None) -> jax.Array:
    """Mean next-token cross entropy (nats) of windows int32[B, T + 1]; targets equal to `pad_id` skipped."""
    optax = _optax()
    inputs, targets = windows[:, :-1], windows[:, 1:]
    logits = sequence_logits(model, inputs)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    if pad_id is None:
        return nll.mean()
    w = (targets != pad_id).astype(jnp.float32)
    return (nll * w).sum() / jnp.maximum(w.sum(), 1.0)


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float, clip: float,
                   params) -> tuple[optax.GradientTransformation, optax.Schedule]:
    optax = _optax()
    warmup = max(1, min(warmup, steps - 1)) if steps > 1 else 1
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.1)
    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)  # no decay on norm scales
    tx = optax.chain(optax.clip_by_global_norm(clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask))
    return tx, schedule


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation):
    """Jitted `(params, opt_state, windows) -> (params, opt_state, loss)` (params/opt_state donated)."""
    optax = _optax()

    def loss_of(params, windows):
        return lm_loss(nnx.merge(graphdef, params), windows)

    def step(params, opt_state, windows):
        loss, grads = jax.value_and_grad(loss_of)(params, windows)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_loss(graphdef: nnx.GraphDef):
    @jax.jit
    def eval_loss(params, windows):
        return lm_loss(nnx.merge(graphdef, params), windows)
    return eval_loss


def greedy_continue(model, tokenizer: ByteTokenizer, prompts: list[str], max_new_tokens: int = 60) -> list[str]:
    """Greedy continuations (text after each prompt, up to the first EOS) via the contiguous cache."""
    ids = [tokenizer.encode(p, add_bos=True) for p in prompts]
    tokens, _ = greedy_generate_contiguous(model, ids, max_new_tokens)
    return [tokenizer.decode(row, stop_at_eos=True) for row in np.asarray(tokens)]


SAMPLE_PROMPTS = ["Once upon a time there was a", "Once upon a time there was a brave lion named Rosa.",
                  "The cow says", "Q: What color is a banana? A:", "After Monday comes", "Let us count: 12, 13,",
                  "3 plus 4 is"]


# ---------------------------------------------------------------------- training loop
def _bar(frac: float, width: int = 24) -> str:
    n = int(round(frac * width))
    return "[" + "#" * n + "." * (width - n) + "]"


def train(args, argv: list[str] | None = None) -> dict:
    started = utc_now()
    tokenizer = ByteTokenizer()
    config = model_config(args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate,
                          args.max_positions, tokenizer)
    train_windows = pack_documents(generate_corpus(args.seed + TRAIN_SEED_OFFSET, args.train_docs), tokenizer,
                                   args.seq_len)
    val_windows = pack_documents(generate_corpus(args.seed + VAL_SEED_OFFSET, args.val_docs), tokenizer,
                                 args.seq_len)
    val_windows = val_windows[: max(args.batch_size, (len(val_windows) // args.batch_size) * args.batch_size)]
    print(f"corpus: {train_windows.size:,} train tokens in {len(train_windows)} windows of {args.seq_len + 1}, "
          f"{val_windows.size:,} val tokens; model: {config.num_params():,} params "
          f"(d={config.hidden_size}, L={config.num_layers}, H={config.num_heads}/{config.num_kv_heads}, "
          f"F={config.intermediate_size}, V={config.vocab_size})", flush=True)

    model = init_model(config, seed=args.seed)
    graphdef, params = nnx.split(model)
    tx, schedule = make_optimizer(args.lr, args.steps, args.warmup, args.weight_decay, args.clip, params)
    opt_state = tx.init(params)
    step_fn = make_train_step(graphdef, tx)
    eval_fn = make_eval_loss(graphdef)

    def val_loss(p):
        losses = [float(eval_fn(p, jnp.asarray(val_windows[i:i + args.batch_size])))
                  for i in range(0, len(val_windows), args.batch_size)]
        return float(np.mean(losses))

    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(train_windows))
    cursor = 0
    history = {"step": [], "train_loss": [], "lr": [], "elapsed_s": []}
    val_history = {"step": [], "val_loss": []}
    t0 = time.perf_counter()
    window_losses = []
    tokens_per_step = args.batch_size * args.seq_len
    for step in range(1, args.steps + 1):
        if cursor + args.batch_size > len(order):
            order, cursor = rng.permutation(len(train_windows)), 0
        batch = jnp.asarray(train_windows[order[cursor:cursor + args.batch_size]])
        cursor += args.batch_size
        params, opt_state, loss = step_fn(params, opt_state, batch)
        window_losses.append(loss)
        if step % args.log_every == 0 or step == args.steps or step == 1:
            mean_loss = float(np.mean([float(x) for x in window_losses]))
            window_losses = []
            elapsed = time.perf_counter() - t0
            history["step"].append(step)
            history["train_loss"].append(round(mean_loss, 5))
            history["lr"].append(float(schedule(step - 1)))
            history["elapsed_s"].append(round(elapsed, 2))
            rate = step * tokens_per_step / max(elapsed, 1e-9)
            eta = (args.steps - step) * elapsed / step
            print(f"{_bar(step / args.steps)} step {step:5d}/{args.steps} loss {mean_loss:.4f} "
                  f"lr {float(schedule(step - 1)):.2e} {rate:,.0f} tok/s elapsed {elapsed:6.1f}s eta {eta:6.1f}s",
                  flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            vl = val_loss(params)
            val_history["step"].append(step)
            val_history["val_loss"].append(round(vl, 5))
            print(f"    val loss {vl:.4f} ({vl / math.log(2):.3f} bits/byte)", flush=True)
    train_time = time.perf_counter() - t0

    model = nnx.merge(graphdef, params)
    out = Path(args.out)
    save_hf_checkpoint(model, out)
    tokenizer.save(out)
    print(f"saved checkpoint to {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB)", flush=True)

    samples = greedy_continue(model, tokenizer, SAMPLE_PROMPTS, args.sample_tokens)
    for p, c in zip(SAMPLE_PROMPTS, samples):
        print(f"  {p!r} -> {c!r}")

    result = {
        "run": record(__file__, args, argv, started=started),
        "script": "scripts/train_tiny_llama.py",
        "args": vars(args),
        "config": config.to_hf_config(),
        "num_params": config.num_params(),
        "train_tokens": int(train_windows.size),
        "val_tokens": int(val_windows.size),
        "tokens_seen": int(args.steps * args.batch_size * (args.seq_len + 1)),
        "train_time_s": round(train_time, 1),
        "backend": jax.default_backend(),
        "uniform_loss": math.log(config.vocab_size),
        "final_train_loss": history["train_loss"][-1],
        "final_val_loss": val_history["val_loss"][-1],
        "train_curve": history,
        "val_curve": val_history,
        "greedy_samples": [{"prompt": p, "continuation": c} for p, c in zip(SAMPLE_PROMPTS, samples)],
    }
    if args.results:
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.results}")
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--out", default="checkpoints/tiny-llama")
    p.add_argument("--results", default="results/train_tiny_llama.json", help="'' to skip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--train-docs", type=int, default=40_000)
    p.add_argument("--val-docs", type=int, default=400)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--sample-tokens", type=int, default=64)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    print(f"jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} cpus)", flush=True)
    train(args, argv)


if __name__ == "__main__":
    sys.exit(main())
