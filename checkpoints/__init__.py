"""The built-in checkpoint, ``tiny-llama/`` (a Hugging Face Llama directory trained on a small
story/Q&A corpus by ``scripts/train_tiny_llama.py``), shipped with the package as data.
``BUILTIN`` is its path, wherever the package is installed."""

from pathlib import Path

BUILTIN = Path(__file__).resolve().parent / "tiny-llama"
