"""The main job (``python -m paged_kv``): help, one-line errors, and a small end-to-end run in a
subprocess (report, PNG, JSON). Every run that may write files gets ``--out-dir`` in a temporary
folder, so the tests never write into the repository."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = ["--checkpoint", "--requests", "--max-new-tokens", "--arrival-gap", "--seed", "--num-blocks",
           "--block-size", "--max-seqs", "--max-seq-len", "--chunk-size", "--max-prefill-rows",
           "--no-prefix-caching", "--tp", "--impl", "--batch-invariant", "--kv-dtype", "--show", "--out-dir", "--png",
           "--json", "--color",
           "--no-progress", "--compile-cache", "--no-compile-cache", "--walkthrough", "--prompt", "--prompts-file",
           "--overwrite", "--decode-steps",
           "--chat", "--n", "--beam-width", "--temperature", "--top-p", "--top-k", "--verbose"]
# The CLI's persistent compilation cache goes to a folder of this test session, not the user's.
_CACHE_HOME = tempfile.mkdtemp(prefix="paged-kv-test-cache-")


def _run(*args, timeout=600, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "XDG_CACHE_HOME": _CACHE_HOME, **(env or {})}
    return subprocess.run([sys.executable, "-m", "paged_kv", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_help_explains_every_option():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    for opt in OPTIONS:
        assert opt in r.stdout, opt
    from paged_kv.apps.cli import build_parser

    for action in build_parser()._actions:
        assert action.help, action.option_strings  # every option has an explanation


def test_help_shows_each_default_once():
    from paged_kv.apps.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "(default: None)" not in text and "(default: False)" not in text
    start = text.index("--checkpoint DIR ")
    checkpoint_help = text[start: text.index("--requests N ", start)]
    assert checkpoint_help.lower().count("default") == 1, checkpoint_help
    assert "(default: 24)" in text  # --requests: real defaults are still shown
    assert "(default: paged-kv-out)" in text and "docs/design.md" in text


def test_help_names_every_model_family():
    from paged_kv.apps import cli
    from paged_kv.models.config import FAMILIES

    text = " ".join(cli.build_parser().format_help().split())
    start = text.index("--checkpoint DIR ")
    checkpoint_help = text[start: text.index("--requests N ", start)]
    for family in FAMILIES:  # llama ... gemma3_text: the families the loader takes
        assert family in checkpoint_help, family
    assert "Gemma 3" in cli.__doc__


def test_output_paths_default_to_the_output_folder():
    from paged_kv.apps.cli import build_parser, output_paths

    p = build_parser()
    assert output_paths(p.parse_args([])) == (Path("paged-kv-out/block_tables.png"), Path("paged-kv-out/report.json"))
    assert output_paths(p.parse_args(["--out-dir", "runs/a"])) == (Path("runs/a/block_tables.png"),
                                                                   Path("runs/a/report.json"))
    # --png / --json name a file of their own; the other one still goes to the folder.
    assert output_paths(p.parse_args(["--out-dir", "o", "--png", "t.png"])) == (Path("t.png"), Path("o/report.json"))
    assert output_paths(p.parse_args(["--json", "r.json"])) == (Path("paged-kv-out/block_tables.png"),
                                                                Path("r.json"))


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--num-blocks", "zero"], "'zero' is not an integer"),
    (["--block-size", "12"], "must be a power of two"),
    (["--requests", "0"], "0 must be >= 1"),
    (["--tp", "0"], "0 must be >= 1"),
    (["--impl", "cuda"], "invalid choice"),
    (["--png", "/no/such/dir/x.png"], "does not exist"),
    (["--out-dir", "pyproject.toml"], "is not a directory"),
    (["--out-dir", "pyproject.toml/sub"], "is a file, not a directory"),
    (["--max-new-tokens", "100000"], "--max-new-tokens 100000 does not fit --max-seq-len 256 (prompt + answer, and a "
                                     "prompt has at least one token): at most 255"),
    (["--prompt", "hi", "--n", "1000"], "--n 1000 needs 1000 sequences running at once; --max-seqs is 32 (raise "
                                        "--max-seqs to 1000 or more, or lower --n)"),
    (["--prompt", "hi", "--beam-width", "40"], "--beam-width 40 needs 40 sequences running at once; --max-seqs is 32"),
    (["--batch-invariant", "--kv-dtype", "int8"], "--batch-invariant does not support --kv-dtype int8"),
    (["--decode-steps", "100000"], "--decode-steps 100000 must be <= "),  # the library's check, in the option's terms
    # Needs the backend (the reference kernels' limit): still before the model loads.
    (["--batch-invariant", "--block-size", "256"], "--batch-invariant on the reference kernels (--impl auto on cpu) "
                                                   "needs a --block-size that divides 128"),
])
def test_bad_option_is_one_line(args, message, tmp_path):
    r = _run(*args, *([] if "--out-dir" in args else ["--out-dir", str(tmp_path / "out")]))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("paged-kv: error:") and message in lines[0], r.stderr
    assert lines[0].endswith("(see --help)") and not re.search(r"[a-z_]=", lines[0]), lines[0]  # no library names
    assert r.stdout == "" and not (tmp_path / "out").exists()


def test_missing_checkpoint_is_one_line(tmp_path):
    r = _run("--checkpoint", str(tmp_path / "nope"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"paged-kv: error: checkpoint directory '{tmp_path / 'nope'}' "
                                             "does not exist"]
    (tmp_path / "file").write_text("x")
    r = _run("--checkpoint", str(tmp_path / "file"))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"paged-kv: error: checkpoint '{tmp_path / 'file'}' is a file, not a "
                                             "directory (pass the directory that holds config.json and the "
                                             "safetensors)"]
    r = _run("--checkpoint", "checkpoints/tiny-llama/config.json")
    assert r.returncode == 1 and "did you mean --checkpoint 'checkpoints/tiny-llama'?" in r.stderr
    (tmp_path / "empty").mkdir()
    r = _run("--checkpoint", str(tmp_path / "empty"))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "cannot load checkpoint" in r.stderr


def test_tensor_parallel_degree_that_fits_no_head_layout_is_one_line(tmp_path):
    """Checked against the checkpoint's config.json, before the weights load; named as the option."""
    r = _run("--tp", "3", "--requests", "2", "--out-dir", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "paged-kv: error: tensor-parallel degree --tp 3 fits no head layout: 3 does not divide num_heads=4; "
        "degrees that work for this model: [1, 2, 4] (see --help)"]


def test_tensor_parallel_run(tmp_path):
    """``--tp 2`` on a CPU: the CLI creates its 2 host devices itself and serves over them.
    Compiling dominates: XLA's optimisation passes are off for this run (as in
    tests/sharding_worker.py; the SPMD partitioner still runs), and no other test compiles these
    programs, so the compilation cache is off too."""
    r = _run("--tp", "2", "--requests", "3", "--max-new-tokens", "6", "--num-blocks", "24", "--max-seqs", "12",
             "--max-seq-len", "192", "--chunk-size", "32", "--max-prefill-rows", "4", "--no-progress",
             "--no-compile-cache", "--out-dir", str(tmp_path),
             env={"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "block_tables.png").is_file() and (tmp_path / "report.json").is_file()
    assert "tensor-parallel over 2 devices" in r.stdout and "generated tokens/s" in r.stdout
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["requests"]["finished"] == 3 and rep["run"]["options"]["tp"] == 2
    assert rep["run"]["backend"] == "cpu" and rep["run"]["device_count"] == 2  # the CLI's own host devices


SMALL_RUN = ("--requests", "6", "--max-new-tokens", "12", "--num-blocks", "24", "--max-seqs", "12",
             "--max-seq-len", "192", "--chunk-size", "32", "--max-prefill-rows", "4", "--no-progress",
             "--kv-dtype", "int8")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """The small end-to-end run, once for the module, with a compilation cache of its own (empty
    before it): (the completed process, its output folder, its cache folder). The run compiles
    every program; test_compilation_cache_is_filled_once_and_reused runs it again on that cache."""
    tmp = tmp_path_factory.mktemp("small_run")
    out_dir, cache = tmp / "out" / "run1", tmp / "cache"
    return _run(*SMALL_RUN, "--compile-cache", str(cache), "--out-dir", str(out_dir)), out_dir, cache


@pytest.mark.smoke
def test_small_end_to_end_run(small_run):
    """Six requests (greedy, shared preamble, n=4 samples, a beam search) on int8 KV pages, in the
    KV memory of a 24-block float32 pool; the files go to the output folder, which the run creates."""
    r, out_dir, _ = small_run
    png, js = out_dir / "block_tables.png", out_dir / "report.json"
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in out_dir.iterdir()) == ["block_tables.png", "report.json"]
    assert "done at step" not in r.stderr + r.stdout  # one line per request only with --verbose
    out = r.stdout
    assert f"report JSON: {js}" in out and f"block-table picture: {png}" in out
    for text in ("generated tokens/s", "peak blocks in use", "saved by sharing", "prefix cache", "preemptions",
                 "block tables of request", "beam 0 (score"):
        assert text in out, text
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    rep = json.loads(js.read_text())
    assert rep["requests"] == {"total": 6, "finished": 6, "rejected": 0, "sampling_n_gt_1": 1, "beam": 1}
    # The tiny model (float32, 4 layers, 2 KV heads, head_dim 32), 16-token blocks: 32,768 bytes a
    # block in float32, 4 * 2 * 2 * (32 + 4) * 16 = 9,216 in int8 with its scales; 24 float32
    # blocks' bytes buy 786,432 // 9,216 = 85 int8 blocks (84 usable, 1,344 tokens).
    assert rep["kv_pages"] == {"kv_dtype": "int8", "model_dtype": "float32", "quantized": True,
                               "bytes_per_block": 9216, "budget_bytes": 786432, "blocks": 85, "tokens": 1344}
    assert "KV pages: int8 + float32 scales, 9,216 bytes per block" in out and "bought 85 blocks = 1344 tokens" in out
    assert rep["throughput"]["tokens_per_s"] > 0
    assert rep["sharing"]["beam_search"]["saved_fraction"] > 0
    assert rep["sharing"]["parallel_sampling"]["saved_fraction"] > 0
    assert rep["prefix_cache"]["hit_tokens"] > 0  # the shared preamble
    assert rep["block_tables"]["saved_blocks"] > 0
    # How it was made: the command, every option, the versions, the device and the times.
    run = rep["run"]
    assert rep["partial"] is False and run["argv"] == [*SMALL_RUN, "--compile-cache", str(small_run[2]),
                                                       "--out-dir", str(out_dir)]
    assert run["command"].startswith("python -m paged_kv --requests 6 ")
    assert {k: run["options"][k] for k in ("kv_dtype", "batch_invariant", "impl", "tp", "decode_steps",
                                            "temperature", "max_new_tokens")} == {
        "kv_dtype": "int8", "batch_invariant": False, "impl": "auto", "tp": 1, "decode_steps": None,
        "temperature": 0.0, "max_new_tokens": 12}
    # An option left out takes ServingConfig's default; the report gives the values that ran.
    assert {k: rep["config"][k] for k in ("chunk_size", "max_prefill_rows", "decode_steps")} == {
        "chunk_size": 32, "max_prefill_rows": 4, "decode_steps": 16}
    assert set(run["versions"]) == {"paged_kv", "paged_kv_commit", "jax", "jaxlib", "flax", "python"}
    assert run["versions"]["jax"] and run["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert run["backend"] == "cpu" and run["device_kind"]
    assert datetime.fromisoformat(run["started"]) <= datetime.fromisoformat(run["ended"])
    # Request order (they finish in another: the beams last).
    assert [q["id"] for q in rep["per_request"]] == [str(i) for i in range(6)]
    # Every answer's token ids and log-probabilities (beam hypotheses: their score) are recorded.
    for req in rep["per_request"]:
        assert len(req["answers"]) == req["width"], req["id"]
        assert sum(len(a["tokens"]) for a in req["answers"]) == req["generated_tokens"]
        for a in req["answers"]:
            assert a["tokens"] and all(isinstance(t, int) for t in a["tokens"])
            assert a["finish_reason"] in ("eos", "length", "length_capped")
            if req["kind"] == "beam":
                assert a["logprobs"] is None and isinstance(a["score"], float)
            else:
                assert len(a["logprobs"]) == len(a["tokens"]) and all(x <= 0 for x in a["logprobs"])


def test_pallas_on_a_cpu_is_one_line_before_loading_anything(tmp_path):
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present: --impl pallas is valid here")
    t0 = time.monotonic()
    r = _run("--impl", "pallas", "--requests", "2", "--out-dir", str(tmp_path / "out"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "paged-kv: error: --impl pallas needs a GPU (the Pallas kernels compile through Triton); JAX runs on cpu "
        "here: use --impl auto, reference or interpret (see --help)"]
    assert r.stdout == "" and time.monotonic() - t0 < 30  # nothing loaded, nothing compiled
    assert not (tmp_path / "out").exists()  # the output folder is created only when files are written


def test_earlier_report_is_kept_unless_overwrite(tmp_path):
    """An output folder (or --json / --png path) that holds an earlier run's files is refused at
    once, naming --overwrite; nothing is touched."""
    (tmp_path / "report.json").write_text("{}")
    r = _run("--requests", "2", "--out-dir", str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"paged-kv: error: --out-dir '{tmp_path}' already holds an earlier run's report (report.json): pass "
        "--overwrite to replace that run's files, or choose another --out-dir (see --help)"]
    png = tmp_path / "t.png"
    png.write_bytes(b"x")
    r = _run("--requests", "2", "--png", str(png), "--out-dir", str(tmp_path / "new"))
    assert r.returncode == 2 and f"--png '{png}' already holds an earlier run's block-table picture" in r.stderr
    assert (tmp_path / "report.json").read_text() == "{}" and png.read_bytes() == b"x"
    assert not (tmp_path / "new").exists()


def test_every_request_rejected_exits_1_and_prints_dashes(tmp_path):
    """Two blocks (one allocatable) fit no prompt: the report still comes (no step ran, so no
    throughput, first-token time, sharing or hit rate: "–"), then a one-line reason and exit 1.
    The folder holds an earlier run's files: --overwrite replaces the report and removes the
    picture this run does not draw."""
    js = tmp_path / "report.json"
    js.write_text("{}")
    (tmp_path / "block_tables.png").write_bytes(b"an earlier run's")
    r = _run("--num-blocks", "2", "--requests", "3", "--no-progress", "--out-dir", str(tmp_path), "--overwrite")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "paged-kv: error: every request was rejected (3 of 3), e.g. request 0: prompt has 29 tokens = 2 blocks; "
        "the pool has only 1 allocatable blocks")
    out = r.stdout
    assert "None" not in out
    for line in ("requests            0 finished, 3 rejected", "throughput          – generated tokens/s",
                 "time to first token median –\n", "parallel sampling: – of block-steps",
                 "prefix cache        hit rate – (0 of 0 prompt tokens)"):
        assert line in out, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no request family ran: no picture
    rep = json.loads(js.read_text())
    assert rep["requests"]["rejected"] == 3 and rep["throughput"]["tokens_per_s"] is None
    assert rep["throughput"]["time_to_first_token_median_s"] is None and rep["prefix_cache"]["hit_rate"] is None


def test_answers_that_are_not_bytes_print_as_token_ids():
    from paged_kv.apps.workload import shown_tokens
    from paged_kv.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    assert shown_tokens(tok, [72, 105, 258, 300], 90) == "'Hi'"  # stops at EOS before the bad id
    assert shown_tokens(tok, [72, 300, 105], 90) == "token ids [72 300 105]"
    assert shown_tokens(tok, [72, 105, 258, 7], 90, as_text=False) == "token ids [72 105]"
    assert shown_tokens(None, list(range(1000, 1100)), 20) == "token ids [1000 1001 1002 10...]"


def test_model_without_a_byte_level_vocabulary_serves_and_reports(tmp_path):
    """A Hugging Face Llama with 512 ids and no tokenizer.json: answers with ids >= 259 print as
    token ids; the report, the PNG and the JSON are all written (at the paths --png and --json
    name, so the output folder is never created); exit 0."""
    from paged_kv.models import init_model, save_hf_checkpoint, tiny

    ckpt, png, js = tmp_path / "ckpt", tmp_path / "t.png", tmp_path / "r.json"
    save_hf_checkpoint(init_model(tiny(vocab_size=512, num_layers=1, hidden_size=32, intermediate_size=64,
                                       num_heads=2, num_kv_heads=1), seed=0, init_std=1.0), ckpt)
    r = _run("--checkpoint", str(ckpt), "--requests", "3", "--max-new-tokens", "3", "--arrival-gap", "0",
             "--num-blocks", "16", "--max-seqs", "8", "--max-seq-len", "64", "--chunk-size", "16",
             "--max-prefill-rows", "8", "--no-progress", "--png", str(png), "--json", str(js),
             "--out-dir", str(tmp_path / "unused"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (tmp_path / "unused").exists()
    assert "Traceback" not in r.stderr and "outside the vocabulary" not in r.stderr
    out = r.stdout
    assert "note: no tokenizer.json and a vocabulary of 512 ids" in out
    assert "sample 0: token ids [" in out and "generated tokens/s" in out and "block-table picture" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(js.read_text())["requests"]["finished"] == 2  # request 1 (137 tokens) does not fit 64


# -- Ctrl-C ------------------------------------------------------------------------------------------
# PAGED_KV_TEST_PHASE=NAME[:wait] makes the CLI announce phase NAME on stderr (and wait there): the
# test sends SIGINT then. Every phase must end with exit status 130, "paged-kv: interrupted" as the
# only line after the announcement (no traceback, no segmentation fault), within seconds.

def _interrupt_at(phase, *args, delay=0.0, cache=False):
    """Runs the CLI until it announces ``phase``, then sends SIGINT. ``cache=False`` (phases up to
    the compile): ``--no-compile-cache``, so a signal sent while compiling comes while XLA really
    compiles. ``cache=True`` (later phases): the session's cache, so programs another test compiled
    (the same options) load instead of compiling again."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "PAGED_KV_TEST_PHASE": phase,
           "XDG_CACHE_HOME": _CACHE_HOME}
    p = subprocess.Popen([sys.executable, "-m", "paged_kv", *([] if cache else ["--no-compile-cache"]), *args],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(300, p.kill)
    guard.start()
    try:
        before = []
        for line in p.stderr:
            before.append(line)
            if line.startswith("paged-kv: test phase"):
                break
        assert before and before[-1].startswith(f"paged-kv: test phase {phase.split(':')[0]} "), "".join(before)
        time.sleep(delay)
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        guard.cancel()
        if p.poll() is None:
            p.kill()
    return p.returncode, before[-1], out, err, took


def _assert_interrupted(rc, err, took, partial=None):
    """Exit 130 within seconds, with the one line; ``partial``: the report a partial run wrote."""
    assert rc == 130, (rc, err[-3000:])
    assert err.strip().splitlines() == ["paged-kv: interrupted"] + (
        [f"paged-kv: partial report ({partial[0]} finished requests): {partial[1]}"] if partial else []), err[-3000:]
    assert took < 10


def test_ctrl_c_while_jax_imports(tmp_path):
    rc, announced, out, err, took = _interrupt_at("import", "--requests", "2", "--out-dir", str(tmp_path))
    assert "jax imported: False" in announced  # the signal really came during the import
    _assert_interrupted(rc, err, took)


def test_ctrl_c_while_compiling(tmp_path):
    """SIGINT two seconds into compiling the first step variant (it takes far longer): out at once,
    while XLA is still at work, with no crash after."""
    rc, _, out, err, took = _interrupt_at("compile", "--requests", "2", "--max-new-tokens", "4", "--no-progress",
                                          "--out-dir", str(tmp_path), delay=2.0)
    _assert_interrupted(rc, err, took)
    assert "compiling step variant 1/1" in out and "done at step" not in err  # one variant on a CPU


def test_ctrl_c_while_the_report_renders(tmp_path):
    # The options of test_every_request_rejected_exits_1_and_prints_dashes (2 blocks): its compiled
    # programs are in the session's cache.
    rc, _, out, err, took = _interrupt_at("report:wait", "--num-blocks", "2", "--requests", "3", "--no-progress",
                                          "--out-dir", str(tmp_path), cache=True)
    _assert_interrupted(rc, err, took, partial=(3, tmp_path / "report.json"))  # before its files: a partial one
    assert "serving report" not in out
    assert json.loads((tmp_path / "report.json").read_text())["partial"] is True


def test_compilation_cache_is_filled_once_and_reused(small_run, tmp_path):
    """The first run (the module's small run) writes the compiled programs to --compile-cache; a
    second identical run loads every one of them (it writes nothing new). --no-compile-cache
    writes nothing, and creates no folder: the run below stops at loading its (empty) checkpoint,
    after the cache would have been set up. (Running without a persistent cache is JAX's default:
    every engine test in-process runs so.)"""
    first, _, cache = small_run
    assert first.returncode == 0, first.stderr[-3000:]
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) >= 2  # the step, the admission, ...
    second = _run(*SMALL_RUN, "--compile-cache", str(cache), "--verbose", "--out-dir", str(tmp_path / "b"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "done at step" not in first.stdout + first.stderr  # one line per request only with --verbose
    assert (second.stdout + second.stderr).count("done at step") == 6
    assert sorted(p.name for p in cache.iterdir()) == entries
    (tmp_path / "empty").mkdir()
    off = _run("--requests", "2", "--max-new-tokens", "3", "--no-progress", "--no-compile-cache",
               "--compile-cache", str(tmp_path / "unused"), "--checkpoint", str(tmp_path / "empty"),
               "--out-dir", str(tmp_path / "c"))
    assert off.returncode == 1 and "cannot load checkpoint" in off.stderr, off.stderr
    assert not (tmp_path / "unused").exists()


def test_ctrl_c_while_serving_writes_a_partial_report(small_run, tmp_path):
    """SIGINT once the first request has finished (the small run's programs, loaded from its
    cache): the report of the requests that finished, marked partial, with how the run was
    made; the earlier run's picture is removed (--overwrite), so nothing stale stays beside it."""
    _, _, cache = small_run
    (tmp_path / "report.json").write_text("{}")
    (tmp_path / "block_tables.png").write_bytes(b"an earlier run's")
    rc, _, out, err, took = _interrupt_at("served:wait", *SMALL_RUN, "--compile-cache", str(cache), "--overwrite",
                                          "--out-dir", str(tmp_path), cache=True)
    _assert_interrupted(rc, err, took, partial=(1, tmp_path / "report.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["partial"] is True and rep["requests"]["total"] == 1 and len(rep["per_request"]) == 1
    assert rep["per_request"][0]["answers"][0]["tokens"] and rep["run"]["ended"] and rep["run"]["options"]["overwrite"]


def test_a_prompt_samples_the_same_bits_wherever_it_stands(tmp_path):
    """A prompt's default seed comes from its token ids and --seed, not its place in the list:
    moved from first of two to last of three, among other prompts, "The cow says" samples the
    same tokens and log-probabilities, bit for bit. Under --batch-invariant, so that its logits do
    not depend on its batchmates either (without it they may differ in the last bits, and a
    sample with them); the seed itself is checked alone in tests/test_cli_report.py."""
    from paged_kv.apps.cli import prompt_seed
    from paged_kv.models.tokenizer import ByteTokenizer

    common = ("--temperature", "1.0", "--max-new-tokens", "6", "--batch-invariant", "--seed", "5", "--num-blocks",
              "16", "--max-seqs", "4", "--max-seq-len", "64", "--chunk-size", "16", "--max-prefill-rows", "4",
              "--no-progress", "--show", "0")
    first = _run("--prompt", "The cow says", "--prompt", "Once upon a time", *common, "--out-dir", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-3000:]
    last = _run("--prompt", "3 plus 4 is", "--prompt", "After Monday comes", "--prompt", "The cow says", *common,
                "--out-dir", str(tmp_path / "b"))
    assert last.returncode == 0, last.stderr[-3000:]
    a = json.loads((tmp_path / "a" / "report.json").read_text())["answers"]
    b = json.loads((tmp_path / "b" / "report.json").read_text())["answers"]
    assert a[0]["prompt"] == b[2]["prompt"] == "The cow says"
    assert a[0]["seed"] == b[2]["seed"] == prompt_seed(5, ByteTokenizer().encode("The cow says", add_bos=True))
    assert a[0]["answers"] == b[2]["answers"]  # tokens, log-probabilities, text and finish reason
    assert len(a[0]["answers"][0]["logprobs"]) == len(a[0]["answers"][0]["tokens"]) > 0
    assert len({e["seed"] for e in a + b}) == 4  # four different prompts, four seeds


def test_default_compile_cache_follows_xdg(monkeypatch, tmp_path):
    from paged_kv.apps.cli import default_compile_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_compile_cache() == tmp_path / "paged-kv" / "jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_compile_cache() == Path.home() / ".cache" / "paged-kv" / "jax"


# -- your prompts, streamed -----------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--n", "2"], "--n applies to your prompts: give --prompt TEXT or --prompts-file FILE"),
    (["--chat"], "--chat applies to your prompts"),
    (["--prompt", "hi", "--beam-width", "2", "--temperature", "0.5"],
     "--beam-width 2 is beam search; it takes no sampling option (--temperature 0.5)"),
    (["--prompt", "hi", "--top-p", "0"], "argument --top-p: 0 must be in (0, 1]"),
    (["--prompt", "hi", "--temperature", "-1"], "argument --temperature: -1 must be in [0, 100]"),
    (["--prompts-file", "/nonexistent/prompts.txt"], "cannot read --prompts-file '/nonexistent/prompts.txt'"),
])
def test_prompt_options_are_checked_first(args, message):
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"paged-kv: error: {message}"), r.stderr
    assert lines[0].endswith("(see --help)")


@pytest.fixture(scope="module")
def bpe_ckpt(tmp_path_factory):
    from scripts import bpe_checkpoint

    return bpe_checkpoint.write_checkpoint(tmp_path_factory.mktemp("bpe"), family="qwen2", vocab_size=400)


def test_your_prompts_stream_through_the_checkpoint_tokenizer(bpe_ckpt, tmp_path):
    """Two prompts from the command line and one from a file, through the chat template, two sampled
    answers each: the header names the tokenizer, the answers stream one after another in prompt
    order, and the streamed text of every answer is the decode of its tokens (the report JSON
    records them)."""
    from paged_kv.apps.prompts import printable
    from paged_kv.models.hf_tokenizer import HFTokenizer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\nQ: Where does the owl live? A:\n\n")
    js = tmp_path / "r.json"
    r = _run("--checkpoint", str(bpe_ckpt), "--prompt", "Once upon a time there was a", "--prompt", "The cow says",
             "--prompts-file", str(prompts), "--chat", "--n", "2", "--temperature", "0.8", "--top-k", "50",
             "--max-new-tokens", "12", "--num-blocks", "32", "--max-seqs", "8", "--max-seq-len", "128",
             "--chunk-size", "32", "--json", str(js), "--png", str(tmp_path / "t.png"), "--seed", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "tokenizer: tokenizer.json (BPE, 400 ids) through tokenizers; EOS ids 1, 2; prompts rendered through " \
           "the chat template" in out
    rep = json.loads(js.read_text())
    assert [a["prompt"] for a in rep["answers"]] == ["Once upon a time there was a", "The cow says",
                                                     "Q: Where does the owl live? A:"]
    tok = HFTokenizer.load(bpe_ckpt)
    rendered = tok.render_chat([{"role": "user", "content": "The cow says"}])
    assert rep["answers"][1]["prompt_tokens"] == len(tok.encode(rendered, add_bos=False))
    expected = []
    for i, entry in enumerate(rep["answers"]):
        for j, a in enumerate(entry["answers"]):
            assert a["text"] == tok.decode(a["tokens"], stop_at_eos=True)
            assert len(a["logprobs"]) == len(a["tokens"]) and all(x <= 0 for x in a["logprobs"])
            head = f"[prompt {i}, sample {j}] {entry['prompt']!r} ->"
            expected.append(f"{head} {printable(a['text'])} [{a['finish_reason']}]")
    # One answer after the other, in order, each on its own line (a newline in an answer prints as \n).
    assert "\n".join(expected) + "\n\n== paged-kv serving report ==" in out
    assert "tokenization: encode" in out and "ms per engine step" in out
    # No escape sequence reaches the terminal, and a run of newlines shows as \n\n, not blank lines.
    assert printable("a\x1b[2J\tb\n\nc\x7f") == "a\\x1b[2J\tb\\n\\nc\\x7f"
    assert rep["tokenizer"]["streamed_tokens"] == sum(len(a["tokens"]) for e in rep["answers"] for a in e["answers"])


def test_chat_without_a_template_is_one_line(bpe_ckpt, tmp_path):
    d = tmp_path / "c"
    import shutil

    shutil.copytree(bpe_ckpt, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = _run("--checkpoint", str(d), "--prompt", "hi", "--chat", "--out-dir", str(tmp_path / "o"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["paged-kv: error: --chat: the checkpoint has no chat template "
                                             "(tokenizer_config.json's chat_template) (see --help)"], r.stderr


def test_stream_printer_holds_later_answers_until_their_turn():
    """The printer in isolation (no model): answers print whole and in (prompt, sample) order
    whatever order their tokens arrive in; a beam request prints its best hypothesis; a rejected
    request prints its error; EOS ids print nothing; a character split over two deltas prints once."""
    import io

    from paged_kv.apps.prompts import StreamPrinter
    from paged_kv.engine import BeamParams, SamplingParams
    from paged_kv.engine.serving import Request, TokenDelta
    from paged_kv.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    reqs = [Request([1], SamplingParams(n=2), request_id=0), Request([1], BeamParams(beam_width=2), request_id=1),
            Request([1], SamplingParams(), request_id=2)]
    out = io.StringIO()
    pr = StreamPrinter(tok, reqs, [("a", [1]), ("b", [1]), ("c", [1])], out=out)
    e = list("é".encode())
    pr.on_token(TokenDelta(0, 1, (ord("y"),)))             # held: sample 1 is not on screen yet
    pr.on_token(TokenDelta(0, 0, (ord("x"), e[0])))        # live; half a character: nothing yet
    assert out.getvalue() == "[prompt 0, sample 0] 'a' -> x"
    pr.on_token(TokenDelta(1, 0, (ord("B"), tok.eos_id), "eos"))  # the beam's best, held
    pr.on_token(TokenDelta(1, 1, (ord("Z"),), "length"))   # a lesser hypothesis: not streamed
    pr.on_token(TokenDelta(0, 0, (e[1], tok.eos_id), "eos"))
    pr.on_token(TokenDelta(0, 1, (ord("z"),), "length"))

    class Rejected:
        request_id, error = 2, "prompt too long"
    pr.on_output(Rejected())
    assert out.getvalue() == ("[prompt 0, sample 0] 'a' -> xé [eos]\n"
                              "[prompt 0, sample 1] 'a' -> yz [length]\n"
                              "[prompt 1, best beam] 'b' -> B [eos]\n"
                              "[prompt 2, answer] 'c' ->  [rejected: prompt too long]\n")
    assert pr.tokens == 8


# -- checked before anything loads or compiles ---------------------------------------------------
def _run_patched(prelude: str, *args, timeout=120):
    """``main(args)`` in a fresh process after ``prelude`` (Python run first, e.g. to hide a module)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "XDG_CACHE_HOME": _CACHE_HOME}
    code = f"{prelude}\nimport sys\nfrom paged_kv.apps.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_unwritable_output_folder_is_refused_first(tmp_path):
    """An --out-dir (or the folder it would be created in) that cannot be written is refused at
    once, not after the run (whose report would be lost). os.access is patched: tests may run as
    root, who can write anywhere."""
    ro = tmp_path / "ro"
    ro.mkdir()
    prelude = (f"import os\n_access = os.access\n"
               f"os.access = lambda p, m, **k: False if str(p).startswith({str(ro)!r}) else _access(p, m, **k)")
    for out_dir, why in ((ro, "is not writable"), (ro / "new", f"cannot be created: '{ro}' is not writable")):
        t0 = time.monotonic()
        r = _run_patched(prelude, "--out-dir", str(out_dir))
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert r.stderr.strip().splitlines() == [f"paged-kv: error: --out-dir '{out_dir}': {why} (see --help)"]
        assert time.monotonic() - t0 < 30
    r = _run_patched(prelude, "--json", str(ro / "r.json"), "--png", str(tmp_path / "t.png"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"paged-kv: error: --json '{ro / 'r.json'}': its folder '{ro}' is not "
                                             "writable (see --help)"]


def test_missing_cli_extra_is_one_line(tmp_path):
    """Every missing package named, and the command that installs them from a checkout too."""
    for hidden in (["tqdm"], ["tqdm", "matplotlib"]):
        prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in hidden)
        r = _run_patched(prelude, "--requests", "2", "--out-dir", str(tmp_path))
        assert r.returncode == 1 and r.stdout == ""
        assert r.stderr.strip().splitlines() == [
            f"paged-kv: error: the command line needs {' and '.join(hidden)}, which "
            f"{'is' if len(hidden) == 1 else 'are'} not installed: pip install 'paged-kv[cli]' (from a checkout of "
            "the repository: pip install -e '.[cli]')"], r.stderr


@pytest.mark.parametrize("args, message", [
    (["--prompt", "x" * 300], "prompt 0 ('xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...') has 301 tokens; --max-seq-len 256 "
                              "allows 256 per sequence (prompt + answer): raise --max-seq-len or shorten the prompt"),
    (["--prompt", "hi", "--n", "4", "--num-blocks", "8", "--max-new-tokens", "100"],
     "prompt 0 ('hi'): 4 answers of up to 102 tokens need up to 28 blocks of 16 tokens; --num-blocks 8 gives 7 "
     "(raise --num-blocks, or lower --max-new-tokens or --n/--beam-width)"),
    # The model's 512-token context caps --max-seq-len first: 32 blocks an answer, not 251.
    (["--prompt", "hi", "--n", "4", "--num-blocks", "100", "--max-seq-len", "5000", "--max-new-tokens", "4000"],
     "prompt 0 ('hi'): 4 answers of up to 512 tokens (the model's context (max_position_embeddings=512, under "
     "--max-seq-len 5000) caps them) need up to 128 blocks of 16 tokens; --num-blocks 100 gives 99"),
])
def test_prompts_that_cannot_run_are_refused_before_loading(args, message, tmp_path):
    t0 = time.monotonic()
    r = _run(*args, "--out-dir", str(tmp_path / "o"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"paged-kv: error: {message}"), r.stderr
    assert "compiling" not in r.stdout and time.monotonic() - t0 < 60  # nothing loaded, nothing compiled


def test_answers_cut_by_the_sequence_length_are_announced_before_compiling(tmp_path):
    """A prompt that leaves fewer than --max-new-tokens positions, and workload prompts longer than
    --max-seq-len, are said before compiling (stopped there with Ctrl-C: nothing compiles)."""
    rc, _, out, err, _ = _interrupt_at("compile:wait", "--prompt", "y" * 200, "--max-new-tokens", "100",
                                       "--out-dir", str(tmp_path))
    assert rc == 130, err
    assert ("note: --max-seq-len 256 leaves prompt 0 fewer than --max-new-tokens 100 new tokens: their answers "
            "stop at the sequence length (finish reason 'length_capped')") in out
    rc, _, out, err, _ = _interrupt_at("compile:wait", "--max-seq-len", "48", "--max-new-tokens", "8",
                                       "--out-dir", str(tmp_path))
    assert rc == 130, err
    assert "note: 10 of 24 requests have prompts longer than the 48 tokens a sequence holds (--max-seq-len 48): " \
           "they will be rejected" in out
    # A --max-seq-len past the model's context (512) serves that context: accepted, and said.
    rc, _, out, err, _ = _interrupt_at("compile:wait", "--prompt", "hi", "--max-seq-len", "5000",
                                       "--max-new-tokens", "4000", "--out-dir", str(tmp_path))
    assert rc == 130, err
    assert ("note: the model's context (max_position_embeddings=512, under --max-seq-len 5000) leaves prompt 0 "
            "fewer than --max-new-tokens 4000 new tokens") in out
