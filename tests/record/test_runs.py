"""The run folder (treadle.record.runs), in one process: what overwrite_output_dir may delete (only what a treadle
run provably wrote), the lock (atomic with its contents; an empty one is being written; a reused pid names the file to
delete), output_dir paths expanded or refused, and a disk that fills up or turns read-only mid-run. The `treadle
train` command's refusals of a run folder: tests/test_run_errors.py; docs/runs.md lists the trial cases."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from _factories import sft, write
from _runs import lock_held_by_another_process

from treadle import checkpoint as ckpt
from treadle.record import disk, fingerprints, runs


def files_under(folder) -> dict[str, bytes]:
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def fake_checkpoint(folder: Path) -> Path:
    """A checkpoint folder as save_checkpoint leaves it: its files, then treadle's marker."""
    write(folder / "model.safetensors", "weights")
    write(folder / "trainer_state.json", json.dumps({"global_step": 1}))
    fingerprints.write_marker(str(folder))
    return folder


def claim(output_dir: Path, *, overwrite=False, resume=False):
    return runs.claim_run_folder(
        SimpleNamespace(output_dir=str(output_dir), overwrite_output_dir=overwrite), resume=resume, main_process=True
    )


# ---- overwrite deletes only what a treadle run provably wrote -------------------------------------------------------
USER_FILES = [
    "config.json",
    "vocab.json",
    "report.html",
    "plots/my_figure.png",
    "checkpoint-2023/holiday.txt",
    "runs/other-experiment/events.out.tfevents.1",
]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_of_the_users_own_files_is_never_an_earlier_run_and_never_deleted(tmp_path, overwrite):
    for name in USER_FILES:
        write(tmp_path / name, f"mine: {name}")
    before = files_under(tmp_path)
    with pytest.raises(runs.RunFolderError) as error:
        runs.check_run_folder(str(tmp_path), resume=False, overwrite=overwrite)
    message = str(error.value)
    assert "no treadle run provably wrote" in message and "earlier run" not in message
    assert "checkpoint-2023 (no treadle_checkpoint.json" in message and "config.json (no .treadle-run.json" in message
    assert files_under(tmp_path) == before


def test_overwrite_deletes_the_runs_files_and_keeps_the_users(tmp_path, capsys):
    write(tmp_path / "notes.txt", "mine")
    with claim(tmp_path):  # a first run claims the folder: the manifest records what was there
        fake_checkpoint(tmp_path / "checkpoint-1")
        write(tmp_path / "plots" / "my_figure.png", "mine, added to the run's plots")
        write(tmp_path / "config.json", "{}")
        write(tmp_path / "plots" / "training.png", "plot")
        write(tmp_path / "metrics.jsonl", json.dumps({"step": 1, "loss": 1.0}) + "\n")
    with claim(tmp_path, overwrite=True):
        pass
    err = capsys.readouterr().err
    assert "deleting 4 entries of the earlier run" in err and "not ours, kept: plots/my_figure.png" in err
    assert sorted(files_under(tmp_path)) == [".treadle-run.json", "notes.txt", "plots/my_figure.png"]


def test_a_checkpoint_folder_holding_a_foreign_file_refuses_the_overwrite(tmp_path):
    with claim(tmp_path):
        fake_checkpoint(tmp_path / "checkpoint-2023")
    write(tmp_path / "checkpoint-2023" / "holiday.txt", "photos")
    before = files_under(tmp_path)
    with pytest.raises(runs.RunFolderError, match=r"checkpoint-2023 \(holds holiday.txt, which no treadle checkpoint"):
        runs.check_run_folder(str(tmp_path), resume=False, overwrite=True)
    assert files_under(tmp_path) == before


def test_a_symlinked_checkpoint_is_refused_and_its_target_untouched(tmp_path):
    target = fake_checkpoint(tmp_path / "elsewhere" / "checkpoint-7")
    run = tmp_path / "run"
    with claim(run):
        fake_checkpoint(run / "checkpoint-1")
    os.symlink(target, run / "checkpoint-7")
    with pytest.raises(runs.RunFolderError, match=r"checkpoint-7 \(a symbolic link to .*treadle never makes one"):
        runs.check_run_folder(str(run), resume=False, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors", "trainer_state.json", fingerprints.MARKER]


# ---- the lock: the OS's, one winner of a race; its file names the holder, not whether it lives --------------------
RACER = textwrap.dedent("""
    import os, sys, time
    from treadle.record import runs
    folder, me, go = sys.argv[1], sys.argv[2], sys.argv[3]
    while not os.path.exists(go):
        pass
    try:
        lock = runs.acquire_lock(folder)  # kept: a lock that is garbage-collected is let go of
        won = "won"
    except runs.RunFolderError:
        won = "lost"
    with open(me + ".tmp", "w") as f:
        f.write(won)
    os.rename(me + ".tmp", me)
    if won == "won":  # hold the lock until every racer has tried
        while not os.path.exists(go + ".done"):
            time.sleep(0.01)
""")


def test_processes_racing_for_the_lock_never_both_win(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(runs.__file__).parents[2])}
    for round_ in range(6):
        folder, go = tmp_path / f"r{round_}", tmp_path / f"go{round_}"
        results = [tmp_path / f"r{round_}-{i}" for i in range(4)]
        procs = [
            subprocess.Popen([sys.executable, "-c", RACER, str(folder), str(r), str(go)], env=env) for r in results
        ]
        try:
            go.touch()
            for proc, result in zip(procs, results):
                while not result.exists() and proc.poll() is None:
                    pass
            outcomes = sorted(r.read_text() for r in results if r.exists())
            assert outcomes == ["lost", "lost", "lost", "won"], outcomes
        finally:
            Path(f"{go}.done").touch()
            for proc in procs:
                proc.wait(timeout=60)


@pytest.mark.parametrize("content", ["", "{cut", json.dumps({"pid": os.getppid(), "host": "elsewhere", "started": 0})])
def test_a_lock_file_that_no_process_holds_is_free_whatever_it_says(tmp_path, content):
    """Empty, cut, or naming a live pid on another host: only the OS lock says whether a run holds the folder."""
    (tmp_path / runs.LOCK_FILE).write_text(content)
    assert runs.lock_holder(str(tmp_path)) is None
    runs.check_run_folder(str(tmp_path), resume=False)  # not refused
    lock = runs.acquire_lock(str(tmp_path))
    assert json.loads((tmp_path / runs.LOCK_FILE).read_text())["pid"] == os.getpid()  # the holder's name
    runs.release_lock(lock)
    assert not (tmp_path / runs.LOCK_FILE).exists()


def test_a_lock_held_by_a_live_run_names_it(tmp_path):
    with lock_held_by_another_process(tmp_path) as pid:
        with pytest.raises(runs.RunFolderError, match=rf"in use by another run \(pid {pid} on {socket.gethostname()}"):
            runs.check_run_folder(str(tmp_path), resume=False)


# ---- output_dir: expanded, and never the filesystem root or the home folder -----------------------------------------
def test_paths_expand_tilde_and_variables_and_root_or_home_are_refused(tmp_path, monkeypatch):
    from treadle import TrainingArguments

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    assert TrainingArguments(output_dir="~/run").output_dir == str(tmp_path / "run")
    assert TrainingArguments(output_dir="$RUNS/a").output_dir == str(tmp_path / "runs" / "a")
    for folder, needle in (("/", "the filesystem root"), ("~", "your home folder")):
        with pytest.raises(runs.RunFolderError, match=f"is {needle} itself"):
            runs.check_run_folder(folder, resume=False)


# ---- a disk that fills up or turns read-only mid-run ----------------------------------------------------------------
@pytest.mark.parametrize(
    "code, needle, fix",
    [
        (28, "the disk is full (No space left on device)", "free some space"),  # errno.ENOSPC
        (30, "the file system is read-only (Read-only file system)", "make it writable"),  # errno.EROFS
    ],
)
def test_a_disk_that_stops_taking_writes_mid_run_is_one_line_and_keeps_what_was_saved(
    tmp_path, monkeypatch, code, needle, fix
):
    import errno

    from treadle.errors import is_user_error

    assert (errno.ENOSPC, errno.EROFS) == (28, 30)
    rows = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(4)]
    trainer = sft(tmp_path, rows, max_steps=3, save_strategy="steps", save_steps=1)
    real_save, calls = ckpt.save_weights, []

    def save_weights(model, folder):  # the second checkpoint's weights meet the full disk
        calls.append(folder)
        if len(calls) == 2:
            raise OSError(code, os.strerror(code))
        return real_save(model, folder)

    monkeypatch.setattr(ckpt, "save_weights", save_weights)
    run = tmp_path / "run"
    with pytest.raises(disk.DiskError) as error:
        trainer.train()
    message = str(error.value)
    assert is_user_error(error.value) and "\n" not in message
    assert (
        f"output_dir {run}: {needle}, so the run stopped; its checkpoints saved before are intact (newest: "
        f"checkpoint-1); {fix}"
        in message
        and "--resume" in message
    )
    assert fingerprints.verify(str(run / "checkpoint-1")) == []  # intact
    assert not (run / runs.LOCK_FILE).exists() and not list(run.glob(".tmp-checkpoint-*"))


def test_an_error_without_an_errno_is_told_by_a_probe_write(tmp_path, monkeypatch):
    """torch's writer reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc:672]``: the
    probe write that follows finds the disk full."""
    import builtins
    import errno

    real_open = builtins.open

    def full_open(path, mode="r", *a, **kw):
        if ".treadle-probe-" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, mode, *a, **kw)

    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 512 vs 0")
    assert disk.disk_problem(str(tmp_path), error) is None  # the disk takes writes: not the disk, a traceback
    monkeypatch.setattr(builtins, "open", full_open)
    assert disk.disk_problem(str(tmp_path), error) == "the disk is full (No space left on device)"
