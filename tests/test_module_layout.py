"""The module graph the design doc describes: no import cycle between the checkpoint loaders, and
the serving split keeps its public names where they were."""

import ast
import importlib
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


def test_checkpoint_format_breaks_the_hf_io_sharding_cycle():
    fmt = imported_modules(ROOT / "models/hf_format.py")
    shard = imported_modules(ROOT / "models/sharding.py")
    assert not {"models.hf_io", "models.sharding"} & fmt
    assert "models.hf_io" not in shard
    assert "models.hf_format" in imported_modules(ROOT / "models/hf_io.py")


def test_serving_names_still_importable_from_serving_and_engine():
    serving = importlib.import_module("paged_kv.engine.serving")
    engine = importlib.import_module("paged_kv.engine")
    for name in ("EngineStats", "Request", "RequestOutput", "RequestStats", "ServingConfig", "ServingEngine",
                 "StepInputs", "StepOutputs", "TableSnapshot", "TokenDelta"):
        assert hasattr(serving, name), name
    for name in ("Request", "RequestOutput", "ServingConfig", "ServingEngine", "TokenDelta"):
        assert getattr(engine, name) is getattr(serving, name)
    hf_io = importlib.import_module("models.hf_io")
    fmt = importlib.import_module("models.hf_format")
    assert hf_io.CheckpointError is fmt.CheckpointError and hf_io.check_checkpoint is fmt.check_checkpoint
