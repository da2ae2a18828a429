"""``scripts/gate/gpu_check.py perf``: measured kernel times against the performance model's
estimates. The matching and the ratios on made-up summary rows, and the whole stage on tiny
shapes in interpret mode (``--smoke``) for a few specs."""

import json

import jax
import jax.numpy as jnp
import pytest

from scripts.gate import gpu_check, perf_plan

EST = {"low_us": 100.0, "high_us": 200.0, "roofline_us": 80.0, "fraction": [0.4, 0.8], "bound": "memory",
       "bytes": 4.8e8, "gate": "pass"}


def _summary(rows):
  return {"performance_model": {"kernels": rows, "layout": None, "programs": None}}


@pytest.mark.smoke
def test_run_specs_are_every_estimated_spec_but_the_rule_checks_uniquely_named():
  specs = gpu_check.perf_run_specs()
  want = [s for s in perf_plan.perf_specs() if s["purpose"] != "perf_rule_check"]
  assert sorted(map(perf_plan.spec_name, specs)) == sorted(map(perf_plan.spec_name, want))
  names = [perf_plan.spec_name(s) for s in specs]
  assert len(set(names)) == len(names), "measurements are matched to estimates by name"
  assert specs[0]["kernel"] == "xla_copy" and specs[0]["purpose"] == "perf_sanity"
  only = gpu_check.perf_run_specs(["DECODE 64x4096", "llama3.2-1b down M=256"])
  assert [perf_plan.spec_name(s) for s in only] == ["decode 64x4096", "layer_matmul llama3.2-1b down M=256"]


@pytest.mark.smoke
def test_estimates_are_found_by_name_in_a_summary_or_a_full_report():
  spec = gpu_check.perf_run_specs(["decode 64x4096"])[0]
  from_summary = gpu_check.estimates_by_name(_summary([dict(EST, name="decode 64x4096", purpose="perf")]))
  from_report = gpu_check.estimates_by_name(_summary([{"spec": spec, "model": EST, "gate": "pass"}]))
  assert from_summary == from_report == {"decode 64x4096": EST}
  assert gpu_check.estimates_by_name(None) == {}
  assert gpu_check.estimates_by_name({"what": "a summary from before the model"}) == {}
  # A row the gate could not estimate (no kernel found) is no estimate.
  assert gpu_check.estimates_by_name(_summary([{"name": "decode 64x4096", "purpose": "perf"}])) == {}


@pytest.mark.smoke
def test_measured_against_the_estimate_range():
  inside = gpu_check.compare_to_estimate(160.0, EST)
  assert inside["vs_estimate"] == "within"
  assert inside["measured_over_estimate"] == {"low": 1.6, "high": 0.8}
  assert inside["measured_fraction"] == 0.5  # roofline / measured
  assert inside["measured_bandwidth_tb_s"] == 3.0
  assert (inside["low_us"], inside["high_us"], inside["roofline_us"]) == (100.0, 200.0, 80.0)
  assert gpu_check.compare_to_estimate(400.0, EST)["vs_estimate"] == "slower"
  assert gpu_check.compare_to_estimate(400.0, EST)["measured_over_estimate"]["high"] == 2.0
  assert gpu_check.compare_to_estimate(50.0, EST)["vs_estimate"] == "faster"
  none = gpu_check.compare_to_estimate(160.0, None)
  assert none["low_us"] is None and none["measured_fraction"] is None and none["vs_estimate"] is None
  skipped = gpu_check.compare_to_estimate(None, EST)
  assert skipped["high_us"] == 200.0 and skipped["measured_over_estimate"] is None


@pytest.mark.smoke
def test_measured_comparisons_pair_copies_with_their_baseline_and_decode_with_jax():
  specs = {perf_plan.spec_name(s): s for s in gpu_check.perf_run_specs()}
  copy = "copy_blocks llama3.2-1b 1 layer(s) x 16"
  base = perf_plan.spec_name(dict(kernel="xla_copy", bytes=16 * perf_plan.copy_block_bytes("llama3.2-1b", 1)))
  assert base in specs
  rows = [dict(name=n, spec=specs[n], measured_us=us, model_vs_plain_copy=0.9 if n == copy else None)
          for n, us in ((copy, 10.0), (base, 8.0), ("decode 64x4096", 300.0), ("jax_paged_attention 64x4096", 450.0),
                        ("decode 256x1024", 280.0))]
  got = gpu_check.measured_comparisons(rows)
  (c,) = got["copy_blocks_vs_xla_copy"]
  assert (c["baseline"], c["vs_plain_copy"], c["model_vs_plain_copy"]) == (base, 0.8, 0.9)
  (a,) = got["decode_vs_jax_paged_attention"]  # JAX's kernel is measured at 64 x 4096 only
  assert (a["name"], a["jax_over_ours"]) == ("decode 64x4096", 1.5)


@pytest.mark.smoke
def test_decode_step_measured_by_layouts_next_to_the_model_sums():
  layouts = {"batch": 64, "context": 4096, "layers": 32, "device": "cuda:0",
             "stacked_scan": {"step_ms": 12.0}, "per_layer_unrolled": {"step_ms": 10.0}}
  shape = {"batch": 64, "context": 4096, "faster": "stacked", "margin": 1.1,
           "stacked": {"low_ms": 9.0, "high_ms": 11.0, "roofline_ms": 6.0},
           "per_layer": {"low_ms": 9.5, "high_ms": 12.5, "roofline_ms": 6.0}}
  got = gpu_check.decode_step_comparison(layouts, {"shapes": [shape]}, {"serving_step_decode": {"low_ms": 9.0}})
  m = got["matched"]
  assert got["measured"]["faster"] == "per_layer" and not m["agrees"]
  assert m["stacked"]["vs_estimate"] == "slower" and m["per_layer"]["vs_estimate"] == "within"
  assert m["stacked"]["measured_fraction"] == 0.5 and m["stacked"]["measured_over_estimate"]["high"] == 1.091
  assert got["model_programs"] == {"serving_step_decode": {"low_ms": 9.0}}
  # Either side missing, or a measured shape the model does not sum: figures kept, no match.
  assert gpu_check.decode_step_comparison(None, {"shapes": [shape]})["model_shapes"][0]["stacked"]["high_ms"] == 11.0
  assert gpu_check.decode_step_comparison(layouts, None)["measured"]["stacked_ms"] == 12.0
  other = gpu_check.decode_step_comparison(dict(layouts, context=1024), {"shapes": [shape]})
  assert other["matched"] is None and "none of the model's shapes" in other["note"]


def test_perf_smoke_runs_a_few_specs_and_writes_measured_against_estimated(tmp_path):
  summary = tmp_path / "summary.json"
  summary.write_text(json.dumps(_summary([dict(EST, name="decode 64x4096", purpose="perf")])))
  out = tmp_path / "perf.json"
  only = ["decode 64x4096", "copy_blocks llama3.2-1b 1 layer(s) x 16", "xla_copy 524,288 B"]
  res = gpu_check.check_perf(out, smoke=True, only=only, summary_path=summary, layouts_path=tmp_path / "missing.json")
  assert json.loads(out.read_text())["counts"] == res["counts"]
  rows = {r["name"]: r for r in res["kernels"]}
  assert set(rows) == {"decode 64x4096", "copy_blocks llama3.2-1b 1 layer(s) x 16", "xla_copy 524,288 B"}
  assert all(r["status"] == "measured" and r["measured_us"] > 0 and 1 <= r["repeats"] <= 2 for r in rows.values())
  assert res["failures"] == 0 and res["impl"] == "interpret" and res["estimates"] == 1
  d = rows["decode 64x4096"]
  assert d["high_us"] == 200.0 and d["vs_estimate"] in ("within", "slower", "faster")
  assert d["compared"] in ("kernel_us", "measured_us") and d["compared_us"] == d[d["compared"]]
  assert d["measured_fraction"] == round(80.0 / d["compared_us"], 3)
  assert all(r["chain"] == 2 and r["chain_us"] > 0 and "chain_error" not in r for r in rows.values())
  assert rows["xla_copy 524,288 B"]["high_us"] is None
  assert res["comparisons"]["copy_blocks_vs_xla_copy"][0]["vs_plain_copy"] > 0
  assert res["decode_step"]["measured"] is None and res["decode_step"]["note"]


class _AbstractInputs(gpu_check._Inputs):
  """Arrays as shapes only: the full-size specs traced without allocating their gigabytes."""

  def normal(self, shape, dtype, scale=1.0, shift=0.0, keep=None):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


@pytest.mark.smoke
def test_every_spec_and_its_chain_traces_at_full_size_with_the_pallas_kernels():
  """What the GPU run builds (GPU shapes, impl "pallas", one call and the chain of 8), traced: the
  kernels' own checks of shapes and tiles pass, and the chain's operands line up."""
  inputs = _AbstractInputs(0)
  for spec in gpu_check.perf_run_specs():
    _, fn, args, donate, chain = gpu_check.perf_call(spec, "pallas", inputs)
    jax.jit(fn, donate_argnums=donate).trace(*args)
    assert chain is not None or spec["kernel"] == "xla_gemm", perf_plan.spec_name(spec)
    if chain is not None:
      cfn, cargs = chain(args, gpu_check.PERF_CHAIN)
      jax.jit(cfn, donate_argnums=donate).trace(*cargs)


@pytest.mark.smoke
def test_gpu_check_sh_fits_one_ten_minute_run_and_perf_stops_before_its_limit():
  import re
  from pathlib import Path
  text = (Path(gpu_check.ROOT) / "scripts" / "gpu_check.sh").read_text()
  stages = {m[0]: int(m[1]) for m in re.findall(r"^stage (\w+) (\d+) ", text, re.M)}
  env = int(re.search(r"^timeout (\d+) .* env ", text, re.M)[1])
  assert set(stages) == {"kernels", "layouts", "perf", "engine"}
  assert env + sum(stages.values()) <= 590, "the device tool stops a command at 600 s"
  assert list(stages).index("layouts") < list(stages).index("perf"), "perf reads the layouts stage's JSON"
  budget = float(re.search(r"perf --budget-s (\d+)", text)[1])
  assert budget + 20 <= stages["perf"], "room for the start and the last kernel after the budget"
