"""Resuming a run from a checkpoint: which checkpoint, whether it continues this run exactly, and what the run
carries over besides the weights.

- ``resolve``: ``resume_from_checkpoint`` (True: the newest complete checkpoint; ``"auto"``: that or a fresh start;
  a path; None / False: a fresh start) as a checkpoint folder. A folder that is missing or incomplete is refused,
  naming the complete ones beside it.
- ``resumed_state``: the checkpoint's ``TrainerState``, checked against the current run's before anything is
  loaded: its files against its marker (``record.fingerprints``), the trainer class, the batch shape, the number
  of processes and the dataset. What would not continue the run exactly is refused (``CheckpointError``) and the
  model stays as it was; the run's length and cadence come from the current arguments, and the other settings that
  changed are named in a note.
- ``read_run_extra``: this rank's metrics window and trainer extra state, in today's layout whatever release wrote
  the checkpoint.

Reading and restoring the checkpoint's files (weights, optimizer, scheduler, RNG) is ``treadle.checkpoint``'s.
"""

from __future__ import annotations

import os
import sys

import torch

from treadle import distributed as dist
from treadle.checkpoint import (
    PREFIX,
    STATE_FILE,
    CheckpointError,
    check_own_checkpoint,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    load_extra_state,
    read_json,
    read_state,
)
from treadle.record import fingerprints
from treadle.record.runfiles import ARGS_FILE

AUTO = "auto"  # resume_from_checkpoint="auto": the newest complete checkpoint if there is one, else a fresh start


# ---------------------------------------------------------------------------------------------------------
# Which checkpoint
# ---------------------------------------------------------------------------------------------------------
def resolve(resume_from_checkpoint, output_dir: str, ignore_fingerprints: bool = False) -> str | None:
    """``True`` -> newest complete checkpoint in output_dir; ``"auto"`` -> the newest intact one (a corrupt one,
    whose files differ from its marker or whose state cannot be read, is skipped with a note naming it), or None
    when there is none (a fresh folder, or an attempt that crashed before its first checkpoint: an elastic worker
    or a restart loop starts or restarts with the same command); a path -> that folder (checked); None/False ->
    None. A checkpoint being written is never found: it lives in ``.tmp-checkpoint-<step>`` until it is complete,
    then is renamed into place. ``ignore_fingerprints`` (``ignore_checkpoint_fingerprints``): auto skips only
    checkpoints whose state cannot be read."""
    if resume_from_checkpoint in (None, False):
        return None
    path = _resolve(resume_from_checkpoint, output_dir, ignore_fingerprints)
    if path is not None:
        check_own_checkpoint(path)  # transformers' Trainer's: its weights start a new run
    return path


def _resolve(resume_from_checkpoint, output_dir: str, ignore_fingerprints: bool) -> str | None:
    if resume_from_checkpoint == AUTO:
        return _newest_intact(output_dir, ignore_fingerprints)
    if resume_from_checkpoint is True:
        path = latest_checkpoint(output_dir)
        if path is None:
            raise CheckpointError(
                f"resume_from_checkpoint=True but {output_dir!r} holds no complete checkpoint "
                f"(a folder named {PREFIX}<step> with {STATE_FILE}); start without resuming, or with --resume "
                f"auto (resume_from_checkpoint='auto'), which starts afresh in place of an attempt that saved none"
            )
        return path
    path = str(resume_from_checkpoint)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint folder {path!r} does not exist; {_complete_ones(path, output_dir)}")
    if not is_complete(path):
        raise CheckpointError(
            f"checkpoint {path!r} is incomplete (no {STATE_FILE}): it was interrupted while "
            f"being written; {_complete_ones(path, output_dir)}"
        )
    return path


def _newest_intact(output_dir: str, ignore_fingerprints: bool) -> str | None:
    """``"auto"``'s checkpoint: the newest complete one that is intact, each corrupt newer one skipped with a
    one-line note; None when there is no complete checkpoint; refused when every one is corrupt."""
    found = [path for _, path in reversed(list_checkpoints(output_dir))]
    for path in found:
        problem = _corruption(path, ignore_fingerprints)
        if problem is None:
            return path
        if dist.is_main_process():
            print(f"treadle: resume auto: skipping {path}: {problem}", file=sys.stderr)
    if found:
        raise CheckpointError(
            f"resume auto: every checkpoint in {output_dir} is corrupt (the newest, {found[0]}: "
            f"{_corruption(found[0], ignore_fingerprints)}); move them out of {output_dir} to start afresh, or set "
            f"ignore_checkpoint_fingerprints: true to resume anyway"
        )
    return None


def _corruption(path: str, ignore_fingerprints: bool) -> str | None:
    """Why checkpoint ``path`` cannot be resumed as saved (its files against its marker, its state), or None."""
    if not ignore_fingerprints and fingerprints.read_marker(path) is not None:
        problems = fingerprints.verify(path)
        if problems:
            return f"{'; '.join(problems[:3])} (not what was saved)"
    try:
        read_state(path)
    except CheckpointError as error:
        return str(error).split(";")[0]
    return None


def _complete_ones(path: str, output_dir: str) -> str:
    """Where to resume from instead of ``path``: the complete checkpoints beside it (or in ``output_dir``)."""
    parent = os.path.dirname(os.path.abspath(path))
    found = [p for _, p in list_checkpoints(parent if os.path.isdir(parent) else output_dir)]
    if not found:
        return f"no complete checkpoint is there ({parent}): start without resuming"
    names = ", ".join(os.path.basename(p) for p in found[-4:])
    return f"resume from a complete one there ({names}; --resume alone takes the newest, {found[-1]})"


# ---------------------------------------------------------------------------------------------------------
# Whether it continues this run
# ---------------------------------------------------------------------------------------------------------
RESUME_MUST_MATCH = ("train_batch_size", "gradient_accumulation_steps", "world_size", "steps_per_epoch")
MATCH_FIX = {  # what sets each of them, for the refusal
    "train_batch_size": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "world_size": "the number of processes: torchrun --nproc-per-node",
    "steps_per_epoch": "the training rows per epoch: the dataset, its length, packing or drop_last",
}
RUN_LENGTH_FIELDS = (
    "max_steps",
    "num_train_epochs",
    "logging_steps",
    "eval_steps",
    "save_steps",  # taken from the
    "is_world_process_zero",
    "is_local_process_zero",
    "config_fingerprint",  # new run, not the saved
    "dataset_fingerprint",
)  # one


def resumed_state(path: str, current, args=None, stream: bool = False):
    """The TrainerState to continue from checkpoint ``path``, checked against the ``current`` run's before
    anything is loaded: another Trainer class (an SFT run continued by DPO would mix two losses), or a
    different batch size, accumulation, number of processes or dataset length would not continue the run
    exactly, so it is refused (CheckpointError, naming what differs and the setting that restores it) and the
    model stays as it was. The run's length and cadence come from the current arguments (a resumed run may be
    asked to go further: a ``stream``'s one "epoch" is the whole run, so its steps per epoch follow
    ``max_steps``); other settings that changed (``args`` against the checkpoint's training_args.json) are
    named in a note."""
    _verify_files(path, args)  # the files first: trainer_state.json is read next
    state = read_state(path)
    if state.trainer_class and current.trainer_class and state.trainer_class != current.trainer_class:
        raise CheckpointError(
            f"checkpoint {path} was written by {state.trainer_class}, and this run is "
            f"{current.trainer_class}: resuming would mix two trainings; start a new run in "
            f"another output_dir from its weights (model: {path})"
        )
    _verify_files(
        path, args, getattr(current, "dataset_fingerprint", None)
    )  # then the data (another trainer's differs)
    differ = [name for name in RESUME_MUST_MATCH if getattr(state, name) != getattr(current, name)]
    if stream or len(differ) > 1:  # a stream's epoch is its run; another batch shape changes the steps per epoch
        differ = [name for name in differ if name != "steps_per_epoch"]
    mismatches = [
        f"{name}: checkpoint {getattr(state, name)} vs now {getattr(current, name)} ({MATCH_FIX[name]})"
        for name in differ
    ]
    if mismatches:
        raise CheckpointError(
            f"cannot resume {path!r} exactly: {'; '.join(mismatches)}; set them back to the checkpoint's, or "
            f"start a new run from its weights (model: {path})"
        )
    if state.max_steps and state.global_step >= state.max_steps and current.max_steps > state.max_steps:
        raise CheckpointError(
            f"checkpoint {path} ends a finished run of {state.max_steps} steps: its learning-rate "
            f"schedule was built for {state.max_steps} steps and is spent, so steps past it would "
            f"not train as asked (max_steps={current.max_steps}); start a new run from its "
            f"weights (model: {path}) with the steps you want"
        )
    for name in RUN_LENGTH_FIELDS + (("steps_per_epoch",) if stream else ()):
        setattr(state, name, getattr(current, name))
    if dist.is_main_process():
        _announce_resume(path, state, args)
    return state


def _verify_files(path: str, args, dataset: str | None = None) -> None:
    """Refuse a checkpoint whose files differ from its marker's digests (a swapped weights file, an edited
    trainer_state.json) or that trained on another ``dataset`` (fingerprints), unless
    ``args.ignore_checkpoint_fingerprints``; a checkpoint without a marker is read with the file checks alone."""
    if fingerprints.read_marker(path) is None or getattr(args, "ignore_checkpoint_fingerprints", False):
        return
    problems = fingerprints.verify(path, dataset)
    if problems:
        raise CheckpointError(
            f"checkpoint {path} is not what was saved: {'; '.join(problems[:3])}; resume from "
            f"another checkpoint, or set ignore_checkpoint_fingerprints: true to resume anyway"
        )


def _announce_resume(path: str, state, args) -> None:
    changed = []
    if args is not None and os.path.isfile(os.path.join(path, ARGS_FILE)):
        changed = fingerprints.changed_settings(read_json(os.path.join(path, ARGS_FILE), path), args)
    note = f"; settings changed since: {', '.join(changed)}" if changed else ""
    print(f"treadle: resuming from {path} at step {state.global_step} of {state.max_steps}{note}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------
# What the run carries over
# ---------------------------------------------------------------------------------------------------------
def read_run_extra(path: str, state) -> tuple[dict, dict | None]:
    """This rank's ``(metrics window state, trainer extra state)`` from checkpoint ``path``, whose
    ``TrainerState`` is ``state``.

    Checkpoints written before the metrics window (the first release) kept the unlogged loss in
    ``trainer_state.json`` (``_log_window``, already summed over ranks) and a trainer's extra state at the top of
    ``extra_state_<rank>.pt`` (GRPO: its buffers and its own metric sums): both are read into today's layout,
    so those runs resume exactly too."""
    extra = load_extra_state(path) or {}
    old_window = state.stateful_callbacks.pop("_log_window", None)
    if "metrics" in extra or "trainer" in extra:
        return extra.get("metrics", {}), extra.get("trainer")
    rows = dict(extra.pop("metric_sums", {}))  # name -> [sum, count] of this rank
    if old_window and dist.is_main_process():  # summed over ranks when saved: rank 0 carries it
        rows["loss"] = [old_window["loss_sum"], old_window["items"]]
    sums = torch.tensor([list(map(float, v)) for v in rows.values()], dtype=torch.float64).view(-1, 2)
    return ({"train": {"names": list(rows), "sums": sums}} if rows else {}), (extra or None)
