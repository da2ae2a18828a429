"""The command line's record of a run and its pieces, without a model: the provenance of
``report.json`` (``paged_kv.apps.provenance``), atomic writes, the default seed of your prompts,
progress lines ended before an error, and library errors named as options. The runs that serve
are in tests/test_cli.py."""

import errno
import hashlib
import io
import os
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from paged_kv.apps import provenance
from paged_kv.apps.options import build_parser, in_option_terms
from paged_kv.apps.progress import CompileProgress
from paged_kv.apps.prompts import StreamPrinter, prompt_requests, prompt_seed

ROOT = Path(__file__).resolve().parent.parent


# -- seeds ---------------------------------------------------------------------------------------
def test_prompt_seed_is_a_stable_function_of_the_prompt_and_the_run_seed():
    ids = [257, 84, 104, 101]
    # The documented definition, the same in every process (blake2b, not the salted hash()).
    digest = hashlib.blake2b(b"0:257,84,104,101", digest_size=8).digest()
    assert prompt_seed(0, ids) == int.from_bytes(digest, "little") % 2**31 == 346803997
    assert prompt_seed(0, ids) == prompt_seed(0, tuple(ids))
    assert prompt_seed(1, ids) != prompt_seed(0, ids)
    assert prompt_seed(0, ids[:-1]) != prompt_seed(0, ids)
    assert prompt_seed(0, [1, 23]) != prompt_seed(0, [12, 3])  # ids are separated, not concatenated digits
    assert all(0 <= prompt_seed(s, ids) < 2**31 for s in range(50))


def test_a_prompts_seed_does_not_depend_on_its_place():
    args = build_parser().parse_args(["--prompt", "x", "--temperature", "0.7", "--seed", "3"])
    a, b, c = ("a", [257, 97]), ("b", [257, 98]), ("c", [257, 99])
    first = {tuple(q.prompt): q.seed for q in prompt_requests(args, [a, b], eos_ids=(258,))}
    moved = {tuple(q.prompt): q.seed for q in prompt_requests(args, [c, b, a], eos_ids=(258,))}
    assert first[(257, 97)] == moved[(257, 97)] == prompt_seed(3, [257, 97])
    assert first[(257, 98)] == moved[(257, 98)] and len(set(moved.values())) == 3
    assert [q.request_id for q in prompt_requests(args, [c, b, a], eos_ids=())] == [0, 1, 2]


# -- provenance ------------------------------------------------------------------------------------
def test_git_commit_of_a_checkout_and_of_no_checkout(tmp_path, monkeypatch):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not run from a git checkout")
    commit = provenance.git_commit()  # the package's own folder
    assert commit is not None and commit.removesuffix("+dirty") == head.stdout.strip()
    assert provenance.git_commit(tmp_path / "paged_kv") is None  # no repository at all
    # A package inside some other repository (a virtual environment within a project): not its commit.
    nested = tmp_path / "project" / ".venv" / "site-packages" / "paged_kv"
    nested.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(tmp_path / "project")], check=True)
    assert provenance.git_commit(nested) is None
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no git on the PATH: None, not an error
    assert provenance.git_commit() is None


def test_run_record_says_how_the_run_was_made():
    args = build_parser().parse_args(["--prompt", "it's", "--batch-invariant", "--top-k", "5"])
    rec = provenance.run_record(["--prompt", "it's", "--batch-invariant", "--top-k", "5"], vars(args))
    # Quoted as a shell reads it.
    assert rec["command"] == "python -m paged_kv --prompt 'it'\"'\"'s' --batch-invariant --top-k 5"
    assert rec["options"]["batch_invariant"] is True and rec["options"]["top_k"] == 5
    # Defaults too (None: ServingConfig's own, which the report's config gives as resolved).
    assert rec["options"]["decode_steps"] is None and rec["options"]["tp"] == 1
    assert rec["ended"] is None and rec["versions"]["python"]
    done = provenance.finish_record(rec)
    assert done["backend"] == "cpu" and done["device_count"] >= 1
    start, end = datetime.fromisoformat(done["started"]), datetime.fromisoformat(done["ended"])
    assert start.utcoffset().total_seconds() == 0 and start <= end


# -- atomic writes --------------------------------------------------------------------------------
def _full_disk(monkeypatch):
    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(provenance.os, "fsync", fsync)


def test_a_failed_write_leaves_the_earlier_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    assert provenance.write_atomic(path, "new") == str(path) and path.read_text() == "new"
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    _full_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        provenance.write_atomic(path, "newer")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["report.json"]


def test_report_and_picture_are_written_atomically(tmp_path, monkeypatch):
    """Both writers go through write_atomic: on a full disk the earlier report stays whole and no
    0-byte PNG appears."""
    from paged_kv.apps import report
    from paged_kv.engine.serving import TableSnapshot

    snap = TableSnapshot(request_id=0, kind="sample", step=3, labels=["sample 0", "sample 1"],
                         blocks=[[1, 2], [1, 3]], refs=[[2, 1], [2, 1]], num_tokens=[20, 20], saved_blocks=1)
    js, png = tmp_path / "report.json", tmp_path / "block_tables.png"
    report.save_report_json({"a": 1}, js)
    _full_disk(monkeypatch)
    with pytest.raises(OSError):
        report.save_report_json({"a": 2}, js)
    with pytest.raises(OSError):
        report.save_block_tables_png(snap, png)
    assert js.read_text() == '{\n  "a": 1\n}\n' and sorted(os.listdir(tmp_path)) == ["report.json"]
    monkeypatch.undo()
    report.save_block_tables_png(snap, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


# -- errors on a line of their own, in the options' terms ---------------------------------------
def test_an_open_progress_line_is_ended_before_an_error():
    out = io.StringIO()
    progress = CompileProgress(out, live=False)
    progress(1, 2, "step variant 1/2 (decode)", None)
    assert out.getvalue() == "compiling step variant 1/2 (decode) ..."
    progress.end_line()  # (an error or Ctrl-C during the compile)
    assert out.getvalue() == "compiling step variant 1/2 (decode) ...\n"
    progress(1, 2, "step variant 1/2 (decode)", None)
    progress(1, 2, "step variant 1/2 (decode)", 1.5)
    progress.end_line()  # no line open: nothing
    assert out.getvalue().endswith("compiling step variant 1/2 (decode) ... 1.5 s\n")


def test_an_answer_streaming_is_ended_before_an_error():
    from paged_kv.engine import SamplingParams
    from paged_kv.engine.serving import Request, TokenDelta
    from paged_kv.models.tokenizer import ByteTokenizer

    out = io.StringIO()
    pr = StreamPrinter(ByteTokenizer(), [Request([1], SamplingParams(), request_id=0)], [("a", [1])], out=out)
    pr.on_token(TokenDelta(0, 0, (ord("x"),)))
    pr.end_line()
    assert out.getvalue() == "[prompt 0, answer] 'a' -> x\n"
    pr.end_line()
    pr.on_token(TokenDelta(0, 0, (ord("y"),), "length"))  # (nothing more prints)
    assert out.getvalue() == "[prompt 0, answer] 'a' -> x\n"


def test_library_errors_are_named_as_options():
    assert in_option_terms("decode_steps=300 must be <= 256") == "--decode-steps 300 must be <= 256"
    assert in_option_terms("num_blocks * block_size = 9 overflows") == "--num-blocks * --block-size = 9 overflows"
    assert in_option_terms("tensor-parallel degree tp=3 fits no head layout; n > 1 needs") == \
        "tensor-parallel degree --tp 3 fits no head layout; n > 1 needs"  # a short name only as name=value
    assert in_option_terms("--max-seq-len 48 and max_position_embeddings=512") == \
        "--max-seq-len 48 and max_position_embeddings=512"  # not an option: left as it is
