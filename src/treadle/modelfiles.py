"""A model's files, checked before transformers reads them: a folder in transformers layout, or a GGUF file.

Each check is one line naming the file and the fix (ValueError), where transformers would raise a traceback from deep
inside its reader or say something beside the point. Contracts:

- :func:`check_model_folder` -- a folder with no files at all, with only a GGUF file in it (name the file), with no
  tokenizer files (when none is given), or with a ``.safetensors`` file shorter than its own header says.
- :func:`gguf_source` -- ``(folder or Hub id, GGUF file name or None)``: a file is GGUF by its first four bytes
  (``GGUF``), whatever its name (``x.bin``, ``MODEL.GGUF``); :func:`check_gguf_file` -- its format version, its
  metadata, its architecture and its length (a file cut in its tensor data: an interrupted download).
- :func:`gguf_architectures` -- the ``general.architecture`` values transformers turns into a model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct

__all__ = [
    "GGUF_MAGIC",
    "TOKENIZER_FILES",
    "check_gguf_file",
    "check_model_folder",
    "gguf_architectures",
    "gguf_source",
    "is_gguf_file",
]

GGUF_PACKAGE = "gguf"  # what transformers' GGUF reader imports; treadle's `gguf` extra installs it
GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


# ---------------------------------------------------------------------------------------------------------
# A folder in transformers layout
# ---------------------------------------------------------------------------------------------------------
def check_model_folder(path: str, *, needs_tokenizer: bool = True, gguf_file: str | None = None) -> None:
    """Refuse (ValueError) a model folder that is empty, that holds a GGUF file but no config and none was named
    (``gguf_file``: name the file, not the folder), without tokenizer files (when no tokenizer is given) or with a
    truncated ``.safetensors`` file (shorter than its own header says), before transformers reads it."""
    names = set(os.listdir(path))
    if not names:
        raise ValueError(
            f"model folder {path} is empty: it has no config.json, no weights and no tokenizer; name the folder "
            f"save_pretrained wrote, or a .gguf file"
        )
    gguf_files = sorted(n for n in names if is_gguf_file(os.path.join(path, n)))
    if gguf_files and gguf_file is None and "config.json" not in names:
        raise ValueError(
            f"model folder {path} holds the GGUF file {gguf_files[0]} and no config.json; name the file itself "
            f"(model: {os.path.join(path, gguf_files[0])}), or pass gguf_file={gguf_files[0]!r}"
        )
    if needs_tokenizer and not names & set(TOKENIZER_FILES):
        what = "" if "config.json" in names or names & _weight_files(names) else "no config.json, no weights and "
        raise ValueError(
            f"model folder {path} has {what}no tokenizer files ({' / '.join(TOKENIZER_FILES[:2])}); save the "
            f"tokenizer there too (tokenizer.save_pretrained({path!r}))"
        )
    for name in sorted(n for n in names if n.endswith(".safetensors")):
        problem = _safetensors_problem(os.path.join(path, name))
        if problem:
            raise ValueError(f"{os.path.join(path, name)} is {problem}; copy or save the model again")


def _weight_files(names: set[str]) -> set[str]:
    return {n for n in names if n.endswith(WEIGHT_SUFFIXES)}


def _safetensors_problem(path: str) -> str | None:
    """What is wrong with a .safetensors file's framing (8-byte header length, JSON header, data), or None."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or 8 + length > size:
            return f"truncated ({size} bytes, not even its header)"
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return "not a safetensors file (its header is not JSON)"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    expected = 8 + length + end
    return f"truncated ({size} bytes of the {expected} its header describes)" if expected > size else None


# ---------------------------------------------------------------------------------------------------------
# A GGUF file
# ---------------------------------------------------------------------------------------------------------
def is_gguf_file(path: str) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic bytes (its name does not matter)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:  # a folder, a missing or unreadable file
        return False


def gguf_source(source: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """``(folder or Hub id, GGUF file name or None)`` for a model named by ``source``: a path ending in ``.gguf`` (any
    case) or a file that starts with the GGUF magic bytes is split into its folder and file name; a folder or Hub id
    keeps ``gguf_file`` as given. A local GGUF file is checked before transformers reads it (ValueError, one line
    naming the fix): the ``gguf`` package is installed, the file exists and :func:`check_gguf_file` passes."""
    named = source.lower().endswith(".gguf") or is_gguf_file(source)
    if gguf_file is None and named and not os.path.isdir(source):
        source, gguf_file = os.path.dirname(os.path.abspath(source)), os.path.basename(source)
    if gguf_file is None:
        return source, None
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        raise ValueError(
            f"loading {gguf_file} needs the {GGUF_PACKAGE} package, which transformers reads GGUF files with; "
            f"install it: pip install 'treadle[gguf]'"
        )
    if importlib.util.find_spec("transformers.integrations.gguf") is None:
        import transformers

        raise ValueError(
            f"loading {gguf_file} needs transformers' GGUF reader with GgufConfig(dequantize=True), which "
            f"transformers {transformers.__version__} lacks; upgrade transformers (5.24 is what treadle tests)"
        )
    path = os.path.join(source, gguf_file)
    if (os.path.isdir(source) or os.path.isabs(source)) and not os.path.isfile(path):
        raise ValueError(f"GGUF file {path} not found; name an existing .gguf file (model: path/to/model.gguf)")
    if os.path.isfile(path):
        check_gguf_file(path)
    return source, gguf_file


def check_gguf_file(path: str) -> None:
    """Refuse a file that is not GGUF, is of a newer GGUF format version than the installed readers read, is cut short
    (in its metadata or in its tensor data), or whose architecture transformers cannot turn into a model."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes GGUF); copy it again")
    _check_gguf_version(path, int.from_bytes(head[4:8].ljust(4, b"\0"), "little"))
    from transformers.integrations.gguf import reader

    try:
        blob = reader._mapped(path)
        metadata, tensor_count, table = reader._read_metadata(blob, path)
        tensors, data_start = reader._read_tensor_table(blob, tensor_count, table)
    except (struct.error, ValueError) as error:  # an interrupted download: the reader runs off the end of the file
        raise ValueError(
            f"{path} is not a whole GGUF file, its metadata cannot be read ({str(error).splitlines()[0]}); "
            f"copy it again"
        ) from None
    _check_gguf_length(path, tensors, data_start, metadata.get("general.alignment", 32))
    architecture = metadata.get("general.architecture")
    known = gguf_architectures()
    if architecture not in known:
        raise ValueError(
            f"{path} holds a {architecture!r} model, which transformers' GGUF loader does not know (it knows "
            f"{', '.join(sorted(known)[:12])}, ...); convert it to a transformers folder "
            f"with the tools of the project that wrote it, or upgrade transformers"
        )


def _check_gguf_version(path: str, version: int) -> None:
    """A format version the installed ``gguf`` package reads (it reads the newest it knows and the one before)."""
    import gguf

    newest = gguf.GGUF_VERSION
    if 2 <= version <= newest:
        return
    if version > newest:
        raise ValueError(
            f"{path} is a GGUF file of format version {version}, newer than the installed gguf "
            f"{_version_of('gguf')} reads (versions 2 to {newest}); upgrade gguf and transformers "
            f"(pip install -U gguf transformers), or convert the model with the llama.cpp that gguf reads"
        )
    raise ValueError(
        f"{path} is a GGUF file of format version {version}, older than any reader here takes (2 to {newest}); "
        f"convert the model again with a current llama.cpp"
    )


def _check_gguf_length(path: str, tensors: list[tuple], table_end: int, alignment: int) -> None:
    """A file shorter than its tensor table says (the data section starts at the next ``alignment`` boundary)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    data_start = (table_end + alignment - 1) // alignment * alignment
    end = data_start
    for _name, shape, ggml_type, offset in tensors:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        elements = 1
        for dim in shape:
            elements *= dim
        end = max(end, data_start + offset + elements * size // block)
    actual = os.path.getsize(path)
    if actual < end:
        raise ValueError(
            f"{path} is cut short: {actual} bytes of the {end} its tensor table describes (an interrupted download "
            f"or copy); copy it again"
        )


def _version_of(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(version unknown)"


# llama.cpp's spellings (general.architecture) that transformers' legacy GGUF reader renames to its own before it
# looks them up (``load_gguf_checkpoint``)
GGUF_ARCHITECTURE_RENAMES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "t5encoder": "t5",
}


def gguf_architectures() -> set[str]:
    """The ``general.architecture`` values transformers turns into a model: those its GGUF reader rebuilds a config
    for (``GGUF_CONFIG_ARCHS``: Qwen3.5, LFM2 ...), and those of its legacy reader, in its spelling and llama.cpp's.
    (The legacy list also holds the metadata sections ``general`` and ``tokenizer``, no architectures.)"""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    legacy = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}
    renamed = {name for name, target in GGUF_ARCHITECTURE_RENAMES.items() if target in legacy}
    return set(GGUF_CONFIG_ARCHS) | legacy | renamed
