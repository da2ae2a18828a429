"""The module graph the design doc describes (docs/design.md, section 1): imports point down only
(apps -> engine -> core / models -> pallas_kernels), everything installs under the one name
``paged_kv``, importing the library has no side effects, no import cycle between the checkpoint
loaders, and the serving split keeps its public names where they were."""

import ast
import importlib
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


# Each layer (a folder of the repository) and the layers of this repository it may import.
LAYERS = {
    "pallas_kernels": set(),
    "models": {"pallas_kernels"},
    "core": set(),
    "engine": {"core", "models", "pallas_kernels"},
    "apps": {"core", "engine", "models", "pallas_kernels", "checkpoints"},
    "checkpoints": set(),
}


def layer_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT)
    top = rel.parts[0]
    if rel == Path("paged_kv/__main__.py"):  # `python -m paged_kv`: the command line's entry point
        return "apps"
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
    """``IMPLS`` is defined once (pallas_kernels/validate.py; the other layers import it) and
    ``is_int`` once per side of the import rule: paged_kv/inputs.py for the core and the engine,
    pallas_kernels/validate.py for the kernels and models. The two ``is_int`` agree."""
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
    assert defs == {"IMPLS": ["pallas_kernels/validate.py"], "_is_int": [],
                    "is_int": ["paged_kv/inputs.py", "pallas_kernels/validate.py"]}, defs

    import numpy as np

    core = importlib.import_module("paged_kv.inputs").is_int
    kernels = importlib.import_module("paged_kv.pallas_kernels.validate").is_int
    for v in (0, -3, 2**40, np.int8(1), np.uint32(7), np.int64(-1), True, False, np.bool_(True),
              1.0, np.float32(2), "1", None, np.array(1), [1]):
        assert core(v) == kernels(v) == (isinstance(v, (int, np.integer)) and not isinstance(v, bool)), v
