"""A disk that fills up, turns read-only or reaches a file-size limit mid-run: the error that says so in one line.

``disk_errors`` wraps what writes into a run folder (the whole run inside ``runs.claim_run_folder``; the final save in
``treadle train``): an error a full (ENOSPC), over-quota (EDQUOT), read-only (EROFS) or size-limited (EFBIG: ``ulimit
-f``, FAT32's 4 GiB) disk caused -- an OSError's errno, safetensors' ``SafetensorError`` naming ``(os error N)``, or
torch's writer error followed by a failing probe write -- becomes one ``DiskError`` naming the folder, the newest
checkpoint kept and what to do, and the half-written checkpoint or final model (``SCRATCH_PREFIXES``) goes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil

from treadle.errors import UserError, resume_hint

DISK_ERRNOS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EFBIG: "a file grew past the largest the system allows (`ulimit -f`, a quota, or FAT32's 4 GiB)",
}
OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how a Rust library (safetensors' SafetensorError) names the errno
MODEL_SCRATCH = ".tmp-model-"  # the final model's scratch folder in output_dir (checkpoint.export_model)
SCRATCH_PREFIXES = (".tmp-checkpoint-", MODEL_SCRATCH)  # half-written checkpoints and final models


class DiskError(UserError):
    """``output_dir`` stopped taking writes mid-run (full, over quota, read-only, a file-size limit): the run
    stopped; what it saved before is intact."""


@contextlib.contextmanager
def disk_errors(output_dir: str, *, final_save: bool = False):
    """Inside the block, an error caused by a full or read-only disk -- an OSError with its errno, an error naming
    ``(os error N)`` (safetensors'), or any other error (torch's ``inline_container`` RuntimeError) while a probe
    write into ``output_dir`` then fails that way -- becomes one DiskError naming the folder, the newest complete
    checkpoint and what to do. A half-written checkpoint or final model (``SCRATCH_PREFIXES``) is removed to give
    the space back (the run's lock is the operating system's: it is let go of even on a read-only disk).
    ``final_save``: the block is the final save, so the message says the trained weights were not saved."""
    try:
        yield
    except Exception as error:
        problem = disk_problem(output_dir, error)
        if problem is None:
            raise
        for name in os.listdir(output_dir) if os.path.isdir(output_dir) else ():
            if name.startswith(SCRATCH_PREFIXES):
                shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
        raise DiskError(_disk_message(output_dir, problem, final_save)) from error


def _disk_message(output_dir: str, problem: str, final_save: bool) -> str:
    kept = checkpoints(output_dir)
    if "read-only" in problem:
        fix = "make it writable (remount, or copy the folder to a writable disk)"
    elif "ulimit" in problem:
        fix = "raise the limit (ulimit -f unlimited) or move output_dir to a disk that takes large files"
    else:
        fix = "free some space (or move output_dir to another disk)"
    if final_save:
        saved = (
            f"the final model was NOT saved (the folder is as it was before the save); the newest checkpoint, "
            f"{kept[-1]}, holds the weights of its step"
            if kept
            else "the trained weights were NOT saved and no checkpoint holds them (save_strategy saved none); the "
            "folder is as it was before the save"
        )
        return f"output_dir {output_dir}: {problem} at the final save: {saved}; {fix}" + (
            f", then {resume_hint()}" if kept else ", then train again"
        )
    saved = f"its checkpoints saved before are intact (newest: {kept[-1]})" if kept else "no checkpoint was saved"
    return f"output_dir {output_dir}: {problem}, so the run stopped; {saved}; {fix}" + (
        f", then {resume_hint()}" if kept else ", then start again"
    )


def _disk_errno(error: BaseException) -> int | None:
    """The errno of a full or read-only disk that ``error`` carries (an OSError's, or ``(os error N)`` in its
    text), None when it carries none."""
    if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
        return error.errno
    found = OS_ERROR.search(str(error))
    return int(found.group(1)) if found and int(found.group(1)) in DISK_ERRNOS else None


def disk_problem(output_dir: str, error: BaseException) -> str | None:
    """What about the disk caused ``error`` ("the disk is full (No space left on device)" ...), None when it was
    not the disk: the errno of an OSError in its chain, else a probe write of 64 KiB into ``output_dir``."""
    seen = error
    while seen is not None:
        code = _disk_errno(seen)
        if code is not None:
            return f"{DISK_ERRNOS[code]} ({os.strerror(code)})"
        seen = seen.__cause__ or seen.__context__
    probe = os.path.join(output_dir, f".treadle-probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(bytes(1 << 16))
            f.flush()
            os.fsync(f.fileno())
    except OSError as probe_error:
        if probe_error.errno in DISK_ERRNOS:
            return f"{DISK_ERRNOS[probe_error.errno]} ({os.strerror(probe_error.errno)})"
        return None
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    return None


def checkpoints(output_dir: str) -> list[str]:
    """The complete checkpoint folders of ``output_dir`` (``checkpoint-<step>``), by step."""
    names = (
        [n for n in os.listdir(output_dir) if re.fullmatch(r"checkpoint-\d+", n)] if os.path.isdir(output_dir) else []
    )
    return sorted(names, key=lambda n: int(n.rpartition("-")[2]))
