"""scripts/bench_generate.py's bookkeeping: near-tie accounting and the load guard (no timing)."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_generate", ROOT / "scripts" / "bench_generate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_generate"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def model():
    from paged_kv.models import LlamaConfig, init_model
    return init_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                                  num_kv_heads=2), seed=0)


def _logits(rng, b, n, v, margin_at=None, margin=1.0):
    logits = rng.standard_normal((b, n, v)).astype(np.float32)
    top = logits.argmax(-1)
    # A clear winner everywhere ...
    np.put_along_axis(logits, top[..., None], logits.max(-1, keepdims=True) + 2.0, axis=-1)
    if margin_at is not None:  # ... except one step whose runner-up is `margin` below the top
        r, s = margin_at
        second = np.argsort(logits[r, s])[-2]
        logits[r, s, second] = logits[r, s].max() - margin
    return logits


def test_agreement_tells_near_ties_from_real_divergences(bench, model):
    rng = np.random.default_rng(0)
    b, n, v = 4, 6, 64
    tie = _logits(rng, b, n, v, margin_at=(1, 3), margin=2e-6)  # a few float32 ulps
    ours = tie.argmax(-1)
    other = ours.copy()
    other[1, 3:] = np.argsort(tie[1, 3])[-2]
    assert other[1, 3] != ours[1, 3]  # diverges at the near-tie, then differs onwards
    a = bench.agreement(model, tie, ours, {"x": other}, context=16)
    assert a["near_tie_steps"] == 1 and a["x"]["diverging"] == 1
    assert a["x"]["first_divergence_at_near_tie"] == 1 and a["real_divergences"] == 0

    clear = _logits(rng, b, n, v)
    ours = clear.argmax(-1)
    other = ours.copy()
    other[2, 1] = (ours[2, 1] + 1) % v  # a divergence where the top logit wins by 2
    a = bench.agreement(model, clear, ours, {"x": other}, context=16)
    assert a["near_tie_steps"] == 0 and a["x"]["real_divergences"] == 1 and a["real_divergences"] == 1
    # The teacher-forced check: a token that is not the argmax of clear logits is a real divergence.
    a = bench.agreement(model, clear, other, {}, context=16)
    assert a["teacher_forced"]["disagreeing_steps"] == 1 and a["real_divergences"] == 1


def test_load_meter_counts_other_processes_only(bench):
    meter = bench.LoadMeter()
    s = meter.start()
    x = 0
    for i in range(2_000_000):  # this process's own work is not "other processes"
        x += i
    rec = meter.stop(s)
    assert rec["other_processes_cores"] is None or 0.0 <= rec["other_processes_cores"] < meter.cpus
    assert set(rec) == {"load_average_before", "load_average_after", "other_processes_cores"}


def test_docs_table_renders_every_row(bench, tmp_path):
    row = {"prompt": 128, "batch": 8, "on_device_tok_s": 3000.0, "contiguous_host_loop_tok_s": 1700.0,
           "transformers_tok_s": 1400.0, "on_device_over_transformers": 3000 / 1400,
           "agreement": {"near_tie_steps": 3, "steps": 512, "real_divergences": 0,
                         "contiguous": {"diverging": 0, "sequences": 8},
                         "transformers": {"diverging": 1, "sequences": 8}}}
    meta = {"new_tokens": 256, "block_size": 16, "repeats": 3,
            "command": "python scripts/bench_generate.py --repeats 3 --update-docs",
            "cpu_count": 2, "jax": "0.10.2", "torch": "2", "torch_threads": 2, "transformers": "5",
            "max_other_cores_per_core": 0.05}
    page = tmp_path / "benchmarks.md"
    page.write_text(f"intro\n{bench.BEGIN}\nold\n{bench.END}\nrest\n")
    bench.update_docs({"meta": meta, "rows": [row, {**row, "batch": 64}]}, page)
    text = page.read_text()
    assert "old" not in text and "| 128 | 8 | 3,000 |" in text and "| 128 | 64 |" in text and "2.14x" in text
    assert text.startswith("intro\n") and text.endswith("rest\n")
    # The table shows how to measure, not how it was written into the page.
    assert "`python scripts/bench_generate.py --repeats 3`" in text and "--update" not in text


def test_scripts_write_docs_not_the_readme(bench):
    from scripts import doc_tables

    page = ROOT / "docs" / "benchmarks.md"
    assert doc_tables.BENCHMARKS == page and bench.update_docs.__defaults__ == (page,)
    text, readme = page.read_text(), (ROOT / "README.md").read_text()
    for name in ("bench_generate", "profile_decode"):
        begin, end = doc_tables.markers(name)
        assert text.count(begin) == 1 and text.count(end) == 1, name
        assert begin not in readme and end not in readme, name
    for script in ("bench_generate.py", "profile_decode.py"):  # (profile_decode sets XLA_FLAGS on import)
        source = (ROOT / "scripts" / script).read_text()
        assert "update_docs" in source and "update_readme" not in source and "--update-readme" not in source, script
