"""The main job (``python -m paged_kv``): help, one-line errors, and a small end-to-end run in a
subprocess (report, PNG, JSON)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = ["--checkpoint", "--requests", "--max-new-tokens", "--arrival-gap", "--seed", "--num-blocks",
           "--block-size", "--max-seqs", "--max-seq-len", "--chunk-size", "--max-prefill-rows",
           "--no-prefix-caching", "--tp", "--impl", "--show", "--png", "--json", "--color", "--no-progress",
           "--walkthrough"]


def _run(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "paged_kv", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_help_explains_every_option():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    for opt in OPTIONS:
        assert opt in r.stdout, opt
    from paged_kv.cli import build_parser

    for action in build_parser()._actions:
        assert action.help, action.option_strings  # every option has an explanation


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--num-blocks", "zero"], "'zero' is not an integer"),
    (["--block-size", "12"], "must be a power of two"),
    (["--requests", "0"], "0 must be >= 1"),
    (["--tp", "0"], "0 must be >= 1"),
    (["--impl", "cuda"], "invalid choice"),
    (["--png", "/no/such/dir/x.png"], "does not exist"),
])
def test_bad_option_is_one_line(args, message):
    r = _run(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paged-kv: error:") and message in lines[0], r.stderr


def test_missing_checkpoint_is_one_line(tmp_path):
    r = _run("--checkpoint", str(tmp_path / "nope"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"paged-kv: error: checkpoint directory '{tmp_path / 'nope'}' "
                                             "does not exist"]
    (tmp_path / "empty").mkdir()
    r = _run("--checkpoint", str(tmp_path / "empty"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "cannot load checkpoint" in r.stderr


def test_tensor_parallel_degree_that_fits_no_head_layout_is_one_line():
    r = _run("--tp", "3", "--requests", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "paged-kv: error: tensor-parallel degree tp=3 fits no head layout: 3 does not divide num_heads=4; "
        "degrees that work for this model: [1, 2, 4]"]


@pytest.mark.skipif(os.environ.get("PAGED_KV_MESH_TESTS") != "1",
                    reason="compiles the serving step for 2 host devices; set PAGED_KV_MESH_TESTS=1")
def test_tensor_parallel_run(tmp_path):
    r = _run("--tp", "2", "--requests", "3", "--max-new-tokens", "6", "--num-blocks", "24", "--max-seqs", "12",
             "--max-seq-len", "192", "--chunk-size", "32", "--max-prefill-rows", "4", "--no-progress",
             "--png", str(tmp_path / "t.png"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tensor-parallel over 2 devices" in r.stdout and "generated tokens/s" in r.stdout


def test_small_end_to_end_run(tmp_path):
    """Six requests (greedy, shared preamble, n=4 samples, a beam search) in a 24-block pool."""
    png, js = tmp_path / "tables.png", tmp_path / "report.json"
    r = _run("--requests", "6", "--max-new-tokens", "12", "--num-blocks", "24", "--max-seqs", "12",
             "--max-seq-len", "192", "--chunk-size", "32", "--max-prefill-rows", "4", "--no-progress",
             "--png", str(png), "--json", str(js))
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for text in ("generated tokens/s", "peak blocks in use", "saved by sharing", "prefix cache", "preemptions",
                 "block tables of request", "beam 0 (score"):
        assert text in out, text
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    rep = json.loads(js.read_text())
    assert rep["requests"] == {"total": 6, "finished": 6, "rejected": 0, "sampling_n_gt_1": 1, "beam": 1}
    assert rep["throughput"]["tokens_per_s"] > 0
    assert rep["sharing"]["beam_search"]["saved_fraction"] > 0
    assert rep["sharing"]["parallel_sampling"]["saved_fraction"] > 0
    assert rep["prefix_cache"]["hit_tokens"] > 0  # the shared preamble
    assert rep["block_tables"]["saved_blocks"] > 0
