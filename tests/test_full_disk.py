"""Cases of the fourth hostile trial (issue 59), full disks for real: safetensors' own error (``SafetensorError``, os
error 28 or 27) is the one-line disk error too, its half-written checkpoint removed; the final model is written
atomically, so a final save that fails leaves the folder as it was and says the weights were not saved. A real small
tmpfs where this user may mount one (root), a file-size limit (``RLIMIT_FSIZE``) in a subprocess, and safetensors'
error raised in place otherwise. docs/runs.md: "The fourth hostile trial"."""

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _factories import sft
from safetensors import SafetensorError

from treadle import checkpoint as ckpt
from treadle.callbacks import TrainerCallback
from treadle.cli.command import train_and_save
from treadle.record import disk, runs

ROWS = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(4)]
ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def small_disk(folder: Path, size: str):
    """A tmpfs of ``size`` mounted at ``folder`` (root only; skipped where it cannot be mounted)."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the SafetensorError tests below cover the path")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def no_scratch(run: Path) -> bool:
    return not [n for n in os.listdir(run) if n.startswith(disk.SCRATCH_PREFIXES)]


@pytest.mark.parametrize("size", ["2m", "1m"])  # 2m: the trial's tmpfs, where safetensors' own error came through
def test_a_real_full_disk_at_a_checkpoint_is_one_line_and_removes_the_scratch(tmp_path, size):
    with small_disk(tmp_path / "run", size) as run:
        trainer = sft(tmp_path, ROWS, max_steps=200, save_strategy="steps", save_steps=1)
        with pytest.raises(disk.DiskError) as error:
            trainer.train()
        message = str(error.value)
        assert "the disk is full (No space left on device), so the run stopped" in message and "\n" not in message
        assert no_scratch(run)


class FillTheDisk(TrainerCallback):
    """At train end, fill ``folder``'s file system but for a few KiB: the final save meets a full disk."""

    def __init__(self, folder: Path):
        self.folder = folder

    def on_train_end(self, args, state, control, **kwargs):
        free = os.statvfs(self.folder).f_bavail * os.statvfs(self.folder).f_frsize
        (self.folder / "filler").write_bytes(bytes(max(0, free - 8192)))


def test_a_real_full_disk_at_the_final_save_leaves_the_folder_as_it_was(tmp_path):
    with small_disk(tmp_path / "run", "4m") as run:
        trainer = sft(tmp_path, ROWS, max_steps=2)  # save_strategy: no
        trainer.add_callback(FillTheDisk(run))
        before = {}

        def listing(*_, **__):
            before.update(dict.fromkeys(os.listdir(run)))

        trainer.add_callback(type("Seen", (TrainerCallback,), {"on_train_end": listing})())
        with pytest.raises(disk.DiskError) as error:
            train_and_save(trainer, None, ["treadle", "train", "cfg.yaml"])
        message = str(error.value)
        assert "the disk is full" in message and "at the final save: the trained weights were NOT saved" in message
        assert set(os.listdir(run)) == set(before) - {runs.LOCK_FILE}  # no config.json without weights, no scratch
        assert "config.json" not in before and "model.safetensors" not in before


@pytest.mark.parametrize("code, needle", [(28, "the disk is full"), (27, "ulimit -f")])
def test_safetensors_own_error_is_the_disk_error_and_its_scratch_goes(tmp_path, monkeypatch, code, needle):
    trainer = sft(tmp_path, ROWS, max_steps=3, save_strategy="steps", save_steps=1)
    real_save, calls = ckpt.save_weights, []

    def save_weights(model, folder, state_dict=None):
        calls.append(folder)
        if len(calls) == 2:  # the second checkpoint
            Path(folder, "model.safetensors").write_bytes(b"half")
            raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")
        return real_save(model, folder, state_dict)

    monkeypatch.setattr(ckpt, "save_weights", save_weights)
    with pytest.raises(disk.DiskError) as error:
        trainer.train()
    assert needle in str(error.value) and "newest: checkpoint-1" in str(error.value)
    assert no_scratch(tmp_path / "run")


def test_a_failed_final_save_leaves_the_folder_as_it_was_and_says_so(tmp_path, monkeypatch):
    trainer = sft(tmp_path, ROWS, max_steps=2)  # save_strategy: no
    real_save = ckpt.save_weights

    def save_weights(model, folder, state_dict=None):
        real_save(model, folder, state_dict)  # the config and part of the weights are written, then the disk fills
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt, "save_weights", save_weights)
    with pytest.raises(disk.DiskError, match="the trained weights were NOT saved and no checkpoint holds them"):
        train_and_save(trainer, None, ["treadle", "train", "cfg.yaml"])
    left = set(os.listdir(tmp_path / "run"))
    assert "config.json" not in left and "model.safetensors" not in left and no_scratch(tmp_path / "run")


@pytest.mark.slow
def test_a_file_size_limit_is_the_disk_error_for_real(tmp_path):
    """``ulimit -f`` for real: safetensors raises os error 27 (Python ignores SIGXFSZ, so the write fails)."""
    script = textwrap.dedent(
        f"""
        import resource, sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from _factories import sft
        from pathlib import Path
        from treadle.record import disk
        rows = [{{"prompt": f"{{a}}+1=", "completion": str(a + 1)}} for a in range(4)]
        trainer = sft(Path({str(tmp_path)!r}), rows, max_steps=3, save_strategy="steps", save_steps=1)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        try:
            trainer.train()
        except disk.DiskError as error:
            print("DISK", error)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "DISK" in result.stdout and "ulimit -f" in result.stdout and "File too large" in result.stdout
    assert no_scratch(tmp_path / "run")


def test_the_final_model_replaces_an_earlier_saves_shards_and_keeps_them_when_it_fails(tmp_path, monkeypatch):
    trainer = sft(tmp_path, ROWS, max_steps=1)
    run = tmp_path / "run"
    run.mkdir()
    stale = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    for name in stale:
        (run / name).write_text("an earlier save's")
    real_save = ckpt.save_weights

    def failing(model, folder, state_dict=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt, "save_weights", failing)
    with pytest.raises(SafetensorError):
        trainer.save_model()
    assert sorted(os.listdir(run)) == sorted(stale)  # as it was
    monkeypatch.setattr(ckpt, "save_weights", real_save)
    trainer.save_model()
    left = set(os.listdir(run))
    assert "model.safetensors" in left and "config.json" in left and not left & set(stale)  # as save_pretrained
