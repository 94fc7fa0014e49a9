"""A run folder belongs to one run.

``claim_run_folder`` is what ``Trainer.train`` runs before anything else (and ``treadle train`` before it
loads a model), on the main process:

- ``output_dir`` must be a folder (or not exist yet) that this user can write, and not the folder of the model
  being trained, nor inside it (the final save would overwrite the weights the run started from);
- a *new* run (no resume) into a folder that holds a run's files (``run_files``: checkpoints, metrics.jsonl, a
  saved model, plots ...) is refused, naming the two ways out: resume it, or ``overwrite_output_dir=True``,
  which deletes exactly those files (listed when it does) and nothing else;
- a lock file, ``output_dir/.treadle.lock`` (pid, host, start time), is held for the run's lifetime, so that a
  second run into the same folder is refused while the first one lives. A lock left by a process that no
  longer runs on this machine (killed with SIGKILL, out of memory) is taken over, with a note; one held by a
  process on another machine is refused with the file's name, as this machine cannot tell whether it lives.

Every refusal is a :class:`RunFolderError` raised before anything is written. This module imports neither
torch nor a trainer, so the CLI runs it before its slow imports.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sys
import time

from treadle.errors import PreflightError

LOCK_FILE = ".treadle.lock"
# what a treadle run writes into its output_dir (a transformers model's save_pretrained files included)
RUN_FILE_NAMES = frozenset({
    "metrics.jsonl", "completions.jsonl", "plots", "report.html", "runs", "model.safetensors",
    "model.safetensors.index.json", "config.json", "generation_config.json", "adapter_model.safetensors",
    "adapter_config.json", "training_args.json", "trainer_state.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json",
    "tokenizer.model"})
RUN_FILE_PATTERN = re.compile(r"(\.tmp-|\.old-)?checkpoint-\d+|model-\d+-of-\d+\.safetensors")


class RunFolderError(PreflightError):
    """``output_dir`` cannot take this run (it holds another, is locked, is a file ...); nothing was written."""


def run_files(output_dir: str) -> list[str]:
    """The names in ``output_dir`` that a run wrote (checkpoints first, by step), [] when it does not exist."""
    if not os.path.isdir(output_dir):
        return []
    names = [n for n in os.listdir(output_dir) if n in RUN_FILE_NAMES or RUN_FILE_PATTERN.fullmatch(n)]
    if "metrics.jsonl" in names and not _has_training_records(os.path.join(output_dir, "metrics.jsonl")):
        names.remove("metrics.jsonl")  # only evaluate() before training logged there: no run yet
    return sorted(names, key=lambda n: (not n.startswith("checkpoint-"), int(n.rpartition("-")[2])
                                        if n.startswith("checkpoint-") else 0, n))


def _has_training_records(path: str) -> bool:
    """Whether a metrics.jsonl logged any training (a step after 0, a loss), not only evaluations before it."""
    with open(path, errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                return True  # a line cut by a crash: a run was writing here
            if not isinstance(record, dict) or record.get("step", 0) or "loss" in record or "train_loss" in record:
                return True
    return False


def _listing(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_run_folder(output_dir: str, *, resume: bool, overwrite: bool = False,
                     model_dir: str | None = None) -> list[str]:
    """Refuse (RunFolderError) an ``output_dir`` that cannot take this run; return the run files that
    ``overwrite`` will delete. Reads only: nothing is written or removed here."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise RunFolderError(f"output_dir {output_dir} is a file, not a folder; set output_dir to a folder "
                             f"(new, or holding the run to resume)")
    _check_not_in_model(output_dir, model_dir)
    _check_writable(output_dir)
    holder = _live_holder(os.path.join(output_dir, LOCK_FILE))
    if holder is not None:
        raise RunFolderError(f"output_dir {output_dir} is in use by another run ({holder}); wait for it to end or "
                             f"choose another output_dir")
    files = run_files(output_dir)
    if resume or not files:
        return []
    if not overwrite:
        raise RunFolderError(
            f"output_dir {output_dir} holds an earlier run ({_listing(files)}); continue it with --resume "
            f"(train(resume_from_checkpoint=True)), choose another output_dir, or set overwrite_output_dir: true "
            f"to delete those {len(files)} entries (nothing else in the folder is touched)")
    return files


def _check_not_in_model(output_dir: str, model_dir: str | None) -> None:
    if not model_dir or not os.path.isdir(model_dir):
        return
    out, model = os.path.realpath(output_dir), os.path.realpath(model_dir)
    if out == model or out.startswith(model + os.sep):
        where = "is" if out == model else "is inside"
        raise RunFolderError(f"output_dir {output_dir} {where} the model folder {model_dir}: the run's saves would "
                             f"overwrite or mix with the weights it trains from; set output_dir to another folder")


def _check_writable(output_dir: str) -> None:
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):  # the folder is made later: its nearest existing parent must take it
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise RunFolderError(f"output_dir {output_dir} cannot be created: {existing} is a file; set output_dir "
                             f"to a folder path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunFolderError(f"output_dir {output_dir} is not writable ({existing} refuses writes); choose a "
                             f"folder you can write, or change its permissions")


# ---------------------------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------------------------
def _read_lock(path: str) -> dict | None:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # a lock cut short by a crash mid-write: no live owner can be named
        return {}


def _describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {started}"


def _alive(holder: dict) -> bool | None:
    """True / False for a process of this machine (never this very process), None when it cannot be told."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname():
        return None
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def _live_holder(path: str) -> str | None:
    """Who holds the lock at ``path``, when it may be alive; None when it is free or stale."""
    holder = _read_lock(path)
    if not holder:
        return None
    alive = _alive(holder)
    if alive is None:
        return f"{_describe(holder)}, another machine: if that run is gone, delete {path}"
    return _describe(holder) if alive else None


def acquire_lock(output_dir: str) -> str:
    """Create ``output_dir/.treadle.lock`` for this process (taking over a stale one, with a note); its path."""
    path = os.path.join(output_dir, LOCK_FILE)
    os.makedirs(output_dir, exist_ok=True)
    holder = _read_lock(path)
    if holder is not None:
        if _live_holder(path) is not None:
            raise RunFolderError(f"output_dir {output_dir} is in use by another run ({_live_holder(path)}); wait "
                                 f"for it to end or choose another output_dir")
        print(f"treadle: taking over the lock {path} of a run that no longer runs ({_describe(holder)})",
              file=sys.stderr)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:  # another run took it between the check and now
        raise RunFolderError(f"output_dir {output_dir} is in use by another run that just started "
                             f"({_describe(_read_lock(path) or {})}); choose another output_dir") from None
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}, f)
    return path


def release_lock(path: str) -> None:
    """Remove the lock at ``path`` if this process still holds it."""
    holder = _read_lock(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def claim_run_folder(args, *, resume: bool, main_process: bool, model=None):
    """Check ``args.output_dir`` (``check_run_folder``; the model's folder from ``model_folder``), lock it,
    delete what ``args.overwrite_output_dir`` asks (naming it), and hold the lock inside the block. The other
    processes of a multi-process run (``main_process=False``) do nothing: rank 0 owns the folder."""
    if not main_process:
        yield
        return
    output_dir = args.output_dir
    doomed = check_run_folder(output_dir, resume=resume, overwrite=args.overwrite_output_dir,
                              model_dir=model_folder(model))
    lock = acquire_lock(output_dir)
    try:
        if doomed:
            print(f"treadle: overwrite_output_dir: deleting {len(doomed)} entries of the earlier run in {output_dir}: "
                  f"{', '.join(doomed)}", file=sys.stderr)
            for name in doomed:
                path = os.path.join(output_dir, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        yield
    finally:
        release_lock(lock)


def model_folder(model) -> str | None:
    """The local folder ``model`` was loaded from (transformers' ``name_or_path``), None when unknown."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return name if isinstance(name, str) and name and os.path.isdir(name) else None
