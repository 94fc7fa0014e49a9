"""MetricWindow: (sum, count) per name, one reduction, a state that survives resuming; and every trainer's
windowed metrics logged exactly across a resume."""

import itertools

import pytest
import torch
from _factories import dpo_trainer, reward_trainer

from treadle import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer, TrainerCallback
from treadle.demos import toy
from treadle.errors import NonFiniteLossError, resuming_as
from treadle.metrics import MetricWindow, check_logged_loss, record_num_tokens, training_logs
from treadle.record.commands import DEMO_RESUME_HINT
from treadle.state import TrainerState
from treadle.trainers.kto import KTOConfig, KTOTrainer


def test_means_are_sums_over_counts_per_name_and_mode():
    window = MetricWindow()
    window.add("accuracy", torch.tensor(3.0), torch.tensor(4.0))
    window.add("accuracy", 1.0, 4.0)
    window.add("loss", 2.0, 1, mode="eval")
    assert window.names("train") == ("accuracy",)
    assert window.means("train") == {"accuracy": 0.5}
    assert window.means("train") == {}  # reduced: emptied
    assert window.reduce("eval") == {"loss": (2.0, 1.0)}


def test_a_batch_with_new_names_widens_the_window_and_keeps_the_old_sums():
    window = MetricWindow()
    window.add_many({"a": (1.0, 1), "b": (2.0, 2)})
    window.add_many({"b": (4.0, 2), "c": (9.0, 3)})
    window.add_many({"a": (1.0, 1), "b": (0.0, 0)})
    assert window.reduce() == {"a": (2.0, 2.0), "b": (6.0, 4.0), "c": (9.0, 3.0)}


def test_metrics_without_items_are_left_out_of_the_means():
    window = MetricWindow()
    window.add_many({"scored": (0.0, 0), "length": (6.0, 2)})
    assert window.means() == {"length": 3.0}


def test_state_dict_round_trips_through_a_weights_only_load(tmp_path):
    window = MetricWindow()
    window.add_many({"x": (torch.tensor(1.5, dtype=torch.float64), 3)})
    window.add("y", 2.0, 1, mode="eval")
    torch.save(window.state_dict(), tmp_path / "w.pt")
    restored = MetricWindow()
    restored.add("stale", 1.0)  # loading replaces, not adds
    restored.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True))
    assert restored.reduce("train") == {"x": (1.5, 3.0)} and restored.reduce("eval") == {"y": (2.0, 1.0)}


def test_clear_forgets_one_mode_or_all():
    window = MetricWindow()
    window.add("a", 1.0)
    window.add("b", 1.0, mode="eval")
    window.clear("eval")
    assert window.names("eval") == () and window.names("train") == ("a",)
    window.clear()
    assert window.reduce("train") == {}


# ------------------------------------------------------------------ windowed metrics across a resume
COMMON = dict(
    seed=0, learning_rate=3e-3, disable_tqdm=True, logging_steps=4, max_steps=4, save_strategy="steps", save_steps=2
)


def sft(tmp_path, tok, callbacks=()):
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, **COMMON)
    return SFTTrainer(
        toy.build_model("tiny", tokenizer=tok, seed=0),
        args,
        callbacks=list(callbacks),
        train_dataset=toy.load_task("addition", n=64),
        processing_class=tok,
    )


def dpo(tmp_path, tok, callbacks=()):
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, **COMMON)
    return DPOTrainer(
        toy.build_model("tiny", tokenizer=tok, seed=0),
        args=args,
        callbacks=list(callbacks),
        train_dataset=toy.load_task("addition", kind="preference", n=64),
        processing_class=tok,
    )


class StopAfter2(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == 2


@pytest.mark.parametrize(
    "build, metric", [(sft, "mean_token_accuracy"), (dpo, "rewards/accuracies")], ids=["sft", "dpo"]
)
def test_a_resumed_run_logs_the_window_it_was_saved_in_exactly(tmp_path, build, metric):
    """Checkpoint-2 is written between the logs at steps 0 and 4: the metrics of steps 1-2 travel in it, so the
    resumed run logs at step 4 exactly what the uninterrupted run logged."""
    tok = toy.build_tokenizer()
    full = build(tmp_path / "full", tok)
    full.train()
    build(tmp_path / "cut", tok, callbacks=[StopAfter2()]).train()
    assert not any("loss" in h for h in full.state.log_history if h["step"] < 4)  # steps 1-2: not logged
    resumed = build(tmp_path / "cut", tok)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    logged = lambda t: next(h for h in t.state.log_history if h["step"] == 4 and "loss" in h)  # noqa: E731
    assert logged(resumed)[metric] == logged(full)[metric]
    assert logged(resumed)["loss"] == logged(full)["loss"]
    assert logged(resumed).get("num_tokens") == logged(full).get("num_tokens")  # DPO's: the run's, across the resume


# ------------------------------------------------------------------ num_tokens: a run total
def test_num_tokens_is_folded_into_the_run_s_total_at_each_log():
    """What ``record_num_tokens`` adds is summed (not averaged) and added to ``state.num_tokens``; the log shows the
    total. A window whose micro-batches held no loss item logs nothing but still counts its tokens; a window that
    recorded none logs no ``num_tokens``."""
    state, window = TrainerState(), MetricWindow()
    record_num_tokens(window, 10)
    record_num_tokens(window, 5)
    window.add("loss", 6.0, 3)
    assert training_logs(window, state, None, 1e-3) == {"loss": 2.0, "learning_rate": 1e-3, "num_tokens": 15}
    record_num_tokens(window, 7)
    window.add("loss", 0.0, 0)  # every label masked
    assert training_logs(window, state, None, 1e-3) is None and state.num_tokens == 22
    record_num_tokens(window, 1)
    window.add_many({"loss": (1.0, 1), "x": (4.0, 2)})
    assert training_logs(window, state, None, 1e-3) == {"loss": 1.0, "learning_rate": 1e-3, "num_tokens": 23, "x": 2.0}
    window.add("loss", 1.0, 1)
    assert "num_tokens" not in training_logs(window, state, None, 1e-3)


def kto(tmp_path, tok, **overrides):
    pairs = toy.load_task("addition", kind="preference", n=8)
    rows = [
        {"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
        for i, r in enumerate(pairs)
    ]
    args = KTOConfig(output_dir=str(tmp_path), disable_tqdm=True, save_strategy="no", **overrides)
    return KTOTrainer(toy.build_model("tiny", tokenizer=tok), args=args, train_dataset=rows, processing_class=tok)


def row_tokens(row) -> int:
    """A row's tokens in its batch: a preference pair's prompt twice and each response once; a KTO row's prompt
    and completion (its KL completion is not counted, as TRL)."""
    if "completion_input_ids" in row:
        return len(row["prompt_input_ids"]) + len(row["completion_input_ids"])
    return 2 * len(row["prompt_input_ids"]) + len(row["chosen_input_ids"]) + len(row["rejected_input_ids"])


@pytest.mark.parametrize("kind", ["dpo", "kto", "reward"])
def test_num_tokens_counts_every_attention_mask_token_trained_on(tmp_path, kind):
    """DPO, KTO and the reward model log TRL's ``num_tokens``: the attention-mask tokens of every training
    micro-batch over the run, counted once per micro-batch under accumulation. One epoch of 8 rows in 2 steps of 2
    micro-batches of 2 rows: the first log holds 4 rows' tokens, the last every row's."""
    tok = toy.build_tokenizer()
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, logging_steps=1)
    pairs = toy.load_task("addition", kind="preference", n=8)
    if kind == "dpo":
        trainer = dpo_trainer(tmp_path, tok, pairs, **common)
    elif kind == "reward":
        trainer = reward_trainer(tmp_path, tok, pairs, **common)
    else:
        trainer = kto(tmp_path, tok, **common)
    per_row = [row_tokens(r) for r in trainer.train_dataset]
    assert len(per_row) == 8
    trainer.train()
    logged = [h["num_tokens"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and logged[1] == sum(per_row) == trainer.state.num_tokens
    assert logged[0] in {sum(rows) for rows in itertools.combinations(per_row, 4)}


def test_a_nan_loss_names_how_this_program_resumes_a_demo_none():
    state = TrainerState(global_step=3)
    with pytest.raises(NonFiniteLossError, match=r"resume_from_checkpoint=True"):
        check_logged_loss({"loss": float("nan")}, state)
    with resuming_as(DEMO_RESUME_HINT), pytest.raises(NonFiniteLossError) as caught:
        check_logged_loss({"loss": float("nan")}, state)
    assert "run `treadle demo` again" in str(caught.value) and "--resume" not in str(caught.value)
