"""Elastic restarts: ``resume_from_checkpoint="auto"`` and a torchrun job whose worker is killed and restarted.

The fast tests pin the rules (which checkpoint "auto" finds, that a restarted attempt finds the run folder's lock
free and restarts in the folder its job wrote); the slow one runs ``torchrun --max-restarts 1`` on 2 CPU processes,
SIGKILLs rank 0 in the middle of writing a checkpoint, and compares the restarted run's final weights with an
uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import _resume_worker as resume_worker
import pytest
import torch
from _runs import lock_held_by_another_process

from treadle import checkpoint as ckpt, resume
from treadle.record import runs

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_elastic_worker.py")


def _fake_checkpoint(folder: Path, step: int, *, complete: bool = True, prefix: str = ckpt.PREFIX) -> Path:
    path = folder / f"{prefix}{step}"
    path.mkdir(parents=True)
    (path / ckpt.WEIGHTS_FILE).write_bytes(b"weights")
    if complete:
        (path / ckpt.STATE_FILE).write_text("{}")
    return path


# ---------------------------------------------------------------------------------------------------------
# "auto": the newest complete checkpoint, never one being written; nothing on a fresh folder
# ---------------------------------------------------------------------------------------------------------
def test_auto_is_nothing_on_a_fresh_or_missing_folder(tmp_path):
    assert resume.resolve("auto", str(tmp_path / "not-yet")) is None
    assert resume.resolve("auto", str(tmp_path)) is None
    with pytest.raises(ckpt.CheckpointError, match="holds no complete checkpoint"):
        resume.resolve(True, str(tmp_path))  # True still insists: the user asked to continue something


def test_auto_finds_the_newest_complete_checkpoint_never_one_being_written(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    _fake_checkpoint(tmp_path, 10)  # 10 > 4: steps sort as numbers, not as text
    _fake_checkpoint(tmp_path, 4)
    _fake_checkpoint(tmp_path, 12, prefix=ckpt.TMP_PREFIX)  # being written when the kill landed
    _fake_checkpoint(tmp_path, 14, complete=False)  # no trainer_state.json: not a complete checkpoint
    assert resume.resolve("auto", str(tmp_path)) == str(tmp_path / "checkpoint-10")


def test_a_fresh_auto_run_trains_and_a_second_one_resumes_its_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    first = resume_worker.run({"output_dir": out, "resume": "auto", "max_steps": 2, "save_steps": 2})
    assert first.state.global_step == 2 and os.path.isdir(os.path.join(out, "checkpoint-2"))
    # the same command again (max_steps raised is refused on a finished schedule, so the same length): the
    # finished run is found and nothing is trained twice
    again = resume_worker.run({"output_dir": out, "resume": "auto", "max_steps": 2, "save_steps": 2})
    assert again.state.global_step == 2
    assert [e["loss"] for e in again.state.log_history if "loss" in e] == [
        e["loss"] for e in first.state.log_history if "loss" in e
    ]


# ---------------------------------------------------------------------------------------------------------
# The run folder lets a restarted attempt of the same torchrun job back in, and no one else
# ---------------------------------------------------------------------------------------------------------
def _as_attempt(monkeypatch, run_id: str | None, attempt: int) -> None:
    for name, value in (("TORCHELASTIC_RUN_ID", run_id), ("TORCHELASTIC_RESTART_COUNT", str(attempt))):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def test_a_restarted_attempt_takes_over_the_lock_its_stopped_attempt_left(tmp_path, monkeypatch, capsys):
    """torchrun stops every worker of an attempt before it restarts the job: the OS let go of the lock, whose file
    still names the attempt that held it; the next attempt takes it, with a note, and names itself there."""
    _as_attempt(monkeypatch, "job-a", 0)
    with lock_held_by_another_process(tmp_path, env=dict(os.environ)) as pid:
        pass  # SIGKILLed at the block's end, as torchrun stops an attempt's workers
    _as_attempt(monkeypatch, "job-a", 1)
    lock = runs.acquire_lock(str(tmp_path))
    holder = json.loads((tmp_path / runs.LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["elastic_run"] == "job-a" and holder["attempt"] == 1
    assert f"taking over the lock {tmp_path / runs.LOCK_FILE} of a run that no longer runs (pid {pid}" in (
        capsys.readouterr().err
    )
    runs.release_lock(lock)
    assert not (tmp_path / runs.LOCK_FILE).exists()  # released cleanly: no lock file left behind


@pytest.mark.parametrize("run_id, attempt", [(None, 0), ("job-b", 1), ("job-a", 0), ("job-a", 1)])
def test_anyone_is_refused_while_the_holder_lives(tmp_path, monkeypatch, run_id, attempt):
    # no torchrun, another job, the same attempt or a later one: the OS lock is held, so the holder lives
    _as_attempt(monkeypatch, "job-a", 0)
    with lock_held_by_another_process(tmp_path, env=dict(os.environ)) as pid:
        _as_attempt(monkeypatch, run_id, attempt)
        with pytest.raises(runs.RunFolderError, match=rf"in use by another run \(pid {pid} on {socket.gethostname()}"):
            runs.acquire_lock(str(tmp_path))


def test_a_restarted_attempt_starts_again_in_the_folder_its_job_wrote(tmp_path, monkeypatch):
    """Killed before its first checkpoint: "auto" finds none, and the folder holds the job's metrics.jsonl."""
    out = tmp_path / "run"
    _as_attempt(monkeypatch, "job-a", 0)
    resume_worker.run({"output_dir": str(out), "max_steps": 1, "save_strategy": "no"})
    assert runs.read_manifest(str(out))["elastic_run"] == "job-a"
    _as_attempt(monkeypatch, "job-b", 1)  # another job is not let in
    with pytest.raises(runs.RunFolderError, match="holds an earlier run"):
        runs.check_run_folder(str(out), resume=False)
    _as_attempt(monkeypatch, "job-a", 1)
    trainer = resume_worker.run({"output_dir": str(out), "resume": "auto", "max_steps": 1, "save_strategy": "no"})
    assert trainer.state.global_step == 1
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1]  # the first attempt's step 1 is not kept twice
    assert runs.read_manifest(str(out))["attempt"] == 1


# ---------------------------------------------------------------------------------------------------------
# torchrun --max-restarts 1: rank 0 killed while writing checkpoint-4, restarted, resumed from checkpoint-2
# ---------------------------------------------------------------------------------------------------------
def _load(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_a_killed_worker_restarts_and_ends_with_the_uninterrupted_weights(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.5",
        str(WORKER),
        str(tmp_path),
    ]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    attempts = sorted(p.name for p in tmp_path.glob("attempt-*"))
    assert attempts == ["attempt-0-killed", "attempt-1"], output[-3000:]
    resumed = json.loads((tmp_path / "attempt-1").read_text())
    # attempt 0 died inside the save of checkpoint-4 (its .tmp-checkpoint-4 left behind): attempt 1 resumed
    # from checkpoint-2, the newest complete one, and trained steps 3-6 again
    assert resumed["resumed_at"] == 2 and resumed["steps"] == [3, 4, 5, 6]
    assert "taking over the lock" in output
    reference, elastic = _load(tmp_path / "reference" / "final"), _load(tmp_path / "elastic" / "final")
    assert sorted(reference) == sorted(elastic)
    for name in reference:
        torch.testing.assert_close(
            elastic[name], reference[name], rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}"
        )
