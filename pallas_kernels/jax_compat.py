"""What differs between the JAX releases paged-kv supports, in one place.

The supported range is ``pyproject.toml``'s (JAX and jaxlib 0.10.2 up to 0.12.x); the exact
versions each CI run installs are in ``.ci/constraints-*.txt``. Nothing else in the project looks
at JAX's version or probes for an API that moved: it calls a function here.

* **Lowering Triton kernels for CUDA on a machine with no GPU** (``jax.export`` in the tests, the
  deviceless GPU gate). JAX 0.12 lowers a Pallas kernel to Triton for the compute capability of the
  device it will run on, and with no GPU present that device must be named through an abstract mesh
  (``jax.sharding.use_abstract_mesh`` with an ``AbstractDevice``); it raises otherwise. JAX 0.10 has
  the same API but ignores it there: it lowers for compute capability 9.0 whenever no GPU is
  present. :func:`cuda_lowering` names the device on every release, so the sm_80 gate lowers for
  an A100 where JAX lets it.
* **The deviceless compile's assembler report** (the GPU gate). JAX 0.12's XLA assembles PTX through
  libnvJitLink, which does not log ptxas's register and spill report, and dumps PTX only when
  ``xla_dump_emitter_re`` selects the "ptx" emitter. :func:`gate_compile_options` asks for the standalone
  ``ptxas`` and the PTX dump on that release; JAX 0.10 gives both by default.
* **JAX's own Pallas paged attention** (``jax.experimental.pallas.ops.gpu.paged_attention``), the
  outside reference the decode kernel is tested and benchmarked against. JAX 0.12 deprecates the
  module (a ``DeprecationWarning`` at import) but still ships it; :func:`jax_paged_attention`
  imports it without the warning, and the comparison stays for as long as JAX ships it.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

# The GPU the tests lower for when nothing else is named: a Hopper part (sm_90), the target the
# kernels' tiles are tuned for.
DEFAULT_CUDA_DEVICE_KIND = "NVIDIA H100"


@contextlib.contextmanager
def cuda_lowering(device_kind: str = DEFAULT_CUDA_DEVICE_KIND) -> Iterator[None]:
  """Context in which ``jax.export(..., platforms=["cuda"])`` or ``jit(...).lower()`` of Pallas
  Triton kernels works on a machine without a GPU.

  ``device_kind`` is the NVIDIA device name the kernels are lowered for (``"NVIDIA H100"``,
  ``"NVIDIA A100-SXM4-80GB"``, ...): where JAX reads it (0.12), it decides the compute capability
  Triton lowers for.
  """
  mesh = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind, None, "gpu"))
  with use_abstract_mesh(mesh):
    yield


def export_cuda(fn: Callable[..., Any], *args: jax.Array | jax.ShapeDtypeStruct,
                donate_argnums: int | tuple[int, ...] = ()) -> jax.export.Exported:
  """``jax.jit(fn)`` exported for CUDA with its Triton custom calls allowed, on any machine (no
  GPU needed): ``.mlir_module()`` is the StableHLO text, ``.out_avals`` the output shapes.
  ``args`` are arrays or ``jax.ShapeDtypeStruct``\\ s."""
  from jax import export
  with cuda_lowering():
    return export.export(
        jax.jit(fn, donate_argnums=donate_argnums), platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)


def gate_compile_options(dump_dir: str) -> dict[str, str]:
  """XLA compile options for a deviceless GPU compile whose log carries ptxas's per-kernel
  register/spill report and whose dump (``dump_dir``) carries the thunk sequence and the PTX."""
  options = {"xla_dump_to": dump_dir}
  # XLA keeps its option names in C++ (an unknown one is an error), so the release decides here.
  if jaxlib_version() >= (0, 12):
    # Assemble with the standalone ptxas, which logs its report (libnvJitLink does not), and
    # dump the PTX (the "ptx" emitter's dump). A wider pattern also dumps the Triton pipeline
    # after every pass, about 10 MB and 15 s per attention kernel.
    options["xla_gpu_libnvjitlink_mode"] = "LIB_NV_JIT_LINK_MODE_DISABLED"
    options["xla_dump_emitter_re"] = "^ptx$"
  return options


def jaxlib_version() -> tuple[int, ...]:
  """The installed jaxlib's release as integers, e.g. ``(0, 12, 0, 1)``."""
  from jaxlib import version
  return tuple(int(p) for p in re.findall(r"\d+", version.__version__))


def jax_paged_attention() -> ModuleType:
  """JAX's own Pallas GPU paged-attention module (``paged_attention(q, k_pages, v_pages,
  block_tables, lengths, ...)``), an independent reference for the decode kernel. Its import
  warns of its deprecation from JAX 0.12; that one warning is silenced here, nothing else."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"jax\.experimental\.pallas\.ops\.gpu\.paged_attention is deprecated",
                            category=DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import paged_attention
  return paged_attention
