"""Tests for treadle.checkpoint: the layout, loading without unpickling, errors that name the file, saves that
are atomic, rotation that keeps the best and the newest, RNG state, and quiet saves.

Exact resume (a new process, SIGTERM, SIGKILL mid-save) is tested in tests/test_resume.py.
"""

import hashlib
import json
import os
import random
import shutil

import _resume_worker as worker
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from treadle import checkpoint as ckpt, resume
from treadle.callbacks import TrainerCallback, TrainerState
from treadle.trainer import Trainer

SAFE_LOADERS = {  # extension -> how to read it without executing anything
    ".safetensors": lambda path: load_file(path),
    ".pt": lambda path: torch.load(path, weights_only=True),
    ".pth": lambda path: torch.load(path, weights_only=True),
    ".json": lambda path: json.load(open(path)),
    ".jinja": lambda path: open(path).read(),  # the tokenizer's chat template: plain text
}


def digest(folder) -> dict[str, str]:
    """sha256 of every file under ``folder`` (relative name -> hex)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def same_weights(model, state: dict) -> bool:
    own = model.state_dict()
    return set(own) == set(state) and all(torch.equal(own[k], state[k]) for k in own)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two optimizer steps of the tiny run with a tokenizer, checkpointed at step 2 (the final step)."""
    from treadle.demos import toy

    out = tmp_path_factory.mktemp("trained")
    trainer = Trainer(
        worker.make_model(), worker.make_args(str(out), max_steps=2, save_steps=2), train_dataset=worker.make_rows()
    )
    # set after the constructor: its preflight refuses 103 tokens for a 64-row embedding (docs/runs.md row 88); the
    # rows are ids below 64, and what is under test is that the checkpoint saves the tokenizer
    trainer.processing_class = toy.build_tokenizer()
    trainer.train()
    return trainer, out / "checkpoint-2"


@pytest.fixture
def copy_of_checkpoint(trained, tmp_path):
    """A private copy of the trained checkpoint (in ``tmp_path/run``) that a test may damage."""
    path = tmp_path / "run" / "checkpoint-2"
    shutil.copytree(trained[1], path)
    (path / "treadle_checkpoint.json").unlink()  # as a checkpoint without digests: the file checks below are its guard
    state = json.loads((path / "trainer_state.json").read_text())
    (path / "trainer_state.json").write_text(json.dumps({**state, "max_steps": 9}))  # mid-way (a spent one is refused)
    return path


def fresh_trainer(output_dir, **overrides):
    return Trainer(
        worker.make_model(seed=123), worker.make_args(str(output_dir), **overrides), train_dataset=worker.make_rows()
    )


# ------------------------------------------------------------------------------------------------ layout
def test_checkpoint_layout(trained):
    trainer, path = trained
    files = set(os.listdir(path))
    assert {
        "model.safetensors",
        "config.json",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state_0.pth",
        "trainer_state.json",
        "training_args.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "treadle_checkpoint.json",
    } <= files
    assert sorted(os.listdir(path.parent)) == [
        ".treadle-run.json",
        "checkpoint-2",
        "metrics.jsonl",
        "run.json",
        "training_args.json",
    ]  # no temp folder; the run's manifest


def test_every_checkpoint_file_reads_without_unpickling(trained):
    _, path = trained
    for name in os.listdir(path):
        ext = os.path.splitext(name)[1]
        assert ext in SAFE_LOADERS, f"{name}: a file no safe loader reads"
        SAFE_LOADERS[ext](os.path.join(path, name))  # raises on anything that needs a pickle


def test_checkpoint_contents_are_the_run_at_that_step(trained):
    trainer, path = trained
    assert same_weights(trainer.model, load_file(path / "model.safetensors"))
    optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    assert len(optimizer["state"]) == len(trainable)
    assert all(float(s["step"]) == 2 for s in optimizer["state"].values())  # two AdamW updates
    assert torch.load(path / "scheduler.pt", weights_only=True)["last_epoch"] == 2
    assert set(torch.load(path / "rng_state_0.pth", weights_only=True)) >= {"python", "numpy", "torch"}
    state = json.load(open(path / "trainer_state.json"))
    assert (state["global_step"], state["train_batch_size"], state["gradient_accumulation_steps"]) == (2, 2, 2)
    assert json.load(open(path / "training_args.json")) == json.loads(trainer.args.to_json_string())


def test_the_tokenizer_is_saved_and_reloads(trained):
    from transformers import AutoTokenizer

    trainer, path = trained
    reloaded = AutoTokenizer.from_pretrained(str(path))
    assert reloaded.get_vocab() == trainer.processing_class.get_vocab()
    assert reloaded("12+34=")["input_ids"] == trainer.processing_class("12+34=")["input_ids"]


def test_a_plain_module_is_saved_as_model_safetensors(tmp_path):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    ckpt.save_weights(module, str(tmp_path))
    assert os.listdir(tmp_path) == ["model.safetensors"]
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    ckpt.load_weights(other, str(tmp_path))
    assert same_weights(other, module.state_dict())


def test_tied_weights_saved_once_load_back(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    a = LlamaForCausalLM(config)
    ckpt.save_weights(a, str(tmp_path))
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")  # saved once, as the embedding
    torch.manual_seed(1)
    b = LlamaForCausalLM(config)
    ckpt.load_weights(b, str(tmp_path))
    assert same_weights(b, a.state_dict())
    assert b.lm_head.weight.data_ptr() == b.model.embed_tokens.weight.data_ptr()


# ------------------------------------------------------------------------------------------- quiet saves
@pytest.mark.parametrize("enabled_before", [True, False])
def test_saving_draws_no_progress_bar_and_restores_the_setting(tmp_path, capfd, enabled_before):
    from transformers.utils import logging as hf_logging

    model = worker.make_model()
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled_before else hf_logging.disable_progress_bar)()
    try:
        capfd.readouterr()
        ckpt.save_weights(model, str(tmp_path))
        captured = capfd.readouterr()
        assert "Writing model shards" not in captured.err + captured.out
        assert hf_logging.is_progress_bar_enabled() is enabled_before
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_the_progress_bar_check_can_fail(tmp_path, capfd):
    """Control for the test above: save_pretrained itself does draw the bar when it is enabled."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        capfd.readouterr()
        worker.make_model().save_pretrained(str(tmp_path))
        assert "Writing model shards" in capfd.readouterr().err
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


# -------------------------------------------------------------------------------------- damaged checkpoints
def test_a_truncated_weights_file_names_the_file_and_the_checkpoint(copy_of_checkpoint):
    weights = copy_of_checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    trainer = fresh_trainer(copy_of_checkpoint.parent)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint-2/model\.safetensors.*corrupt or truncated"):
        trainer.train(resume_from_checkpoint=str(copy_of_checkpoint))
    assert same_weights(trainer.model, before)  # nothing half-loaded


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state_0.pth"])
def test_a_corrupt_state_file_names_the_file_and_the_checkpoint(copy_of_checkpoint, name):
    (copy_of_checkpoint / name).write_bytes(b"\x80\x02 not a torch file")
    trainer = fresh_trainer(copy_of_checkpoint.parent)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint-2/{name}.*corrupt or truncated"):
        trainer.train(resume_from_checkpoint=True)
    assert same_weights(trainer.model, before)  # the weights were not restored before the failure


@pytest.mark.parametrize("name", ["optimizer.pt", "model.safetensors"])
def test_a_missing_file_names_the_file_and_the_checkpoint(copy_of_checkpoint, name):
    os.remove(copy_of_checkpoint / name)
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint-2.*{name}"):
        fresh_trainer(copy_of_checkpoint.parent).train(resume_from_checkpoint=True)


def test_a_corrupt_trainer_state_names_the_file(copy_of_checkpoint):
    (copy_of_checkpoint / "trainer_state.json").write_text('{"global_step": 2, "epo')
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint-2/trainer_state\.json"):
        ckpt.load_checkpoint(str(copy_of_checkpoint), model=worker.make_model())


PICKLE_RAN = []


def _record_unpickling(tag):
    PICKLE_RAN.append(tag)
    return {}


class _Payload:
    """Unpickling this calls _record_unpickling: what a malicious optimizer.pt could do with any function."""

    def __reduce__(self):
        return _record_unpickling, ("unpickled",)


def test_loading_never_unpickles_arbitrary_objects(copy_of_checkpoint):
    torch.save({"state": {}, "param_groups": _Payload()}, copy_of_checkpoint / "optimizer.pt")
    PICKLE_RAN.clear()
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint-2/optimizer\.pt"):
        fresh_trainer(copy_of_checkpoint.parent).train(resume_from_checkpoint=True)
    assert PICKLE_RAN == []
    torch.load(copy_of_checkpoint / "optimizer.pt", weights_only=False)  # control: a full unpickle runs it
    assert PICKLE_RAN == ["unpickled"]


def test_weights_that_do_not_fit_are_refused_and_leave_the_model_untouched(trained):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, path = trained
    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=worker.VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint-2.*do not fit.*mlp"):
        ckpt.load_weights(other, str(path))
    assert same_weights(other, before)


# ------------------------------------------------------------------------------------------- atomic saves
class _Crash(Exception):
    pass


def crash_in(monkeypatch, name):
    """Make ``treadle.checkpoint.<name>`` raise, as if the process died at that point of the save."""

    def boom(*args, **kwargs):
        raise _Crash(name)

    monkeypatch.setattr(ckpt, name, boom)


@pytest.mark.parametrize("where", ["rng_files", "rename"])
def test_a_save_cut_short_leaves_earlier_checkpoints_and_no_complete_folder(trained, tmp_path, monkeypatch, where):
    trainer, _ = trained
    out = tmp_path / "run"
    trainer.state.global_step = 2
    first = ckpt.save_checkpoint(
        str(out),
        model=trainer.model,
        optimizer=trainer.optimizer,
        scheduler=trainer.lr_scheduler,
        state=trainer.state,
        args=trainer.args,
    )
    before = digest(first)
    trainer.state.global_step = 4
    with monkeypatch.context() as m:
        if where == "rename":  # everything written, trainer_state.json included: only the rename is missing
            crash_in(m, "_replace_dir")
        else:  # died while writing the per-rank files, before trainer_state.json
            crash_in(m, "rng_state")
        with pytest.raises(_Crash):
            ckpt.save_checkpoint(
                str(out),
                model=trainer.model,
                optimizer=trainer.optimizer,
                scheduler=trainer.lr_scheduler,
                state=trainer.state,
                args=trainer.args,
            )
    trainer.state.global_step = 2
    assert sorted(os.listdir(out)) == [".tmp-checkpoint-4", "checkpoint-2"]
    assert ckpt.list_checkpoints(str(out)) == [(2, first)]
    assert resume.resolve(True, str(out)) == first
    assert digest(first) == before
    # the next save clears the debris
    trainer.state.global_step = 6
    ckpt.save_checkpoint(
        str(out),
        model=trainer.model,
        optimizer=trainer.optimizer,
        scheduler=trainer.lr_scheduler,
        state=trainer.state,
        args=trainer.args,
    )
    trainer.state.global_step = 2
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-6"]


def test_saving_the_same_step_again_replaces_it_whole(trained, tmp_path):
    trainer, _ = trained
    out = tmp_path / "run"
    kwargs = dict(
        model=trainer.model,
        optimizer=trainer.optimizer,
        scheduler=trainer.lr_scheduler,
        state=trainer.state,
        args=trainer.args,
    )
    path = ckpt.save_checkpoint(str(out), **kwargs)
    (out / os.path.basename(path) / "stray.txt").write_text("from an older save")
    assert ckpt.save_checkpoint(str(out), **kwargs) == path
    assert "stray.txt" not in os.listdir(path)
    assert sorted(os.listdir(out)) == [os.path.basename(path)]


# ------------------------------------------------------------------------------------- finding checkpoints
def fake_checkpoint(out, step, complete=True):
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        TrainerState(global_step=step).save_to_json(str(path / "trainer_state.json"))
    return str(path)


def test_resolve_picks_the_newest_complete_checkpoint_by_step(tmp_path):
    paths = {step: fake_checkpoint(tmp_path, step) for step in (5, 40, 300)}
    fake_checkpoint(tmp_path, 1000, complete=False)  # being written when the run died
    (tmp_path / ".tmp-checkpoint-2000").mkdir()
    (tmp_path / "checkpoint-notastep").mkdir()
    assert ckpt.list_checkpoints(str(tmp_path)) == [(5, paths[5]), (40, paths[40]), (300, paths[300])]
    assert resume.resolve(True, str(tmp_path)) == paths[300]  # 300 > 40 > 5 as numbers, not as strings
    assert resume.resolve(paths[40], str(tmp_path)) == paths[40]
    assert resume.resolve(None, str(tmp_path)) is None and resume.resolve(False, str(tmp_path)) is None


def test_resolve_refuses_what_cannot_be_resumed(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        resume.resolve(True, str(tmp_path / "empty"))
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        resume.resolve(str(tmp_path / "checkpoint-9"), str(tmp_path))
    done = fake_checkpoint(tmp_path, 3)
    half = fake_checkpoint(tmp_path, 6, complete=False)
    with pytest.raises(ckpt.CheckpointError, match=rf"incomplete.*{done}"):
        resume.resolve(half, str(tmp_path))


# ---------------------------------------------------------------------------------------------- rotation
@pytest.mark.parametrize(
    "steps, limit, keep, kept",
    [
        ([1, 2, 3, 4, 5], 2, 2, [2, 5]),  # the best survives; the newest always does
        ([1, 2, 3, 4, 5], 1, 2, [2, 5]),  # a limit of 1 cannot drop the best nor the newest: two remain
        ([1, 2, 3, 4, 5], 3, 5, [3, 4, 5]),  # the best is the newest
        ([1, 2, 3, 4, 5], 3, None, [3, 4, 5]),
        ([1, 2, 3, 4, 5], 1, None, [5]),
        ([10, 20, 100], 2, 10, [10, 100]),  # ordered by step, not by name
        ([1, 2], 5, None, [1, 2]),  # under the limit: nothing to delete
    ],
)
def test_rotation_keeps_the_limit_the_best_and_the_newest(tmp_path, steps, limit, keep, kept):
    for step in steps:
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 999, complete=False)  # an incomplete folder is neither counted nor deleted
    best = str(tmp_path / f"checkpoint-{keep}") if keep else None
    deleted = ckpt.rotate(str(tmp_path), limit, keep=(best,))
    assert [s for s, _ in ckpt.list_checkpoints(str(tmp_path))] == kept
    assert sorted(os.path.basename(p) for p in deleted) == sorted(f"checkpoint-{s}" for s in steps if s not in kept)
    assert (tmp_path / "checkpoint-999").is_dir()


def test_rotation_without_a_limit_deletes_nothing(tmp_path):
    for step in (1, 2, 3):
        fake_checkpoint(tmp_path, step)
    assert ckpt.rotate(str(tmp_path), None) == []
    assert len(ckpt.list_checkpoints(str(tmp_path))) == 3


class _Scores:
    """compute_metrics returning a fixed sequence of scores, one per evaluation."""

    def __init__(self, scores):
        self.scores = list(scores)

    def __call__(self, prediction):
        return {"score": self.scores.pop(0)}


class _Listing(TrainerCallback):
    def __init__(self):
        self.after_save = []

    def on_save(self, args, state, control, **kwargs):
        self.after_save.append([s for s, _ in ckpt.list_checkpoints(args.output_dir)])


def test_training_rotation_keeps_the_best_and_load_best_model_at_end_reloads_it(tmp_path):
    # evaluations at steps 2, 4, 6, 8 score 0.3, 0.9, 0.5, 0.1: the best is step 4 (greater is better)
    listing = _Listing()
    args = worker.make_args(
        str(tmp_path),
        max_steps=8,
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        save_total_limit=1,
        metric_for_best_model="score",
        greater_is_better=True,
        load_best_model_at_end=True,
    )
    trainer = Trainer(
        worker.make_model(),
        args,
        train_dataset=worker.make_rows(),
        eval_dataset=worker.make_rows(6, seed=9),
        compute_metrics=_Scores([0.3, 0.9, 0.5, 0.1]),
        callbacks=[listing],
    )
    trainer.train()
    assert listing.after_save == [[2], [4], [4, 6], [4, 8]]
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-4")
    assert (trainer.state.best_metric, trainer.state.best_global_step) == (0.9, 4)
    best = load_file(tmp_path / "checkpoint-4" / "model.safetensors")
    last = load_file(tmp_path / "checkpoint-8" / "model.safetensors")
    assert same_weights(trainer.model, best)
    assert not same_weights(trainer.model, last)  # the control: the run did move on after step 4


# ---------------------------------------------------------------------------------------------------- RNG
def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    torch.save(ckpt.rng_state(), tmp_path / "rng.pth")

    def draw():
        return random.random(), np.random.normal(), np.random.randint(1 << 30), torch.rand(3).tolist()

    expected = draw()
    draw()  # move every generator on
    ckpt.set_rng_state(torch.load(tmp_path / "rng.pth", weights_only=True))
    assert draw() == expected
