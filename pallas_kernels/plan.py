"""The execution plan: from the cross-cutting switches, what runs, decided once before anything traces.

The switches are ``impl`` ("auto" | "pallas" | "interpret" | "reference"), ``target`` (what the
Pallas kernels are compiled for: "auto", "cpu", or a GPU as ``"sm_XY"``), ``batch_invariant``,
the KV pages' dtype (plain float pages, int8 or float8_e4m3fn), the attention kinds the model's
layers use (an opaque static tuple of names, :data:`KINDS`: this module does not depend on how a
kernel represents them), the tensor-parallel mesh ``tp`` (None: one device) and, where the caller
knows them, the model's ``head_dim`` and the pages' ``block_size``. :func:`make_plan` walks :data:`ROWS` in order;
the first row whose conditions hold decides: either an :class:`ExecutionPlan` (the resolved
``impl``, the attention kernel family, how the layers loop and how the projections run) or a
refusal, one-line ``ValueError`` naming the combination and what is supported.

Every combination that used to pick another implementation or path quietly is a row here, so a
reader (and docs/design.md's table, generated from :func:`table_markdown`) sees it:

* ``impl="auto"`` on a GPU with a head_dim the Triton kernels cannot take runs the XLA reference
  (it was a branch inside ``resolve_impl``, duplicated in the tiling check);
* a projection weight whose K or N is not a multiple of 16 runs the XLA reference for that
  weight (:meth:`ExecutionPlan.matmul_impl`; it was a branch inside the model's layer matmul);
* the Pallas kernels over a tensor-parallel mesh loop unrolled over per-layer weights with XLA
  projections (GSPMD partitions them) instead of the in-place ``layer_matmul`` scan;
* batch-invariant mode on the XLA reference needs a block size dividing the invariant key tile
  (it was refused only while compiling).

The refusals that were spread over the kernels' checks (``validate``: a head_dim the Pallas
kernels cannot take, quantized pages with ``batch_invariant``), ``quant`` (float8_e4m3fn below
sm_89), the engines (``call_setup.check_kv_pages``, ``ServingConfig``), the command line
(``--impl pallas`` without a GPU, ``--batch-invariant`` with ``--kv-dtype`` or a block size the
reference cannot step over) and the reference kernel (that block size, while compiling) are
rows here; those callers ask this module (the command line words the answer in its options).

Why in ``pallas_kernels/``: the kernels' dispatch and input checks (``dispatch.py``,
``validate.py``) must consult it, and this package imports nothing from the rest of the
repository (docs/design.md section 1); every layer above (models, engine, apps, the GPU gate) may
import it from here. Everything is static Python, run outside ``jit``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

IMPLS = ("auto", "pallas", "interpret", "reference")
"""The accepted ``impl`` values (the other layers import them from here, through ``validate``)."""

KINDS = ("full", "window", "chunked")
"""Attention kinds a plan may be asked about: full causal, sliding window, chunked-local."""

KERNEL_KINDS = ("full", "window", "chunked")
"""The kinds the attention kernels implement (a window or a chunk is one more int32 operand; the
chunked-local Triton build is not compiled by the GPU gate yet: rows ``chunked_pallas``, ``auto_chunked``)."""

KV_CLASSES = ("plain", "int8", "fp8")
"""The pages' dtype as the plan sees it: float pages (the model's dtype), int8, float8_e4m3fn."""

# The batch-invariant reference steps over this many keys (pallas_kernels/invariant.py's
# KEY_TILE; restated, not imported, to keep this module free of the kernels' JAX code).
INVARIANT_KEY_TILE = 128
MATMUL_MIN_DIM = 16  # Triton's smallest dot: the Pallas layer_matmul takes K, N multiples of it


# ``paged_kv.inputs.is_int`` is the same check for the core and the engine: this package imports
# nothing from the rest of the repository (models import it from here, through ``validate``), so
# each side keeps one definition (tests/test_module_layout.py checks they agree).
def is_int(v: Any) -> bool:
  """A Python or NumPy integer scalar; bools (Python or NumPy) are not ints here."""
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def check_impl(impl: Any) -> str:
  """``impl`` when it is one of :data:`IMPLS`, else ``ValueError`` naming it and them."""
  if not isinstance(impl, str) or impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  return impl


# The GPU targets (the compute capability Triton lowers for) live here rather than in ``quant``
# (which refuses float8_e4m3fn below sm_89 through this module's table), so that the plan sits
# below every kernel module and imports none of them. FP8_MIN_CAPABILITY: the lowest compute
# capability whose Triton converts float8_e4m3fn (sm_89, Ada; Hopper is 9.0).
FP8_MIN_CAPABILITY = (8, 9)


def parse_target(target: Any) -> tuple[int, int] | None:
  """A GPU target as ``(major, minor)`` compute capability: ``"sm_90a"``, ``"sm_80"``, ``"9.0"``,
  ``(8, 0)`` or a ``jax.Device`` with a ``compute_capability``; None for a CPU (or any target
  without one: nothing is compiled by Triton there).

  Raises:
    ValueError: for a string that is none of these forms.
  """
  if target is None:
    return None
  if isinstance(target, tuple) and len(target) == 2:
    return int(target[0]), int(target[1])
  cc = getattr(target, "compute_capability", None)
  if cc is not None:
    target = str(cc)
  elif not isinstance(target, str):
    return None
  text = target.strip().lower()
  if text in ("cpu", "tpu", ""):
    return None
  m = re.fullmatch(r"sm_(\d+)(\d)a?", text) or re.fullmatch(r"(\d+)\.(\d+)", text)
  if not m:
    raise ValueError(f"target {target!r} is neither 'sm_XY[a]', 'X.Y', a (major, minor) pair nor a device")
  return int(m.group(1)), int(m.group(2))


# Compute capability of the NVIDIA parts a lowering may name by device kind (an abstract mesh, as
# the deviceless GPU gate and the tests use): the first matching substring wins.
_KIND_CAPABILITY = (("GH200", (9, 0)), ("H100", (9, 0)), ("H200", (9, 0)), ("H800", (9, 0)),
                    ("B200", (10, 0)), ("L40", (8, 9)), ("L4", (8, 9)), ("RTX 40", (8, 9)),
                    ("A100", (8, 0)), ("A800", (8, 0)), ("A30", (8, 0)), ("A10", (8, 6)), ("A40", (8, 6)))


def abstract_device_kind() -> str | None:
  """The GPU device kind an enclosing abstract mesh names (``jax_compat.cuda_lowering``), else None."""
  try:
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  except AttributeError:  # a JAX without abstract meshes
    return None
  if device is None or getattr(device, "platform", None) != "gpu":
    return None
  return getattr(device, "device_kind", None)


def default_target() -> tuple[int, int] | None:
  """The compute capability the Pallas kernels are lowered for here: the GPU an enclosing abstract
  mesh names (a deviceless lowering; None for a device kind not in the table), else JAX's first
  device when the default backend is a GPU, else None (a CPU: nothing is compiled by Triton)."""
  kind = abstract_device_kind()
  if kind is not None:
    return next((cc for name, cc in _KIND_CAPABILITY if name in kind), None)
  if jax.default_backend() != "gpu":
    return None
  return parse_target(jax.devices()[0])


@dataclasses.dataclass(frozen=True)
class Switches:
  """The checked inputs of a plan (hashable). ``target``: :func:`resolve_target`'s "cpu", "none",
  "gpu" (a GPU of unknown compute capability) or "sm_XY"; ``gpu_backend``: JAX's default backend
  is a GPU (what ``impl="auto"`` reads; a deviceless lowering for CUDA names a GPU target on a CPU
  backend)."""

  impl: str
  target: str
  gpu_backend: bool | None  # None: not known yet (JAX's backend not started: check_early)
  batch_invariant: bool
  kv: str
  kinds: tuple[str, ...]
  tp: int | None
  head_dim: int | None
  block_size: int | None

  @property
  def pallas_head_dim(self) -> bool:
    """The Triton kernels can take this head_dim (a power of two >= 16; unknown counts as yes)."""
    d = self.head_dim
    return d is None or (d >= 16 and d & (d - 1) == 0)

  @property
  def runs_pallas(self) -> bool:
    """Whether the kernels compile through Triton for ``target`` (not interpret mode)."""
    return self.impl == "pallas" or (self.impl == "auto" and self.gpu_backend is True and self.pallas_head_dim
                                      and "chunked" not in self.kinds)

  @property
  def runs_reference(self) -> bool:
    """The XLA reference runs (False for "auto" while the backend is not known)."""
    return self.impl == "reference" or (
        self.impl == "auto" and self.gpu_backend is not None and not self.runs_pallas)

  @property
  def capability(self) -> tuple[int, int] | None:
    return parse_target(self.target) if self.target.startswith("sm_") else None


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
  """What runs (hashable: a static argument of ``jit``).

  Attributes:
    impl: the kernels' implementation: "pallas", "interpret" or "reference" (never "auto").
    attention: "paged" (the paged decode / prefill kernels or their references) or "invariant"
      (the fixed-tile batch-invariant kernel, or the reference's fixed-order formulation).
    layers: "scan" (one scan over stacked layer weights) or "unrolled" (per-layer weights).
    projections: "layer_matmul" (the Pallas kernel reads each layer of the stacked weights in
      place) or "xla" (XLA matmuls: the scan's slices, or GSPMD-partitioned ones over a mesh).
    switches: the checked inputs. row: the name of the :data:`ROWS` row that decided.
  """

  impl: str
  attention: str
  layers: str
  projections: str
  switches: Switches
  row: str

  @property
  def batch_invariant(self) -> bool:
    return self.switches.batch_invariant

  @property
  def pallas(self) -> bool:
    """The Pallas kernels run (compiled, or interpreted)."""
    return self.impl != "reference"

  def matmul_impl(self, k: int, n: int) -> str:
    """The implementation of one ``[K, N]`` projection weight under ``layer_matmul``: the plan's
    impl, or "reference" where K or N is not a multiple of 16 (Triton's smallest dot; such a
    weight's layer slice is copied on a GPU, as any scan's is)."""
    if self.impl == "reference" or (k % MATMUL_MIN_DIM == 0 and n % MATMUL_MIN_DIM == 0 and k > 0 and n > 0):
      return self.impl
    return "reference"


@dataclasses.dataclass(frozen=True)
class Row:
  """One row of the table: conditions (``when``: column -> the values it matches, as shown in
  the docs) with their predicate, and either what runs or why the combination is refused."""

  name: str
  when: dict[str, str]
  holds: Callable[[Switches], bool]
  impl: str | None = None  # None: the requested impl ("pallas" / "interpret"), unchanged
  attention: str | None = None  # None: "invariant" with batch_invariant, else "paged"
  layers: str = "scan"
  projections: str = "xla"
  refuse: Callable[[Switches], str] | None = None
  note: str = ""


def _kv_name(s: Switches) -> str:
  return {"int8": "int8", "fp8": "float8_e4m3fn"}.get(s.kv, "float")


def _fp8_below_89(s: Switches) -> bool:
  cc = s.capability
  return s.kv == "fp8" and s.runs_pallas and cc is not None and cc < FP8_MIN_CAPABILITY


_COLUMNS = ("impl", "target", "batch_invariant", "kv_dtype", "kinds", "tp", "head_dim / block_size")
_SHAPE = "head_dim / block_size"
_PALLAS = "pallas, interpret, auto (GPU backend)"

ROWS: tuple[Row, ...] = (
    Row("pallas_on_cpu", dict(impl="pallas", target="cpu (named)"),
        lambda s: s.impl == "pallas" and s.target == "cpu",
        refuse=lambda s: "impl='pallas' on target 'cpu': the Pallas kernels compile through Triton for a GPU; "
                         "supported there: impl 'auto', 'reference' or 'interpret'",
        note="Triton compiles for a GPU; auto, reference or interpret run there"),
    Row("chunked_pallas", dict(impl="pallas", kinds="has chunked"),
        lambda s: s.impl == "pallas" and "chunked" in s.kinds,
        refuse=lambda s: f"impl='pallas' with attention kinds {s.kinds}: the chunked-local kernels run in "
                         "interpret mode and on the reference, and the GPU gate does not compile them yet; "
                         "supported: impl 'auto' (the reference on a GPU), 'reference' or 'interpret'",
        note="the chunked-local Triton build is not compiled by the GPU gate yet"),
    Row("pallas_head_dim", {"impl": "pallas, interpret", _SHAPE: "head_dim not a power of two >= 16"},
        lambda s: s.impl in ("pallas", "interpret") and not s.pallas_head_dim,
        refuse=lambda s: f"head_dim={s.head_dim}: the Pallas (Triton) kernels need a power-of-two head_dim >= 16; "
                         "use impl='reference'",
        note="the Triton dots need a power-of-two head_dim >= 16; the reference takes any"),
    Row("invariant_quant", dict(batch_invariant="True", kv_dtype="int8, fp8"),
        lambda s: s.batch_invariant and s.kv != "plain",
        refuse=lambda s: f"batch_invariant=True does not support quantized KV pages (kv dtype {_kv_name(s)}); "
                         "use plain pages (kv_dtype 'auto') or batch_invariant=False",
        note="the fixed-tile kernels have no scale operands; plain pages"),
    Row("fp8_target", dict(impl="pallas, auto (GPU backend)", target="below sm_89", kv_dtype="fp8"), _fp8_below_89,
        refuse=lambda s: f"KV dtype float8_e4m3fn needs compute capability >= 8.9 (sm_89 / sm_90), "
                         f"target is {s.target}; use int8",
        note="Triton converts e4m3 only from sm_89 (Ada, Hopper) on; int8 runs"),
    Row("invariant_reference_block", {"impl": "reference, auto (-> reference)", "batch_invariant": "True",
                                      _SHAPE: f"block_size not dividing {INVARIANT_KEY_TILE}"},
        lambda s: s.batch_invariant and s.runs_reference and s.block_size is not None
        and INVARIANT_KEY_TILE % s.block_size != 0,
        refuse=lambda s: f"batch_invariant=True on the reference kernels (impl={s.impl!r}) needs a block size "
                         f"dividing {INVARIANT_KEY_TILE} (the invariant key tile), got block_size={s.block_size}; "
                         f"supported: block sizes 1..{INVARIANT_KEY_TILE} (powers of two), or a Pallas impl",
        note=f"the invariant reference steps over {INVARIANT_KEY_TILE} keys in whole blocks"),
    Row("auto_head_dim", {"impl": "auto", "target": "GPU backend", _SHAPE: "head_dim not a power of two >= 16"},
        lambda s: s.impl == "auto" and s.gpu_backend is True and not s.pallas_head_dim, impl="reference",
        note="formerly a silent fallback: the Triton kernels need a power-of-two head_dim >= 16"),
    Row("auto_chunked", {"impl": "auto", "target": "GPU backend", "kinds": "has chunked"},
        lambda s: s.impl == "auto" and s.gpu_backend is True and "chunked" in s.kinds, impl="reference",
        note="the chunked-local Triton build is not compiled by the GPU gate yet"),
    Row("reference", dict(impl="reference, auto (CPU backend)"), lambda s: s.runs_reference, impl="reference",
        note="the XLA reference; XLA's matmuls on the scan's weight slices"),
    Row("pallas_mesh", dict(impl=_PALLAS, tp="a mesh (any degree)"), lambda s: s.tp is not None,
        layers="unrolled", projections="xla",
        note="per-layer weights; XLA matmuls, which GSPMD partitions over the mesh"),
    Row("pallas", dict(impl=_PALLAS, tp="none (one device)"), lambda s: True, projections="layer_matmul",
        note=f"a weight with K or N not a multiple of {MATMUL_MIN_DIM}: the XLA reference for that weight "
             "(`ExecutionPlan.matmul_impl`)"),
)
"""The table, first matching row first (docs/design.md prints it: :func:`table_markdown`)."""


def resolve_target(target: Any = "auto", backend: bool = True) -> str:
  """``target`` as the plan names it: "cpu" (named: the caller runs on a CPU), "gpu", "sm_XY" or
  "none". "auto": the GPU an enclosing abstract mesh names (a deviceless lowering,
  ``jax_compat.cuda_lowering``) or JAX's GPU, else "none" (no GPU named: whatever lowers the
  program decides, so ``impl="pallas"`` is left to the lowering, as a CUDA export from a CPU
  process needs). A GPU whose compute capability is unknown is "gpu". ``backend=False``: only an
  abstract mesh is read (JAX's backend is not started; :func:`check_early`)."""
  if isinstance(target, str) and target in ("cpu", "gpu", "none"):
    return target
  if isinstance(target, str) and target == "auto" and not backend:
    kind = abstract_device_kind()
    cc = None if kind is None else default_target()
    if cc is None:
      return "gpu" if kind else "none"
  elif isinstance(target, str) and target == "auto":
    cc = default_target()
    if cc is None:
      return "gpu" if jax.default_backend() == "gpu" or abstract_device_kind() else "none"
  else:
    cc = parse_target(target)
    if cc is None:
      return "cpu"
  return f"sm_{cc[0]}{cc[1]}"


def kv_class(kv_dtype: Any) -> str:
  """"plain" (None, "auto" or a float dtype), "int8" or "fp8" ("fp8" or float8_e4m3fn)."""
  if kv_dtype is None or (isinstance(kv_dtype, str) and kv_dtype in ("auto", "plain")):
    return "plain"
  if isinstance(kv_dtype, str) and kv_dtype in ("int8", "fp8"):
    return kv_dtype
  try:
    dt = jnp.dtype(kv_dtype)
  except TypeError as e:
    raise ValueError(f"kv_dtype={kv_dtype!r} must be 'auto', 'int8', 'fp8' or a dtype") from e
  if dt == jnp.dtype(jnp.int8):
    return "int8"
  if dt == jnp.dtype(jnp.float8_e4m3fn):
    return "fp8"
  if jnp.issubdtype(dt, jnp.floating):
    return "plain"
  raise ValueError(f"kv_dtype={kv_dtype!r} must be a float dtype (plain pages), int8 or float8_e4m3fn")


def switches(impl: str = "auto", *, target: Any = "auto", batch_invariant: bool = False, kv_dtype: Any = None,
             kinds: tuple[str, ...] = ("full",), tp: int | None = None, head_dim: int | None = None,
             block_size: int | None = None, backend: bool = True) -> Switches:
  """The checked :class:`Switches` (``ValueError`` naming a bad value and what is accepted).
  ``backend=False``: JAX's backend is not consulted (nor started): ``gpu_backend`` is None."""
  check_impl(impl)
  if not isinstance(batch_invariant, bool):
    raise ValueError(f"batch_invariant={batch_invariant!r} must be a bool")
  kinds = tuple(kinds)
  if not kinds or any(k not in KINDS for k in kinds):
    raise ValueError(f"attention kinds {kinds!r} must be a non-empty tuple of {KINDS}")
  if tp is not None and (not is_int(tp) or tp < 1):
    raise ValueError(f"tp={tp!r} must be None (no mesh) or an int >= 1 (a mesh of that degree)")
  for name, v in (("head_dim", head_dim), ("block_size", block_size)):
    if v is not None and (not is_int(v) or v < 1):
      raise ValueError(f"{name}={v!r} must be None or an int >= 1")
  return Switches(impl=impl, target=resolve_target(target, backend),
                  gpu_backend=(jax.default_backend() == "gpu") if backend else None,
                  batch_invariant=batch_invariant, kv=kv_class(kv_dtype),
                  kinds=tuple(sorted(set(kinds), key=KINDS.index)), tp=None if tp is None else int(tp),
                  head_dim=None if head_dim is None else int(head_dim),
                  block_size=None if block_size is None else int(block_size))


def decide(s: Switches) -> tuple[Row, str | None]:
  """``(row, refusal message or None)`` for checked switches: the first row that holds."""
  for row in ROWS:
    if row.holds(s):
      return row, None if row.refuse is None else row.refuse(s)
  raise AssertionError("the table's last row holds for every combination")  # pragma: no cover


def refusal(impl: str = "auto", **kw: Any) -> tuple[str, str] | None:
  """``(row name, message)`` when the table refuses the combination, else None; the arguments are
  :func:`make_plan`'s. For callers that word the refusal in their own terms (the command line)."""
  row, why = decide(switches(impl, **kw))
  return None if why is None else (row.name, why)


def check_early(impl: str = "auto", **kw: Any) -> None:
  """The refusals that need no JAX backend (``ValueError``), for checks that run before JAX starts
  (``ServingConfig``, which the command line builds before it creates its devices): the rows that
  read the backend (what "auto" resolves to, JAX's GPU) do not hold here; :func:`make_plan`, later,
  checks them. Arguments: :func:`make_plan`'s."""
  row, why = decide(switches(impl, backend=False, **kw))
  if why is not None:
    raise ValueError(why)


def make_plan(impl: str = "auto", *, target: Any = "auto", batch_invariant: bool = False, kv_dtype: Any = None,
              kinds: tuple[str, ...] = ("full",), tp: int | None = None, head_dim: int | None = None,
              block_size: int | None = None) -> ExecutionPlan:
  """What runs for this combination (module docstring), or a one-line ``ValueError`` naming the
  combination and what is supported.

  Args:
    impl: "auto" | "pallas" | "interpret" | "reference".
    target: "auto" (:func:`resolve_target`), "cpu", "gpu", or a GPU as "sm_XY" / (major, minor).
    batch_invariant: the fixed-order, batch-independent kernels.
    kv_dtype: the pages' dtype: None / "auto" / a float dtype (plain pages), "int8" or int8,
      "fp8" or float8_e4m3fn.
    kinds: the attention kinds of the model's layers (:data:`KINDS`), an opaque static tuple.
    tp: None (one device, no mesh), or the degree of the tensor-parallel mesh the model is placed
      on (1 included: a mesh of one device still runs the mesh's layout).
    head_dim, block_size: where known (None: not checked).
  """
  s = switches(impl, target=target, batch_invariant=batch_invariant, kv_dtype=kv_dtype, kinds=kinds, tp=tp,
               head_dim=head_dim, block_size=block_size)
  row, why = decide(s)
  if why is not None:
    raise ValueError(why)
  attention = row.attention or ("invariant" if s.batch_invariant else "paged")
  resolved = row.impl or ("pallas" if impl == "auto" else impl)
  return ExecutionPlan(impl=resolved, attention=attention, layers=row.layers, projections=row.projections,
                       switches=s, row=row.name)


def resolve_impl(impl: str, head_dim: int | None = None) -> str:
  """The implementation ``impl`` runs here (``make_plan(impl, head_dim=...).impl``, without the
  refusals that need the other switches): "auto" is "pallas" on a GPU backend for a head_dim the
  Triton kernels take, else "reference" (both table rows)."""
  s = switches(impl, head_dim=head_dim)
  for row in ROWS:
    if row.refuse is None and row.holds(s):
      return row.impl or ("pallas" if impl == "auto" else impl)
  raise AssertionError("unreachable")  # pragma: no cover


def table_markdown() -> str:
  """:data:`ROWS` as a Markdown table (docs/design.md, between the ``execution_plan`` markers)."""
  head = ["row", *_COLUMNS, "runs impl", "attention", "layers", "projections", "why"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for row in ROWS:
    cells = [f"`{row.name}`", *(row.when.get(c, "any") for c in _COLUMNS)]
    if row.refuse is not None:
      runs = ["**refused**", "", "", ""]
    else:
      runs = [row.impl or "as requested (auto: pallas)", row.attention or "paged; invariant with batch_invariant",
              row.layers, row.projections]
    lines.append("| " + " | ".join([*cells, *runs, row.note]) + " |")
  return "\n".join(lines)
