"""paged-kv's block manager against vLLM 0.33's own KVCacheManager, on random request streams rich
in duplicate full blocks (``scripts/diff_vllm.py``): hit tokens of every admission, tables, append
outcomes and the free queue after every free must be identical, id for id; with KV-cache groups,
under both prefix-cache retention settings, the cached set too; spans (chunked prefill, speculative
decoding) against ``allocate_slots`` as vLLM's scheduler calls it.

Runs where vLLM's CPU environment exists (``../shared/tools/vllm_ref/setup.sh`` builds it in
``~/.cache/vllm-ref-env``, or set ``VLLM_ENV``); skipped elsewhere."""

import pytest

from scripts import diff_vllm


@pytest.mark.skipif(diff_vllm.find_driver() is None or not diff_vllm.env_built(),
                    reason="vLLM 0.33 reference environment not built (../shared/tools/vllm_ref/setup.sh)")
@pytest.mark.parametrize("seed", [101, 202])
def test_identical_to_vllm_on_random_streams(seed):
    r = diff_vllm.compare(seed, 120, 12, diff_vllm.DEFAULT_ENV, diff_vllm.find_driver())
    assert r["hit_tokens"] > 0
    assert r["equal"], r["first_difference"]


@pytest.mark.skipif(not diff_vllm.env_built(),
                    reason="vLLM 0.33 reference environment not built (../shared/tools/vllm_ref/setup.sh)")
@pytest.mark.parametrize("retention", diff_vllm.RETENTIONS)
def test_groups_identical_to_vllm(retention):
    """A full group and a sliding window of 5 tokens (block size 4), under sparse (``0``) and
    dense (``none``) prefix-cache retention, set alike on both sides: hits, every group's table,
    the free queue and the cached set equal vLLM's hybrid ``KVCacheManager``'s after every op."""
    r = diff_vllm.compare_groups(7, 120, 40, "full,w5", diff_vllm.DEFAULT_ENV, retention)
    assert r["hit_tokens"] > 0 and r["null_entries_seen"] > 0
    assert r["equal"], r["first_difference"]


@pytest.mark.skipif(not diff_vllm.env_built(),
                    reason="vLLM 0.33 reference environment not built (../shared/tools/vllm_ref/setup.sh)")
@pytest.mark.parametrize("seed,groups,retention", [(1, "full,w5", "none"), (6, "full,c8", "0")])
def test_spans_identical_to_vllm(seed, groups, retention):
    """Chunked prefill and speculative decoding (drafts, lookahead of ``k`` slots, rejected drafts
    kept as reserved blocks) through ``extend`` / ``commit`` / ``truncate(keep_reserved=True)``
    equal vLLM's ``allocate_slots`` as its scheduler calls it, with a sliding window (dense
    retention) and with ChunkedLocal: hits, every group's table, blocks in use, the free queue and
    the cached set after every op (``scripts/diff_vllm_spans.py``)."""
    from scripts import diff_vllm_spans

    r = diff_vllm_spans.compare_spans(seed, 120, 40, groups, diff_vllm.DEFAULT_ENV, retention)
    assert r["hit_tokens"] > 0 and r["spec_steps"] > 0 and r["prefill_chunks"] > 0 and r["lookahead"] > 0
    assert r["equal"], r["first_difference"]
