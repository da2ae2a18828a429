"""Sampling that depends only on the request (the seeding rule of ``paged_kv.engine.sampling``):
a sample's randomness is a function of its seed, its sample index and its token index, never of
its row, its batchmates, the batch size or the submission order.

``generate``: a prompt repeated in every row of a batch samples the same tokens in each row and
alone; permuting the prompts (and their seeds) permutes the outputs; the seeds derived from the
key are recorded and replay a prompt alone; ``n > 1`` samples differ yet repeat. ``ServingEngine``:
a request samples the same tokens alone, after another submission, among batchmates and with
fewer rows; its default seed is a stable hash of the engine's seed and its id, recorded in its
output, and replays it on a fresh engine with another engine seed.

Mutation-checked: keying ``generate``'s draws by row (``rows`` for ``rows % n``, or one key for
the batch), the serving default seed by submission number, or the serving keys by row makes
tests here fail.
"""

import jax
import numpy as np
import pytest

import paged_kv as pk
from paged_kv import engine
from paged_kv.engine import SamplingParams
from paged_kv.engine.sampling import default_seed, derive_seeds, root_key, sample_keys, sample_tokens
from paged_kv.engine.serving import Request, ServingConfig, ServingEngine
from paged_kv.models import allocate_pages, load_hf_checkpoint, page_spec
from paged_kv.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
PARAMS = SamplingParams(max_new_tokens=24, temperature=3.0, n=2)
PROMPTS = ["The cow says", "Once upon a time", "Let us count: 1, 2,", "Q: What do bees make? A:"]
WIDTH = 32


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint("checkpoints/tiny-llama")


# ---------------------------------------------------------------------------- generate
def _generate(model, prompts, seeds=None, key=0, params=PARAMS):
    mgr = pk.ManagerConfig(num_blocks=64, block_size=8, max_seqs=8, max_blocks_per_seq=8)
    toks, lens = engine.pad_prompts([TOK.encode(p) for p in prompts], width=WIDTH)
    pages = allocate_pages(page_spec(model.config, mgr.num_blocks, mgr.block_size))
    out, _, _ = engine.generate(model, pages, toks, lens, key, params, manager=mgr, impl="reference", seeds=seeds)
    return out


def _distinct(tokens) -> int:
    return len({tuple(t) for t in np.asarray(tokens).reshape(-1, np.shape(tokens)[-1]).tolist()})


def test_generate_same_prompt_same_samples_in_every_row_and_alone(model):
    """One prompt in each of 4 rows with one seed: every row samples the same tokens (identical
    rows have identical logits), and so does the prompt alone in a batch of 1. Before the rule,
    one key drew a [B * n, V] noise array and only row 0 matched the prompt alone."""
    four = _generate(model, [PROMPTS[0]] * 4, seeds=[11] * 4)
    tokens = np.asarray(four.tokens)
    for b in range(1, 4):
        np.testing.assert_array_equal(tokens[b], tokens[0])
    assert _distinct(tokens[0]) == 2  # its two samples differ
    alone = _generate(model, [PROMPTS[0]], seeds=[11])
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], tokens[0])
    assert np.asarray(four.seeds).tolist() == [11] * 4


def test_generate_permuted_rows_give_permuted_outputs(model):
    seeds = [5, 6, 7, 8]
    out = _generate(model, PROMPTS, seeds=seeds)
    perm = [2, 0, 3, 1]
    moved = _generate(model, [PROMPTS[p] for p in perm], seeds=[seeds[p] for p in perm])
    np.testing.assert_array_equal(np.asarray(moved.tokens), np.asarray(out.tokens)[perm])
    np.testing.assert_array_equal(np.asarray(moved.lengths), np.asarray(out.lengths)[perm])


def test_generate_records_derived_seeds_that_replay_a_prompt_alone(model):
    """Without ``seeds`` each prompt's seed comes from the key and its index; the output records
    them, and each prompt replays alone (batch 1) from its recorded seed."""
    key = jax.random.key(3)
    out = _generate(model, PROMPTS, key=key)
    seeds = np.asarray(out.seeds)
    np.testing.assert_array_equal(seeds, derive_seeds(key, len(PROMPTS)))
    assert len(set(seeds.tolist())) == len(PROMPTS) and (seeds >= 0).all()
    for b in (1, 3):
        alone = _generate(model, [PROMPTS[b]], seeds=[int(seeds[b])], key=99)
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(out.tokens)[b])
    # The same key again: the same seeds and tokens; another key: other samples.
    again = _generate(model, PROMPTS, key=key)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(out.tokens))
    other = _generate(model, PROMPTS, key=jax.random.key(4))
    assert not np.array_equal(np.asarray(other.tokens), np.asarray(out.tokens))


def test_generate_checks_seeds(model):
    for seeds, match in (([1, 2], r"shape \(1,\)"), ([-1], r"seeds\[0\]=-1 must be"), ([2**31], r"seeds\[0\]="),
                         ([1.5], "integers"), ([True], "integers")):
        with pytest.raises(ValueError, match=match):
            _generate(model, [PROMPTS[0]], seeds=seeds)


def test_sample_tokens_rows_draw_with_their_own_keys():
    """Per-row keys: a row's token is a function of its logits and key, not of its position."""
    logits = jax.random.normal(jax.random.key(0), (3, 50)) * 2
    keys = sample_keys(root_key(), np.array([4, 4, 9], np.int32), np.array([0, 1, 0], np.int32),
                       np.zeros(3, np.int32))
    params = SamplingParams(temperature=1.0, top_k=20)
    tok, lp = sample_tokens(logits, keys, params)
    flipped, flp = sample_tokens(logits[::-1], keys[::-1], params)
    np.testing.assert_array_equal(flipped, tok[::-1])
    np.testing.assert_array_equal(flp, lp[::-1])
    one, _ = sample_tokens(logits[1:2], keys[1:2], params)
    assert int(one[0]) == int(tok[1])


# ---------------------------------------------------------------------------- serving
MGR = pk.ManagerConfig(num_blocks=48, block_size=16, max_seqs=8, max_blocks_per_seq=8)
CFG = ServingConfig(MGR, chunk_size=32, max_prefill_rows=4, top_candidates=8, impl="reference")
PROBE = Request(TOK.encode("The dog says"), PARAMS, request_id="probe")


def _serve(model, reqs, seed=0, config=CFG):
    return {o.request_id: o for o in ServingEngine(model, config, seed=seed).run(reqs)}


def _mates(k):
    return [Request(TOK.encode(PROMPTS[i % len(PROMPTS)]), SamplingParams(max_new_tokens=16, temperature=1.0),
                    request_id=f"mate{i}") for i in range(k)]


@pytest.fixture(scope="module")
def probe_alone(model):
    return _serve(model, [PROBE])["probe"]


def test_default_seed_is_a_stable_hash_of_engine_seed_and_id(probe_alone):
    # Pinned values: Python's salted ``hash`` would change them from one process to the next.
    assert default_seed(0, "a") == 88495011 and default_seed(1, "a") == 1188087038
    assert default_seed(0, 3) == default_seed(0, np.int64(3)) != default_seed(0, "3")
    assert probe_alone.seed == default_seed(0, "probe")
    assert _distinct(probe_alone.tokens) == 2  # n = 2 samples differ


def test_serving_request_samples_do_not_depend_on_submission_order_or_batch(model, probe_alone):
    # Submitted after others (its submission number changes), among batchmates (other rows).
    after = _serve(model, _mates(5) + [PROBE])
    assert after["probe"].tokens == probe_alone.tokens
    # Fewer rows: another batch size (the same logits on this model and backend).
    small = ServingConfig(pk.ManagerConfig(num_blocks=48, block_size=16, max_seqs=4, max_blocks_per_seq=8),
                          chunk_size=32, max_prefill_rows=2, top_candidates=8, impl="reference")
    assert _serve(model, _mates(3) + [PROBE], config=small)["probe"].tokens == probe_alone.tokens


def test_serving_replays_a_recorded_seed_on_a_fresh_engine(model, probe_alone):
    """The recorded seed alone fixes the samples: another engine seed, another id, another row."""
    replay = Request(PROBE.prompt, PARAMS, request_id="replay", seed=probe_alone.seed)
    outs = _serve(model, _mates(2) + [replay], seed=12345)
    assert outs["replay"].seed == probe_alone.seed
    assert outs["replay"].tokens == probe_alone.tokens
    # Another engine seed changes a default seed, so the samples.
    assert _serve(model, [PROBE], seed=1)["probe"].tokens != probe_alone.tokens


def test_serving_and_generate_share_the_rule(model, probe_alone):
    """The same seed gives the same samples in both engines (their logits agree here)."""
    out = _generate(model, ["The dog says"], seeds=[probe_alone.seed])
    got = [t[:n] for t, n in zip(np.asarray(out.tokens)[0].tolist(), np.asarray(out.lengths)[0].tolist())]
    assert got == probe_alone.tokens
