"""Experiment trackers (``report_to``): W&B, MLflow, Trackio, Comet and TensorBoard.

Each tracker is transformers' own integration callback (``transformers.integrations.WandbCallback``, ...),
run unchanged on treadle's Trainer: treadle's arguments and state carry the fields those callbacks read
(``project``, ``trackio_*``, ``hub_private_repo``; ``TrainerState.trial_name`` ...), so a run lands in the
tracker exactly where a transformers / TRL run of the same arguments would, under the same metric names
(``train/loss``, ``eval/loss``, ``train/rewards/<fn>/mean``). They send the config (every argument), every
logged metric at its step, evaluation metrics and the end-of-run summary.

``TrackerMedia`` sends what those callbacks do not:

- GRPO's sampled completions (``log_completions=True``): at every log, the rows written to
  ``completions.jsonl`` since the last one, as a table (step, prompt, completion, each reward, advantage):
  a W&B Table, a Trackio Table, an MLflow JSON artifact ``completions/step_<N>.json``, a TensorBoard text
  (markdown table), a Comet table;
- the run's plots (treadle.cli.report) as images when training ends.

A name that is not a tracker is refused when the arguments are built; a tracker that is not installed is refused
when the Trainer is built, before training, with the pip command that installs it. :func:`preflight` then opens
what a tracker needs that can fail on the user's settings (MLflow's tracking store), also when the Trainer is
built: before the run folder is claimed, so a tracker that cannot start is one line and leaves no file behind.
"""

from __future__ import annotations

import os

from treadle.arguments import TRACKERS, is_installed
from treadle.callbacks import TrainerCallback
from treadle.errors import PreflightError
from treadle.record import runfiles
from treadle.record.plots import completions_table, plot_run


def tracker_callbacks(report_to: list[str]) -> list:
    """The callbacks that report a run to ``report_to``'s trackers: ``TrackerMedia`` first (its images must reach
    a tracker before the tracker's own ``on_train_end`` closes the run), then transformers' callback of each.
    ValueError, with the pip command, for a tracker that is not installed."""
    missing = [name for name in report_to if not is_installed(name)]
    if missing:
        packages = " ".join(TRACKERS[name][1] for name in missing)
        raise ValueError(
            f"report_to asks for {', '.join(missing)}, not installed; install with "
            f"`pip install {packages}` (or `pip install 'treadle[trackers]'`), or drop it from report_to"
        )
    if "wandb" in report_to and os.environ.get("WANDB_LOG_MODEL", "false").lower() == "end":
        raise ValueError(
            "WANDB_LOG_MODEL=end builds a transformers.Trainer to save the model, which treadle's "
            "arguments cannot do; unset it, or use WANDB_LOG_MODEL=checkpoint"
        )
    if not report_to:
        return []
    preflight(report_to)
    from transformers import integrations

    trackers = {name: getattr(integrations, TRACKERS[name][2])() for name in report_to}
    return [TrackerMedia(trackers), *trackers.values()]


def preflight(report_to: list[str]) -> None:
    """Open what each tracker in ``report_to`` needs that the user's settings can break, before anything is
    written to the run folder; PreflightError (one line, with the working settings) when one cannot start.
    MLflow: its tracking store (``MLFLOW_TRACKING_URI``; MLflow 3 refuses a file store unless
    ``MLFLOW_ALLOW_FILE_STORE=true`` and needs a database driver for its default ``sqlite:`` store)."""
    if "mlflow" in report_to:
        from mlflow import MlflowClient  # optional tracker, imported only when asked for

        try:
            MlflowClient().search_experiments(max_results=1)  # builds the store as mlflow.start_run would
        except Exception as error:  # mlflow raises several types (MlflowException, registry and driver errors)
            uri = os.environ.get("MLFLOW_TRACKING_URI") or "mlflow's default (sqlite:///mlflow.db)"
            raise PreflightError(
                f"report_to mlflow cannot start with tracking URI {uri}: {_first_line(error)}; set "
                f"MLFLOW_TRACKING_URI to a server (http://host:5000), or to a folder (file:./mlruns) together with "
                f"MLFLOW_ALLOW_FILE_STORE=true, or drop mlflow from report_to (docs/trackers.md)"
            ) from None


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class TrackerMedia(TrainerCallback):
    """GRPO's sampled completions (a table at every log) and the run's plots (images at the end) for the trackers
    in ``trackers`` (report_to name -> that tracker's transformers callback, which holds its run)."""

    def __init__(self, trackers: dict):
        self.trackers = trackers
        self.tabled_step = 0  # completions sampled before this step have been sent
        self.offset = 0  # bytes of completions.jsonl already read

    def on_train_begin(self, args, state, control, **kwargs):
        # a resumed run rewrites completions.jsonl (records from its step on are dropped): read it from the start
        self.tabled_step, self.offset = state.global_step, 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if (
            not getattr(args, "log_completions", False)
            or not state.is_world_process_zero
            or state.global_step <= self.tabled_step
        ):
            return  # (a run without log_completions may share its folder with an older run's completions)
        rows = self._new_completions(args.output_dir, state.global_step)
        self.tabled_step = state.global_step
        if rows:
            table = completions_table(rows)
            for name, callback in self.trackers.items():
                SENDERS[name].table(callback, table, state.global_step)

    def _new_completions(self, output_dir: str, step: int) -> list[dict]:
        """The completions.jsonl records sampled in [tabled_step, step) (a record's step is the global step
        before the optimizer step that trains on it)."""
        records, self.offset = runfiles.read_new_entries(
            os.path.join(output_dir, runfiles.COMPLETIONS_FILE), self.offset
        )
        return [r for r in records if self.tabled_step <= r.get("step", -1) < step]

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        try:
            paths = plot_run(args.output_dir)
        except ValueError:  # nothing logged: no plots
            return
        for name, callback in self.trackers.items():
            SENDERS[name].images(callback, paths, state.global_step)


# ---------------------------------------------------------------------------------------------------------
# How each tracker receives a table and images (through the run its transformers callback holds)
# ---------------------------------------------------------------------------------------------------------
class _Wandb:
    @staticmethod
    def table(callback, table, step):
        wandb = callback._wandb
        if wandb.run is not None:
            columns, rows = table
            wandb.log({"completions": wandb.Table(columns=columns, data=rows), "train/global_step": step})

    @staticmethod
    def images(callback, paths, step):
        wandb = callback._wandb
        if wandb.run is not None:
            wandb.log({f"plots/{p.stem}": wandb.Image(str(p)) for p in paths} | {"train/global_step": step})


class _Mlflow:
    @staticmethod
    def table(callback, table, step):
        mlflow = callback._ml_flow
        if mlflow.active_run() is not None:
            columns, rows = table
            mlflow.log_dict({"columns": columns, "data": rows}, f"completions/step_{step:06d}.json")

    @staticmethod
    def images(callback, paths, step):
        mlflow = callback._ml_flow
        if mlflow.active_run() is not None:
            for path in paths:
                mlflow.log_artifact(str(path), artifact_path="plots")


class _Trackio:
    @staticmethod
    def table(callback, table, step):
        if callback._initialized:
            columns, rows = table
            callback._trackio.log(
                {"completions": callback._trackio.Table(columns=columns, data=rows), "train/global_step": step}
            )

    @staticmethod
    def images(callback, paths, step):
        if callback._initialized:
            trackio = callback._trackio
            trackio.log({f"plots/{p.stem}": trackio.Image(str(p)) for p in paths} | {"train/global_step": step})


class _Comet:
    @staticmethod
    def table(callback, table, step):
        if callback._experiment is not None:
            columns, rows = table
            callback._experiment.log_table(f"completions_step_{step:06d}.csv", tabular_data=rows, headers=columns)

    @staticmethod
    def images(callback, paths, step):
        if callback._experiment is not None:
            for path in paths:
                callback._experiment.log_image(str(path), name=f"plots/{path.stem}", step=step)


class _TensorBoard:
    @staticmethod
    def table(callback, table, step):
        if callback.tb_writer is not None:
            callback.tb_writer.add_text("completions", markdown_table(*table), step)
            callback.tb_writer.flush()

    @staticmethod
    def images(callback, paths, step):
        if callback.tb_writer is not None:
            from matplotlib.image import imread

            for path in paths:
                callback.tb_writer.add_image(f"plots/{path.stem}", imread(path)[..., :3], step, dataformats="HWC")
            callback.tb_writer.flush()


SENDERS = {"wandb": _Wandb, "mlflow": _Mlflow, "trackio": _Trackio, "comet_ml": _Comet, "tensorboard": _TensorBoard}


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A markdown table (TensorBoard's text plugin renders it); ``|`` and newlines in cells are escaped.

    >>> print(markdown_table(["a", "b"], [[1, "x|y"]]))
    | a | b |
    |---|---|
    | 1 | x\\|y |
    """

    def cell(value):
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
