"""Bad inputs to `treadle train` / `treadle report`, each a real command in a subprocess: the exit status, the
one line that says what is wrong and how to fix it (never a traceback), and -- where a run could be lost --
that every file that was there before is byte-identical afterwards. docs/runs.md holds the table.

One tiny model folder (the toy model, saved) and one real two-step SFT run are built once per module; most
cases fail at preflight, before a model loads. The cases that train (signals, NaN, overwrite) are marked slow.

A signal after the last step (during the final save, or before it begins) lets the final model be saved whole and
exits 128 + the signal: those cases run the command in a script that sends the process the signal at that point, as
a preemption landing in that window would.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _runs import lock_held_by_another_process

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TREADLE_DEBUG": "0"}
ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)] * 4]


def treadle(*argv, cwd, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "treadle", *map(str, argv)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **ENV, **(env or {})},
        timeout=timeout,
    )


def error_line(result, code: int = 2) -> str:
    """The one ``treadle: error:`` line of a refused command (and no traceback)."""
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("treadle: error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def snapshot(folder) -> dict[str, bytes]:
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def write_jsonl(path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_config(folder, **keys) -> Path:
    config = {
        "trainer": "sft",
        "model": "toy:tiny",
        "dataset": "data.jsonl",
        "output_dir": "run",
        "max_steps": 2,
        "per_device_train_batch_size": 4,
        "save_steps": 1,
        "logging_steps": 1,
        "disable_tqdm": True,
        "learning_rate": 1e-3,
        **keys,
    }
    path = Path(folder) / "cfg.yaml"
    path.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in config.items()))
    if not (Path(folder) / "data.jsonl").exists():
        write_jsonl(Path(folder) / "data.jsonl", ROWS)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The toy model and its tokenizer, saved as a transformers model folder."""
    from treadle.demos import toy

    folder = tmp_path_factory.mktemp("model") / "toy"
    tokenizer = toy.build_tokenizer()
    toy.build_model("tiny", tokenizer=tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A real finished SFT run of two steps (checkpoint-1, checkpoint-2, metrics, final model, plots)."""
    work = tmp_path_factory.mktemp("earlier")
    result = treadle("train", write_config(work), cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    return work / "run"


@pytest.fixture
def work(tmp_path):
    write_jsonl(tmp_path / "data.jsonl", ROWS)
    return tmp_path


# ---- the run folder: refused before anything is loaded or written ------------------------------------------
def test_a_new_run_into_a_folder_holding_a_run_is_refused_and_nothing_changes(work, earlier_run):
    shutil.copytree(earlier_run, work / "run")
    before = snapshot(work / "run")
    line = error_line(treadle("train", write_config(work), cwd=work))
    assert "output_dir run holds an earlier run (checkpoint-1, checkpoint-2" in line
    assert "--resume" in line and "overwrite_output_dir: true to delete those" in line
    assert snapshot(work / "run") == before


@pytest.mark.parametrize(
    "output_dir, needle",
    [
        ("{model}", "is the model folder"),
        ("{model}/out", "is inside the model folder"),
        ("cfg.yaml", "is a file, not a folder"),
        ("cfg.yaml/run", "cannot be created: "),
    ],
)
def test_an_output_dir_that_cannot_take_a_run(work, model_dir, output_dir, needle):
    before = snapshot(model_dir)
    config = write_config(work, model=str(model_dir), output_dir=output_dir.format(model=model_dir))
    assert needle in error_line(treadle("train", config, cwd=work))
    assert snapshot(model_dir) == before


def test_a_folder_locked_by_a_live_run_is_refused(work):
    with lock_held_by_another_process(work / "run") as pid:
        line = error_line(treadle("train", write_config(work), cwd=work))
        assert f"output_dir run is in use by another run (pid {pid} on {socket.gethostname()}" in line
        assert json.loads((work / "run" / ".treadle.lock").read_text())["pid"] == pid  # the holder's, untouched


# ---- config values, datasets, model folders, reward files: refused before training -------------------------
CONFIG_CASES = {
    "eval_strategy without eval_dataset": (["--eval_strategy", "steps"], "but there is no evaluation dataset"),
    "learning_rate .nan": (["--learning_rate", ".nan"], "learning_rate must be a finite number, got nan"),
    "max_grad_norm nan": (["--max_grad_norm", "nan"], "max_grad_norm must be a finite number, got nan"),
    "learning_rate fast": (["--learning_rate", "fast"], "learning_rate must be a number, got 'fast'"),
    "resume with nothing to resume": (["--resume"], "holds no complete checkpoint"),
    "resume from a missing path": (["--resume", "run/checkpoint-9"], "does not exist"),
}


@pytest.mark.parametrize("extra, needle", CONFIG_CASES.values(), ids=CONFIG_CASES.keys())
def test_bad_config_values(work, extra, needle):
    assert needle in error_line(treadle("train", write_config(work), *extra, cwd=work))
    assert not (work / "run").exists()  # nothing written


DATA_CASES = {
    "json object that is no columns": ("data.json", '{"prompt": "1+2=", "completion": "3"}', "must hold rows"),
    "json columns of different lengths": (
        "data.json",
        '{"prompt": ["1+2="], "completion": []}',
        "columns of different lengths",
    ),
    "json that does not parse": ("data.json", '[{"prompt": "1+2="', "data.json:1: not valid JSON"),
    "jsonl line that is a list": (
        "data.jsonl",
        '{"prompt": "1+2=", "completion": "3"}\n["1+2=", "3"]\n',
        "data.jsonl:2: a JSON lines dataset holds one object per line",
    ),
    "int in a text column": (
        "data.jsonl",
        '{"prompt": "1+2=", "completion": "3"}\n{"prompt": "4+4=", "completion": 8}\n',
        "data.jsonl, line 2: column 'completion' holds int '8'",
    ),
    "null in a text column": (
        "data.jsonl",
        '{"prompt": null, "completion": "3"}\n',
        "data.jsonl, line 1: column 'prompt' holds nothing (null / empty)",
    ),
    "empty csv cell": ("data.csv", "prompt,completion\n1+2=,3\n4+4=,\n", "data.csv, line 3: column 'completion'"),
}


@pytest.mark.parametrize("name, text, needle", DATA_CASES.values(), ids=DATA_CASES.keys())
def test_bad_dataset_files_name_the_file_and_row(work, name, text, needle):
    (work / name).write_text(text)
    assert needle in error_line(treadle("train", write_config(work, dataset=name), cwd=work))


def _model_copy(model_dir, folder, *, drop=(), truncate=None):
    shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns(*drop))
    if truncate:
        data = (folder / truncate).read_bytes()
        (folder / truncate).write_bytes(data[: len(data) // 2])
    return folder


def test_model_folder_without_tokenizer_files(work, model_dir):
    model = _model_copy(model_dir, work / "m", drop=("tokenizer*", "special_tokens_map.json", "chat_template*"))
    assert "has no tokenizer files" in error_line(treadle("train", write_config(work, model=str(model)), cwd=work))


def test_truncated_safetensors(work, model_dir):
    model = _model_copy(model_dir, work / "m", truncate="model.safetensors")
    line = error_line(treadle("train", write_config(work, model=str(model)), cwd=work))
    assert "model.safetensors is truncated" in line and "save the model again" in line


def test_model_vocabulary_smaller_than_the_tokenizer(work, model_dir):
    from treadle.demos import toy

    small = work / "small"
    toy.build_model("tiny", vocab_size=16).save_pretrained(small)
    toy.build_tokenizer().save_pretrained(small)
    line = error_line(treadle("train", write_config(work, model=str(small)), cwd=work))
    assert "tokens but the model's embedding has 16 rows" in line and "resize_token_embeddings" in line


@pytest.mark.parametrize(
    "source, needle",
    [
        ("def reward(:\n    pass\n", "rewards.py line 1: invalid syntax"),
        ("1 / 0\n", "raised ZeroDivisionError: division by zero"),
    ],
)
def test_reward_file_that_does_not_import(work, source, needle):
    (work / "rewards.py").write_text(source)
    config = write_config(work, trainer="grpo", reward_funcs=["rewards.py:reward"], num_generations=2)
    assert needle in error_line(treadle("train", config, cwd=work))


def test_report_on_a_file(work):
    assert "is a file; treadle report takes a run folder" in error_line(treadle("report", "data.jsonl", cwd=work))


def test_report_on_a_metrics_file_reports_its_run(earlier_run):
    result = treadle("report", earlier_run / "metrics.jsonl", cwd=earlier_run.parent)
    assert result.returncode == 0 and "loss" in result.stdout, result.stderr[-3000:]


def test_debug_shows_the_traceback(work):
    for env, argv in (({"TREADLE_DEBUG": "1"}, ["train", "nope.yaml"]), ({}, ["--debug", "train", "nope.yaml"])):
        result = treadle(*argv, cwd=work, env=env)
        assert (
            result.returncode == 1
            and "Traceback" in result.stderr
            and "config file nope.yaml not found" in result.stderr
        )


# ---- against an earlier run: resume mismatches --------------------------------------------------------------
def test_resuming_sft_checkpoints_with_dpo_is_refused_by_name(work, earlier_run):
    shutil.copytree(earlier_run, work / "run")
    write_jsonl(work / "pairs.jsonl", [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}] * 8)
    before = snapshot(work / "run")
    config = write_config(work, trainer="dpo", dataset="pairs.jsonl")
    line = error_line(treadle("train", config, "--resume", cwd=work))
    assert "checkpoint run/checkpoint-2 was written by SFTTrainer, and this run is DPOTrainer" in line
    assert snapshot(work / "run") == before


def test_resume_mismatch_is_one_line(work, earlier_run):
    """--resume PATH picks that checkpoint (not the newest); another batch size cannot continue it exactly."""
    shutil.copytree(earlier_run, work / "run")
    before = snapshot(work / "run")
    argv = ["--resume", "run/checkpoint-1", "--per_device_train_batch_size", "2"]
    line = error_line(treadle("train", write_config(work, max_steps=3), *argv, cwd=work))
    assert "cannot resume 'run/checkpoint-1' exactly: train_batch_size: checkpoint 4 vs now 2" in line
    assert snapshot(work / "run") == before


def test_a_corrupt_checkpoint_is_one_line(work, earlier_run):
    shutil.copytree(earlier_run, work / "run")
    (work / "run" / "checkpoint-2" / "optimizer.pt").write_bytes(b"not a torch file")
    line = error_line(treadle("train", write_config(work, max_steps=3), "--resume", cwd=work))
    # the digests marker catches it first, naming the file and both ways on
    assert "checkpoint run/checkpoint-2 is not what was saved: optimizer.pt changed" in line
    assert "resume from another checkpoint" in line and "ignore_checkpoint_fingerprints" in line


# ---- runs that train -----------------------------------------------------------------------------------------
def test_the_plan_header_summary_and_length_notes(work):
    long_prompt = [{"prompt": "1+1+1+1+1+1+1+1+1+1+1+1+1+1=", "completion": "14"}] * 4
    write_jsonl(work / "data.jsonl", ROWS[:12] + long_prompt)
    result = treadle("train", write_config(work, max_steps=0, num_train_epochs=1, max_length=16), cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "steps   4 (num_train_epochs=1 x 4 steps per epoch, as max_steps=0 asks)" in result.stdout
    assert "137,984 parameters, 137,984 trainable" in result.stdout and "16 rows; 4 rows per step" in result.stdout
    assert "treadle: finished at step 4 of 4; train_loss=" in result.stdout
    assert "4 of 16 train rows are longer than max_length=16" in result.stderr


def test_a_completion_longer_than_max_length_is_refused(work):
    write_jsonl(work / "data.jsonl", [{"prompt": "1+2=", "completion": "3" * 40}] * 4)
    line = error_line(treadle("train", write_config(work, max_length=16), cwd=work))
    assert "4 train rows have a completion longer than max_length=16 by itself (row 0: 41 completion tokens" in line


@pytest.mark.slow
def test_a_nan_loss_stops_the_run_naming_the_step(work, model_dir):
    import torch
    from safetensors.torch import load_file, save_file

    model = _model_copy(model_dir, work / "m")
    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    line = error_line(treadle("train", write_config(work, model=str(model), save_steps=10), cwd=work))
    assert "the training loss became nan (step 1); the run stopped without saving after it" in line
    assert "skip_nonfinite_steps" in line and not (work / "run" / "checkpoint-1").exists()


@pytest.mark.slow
def test_overwrite_output_dir_deletes_exactly_the_run_files(work, earlier_run):
    shutil.copytree(earlier_run, work / "run")
    (work / "run" / "notes.txt").write_text("mine")
    result = treadle("train", write_config(work, max_steps=1, overwrite_output_dir=True), cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    (deleted,) = [line for line in result.stderr.splitlines() if "overwrite_output_dir: deleting" in line]
    names = deleted.split("entries of the earlier run in run: ")[1].split(", ")
    assert names[:2] == ["checkpoint-1", "checkpoint-2"] and "notes.txt" not in names
    assert {"config.json", "metrics.jsonl", "model.safetensors", "plots", "tokenizer.json"} <= set(names)
    assert (work / "run" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (work / "run").glob("checkpoint-*")) == ["checkpoint-1"]


@pytest.mark.slow
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_exits_128_plus_it_and_says_how_to_resume(work, signum, status):
    config = write_config(work, max_steps=500, save_steps=1000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "treadle", "train", str(config), "--max_steps", "500"],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **ENV},
    )
    for line in proc.stdout:  # the first logged step: training is under way
        if line.startswith("[step "):
            break
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == status, stderr[-3000:]
    assert "Traceback" not in stderr
    assert f"treadle: resume with: treadle train {config} --max_steps 500 --resume" in stderr
    (step,) = [int(p.name.split("-")[1]) for p in (work / "run").glob("checkpoint-*")]
    resumed = treadle("train", config, "--max_steps", step + 1, "--learning_rate", 0.002, "--resume", cwd=work)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"treadle: resuming from run/checkpoint-{step} at step {step} of {step + 1}; settings changed since: "
        f"learning_rate: 0.001 -> 0.002" in resumed.stderr
    )


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


@pytest.mark.slow
def test_a_reward_function_that_breaks_its_contract_is_one_line(work):
    (work / "rewards.py").write_text("def reward(completions, **kwargs):\n    return []\n")
    config = write_config(
        work, trainer="grpo", reward_funcs=["rewards.py:reward"], num_generations=2, max_completion_length=2
    )
    line = error_line(treadle("train", config, cwd=work))
    assert "reward function 'reward' returned 0 values for 4 completions at step" in line


# ---- in one process: the rules behind the messages -------------------------------------------------------------
def test_a_stale_lock_is_taken_over_and_a_live_one_refused(tmp_path, capsys):
    from treadle.record import runs

    lock = tmp_path / runs.LOCK_FILE
    with lock_held_by_another_process(tmp_path) as pid:
        with pytest.raises(runs.RunFolderError, match=rf"in use by another run \(pid {pid} on"):
            runs.acquire_lock(str(tmp_path))
        assert runs.lock_holder(str(tmp_path)).startswith(f"pid {pid} on {socket.gethostname()}")
    # SIGKILLed: the OS let go of the lock, and its file, naming the dead run, stays behind
    assert json.loads(lock.read_text())["pid"] == pid and runs.lock_holder(str(tmp_path)) is None
    held = runs.acquire_lock(str(tmp_path))
    assert f"taking over the lock {lock} of a run that no longer runs (pid {pid}" in capsys.readouterr().err
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    runs.release_lock(held)
    assert not lock.exists()  # a clean release leaves no lock file behind


def test_learning_rate_of_the_wrong_type_in_python():
    from treadle import TrainingArguments

    with pytest.raises(ValueError, match="learning_rate must be a number, got 'fast'"):
        TrainingArguments(learning_rate="fast")
    assert TrainingArguments(learning_rate="1e-3").learning_rate == 1e-3


def test_json_layouts(tmp_path):
    from treadle.cli.loading import load_dataset

    write_jsonl(tmp_path / "one.jsonl", ROWS[:1])  # one line: one row, never columns
    assert load_dataset(str(tmp_path / "one.jsonl")).to_list() == ROWS[:1]
    (tmp_path / "cols.json").write_text(json.dumps({"prompt": ["1+2=", "3+4="], "completion": ["3", "7"]}))
    assert load_dataset(str(tmp_path / "cols.json")).to_list() == [ROWS[0], ROWS[1]]
    (tmp_path / "n.csv").write_text("prompt,completion\n1+2=,3\n")  # a CSV is text: "3" stays "3"
    assert load_dataset(str(tmp_path / "n.csv")).to_list() == ROWS[:1]


def test_truncation_keeps_the_completion_and_cuts_the_prompt_from_the_left(capsys):
    from treadle.trainers.sft import truncate_rows

    rows = [
        ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 1, 1]),  # prompt 4, completion 2
        ([7, 8, 9], [0, 1, 1]),  # fits
        ([1, 2, 3, 4, 5, 6], [1, 1, 1, 1, 1, 1]),
    ]  # text: keeps its start
    assert truncate_rows(rows, 4) == [([3, 4, 5, 6], [0, 0, 1, 1]), rows[1], ([1, 2, 3, 4], [1, 1, 1, 1])]
    assert "2 of 3 train rows are longer than max_length=4" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"1 train rows have a completion longer than max_length=1 by itself"):
        truncate_rows(rows[:1], 1)


def test_skip_nonfinite_steps_skips_within_its_budget_then_stops(capsys):
    import torch

    from treadle.callbacks import TrainerState
    from treadle.errors import NonFiniteLossError
    from treadle.metrics import skip_nonfinite_step

    args, state = TrainingArgumentsStub(skip_nonfinite_steps=1), TrainerState(global_step=4)
    assert skip_nonfinite_step(torch.tensor(1.5), state, args) is False
    assert skip_nonfinite_step(torch.tensor(float("inf")), state, args) is True
    assert "step 5: the loss is not finite; step skipped (1 of skip_nonfinite_steps=1)" in capsys.readouterr().err
    with pytest.raises(
        NonFiniteLossError, match=r"NaN or infinite at step 5: 2 such steps, more than skip_nonfinite_steps=1"
    ):
        skip_nonfinite_step(torch.tensor(float("nan")), state, args)


class TrainingArgumentsStub:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def test_an_unwritable_output_dir_is_refused(tmp_path, monkeypatch):
    """Root (as in CI containers) writes anywhere, so the permission answer is faked: the rule is what counts."""
    from treadle.record import runs

    monkeypatch.setattr(runs.os, "access", lambda path, mode: False)
    with pytest.raises(runs.RunFolderError, match=r"output_dir .*/new/run is not writable \(.* refuses writes\)"):
        runs.check_run_folder(str(tmp_path / "new" / "run"), resume=False)


def test_evaluations_before_training_are_not_an_earlier_run(tmp_path):
    """evaluate() before train() logs at step 0 into metrics.jsonl; that alone does not make the folder a run's."""
    from treadle.record import runs

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "epoch": 0, "eval_loss": 1.0}) + "\n")
    assert runs.run_files(str(tmp_path)) == []
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 2, "epoch": 0.5, "loss": 1.0}) + "\n")
    assert runs.run_files(str(tmp_path)) == ["metrics.jsonl"]
