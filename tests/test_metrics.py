"""MetricWindow: (sum, count) per name, one reduction, a state that survives resuming; and every trainer's
windowed metrics logged exactly across a resume."""

import pytest
import torch

from treadle import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer, TrainerCallback
from treadle.demos import toy
from treadle.metrics import MetricWindow


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
