"""treadle.trainers.dpo: data handling by hand, the loss against plain PyTorch, and short training runs."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from _factories import PAIRS, dpo_args as make_args, dpo_trainer as make_trainer, tiny_llama
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

from treadle.demos import toy
from treadle.trainers.dpo import DPOCollator, DPOConfig, DPOTrainer
from treadle.trainers.pairs import split_implicit_prompt

VOCAB = len(toy.build_tokenizer())  # 103: the toy character tokenizer


def digit(d: int) -> int:
    """Toy token id of a digit character: 7 specials/role markers come first, then '0'..'9'."""
    return 7 + d


PLUS, EQUALS, NEWLINE, EOS, USER, ASSISTANT = 79, 87, 102, 2, 5, 6


@pytest.fixture(scope="module")
def tokenizer():
    return toy.build_tokenizer()


def collate(trainer, rows):
    return trainer.prepare_inputs(trainer.data_collator(rows))  # on the trainer's device


def first_batch(trainer, n=None):
    return collate(trainer, [trainer.train_dataset[i] for i in range(len(PAIRS) if n is None else n)])


def peaked_reference(seed=1):
    """A reference far from a freshly initialised policy (log-ratios of several nats), so that wrong
    formulas give visibly wrong losses."""
    model = tiny_llama(seed, VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


def plain_sequence_logps(model, batch):
    """Independent reference: full float32 log-softmax of the model's logits, summed over response tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logps = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = logps.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["completion_mask"][:, 1:].float()
    return (picked * mask).sum(-1), logits, mask


# ------------------------------------------------------------------------------------------ collator


def test_collator_stacks_chosen_then_rejected_pads_right_and_masks_the_prompt():
    rows = [
        {"prompt_input_ids": [5, 6], "chosen_input_ids": [7], "rejected_input_ids": [8, 9, 10]},
        {"prompt_input_ids": [11], "chosen_input_ids": [12, 13], "rejected_input_ids": [14]},
    ]
    batch = DPOCollator(pad_token_id=0)(rows)
    assert batch["input_ids"].tolist() == [
        [5, 6, 7, 0, 0],  # chosen of row 0
        [11, 12, 13, 0, 0],  # chosen of row 1
        [5, 6, 8, 9, 10],  # rejected of row 0
        [11, 14, 0, 0, 0],
    ]  # rejected of row 1
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert "labels" not in batch and "ref_chosen_logps" not in batch


def test_collator_passes_reference_logps_only_when_every_row_has_them():
    rows = [
        {
            "prompt_input_ids": [1],
            "chosen_input_ids": [2],
            "rejected_input_ids": [3],
            "ref_chosen_logps": -1.5,
            "ref_rejected_logps": -2.0,
        }
    ] * 2
    batch = DPOCollator(pad_token_id=9)(rows)
    assert batch["ref_chosen_logps"].tolist() == [-1.5, -1.5]
    assert batch["ref_rejected_logps"].dtype == torch.float32
    assert "ref_chosen_logps" not in DPOCollator()([rows[0], {**rows[0], "ref_chosen_logps": None}])


# ------------------------------------------------------------------------------------- tokenisation


def test_text_rows_tokenise_prompt_and_responses_separately_with_eos(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer)
    row = trainer.train_dataset[0]
    assert set(trainer.train_dataset.column_names) == {"prompt_input_ids", "chosen_input_ids", "rejected_input_ids"}
    assert row["prompt_input_ids"] == [digit(1), digit(2), PLUS, digit(3), digit(4), EQUALS]  # "12+34="
    assert row["chosen_input_ids"] == [digit(4), digit(6), EOS]  # "46" + eos
    assert row["rejected_input_ids"] == [digit(4), digit(7), EOS]


def test_chat_rows_are_rendered_with_the_chat_template(tmp_path, tokenizer):
    rows = [
        {
            "prompt": [{"role": "user", "content": "1+2="}],
            "chosen": [{"role": "assistant", "content": "3"}],
            "rejected": [{"role": "assistant", "content": "4"}],
        }
    ]
    row = make_trainer(tmp_path, tokenizer, rows=rows).train_dataset[0]
    # "<|user|>1+2=\n<|assistant|>" then "3</s>": the template ends the turn with eos, nothing is added
    assert row["prompt_input_ids"] == [USER, digit(1), PLUS, digit(2), EQUALS, NEWLINE, ASSISTANT]
    assert row["chosen_input_ids"] == [digit(3), EOS]
    assert row["rejected_input_ids"] == [digit(4), EOS]


def test_implicit_prompt_conversations_split_at_their_longest_common_prefix(tmp_path, tokenizer):
    user = {"role": "user", "content": "1+2="}
    rows = [
        {
            "chosen": [user, {"role": "assistant", "content": "3"}],
            "rejected": [user, {"role": "assistant", "content": "4"}],
        }
    ]
    row = make_trainer(tmp_path, tokenizer, rows=rows).train_dataset[0]
    assert row["prompt_input_ids"] == [USER, digit(1), PLUS, digit(2), EQUALS, NEWLINE, ASSISTANT]
    assert row["chosen_input_ids"] == [digit(3), EOS]
    assert row["rejected_input_ids"] == [digit(4), EOS]


def test_split_implicit_prompt_by_characters_and_by_messages():
    assert split_implicit_prompt("ab=12", "ab=13") == ("ab=1", "2", "3")
    a, b, c = (
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"},
        {"role": "assistant", "content": "z"},
    )
    assert split_implicit_prompt([a, b], [a, c]) == ([a], [b], [c])


@pytest.mark.parametrize(
    "mode, kept",
    [("keep_end", [PLUS, digit(3), digit(4), EQUALS]), ("keep_start", [digit(1), digit(2), PLUS, digit(3)])],
)
def test_truncation_of_prompt_then_responses(tmp_path, tokenizer, mode, kept):
    rows = [{"prompt": "12+34=", "chosen": "4646", "rejected": "47"}]
    row = make_trainer(
        tmp_path, tokenizer, rows=rows, max_prompt_length=4, max_length=6, truncation_mode=mode
    ).train_dataset[0]
    assert row["prompt_input_ids"] == kept
    assert row["chosen_input_ids"] == [digit(4), digit(6)]  # 2 tokens of room; the response keeps its start
    assert row["rejected_input_ids"] == [digit(4), digit(7)]


def test_pretokenised_rows_are_kept(tmp_path):
    rows = [{"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4, 5]}]
    trainer = DPOTrainer(tiny_llama(0, VOCAB), args=make_args(tmp_path), train_dataset=rows)
    assert trainer.train_dataset[0] == rows[0]


def test_missing_columns_are_named(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"\['rejected'\].*has \['prompt', 'chosen'\]"):
        make_trainer(tmp_path, tokenizer, rows=[{"prompt": "1+1=", "chosen": "2"}])


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "1+1=", "chosen": "2", "rejected": ""}, "row 0: the rejected response is empty"),
        ({"chosen": "1+1=2", "rejected": "1+1=2"}, "row 0: the chosen response is empty"),
        ({"prompt": "1+1=", "chosen": [{"role": "assistant", "content": "2"}], "rejected": "3"}, "all be text"),
    ],
)
def test_bad_rows_are_rejected_with_the_row_number(tmp_path, tokenizer, row, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, tokenizer, rows=[row])


def test_prompt_longer_than_max_length_is_an_error_that_says_how_to_fix_it(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"row 0: the prompt has 6 tokens.*max_length=6.*max_prompt_length"):
        make_trainer(tmp_path, tokenizer, rows=PAIRS[:1], max_length=6, max_prompt_length=None)


def dpo(tmp_path, rows):
    from treadle.demos import toy
    from treadle.trainers.dpo import DPOConfig, DPOTrainer

    tok = toy.build_tokenizer()
    args = DPOConfig(
        output_dir=str(tmp_path / "run"),
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
    )
    return DPOTrainer(toy.build_model("tiny", tokenizer=tok), args=args, train_dataset=rows, processing_class=tok)


def test_dpo_refuses_pairs_that_are_all_identical_and_notes_some(tmp_path, capsys):
    same = [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 1)} for a in range(4)]
    with pytest.raises(
        ValueError,
        match=r"every one of the 4 train pairs has chosen identical to rejected .*loss "
        r"log 2, gradient 0",
    ):
        dpo(tmp_path, same)
    mixed = same[:1] + [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(3)]
    dpo(tmp_path, mixed)
    assert "treadle: 1 of 4 train pairs have chosen identical to rejected (rows 0)" in capsys.readouterr().err


# --------------------------------------------------------------------------------------- the config


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(loss_type="kto"), "loss_type='kto' is not supported"),
        (dict(beta=0.0), "beta must be > 0"),
        (dict(loss_type="hinge", label_smoothing=0.1), "does not use label_smoothing"),
        (dict(loss_type="robust", label_smoothing=0.5), r"\[0, 0.5\)"),
        (dict(max_length=8, max_prompt_length=8), "must be < max_length"),
        (dict(truncation_mode="middle"), "truncation_mode"),
        (dict(rpo_alpha=-1.0), "rpo_alpha"),
    ],
)
def test_config_validation(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        DPOConfig(output_dir=str(tmp_path), **fields)


def test_trainer_needs_a_dpo_config(tmp_path):
    from treadle import TrainingArguments

    with pytest.raises(TypeError, match="DPOConfig"):
        DPOTrainer(tiny_llama(0, VOCAB), args=TrainingArguments(output_dir=str(tmp_path)))


# ------------------------------------------------------------------------------ loss types by hand


# pc = -1, rc = -2 (chosen log-ratio 1); pr = -3, rr = -2.5 (rejected log-ratio -0.5); beta = 0.1:
# h = 1.5, z = beta h = 0.15. Chosen has 2 response tokens, rejected 4.
def softplus(x):
    return math.log1p(math.exp(x))


HAND = {
    ("sigmoid", 0.0, 0.0): softplus(-0.15),  # -log sigmoid(0.15) = 0.620957
    ("sigmoid", 0.1, 0.0): 0.9 * softplus(-0.15) + 0.1 * softplus(0.15),  # cDPO: 0.635957
    ("robust", 0.1, 0.0): (0.9 * softplus(-0.15) - 0.1 * softplus(0.15)) / 0.8,  # 0.602207
    ("hinge", 0.0, 0.0): 1 - 0.15,  # relu(1 - z)
    # IPO on per-token means: pc/2 = -0.5, rc/2 = -1, pr/4 = -0.75, rr/4 = -0.625 -> h = 0.625;
    # (h - 1/(2 beta))^2 = (0.625 - 5)^2 = 19.140625
    ("ipo", 0.0, 0.0): 19.140625,
    # RPO: + alpha * (-pc / 2 tokens) = 0.5 * 0.5
    ("sigmoid", 0.0, 0.5): softplus(-0.15) + 0.25,
}


@pytest.mark.parametrize("loss_type, smoothing, alpha", list(HAND))
def test_pair_losses_against_hand_values(tmp_path, loss_type, smoothing, alpha):
    trainer = DPOTrainer(
        tiny_llama(0, VOCAB),
        args=make_args(tmp_path, loss_type=loss_type, beta=0.1, label_smoothing=smoothing, rpo_alpha=alpha),
    )
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    losses, metrics = trainer.pair_losses(t(-1.0), t(-3.0), t(-2.0), t(-2.5), t(2.0), t(4.0))
    assert losses.item() == pytest.approx(HAND[(loss_type, smoothing, alpha)], abs=1e-12)
    if loss_type != "ipo":
        assert metrics["chosen_rewards"].item() == pytest.approx(0.1)  # beta * (pc - rc)
        assert metrics["rejected_rewards"].item() == pytest.approx(-0.05)
    assert ("nll_loss" in metrics) == (alpha > 0)


# -------------------------------------------------------------------- the loss on a real tiny model


def test_policy_equal_to_reference_gives_log2_and_zero_rewards(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer)  # the reference is a frozen copy of the policy
    assert trainer.ref_model is not trainer.model
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, first_batch(trainer))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    metrics = trainer.metrics.means("train")
    assert metrics["rewards/chosen"] == 0.0 and metrics["rewards/rejected"] == 0.0
    assert metrics["rewards/margins"] == 0.0 and metrics["rewards/accuracies"] == 0.0


def test_trainer_loss_and_gradient_equal_plain_pytorch_full_softmax(tmp_path, tokenizer):
    beta = 0.5
    trainer = make_trainer(tmp_path, tokenizer, ref_model=peaked_reference(), beta=beta)
    policy, batch = trainer.model.train(), first_batch(trainer)
    loss = trainer.compute_loss(policy, batch)
    metrics = trainer.metrics.means("train")
    (grad,) = torch.autograd.grad(loss, policy.model.embed_tokens.weight)

    logps, logits, mask = plain_sequence_logps(policy, batch)
    with torch.no_grad():
        ref_logps, _, _ = plain_sequence_logps(trainer.ref_model, batch)
    pc, pr, rc, rr = logps[:4], logps[4:], ref_logps[:4], ref_logps[4:]
    expected = -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()
    (expected_grad,) = torch.autograd.grad(expected, policy.model.embed_tokens.weight)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-4)

    chosen_rewards, rejected_rewards = beta * (pc - rc).detach(), beta * (pr - rr).detach()
    assert metrics["rewards/chosen"] == pytest.approx(chosen_rewards.mean().item(), abs=1e-5)
    assert metrics["rewards/rejected"] == pytest.approx(rejected_rewards.mean().item(), abs=1e-5)
    assert metrics["rewards/accuracies"] == (chosen_rewards > rejected_rewards).float().mean().item()
    assert metrics["logps/chosen"] == pytest.approx(pc.mean().item(), abs=1e-4)
    token_mean_logits = logits[:, :-1].mean(-1)  # mean over the vocabulary, per position
    chosen_mask = mask[:4]
    expected_logits = (token_mean_logits[:4] * chosen_mask).sum() / chosen_mask.sum()
    assert metrics["logits/chosen"] == pytest.approx(expected_logits.item(), abs=1e-5)

    # The classic bug, beta * chosen_logratio - rejected_logratio, gives a clearly different loss here.
    buggy = -F.logsigmoid(beta * (pc - rc) - (pr - rr)).mean()
    assert abs(buggy.item() - loss.item()) > 1e-2


def test_loss_is_normalised_by_the_pairs_of_the_whole_accumulation_window(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, ref_model=peaked_reference())
    model = trainer.model.train()
    rows = [trainer.train_dataset[i] for i in range(4)]
    whole = collate(trainer, rows)
    halves = [collate(trainer, rows[:1]), collate(trainer, rows[1:])]  # 1 pair + 3 pairs
    assert trainer.get_num_items_in_batch(halves) == 4

    full_loss = trainer.compute_loss(model, whole)
    (full_grad,) = torch.autograd.grad(full_loss, model.lm_head.weight)
    window_loss = sum(trainer.compute_loss(model, h, num_items_in_batch=4) for h in halves)
    (window_grad,) = torch.autograd.grad(window_loss, model.lm_head.weight)
    # a mean per micro-batch, averaged over the two micro-batches, would weigh the single pair 3x
    mean_of_means = sum(trainer.compute_loss(model, h) for h in halves) / 2
    assert window_loss.item() == pytest.approx(full_loss.item(), abs=1e-6)
    torch.testing.assert_close(window_grad, full_grad, atol=1e-7, rtol=1e-5)
    assert abs(mean_of_means.item() - full_loss.item()) > 1e-4


def test_precomputed_reference_logps_give_the_same_loss_as_a_live_reference(tmp_path, tokenizer):
    live = make_trainer(tmp_path / "live", tokenizer, ref_model=peaked_reference())
    pre = make_trainer(
        tmp_path / "pre",
        tokenizer,
        ref_model=peaked_reference(),
        precompute_ref_log_probs=True,
        max_steps=1,
        learning_rate=0.0,
    )
    pre.precompute_reference_logps()
    assert pre.ref_model is None  # freed
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(pre.train_dataset.column_names)
    batch = first_batch(pre)
    assert "ref_chosen_logps" in batch
    live_loss = live.compute_loss(live.model.train(), first_batch(live))
    pre_loss = pre.compute_loss(pre.model.train(), batch)
    assert pre_loss.item() == pytest.approx(live_loss.item(), abs=1e-6)
    assert abs(live_loss.item() - math.log(2)) > 1e-3  # the reference differs from the policy
    pre.train()  # trains without any reference model
    assert math.isfinite(pre.state.log_history[-1]["train_loss"])


def test_precompute_inside_train_frees_the_frozen_copy(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, precompute_ref_log_probs=True, max_steps=1)
    assert trainer.ref_model is not None
    trainer.train()
    assert trainer.ref_model is None
    assert "ref_rejected_logps" in trainer.train_dataset.column_names
    with pytest.raises(RuntimeError, match="freed"):
        trainer.evaluate(PAIRS)  # new rows would need the reference that is gone


# ------------------------------------------------------------------------------- PEFT-like policies


class AdapterLM(nn.Module):
    """A duck-typed PEFT model: a frozen base plus a trainable logit offset that ``disable_adapter()`` removes."""

    def __init__(self, base):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.offset = nn.Parameter(torch.randn(base.config.vocab_size, generator=torch.Generator().manual_seed(3)))
        self.adapter_enabled = True

    @contextlib.contextmanager
    def disable_adapter(self):
        self.adapter_enabled = False
        try:
            yield
        finally:
            self.adapter_enabled = True

    def forward(self, input_ids, attention_mask=None, **kwargs):
        logits = self.base(input_ids=input_ids, attention_mask=attention_mask).logits
        return CausalLMOutput(logits=logits + self.offset if self.adapter_enabled else logits)


def test_peft_policy_is_its_own_reference_with_adapters_disabled(tmp_path, tokenizer):
    policy = AdapterLM(tiny_llama(0, VOCAB))
    trainer = make_trainer(tmp_path, tokenizer, model=policy, max_steps=2, learning_rate=1e-2)
    assert trainer.ref_model is None  # no second copy of the model
    batch = first_batch(trainer)
    ref_chosen, ref_rejected = trainer.reference_logps(batch)
    expected, _, _ = plain_sequence_logps(policy.base, batch)
    torch.testing.assert_close(torch.cat([ref_chosen, ref_rejected]), expected, atol=1e-5, rtol=0)
    assert policy.adapter_enabled
    base_before = {k: v.clone() for k, v in policy.base.state_dict().items()}
    offset_before = policy.offset.detach().clone()
    trainer.train()
    assert not torch.equal(policy.offset.detach(), offset_before)
    assert all(torch.equal(v, policy.base.state_dict()[k]) for k, v in base_before.items())


# ------------------------------------------------------------------------------------ training runs


def test_training_run_logs_window_averages_and_evaluate_returns_dpo_metrics(tmp_path, tokenizer):
    # learning_rate 0: the policy stays equal to its reference, so every logged value is known in advance;
    # 4 pairs, 2 per step, one log after both steps: the log averages over all 4 pairs.
    trainer = make_trainer(
        tmp_path, tokenizer, learning_rate=0.0, max_steps=2, logging_steps=2, eval_strategy="steps", eval_steps=2
    )
    trainer.eval_dataset = trainer.prepare_dataset(PAIRS[:3], "eval")
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 1
    with torch.no_grad():
        logps, _, _ = plain_sequence_logps(trainer.model, first_batch(trainer))
    assert logs[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert logs[0]["logps/chosen"] == pytest.approx(logps[:4].mean().item(), abs=1e-4)
    assert logs[0]["logps/rejected"] == pytest.approx(logps[4:].mean().item(), abs=1e-4)
    assert logs[0]["rewards/accuracies"] == 0.0
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logits/chosen", "logits/rejected"):
        assert key in logs[0]
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 1 and evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["eval_logps/chosen"] == pytest.approx(logps[:3].mean().item(), abs=1e-4)
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/rejected",
        "logits/chosen",
        "logits/rejected",
    ):
        assert f"eval_{key}" in metrics


def test_short_run_with_accumulation_changes_every_parameter_and_never_the_reference(tmp_path, tokenizer):
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        max_steps=3,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        per_device_train_batch_size=1,
        logging_steps=1,
        rpo_alpha=1.0,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    ref_before = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    assert all(
        h["rewards/margins"] == pytest.approx(h["rewards/chosen"] - h["rewards/rejected"], abs=1e-6) for h in logs
    )
    assert "nll_loss" in logs[0]
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert unchanged == []
    assert all(torch.equal(p, ref_before[n]) for n, p in trainer.ref_model.named_parameters())


def test_toy_preference_task_reaches_high_reward_accuracy(tmp_path, tokenizer):
    """On 64 addition problems (toy.load_task, preference kind) the policy learns to prefer the right sums of its
    training pairs over plausible wrong ones, relative to its frozen starting point."""
    pairs = toy.load_task("addition", kind="preference", n=64, seed=0)
    trainer = DPOTrainer(
        toy.build_model("tiny", seed=0),
        args=make_args(
            tmp_path,
            max_steps=50,
            per_device_train_batch_size=16,
            learning_rate=5e-3,
            beta=1.0,
            lr_scheduler_type="constant",
            logging_steps=10,
        ),
        train_dataset=pairs,
        processing_class=tokenizer,
    )
    trainer.train()
    accuracies = [h["rewards/accuracies"] for h in trainer.state.log_history if "rewards/accuracies" in h]
    assert accuracies[0] < 0.8 and accuracies[-1] > 0.9, accuracies
    assert trainer.evaluate(pairs)["eval_rewards/accuracies"] > 0.9


# ------------------------------------------------------------------------------------ golden regression
GOLDEN_DPO = [0.6931471824645996, 0.7219655513763428, 0.693049281835556, 0.6908051371574402, 0.6956735849380493]


def test_golden_losses_of_a_fixed_seed(tmp_path):
    """The first 5 logged losses of a fixed-seed run (toy preference pairs, accumulation 2), recorded before the
    metrics window refactor: any change to the loss, the reference, the data order or the loop shows up here."""
    tok = toy.build_tokenizer()
    args = DPOConfig(
        output_dir=str(tmp_path),
        max_steps=5,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        learning_rate=3e-3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    trainer = DPOTrainer(
        toy.build_model("tiny", tokenizer=tok, seed=0),
        args=args,
        train_dataset=toy.load_task("addition", kind="preference", n=64),
        processing_class=tok,
    )
    trainer.train()
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h] == pytest.approx(GOLDEN_DPO, rel=1e-5)
    assert {"rewards/chosen", "rewards/accuracies", "logits/chosen", "logps/rejected"} <= set(
        trainer.state.log_history[0]
    )
