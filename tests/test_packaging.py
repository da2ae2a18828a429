"""What `pip install` gets: the wheel carries the built-in checkpoint as package data of
`paged_kv.checkpoints` and installs only the one name `paged_kv` (no top-level `models`,
`examples`, ...); `python -m paged_kv --help` answers without importing JAX."""

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_the_checkpoint_and_one_top_level_name(tmp_path):
    # From a copy of the source (setuptools' build/ folder keeps modules since removed, and the
    # checkout's must stay clean); --no-build-isolation: the environment's setuptools builds it,
    # so this runs offline.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", ".venv*", "venv*", "build", "*.egg-info", "__pycache__", ".ruff_cache",
                                  "results", "paged-kv-out")
    shutil.copytree(ROOT, src, ignore=skip)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(src)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = tmp_path.glob("paged_kv-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "paged_kv/checkpoints/tiny-llama/model.safetensors" in names
    assert "paged_kv/checkpoints/tiny-llama/config.json" in names
    assert "paged_kv/checkpoints/tiny-llama/tokenizer.json" in names
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"paged_kv"}, tops
    for sub in ("models", "pallas_kernels", "engine", "apps"):
        assert any(n.startswith(f"paged_kv/{sub}/") for n in names), sub
    assert not any(n.startswith(("models/", "examples/", "scripts/", "tests/")) for n in names)


def test_help_imports_no_jax():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "paged_kv", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--max-seq-len" in r.stdout, r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "paged_kv.apps.cli" in imported  # the importtime log is there
    heavy = sorted(m for m in imported if re.match(r"(jax|jaxlib|flax|numpy|tqdm|matplotlib)(\.|$)", m))
    assert not heavy, heavy
