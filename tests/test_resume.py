"""Tests for exact resume and preemption (Trainer.train(resume_from_checkpoint), SIGTERM, SIGKILL mid-save).

Every run is the tiny run of tests/_resume_worker.py: a Llama with attention dropout, 22 variable-length rows
shuffled by the seeded sampler, micro-batches of 2, gradient accumulation 2 (6 optimizer steps per epoch, the
last with a single micro-batch), a linear schedule with warm-up, clipping, 9 steps in all. A run interrupted
and resumed must match the uninterrupted run bit for bit: the logged losses, the final train_loss and every
weight (torch.equal).

The fast tests resume in the same process; the slow ones run real processes (SIGKILL while a checkpoint is
being written, SIGTERM during a step, a clean stop) and resume each in a new process.

What a resume verifies before it continues, and ``--resume auto``, run tiny SFT runs (_factories) and hand-made
checkpoints: a checkpoint whose files changed since they were saved, a finished schedule, another dataset, a mismatch
named by the setting that restores it, the messages that name a fix, and ``--resume auto`` starting afresh where no
checkpoint was saved and skipping a corrupt newest one (docs/runs.md lists the trial cases).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import _resume_worker as worker
import pytest
import torch
from _factories import sft, sft_trainer, write
from safetensors.torch import load_file

from treadle import checkpoint as ckpt, resume
from treadle.callbacks import TrainerCallback
from treadle.checkpoint import CheckpointError
from treadle.data import SeededSampler
from treadle.errors import Interrupted, Preempted
from treadle.record import fingerprints, runs
from treadle.state import TrainerState
from treadle.streaming import dataset_fingerprint
from treadle.trainer import Trainer

WORKER = os.path.join(os.path.dirname(__file__), "_resume_worker.py")
LOG_EVERY_STEP = {"logging_steps": 1}
LOG_WINDOWS = {"logging_steps": 4, "save_steps": 3}  # checkpoints at 3, 6 fall inside logging windows


def in_process(spec: dict):
    """Run the worker's training in this process (the worker pins one thread: put ours back afterwards)."""
    threads = torch.get_num_threads()
    try:
        return worker.run(spec)
    finally:
        torch.set_num_threads(threads)


def losses(log_history: list[dict]) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in log_history if "loss" in h}


def train_loss(log_history: list[dict]) -> float:
    (value,) = [h["train_loss"] for h in log_history if "train_loss" in h]
    return value


def same_weights(model, state: dict) -> bool:
    own = model.state_dict()
    return set(own) == set(state) and all(torch.equal(own[k], state[k]) for k in own)


def metrics_file(output_dir) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted runs, never checkpointed: one logging every step, one logging every 4 steps."""
    root = tmp_path_factory.mktemp("reference")
    return {
        "every_step": in_process({"output_dir": str(root / "a"), "save_strategy": "no", **LOG_EVERY_STEP}),
        "windows": in_process({"output_dir": str(root / "b"), "save_strategy": "no", **LOG_WINDOWS}),
    }


# ---------------------------------------------------------------------------------------- in one process
def test_dropout_is_live_so_the_rng_matters():
    model = worker.make_model().train()
    ids = torch.tensor([worker.make_rows()[0]["input_ids"]])
    assert not torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def carried_loss_items(checkpoint: str) -> float:
    """The loss items of the unlogged window that checkpoint (rank 0) carries in its metrics window."""
    window = ckpt.load_extra_state(checkpoint)["metrics"]["train"]
    return float(window["sums"][window["names"].index("loss"), 1])


def window_items(steps: list[int]) -> int:
    """Label tokens (shifted by one) in the given optimizer steps, rebuilt from the seeded data order."""
    rows = worker.make_rows()
    batch, accum = worker.ARGS["per_device_train_batch_size"], worker.ARGS["gradient_accumulation_steps"]
    batches_per_epoch = -(-len(rows) // batch)
    steps_per_epoch = -(-batches_per_epoch // accum)
    total = 0
    for step in steps:
        epoch, step_in_epoch = divmod(step - 1, steps_per_epoch)
        sampler = SeededSampler(len(rows), seed=worker.ARGS["seed"])
        sampler.set_epoch(epoch)
        order = sampler.indices()
        for i in order[step_in_epoch * batch * accum : (step_in_epoch + 1) * batch * accum]:
            total += sum(label != -100 for label in rows[i]["labels"][1:])
    return total


def test_resume_in_the_same_process_continues_exactly(tmp_path, reference):
    ref = reference["windows"]
    out = str(tmp_path / "run")
    in_process({"output_dir": out, "stop_at": 3, **LOG_WINDOWS})
    # steps 1-3 were not logged yet when checkpoint-3 was written: their loss travels in the checkpoint
    assert carried_loss_items(os.path.join(out, "checkpoint-3")) == window_items([1, 2, 3])
    resumed = in_process({"output_dir": out, "resume": True, **LOG_WINDOWS})
    assert list(losses(ref.state.log_history)) == [4, 8, 9]
    assert losses(resumed.state.log_history) == losses(ref.state.log_history)
    assert train_loss(resumed.state.log_history) == train_loss(ref.state.log_history)
    assert same_weights(resumed.model, ref.model.state_dict())


def test_without_the_rng_state_the_resumed_run_differs(tmp_path, reference, monkeypatch):
    """The control for the exactness tests: skipping one piece of the restore is caught."""
    out = str(tmp_path / "run")
    in_process({"output_dir": out, "stop_at": 6, **LOG_WINDOWS})
    monkeypatch.setattr(ckpt, "set_rng_state", lambda state: None)
    resumed = in_process({"output_dir": out, "resume": True, **LOG_WINDOWS})
    assert losses(resumed.state.log_history)[8] != losses(reference["windows"].state.log_history)[8]
    assert not same_weights(resumed.model, reference["windows"].model.state_dict())


def test_a_checkpoint_at_an_epoch_end_holds_what_the_epoch_end_logged(tmp_path):
    """Logging once per epoch, checkpointing at the epoch's last step: the epoch's loss, logged by
    on_epoch_end, must be in the checkpoint, or the resumed run logs it again inside the next window."""
    epochly = {"logging_strategy": "epoch", "save_steps": 6}
    ref = in_process({"output_dir": str(tmp_path / "ref"), **epochly, "save_strategy": "no"})
    out = str(tmp_path / "run")
    in_process({"output_dir": out, "stop_at": 6, **epochly})
    resumed = in_process({"output_dir": out, "resume": True, **epochly})
    assert list(losses(ref.state.log_history)) == [6, 9]  # the end of epoch 0, then the end of the run
    assert losses(resumed.state.log_history) == losses(ref.state.log_history)
    assert train_loss(resumed.state.log_history) == train_loss(ref.state.log_history)
    records = metrics_file(out)
    assert {r["step"]: r["loss"] for r in records if "loss" in r} == losses(ref.state.log_history)
    assert [r["step"] for r in records if "loss" in r] == [6, 9]
    assert [r["step"] for r in records if "train_loss" in r] == [9]  # the stopped process's summary is gone


class _SignalSelf(TrainerCallback):
    """Sends ``signum`` to this very process ``times`` times between the two micro-batches of ``step``."""

    def __init__(self, step: int, signum: int, times: int = 1):
        self.step, self.signum, self.times = step, signum, times
        self.train_end_steps = []

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)

    def on_train_end(self, args, state, control, **kwargs):
        self.train_end_steps.append(state.global_step)


@pytest.mark.parametrize(
    "signum, save_only_model, raised",
    [(signal.SIGTERM, False, Preempted), (signal.SIGINT, True, Interrupted)],
    ids=["SIGTERM", "Ctrl-C with save_only_model"],
)
def test_a_signal_mid_step_checkpoints_that_step_then_raises(
    tmp_path, reference, capsys, signum, save_only_model, raised
):
    """SIGTERM raises Preempted (a SystemExit with code 143), Ctrl-C Interrupted (a KeyboardInterrupt): never a
    SystemExit(0) that would tell a script or an orchestrator the run had finished."""
    out = str(tmp_path / "run")
    sender = _SignalSelf(4, signum)
    handler_before = signal.getsignal(signum)
    trainer = Trainer(
        worker.make_model(),
        worker.make_args(out, save_only_model=save_only_model),
        train_dataset=worker.make_rows(),
        callbacks=[sender],
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as worker.run, to compare with the reference
    try:
        with pytest.raises(raised) as stopped:
            trainer.train()
    finally:
        torch.set_num_threads(threads)
    assert stopped.value.exit_status == 128 + signum and stopped.value.step == 4
    assert stopped.value.checkpoint == os.path.join(out, "checkpoint-4")
    assert (stopped.value.code == 143) if signum == signal.SIGTERM else not isinstance(stopped.value, SystemExit)
    assert sender.train_end_steps == [4]  # on_train_end fired after step 4, no step 5 begun
    assert signal.getsignal(signum) is handler_before  # the Trainer's handler is gone
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [4]
    assert os.path.isfile(os.path.join(out, "checkpoint-4", "optimizer.pt"))  # resumable, whatever the setting
    err = capsys.readouterr().err
    assert f"stopped by {signal.Signals(signum).name} after step 4" in err and "resume_from_checkpoint=True" in err
    resumed = in_process({"output_dir": out, "resume": True})
    ref = reference["every_step"]
    assert losses(resumed.state.log_history) == losses(ref.state.log_history)
    assert same_weights(resumed.model, ref.model.state_dict())


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    out = str(tmp_path / "run")
    handler_before = signal.getsignal(signal.SIGINT)
    trainer = Trainer(
        worker.make_model(),
        worker.make_args(out),
        train_dataset=worker.make_rows(),
        callbacks=[_SignalSelf(2, signal.SIGINT, times=2)],
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.state.global_step == 1 and ckpt.list_checkpoints(out) == []
    assert signal.getsignal(signal.SIGINT) is handler_before


@pytest.fixture(scope="module")
def stopped_at_2(tmp_path_factory):
    out = tmp_path_factory.mktemp("stopped") / "run"
    in_process({"output_dir": str(out), "stop_at": 2, "save_steps": 2})
    return out


@pytest.mark.parametrize(
    "change, message",
    [
        ({"per_device_train_batch_size": 4}, r"train_batch_size: checkpoint 2 vs now 4"),
        ({"gradient_accumulation_steps": 1}, r"gradient_accumulation_steps: checkpoint 2 vs now 1"),
    ],
)
def test_resuming_with_another_batch_shape_is_refused(stopped_at_2, tmp_path, change, message):
    shutil.copytree(stopped_at_2, tmp_path / "run")
    trainer = Trainer(
        worker.make_model(seed=5), worker.make_args(str(tmp_path / "run"), **change), train_dataset=worker.make_rows()
    )
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint-2.*{message} \(.*\); set them back"):
        trainer.train(resume_from_checkpoint=True)
    assert same_weights(trainer.model, before)  # refused before anything was loaded


def test_resuming_with_another_world_size_is_refused(stopped_at_2, tmp_path):
    shutil.copytree(stopped_at_2, tmp_path / "run")
    state_file = tmp_path / "run" / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["world_size"] = 2  # as if written by a 2-process torchrun job
    state_file.write_text(json.dumps(state))
    fingerprints.write_marker(str(state_file.parent))  # a real 2-process checkpoint's digests match its files
    trainer = Trainer(worker.make_model(), worker.make_args(str(tmp_path / "run")), train_dataset=worker.make_rows())
    with pytest.raises(ckpt.CheckpointError, match=r"world_size: checkpoint 2 vs now 1"):
        trainer.train(resume_from_checkpoint=True)


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    """Resuming from an older checkpoint while later ones exist: the new save is not the highest step, yet it
    must survive rotation (and so must the highest one)."""
    out = str(tmp_path / "run")
    in_process({"output_dir": out, "save_steps": 2, "stop_at": 8})
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [2, 4, 6, 8]
    args = worker.make_args(out, save_steps=3, save_total_limit=1)
    trainer = Trainer(worker.make_model(), args, train_dataset=worker.make_rows(), callbacks=[_StopAt(3)])
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    assert [s for s, _ in ckpt.list_checkpoints(out)] == [3, 8]


class _StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


# -------------------------------------------------------------------------------- what a resume verifies
def saved_state(folder: Path, **fields) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    TrainerState(train_batch_size=4, steps_per_epoch=4, **fields).save_to_json(str(folder / ckpt.STATE_FILE))
    write(folder / "model.safetensors", "weights")
    fingerprints.write_marker(str(folder))
    return folder


@pytest.mark.parametrize(
    "tamper, needle",
    [
        (lambda f: write(f / "model.safetensors", "an earlier checkpoint's weights"), "model.safetensors changed"),
        (lambda f: write(f / ckpt.STATE_FILE, json.dumps({"global_step": 99})), "trainer_state.json changed"),
        (lambda f: os.remove(f / "model.safetensors"), "model.safetensors is missing"),
    ],
)
def test_resume_refuses_a_checkpoint_that_is_not_what_was_saved(tmp_path, tamper, needle):
    folder = saved_state(tmp_path / "checkpoint-2", global_step=2, max_steps=5)
    current = TrainerState(train_batch_size=4, steps_per_epoch=4, max_steps=5)
    tamper(folder)
    with pytest.raises(ckpt.CheckpointError, match=f"is not what was saved: {needle}.*ignore_checkpoint_fingerprints"):
        resume.resumed_state(str(folder), current, SimpleNamespace(ignore_checkpoint_fingerprints=False))
    if needle == "model.safetensors changed":  # the override, named in the message, resumes
        state = resume.resumed_state(str(folder), current, SimpleNamespace(ignore_checkpoint_fingerprints=True))
        assert state.max_steps == 5


def test_resume_past_a_finished_schedule_is_refused_with_the_reason(tmp_path):
    folder = saved_state(tmp_path / "checkpoint-3", global_step=3, max_steps=3)
    current = TrainerState(train_batch_size=4, steps_per_epoch=4, max_steps=5)
    with pytest.raises(
        ckpt.CheckpointError, match="ends a finished run of 3 steps: its learning-rate schedule was built for 3 steps"
    ):
        resume.resumed_state(str(folder), current)
    unfinished = saved_state(tmp_path / "checkpoint-2", global_step=2, max_steps=3)
    assert resume.resumed_state(str(unfinished), current).max_steps == 5  # going further mid-run is allowed


def test_fingerprints_see_a_swapped_file_and_a_different_dataset(tmp_path):
    write(tmp_path / "a.bin", "one")
    fingerprints.write_marker(str(tmp_path), dataset=dataset_fingerprint([{"x": 1}]))
    assert fingerprints.verify(str(tmp_path), dataset_fingerprint([{"x": 1}])) == []
    write(tmp_path / "b.bin", "two")
    assert fingerprints.verify(str(tmp_path), dataset_fingerprint([{"x": 2}])) == [
        "b.bin was added",
        "the training dataset differs from the one it trained on (other rows)",
    ]


def test_resume_into_another_dataset_of_the_same_length_is_refused(tmp_path):
    first = [{"prompt": f"{a}+1=", "completion": str(a + 1)} for a in range(4)]
    other = [{"prompt": f"{a}+2=", "completion": str(a + 2)} for a in range(4)]
    sft(tmp_path, first, save_strategy="steps", save_steps=1).train()
    checkpoint = str(tmp_path / "run" / "checkpoint-1")
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"checkpoint-1 is not what was saved: the training dataset differs "
        r"from the one it trained on .*ignore_checkpoint_fingerprints",
    ):
        sft(tmp_path, other, save_strategy="steps", save_steps=1).train(resume_from_checkpoint=checkpoint)
    sft(tmp_path, first, save_strategy="steps", save_steps=1).train(
        resume_from_checkpoint=checkpoint
    )  # the same: fine
    sft(tmp_path, other, save_strategy="steps", save_steps=1, ignore_checkpoint_fingerprints=True).train(
        resume_from_checkpoint=checkpoint
    )  # the override named in the message


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


def test_messages_that_were_wrong_or_gave_no_fix_now_name_one(tmp_path, monkeypatch):
    from types import SimpleNamespace as NS

    import torch
    from safetensors.torch import save_file

    from treadle.cli.loading import load_reward_funcs
    from treadle.data import plan_steps
    from treadle.errors import PreflightError

    run = tmp_path / "run"
    saved_state(run / "checkpoint-1", global_step=1, max_steps=5)
    (run / "checkpoint-3").mkdir()  # interrupted while being written
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"does not exist; resume from a complete one there \(checkpoint-1; "
        r"--resume alone takes the newest",
    ):
        resume.resolve(str(run / "checkpoint-9"), str(run))
    lone = tmp_path / "lone" / "checkpoint-2"
    lone.mkdir(parents=True)
    with pytest.raises(
        ckpt.CheckpointError, match="is incomplete .*no complete checkpoint is there .*start without resuming"
    ):  # was "resume from an earlier one, e.g. None"
        resume.resolve(str(lone), str(lone.parent))
    write(run / "checkpoint-1" / ckpt.STATE_FILE, "{not json")
    with pytest.raises(ckpt.CheckpointError, match="the file is corrupt: resume from an earlier checkpoint"):
        ckpt.read_state(str(run / "checkpoint-1"))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ckpt.CheckpointError, match="has no weights file .*resume from another checkpoint"):
        ckpt.load_weights(model, str(lone))
    save_file({"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}, str(lone / "model.safetensors"))
    with pytest.raises(ckpt.CheckpointError, match="shapes differ.*load them into the model they were saved from"):
        ckpt.load_weights(model, str(lone))
    write(tmp_path / "rewards.py", "def length(completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(ValueError, match=r"has no function 'lenght'; its functions: \['length'\]"):
        load_reward_funcs(["rewards.py:lenght"], base_dir=tmp_path)
    with pytest.raises(
        PreflightError, match="give more rows, a smaller per_device_train_batch_size, or dataloader_drop_last: false"
    ):
        plan_steps(
            torch.utils.data.DataLoader([1, 2], batch_size=4, drop_last=True),
            NS(gradient_accumulation_steps=1, max_steps=1),
        )


# ----------------------------------------------------------------------------------------- --resume auto
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


# -------------------------------------------------------------------------------------- in new processes
def launch(spec: dict, name: str, folder) -> subprocess.Popen:
    path = folder / f"{name}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    out, err = open(folder / f"{name}.out", "w"), open(folder / f"{name}.err", "w")
    proc = subprocess.Popen([sys.executable, WORKER, str(path)], stdout=out, stderr=err, env=env)
    proc.log = folder / f"{name}.err"
    return proc


def wait_for(path, proc, timeout=300.0) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"worker exited ({proc.returncode}) before {path}:\n{proc.log.read_text()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"no {path} after {timeout}s")
        time.sleep(0.05)


def finish(proc, timeout=300.0) -> int:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode


def read_json(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, reference):
    """Two runs interrupted in a process of their own, then resumed (resume_from_checkpoint=True) in another:

    ``kill``  logs every step, checkpoints every 4; SIGKILL while checkpoint-8 is being written: resumes from 4
    ``term``  logs every 4 steps, checkpoints every 3; SIGTERM between the two micro-batches of step 7: it
              finishes step 7 and checkpoints it with the loss of steps 5-7 not yet logged; resumes from 7
    """
    root = tmp_path_factory.mktemp("interrupted")
    dirs = {name: root / name for name in ("kill", "term")}
    first = {
        "kill": {"save_steps": 4, "hang_in_save_at": 8, "marker": str(root / "kill.saving"), **LOG_EVERY_STEP},
        "term": {"sigterm_at": 7, "marker": str(root / "term.ready"), "go": str(root / "term.go"), **LOG_WINDOWS},
    }
    second = {"kill": {"save_steps": 4, **LOG_EVERY_STEP}, "term": LOG_WINDOWS}
    procs = {
        name: launch(
            {"output_dir": str(dirs[name]), "result": str(root / f"{name}.first.json"), **spec}, f"{name}.first", root
        )
        for name, spec in first.items()
    }
    seen = {name: {} for name in first}

    wait_for(first["term"]["marker"], procs["term"])
    procs["term"].send_signal(signal.SIGTERM)
    open(first["term"]["go"], "w").close()

    wait_for(first["kill"]["marker"], procs["kill"])
    seen["kill"]["checkpoint-4 before"] = _digest(dirs["kill"] / "checkpoint-4")
    procs["kill"].send_signal(signal.SIGKILL)

    for name, proc in procs.items():
        seen[name]["returncode"] = finish(proc)
        seen[name]["stderr"] = proc.log.read_text()
        seen[name]["listing"] = sorted(os.listdir(dirs[name]))
        seen[name]["checkpoints"] = [s for s, _ in ckpt.list_checkpoints(str(dirs[name]))]
    seen["kill"]["tmp listing"] = sorted(os.listdir(dirs["kill"] / ".tmp-checkpoint-8"))
    seen["kill"]["checkpoint-4 after"] = _digest(dirs["kill"] / "checkpoint-4")
    seen["term"]["first"] = read_json(root / "term.first.json")
    seen["term"]["carried_items"] = carried_loss_items(str(dirs["term"] / "checkpoint-7"))

    procs = {
        name: launch(
            {"output_dir": str(dirs[name]), "resume": True, "result": str(root / f"{name}.second.json"), **spec},
            f"{name}.second",
            root,
        )
        for name, spec in second.items()
    }
    for name, proc in procs.items():
        code = finish(proc)
        assert code == 0, f"{name} resume failed:\n{proc.log.read_text()[-3000:]}"
        seen[name]["second"] = read_json(root / f"{name}.second.json")
        seen[name]["final"] = load_file(dirs[name] / "final" / "model.safetensors")
        seen[name]["metrics"] = metrics_file(dirs[name])
        seen[name]["listing after"] = sorted(os.listdir(dirs[name]))
    return seen


def _digest(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


@pytest.mark.slow
def test_sigkill_during_a_save_leaves_earlier_checkpoints_and_no_complete_folder(interrupted):
    kill = interrupted["kill"]
    assert kill["returncode"] == -signal.SIGKILL
    # the killed run's lock stays behind; the resumed process takes it over (a dead pid of this machine)
    assert kill["listing"] == [
        ".tmp-checkpoint-8",
        ".treadle-run.json",
        ".treadle.lock",
        "checkpoint-4",
        "metrics.jsonl",
        "run.json",
        "training_args.json",
    ]
    assert "model.safetensors" in kill["tmp listing"] and "trainer_state.json" not in kill["tmp listing"]
    assert kill["checkpoints"] == [4]  # what resume_from_checkpoint=True picks
    assert kill["checkpoint-4 after"] == kill["checkpoint-4 before"]
    # the resumed process cleared the debris and checkpointed at 8 (save_steps) and 9 (the end)
    assert kill["listing after"] == [
        ".treadle-run.json",
        "checkpoint-4",
        "checkpoint-8",
        "checkpoint-9",
        "final",
        "metrics.jsonl",
        "run.json",
        "training_args.json",
    ]


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_143(interrupted):
    term = interrupted["term"]
    assert term["returncode"] == 143  # 128 + SIGTERM: an orchestrator sees a preempted job, not a finished one
    assert term["first"]["steps"] == [1, 2, 3, 4, 5, 6, 7]  # step 7 was finished, no step 8 begun
    assert term["first"]["train_end_step"] == 7  # on_train_end fired
    assert term["checkpoints"] == [3, 6, 7]
    assert term["listing"] == [
        ".treadle-run.json",
        "checkpoint-3",
        "checkpoint-6",
        "checkpoint-7",
        "metrics.jsonl",
        "run.json",
        "training_args.json",
    ]
    assert "stopped by SIGTERM after step 7" in term["stderr"]
    assert "checkpoint-7" in term["stderr"] and "resume_from_checkpoint=True" in term["stderr"]


@pytest.mark.slow
@pytest.mark.parametrize("name, resumed_steps", [("kill", [5, 6, 7, 8, 9]), ("term", [8, 9])])
def test_a_new_process_continues_bit_for_bit(interrupted, reference, name, resumed_steps):
    ref = reference["every_step" if name == "kill" else "windows"]
    run = interrupted[name]
    assert run["second"]["steps"] == resumed_steps  # it did resume: only the missing steps ran
    assert losses(run["second"]["log_history"]) == losses(ref.state.log_history)  # each logged loss, exact
    assert train_loss(run["second"]["log_history"]) == train_loss(ref.state.log_history)
    assert same_weights(ref.model, run["final"])


@pytest.mark.slow
def test_a_new_process_carries_the_unlogged_window_over(interrupted, reference):
    """SIGTERM checkpointed step 7 between logs (at 4 and 8): steps 5-7 are logged by the next process."""
    assert interrupted["term"]["carried_items"] == window_items([5, 6, 7])
    logged = losses(interrupted["term"]["second"]["log_history"])
    assert list(logged) == [4, 8, 9]
    assert logged[8] == losses(reference["windows"].state.log_history)[8]


@pytest.mark.slow
@pytest.mark.parametrize("name, logged", [("kill", list(range(1, 10))), ("term", [4, 8, 9])])
def test_metrics_file_continues_without_duplicated_or_missing_steps(interrupted, reference, name, logged):
    records = interrupted[name]["metrics"]
    ref = reference["every_step" if name == "kill" else "windows"]
    assert [r["step"] for r in records if "loss" in r] == logged
    assert {r["step"]: r["loss"] for r in records if "loss" in r} == losses(ref.state.log_history)
    (final,) = [r for r in records if "train_loss" in r]  # the interrupted process's total was dropped
    assert final["step"] == 9 and final["train_loss"] == train_loss(ref.state.log_history)
    assert records[-1] is final


# ---- the fourth hostile trial (issue 59): a folder transformers' Trainer wrote --------------------------------------
def test_resume_auto_in_a_transformers_trainer_folder_names_whose_checkpoint_it_is(tmp_path):
    import transformers

    from treadle.demos import toy

    tok = toy.build_tokenizer()
    ids = tok("1+1=2")["input_ids"]
    rows = [{"input_ids": ids, "labels": ids}] * 4
    theirs = transformers.Trainer(
        model=toy.build_model("tiny", tokenizer=tok),
        args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "run"), max_steps=1, save_steps=1, report_to=[], use_cpu=True
        ),
        train_dataset=rows,
    )
    theirs.train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    assert (checkpoint / "training_args.bin").is_file()
    for resume_from in ("auto", True, str(checkpoint)):
        with pytest.raises(CheckpointError) as error:
            sft(tmp_path, [{"prompt": "1+1=", "completion": "2"}] * 4).train(resume_from_checkpoint=resume_from)
        message = str(error.value)
        assert f"checkpoint {checkpoint} was written by transformers' Trainer" in message
        assert f"model: {checkpoint}" in message and "steps_per_epoch" not in message
