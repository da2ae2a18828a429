"""The serving step's variants: on a CPU one program serves every step (the prefill chunk's
forward is skipped by a ``cond`` on steps without a chunk). It must give the same bits as the two
variants the GPU compiles, and write the donated pages in place like every other step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_kv as pk
from paged_kv.engine import BeamParams, SamplingParams, serving_step
from paged_kv.engine.serving import Request, ServingConfig, ServingEngine
from paged_kv.models import load_hf_checkpoint
from paged_kv.models.tokenizer import ByteTokenizer
from tests import tolerances as tol
from tests.test_model_scan import page_sized_copies

TOK = ByteTokenizer()
# Pages far larger than any weight of the tiny model, so that a copy of them stands out.
MGR = pk.ManagerConfig(num_blocks=520, block_size=16, max_seqs=8, max_blocks_per_seq=8)
CFG = ServingConfig(MGR, chunk_size=16, max_prefill_rows=2, top_candidates=8, impl="reference")


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint("checkpoints/tiny-llama")


def _requests():
    # Staggered arrivals and prompts longer than one chunk: steps with a chunk, steps without one,
    # and steps that prefill one cohort while others decode; sampled rows, a family, a beam.
    texts = ["The cow says", "Let us count to twenty: 1, 2, 3, 4,", "Once upon a time"]
    reqs = [Request(TOK.encode(t), SamplingParams(max_new_tokens=12, temperature=0.7 * (i % 2), top_k=5 * (i % 3)),
                    arrival=3 * i, request_id=i) for i, t in enumerate(texts)]
    reqs.append(Request(TOK.encode("The cat"), SamplingParams(max_new_tokens=10, n=2, temperature=1.0),
                        arrival=2, request_id="n2"))
    reqs.append(Request(TOK.encode("A bird"), BeamParams(beam_width=2, max_new_tokens=8), arrival=5,
                        request_id="beam"))
    return reqs


def _outputs(model, seed=3):
    eng = ServingEngine(model, CFG, seed=seed)
    outs = {o.request_id: (o.tokens, o.logprobs, o.scores, o.finish_reasons) for o in eng.run(_requests())}
    return eng, outs


def test_the_single_variant_updates_pages_in_place(model):
    """The chunk's forward sits in a ``cond`` that the pages pass through: XLA must still update
    them in place (no copy of the pages or of one layer's pages) and alias them to the output."""
    eng = ServingEngine(model, CFG)
    text = eng.device.lower_step(CFG.max_prefill_rows).compile().as_text()
    pages = eng.pages
    layer_elements = int(np.prod(pages.shape[1:]))
    assert layer_elements > 4 * max(int(np.prod(w.shape)) for w in jax.tree.leaves(eng.device.weights))
    assert page_sized_copies(text, layer_elements) == []
    assert "input_output_alias" in text


def test_one_variant_on_cpu_gives_the_bits_of_two(model, monkeypatch):
    eng, one = _outputs(model)
    assert eng.device.variants() == (CFG.max_prefill_rows,)
    assert [name for name, _, _ in eng.programs()] == ["step variant 1/1 (prefill chunk [2, 16] + decode)", "admit"]
    monkeypatch.setattr(serving_step, "single_step_variant", lambda pages: False)
    eng2, two = _outputs(model)
    assert eng2.device.variants() == (0, CFG.max_prefill_rows)
    assert one.keys() == two.keys()
    for rid in one:
        tokens, logprobs, scores, reasons = one[rid]
        assert tokens == two[rid][0] and reasons == two[rid][3], rid
        if logprobs is not None:  # the same program up to the skipped cond: the same bits
            for a, b in zip(logprobs, two[rid][1]):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert scores == two[rid][2], rid


def test_only_the_targets_form_is_traced():
    """``per_platform`` traces one form for target "cpu" or "gpu" (no ``platform_index`` left in
    the jaxpr to choose at lowering) and both for "auto"; the engine's step on CPU arrays asks
    for the CPU form."""
    from paged_kv import scan

    def jaxpr(target):
        return str(jax.make_jaxpr(lambda v: scan.per_platform(target, v, cpu=lambda u: u + 1,
                                                              default=lambda u: u * 2))(jnp.ones(3)))

    assert "platform_index" in jaxpr("auto")
    cpu, gpu = jaxpr("cpu"), jaxpr("gpu")
    assert "platform_index" not in cpu and "add" in cpu and "mul" not in cpu
    assert "platform_index" not in gpu and "mul" in gpu
    assert scan.target_of(jnp.ones(3)) == "cpu"


def test_the_engine_traces_the_cpu_form(model):
    eng = ServingEngine(model, CFG)
    assert eng.device.config.manager.target == "cpu"
    assert {s.config.manager.target for s in eng.device._shapes.values()} == {"cpu"}


# Wider than 8 prefill rows: on a CPU the chunk forward runs on 8 or 16 rows, whichever holds the
# step's pieces (``serving_step.prefill_widths``).
WIDE = ServingConfig(pk.ManagerConfig(num_blocks=520, block_size=16, max_seqs=16, max_blocks_per_seq=8),
                     chunk_size=16, max_prefill_rows=16, top_candidates=8, impl="reference")


def test_prefill_widths_are_a_ladder_up_to_p():
    assert serving_step.prefill_widths(1) == (1,) and serving_step.prefill_widths(8) == (8,)
    assert serving_step.prefill_widths(16) == (8, 16)
    assert serving_step.prefill_widths(256) == (8, 32, 128, 256)
    assert serving_step.prefill_widths(300) == (8, 32, 128, 300)


def _wide_outputs(model):
    # 12 prompts at step 0 (one step of 12 pieces: the 16-row forward), then one late arrival
    # (a step of one piece: the 8-row forward) while the others decode; greedy.
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    reqs = [Request(TOK.encode(f"Prompt number {i}:"), params, request_id=i) for i in range(12)]
    reqs.append(Request(TOK.encode("The late one"), params, arrival=4, request_id="late"))
    eng = ServingEngine(model, WIDE)
    return eng, {o.request_id: o for o in eng.run(reqs)}


def test_the_width_ladder_gives_the_tokens_of_the_full_width(model, monkeypatch):
    """The narrow branch computes the pieces' rows only: the same greedy tokens as two variants
    (every chunk at the full ``[P, C]``), log-probs within float32 rounding (another batch
    size), and the pages still updated in place through the switch."""
    eng, one = _wide_outputs(model)
    text = eng.device.lower_step(WIDE.max_prefill_rows).compile().as_text()
    layer_elements = int(np.prod(eng.pages.shape[1:]))
    assert page_sized_copies(text, layer_elements) == [] and "input_output_alias" in text
    monkeypatch.setattr(serving_step, "single_step_variant", lambda pages: False)
    eng2, two = _wide_outputs(model)
    assert eng2.device.variants() == (0, WIDE.max_prefill_rows)
    assert one.keys() == two.keys()
    # Two batch sizes of one forward: the logits bound of two computations over a context of at
    # most 32 positions (prompts under 22 tokens, 10 new), carried through log_softmax.
    atol = tol.logprob_atol(tol.model_atol(model.config, 32, tol.logits_bound(model),
                                           score_mag=tol.score_bound(model)), model.config.vocab_size)
    for rid, o in one.items():
        assert o.tokens == two[rid].tokens, rid
        np.testing.assert_allclose(o.logprobs[0], two[rid].logprobs[0], rtol=0, atol=atol)
