"""Each objective of the table (issue 17) learns on the toy tasks in a short run.

GRPO: a cheaper proxy than the addition task, on purpose (the addition task needs an SFT warm-up and ~40 steps per
objective, see test_grpo.py): the fraction of digit tokens in 3-token completions of the addition prompts, which a
random tiny model samples ~10% of the time. Two samples per generation slice (``steps_per_generation=2``) make the
second micro-step off-policy, so the ratio-shaping objectives (clip, delta, CISPO, SAPO, GSPO, masks) act.
DPO: rewards/accuracies and margins on the training pairs, from 0 (policy == reference) to high.
"""

import statistics

import pytest
import torch

from treadle.demos import toy
from treadle.trainers.dpo import DPOConfig, DPOTrainer
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer, Sample

pytestmark = pytest.mark.usefixtures("one_thread")


def digits(completion_ids, **kwargs):
    """Share of digit tokens in a completion of at most 3 tokens (toy ids 7..16 are '0'..'9')."""
    return [sum(7 <= i <= 16 for i in ids) / 3 for ids in completion_ids]


def short(completion_ids, **kwargs):
    return [float(len(ids) <= 2) for ids in completion_ids]


GRPO_OBJECTIVES = {
    "dapo (default)": {},
    "grpo": dict(loss_type="grpo"),
    "dr_grpo": dict(loss_type="dr_grpo", scale_rewards="none"),
    "gspo": dict(importance_sampling_level="sequence"),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "sapo": dict(loss_type="sapo"),
    "delta": dict(delta=1.5),
    "top_entropy_quantile": dict(top_entropy_quantile=0.2),
    "off_policy_mask": dict(off_policy_mask_threshold=0.01),
    "rloo": dict(advantage_estimator="rloo", scale_rewards="none"),
    "gdpo": dict(multi_objective_aggregation="normalize_then_sum"),
    "bias-corrected kl": dict(beta=0.04),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GRPO_OBJECTIVES))
def test_every_grpo_objective_raises_the_reward(tmp_path, tok, name):
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        steps_per_generation=2,
        num_generations=8,
        max_completion_length=3,
        max_steps=16,
        learning_rate=1e-2,
        logging_steps=1,
        disable_tqdm=True,
        save_strategy="no",
        lr_scheduler_type="constant",
        report_to="none",
        **GRPO_OBJECTIVES[name],
    )
    rewards = [digits, short] if name == "gdpo" else digits  # GDPO normalises each reward on its own
    trainer = GRPOTrainer(
        toy.build_model("tiny", tokenizer=tok, seed=0),
        rewards,
        args=args,
        train_dataset=toy.load_task("addition", kind="rl", n=64),
        processing_class=tok,
    )
    trainer.train()
    history = [h["rewards/digits/mean"] for h in trainer.state.log_history if "rewards/digits/mean" in h]
    first, last = statistics.mean(history[:3]), statistics.mean(history[-3:])
    assert first < 0.2 and last > first + 0.2, history


DPO_OBJECTIVES = {
    "sigmoid": {},
    "ipo": dict(loss_type="ipo"),
    "hinge": dict(loss_type="hinge"),
    "robust": dict(loss_type="robust", label_smoothing=0.1),
    "sigmoid_norm": dict(loss_type="sigmoid_norm"),
    "apo_zero": dict(loss_type="apo_zero"),
    "apo_down": dict(loss_type="apo_down"),
    "bco_pair": dict(loss_type="bco_pair"),
    "sppo_hard": dict(loss_type="sppo_hard"),
    "nca_pair": dict(loss_type="nca_pair"),
    "exo_pair": dict(loss_type="exo_pair", label_smoothing=1e-3),
    # DiscoPOP's loss falls as the margin goes *negative* near 0 (its mixing weight σ(z/τ) moves fastest there):
    # from policy == reference it needs a β large enough to leave that region (docs/dpo.md)
    "discopop": dict(loss_type="discopop", beta=2.0),
    "aot": dict(loss_type="aot"),
    "aot_unpaired": dict(loss_type="aot_unpaired"),
    "mpo (list)": dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),
    "ld_alpha": dict(ld_alpha=0.5),
    "use_weighting (wpo)": dict(use_weighting=True),
    "f-dpo js": dict(f_divergence_type="js_divergence"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DPO_OBJECTIVES))
def test_every_dpo_objective_raises_reward_accuracy_on_its_pairs(tmp_path, tok, name):
    options = {"beta": 0.5, **DPO_OBJECTIVES[name]}
    pairs = toy.load_task("addition", kind="preference", n=16, seed=0)
    args = DPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        max_steps=10,
        learning_rate=5e-3,
        logging_steps=10,
        disable_tqdm=True,
        save_strategy="no",
        report_to="none",
        lr_scheduler_type="constant",
        **options,
    )
    trainer = DPOTrainer(
        toy.build_model("tiny", tokenizer=tok, seed=0), args=args, train_dataset=pairs, processing_class=tok
    )
    trainer.train()
    metrics = trainer.evaluate(pairs)  # starts at accuracy 0, margin 0: the policy is its reference
    assert metrics["eval_rewards/accuracies"] > 0.8 and metrics["eval_rewards/margins"] > 0.3, metrics


def test_trainer_wpo_weights_and_ld_sums_equal_a_full_softmax_by_hand(tmp_path, tok):
    """The real DPOTrainer paths: ``wpo_pair_weights`` (extra no-grad forward) and ``ld_alpha`` in
    ``completion_logps``, against log-softmax over the full logits written out here."""
    pairs = [
        {"prompt": "12+34=", "chosen": "46", "rejected": "47"},
        {"prompt": "5+5=", "chosen": "10", "rejected": "100"},
        {"prompt": "99+1=", "chosen": "100", "rejected": "1"},
        {"prompt": "7+8=", "chosen": "15", "rejected": "51"},
    ]
    args = DPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        ld_alpha=0.25,
        use_weighting=True,
        disable_tqdm=True,
        save_strategy="no",
        report_to="none",
    )
    trainer = DPOTrainer(
        toy.build_model("tiny", tokenizer=tok, seed=0), args=args, train_dataset=pairs, processing_class=tok
    )
    inputs = trainer.prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    with torch.no_grad():
        logits = trainer.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        log_probs = torch.log_softmax(logits[:, :-1].double(), dim=-1)
        token = log_probs.gather(-1, inputs["input_ids"][:, 1:, None]).squeeze(-1)  # (8, T-1)
        mask = inputs["completion_mask"][:, 1:].double()
        aligned = ((token - torch.log((log_probs.exp() ** 2).sum(-1))) * mask).sum(1) / mask.sum(1)
        expected_weights = torch.exp(aligned[:4] + aligned[4:])
        lengths = mask.sum(1)
        shared = torch.minimum(lengths[:4], lengths[4:]).repeat(2)
        position = mask.cumsum(1)
        ld = (token * mask * torch.where(position <= shared[:, None], 1.0, 0.25)).sum(1)
        scores = trainer.completion_logps(trainer.model, inputs)
    torch.testing.assert_close(
        trainer.wpo_pair_weights(trainer.model, inputs).double(), expected_weights, rtol=1e-4, atol=1e-6
    )
    torch.testing.assert_close(torch.cat(scores.logps).double(), ld, rtol=1e-4, atol=1e-5)
    assert not torch.equal(lengths[:4], lengths[4:])  # the pairs differ in length: the tails count


def test_configs_validate_the_table_and_keep_trls_shapes(tmp_path):
    out = str(tmp_path)
    assert DPOConfig(output_dir=out).loss_type == ["sigmoid"]  # a list after __post_init__, as TRL
    args = DPOConfig.from_mapping({"output_dir": out, "loss_type": ["sigmoid", "sft"], "loss_weights": [1, 0.5]})
    assert args.loss_type == ["sigmoid", "sft"] and args.loss_weights == [1, 0.5]
    for fields, message in [
        (dict(loss_type=["sigmoid", "nope"]), "loss_type='nope'"),
        (dict(loss_type=["sigmoid"], loss_weights=[1.0, 2.0]), "loss_weights"),
        (dict(ld_alpha=1.5), "ld_alpha"),
        (dict(f_divergence_type="kl"), "f_divergence_type"),
        (dict(loss_type="aot", use_weighting=True), "use_weighting"),
    ]:
        with pytest.raises(ValueError, match=message):
            DPOConfig(output_dir=out, **fields)
    grpo = GRPOConfig(output_dir=out)
    assert (
        grpo.importance_sampling_level,
        grpo.use_bias_correction_kl,
        grpo.sapo_temperature_neg,
        grpo.multi_objective_aggregation,
        grpo.advantage_estimator,
    ) == ("token", True, 1.05, "sum_then_normalize", "grpo")
    for fields, message in [
        (dict(importance_sampling_level="batch"), "importance_sampling_level"),
        (dict(multi_objective_aggregation="mean"), "multi_objective_aggregation"),
        (dict(advantage_estimator="ppo"), "advantage_estimator"),
        (dict(advantage_estimator="rloo", multi_objective_aggregation="normalize_then_sum"), "GDPO"),
        (dict(loss_type="vespo"), "loss_type"),
        (dict(top_entropy_quantile=2.0), "top_entropy"),
    ]:
        with pytest.raises(ValueError, match=message):
            GRPOConfig(output_dir=out, **fields)
    with pytest.warns(UserWarning, match="epsilon_high=5.0"):
        GRPOConfig(output_dir=out, loss_type="cispo")


def test_grpo_trainer_counts_cispo_items_as_tokens_and_sapo_items_as_completions(tmp_path, tok):
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # (B, C): 5 tokens in 2 completions
    inputs = Sample(
        input_ids=torch.zeros(2, 5, dtype=torch.long),
        attention_mask=torch.ones(2, 5, dtype=torch.long),
        completion_mask=completion_mask,
        advantages=torch.zeros(2),
    )
    for loss_type, items in (("cispo", 5), ("sapo", 2), ("dapo", 5), ("grpo", 2), ("bnpo", None)):
        args = GRPOConfig(
            output_dir=str(tmp_path),
            loss_type=loss_type,
            epsilon_high=5.0,
            num_generations=2,
            per_device_train_batch_size=2,
        )
        trainer = GRPOTrainer(toy.build_model("tiny", tokenizer=tok), digits, args=args, processing_class=tok)
        assert trainer.count_items(inputs) == items, loss_type
