"""The supported JAX range and the one module that holds what differs across it
(pallas_kernels/jax_compat.py), plus the lent GPU machine's version check (scripts/gate/gpu_check.py env).
"""

import pytest
from packaging.specifiers import SpecifierSet

from paged_kv.pallas_kernels import jax_compat
from scripts.gate import gpu_check

pytestmark = pytest.mark.smoke


def test_declared_range_spans_the_oldest_and_newest_tested_pairs():
  ranges = gpu_check.declared_ranges()
  for name in ("jax", "jaxlib"):
    for tested in ("0.10.2", "0.11.2", "0.12.0.1"):  # CI's two ends and the GPU machine's JAX
      assert SpecifierSet(ranges[name]).contains(tested), (name, tested, ranges[name])
    assert not SpecifierSet(ranges[name]).contains("0.13.0"), "Pallas moves between minor releases"
  assert SpecifierSet(ranges["flax"]).contains("0.12.8") and SpecifierSet(ranges["flax"]).contains("0.12.12")


def test_this_environment_is_inside_the_declared_range():
  env = gpu_check.check_env()
  assert env["failures"] == 0, env["packages"]
  assert env["packages"]["jax"]["installed"] == env["jax"]


def test_env_check_reports_a_jax_outside_the_range_and_a_missing_package():
  installed = {name: p["installed"] for name, p in gpu_check.check_env()["packages"].items()}
  env = gpu_check.check_env({**installed, "jax": "0.9.2", "flax": None})
  assert env["failures"] == 2
  assert not env["packages"]["jax"]["ok"] and env["packages"]["jax"]["installed"] == "0.9.2"
  assert not env["packages"]["flax"]["ok"] and env["packages"]["flax"]["installed"] is None


def test_gate_options_ask_for_the_ptxas_report_where_xla_assembles_through_nvjitlink():
  opts = jax_compat.gate_compile_options("/tmp/dump")
  assert opts["xla_dump_to"] == "/tmp/dump"
  newer = jax_compat.jaxlib_version() >= (0, 12)
  assert ("xla_gpu_libnvjitlink_mode" in opts) == newer
  assert ("xla_dump_emitter_re" in opts) == newer


def test_cuda_lowering_names_the_target_device():
  from jax._src import mesh as mesh_lib  # the abstract mesh JAX's Triton lowering reads

  with jax_compat.cuda_lowering("NVIDIA A100-SXM4-80GB"):
    device = mesh_lib.get_abstract_mesh().abstract_device
  assert device.device_kind == "NVIDIA A100-SXM4-80GB" and device.platform == "gpu"
  assert mesh_lib.get_abstract_mesh().abstract_device is None  # restored on exit
