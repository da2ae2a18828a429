"""The GPU compile gate's readers (``scripts/gate/gpu_report.py``) on text in the formats XLA 0.10.2 and
ptxas 12.9 write (shortened from real dumps of ``scripts/gate/gpu_compile.py``). No CUDA needed."""

import json
import os

from scripts.gate import gpu_compile_plan, gpu_report

PTXAS_LOG = """\
I1201 07:52:28.137985    5071 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'loop_clamp_fusion' for 'sm_90a'
ptxas info    : Function properties for loop_clamp_fusion
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
ptxas info    : Compile time = 2.025 ms

I1201 07:52:28.141158    5070 subprocess_compilation.cc:356] ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'paged_prefill_attention' for 'sm_90a'
ptxas info    : Function properties for paged_prefill_attention
    64 bytes stack frame, 60 bytes spill stores, 64 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 448 bytes cmem[0]
ptxas info    : Compiling entry function 'write_kv' for 'sm_80'
ptxas info    : Used 26 registers
"""


def test_ptxas_report_per_kernel():
  r = gpu_report.parse_ptxas(PTXAS_LOG)
  assert r["loop_clamp_fusion"] == {"arch": "sm_90a", "registers": 10, "barriers": 0, "stack_frame_bytes": 0,
                                    "spill_store_bytes": 0, "spill_load_bytes": 0}
  assert r["paged_prefill_attention"]["registers"] == 255
  assert r["paged_prefill_attention"]["spill_store_bytes"] == 60
  assert r["paged_prefill_attention"]["spill_load_bytes"] == 64
  # A report without a properties line: its figures are unknown, not borrowed from a neighbour.
  assert r["write_kv"]["registers"] == 26 and r["write_kv"]["spill_store_bytes"] is None
  assert gpu_report.spills(r) == {"paged_prefill_attention": 124}


def test_ptxas_keeps_the_worst_of_repeated_reports():
  log = PTXAS_LOG + PTXAS_LOG.replace("Used 10 registers", "Used 12 registers").replace(
      "0 bytes stack frame, 0 bytes spill stores", "0 bytes stack frame, 8 bytes spill stores", 1)
  r = gpu_report.parse_ptxas(log)
  assert r["loop_clamp_fusion"]["registers"] == 12
  assert r["loop_clamp_fusion"]["spill_store_bytes"] == 8


THUNKS = """\
000: kCommandBuffer [source       | next=041 (1)] 
    001: kCustomKernel [source       | sink         ] wrapped_iota grid: [1, 1, 1] threads: [64, 1, 1]  shared_memory: 0 bytes
    002: kCopy         [source       | next=003 (1) ] kCopy
041: kConditional   [prev=000 (1) | next=000 (1)]   
  false_branch:
    024: kCopy  [source       | next=027 (3)] kCopy
    027: kWhile [prev=026 (1) | sink        ]       
condition:
        028: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        000: kCommandBuffer [source | sink] 
            030: kCustomKernel [source       | next=031 (1)] loop_and_fusion_1 grid: [1, 1, 1] threads: [64, 1, 1]  shared_memory: 0 bytes
            031: kCustomKernel [prev=030 (1) | next=032 (1)] input_reduce_fusion_20 grid: [64, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
    050: kCustomKernel [prev=027 (1) | sink] after_the_loop grid: [1, 1, 1] threads: [32, 1, 1]  shared_memory: 0 bytes
  true_branch:
    038: kCopy [source | sink] kCopy
004: kCustomKernel [prev=003 (1) | next=005 (1)] paged_decode_attention grid: [64, 8, 1] threads: [128, 1, 1]  shared_memory: 73728 bytes
"""  # noqa: E501, W291 (XLA's thunk dump as printed: long lines, trailing blanks)


def test_thunk_tree_sections_and_launch_figures():
  roots = gpu_report.parse_thunks(THUNKS)
  assert [t["kind"] for t in roots] == ["kCommandBuffer", "kConditional", "kCustomKernel"]
  cond = roots[1]
  assert set(cond["sections"]) == {"false_branch", "true_branch"}
  loop = cond["sections"]["false_branch"][1]
  assert loop["kind"] == "kWhile"
  assert [t.get("name") for t in loop["sections"]["condition"]] == ["loop_and_fusion"]
  assert loop["sections"]["body"][0]["kind"] == "kCommandBuffer"
  # The kernel after the while (back at the branch's indentation) stays in the false branch.
  assert cond["sections"]["false_branch"][2]["name"] == "after_the_loop"
  dec = roots[2]
  assert dec["grid"] == [64, 8, 1] and dec["threads"] == [128, 1, 1] and dec["shared_memory_bytes"] == 73728

  s = gpu_report.thunk_summary(roots)
  # Least: the graph (1 kernel, 1 copy), the conditional's true branch (1 copy), the decode kernel.
  assert s["least"] == {"kernels": 2, "copies": 2, "host_launches": 3, "host_syncs": 1}
  # Most: false branch with one loop trip: copy, condition twice (2 syncs), body graph, one kernel.
  assert s["most"]["host_syncs"] == 3
  assert s["most"]["kernels"] == 1 + 2 + 2 + 1 + 1
  assert s["conditionals"] == 1 and s["whiles"] == 1 and s["control_flow_in_command_buffers"] == 0
  assert s["triton_kernels"] == ["paged_decode_attention"]


def test_step_of_a_loop_program_is_the_decode_loop_body():
  text = """\
001: kCustomKernel [source | sink] prefill_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
002: kWhile [prev=001 (1) | sink]
condition:
    003: kCustomKernel [source | sink] cond_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    004: kCustomKernel [source | sink] paged_decode_attention grid: [64, 8, 1] threads: [128, 1, 1]  shared_memory: 73728 bytes
    005: kGemm [source | sink] kGemm
"""  # noqa: E501 (XLA's thunk dump as printed)
  step, scope = gpu_report.step_thunks(gpu_report.parse_thunks(text))
  assert scope == "body of the decode loop"
  assert [t["kind"] for t in step] == ["kCustomKernel", "kGemm"]
  step, scope = gpu_report.step_thunks(gpu_report.parse_thunks(text.replace("paged_decode_attention", "x")))
  assert scope == "whole program" and len(step) == 2


def test_mma_kind_and_kv_bound():
  assert gpu_report.mma_kind("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == "wgmma"
  assert gpu_report.mma_kind("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == "mma.sync"
  assert gpu_report.mma_kind("ld.global.b32") is None
  # 1 GB at 4.8 TB/s: 0.208 ms.
  assert abs(gpu_report.kv_read_lower_bound(10**9, 4.8e12) - 1 / 4800) < 1e-12


def test_hlo_control_flow_counts():
  hlo = ("%w = (s32[], f32[4]) while((s32[], f32[4]) %t), condition=%c, body=%b\n"
         "%k = f32[4] conditional(pred[] %p, f32[4] %a, f32[4] %a), true_computation=%x\n"
         "%n = f32[4] add(f32[4] %a, f32[4] %a)\n")
  assert gpu_report.hlo_control_flow(hlo) == {"while": 1, "conditional": 1}


def test_gate_plan_judges_results():
  ok = {"status": "compiled", "spills": {}, "deviceless": True, "spec": {"purpose": "matrix"}}
  assert gpu_compile_plan.judge(ok) is None
  assert "spill" in gpu_compile_plan.judge(dict(ok, spills={"paged_prefill_attention": 8}))
  assert "spill" in gpu_compile_plan.judge(dict(ok, spills={"layer_matmul_pallas_1": 4}))
  # XLA's own fusions: reported (xla_fusion_spills), not failed.
  xla = dict(ok, spills={"input_or_reduce_fusion": 16, "write_kv": 0})
  assert gpu_compile_plan.judge(xla) is None
  assert gpu_compile_plan.xla_fusion_spills(xla) == {"input_or_reduce_fusion": 16}
  assert "refused" in gpu_compile_plan.judge({"status": "refused", "error": "x", "spec": {"purpose": "matrix"}})
  assert gpu_compile_plan.judge({"status": "refused", "spec": {"purpose": "table_refusal"}}) is None
  assert "expected" in gpu_compile_plan.judge(dict(ok, spec={"purpose": "table_refusal"}))
  assert "compile_failed" in gpu_compile_plan.judge(
      {"status": "compile_failed", "error": "RESOURCE_EXHAUSTED", "spec": {"purpose": "matrix"}})


def test_triton_key_ignores_only_the_grid():
  call = ('%0 = stablehlo.custom_call @__gpu$xla.gpu.triton(%a) {backend_config = "", mhlo.backend_config = '
          '{debug = false, grid_x = {x} : i32, grid_y = 8 : i32, grid_z = 1 : i32, ir = "{ir}", name = "k", '
          'num_stages = 2 : i32, num_warps = 4 : i32}}, operand_layouts = []\n')
  a = gpu_compile_plan.triton_key(call.replace("{x}", "4").replace("{ir}", "IR1"))
  b = gpu_compile_plan.triton_key(call.replace("{x}", "64").replace("{ir}", "IR1"))
  c = gpu_compile_plan.triton_key(call.replace("{x}", "4").replace("{ir}", "IR2"))
  assert a == b != c


def test_gate_matrix_covers_the_issue_axes_and_every_table_row():
  groups = gpu_compile_plan.kernel_groups(quick=False)
  specs = [s for g in groups for s in g]
  matrix = {(s["kernel"], s["dtype"], s["head_dim"], s["block_size"], s["group"], s["size"])
            for s in specs if s["purpose"] == "matrix"}
  assert len(matrix) == 4 * 3 * 3 * 3 * 3 * 2
  from paged_kv.pallas_kernels import tiling
  rows = {(s["kernel"], s["dtype"], s["head_dim"], s["target"]) for s in specs if s["purpose"] == "table_row"}
  for kernel, dt, d, _ in tiling.all_rows():
    assert {(kernel, dt, d, t) for t in ("sm_90", "sm_80")} <= rows
  json.dumps(groups)  # picklable / plain data for the worker processes


def test_gate_configurations_follow_the_execution_plan():
  """Issue 41: every combination of the plan's switches (target, KV dtype, batch-invariant mode,
  attention kind) the plan accepts has compiled configurations of the kernel family the plan names;
  every combination it refuses has a configuration that must be refused before tracing; and a
  configuration's purpose agrees with the plan (compiled where it accepts, a refusal where it refuses)."""
  specs = gpu_compile_plan.kernel_specs(quick=False)
  refusals = ("table_refusal", "quant_refusal", "plan_refusal")

  def combo(s):
    sw = gpu_compile_plan.spec_switches(s)
    return (sw["target"], sw["kv_dtype"], sw["batch_invariant"], sw["kinds"])

  compiled = {(combo(s), s["kernel"]) for s in specs if s["purpose"] not in refusals and s["kernel"] != "layer_matmul"}
  refused = {combo(s) for s in specs if s["purpose"] in ("quant_refusal", "plan_refusal")}
  family = {"paged": {"decode", "prefill"}, "invariant": {"invariant_attention"}}
  combos = gpu_compile_plan.plan_combinations()
  assert len(combos) == 2 * 3 * 2 * 2
  for c in combos:
    key = (c["target"], c["kv_dtype"], c["batch_invariant"], c["kinds"])
    if c["attention"] is None:
      assert key in refused, (key, c["row"])
    else:
      for kernel in family[c["attention"]]:
        assert (key, kernel) in compiled, (key, kernel)
  for s in specs:
    if s["kernel"] == "layer_matmul":
      continue
    verdict = gpu_compile_plan.plan_refusal(s)
    if s["purpose"] in ("quant_refusal", "plan_refusal"):
      assert verdict is not None, s
    elif s["purpose"] != "table_refusal":
      assert verdict is None, (s, verdict)


def test_gate_compiles_every_knob_on_the_table_rows():
  """Issue 18: soft_cap, ALiBi and both, decode and prefill, every dtype at head_dim 64/128/256,
  both targets, at block size 16, the row's largest and smallest block (decode at the row's
  largest GQA group), each with the row that knob selects, and that row's refusals."""
  from paged_kv.pallas_kernels import tiling
  every = gpu_compile_plan.kernel_specs(quick=False)
  specs = [s for s in every if s["purpose"] == "knob_row"]
  got = {(s["kernel"], s["dtype"], s["head_dim"], s["target"], s["knob"], s["block_size"], s["group"])
         for s in specs}
  assert len(got) == len(specs)  # no configuration twice
  for kernel, dt, d, _ in tiling.all_rows():
    if d not in (64, 128, 256):
      assert not any((s["kernel"], s["dtype"], s["head_dim"]) == (kernel, dt, d) for s in specs)
      continue
    for knob in ("soft_cap", "alibi", "soft_cap+alibi"):
      row = tiling.table_row(kernel, dt, d, gpu_compile_plan.knob_facts(knob))
      g = row.rows_per_tile if kernel == "decode" else 8
      for target in ("sm_90", "sm_80"):
        for bs in (16, row.keys_per_tile, row.min_block_size):
          assert (kernel, dt, d, target, knob, bs, g) in got
      # The refusals of the knob's row (twice its block; for decode twice its group).
      refusals = {(s["block_size"], s["group"]) for s in every
                  if s["purpose"] == "table_refusal" and s.get("knob") == knob
                  and (s["kernel"], s["dtype"], s["head_dim"]) == (kernel, dt, d)}
      assert (2 * row.keys_per_tile, 8) in refusals
      assert kernel != "decode" or (16, 2 * g) in refusals
  assert gpu_compile_plan.knob_facts("soft_cap+alibi") == tiling.Knobs(soft_cap=True, alibi=True)
  assert gpu_compile_plan.knob_facts(None) == tiling.NO_KNOBS


def test_knob_summary_takes_the_worst_configuration_per_knob():
  def res(name, knob, regs, spill=0, purpose="knob_row", bs=16, status="compiled", same=None):
    spec = {"kernel": "decode", "dtype": "float32", "head_dim": 256, "target": "sm_90", "block_size": bs,
            "purpose": purpose}
    if knob:
      spec["knob"] = knob
    r = {"spec": spec, "name": name, "status": status}
    if same:
      r["same_as"] = same
    else:
      r.update(kernels={"paged_decode_attention": {"registers": regs}}, spills={"k": spill} if spill else {})
    return r
  rep = {"kernels": [res("a", None, 200, purpose="table_row"), res("b", "alibi", 240),
                     res("c", "alibi", 255, spill=24, bs=64), res("d", "alibi", 0, same="c", bs=32),
                     res("e", "soft_cap", 250)]}
  table = gpu_report.knob_summary(rep).splitlines()
  assert table[0].startswith("| kernel | dtype | head_dim | registers, no knob | registers, alibi "
                             "| registers, soft_cap")
  assert table[2] == "| decode | float32 | 256 | 200 | 255 | 250 | 24 | 4 |"


def test_empty_while_condition_keeps_the_body_apart():
  # A while whose condition only reads its predicate prints "No thunks." with the body's label on
  # the same line; the body must not count as the condition (one sync on zero trips, not three).
  text = """\
052: kWhile         [prev=000 (1) | next=204 (1)]
condition:
    No thunks.  body:
    000: kCommandBuffer [source       | next=080 (1)]
        001: kCustomKernel [source | sink] body_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
    080: kConditional   [prev=000 (1) | next=000 (1)]
      false_branch:
        002: kCustomKernel [source | sink] slow_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      true_branch:
003: kCustomKernel [source | sink] after grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""
  roots = gpu_report.parse_thunks(text)
  assert [t["kind"] for t in roots] == ["kWhile", "kCustomKernel"]
  loop = roots[0]
  assert loop["sections"].get("condition", []) == []
  assert [t["kind"] for t in loop["sections"]["body"]] == ["kCommandBuffer", "kConditional"]
  s = gpu_report.thunk_summary(roots)
  assert s["least"] == {"kernels": 1, "copies": 0, "host_launches": 1, "host_syncs": 1}
  # Most: one trip (the condition read twice, the branch once) through the body and slow branch.
  assert s["most"]["host_syncs"] == 3 and s["most"]["kernels"] == 3


_SCAN_THUNKS = """\
001: kCustomKernel [source | sink] prologue grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
002: kWhile [prev=001 (1) | sink]
condition:
    003: kCustomKernel [source | sink] outer_cond grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    004: kWhile [source | sink]
condition:
        005: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
      body:
        000: kCommandBuffer [source | sink]
            006: kCustomKernel [source | sink] layer_matmul grid: [1, 8, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
            007: kCustomKernel [source | sink] paged_decode_attention grid: [8, 2, 2] threads: [128, 1, 1]  shared_memory: 0 bytes
    008: kCustomKernel [source | sink] sample grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
"""  # noqa: E501 (XLA's thunk dump as printed)
_SCAN_META = """\
thunk_metadata {
  thunk_info {
    profile_annotation: "while.2"
    thunk_id: 2
  }
  thunk_kind: "kWhile"
}
thunk_metadata {
  thunk_info {
    profile_annotation: "while.6"
    thunk_id: 4
  }
  thunk_kind: "kWhile"
}
"""
_SCAN_HLO = """\
  %while.2 = (s32[], f32[4]) while((s32[], f32[4]) %t), condition=%c2, body=%b2
  %while.6 = (s32[], f32[4]) while((s32[], f32[4]) %u), condition=%c6, body=%b6, backend_config={"known_trip_count":{"n":"3"}}
"""  # noqa: E501 (HLO as printed)


def test_known_trip_count_loops_run_that_often_without_host_syncs():
  """A scan over layers inside a decode loop: XLA knows the inner while's trip count (3), so its
  body counts three times and its condition is never read back; the outer loop (a while_loop)
  stays 0 or 1 trips with syncs. The decode step is the outer loop's body, the scan inside it."""
  trips = gpu_report.while_trip_counts(_SCAN_META, _SCAN_HLO)
  assert trips == {4: 3}
  roots = gpu_report.parse_thunks(_SCAN_THUNKS, trips)
  step, scope = gpu_report.step_thunks(roots)
  assert scope == "body of the decode loop"
  assert [t["kind"] for t in step] == ["kWhile", "kCustomKernel"] and step[0]["trip_count"] == 3
  s = gpu_report.thunk_summary(step)
  # Three graph launches of two kernels each, then the sampling kernel; no sync.
  assert s["least"] == s["most"] == {"kernels": 7, "copies": 0, "host_launches": 4, "host_syncs": 0}
  # Without the trip counts the scan would be taken for the decode loop: one layer read as the step.
  plain, _ = gpu_report.step_thunks(gpu_report.parse_thunks(_SCAN_THUNKS))
  assert [t["kind"] for t in plain] == ["kCommandBuffer"]


def test_step_copies_sizes_and_the_weight_or_page_check():
  """The copies a step always runs, sized from the HLO: one before the scan (once), one inside
  the scan's body (once per layer, 3 trips), one inside a conditional (not on the common path).
  The gate fails a program whose step copies a weight slice's or the pages' element count."""
  thunks = """\
001: kCopy [source | sink] kCopy
002: kWhile [prev=001 (1) | sink]
condition:
    003: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    004: kCopy [source | sink] kCopy
    005: kCustomKernel [source | sink] layer_matmul grid: [1, 8, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
006: kConditional [source | sink]
  true_branch:
    007: kCopy [source | sink] kCopy
"""
  meta = "".join(f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{n}"\n    thunk_id: {i}\n  }}\n'
                 f'  thunk_kind: "{k}"\n}}\n' for i, n, k in [(1, "copy.1", "kCopy"), (2, "while.2", "kWhile"),
                                                           (4, "copy.4", "kCopy"), (7, "copy.7", "kCopy")])
  hlo = """\
  %copy.1 = s32[64,256]{1,0} copy(s32[64,256]{1,0} %a)
  %while.2 = (s32[], bf16[3,8,16]) while((s32[], bf16[3,8,16]) %t), condition=%c, body=%b, backend_config={"known_trip_count":{"n":"3"}}
  %copy.4 = bf16[1,8,16]{2,1,0} copy(bf16[1,8,16]{2,1,0} %s)
  ROOT %copy.7 = (f32[4]{0}, pred[4]{0}) copy(%u)
"""  # noqa: E501 (HLO as printed)
  shapes = gpu_report.hlo_shapes(hlo)
  assert shapes["copy.1"] == [("s32", 64 * 256)] and shapes["copy.7"] == [("f32", 4), ("pred", 4)]
  roots = gpu_report.parse_thunks(thunks, gpu_report.while_trip_counts(meta, hlo))
  copies = gpu_report.step_copies(roots, gpu_report.thunk_names(meta), shapes)
  assert [(c["name"], c["bytes"], c["times"]) for c in copies] == [("copy.1", 65536, 1), ("copy.4", 256, 3)]
  bad = gpu_report.weight_or_page_copies(copies, {8 * 16: "a weight slice", -10 ** 6: "pages"})
  assert bad == [{"name": "copy.4", "elements": 128, "what": "a weight slice", "times": 3}]
  assert gpu_report.weight_or_page_copies(copies, {-16384: "pages"})[0]["name"] == "copy.1"
  ok = {"status": "compiled", "spills": {}, "deviceless": True, "spec": {}}
  assert "copies of weights or pages" in gpu_compile_plan.judge(dict(ok, weight_or_page_copies=bad))


def test_version_comparison_puts_two_reports_side_by_side():
  """The decode/prefill rows of two gate reports (two JAX releases) in one table, old / new; a
  configuration compiled by one report only shows '-' on the other side."""
  def report(jax_version, regs, mma):
    spec = dict(kernel="decode", target="sm_90", dtype="bfloat16", head_dim=128, block_size=16, group=4,
                size="large", purpose="matrix")
    kernel = {"registers": regs, "shared_memory_bytes": 73728, "mma": mma}
    return {"jax": jax_version, "kernels": [
        {"spec": spec, "name": "a", "status": "compiled", "spills": {}, "kernels": {"paged_decode_attention": kernel}},
        {"spec": dict(spec, group=8), "status": "same_kernel_as", "same_as": "a"},  # not the table's GQA
    ]}
  old, new = report("0.10.2", 167, "mma.sync"), report("0.12.0.1", 168, "mma.sync")
  new["kernels"].append({"spec": dict(old["kernels"][0]["spec"], kernel="prefill"), "status": "compiled",
                         "spills": {"p": 8}, "kernels": {"paged_prefill_attention": {
                             "registers": 255, "shared_memory_bytes": 81920, "mma": "wgmma"}}})
  lines = gpu_report.version_comparison(old, new).splitlines()
  assert "JAX 0.10.2 / 0.12.0.1" in lines[0]
  assert lines[2] == "| sm_90 | decode | bfloat16 | 128 | 167 / 168 | 0 / 0 | 73,728 / 73,728 | mma.sync / mma.sync |"
  assert lines[3] == "| sm_90 | prefill | bfloat16 | 128 | - / 255 | - / 8 | - / 81,920 | - / wgmma |"
  assert len(lines) == 4


def test_summary_of_a_report_is_what_the_tables_read(tmp_path):
  """The gate's summary keeps per group and per program what the tables show; the tables read a
  summary and a full report alike, and the summary is written beside the report."""
  spec = dict(kernel="decode", target="sm_90", dtype="bfloat16", head_dim=128, block_size=16, group=4,
              size="large", purpose="matrix")
  kernel = {"registers": 167, "shared_memory_bytes": 73728, "mma": "mma.sync", "grid": [64, 8, 1],
            "threads": [128, 1, 1]}
  step = {"least": {"kernels": 3, "copies": 1, "host_launches": 2, "host_syncs": 1},
          "most": {"kernels": 5, "copies": 2, "host_launches": 4, "host_syncs": 3}, "conditionals": 1, "whiles": 1,
          "control_flow_in_command_buffers": 0, "copy_bytes": 2**20}
  report = {"jax": "0.12.0.1", "counts": {"configurations": 3}, "failures": [], "kernels": [
      {"spec": spec, "name": "a", "status": "compiled", "spills": {}, "kernels": {"paged_decode_attention": kernel,
                                                                                 "loop_fusion": {"registers": 9}}},
      {"spec": dict(spec, group=8), "status": "same_kernel_as", "same_as": "a"},
      {"spec": dict(spec, block_size=64, purpose="table_refusal"), "status": "refused"},
  ], "programs": [
      {"program": "append", "target": "sm_90", "layers": 32, "status": "compiled", "compile_s": 1.5,
       "per_step": step, "memory": {"temp_size_in_bytes": 2**21}, "spills": {}, "gate": "pass"},
  ]}
  summary = gpu_report.summarize(report)
  assert gpu_report.summarize(summary) is summary
  assert [(g["purpose"], g["configurations"], g["compiled"], g["same_kernel_as"], g["refused"], g["max_registers"])
          for g in summary["groups"]] == [("matrix", 2, 1, 1, 0, 167), ("table_refusal", 1, 0, 0, 1, 0)]
  assert summary["programs"][0]["least"]["host_syncs"] == 1
  assert gpu_report.markdown_summary(summary) == gpu_report.markdown_summary(report)
  table = gpu_report.kernel_table(summary).splitlines()
  assert table[2] == "| sm_90 | decode | bfloat16 | 128 | 167 | 0 | 73,728 | [64, 8, 1] | [128, 1, 1] | mma.sync |"
  assert gpu_report.program_table(summary).splitlines()[2] == (
      "| append | 32 | 3, 5 | 2, 4 | 1, 3 | 1, 1.0 MiB | 1, 1 (0) | 2.0 MiB | 1.5 | - |")
  out = gpu_report.summary_path(str(tmp_path / "gpu_compile_report.json"))
  assert out == str(tmp_path / "gpu_compile_summary.json")
  gpu_report.dump_summary(summary, out)
  assert json.load(open(out)) == json.loads(json.dumps(summary))


def test_committed_summary_is_small_and_docs_tables_match_it():
  """results/gpu_compile_summary.json (the gate's summary; the full report is not committed) stays
  small, and docs/gpu-gate.md's tables are what it renders."""
  from scripts import doc_tables
  path = gpu_report.SUMMARY
  assert os.path.getsize(path) < 96 * 1024
  summary = json.load(open(path))
  assert "kernels" not in summary and summary["counts"]["failures"] == 0
  page = doc_tables.GPU_GATE.read_text()
  for name, table in gpu_report.DOC_TABLES.items():
    begin, end = doc_tables.markers(name)
    assert f"{begin}\n{table(summary)}\n{end}" in page, name
