"""The GPU performance model (``scripts/gate/perf_model.py``, ``scripts/gate/perf_plan.py``) on PTX
in the form Triton and XLA emit (shortened from real sm_90a dumps of the gate) and on made-up
compile facts whose answers follow from the formulas by hand. No CUDA needed."""

import pytest

from scripts.gate import perf_model as pm, perf_plan

# The main loop of a single-buffered Triton kernel (num_stages=2): wait for everything at the top,
# compute, then issue the next tile into the same buffer; three commit groups per iteration.
PTX_SINGLE = """
.visible .entry layer_matmul(
	.param .u64 layer_matmul_param_0
)
{
	ld.global.b32 { %r11 }, [ %rd16 + 0 ];
	cp.async.cg.shared.global [ %r12 + 0 ], [ %rd17 + 0 ], 0x10, %p1;
	cp.async.commit_group;
$L__BB0_1:
	cp.async.wait_group 	0;
	bar.sync 	0;
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
	bar.sync 	0;
	cp.async.cg.shared.global [ %r12 + 0 ], [ %rd62 + 0 ], 0x10, %p4;
	cp.async.commit_group;
	@%p3 cp.async.cg.shared.global [ %r13 + 0 ], [ %rd48 + 0 ], 0x10, %p5;
	cp.async.commit_group;
	cp.async.cg.shared.global [ %r14 + 0 ], [ %rd49 + 0 ], 0x10, %p5;
	cp.async.cg.shared.global [ %r15 + 0 ], [ %rd50 + 0 ], 0x10, %p5;
	cp.async.commit_group;
	@%p6 bra 	$L__BB0_1;
	cp.async.wait_group 	0;
	ret;
}
"""
# The same loop pipelined three deep (num_stages=4): wait_group 6 with 3 groups per iteration.
PTX_DEEP = PTX_SINGLE.replace("cp.async.wait_group \t0;\n\tbar.sync \t0;\n\tmma",
                              "cp.async.wait_group \t6;\n\tbar.sync \t0;\n\tmma")
# A copy loop of plain loads and stores (the data of a load is stored in the same iteration).
PTX_COPY = """
.visible .entry copy_blocks(
)
{
	ld.global.b32 { %r1 }, [ %rd4 + 0 ];
	@%p1 bra 	$L__BB0_3;
$L__BB0_2:
	ld.global.v4.b32 { %r8, %r9, %r10, %r11 }, [ %rd24 + 0 ];
	ld.global.v4.b32 { %r12, %r13, %r14, %r15 }, [ %rd25 + 0 ];
	st.global.v4.b32 [ %rd26 + 0 ], { %r8, %r9, %r10, %r11 };
	st.global.v4.b32 [ %rd27 + 0 ], { %r12, %r13, %r14, %r15 };
	@%p2 bra 	$L__BB0_2;
$L__BB0_3:
	ret;
}
.visible .entry other_kernel(
)
{
	ld.global.v2.b16 { %h1, %h2 }, [ %rd1 + 0 ];
	ret;
}
"""


def test_single_buffer_is_one_stage_without_overlap():
  p = pm.pipeline(pm.entry_text(PTX_SINGLE, "layer_matmul"))
  assert p.loop and p.wait_group == 0 and p.commit_groups == 3
  assert p.cp_async_bytes == 4 * 16  # predicated copies counted as issued
  assert p.stages == 1 and not p.overlapped


def test_wait_group_depth_gives_the_stages_in_flight():
  p = pm.pipeline(pm.entry_text(PTX_DEEP, "layer_matmul"))
  assert p.wait_group == 6 and p.commit_groups == 3
  assert p.stages == 3 and p.overlapped  # 6 / 3 groups + the one being waited for


def test_plain_load_loop_and_loop_free_kernel():
  p = pm.pipeline(pm.entry_text(PTX_COPY, "copy_blocks"))
  assert p.loop and p.ld_global_bytes == 32 and p.cp_async_bytes == 0 and p.stages == 1
  q = pm.pipeline(pm.entry_text(PTX_COPY, "other_kernel"))
  assert not q.loop and q.ld_global_bytes == 4
  assert pm.entry_text(PTX_COPY, "missing") == ""


def test_residency_limits():
  g = pm.H200
  # 168 registers x 128 threads: 168 -> 5,376 registers per warp (rounded to 256), 4 warps each.
  assert pm.resident_ctas(g, 128, 168, 73_728) == (3, "registers")
  assert pm.resident_ctas(g, 128, 24, 0) == (16, "threads")
  assert pm.resident_ctas(g, 128, 64, 100_000) == (2, "shared memory")
  assert pm.resident_ctas(g, 32, 16, 0) == (32, "CTA limit")


def _stream(ctas, step_bytes, steps, stages=1, overlapped=False, regs=32, smem=0):
  pipe = pm.Pipeline(loop=True, cp_async_bytes=16, ld_global_bytes=0, commit_groups=1, wait_group=stages - 1,
                     tma=0, stages=stages, overlapped=overlapped)
  work = pm.Work(bytes=ctas * step_bytes * steps, flops=0, step_bytes=step_bytes, steps=steps)
  return pm.estimate(pm.H200, ctas, 128, regs, smem, pipe, work, None)


def test_a_well_fed_streaming_kernel_reaches_the_achievable_bandwidth():
  e = _stream(ctas=132 * 8 * 4, step_bytes=32_768, steps=16, stages=3, overlapped=True, regs=64, smem=40_000)
  assert e.fraction[0] == pytest.approx(pm.H200.achievable, rel=1e-6)
  assert e.bound == "bandwidth" and not pm.rule_violations(e)


def test_a_single_buffered_narrow_grid_is_latency_bound_and_breaks_both_rules():
  # layer_matmul's k/v projection at M = 1 before this model: 32 CTAs, 64 K steps of a 4 KB
  # tile, one round trip each.
  e = _stream(ctas=32, step_bytes=4096, steps=64)
  lat = pm.H200.latency_s
  assert (e.low_s, e.high_s) == pytest.approx((64 * lat[0], 64 * lat[1]))
  assert e.bound == "grid"
  rules = pm.rule_violations(e)
  assert len(rules) == 2 and "in flight" in rules[0] and "SMs idle" in rules[1]


def test_a_tail_wave_costs_a_whole_per_cta_time_when_latency_bound():
  one = _stream(ctas=132 * 16, step_bytes=1024, steps=8)
  tail = _stream(ctas=132 * 16 + 1, step_bytes=1024, steps=8)
  assert tail.high_s == pytest.approx(one.high_s + 8 * pm.H200.latency_s[1])


def test_compute_bound_kernel_is_held_to_its_mma_efficiency():
  pipe = pm.Pipeline(True, 16, 0, 1, 2, 0, 3, True)
  work = pm.Work(bytes=1 << 20, flops=10**12, step_bytes=16_384, steps=4)
  e = pm.estimate(pm.H200, 1024, 128, 128, 50_000, pipe, work, "mma.sync")
  lo, hi = pm.H200.mma_efficiency["mma.sync"]
  assert e.bound == "compute" and not e.memory_bound
  assert e.high_s == pytest.approx(10**12 / (pm.H200.dense_flops * lo))
  assert e.fraction[1] == pytest.approx(hi)
  assert e.attainable_fraction == pytest.approx(lo / hi)  # judged against its MMA's best
  assert not pm.rule_violations(e)  # the in-flight rule is for memory-bound kernels


def test_copies_need_in_flight_reads_for_half_the_traffic():
  pipe = pm.Pipeline(False, 0, 16, 0, None, 0, 1, False)
  half = pm.Work(bytes=2 << 20, flops=0, step_bytes=2048, steps=1, read_fraction=0.5)
  full = pm.Work(bytes=2 << 20, flops=0, step_bytes=2048, steps=1)
  a = pm.estimate(pm.H200, 512, 128, 16, 0, pipe, half, None)
  b = pm.estimate(pm.H200, 512, 128, 16, 0, pipe, full, None)
  assert a.inflight_needed_per_sm == pytest.approx(b.inflight_needed_per_sm / 2)


def test_judge_perf_targets_sanity_and_rule_checks():
  spec = dict(kernel="layer_matmul", purpose="perf")
  ok = dict(fraction=[0.85, 0.9], rules=[], high_us=10.0)
  assert perf_plan.judge_perf(spec, ok) is None
  assert "79%" in perf_plan.judge_perf(spec, dict(ok, fraction=[0.79, 0.9]))
  assert "SMs idle" in perf_plan.judge_perf(spec, dict(ok, rules=["grid of 8 CTAs leaves 94% of the SMs idle"]))
  assert perf_plan.judge_perf(spec, None).startswith("no estimate")
  sanity = dict(kernel="xla_copy", purpose="perf_sanity")
  assert perf_plan.judge_perf(sanity, dict(ok, fraction=[0.9, 0.92])) is None
  assert "model is wrong" in perf_plan.judge_perf(sanity, dict(ok, fraction=[0.5, 0.6]))
  check = dict(kernel="decode", purpose="perf_rule_check", variant={"num_splits": 1}, expect=["grid"])
  assert "should break" in perf_plan.judge_perf(check, ok)
  assert perf_plan.judge_perf(check, dict(ok, rules=["grid of 8 CTAs leaves 94% of the SMs idle"])) is None
  # A compute-bound kernel is held to what its MMA attains, not to the data-sheet peak.
  compute = dict(ok, fraction=[0.70, 0.80], memory_bound=False, attainable_fraction=0.875)
  assert perf_plan.judge_perf(spec, compute) is None
  assert "compute-bound" in perf_plan.judge_perf(spec, dict(compute, attainable_fraction=0.6))
  copy = dict(kernel="copy_blocks", purpose="perf")
  assert perf_plan.judge_perf(copy, dict(ok, high_us=12.0), dict(high_us=10.0)) is None  # 83 %
  assert "of XLA's copy" in perf_plan.judge_perf(copy, dict(ok, high_us=20.0), dict(high_us=10.0))


def test_named_shapes_cover_the_issue():
  specs = perf_plan.perf_specs()
  mm = {(s["model"], s["proj"], s["m"]) for s in specs if s["kernel"] == "layer_matmul"}
  assert len(mm) == 2 * 4 * 4  # q|k|v, o, gate|up, down: the launches the in-place path runs
  # The groups' widths sum to their N: every weight of the layer is counted once.
  for model, c in perf_plan.MODELS.items():
    launched = sum(k * n for _, k, n, _ in perf_plan.projections(model))
    q, kv = c["q_heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"]
    assert launched == c["d"] * (q + 2 * kv) + q * c["d"] + 3 * c["d"] * c["f"]
    assert sum(perf_plan.group_widths(model, "qkv")) == q + 2 * kv
  decode = [s for s in specs if s["kernel"] == "decode" and s["purpose"] == "perf"]
  assert {(s["batch"], s["context"]) for s in decode if not s.get("window")} == set(perf_plan.DECODE_SHAPES)
  assert {(s["batch"], s["context"], s["window"]) for s in decode if s.get("window")} == \
      set(perf_plan.DECODE_WINDOW_SHAPES)
  copies = {(s["model"], s["copies"]) for s in specs if s["kernel"] == "copy_blocks" and s["purpose"] == "perf"}
  assert len(copies) == 6
  # Every copy_blocks spec has XLA's copy of the same bytes as its baseline.
  baselines = {s["bytes"] for s in specs if s["purpose"] == "perf_baseline"}
  for s in specs:
    if s["kernel"] == "copy_blocks":
      assert s["copies"] * perf_plan.copy_block_bytes(s["model"], s["layers"]) in baselines


def test_layout_decision_picks_the_faster_layout():
  results = []
  for name, k, n, _ in perf_plan.projections("llama3.1-8b"):
    for m in (1, 64, 256):
      t = (k * n * 2) / pm.H200.bandwidth * 1e6  # at the roofline: beats the library GEMM
      results.append({"spec": dict(kernel="layer_matmul", purpose="perf", model="llama3.1-8b", proj=name, m=m),
                      "model": {"low_us": t, "high_us": t}})
  for b, c in perf_plan.LAYOUT_SHAPES:
    results.append({"spec": dict(kernel="decode", purpose="perf", batch=b, context=c),
                    "model": {"low_us": 100.0, "high_us": 120.0}})
  d = perf_plan.layout_decision(results, [])
  assert d["agrees"] and d["faster"] == "stacked" and {s["faster"] for s in d["shapes"]} == {"stacked"}
  assert all(s["margin"] > 1 for s in d["shapes"])
  slow = [dict(r, model={"low_us": r["model"]["low_us"] * 3, "high_us": r["model"]["high_us"] * 3})
          if r["spec"]["kernel"] == "layer_matmul" else r for r in results]
  assert not perf_plan.layout_decision(slow, [])["agrees"]


def test_a_launch_with_everything_in_flight_at_once_is_not_held_to_more():
  # 32 KB copied by 16 resident CTAs in one step each: all its reads are in flight together, so
  # neither rule can ask for more; the same bytes over 8 serial steps per CTA break both.
  pipe = pm.Pipeline(False, 0, 16, 0, None, 0, 1, False)
  once = pm.estimate(pm.H200, 16, 128, 16, 0, pipe, pm.Work(bytes=65_536, flops=0, step_bytes=2048, steps=1,
                                                          read_fraction=0.5), None)
  assert once.all_at_once and not pm.rule_violations(once)
  serial = pm.estimate(pm.H200, 2, 128, 16, 0, pipe, pm.Work(bytes=65_536, flops=0, step_bytes=2048, steps=8,
                                                           read_fraction=0.5), None)
  assert not serial.all_at_once and len(pm.rule_violations(serial)) == 2


def test_windowed_decode_counts_only_the_window():
  """64 x 32k with a 4096 window: the roofline's K/V bytes are the window's (an eighth of the
  context), the launch is sized for the window's tiles, and the busiest split walks no more of
  them than the window holds (the kernel skips the tiles before it)."""
  from scripts.gate.perf_work_decode import decode_launch, decode_work

  c = perf_plan.MODELS["llama3.1-8b"]
  args = (64, 32_768, c["q_heads"], c["kv_heads"], c["head_dim"], perf_plan.BLOCK_SIZE)
  full, win = decode_work(*args, 2), decode_work(*args, 2, window=4096)
  kv_bytes = 64 * c["kv_heads"] * c["head_dim"] * 2 * 2  # per position
  q_and_out = 2 * 64 * c["q_heads"] * c["head_dim"] * 2
  assert win.bytes == 4096 * kv_bytes + q_and_out and full.bytes == 32_768 * kv_bytes + q_and_out
  launch = decode_launch(*args, window=4096)
  tile_keys = launch.blocks_per_tile * perf_plan.BLOCK_SIZE
  assert win.steps == launch.tiles_per_split
  whole = decode_launch(*args)
  assert launch.tiles_per_split * launch.num_splits <= 4096 // tile_keys + 1 < whole.tiles_per_split * whole.num_splits
