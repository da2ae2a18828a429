"""The module graph the design doc describes (docs/design.md, section 1): imports point down only
(apps -> engine -> core / models -> pallas_kernels), no module imports one that imports it back
(not even from inside a function), the engines see a model only through the protocol (nothing
from ``models/llama.py``), everything installs under the one name ``paged_kv``, importing the
library has no side effects, and the serving, paged-forward and call-setup splits keep their
public names where they were."""

import ast
import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

# A fast check of this area on every supported JAX (CI runs it on the oldest pair too).
pytestmark = pytest.mark.smoke

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def run_time_imports(path: Path) -> set[str]:
    """The modules a file imports when it runs, at any depth (function-level imports included,
    ``if TYPE_CHECKING:`` blocks left out: they never run)."""
    names = set()
    stack = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{a.name}" for a in node.names)
            names.add(node.module)
        stack.extend(ast.iter_child_nodes(node))
    return names


def module_of_file(path: Path) -> str:
    """``paged_kv.x.y`` for a library file (``models/`` and ``pallas_kernels/`` install under
    ``paged_kv``); a package's ``__init__.py`` is the package."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] != "paged_kv":
        parts.insert(0, "paged_kv")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the repository's modules it imports at run time: the core, the engines, the models,
    the kernels and the command line (``paged_kv/apps``). Packages' ``__init__`` modules are left
    out: ``from paged_kv.models import sharding`` loads the package first, but a package only
    gathers names (``paged_kv/__init__.py`` loads them on first use)."""
    files = {}
    for folder in ("paged_kv", "models", "pallas_kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name != "__init__.py":
                files[module_of_file(path)] = path
    return {mod: {name for name in run_time_imports(path) if name in files and name != mod}
            for mod, path in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


# Each layer (a folder of the repository) and the layers of this repository it may import.
# "spec" is the one leaf module `paged_kv/attention_spec.py` (the attention kinds): every layer
# imports it, the kernels too, so that each kind's rule (which keys a query sees, which blocks
# are skipped) is written once; it imports nothing of the repository (test_attention_spec_is_a_leaf).
LAYERS = {
    "spec": set(),
    "pallas_kernels": {"spec"},
    "models": {"pallas_kernels", "spec"},
    "core": {"spec"},
    "engine": {"core", "models", "pallas_kernels", "spec"},
    "apps": {"core", "engine", "models", "pallas_kernels", "checkpoints", "spec"},
    "checkpoints": set(),
}
SPEC_FILE = Path("paged_kv/attention_spec.py")


def layer_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT)
    top = rel.parts[0]
    if rel == Path("paged_kv/__main__.py"):  # `python -m paged_kv`: the command line's entry point
        return "apps"
    if rel == SPEC_FILE:
        return "spec"
    if top == "paged_kv":
        return rel.parts[1] if rel.parts[1] in ("engine", "apps") else "core"
    return top


def layer_of_module(name: str) -> str | None:
    """The layer of an imported module of this repository, None for anything else."""
    parts = name.split(".")
    if parts[0] != "paged_kv":
        return None
    if len(parts) == 1:  # `from paged_kv import x`: x decides (paged_kv/__init__.py imports nothing)
        return None
    if parts[1] == "attention_spec":
        return "spec"
    if parts[1] in ("engine", "apps", "models", "pallas_kernels", "checkpoints"):
        return parts[1]
    return "core"


def test_imports_point_down():
    wrong = []
    for folder in ("paged_kv", "models", "pallas_kernels", "checkpoints"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            mine = layer_of_file(path)
            for name in imported_modules(path):
                theirs = layer_of_module(name)
                if theirs is not None and theirs != mine and theirs not in LAYERS[mine]:
                    wrong.append(f"{path.relative_to(ROOT)} ({mine}) imports {name} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_attention_spec_is_a_leaf():
    """The one module every layer imports imports nothing of the repository (only NumPy and JAX)."""
    names = imported_modules(ROOT / SPEC_FILE)
    assert not [n for n in names if n.split(".")[0] == "paged_kv"], names
    assert {n.split(".")[0] for n in names} <= {"__future__", "dataclasses", "typing", "jax", "numpy"}, names


def test_no_repository_module_under_a_generic_top_level_name():
    """Nothing imports the folders by their repository names (``models``, ``pallas_kernels``):
    installed, they exist only as ``paged_kv.models`` and ``paged_kv.pallas_kernels``."""
    wrong = []
    for folder in ("paged_kv", "models", "pallas_kernels", "scripts", "tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name in imported_modules(path):
                if name.split(".")[0] in ("models", "pallas_kernels", "checkpoints"):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_installs_only_under_paged_kv():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = setuptools["packages"]
    assert all(p == "paged_kv" or p.startswith("paged_kv.") for p in packages), packages
    assert "examples" not in str(packages)
    # every package folder of the repository is installed (a new subpackage must be listed)
    dirs = {p: ROOT / p.replace(".", "/") for p in packages}
    dirs.update({p: ROOT / d for p, d in setuptools["package-dir"].items()})
    for folder in ("paged_kv", "models", "pallas_kernels"):
        for init in (ROOT / folder).rglob("__init__.py"):
            assert init.parent in dirs.values(), f"{init.parent.relative_to(ROOT)} is not in pyproject's packages"
    assert (ROOT / "checkpoints/tiny-llama/model.safetensors").is_file()


def test_importing_the_library_has_no_side_effects():
    """``import paged_kv`` loads neither JAX nor the command line and leaves the signal handlers
    alone; its names load on first use."""
    code = ("import signal, sys; before = signal.getsignal(signal.SIGINT); import paged_kv; "
            "assert signal.getsignal(signal.SIGINT) is before; "
            "assert not any(m == 'jax' or m.startswith(('jax.', 'paged_kv.apps')) for m in sys.modules), "
            "sorted(m for m in sys.modules if m.startswith(('jax', 'paged_kv'))); "
            "assert paged_kv.ManagerConfig.__module__ == 'paged_kv.config'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "tests")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_checkpoint_format_breaks_the_hf_io_sharding_cycle():
    fmt = imported_modules(ROOT / "models/hf_format.py")
    shard = imported_modules(ROOT / "models/sharding.py")
    assert not {"paged_kv.models.hf_io", "paged_kv.models.sharding"} & fmt
    assert "paged_kv.models.hf_io" not in shard
    assert "paged_kv.models.hf_format" in imported_modules(ROOT / "models/hf_io.py")


def test_serving_names_still_importable_from_serving_and_engine():
    serving = importlib.import_module("paged_kv.engine.serving")
    engine = importlib.import_module("paged_kv.engine")
    for name in ("EngineStats", "Request", "RequestOutput", "RequestStats", "ServingConfig", "ServingEngine",
                 "StepInputs", "StepOutputs", "TableSnapshot", "TokenDelta"):
        assert hasattr(serving, name), name
    for name in ("Request", "RequestOutput", "ServingConfig", "ServingEngine", "TokenDelta"):
        assert getattr(engine, name) is getattr(serving, name)
    hf_io = importlib.import_module("paged_kv.models.hf_io")
    fmt = importlib.import_module("paged_kv.models.hf_format")
    assert hf_io.CheckpointError is fmt.CheckpointError and hf_io.check_checkpoint is fmt.check_checkpoint


def test_one_definition_of_the_shared_checks():
    """``IMPLS`` is defined once (pallas_kernels/plan.py, the execution plan, below every kernel
    module; the other layers import it through pallas_kernels/validate.py) and ``is_int`` once per
    side of the import rule: paged_kv/inputs.py for the core and the engine, pallas_kernels/plan.py
    for the kernels and models. The two ``is_int`` agree."""
    defs = {"IMPLS": [], "is_int": [], "_is_int": []}
    for folder in ("paged_kv", "models", "pallas_kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and node.name in defs:
                    defs[node.name].append(str(path.relative_to(ROOT)))
                elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
                    for target in node.targets:
                        if isinstance(target, ast.Name) and target.id == "IMPLS":
                            defs["IMPLS"].append(str(path.relative_to(ROOT)))
    assert defs == {"IMPLS": ["pallas_kernels/plan.py"], "_is_int": [],
                    "is_int": ["paged_kv/inputs.py", "pallas_kernels/plan.py"]}, defs

    import numpy as np

    core = importlib.import_module("paged_kv.inputs").is_int
    kernels = importlib.import_module("paged_kv.pallas_kernels.validate").is_int
    for v in (0, -3, 2**40, np.int8(1), np.uint32(7), np.int64(-1), True, False, np.bool_(True),
              1.0, np.float32(2), "1", None, np.array(1), [1]):
        assert core(v) == kernels(v) == (isinstance(v, (int, np.integer)) and not isinstance(v, bool)), v


def test_no_import_cycles():
    """No module (core, engine, models, kernels, command line) imports, at module level or inside a
    function, a module that imports it back (a lazy import only hides a cycle). The import walk
    finds planted cycles."""
    graph = import_graph()
    for name in ("paged_kv.models.sharding", "paged_kv.engine.call_setup", "paged_kv.apps.interrupt",
                 "paged_kv.apps.cli", "paged_kv.__main__"):
        assert name in graph, name
    assert import_cycles(graph) == [], import_cycles(graph)
    planted = {k: set(v) for k, v in graph.items()}
    planted["paged_kv.models.llama"].add("paged_kv.models.sharding")  # the cycles this layout removed
    planted["paged_kv.apps.interrupt"].add("paged_kv.apps.options")  # (options -> workload -> interrupt)
    cycles = import_cycles(planted)
    assert ["paged_kv.models.llama", "paged_kv.models.sharding"] in cycles, cycles
    assert ["paged_kv.apps.interrupt", "paged_kv.apps.options", "paged_kv.apps.workload"] in cycles, cycles


def test_engines_see_a_model_only_through_the_protocol():
    """docs/design.md, section 9: nothing under paged_kv/engine imports ``models/llama.py``
    (token checks come from ``models/protocol.py``)."""
    wrong = [f"{path.relative_to(ROOT)} imports {name}"
             for path in sorted((ROOT / "paged_kv/engine").rglob("*.py"))
             for name in run_time_imports(path) if name.startswith("paged_kv.models.llama")]
    assert not wrong, "\n".join(wrong)


def test_sharding_sits_above_the_llama():
    """``sharding`` (placing and loading, which knows the Llama) imports ``llama``; ``llama``
    imports neither ``sharding`` nor the paged forward, only the specs of ``tp_layout``."""
    llama = run_time_imports(ROOT / "models/llama.py")
    assert "paged_kv.models.llama" in run_time_imports(ROOT / "models/sharding.py")
    assert "paged_kv.models.tp_layout" in llama
    for above in ("sharding", "paged", "paged_attention", "layer_layout", "hf_io"):
        assert f"paged_kv.models.{above}" not in llama, above


def test_split_modules_keep_their_public_names():
    """``paged_kv.models.paged`` and ``paged_kv.engine.call_setup`` still export what their users
    import from them, as the objects of the modules that now hold them."""
    paged = importlib.import_module("paged_kv.models.paged")
    models = importlib.import_module("paged_kv.models")
    for name in ("KVGroupLayout", "KVPageSpec", "PagedBatch", "allocate_pages", "compute_slots", "copy_blocks",
                 "kv_bytes_per_block", "kv_bytes_per_token", "kv_bytes_per_token_raw", "kv_group_layout",
                 "layer_windows", "layout_for_impl", "make_paged_batch", "page_spec", "page_spec_for_budget",
                 "paged_decode_step", "paged_forward", "paged_prefill_step", "resolve_kv_dtype"):
        assert name in paged.__all__, name
        if hasattr(models, name):
            assert getattr(models, name) is getattr(paged, name), name
    setup = importlib.import_module("paged_kv.engine.call_setup")
    checks = importlib.import_module("paged_kv.engine.input_checks")
    for name in ("check_call", "check_key", "check_seeds", "group_layout", "kv_cache_groups", "layer_layout",
                 "layout_groups", "pad_prompts", "place", "replicate_inputs", "split_model", "token_ids"):
        assert callable(getattr(setup, name)), name
    assert setup.token_ids is checks.token_ids and setup.pad_prompts is checks.pad_prompts
    sharding = importlib.import_module("paged_kv.models.sharding")
    tp_layout = importlib.import_module("paged_kv.models.tp_layout")
    for name in ("AXIS", "PAGE_SPEC", "SCALE_SPEC", "pages_sharding", "pages_spec", "weight_spec", "weight_specs"):
        assert getattr(sharding, name) is getattr(tp_layout, name), name



def test_kernels_docstring_lists_every_export():
    """The API list of ``paged_kv.pallas_kernels``'s docstring names every name of its ``__all__``,
    and every function or class it names is exported."""
    pk = importlib.import_module("paged_kv.pallas_kernels")
    api = pk.__doc__[pk.__doc__.index("Public API"):pk.__doc__.index("Quantized pages (")]
    missing = [name for name in pk.__all__ if not re.search(rf"[`:]{name}`", api)]
    assert not missing, missing
    referenced = re.findall(r":(?:func|class):`(\w+)`", api)
    assert referenced and set(referenced) <= set(pk.__all__), set(referenced) - set(pk.__all__)
