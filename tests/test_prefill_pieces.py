"""Prefill pieces: a step's ``[P, C]`` chunk batch carries up to ``P`` pieces of the cohort's
prompts, several of one prompt when the others leave rows free (``serving_step.prefill_pieces``).

The cuts of a prompt depend on the prompt alone (multiples of ``C`` from its cached prefix on), so
packing changes how many steps a prefill takes, never what it computes: the engine must give the
same bits whether a prompt's pieces share a step or each has its own."""

import numpy as np
import pytest

import paged_kv as pk
from paged_kv.engine import BeamParams, SamplingParams, serving_step
from paged_kv.engine.families import CohortRow
from paged_kv.engine.serving import Request, ServingConfig, ServingEngine
from paged_kv.models import load_hf_checkpoint
from paged_kv.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
MGR = pk.ManagerConfig(num_blocks=200, block_size=16, max_seqs=8, max_blocks_per_seq=12)
CFG = ServingConfig(MGR, chunk_size=16, max_prefill_rows=4, top_candidates=8, impl="reference")


def _row(n, start=0, row=0):
    return CohortRow(row=row, family=None, index=0, tokens=np.arange(n, dtype=np.int32), start=start, fork_to=[])


def _cover(pieces, cr):
    return [(lo, q) for c, lo, q in pieces if c is cr]


def test_pieces_cut_at_multiples_of_the_chunk_and_cover_the_prompt():
    long, short = _row(70, start=5), _row(9, row=1)
    pieces = serving_step.prefill_pieces([long, short], chunk_size=16, max_pieces=10)
    # The first piece runs from the cached prefix to the next multiple of C; the last is partial.
    assert _cover(pieces, long) == [(5, 11), (16, 16), (32, 16), (48, 16), (64, 6)]
    assert _cover(pieces, short) == [(0, 9)]
    # Round-robin: every row's first piece before any row's second.
    assert [c.row for c, _, _ in pieces[:2]] == [0, 1]


def test_pieces_stop_at_the_row_budget_and_resume_where_they_stopped():
    a, b = _row(40), _row(20, row=1)
    first = serving_step.prefill_pieces([a, b], chunk_size=16, max_pieces=3)
    assert [(c.row, lo, q) for c, lo, q in first] == [(0, 0, 16), (1, 0, 16), (0, 16, 16)]
    for c, lo, q in first:  # what the scheduler records after the step
        c.done = lo + q
    second = serving_step.prefill_pieces([a, b], chunk_size=16, max_pieces=3)
    assert [(c.row, lo, q) for c, lo, q in second] == [(0, 32, 8), (1, 16, 4)]
    for c, lo, q in second:
        c.done = lo + q
    assert serving_step.prefill_pieces([a, b], chunk_size=16, max_pieces=3) == []


def test_a_cut_does_not_depend_on_the_neighbours():
    alone = serving_step.prefill_pieces([_row(50, start=3)], chunk_size=16, max_pieces=8)
    crowded = serving_step.prefill_pieces([_row(7, row=1), _row(50, start=3), _row(33, row=2)], 16, 8)
    assert [(lo, q) for _, lo, q in alone] == [(lo, q) for c, lo, q in crowded if c.row == 0]


@pytest.fixture(scope="module")
def model():
    return load_hf_checkpoint("checkpoints/tiny-llama")


def _requests():
    # Prompts of 3 to 6 pieces (C = 16) beside short ones, a family forked at the end of its
    # prefill, a beam, a later arrival that shares a prefix with the first prompt (a cache hit),
    # and one in the same cohort that shares it (computed by the first prompt's row).
    text = "Let us count to forty: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15"
    reqs = [Request(TOK.encode(text), SamplingParams(max_new_tokens=8), request_id="long"),
            # Admitted beside "long" (one cohort): its first blocks are the ones "long" computes
            # (admit's shared tokens), so its pieces may not run ahead of them.
            Request(TOK.encode(text + " and on"), SamplingParams(max_new_tokens=4), request_id="twin"),
            Request(TOK.encode("The cow says"), SamplingParams(max_new_tokens=6, temperature=0.8, top_k=5),
                    request_id="short"),
            Request(TOK.encode("Once upon a time there was a little engine that"),
                    SamplingParams(max_new_tokens=6, n=2, temperature=1.0), request_id="n2"),
            Request(TOK.encode("A bird in the hand is worth"), BeamParams(beam_width=2, max_new_tokens=5),
                    request_id="beam"),
            Request(TOK.encode(text + ", 16, 17"), SamplingParams(max_new_tokens=5), arrival=4, request_id="late")]
    return reqs


def _run(model):
    eng = ServingEngine(model, CFG, seed=7)
    outs = {o.request_id: (o.tokens, o.logprobs, o.scores, o.finish_reasons, o.stats.shared_prompt_tokens)
            for o in eng.run(_requests())}
    return outs, eng.stats()


def _aligned_chunks(cohort, chunk_size, max_pieces):
    # The schedule before pieces: chunk c covers positions [c C, (c + 1) C) of every row, all rows
    # in the same step, one chunk per step (c: the lowest chunk any unfinished row is in).
    left = [cr for cr in cohort if cr.done < len(cr.tokens)]
    if not left:
        return []
    c = min(cr.done // chunk_size for cr in left)
    return [(cr, cr.done, min((c + 1) * chunk_size, len(cr.tokens)) - cr.done)
            for cr in left if cr.done // chunk_size == c]


def test_packing_pieces_changes_the_steps_not_the_bits(model, monkeypatch):
    packed, packed_stats = _run(model)
    monkeypatch.setattr(serving_step, "prefill_pieces", _aligned_chunks)
    single, single_stats = _run(model)
    assert packed.keys() == single.keys()
    for rid in packed:
        tokens, logprobs, scores, reasons, _ = packed[rid]
        want = single[rid]
        assert tokens == want[0] and reasons == want[3], rid
        assert [np.asarray(x).tobytes() for x in logprobs or []] == [np.asarray(x).tobytes() for x in want[1] or []]
        assert np.asarray(scores).tobytes() == np.asarray(want[2]).tobytes(), rid
    assert packed_stats.prefill_tokens == single_stats.prefill_tokens
    # The long prompt's pieces shared steps: fewer prefill steps for the same positions.
    assert packed_stats.prefill_steps < single_stats.prefill_steps
    # The twin read blocks its cohort neighbour computed, in both schedules.
    assert packed["twin"][4] > 0 and single["twin"][4] > 0


def test_a_long_prompt_alone_prefills_in_one_step(model):
    prompt = TOK.encode("0123456789" * 6)  # 60 tokens: 4 pieces of C = 16 in the P = 4 rows
    eng = ServingEngine(model, CFG)
    out = list(eng.run([Request(prompt, SamplingParams(max_new_tokens=3))]))[0]
    st = eng.stats()
    assert st.prefill_steps == 1 and st.prefill_tokens == len(prompt)
    assert st.steps == 3 and len(out.tokens[0]) == 3
