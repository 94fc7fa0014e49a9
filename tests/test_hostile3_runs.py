"""The third hostile trial (issue 44): the run lifecycle, the CLI, resume and streaming. A signal at any point of a
`treadle train` run leaves its work on disk; `--resume auto` restarts what crashed before its first checkpoint and
skips a corrupt newest checkpoint; a resume names what actually differs; a streamed run is tied to its data; cut
or null streamed rows, a `revision` with a local folder and a `.gguf` model are one line each. docs/runs.md holds
the table.

The signal cases run `treadle train` in a subprocess whose save (or end of training) sends the process a signal,
as a preemption landing in that window would."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _factories import sft_trainer
from test_run_errors import ENV, ROWS, error_line, treadle, write_config, write_jsonl

from treadle import TrainerCallback
from treadle.checkpoint import CheckpointError
from treadle.record import runs


def run_python(folder: Path, source: str, timeout: int = 300) -> subprocess.CompletedProcess:
    script = folder / "hooked.py"
    script.write_text(textwrap.dedent(source))
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=folder,
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        timeout=timeout,
    )


# ---- 1. data loss: a signal after the last step ----------------------------------------------------------------
# the process sends itself the signals at a point of the run (the hook), then goes on as a preempted job would
SIGNAL_AT = """
import os, signal, sys, time
import treadle.checkpoint as ckpt
from treadle.trainer import Trainer
from treadle.cli import command

def hooked(original):
    def hook(*args, **kwargs):
        for signum in {signals}:
            os.kill(os.getpid(), signum)
        time.sleep(0.1)  # the handler runs here: before the writes begin
        return original(*args, **kwargs)
    return hook

{patch}
sys.exit(command.main(["train", "cfg.yaml"]))
"""
AT_SAVE = "ckpt.save_weights = hooked(ckpt.save_weights)"  # the final save's weights (save_strategy: no)
AT_END = "Trainer._finish_training = hooked(Trainer._finish_training)"  # after the loop, before the save


def assert_final_model_whole(run: Path) -> None:
    from safetensors.torch import load_file

    names = {p.name for p in run.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "training_args.json"} <= names, names
    assert load_file(run / "model.safetensors")  # whole: it loads
    assert not [n for n in names if n.startswith("checkpoint-")]  # save_strategy: no


@pytest.mark.parametrize(
    "patch, signals, status",
    [
        (AT_SAVE, [signal.SIGTERM], 143),
        (AT_END, [signal.SIGTERM], 143),
        (AT_SAVE, [signal.SIGINT, signal.SIGINT], 130),  # even a second Ctrl-C lets the save complete
    ],
    ids=["sigterm-during-final-save", "sigterm-after-last-step", "two-ctrl-c-during-final-save"],
)
def test_a_signal_after_the_last_step_keeps_the_final_model_and_exits_128_plus_it(tmp_path, patch, signals, status):
    write_config(tmp_path, save_strategy="no")
    result = run_python(tmp_path, SIGNAL_AT.format(signals=[int(s) for s in signals], patch=patch))
    assert result.returncode == status, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    name = signal.Signals(signals[0]).name
    assert f"treadle: stopped by {name} after the last step (2): the final model is saved whole in run" in (
        result.stderr
    )
    assert_final_model_whole(tmp_path / "run")


def test_a_signal_during_a_run_still_stops_it_at_the_next_step_with_a_checkpoint(tmp_path):
    """The guard over the whole run does not change a signal in the loop: checkpoint, resume line, 143."""
    write_config(tmp_path, save_strategy="no", max_steps=3)
    patch = "Trainer.training_step = hooked(Trainer.training_step)"  # every step: the first one stops the run
    result = run_python(tmp_path, SIGNAL_AT.format(signals=[int(signal.SIGTERM)], patch=patch))
    assert result.returncode == 143, result.stderr[-3000:]
    assert "treadle: resume with: treadle train cfg.yaml --resume" in result.stderr
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-1"]


# ---- 2. --resume auto after an attempt that saved no checkpoint -----------------------------------------------
class CrashAt(TrainerCallback):
    """Raises as optimizer step ``step + 1`` begins (0: the first), as a crash (out of memory, a node lost) would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError("node lost")


def crashed_attempt(folder: Path, tok, step: int = 1, **overrides) -> Path:
    """A run folder as an attempt that crashed at ``step`` before saving any checkpoint leaves it."""
    trainer = sft_trainer(folder, tok, callbacks=[CrashAt(step)], max_steps=3, save_steps=100, **overrides)
    with pytest.raises(RuntimeError, match="node lost"):
        trainer.train()
    assert not list(folder.glob("checkpoint-*")) and (folder / "training_args.json").exists()
    return folder


@pytest.mark.parametrize("step", [0, 1], ids=["step-0-failure", "crash-before-first-checkpoint"])
def test_resume_auto_starts_afresh_where_no_checkpoint_was_saved(tmp_path, tok, capsys, step):
    folder = crashed_attempt(tmp_path / "run", tok, step=step)
    capsys.readouterr()
    trainer = sft_trainer(folder, tok, max_steps=2)
    assert trainer.train(resume_from_checkpoint="auto").global_step == 2
    err = capsys.readouterr().err
    assert "treadle: resume auto: no complete checkpoint in " in err and ", so a fresh start: deleting " in err
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2]  # the crashed attempt's records are gone


def test_a_plain_run_into_an_attempt_that_saved_no_checkpoint_says_what_to_do(tmp_path, tok):
    folder = crashed_attempt(tmp_path / "run", tok)
    with pytest.raises(runs.RunFolderError) as refused:
        sft_trainer(folder, tok).train()
    message = str(refused.value)
    assert "it saved no checkpoint (it stopped before its first), so there is nothing to resume" in message
    assert "start it again with --resume auto (train(resume_from_checkpoint='auto'))" in message
    assert "continue it with --resume" not in message
    with pytest.raises(CheckpointError, match="or with --resume auto"):
        sft_trainer(folder, tok).train(resume_from_checkpoint=True)


def test_resume_auto_never_replaces_a_saved_model(tmp_path, tok):
    """A finished run with save_strategy: no holds its model and no checkpoint: auto refuses, naming it."""
    folder = tmp_path / "run"
    trainer = sft_trainer(folder, tok)
    trainer.train()
    trainer.save_model()
    with pytest.raises(runs.RunFolderError, match="it saved its model and no checkpoint, so it cannot be continued"):
        sft_trainer(folder, tok).train(resume_from_checkpoint="auto")
    assert (folder / "model.safetensors").exists()


# ---- 3. --resume auto skips a corrupt newest checkpoint ---------------------------------------------------------
@pytest.fixture
def three_checkpoints(tmp_path, tok):
    folder = tmp_path / "run"
    sft_trainer(folder, tok, max_steps=3, save_strategy="steps", save_steps=1).train()
    return folder


def test_resume_auto_skips_a_corrupt_newest_checkpoint_with_a_note(three_checkpoints, tok, capsys):
    folder = three_checkpoints
    (folder / "checkpoint-3" / "optimizer.pt").write_bytes(b"cut")
    (folder / "checkpoint-2" / "trainer_state.json").write_text("{")
    capsys.readouterr()
    trainer = sft_trainer(folder, tok, max_steps=3, save_strategy="steps", save_steps=1)
    assert trainer.train(resume_from_checkpoint="auto").global_step == 3
    err = capsys.readouterr().err
    assert f"treadle: resume auto: skipping {folder}/checkpoint-3: optimizer.pt changed since it was saved" in err
    assert f"treadle: resume auto: skipping {folder}/checkpoint-2: trainer_state.json changed" in err
    assert f"treadle: resuming from {folder}/checkpoint-1 at step 1 of 3" in err


def test_an_explicit_corrupt_checkpoint_is_still_refused(three_checkpoints, tok):
    (three_checkpoints / "checkpoint-3" / "optimizer.pt").write_bytes(b"cut")
    with pytest.raises(CheckpointError, match="checkpoint-3 is not what was saved: optimizer.pt changed"):
        sft_trainer(three_checkpoints, tok, max_steps=3).train(resume_from_checkpoint=True)
    with pytest.raises(CheckpointError, match="resume auto: every checkpoint in .* is corrupt"):
        for step in (1, 2):
            (three_checkpoints / f"checkpoint-{step}" / "scheduler.pt").write_bytes(b"cut")
        sft_trainer(three_checkpoints, tok, max_steps=3).train(resume_from_checkpoint="auto")


# ---- 4. resuming with a larger max_steps -------------------------------------------------------------------------
def streamed(rows=ROWS):
    from datasets import Dataset

    return Dataset.from_list(rows).to_iterable_dataset()


def test_a_streamed_run_resumes_with_a_larger_max_steps(tmp_path, tok, capsys):
    """A stream's one "epoch" is the run (max_steps): going further is not another batch size or process count."""
    folder = tmp_path / "run"
    sft_trainer(folder, tok, rows=streamed(), max_steps=2, save_strategy="steps", save_steps=1).train()
    resumed = sft_trainer(folder, tok, rows=streamed(), max_steps=4, save_strategy="steps", save_steps=1)
    assert resumed.train(resume_from_checkpoint=str(folder / "checkpoint-1")).global_step == 4
    assert f"treadle: resuming from {folder}/checkpoint-1 at step 1 of 4" in capsys.readouterr().err
    assert [h["step"] for h in resumed.state.log_history if "loss" in h] == [1, 2, 3, 4]


def test_a_resume_mismatch_names_what_differs_and_the_setting_that_restores_it(tmp_path, tok):
    folder = tmp_path / "run"
    sft_trainer(folder, tok, max_steps=2, save_strategy="steps", save_steps=1).train()
    resumed = sft_trainer(folder, tok, max_steps=4, per_device_train_batch_size=1)
    with pytest.raises(CheckpointError) as refused:
        resumed.train(resume_from_checkpoint=str(folder / "checkpoint-1"))
    message = str(refused.value)
    assert "train_batch_size: checkpoint 2 vs now 1 (per_device_train_batch_size); set them back" in message
    assert "steps_per_epoch" not in message  # a consequence of the batch size, not a second fault
    assert "max_steps" not in message  # going further is allowed


# ---- 5. a streamed run resumed on another dataset --------------------------------------------------------------
def test_a_streamed_run_resumed_on_another_dataset_is_refused_as_a_map_style_one_is(tmp_path, tok):
    folder = tmp_path / "run"
    sft_trainer(folder, tok, rows=streamed(), max_steps=2, save_strategy="steps", save_steps=1).train()
    other = [{"prompt": row["prompt"], "completion": row["completion"] + "0"} for row in ROWS]
    for rows in (streamed(other), other):  # streamed or not, other rows
        with pytest.raises(CheckpointError) as refused:
            sft_trainer(folder, tok, rows=rows).train(resume_from_checkpoint=str(folder / "checkpoint-1"))
        assert "checkpoint-1 is not what was saved: the training dataset differs from the one it trained on" in str(
            refused.value
        )
    assert "ignore_checkpoint_fingerprints: true" in str(refused.value)
    resumed = sft_trainer(folder, tok, rows=streamed(other), ignore_checkpoint_fingerprints=True)
    assert resumed.train(resume_from_checkpoint=str(folder / "checkpoint-1")).global_step == 2  # the override works


def test_a_stream_read_once_is_not_read_for_its_fingerprint():
    from treadle import streaming

    rows = iter(ROWS)
    assert streaming.head_fingerprint(rows) is None and next(rows) == ROWS[0]
    assert streaming.head_fingerprint(streamed()).startswith("stream:16:")
    assert streaming.head_fingerprint(ROWS) is None  # not a stream: the sampled fingerprint's


# ---- 6. streamed rows that are cut or null ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "last_line, needle",
    [
        ('{"prompt": "1+2=", "compl', "data.jsonl:17: not valid JSON (Unterminated string"),
        ("null", "data.jsonl:17: a JSON lines dataset holds one object per line, got NoneType"),
        ('{"prompt": null, "completion": "3"}', "data.jsonl, line 17: column 'prompt' holds nothing (null / empty)"),
    ],
    ids=["cut-last-line", "null-line", "null-prompt"],
)
def test_a_streamed_jsonl_row_that_is_cut_or_null_names_the_file_and_line(tmp_path, tok, last_line, needle):
    from treadle.cli.loading import load_dataset
    from treadle.data import DatasetFileError

    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    path.write_text(path.read_text() + last_line)  # the last line as a crash leaves it: no newline
    stream = load_dataset({"path": str(path), "streaming": True}, kind="sft")
    with pytest.raises(DatasetFileError, match=re.escape(f"{tmp_path}/{needle}")):
        list(stream)
    trainer = sft_trainer(tmp_path / "run", tok, rows=load_dataset({"path": str(path), "streaming": True}))
    with pytest.raises(DatasetFileError, match=re.escape(needle)):  # in a run: the same one line
        trainer.train()


def test_a_streamed_jsonl_file_still_resumes_from_its_state(tmp_path, tok):
    from treadle.cli.loading import load_dataset

    spec = {"path": str(write_jsonl(tmp_path / "data.jsonl", ROWS)), "streaming": True}
    folder = tmp_path / "run"
    sft_trainer(folder, tok, rows=load_dataset(spec), max_steps=4, save_strategy="steps", save_steps=2).train()
    resumed = sft_trainer(folder, tok, rows=load_dataset(spec), max_steps=4)
    assert resumed.train(resume_from_checkpoint=str(folder / "checkpoint-2")).global_step == 4
    assert resumed.callback_handler.train_dataloader.mode == "state"


# ---- 7. a revision with a local model ----------------------------------------------------------------------------
def test_a_revision_with_a_local_model_folder_is_refused_in_one_line(tmp_path, tok):
    from treadle.demos import toy
    from treadle.models import load_pretrained

    folder = tmp_path / "model"
    toy.build_model("tiny", tokenizer=tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    with pytest.raises(ValueError) as refused:
        load_pretrained(str(folder), revision="v1.0")
    assert str(refused.value) == (
        f"revision 'v1.0' picks a version of a Hugging Face Hub model, but {folder} is a local folder, which holds "
        f"one version; drop revision, or name the Hub id (org/name) to load that revision"
    )
    assert load_pretrained(str(folder))[0] is not None  # without it, the folder loads


# ---- 8. a .gguf file as the model of a config ----------------------------------------------------------------------
def test_a_config_names_a_gguf_file_beside_it_and_a_missing_one_is_a_gguf_error(tmp_path):
    pytest.importorskip("gguf")
    from test_gguf import write_gguf

    from treadle.cli.command import main

    beside = tmp_path / "configs"
    beside.mkdir()
    write_gguf(beside / "tiny.gguf")
    config = write_config(beside, model="tiny.gguf", output_dir=str(tmp_path / "run"), max_steps=1)
    config.write_text(config.read_text().replace("data.jsonl", str(beside / "data.jsonl")) + 'save_strategy: "no"\n')
    assert main(["train", str(config)]) == 0  # found beside the config, as a dataset is
    assert (tmp_path / "run" / "model.safetensors").exists()
    for missing in ("nope.gguf", str(tmp_path / "nope.gguf")):
        result = treadle("train", config, "--model", missing, "--output_dir", tmp_path / "run2", cwd=tmp_path)
        line = error_line(result)
        assert f"GGUF file {tmp_path / 'nope.gguf'} not found; name an existing .gguf file" in line
        assert "model folder" not in line
