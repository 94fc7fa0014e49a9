"""report_to: each tracker really runs, offline, through transformers' own callback; what it stored is read back
with the tracker's own reader and compared with metrics.jsonl (and completions.jsonl) at the same steps.

One small GRPO run (evaluation, log_completions) reports to every installed tracker at once; nothing may leave
the machine: W&B runs offline, MLflow writes a local file store, Trackio a local database, and a guard refuses
any socket connection that is not local.
"""

import glob
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

import pytest
from _factories import digit_sum_reward, grpo_trainer

from treadle.arguments import TRACKERS, TrainingArguments, is_installed, resolve_report_to
from treadle.demos import toy
from treadle.record.plots import completions_table
from treadle.trackers import tracker_callbacks
from treadle.trainers.grpo.trainer import GRPOConfig

# Trackio reads its folder once, when first imported: point it at a temporary one before anything imports it
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="treadle-trackio-")

SUMMARY_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos")
STEPS, LOG_EVERY = 4, 2


# ------------------------------------------------------------------------------------------ report_to rules
def test_report_to_reads_like_transformers():
    assert TrainingArguments(report_to="none").report_to == []
    assert TrainingArguments(report_to=["none"]).report_to == []
    assert TrainingArguments(report_to="wandb").report_to == ["wandb"]
    assert TrainingArguments(report_to=["mlflow", "wandb", "mlflow"]).report_to == ["mlflow", "wandb"]
    assert TrainingArguments(report_to="all").report_to == [name for name in TRACKERS if is_installed(name)]


def test_an_unknown_tracker_is_refused_naming_the_valid_ones():
    with pytest.raises(
        ValueError,
        match=r"'neptune' is not a tracker treadle supports; use some of "
        r"\['comet_ml', 'mlflow', 'tensorboard', 'trackio', 'wandb'\]",
    ):
        TrainingArguments(report_to=["wandb", "neptune"])
    with pytest.raises(ValueError, match="report_to must be a tracker name or a list of them"):
        resolve_report_to(5)


def test_a_tracker_that_is_not_installed_is_refused_with_the_pip_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "comet_ml" else real(name, *a))
    args = TrainingArguments(report_to=["comet_ml"])  # a known name: the arguments take it
    with pytest.raises(ValueError, match=r"comet_ml, not installed; install with `pip install comet_ml`"):
        tracker_callbacks(args.report_to)


def test_wandb_log_model_end_is_refused(monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_LOG_MODEL", "end")
    with pytest.raises(ValueError, match="unset it, or use WANDB_LOG_MODEL=checkpoint"):
        tracker_callbacks(["wandb"])


# ------------------------------------------------------------------------------------------ one real run
def length_reward(completion_ids, **kwargs):  # not _factories' (len % 3): the lengths themselves
    return [float(len(ids)) for ids in completion_ids]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step GRPO run (logs and evaluations every 2 steps, completions logged) reported to every installed
    tracker, with every network connection refused."""
    trackers = [name for name in ("wandb", "mlflow", "trackio", "tensorboard") if is_installed(name)]
    if not trackers:
        pytest.skip("no tracker installed (pip install 'treadle[trackers,tensorboard]')")
    root = tmp_path_factory.mktemp("trackers")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(root),
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
        "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_DATA_DIR": str(root / "wandb-data"),
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_PROJECT": "treadle-test",
        "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "GRADIO_ANALYTICS_ENABLED": "False",
        "DO_NOT_TRACK": "1",
    }
    refused = []
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        patch.delenv("WANDB_LOG_MODEL", raising=False)
        patch.setattr(socket.socket, "connect", _local_only(socket.socket.connect, refused))
        trainer = grpo_trainer(
            root,
            toy.build_tokenizer(),
            toy.load_task("addition", kind="rl", n=16),
            [digit_sum_reward, length_reward],
            eval_dataset=toy.load_task("addition", kind="rl", n=2, seed=1),
            max_steps=STEPS,
            logging_steps=LOG_EVERY,
            eval_strategy="steps",
            log_completions=True,
            per_device_eval_batch_size=4,
            report_to=trackers,
            run_name="tracked",
        )
        trainer.train()
        if "wandb" in trackers:
            import wandb

            wandb.finish()
    assert not refused, f"a tracker tried the network: {refused}"
    events = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    completions = [json.loads(line) for line in (root / "run" / "completions.jsonl").read_text().splitlines()]
    return {"root": root, "events": events, "completions": completions, "args": trainer.args}


def _local_only(connect, refused):
    def guarded(sock, address):
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and host not in ("127.0.0.1", "::1", "localhost"):
            refused.append(address)
            raise OSError(f"test_trackers: no network ({address})")
        return connect(sock, address)

    return guarded


def expected_metrics(events) -> dict[tuple[str, int], float]:
    """(metric, step) -> value for every number in metrics.jsonl, under its metrics.jsonl name."""
    return {
        (key, event["step"]): value
        for event in events
        for key, value in event.items()
        if key not in ("step", "epoch") and isinstance(value, (int, float))
    }


def tracker_name(key: str) -> str:
    """transformers' rewrite_logs: eval_x -> eval/x, anything else -> train/x."""
    return f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"


def table_of_steps(completions, start, stop):
    return completions_table([r for r in completions if start <= r["step"] < stop])


def test_the_run_logged_what_the_trackers_must_receive(run):
    keys = {key for key, _ in expected_metrics(run["events"])}
    assert {
        "loss",
        "reward",
        "rewards/digit_sum_reward/mean",
        "rewards/length_reward/mean",
        "eval_reward",
        "train_runtime",
        "train_loss",
    } <= keys
    assert sorted({r["step"] for r in run["completions"]}) == [0, 1, 2, 3]


def test_wandb_offline_run_holds_config_metrics_summary_table_and_plots(run):
    pytest.importorskip("wandb")
    [path] = glob.glob(str(run["root"] / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = [
        json.loads(line)
        for line in subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", path],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.splitlines()
    ]
    config = {k: v for r in records if r["type"] == "config" for k, v in r["config"].get("update", {}).items()}
    for key, value in run["args"].to_dict().items():  # every argument
        assert config[key] == value, key
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    logged = {(name, row["train/global_step"]): value for row in history for name, value in row.items()}
    summary = {k: v for r in records if r["type"] == "summary" for k, v in r["summary"]["update"].items()}
    for (key, step), value in expected_metrics(run["events"]).items():
        if key in SUMMARY_KEYS:  # transformers puts the one-per-run values in the run's summary
            assert summary[key] == pytest.approx(value, rel=1e-9), key
        else:
            assert logged[(tracker_name(key), step)] == pytest.approx(value, rel=1e-9), (key, step)
    tables = {row["train/global_step"]: row["completions.path"] for row in history if "completions.path" in row}
    assert sorted(tables) == [2, 4]
    for step, relative in tables.items():
        with open(os.path.join(os.path.dirname(path), "files", relative)) as f:
            stored = json.load(f)
        columns, rows = table_of_steps(run["completions"], step - LOG_EVERY, step)
        assert stored["columns"] == columns and stored["data"] == rows
    assert {"plots/training.path", "plots/rewards.path"} <= set(summary)


def test_mlflow_file_store_holds_params_metrics_table_and_plots(run):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run["root"] / "mlruns").as_uri())
    [found] = client.search_runs(experiment_ids=["0"])
    params = found.data.params
    for key, value in run["args"].to_dict().items():
        assert params[key] == str(value), key
    for (key, step), value in expected_metrics(run["events"]).items():
        # MLflow's names allow only [0-9A-Za-z_-. :/]: transformers' callback writes eval_pass@1 as eval_pass_1
        name = re.sub(r"[^0-9A-Za-z_\-. :/]", "_", key)
        history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, name)}
        assert history[step] == pytest.approx(value, rel=1e-9), (key, step)
    artifacts = {a.path for a in client.list_artifacts(found.info.run_id, "completions")}
    assert artifacts == {"completions/step_000002.json", "completions/step_000004.json"}
    for step in (2, 4):
        local = client.download_artifacts(
            found.info.run_id, f"completions/step_{step:06d}.json", str(run["root"] / "downloads")
        )
        with open(local) as f:
            stored = json.load(f)
        columns, rows = table_of_steps(run["completions"], step - LOG_EVERY, step)
        assert stored == {"columns": columns, "data": rows}
    assert {"plots/training.png", "plots/rewards.png"} <= {
        a.path for a in client.list_artifacts(found.info.run_id, "plots")
    }


def test_tensorboard_events_hold_args_scalars_completions_and_plots(run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [logdir] = glob.glob(str(run["root"] / "run" / "runs" / "*"))
    events = EventAccumulator(logdir, size_guidance={"tensors": 0, "images": 0, "scalars": 0})
    events.Reload()
    args_text = events.Tensors("args/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(args_text) == json.loads(run["args"].to_json_string())
    for (key, step), value in expected_metrics(run["events"]).items():
        scalars = {s.step: s.value for s in events.Scalars(tracker_name(key))}
        assert scalars[step] == pytest.approx(value, rel=1e-6), (key, step)  # TensorBoard keeps float32
    texts = {t.step: t.tensor_proto.string_val[0].decode() for t in events.Tensors("completions/text_summary")}
    assert sorted(texts) == [2, 4]
    for step, text in texts.items():
        columns, rows = table_of_steps(run["completions"], step - LOG_EVERY, step)
        assert text.splitlines()[0] == "| " + " | ".join(columns) + " |" and len(text.splitlines()) == 2 + len(rows)
    assert {"plots/training", "plots/rewards"} <= set(events.Tags()["images"])


def test_trackio_local_database_holds_config_metrics_table_and_plots(run):
    pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    config = SQLiteStorage.get_run_config("huggingface", "tracked")
    for key, value in run["args"].to_dict().items():
        assert config[key] == value, key
    logs = SQLiteStorage.get_logs("huggingface", "tracked")
    logged = {(name, row["train/global_step"]): value for row in logs for name, value in row.items()}
    for (key, step), value in expected_metrics(run["events"]).items():
        if key not in SUMMARY_KEYS:  # transformers' TrackioCallback drops the one-per-run values
            assert logged[(tracker_name(key), step)] == pytest.approx(value, rel=1e-9), (key, step)
    tables = {row["train/global_step"]: row["completions"] for row in logs if "completions" in row}
    assert sorted(tables) == [2, 4]
    for step, stored in tables.items():
        columns, rows = table_of_steps(run["completions"], step - LOG_EVERY, step)
        assert [[r[c] for c in columns] for r in stored["_value"]] == rows
    assert any("plots/training" in row for row in logs)


# ------------------------------------------------------------------------------------------ TrackerMedia alone
class FakeExperiment:
    """Records what Comet's Experiment receives (comet_ml is not installed here: it needs an account)."""

    def __init__(self):
        self.calls = []

    def log_table(self, filename, tabular_data=None, headers=False):
        self.calls.append(("table", filename, tabular_data, headers))

    def log_image(self, image_data, name=None, step=None):
        self.calls.append(("image", image_data, name, step))


class FakeCometCallback:
    def __init__(self):
        self._experiment = FakeExperiment()


def write_completions(path, steps):
    with open(path, "a") as f:
        for step in steps:
            f.write(
                json.dumps(
                    {"step": step, "prompt": "p", "completion": str(step), "rewards": {"r": 1.0}, "advantage": 0.0}
                )
                + "\n"
            )


def test_media_sends_each_completion_once_and_rereads_the_file_after_a_resume(tmp_path):
    from treadle.callbacks import TrainerState
    from treadle.trackers import TrackerMedia

    comet = FakeCometCallback()
    media = TrackerMedia({"comet_ml": comet})
    args = GRPOConfig(output_dir=str(tmp_path), log_completions=True)
    state = TrainerState()
    media.on_train_begin(args, state, None)
    write_completions(tmp_path / "completions.jsonl", [0, 1])
    state.global_step = 2
    media.on_log(args, state, None, logs={"loss": 1.0})
    media.on_log(args, state, None, logs={"eval_loss": 1.0})  # the same step again: nothing new
    media.on_log(args.replace(log_completions=False), TrainerState(global_step=3), None, logs={"loss": 1.0})
    write_completions(tmp_path / "completions.jsonl", [2, 3])  # a step that crashed before its log
    state = TrainerState(global_step=2)  # resumed from the checkpoint of step 2: GRPO rewrites the file
    (tmp_path / "completions.jsonl").write_text("")
    write_completions(tmp_path / "completions.jsonl", [0, 1, 2, 3])
    media.on_train_begin(args, state, None)
    state.global_step = 4
    media.on_log(args, state, None, logs={"loss": 1.0})
    assert [(c[1], [row[0] for row in c[2]]) for c in comet._experiment.calls] == [
        ("completions_step_000002.csv", [0, 1]),
        ("completions_step_000004.csv", [2, 3]),
    ]
    assert comet._experiment.calls[0][3] == ["step", "prompt", "completion", "r", "advantage"]
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 2.0}) + "\n" + json.dumps({"step": 2, "loss": 1.0}) + "\n"
    )
    media.on_train_end(args, state, None)
    assert comet._experiment.calls[-1] == ("image", str(tmp_path / "plots" / "training.png"), "plots/training", 4)


def test_a_tracker_that_cannot_start_is_one_line_before_the_run_folder_is_written(tmp_path, monkeypatch, capsys):
    """MLflow 3 refuses a file store without MLFLOW_ALLOW_FILE_STORE: the preflight says so in one line, before
    training_args.json (or anything) is written, so the rerun with the setting needs no overwrite_output_dir."""
    pytest.importorskip("mlflow")
    from treadle.cli import command as cli

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    out = tmp_path / "run"
    argv = [
        "train",
        os.path.join(os.path.dirname(__file__), "..", "examples", "sft.yaml"),
        "--output_dir",
        str(out),
        "--max_steps",
        "1",
        "--report_to",
        "mlflow",
        "--disable_tqdm",
        "true",
        "--save_strategy",
        "no",
        "--eval_strategy",
        "no",
    ]
    assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("treadle: error")]
    assert len(err) == 1 and "report_to mlflow cannot start" in err[0] and "MLFLOW_ALLOW_FILE_STORE=true" in err[0]
    assert not out.exists() or not any(out.iterdir())  # nothing written: the run folder was never claimed
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert cli.main(argv) == 0, capsys.readouterr().err  # the same folder, no overwrite_output_dir
    assert (out / "metrics.jsonl").is_file() and (tmp_path / "mlruns").is_dir()
