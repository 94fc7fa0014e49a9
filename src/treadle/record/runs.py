"""A run folder belongs to one run.

``claim_run_folder`` is what ``Trainer.train`` runs before anything else (and ``treadle train`` before it
loads a model), on the main process:

- ``output_dir`` must be a folder (or not exist yet) that this user can write, and not the folder of the model
  being trained, nor inside it (the final save would overwrite the weights the run started from);
- a *new* run (no resume) into a folder that holds a run's files (``run_files``: checkpoints, metrics.jsonl, a
  saved model, plots ...) is refused, naming the two ways out: resume it, or ``overwrite_output_dir=True``,
  which deletes only what a treadle run provably wrote (listed when it does): checkpoint folders whose marker
  (``fingerprints.MARKER``) lists every file they hold, and the run-named files of a folder whose manifest
  (``.treadle-run.json``, written when a run claims the folder) says a run owns it, less what was there before
  the run ("not ours, kept"). An entry that cannot be told (no manifest, no marker, a foreign file inside a
  checkpoint, a symbolic link) refuses the overwrite, naming it: nothing is deleted when in doubt;
- a lock, ``output_dir/.treadle.lock``, is held for the run's lifetime, so that a second run into the same folder is
  refused while the first one lives, naming it (pid, host, start time: the holder writes them into the file). It is
  the operating system's file lock (``filelock``: ``flock``), which a process that ends, however it ends (SIGKILL,
  out of memory), gives back: no liveness guess, no stale lock to take over. A lock file left by a process that
  did not end cleanly is reused, with a note naming that run;
- under torchrun with ``--max-restarts``, the workers of a restarted attempt are the same run: the manifest records
  the job (``TORCHELASTIC_RUN_ID``) and its attempt (``TORCHELASTIC_RESTART_COUNT``), and an attempt restarts in the
  folder an earlier attempt of its job wrote, without ``overwrite_output_dir`` (torchrun stopped every worker of the
  earlier attempt, so its lock is free).

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

from filelock import FileLock, Timeout

from treadle.errors import PreflightError, shorten
from treadle.record import fingerprints, runfiles
from treadle.record.disk import disk_errors
from treadle.record.plots import FIGURE_TITLES

LOCK_FILE = ".treadle.lock"
MANIFEST_FILE = ".treadle-run.json"  # written when a run claims the folder: see write_manifest
MANIFEST_MOST = 10_000  # entries recorded as "there before the run"; a fuller folder is never overwritten in part
PLOT_FILES = frozenset(f"{name}.png" for name in FIGURE_TITLES)
# what a treadle run writes into its output_dir (a transformers model's save_pretrained files included)
RUN_FILE_NAMES = frozenset(
    {
        "metrics.jsonl",
        "completions.jsonl",
        "plots",
        "report.html",
        "runs",
        "run.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "config.json",
        "generation_config.json",
        "adapter_model.safetensors",
        "adapter_config.json",
        "training_args.json",
        "trainer_state.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "tokenizer.model",
    }
)
RUN_FILE_PATTERN = re.compile(r"(\.tmp-|\.old-)?checkpoint-\d+|model-\d+-of-\d+\.safetensors")


class RunFolderError(PreflightError):
    """``output_dir`` cannot take this run (it holds another, is locked, is a file ...); nothing was written."""


def run_files(output_dir: str) -> list[str]:
    """The names in ``output_dir`` that a run wrote (checkpoints first, by step), [] when it does not exist."""
    if not os.path.isdir(output_dir):
        return []
    names = [n for n in os.listdir(output_dir) if _run_named(n)]
    metrics = os.path.join(output_dir, "metrics.jsonl")
    if "metrics.jsonl" in names and runfiles.not_regular(metrics) is None and not _has_training_records(metrics):
        names.remove("metrics.jsonl")  # only evaluate() before training logged there: no run yet
    return sorted(
        names,
        key=lambda n: (
            not n.startswith("checkpoint-"),
            int(n.rpartition("-")[2]) if n.startswith("checkpoint-") else 0,
            n,
        ),
    )


def _run_named(name: str) -> bool:
    return name in RUN_FILE_NAMES or bool(RUN_FILE_PATTERN.fullmatch(name))


def _has_training_records(path: str) -> bool:
    """Whether a metrics.jsonl logged any training (a step after 0, a loss), not only evaluations before it. (A
    regular file, ``check_files_regular``; its lines read at most ``runfiles.LINE_MOST`` characters at a time.)"""
    with open(path, errors="replace") as f:
        for line in iter(lambda: f.readline(runfiles.LINE_MOST), ""):
            try:
                record = json.loads(line)
            except ValueError:
                return True  # a line cut by a crash: a run was writing here
            if not isinstance(record, dict) or record.get("step", 0) or "loss" in record or "train_loss" in record:
                return True
    return False


def check_run_folder(
    output_dir: str, *, resume: bool, overwrite: bool = False, model_dir: str | None = None, auto: bool = False
) -> list[str]:
    """Refuse (RunFolderError) an ``output_dir`` that cannot take this run; return what ``overwrite`` will
    delete (paths relative to ``output_dir``: only what a treadle run provably wrote, see ``sort_out``).
    ``auto``: ``resume_from_checkpoint="auto"`` found no complete checkpoint, so the run starts afresh and
    replaces what an attempt that saved none left (a run that saved its model is refused, as ever).
    Reads only: nothing is written or removed here."""
    output_dir = check_path(output_dir)
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise RunFolderError(
            f"output_dir {output_dir} is a file, not a folder; set output_dir to a folder "
            f"(new, or holding the run to resume)"
        )
    check_not_in_model(output_dir, model_dir)
    check_creatable(output_dir)
    check_writable(output_dir)
    check_files_regular(output_dir)
    holder = lock_holder(output_dir)
    if holder is not None:
        raise _in_use(output_dir, holder)
    files = run_files(output_dir)
    if resume or not files or _earlier_attempt(read_manifest(output_dir)):  # the last: a restarted elastic worker
        return []
    ours, _, doubts = sort_out(output_dir, files)
    if doubts:
        raise RunFolderError(
            f"output_dir {output_dir} holds {len(doubts)} entries named like a run's that no treadle run provably "
            f"wrote ({listing(doubts, 3)}); the run would overwrite or mix with them, so nothing was "
            f"{'deleted' if overwrite else 'written'}: move them out of output_dir or choose another output_dir"
        )
    if auto and not overwrite and not _saved_model(files):
        return ours  # an attempt that crashed before its first checkpoint: nothing to resume, start it again
    if not overwrite:
        raise RunFolderError(f"output_dir {output_dir} holds an earlier run ({listing(files)}); {_ways_on(files)}")
    return ours


SAVED_MODEL_NAMES = frozenset({"model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors"})


def _saved_model(files: list[str]) -> bool:
    """Whether a run's ``files`` hold a saved model (its weights, or their shards)."""
    return any(name in SAVED_MODEL_NAMES or name.startswith("model-") for name in files)


def _ways_on(files: list[str]) -> str:
    """What a new run into a folder holding the run ``files`` can do: resume it only when it has a checkpoint."""
    others = (
        f"choose another output_dir, or set overwrite_output_dir: true to delete those {len(files)} entries "
        f"(nothing else in the folder is touched)"
    )
    if any(name.startswith("checkpoint-") for name in files):
        return f"continue it with --resume (train(resume_from_checkpoint=True)), {others}"
    if _saved_model(files):
        return f"it saved its model and no checkpoint, so it cannot be continued: {others}"
    return (
        f"it saved no checkpoint (it stopped before its first), so there is nothing to resume: start it again with "
        f"--resume auto (train(resume_from_checkpoint='auto')), which replaces those {len(files)} entries, or "
        f"{others}"
    )


def check_path(path: str) -> str:
    """``path`` with ``~`` and environment variables expanded; the filesystem root and the home folder itself
    are refused (a run's files would mix with everything there, and overwrite could reach them)."""
    expanded = os.path.expandvars(os.path.expanduser(str(path)))
    real = os.path.realpath(expanded)
    if real in (os.path.realpath(os.sep), os.path.realpath(os.path.expanduser("~"))):
        raise RunFolderError(
            f"output_dir {shorten(path)} is {'the filesystem root' if real == os.sep else 'your home folder'}"
            f" itself; set output_dir to a folder of its own (e.g. {os.path.join(expanded, 'runs', 'my-run')})"
        )
    return expanded


# ---------------------------------------------------------------------------------------------------------
# What a run provably wrote: the manifest written at claim time, checkpoints' markers
# ---------------------------------------------------------------------------------------------------------
def elastic_attempt() -> tuple[str | None, int]:
    """(the torchrun job's id, this attempt's number: 0, then 1 per restart); (None, 0) outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or None
    try:
        return run_id, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return run_id, 0


def _earlier_attempt(record: dict | None) -> bool:
    """Whether a lock or manifest ``record`` was written by an earlier attempt of this process's torchrun job."""
    run_id, attempt = elastic_attempt()
    written = (record or {}).get("attempt")
    return (
        run_id is not None
        and (record or {}).get("elastic_run") == run_id
        and isinstance(written, int)
        and written < attempt
    )


def _identity() -> dict:
    run_id, attempt = elastic_attempt()
    return {"elastic_run": run_id, "attempt": attempt} if run_id is not None else {}


def write_manifest(output_dir: str) -> None:
    """Write ``output_dir/.treadle-run.json`` when the run claims the folder: it marks the folder as a treadle
    run's and lists what was there before (never the run's), so overwrite can tell the run's files from the user's."""
    path = os.path.join(output_dir, MANIFEST_FILE)
    before = _tree(output_dir, most=MANIFEST_MOST + 1)
    manifest = {
        "treadle_run": 1,
        "started": time.time(),
        "kept": before[:MANIFEST_MOST],
        "kept_complete": len(before) <= MANIFEST_MOST,
        **_identity(),
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f)
    os.replace(tmp, path)


def read_manifest(output_dir: str) -> dict | None:
    return fingerprints.read_record(os.path.join(output_dir, MANIFEST_FILE), "treadle_run")


def _tree(output_dir: str, most: int) -> list[str]:
    """Up to ``most`` paths below ``output_dir`` (relative, ``/``), links listed and never followed."""
    found = []
    for root, dirs, files in os.walk(output_dir):
        rel = os.path.relpath(root, output_dir)
        for name in dirs + files:
            if rel == "." and (name in (LOCK_FILE, MANIFEST_FILE) or _run_named(name)):
                continue  # treadle's own (an evaluation's metrics.jsonl, the run being resumed): not "before"
            found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
            if len(found) >= most:
                return found
    return found


def sort_out(output_dir: str, names: list[str]) -> tuple[list[str], list[str], list[str]]:
    """Split the run-named entries ``names`` of ``output_dir`` into (ours: paths a treadle run provably wrote,
    to delete; kept: paths inside them that are not ours, left alone; doubts: entries that cannot be told,
    each with its reason, which refuse the overwrite)."""
    manifest = read_manifest(output_dir)
    ours, kept, doubts = [], [], []
    for name in names:
        path = os.path.join(output_dir, name)
        if os.path.islink(path):
            doubts.append(
                f"{name} (a symbolic link to {shorten(os.readlink(path), 80)}: treadle never makes one; "
                f"remove the link yourself)"
            )
        elif name.startswith("checkpoint-"):
            foreign = fingerprints.foreign_files(path) if os.path.isdir(path) else None
            if foreign is None:
                doubts.append(f"{name} (no {fingerprints.MARKER}: not a checkpoint treadle wrote)")
            elif foreign:
                doubts.append(f"{name} (holds {listing(foreign, 2)}, which no treadle checkpoint wrote)")
            else:
                ours.append(name)
        elif manifest is None:
            doubts.append(f"{name} (no {MANIFEST_FILE}: no treadle run recorded writing it)")
        else:
            _sort_entry(output_dir, name, manifest, ours, kept, doubts)
    return ours, kept, doubts


def _sort_entry(output_dir: str, name: str, manifest: dict, ours: list, kept: list, doubts: list) -> None:
    """One entry of a folder with a manifest: a file is ours unless it was there before the run; a folder
    (plots/, runs/, a temporary checkpoint) gives up the files that were not, and keeps the others."""
    before = set(manifest.get("kept") or [])
    path = os.path.join(output_dir, name)
    if not os.path.isdir(path):
        ours.append(name)
        return
    if not manifest.get("kept_complete", False):
        doubts.append(f"{name} (the folder held too many files to record what was there before)")
        return
    mine, others = [], []
    for rel in fingerprints.folder_files(path):
        full = f"{name}/{rel}"
        link = os.path.islink(os.path.join(path, rel))
        plot = name != "plots" or rel in PLOT_FILES
        (others if link or full in before or not plot else mine).append(full)
    if others:
        ours.extend(mine)
        kept.extend(others)
    else:
        ours.append(name)


def delete_ours(output_dir: str, paths: list[str]) -> None:
    """Delete ``paths`` (relative to ``output_dir``, from ``sort_out``), never through a symbolic link; a
    folder emptied by it goes too."""
    for rel in paths:
        path = os.path.join(output_dir, rel)
        if os.path.islink(path) or not os.path.isdir(path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        else:
            shutil.rmtree(path)
        parent = os.path.dirname(path)
        with contextlib.suppress(OSError):
            while os.path.abspath(parent) != os.path.abspath(output_dir) and not os.listdir(parent):
                os.rmdir(parent)
                parent = os.path.dirname(parent)


def listing(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def check_not_in_model(output_dir: str, model_dir: str | None, what: str = "output_dir") -> None:
    """Refuse ``output_dir`` equal to the model folder ``model_dir`` or inside it (train's output, merge's)."""
    if not model_dir or not os.path.isdir(model_dir):
        return
    out, model = os.path.realpath(output_dir), os.path.realpath(model_dir)
    if out == model or out.startswith(model + os.sep):
        where = "is" if out == model else "is inside"
        raise RunFolderError(
            f"{what} {output_dir} {where} the model folder {model_dir}: the saves would "
            f"overwrite or mix with the weights it starts from; set {what} to another folder"
        )


KERNEL_FOLDERS = ("/proc", "/sys", "/dev")  # the kernel's own file systems: no folder for a run's files


def check_creatable(output_dir: str, what: str = "output_dir") -> None:
    """Refuse (RunFolderError) an ``output_dir`` in the kernel's file systems (/proc, /sys, /dev) or with a name
    longer than its file system takes (ENAMETOOLONG), before anything is created."""
    real = os.path.realpath(output_dir)
    for kernel in KERNEL_FOLDERS:
        if real == kernel or real.startswith(kernel + os.sep):
            raise RunFolderError(
                f"{what} {shorten(output_dir)} is inside {kernel}, the kernel's own file system, which holds no "
                f"folders of files; set {what} to a folder on a disk (e.g. runs/my-run)"
            )
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        name_most, path_most = os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_most, path_most = 255, 4096
    longest = max(os.path.abspath(output_dir).split(os.sep), key=len)
    if len(os.fsencode(longest)) > name_most or len(os.fsencode(os.path.abspath(output_dir))) > path_most - 64:
        raise RunFolderError(
            f"{what} {shorten(output_dir, 80)} has a name too long for its file system (a name of "
            f"{len(os.fsencode(longest))} bytes, at most {name_most}; a path of at most {path_most - 64} leaves room "
            f"for the run's files): choose a shorter name"
        )


RUN_LOGS = (runfiles.METRICS_FILE, runfiles.COMPLETIONS_FILE, runfiles.ARGS_FILE, runfiles.RUN_FILE)


def check_files_regular(output_dir: str) -> None:
    """Refuse (RunFolderError) a folder whose files that treadle opens (its logs, run.json, the lock, the manifest)
    are not regular files: a FIFO would wait forever, a device (a link to /dev/full) read endlessly."""
    for name in (*RUN_LOGS, LOCK_FILE, MANIFEST_FILE):
        path = os.path.join(output_dir, name)
        kind = runfiles.not_regular(path)
        if kind is not None:
            raise RunFolderError(
                f"output_dir {output_dir}: {name} is {kind}, not a regular file: a run reads and appends it; "
                f"remove it (rm {path}) or choose another output_dir"
            )


def check_writable(output_dir: str) -> None:
    existing = os.path.abspath(output_dir)
    while not os.path.exists(existing):  # the folder is made later: its nearest existing parent must take it
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise RunFolderError(
            f"output_dir {output_dir} cannot be created: {existing} is a file; set output_dir to a folder path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunFolderError(
            f"output_dir {output_dir} is not writable ({existing} refuses writes); choose a "
            f"folder you can write, or change its permissions"
        )


# ---------------------------------------------------------------------------------------------------------
# The lock: the operating system's, through filelock; its file names the holder
# ---------------------------------------------------------------------------------------------------------
def _holder(path: str) -> dict:
    """What the lock file at ``path`` says of the run that holds (or last held) it; {} when nothing readable."""
    try:
        with open(path) as f:
            holder = json.load(f)
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    if not holder:
        return "its lock file names no run"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {started}"


def _in_use(output_dir: str, holder: str) -> RunFolderError:
    """The refusal of a folder whose lock a live run holds (``holder``: its lock file's account of it)."""
    return RunFolderError(
        f"output_dir {output_dir} is in use by another run ({holder}); wait for it to end or choose another output_dir"
    )


def _lock(path: str, on_acquired=None) -> FileLock:
    # timeout: a second, for the instant in which a run that is ending has removed its lock file but not yet let go
    return FileLock(path, timeout=1.0, thread_local=False, on_acquired=on_acquired)


def lock_holder(output_dir: str) -> str | None:
    """Who holds the lock of ``output_dir`` (its lock file's account of the run), None when it is free. Reads only:
    an absent lock file is free, and an existing one is tried without being written."""
    path = os.path.join(output_dir, LOCK_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with _lock(path):
            return None
    except Timeout:
        return _describe(_holder(path))
    except OSError:  # a file system without file locks: acquire_lock says so
        return None


def acquire_lock(output_dir: str) -> FileLock:
    """Take the lock of ``output_dir`` for this process and write who holds it into its file; the held lock. A run
    that holds it already is refused (RunFolderError naming it); a lock file a process left behind without
    releasing it (it did not end cleanly) is reused, with a note."""
    path = os.path.join(output_dir, LOCK_FILE)
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as error:
        raise RunFolderError(
            f"output_dir {shorten(output_dir, 80)} cannot be created ({error.strerror or error}); set output_dir to "
            f"a folder you can create"
        ) from None
    left = _holder(path)
    lock = _lock(path, on_acquired=_write_holder)
    try:
        lock.acquire()
    except Timeout:
        raise _in_use(output_dir, _describe(_holder(path))) from None
    except OSError as error:
        raise RunFolderError(
            f"output_dir {output_dir} cannot be locked ({error.strerror or error}: its file system has no file "
            f"locks); set output_dir to a folder on a local disk"
        ) from None
    if left:
        print(
            f"treadle: taking over the lock {path} of a run that no longer runs ({_describe(left)})", file=sys.stderr
        )
    return lock


def _write_holder(fd: int) -> None:
    """Write this process into the lock file just acquired (``fd``: filelock's descriptor of it)."""
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), **_identity()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


def release_lock(lock: FileLock) -> None:
    """Let go of ``lock`` and remove its file (removed first, while held, so that no run ever finds a lock file of
    a run that ended cleanly; on a read-only disk it stays, and the next run reuses it with a note)."""
    with contextlib.suppress(OSError):
        os.remove(lock.lock_file)
    lock.release()


@contextlib.contextmanager
def claim_run_folder(args, *, resume: bool, main_process: bool, model=None, auto: bool = False):
    """Check ``args.output_dir`` (``check_run_folder``; the model's folder from ``model_folder``), lock it,
    delete what ``args.overwrite_output_dir`` asks (naming it), and hold the lock inside the block, where a full
    or read-only disk is one line (``disk_errors``). The other processes of a multi-process run
    (``main_process=False``) do nothing: rank 0 owns the folder."""
    if not main_process:
        yield
        return
    output_dir = args.output_dir
    doomed = check_run_folder(
        output_dir, resume=resume, overwrite=args.overwrite_output_dir, model_dir=model_folder(model), auto=auto
    )
    lock = acquire_lock(output_dir)
    try:
        with disk_errors(output_dir):
            if doomed:
                _, kept, _ = sort_out(output_dir, run_files(output_dir))
                why = (
                    "overwrite_output_dir"
                    if args.overwrite_output_dir
                    else f"resume auto: no complete checkpoint in {output_dir}, so a fresh start"
                )
                print(
                    f"treadle: {why}: deleting {len(doomed)} entries of the earlier run in "
                    f"{output_dir}: {', '.join(doomed)}" + (f"; not ours, kept: {listing(kept)}" if kept else ""),
                    file=sys.stderr,
                )
                delete_ours(output_dir, doomed)
            if not resume or read_manifest(output_dir) is None:
                write_manifest(output_dir)
            yield
    finally:
        release_lock(lock)


def model_folder(model) -> str | None:
    """The local folder ``model`` was loaded from (transformers' ``name_or_path``), None when unknown."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return name if isinstance(name, str) and name and os.path.isdir(name) else None
