"""The folders of the commands besides training: ``treadle demo``'s run folder and ``treadle merge``'s --output-dir.

- A demo writes a new folder of its own: ``claim_demo_folder`` refuses one that is a file, cannot be created, holds
  anything (a user's ``results.json``, an earlier demo) or is locked by a demo or run that lives, then locks it for the
  demo's lifetime (a second demo into it is refused before it writes a line), and its messages say that a demo is run
  again, not resumed (``errors.resuming_as``).
- ``check_merge_output``: merge's --output-dir that is a file, or holds a run or a saved model, is refused unless
  ``--overwrite-output-dir`` says to replace it.
"""

from __future__ import annotations

import contextlib
import os

from treadle.errors import resuming_as
from treadle.record.runs import (
    LOCK_FILE,
    RunFolderError,
    acquire_lock,
    check_creatable,
    check_path,
    check_writable,
    listing,
    lock_holder,
    release_lock,
    run_files,
)

DEMO_RESUME_HINT = "a demo is not resumed: run `treadle demo` again, with a new --output-dir"


def check_demo_folder(output_dir: str) -> str:
    """Refuse (RunFolderError) a ``treadle demo`` folder that is a file, cannot be created, is locked by a demo or run
    that lives, or holds anything (a user's results.json, an earlier demo): a demo writes a new folder of its own,
    and neither resumes nor overwrites. Reads only; returns ``output_dir`` expanded."""
    output_dir = check_path(output_dir)
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise RunFolderError(f"--output-dir {output_dir} is a file, not a folder; set --output-dir to a new folder")
    check_creatable(output_dir, what="--output-dir")
    check_writable(output_dir)
    holder = lock_holder(output_dir)
    if holder is not None:
        raise RunFolderError(
            f"--output-dir {output_dir} is in use by another demo or run ({holder}); wait for it to end, or choose "
            f"another --output-dir"
        )
    held = sorted(n for n in os.listdir(output_dir) if n != LOCK_FILE) if os.path.isdir(output_dir) else []
    if held:
        raise RunFolderError(
            f"--output-dir {output_dir} holds {len(held)} entries ({listing(held, 4)}), which the demo would "
            f"overwrite or mix with; a demo writes a new folder: choose a new --output-dir (or empty that one)"
        )
    return output_dir


@contextlib.contextmanager
def claim_demo_folder(output_dir: str):
    """Check the demo's ``output_dir`` (``check_demo_folder``), lock it (a second demo into it is refused before it
    writes anything), check again under the lock, and hold it inside the block; its messages say that a demo is run
    again, not resumed. A folder it made that the demo left empty (it stopped before writing) is removed."""
    output_dir = check_demo_folder(output_dir)
    made = not os.path.exists(output_dir)
    lock = acquire_lock(output_dir)
    try:
        taken = sorted(n for n in os.listdir(output_dir) if n != LOCK_FILE)  # by a demo that ended in that instant
        if taken:
            raise RunFolderError(f"--output-dir {output_dir} was taken by another demo just now; choose another")
        with resuming_as(DEMO_RESUME_HINT):
            yield output_dir
    finally:
        release_lock(lock)
        if made and not os.listdir(output_dir):
            os.rmdir(output_dir)


def check_merge_output(output_dir: str, *, overwrite: bool) -> None:
    """Refuse (RunFolderError) an ``output_dir`` of ``treadle merge`` that is a file, cannot be created, or holds
    a run's files or a saved model (``run_files``) while ``overwrite`` (``--overwrite-output-dir``) is off: the
    merged model would replace them without a word."""
    output_dir = check_path(output_dir)
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise RunFolderError(
            f"--output-dir {output_dir} is a file, not a folder: the merged model is a folder of files; set "
            f"--output-dir to a new folder"
        )
    check_creatable(output_dir, what="--output-dir")
    files = run_files(output_dir)
    if files and not overwrite:
        raise RunFolderError(
            f"--output-dir {output_dir} holds a run or a saved model ({listing(files)}): the merged model would "
            f"replace them; choose another --output-dir, or pass --overwrite-output-dir to replace them"
        )
