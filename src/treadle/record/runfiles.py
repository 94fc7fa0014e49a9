"""THE run folder's files: their names, how an entry of a log file is written, read and cut back, in one place.

A run folder (``output_dir``) holds, besides its checkpoints (``treadle.checkpoint``):

- ``metrics.jsonl``: one JSON object a line per log event, with ``step`` and ``epoch`` (the Trainer's
  MetricsFileCallback writes it; ``treadle.cli.report`` and ``treadle.record.plots`` read it);
- ``completions.jsonl``: GRPO's sampled completions (``log_completions=True``), one entry a line with ``step``;
- ``training_args.json``: the arguments of the run (also inside every checkpoint);
- ``run.json``: what made the run besides its arguments (model, datasets, reward functions, LoRA settings;
  ``treadle.describe``), written when training begins.

The one policy for a line that does not parse: the **last** line of a file, when it has no newline, is a line cut
by a crash in mid-write, and every reader and every cut-back drops it silently; any other line that is not a
JSON object with a numeric ``step`` is corruption, and ``read_entries`` raises ``RunFileError`` naming
``file:line``. A resumed run first cuts each log file back to the entries before (completions) or up to
(metrics) the step it resumes from, so that no step is recorded twice.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from treadle.errors import UserError

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"  # GRPO's sampled completions (log_completions=True)
ARGS_FILE = "training_args.json"  # the run's arguments, beside its metrics and in every checkpoint
RUN_FILE = "run.json"  # what made the run besides its arguments: model, datasets, reward functions, LoRA


LINE_MOST = 64 << 20  # characters in one entry's line: a longer one is no entry (a device or a damaged file)


class RunFileError(UserError, ValueError):
    """A log file with a line that is neither an entry nor a line cut by a crash (names ``file:line``), or a run
    file that is not a regular file (a FIFO, a device, a folder)."""


def not_regular(path: str | Path) -> str | None:
    """What ``path`` is when it exists and is not a regular file ("a FIFO (named pipe)", "a character device such
    as /dev/full" ...), following a symbolic link; None for a regular file or nothing there. Opening a FIFO waits
    for a writer forever, and a device reads endlessly: a run file that is either is refused before it is opened."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a symbolic link to nothing" if os.path.islink(path) else None
    except OSError as error:
        return f"unreadable ({error.strerror})"
    if stat.S_ISREG(mode):
        return None
    kinds = {
        stat.S_ISFIFO: "a FIFO (named pipe)",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
        stat.S_ISDIR: "a folder",
    }
    kind = next((name for test, name in kinds.items() if test(mode)), "not a regular file")
    return kind + (f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else "")


def check_regular(path: str | Path) -> None:
    """Refuse (RunFileError) a run file ``path`` that exists and is not a regular file (``not_regular``)."""
    kind = not_regular(path)
    if kind is not None:
        raise RunFileError(
            f"{path} is {kind}, not a regular file: treadle reads and appends its run files; remove it "
            f"(rm {path}) or choose another output_dir"
        )


def append_entries(path: str | Path, entries: list[dict[str, Any]]) -> None:
    """Append ``entries`` to ``path``, one JSON line each (numbers that JSON lacks, e.g. tensors' floats, as
    floats), creating its folder when needed."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    check_regular(path)
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, default=float) + "\n" for r in entries)


def write_args(output_dir: str, json_text: str) -> None:
    """Write the run's arguments (``args.to_json_string()``) to ``output_dir/training_args.json``."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, ARGS_FILE), "w", encoding="utf-8") as f:
        f.write(json_text + "\n")


def read_args(run_dir: str | Path) -> dict[str, Any] | None:
    """The arguments a run was trained with (``training_args.json``); None when absent or unreadable."""
    return _read_json(Path(run_dir) / ARGS_FILE)


def _read_json(path: Path) -> Any:
    """The JSON value in the regular file ``path``; None when absent, not a regular file, or not JSON."""
    if not path.is_file() or not_regular(path) is not None:
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def unreadable_note(path: str | Path) -> str | None:
    """Why the JSON file ``path`` (run.json, training_args.json) that is there cannot be read ("cut mid-write ...");
    None when it is absent or reads."""
    path = Path(path)
    kind = not_regular(path)
    if kind is not None:
        return f"{path.name} is {kind}, not a regular file"
    if not path.exists():
        return None
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
    except (OSError, UnicodeDecodeError) as error:
        return f"{path.name} is there but unreadable ({error})"
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("{") and not text.rstrip().endswith("}"):  # an object that never closes
            return (
                f"{path.name} is cut: its {len(text.encode())} bytes stop in mid-write (the run stopped while "
                f"writing it, or the disk filled up)"
            )
        return f"{path.name} is not valid JSON ({error.msg}, line {error.lineno})"
    return None


def write_run_info(output_dir: str, info: dict[str, Any]) -> None:
    """Write ``info`` (``treadle.describe.describe_run``) to ``output_dir/run.json``."""
    os.makedirs(output_dir, exist_ok=True)
    (Path(output_dir) / RUN_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def read_run_info(run_dir: str | Path) -> dict[str, Any] | None:
    """A run's ``run.json``; None when absent or unreadable (a run from before it existed; ``unreadable_note`` says
    why one that is there does not read)."""
    info = _read_json(Path(run_dir) / RUN_FILE)
    return info if isinstance(info, dict) else None


def _numbered_lines(path: str | Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, is the cut last line) of each non-blank line of ``path`` (a regular file: a line of
    more than ``LINE_MOST`` characters raises RunFileError, never read whole)."""
    check_regular(path)
    with open(path, encoding="utf-8") as f:
        number, line = 0, f.readline(LINE_MOST + 1)
        while line:
            number += 1
            if len(line) > LINE_MOST:
                raise RunFileError(
                    f"{path}:{number}: a line of over {LINE_MOST:,} characters, which no run writes: the file is "
                    f"damaged or not a run's log; move it out of the run folder"
                )
            following = f.readline(LINE_MOST + 1)
            if line.strip():
                yield number, line, not following and not line.endswith("\n")
            line = following


def _parse(line: str, where: str) -> dict[str, Any]:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as error:
        raise RunFileError(f"{where}: corrupt line, not valid JSON ({error.msg})") from None
    if not isinstance(entry, dict):
        raise RunFileError(f"{where}: expected a JSON object, got {type(entry).__name__}")
    step = entry.get("step")
    if not isinstance(step, (int, float)) or isinstance(step, bool):
        raise RunFileError(f"{where}: event has no numeric 'step'")
    return entry


def _entries_and_lines(path: str | Path) -> list[tuple[dict[str, Any], str]]:
    entries = []
    for number, line, cut in _numbered_lines(path):
        try:
            entries.append((_parse(line, f"{path}:{number}"), line))
        except RunFileError:
            if not cut:
                raise
    return entries


def read_entries(path: str | Path) -> list[dict[str, Any]]:
    """The entries of a log file in file order ([] when it does not exist); blank lines are skipped, a last
    line cut by a crash is dropped, any other bad line raises RunFileError naming ``file:line``."""
    return [entry for entry, _ in _entries_and_lines(path)] if os.path.exists(path) else []


def cut_back(path: str | Path, keep: Callable[[dict[str, Any]], bool]) -> None:
    """Rewrite ``path`` with only the lines whose entries ``keep`` accepts, as they were written (no-op when it
    does not exist); a line cut by a crash goes, a corrupt line raises as in ``read_entries``."""
    if not os.path.exists(path):
        return
    kept = [line if line.endswith("\n") else line + "\n" for entry, line in _entries_and_lines(path) if keep(entry)]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(kept)


def read_new_entries(path: str | Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The entries appended to ``path`` since byte ``offset``, and the offset to read from next time: a last
    line without its newline is still being written and waits for the next read (the cut-line policy of a file
    that is still growing); ([], offset) when the file does not exist."""
    if not os.path.exists(path):
        return [], offset
    check_regular(path)
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().splitlines(keepends=True)
    entries = []
    for line in lines:
        if not line.endswith(b"\n"):
            break  # the last line, still being written
        if line.strip():
            entries.append(_parse(line.decode("utf-8"), f"{path}:byte {offset}"))  # names the line's own start
        offset += len(line)
    return entries, offset
