"""docs/own_model.md runs as printed: its ```python blocks, in order, as one script in a fresh
Python process started outside the repository. The page's model block is also the model part of
examples/gpt2.py verbatim, so the two cannot drift apart, and the greedy requests of its
ServingEngine run (which preempts) print the tokens of the same model's contiguous greedy
decoding. This is the GPT-2's serving-with-preemption check (tests/test_model_gpt2.py has the rest)."""

import ast
import re
import subprocess
import sys
from pathlib import Path

from flax import nnx

from examples.gpt2 import GPT2, GPT2Config
from paged_kv.models import greedy_generate_contiguous

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "own_model.md"


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(), flags=re.S | re.M)


def test_page_blocks_run_as_printed(tmp_path):
    blocks = _blocks()
    assert len(blocks) >= 4  # the model, pages, generate, ServingEngine
    script = tmp_path / "own_model.py"
    script.write_text("\n".join(blocks))
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "ModelFacts(num_layers=2, num_kv_heads=4, head_dim=8, vocab_size=96, max_positions=64" in out
    assert "(2, 2, 4, 32, 8, 8)" in out and "(2, 3, 8)" in out
    assert ("Unfinished does not implement the paged model protocol: missing __call__, logits, head_dim, "
            "max_positions, dtype") in out
    assert re.search(r"^pi \[\[", out, flags=re.M) and re.search(r"^sqrt2 \[\[.*\], \[", out, flags=re.M)
    preemptions = int(re.search(r"^(\d+) preemptions$", out, flags=re.M).group(1))
    assert preemptions >= 1  # the page's claim: the small pool forces preemption
    # The page's model and greedy prompts (its ServingEngine block); same config and seed, same weights.
    model = GPT2(GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4), rngs=nnx.Rngs(0))
    greedy = {"pi": [3, 1, 4, 1, 5, 9, 2, 6, 5], "e": [2, 7, 1, 8, 2, 8, 1, 8]}
    want, _ = greedy_generate_contiguous(model, list(greedy.values()), 16, chunk_size=8, max_len=32)
    for (rid, _), tokens in zip(greedy.items(), want):
        line = re.search(rf"^{rid} (\[\[.*\]\]) \d+$", out, flags=re.M).group(1)
        assert ast.literal_eval(line) == [tokens.tolist()], rid


def test_page_model_is_the_example():
    model_block = _blocks()[0]
    assert "class GPT2(nnx.Module)" in model_block
    assert model_block in (ROOT / "examples" / "gpt2.py").read_text()
