"""RewardTrainer: the Bradley–Terry loss by hand and against TRL's RewardTrainer.compute_loss, accumulation, a
short run that learns the toy preference pairs, and the saved model as a GRPO reward function."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from _factories import reward_trainer as make_trainer, tiny_reward_model

from treadle.demos import toy
from treadle.rewards import from_reward_model
from treadle.trainers.reward import RewardCollator, RewardConfig, RewardTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


def batch(trainer, n=4):
    return trainer.prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(n)]))


def test_collator_stacks_chosen_then_rejected_with_margins(tmp_path, tok):
    trainer = make_trainer(tmp_path, tok)
    inputs = batch(trainer)
    assert inputs["input_ids"].shape[0] == 8
    assert inputs["margin"].tolist() == [0.0, 0.5, 0.0, 0.0]
    # row 0 is prompt "12+34=" + "46" + eos, as DPOTrainer tokenises it
    assert tok.decode(inputs["input_ids"][0][inputs["attention_mask"][0].bool()]) == "12+34=46</s>"
    no_margin = RewardCollator(0)([{k: v for k, v in trainer.train_dataset[0].items() if k != "margin"}])
    assert "margin" not in no_margin


def test_loss_and_metrics_by_hand(tmp_path, tok):
    trainer = make_trainer(tmp_path, tok, center_rewards_coefficient=0.01)
    inputs = batch(trainer)
    with torch.no_grad():
        rewards = trainer.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[:, 0]
    chosen, rejected, margin = rewards[:4].tolist(), rewards[4:].tolist(), [0.0, 0.5, 0.0, 0.0]
    expected = (
        sum(math.log1p(math.exp(-(c - r - m))) + 0.01 * (c + r) ** 2 for c, r, m in zip(chosen, rejected, margin)) / 4
    )
    loss = trainer.compute_loss(trainer.model, inputs)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    metrics = trainer.metrics.means("train")
    assert metrics["accuracy"] == pytest.approx(sum(c > r for c, r in zip(chosen, rejected)) / 4)
    assert metrics["margin"] == pytest.approx(sum(c - r for c, r in zip(chosen, rejected)) / 4, rel=1e-5)
    assert metrics["mean_reward"] == pytest.approx(sum(chosen + rejected) / 8, rel=1e-5)
    assert trainer.compute_loss(trainer.model, inputs, num_items_in_batch=8).item() == pytest.approx(
        expected / 2, rel=1e-5
    )


def test_loss_equals_trls_reward_trainer_compute_loss(tmp_path, tok):
    trl_reward = pytest.importorskip("trl.trainer.reward_trainer")
    trainer = make_trainer(tmp_path, tok, center_rewards_coefficient=0.01)
    inputs = batch(trainer)

    class Identity:
        def gather(self, x):
            return x

        gather_for_metrics = gather

    stub = SimpleNamespace(
        model=trainer.model,
        args=SimpleNamespace(center_rewards_coefficient=0.01),
        accelerator=Identity(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    trl_inputs = {k: inputs[k] for k in ("input_ids", "attention_mask", "margin")}
    expected = trl_reward.RewardTrainer.compute_loss(stub, trainer.model, trl_inputs)
    assert trainer.compute_loss(trainer.model, inputs).item() == pytest.approx(expected.item(), abs=1e-6)
    ours = trainer.metrics.means("train")
    for name in ("accuracy", "margin", "mean_reward"):
        assert ours[name] == pytest.approx(stub._metrics["train"][name][-1], abs=1e-6), name


def test_config_and_model_are_checked(tmp_path, tok):
    with pytest.raises(ValueError, match="center_rewards_coefficient"):
        RewardConfig(output_dir=str(tmp_path), center_rewards_coefficient=-1.0)
    with pytest.raises(ValueError, match="chosen"):
        make_trainer(tmp_path, tok, rows=[{"prompt": "a", "text": "b"}])
    trainer = make_trainer(tmp_path, tok, model=toy.build_model("tiny", tokenizer=tok))  # a causal LM: V outputs
    with pytest.raises(ValueError, match="num_labels=1"):
        trainer.compute_loss(trainer.model, batch(trainer))


def test_too_long_pairs_are_dropped_as_trl_does(tmp_path, tok):
    trainer = make_trainer(tmp_path, tok, max_length=8)  # "12+34=46</s>" and "99+1=100</s>" are 9 tokens
    assert [tok.decode(row["prompt_input_ids"]) for row in trainer.train_dataset] == ["5+5=", "7+8="]


@pytest.mark.slow
def test_training_learns_the_pairs_and_the_saved_model_is_a_grpo_reward(tmp_path, tok):
    pairs = toy.load_task("addition", kind="preference", n=16, seed=0)
    trainer = RewardTrainer(
        tiny_reward_model(),
        args=RewardConfig(
            output_dir=str(tmp_path),
            disable_tqdm=True,
            save_strategy="no",
            report_to="none",
            max_steps=30,
            per_device_train_batch_size=16,
            learning_rate=1e-2,
            logging_steps=10,
            lr_scheduler_type="constant",
        ),
        train_dataset=pairs,
        processing_class=tok,
    )
    before = trainer.evaluate(pairs)["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate(pairs)
    assert before < 0.8 and after["eval_accuracy"] > 0.9, (before, after)
    path = tmp_path / "rm"
    trainer.save_model(str(path))
    tok.save_pretrained(str(path))
    reward = from_reward_model(str(path), batch_size=3)
    rows = [pairs[i] for i in range(8)]
    prompts = [r["prompt"] for r in rows] * 2
    scores = reward(
        prompts=prompts,
        completions=[r["chosen"] for r in rows] + [r["rejected"] for r in rows],
        completion_ids=[[]] * 16,
    )
    assert reward.__name__ == "rm" and len(scores) == 16
    # the saved model scores as the trained one did: chosen above rejected for most pairs
    assert sum(c > r for c, r in zip(scores[:8], scores[8:])) >= 6
    inputs = trainer.prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(8)]))
    with torch.no_grad():
        direct = trainer.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[:, 0]
    assert scores == pytest.approx(direct.tolist(), abs=1e-4)
