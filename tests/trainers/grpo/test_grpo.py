"""GRPOTrainer: batch semantics, generation cadence, losses against hand values and plain PyTorch, reward
errors, metrics, chat prompts, exact resume, and a reward that rises on the toy addition task."""

import json
import math
import os
import shutil
import statistics

import pytest
import torch
from _factories import (
    GOLDEN_GRPO,
    digit_sum_reward,
    golden_grpo_run as golden_run,
    grpo_args as config,
    grpo_trainer as make_trainer,
    untimed,
)

from treadle.callbacks import TrainerCallback
from treadle.demos import toy
from treadle.generation import GenerationOutput, completion_masks, left_pad
from treadle.record.fingerprints import MARKER
from treadle.rewards import RewardFunctionError
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from treadle.trainers.onpolicy.data import Sample, Ticket

EOS = 2  # the toy tokenizer's eos id


# ------------------------------------------------------------------------------------------------ config
def test_config_defaults():
    args = GRPOConfig(gradient_accumulation_steps=3, per_device_train_batch_size=8, epsilon=0.3)
    assert args.steps_per_generation == 3  # one generation per optimizer step by default
    assert args.epsilon_high == 0.3  # symmetric clipping unless asked otherwise
    assert args.generation_batch_size == 24
    assert (args.num_generations, args.num_iterations, args.loss_type, args.beta) == (8, 1, "dapo", 0.0)


def test_config_rejects_a_group_of_one():
    with pytest.raises(ValueError, match=r"num_generations must be an integer >= 2"):
        GRPOConfig(num_generations=1, per_device_train_batch_size=4)


def test_config_names_the_nearest_valid_values():
    # 4 x 1 x 1 = 4 completions, G = 3. Batch sizes b with b % 3 == 0: 3 below, 6 above. Group sizes g >= 2
    # dividing 4: 2 below, 4 above. Steps s with 4s % 3 == 0: none below 1, 3 above.
    with pytest.raises(ValueError) as err:
        GRPOConfig(per_device_train_batch_size=4, num_generations=3)
    message = str(err.value)
    assert "4 x 1 x 1 = 4 completions" in message
    assert "per_device_train_batch_size=3 or 6, or num_generations=2 or 4, or steps_per_generation=3" in message


def test_the_nearest_valid_hint_is_instant_for_a_huge_num_generations():
    from treadle.trainers.grpo.config import GRPOConfig
    from treadle.trainers.onpolicy.config import _nearest_divisors, _nearest_multiples

    assert _nearest_multiples(5, 4) == [4, 8] and _nearest_multiples(3, 4) == [4]  # hand-computed
    assert _nearest_divisors(12, 5) == [4, 6] and _nearest_divisors(12, 13) == [12]
    assert _nearest_divisors(10**15, 7) == []  # too many trials: no hint rather than a wait
    with pytest.raises(
        ValueError,
        match=r"not a multiple of num_generations=1000000000 .* Nearest valid: "
        r"per_device_train_batch_size=1000000000, or num_generations=8, or steps_per_generation=125000000",
    ):
        GRPOConfig(num_generations=10**9, per_device_train_batch_size=8, steps_per_generation=1)


def test_config_counts_every_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    GRPOConfig(per_device_train_batch_size=2, num_generations=4)  # 2 x 1 x 2 = 4: one group across 2 ranks
    with pytest.raises(ValueError, match=r"1 x 1 x 2 = 2 completions.*per_device_train_batch_size=2"):
        GRPOConfig(per_device_train_batch_size=1, num_generations=4)


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("loss_type", "ppo", "loss_type='ppo' is not supported"),
        ("scale_rewards", "std", "scale_rewards='std'"),
        ("generation_backend", "vllm", "generation_backend='vllm'"),
        ("temperature", 0.0, "temperature must be > 0"),
        ("top_p", 0.0, "top_p must be in (0, 1]"),
        ("epsilon", 1.0, "epsilon must be in [0, 1)"),
        ("beta", -0.1, "beta must be >= 0"),
        ("num_iterations", 0, "num_iterations must be an integer >= 1"),
        ("max_prompt_length", 0, "max_prompt_length must be an integer >= 1 or None"),
    ],
)
def test_config_rejects_bad_values(field, value, fragment):
    with pytest.raises(ValueError) as err:
        GRPOConfig(per_device_train_batch_size=8, **{field: value})
    assert fragment in str(err.value)


def test_trainer_checks_its_arguments(tmp_path, tok, dataset):
    model = toy.build_model("tiny", tokenizer=tok)
    args = config(tmp_path)
    with pytest.raises(ValueError, match="needs reward_funcs"):
        GRPOTrainer(model, None, args=args, train_dataset=dataset, processing_class=tok)
    with pytest.raises(ValueError, match=r"reward_weights has 1 entries for 2 reward functions"):
        GRPOTrainer(
            model,
            [digit_sum_reward, toy.addition_reward],
            args=config(tmp_path, reward_weights=[1.0]),
            train_dataset=dataset,
            processing_class=tok,
        )
    with pytest.raises(ValueError, match=r"needs column\(s\) \['prompt'\]"):
        GRPOTrainer(
            model,
            digit_sum_reward,
            args=args,
            train_dataset=dataset.rename_column("prompt", "question"),
            processing_class=tok,
        )
    with pytest.raises(ValueError, match="needs processing_class"):
        GRPOTrainer(model, digit_sum_reward, args=args, train_dataset=dataset)
    with pytest.raises(ValueError, match=r"needs 4 distinct prompts .* the dataset has 3 rows"):
        GRPOTrainer(
            model,
            digit_sum_reward,
            args=config(tmp_path, per_device_train_batch_size=16),
            train_dataset=dataset.select(range(3)),
            processing_class=tok,
        )
    with pytest.raises(ValueError, match="distinct names"):
        GRPOTrainer(
            model, [digit_sum_reward, digit_sum_reward], args=args, train_dataset=dataset, processing_class=tok
        )
    with pytest.raises(TypeError, match="needs a GRPOConfig"):
        from treadle.arguments import TrainingArguments

        GRPOTrainer(model, digit_sum_reward, args=TrainingArguments(), train_dataset=dataset, processing_class=tok)


# ------------------------------------------------------------------------------------- data and cadence
def test_dataloader_batches_hold_whole_groups_once_per_generation(tmp_path, tok, dataset):
    trainer = make_trainer(
        tmp_path,
        tok,
        dataset,
        per_device_train_batch_size=4,
        steps_per_generation=2,
        num_iterations=3,
        gradient_accumulation_steps=2,
    )
    loader = trainer.get_train_dataloader()
    batches = [[row["prompt"] for row in rows] for rows in loader]
    assert len(loader) == len(batches) == 32 // 2  # 8 rows = 2 distinct prompts per generation, each drawn once
    for batch in batches:
        assert len(batch) == 4 * 2  # per_device_train_batch_size * steps_per_generation
        assert batch[:4] == [batch[0]] * 4 and batch[4:] == [batch[4]] * 4 and batch[0] != batch[4]
    distinct = [p for batch in batches for p in batch[::4]]
    assert sorted(distinct) == sorted(dataset["prompt"])  # one epoch visits every prompt once
    assert trainer.micro_batches_per_batch() == 2 * 3  # each generation batch feeds spg * mu micro-steps


def test_training_windows_hand_out_each_generation_for_a_whole_cycle_and_resume_inside_one(tmp_path, tok, dataset):
    trainer = make_trainer(
        tmp_path,
        tok,
        dataset,
        per_device_train_batch_size=4,
        steps_per_generation=2,
        num_iterations=3,
        gradient_accumulation_steps=4,
    )
    loader = trainer.get_train_dataloader()
    windows = list(trainer.training_windows(loader, epoch=1, skip_steps=0))
    tickets = [(t.generation, t.micro_step) for w in windows for t in w]
    assert [len(w) for w in windows] == [4] * 24  # 16 generations x 6 micro-steps / 4 per window
    assert tickets == [(16 + g, m) for g in range(16) for m in range(6)]  # epoch 1 starts at generation 16
    assert all(t.rows is w[0].rows for w in windows[:1] for t in w)  # one draw of the rows serves the cycle
    resumed = list(trainer.training_windows(loader, epoch=1, skip_steps=5))  # 20 micro-steps in: generation 3, m=2
    assert [(t.generation, t.micro_step) for w in resumed for t in w] == tickets[20:]
    assert [r["prompt"] for r in resumed[0][0].rows] == [r["prompt"] for r in windows[4][3].rows]


@pytest.mark.parametrize(
    "accum, spg, mu, steps, generations, old_logps",
    [
        (1, 1, 1, 3, 3, False),  # the default: one generation per optimizer step
        (2, 4, 2, 8, 2, True),  # a buffer spans optimizer steps and is reused twice: ratios need old log-probs
        (4, 1, 2, 2, 4, False),  # a window spans generations (generated ahead for dapo); policy fixed inside
    ],
)
def test_generation_runs_once_per_cycle(tmp_path, tok, dataset, accum, spg, mu, steps, generations, old_logps):
    trainer = make_trainer(
        tmp_path,
        tok,
        dataset,
        gradient_accumulation_steps=accum,
        steps_per_generation=spg,
        num_iterations=mu,
        max_steps=steps,
        max_completion_length=2,
    )
    calls, slices = [], []
    generate, prepare = trainer.generate, trainer.prepare_inputs

    def counting_generate(prompt_ids, **kwargs):
        calls.append((len(prompt_ids), kwargs["num_generations"]))
        return generate(prompt_ids, **kwargs)

    def recording_prepare(inputs):
        batch = prepare(inputs)
        slices.append(batch)
        return batch

    trainer.generate, trainer.prepare_inputs = counting_generate, recording_prepare
    trainer.train()
    micro_steps = steps * accum
    assert len(slices) == micro_steps
    assert len(calls) == micro_steps // (spg * mu) == generations
    assert calls == [(spg, 4)] * generations  # 4 * spg rows = spg distinct prompts, each sampled G = 4 times
    assert all(isinstance(b, Sample) and len(b.advantages) == 4 for b in slices)
    assert all((b.old_logps is not None) == old_logps for b in slices)
    assert all(b.sampling_logps.shape == b.completion_mask.shape for b in slices)


# ---------------------------------------------------------------------------------------- loss by hand
class UniformLM(torch.nn.Module):
    """Logits = one learnable vector for every position: every token's log-prob is -log V at zero."""

    def __init__(self, vocab_size=4):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(vocab_size))

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        return torch.zeros(*input_ids.shape, self.bias.shape[0]) + self.bias


def hand_inputs():
    """Two completions after a 2-token prompt; ratios r = exp(logp - old) of 1.5, 1.1, 0.9 | 0.5 (A = 1 | -2).

    Per-token losses -min(r A, clip(r, 0.8, 1.2) A): row 0: -1.2, -1.1, -0.9 (sum -3.2); row 1: -min(-1.0,
    -1.6) = 1.6. Clipped: low (r < 0.8, A < 0) 1 token of 4, high (r > 1.2, A > 0) 1 token of 4.
    """
    logp = -math.log(4)
    ratios = torch.tensor([[1.5, 1.1, 0.9], [0.5, 1.0, 1.0]], dtype=torch.float64)
    return {
        "input_ids": torch.tensor([[1, 2, 3, 0, 1], [1, 2, 3, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        "advantages": torch.tensor([1.0, -2.0]),
        "old_logps": (logp - ratios.log()).float(),
    }


@pytest.mark.parametrize(
    "loss_type, num_items, expected",
    [
        ("grpo", None, (-3.2 / 3 + 1.6) / 2),  # mean over the 2 sequences of each one's token mean
        ("grpo", 4, (-3.2 / 3 + 1.6) / 4),  # a window of 4 sequences
        ("bnpo", 10, -1.6 / 4),  # token mean of this micro-batch; the window count is not used
        ("dr_grpo", 10, -1.6 / (2 * 5)),  # sum / (B x max_completion_length)
        ("dapo", None, -1.6 / 4),  # tokens of this batch
        ("dapo", 10, -1.6 / 10),  # tokens of the whole window on all ranks
    ],
)
def test_every_loss_type_by_hand(tmp_path, tok, loss_type, num_items, expected):
    args = GRPOConfig(
        output_dir=str(tmp_path),
        loss_type=loss_type,
        max_completion_length=5,
        epsilon=0.2,
        per_device_train_batch_size=8,
    )
    trainer = GRPOTrainer(UniformLM(), digit_sum_reward, args=args, processing_class=tok)
    loss = trainer.compute_loss(trainer.model, hand_inputs(), num_items_in_batch=num_items)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    metrics = trainer.metrics.means("train")
    assert metrics["clip_ratio/low_mean"] == pytest.approx(0.25)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(0.25)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(0.5)
    assert metrics["entropy"] == pytest.approx(math.log(4), abs=1e-6)  # uniform over 4 tokens
    assert "kl" not in metrics  # beta = 0


def test_clip_higher_uses_epsilon_high(tmp_path, tok):
    # epsilon_high = 0.3: the first token's ratio 1.5 is clipped at 1.3 instead of 1.2 -> sum -1.7
    args = GRPOConfig(
        output_dir=str(tmp_path), loss_type="dapo", epsilon=0.2, epsilon_high=0.3, per_device_train_batch_size=8
    )
    trainer = GRPOTrainer(UniformLM(), digit_sum_reward, args=args, processing_class=tok)
    loss = trainer.compute_loss(trainer.model, hand_inputs())
    assert loss.item() == pytest.approx(-1.7 / 4, abs=1e-6)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_ratio_one_gives_the_reinforce_gradient(tmp_path, tok, loss_type):
    """No old log-probs and beta = 0: the gradient is that of -sum_i A_i sum_t logp_it / N (dapo) or
    -sum_i A_i mean_t logp_it / B (grpo), computed here with a plain forward and log_softmax."""
    torch.manual_seed(0)
    args = GRPOConfig(output_dir=str(tmp_path), loss_type=loss_type, temperature=0.7, per_device_train_batch_size=8)
    model = toy.build_model("tiny", tokenizer=tok, seed=1)
    trainer = GRPOTrainer(model, digit_sum_reward, args=args, processing_class=tok)
    prompt = torch.randint(7, 103, (3, 4))  # equal-length prompts: positions are 0..T-1 without padding
    completion = torch.randint(7, 103, (3, 5))
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    completion = completion.masked_fill(completion_mask == 0, 0)
    advantages = torch.tensor([0.7, -1.3, 0.4])
    inputs = {
        "input_ids": torch.cat([prompt, completion], 1),
        "attention_mask": torch.cat([torch.ones_like(prompt), completion_mask], 1),
        "completion_mask": completion_mask,
        "advantages": advantages,
    }
    tokens = int(completion_mask.sum())
    num_items = tokens if loss_type == "dapo" else 3
    trainer.compute_loss(model, inputs, num_items_in_batch=num_items).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    logps = torch.log_softmax(logits[:, 3:-1] / 0.7, dim=-1).gather(2, completion[..., None]).squeeze(2)
    mask = completion_mask.float()
    if loss_type == "dapo":
        reference = -(advantages[:, None] * logps * mask).sum() / tokens
    else:
        reference = -(advantages * (logps * mask).sum(1) / mask.sum(1)).sum() / 3
    reference.backward()
    for name, p in model.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-6, rtol=1e-4), name
    assert any(g.abs().sum() > 0 for g in got.values())


def test_left_padding_does_not_change_the_trained_log_probs(tmp_path, tok):
    """Positions start at the first prompt token, as when sampling: a left-padded row's completion log-probs
    equal those of the row run alone, without padding. GPT-2 has absolute position embeddings (Llama's RoPE
    is blind to a shift of every position, so it would not notice)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    args = GRPOConfig(output_dir=str(tmp_path), temperature=0.8, per_device_train_batch_size=8)
    torch.manual_seed(2)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=32))
    model.eval()  # no dropout
    trainer = GRPOTrainer(model, digit_sum_reward, args=args, processing_class=tok)
    prompts, completions = [[10, 11, 12, 13, 14], [20, 21]], [[30, 31, 32], [40, 41, EOS]]
    ids, mask = left_pad(prompts, 0)
    batch = Sample(
        input_ids=torch.cat([ids, torch.tensor(completions)], 1),
        attention_mask=torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1),
        completion_mask=torch.ones(2, 3, dtype=torch.long),
        advantages=torch.zeros(2),
    )
    with torch.no_grad():
        logps = trainer.completion_logps(model, batch).logps
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            alone = torch.tensor([prompt + completion])
            logits = model(input_ids=alone).logits[0, len(prompt) - 1 : -1] / 0.8
            expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)
            assert torch.allclose(logps[row], expected, atol=1e-5), row


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_accumulation_gives_the_big_batch_step(tmp_path, tok, dataset, loss_type):
    """8 completions in one micro-batch, or 2 micro-batches of 4 from the same generation: same SGD step."""
    common = dict(
        max_steps=1, optim="sgd", learning_rate=0.5, max_grad_norm=0.0, loss_type=loss_type, max_completion_length=4
    )
    big = make_trainer(tmp_path / "big", tok, dataset, per_device_train_batch_size=8, **common)
    small = make_trainer(
        tmp_path / "small", tok, dataset, per_device_train_batch_size=4, gradient_accumulation_steps=2, **common
    )
    before = {n: p.detach().clone() for n, p in big.model.named_parameters()}
    big.train()
    small.train()
    moved = 0.0
    for (name, p), q in zip(big.model.named_parameters(), small.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), name
        moved += float((p.detach() - before[name]).abs().sum())
    assert moved > 1e-3  # the step did something


# --------------------------------------------------------------------------------------- reward errors
def test_a_reward_error_names_function_step_and_sample(tmp_path, tok, dataset):
    calls = []

    def flaky(prompts, completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ZeroDivisionError("division by zero")
        return [0.0] * len(completions)

    trainer = make_trainer(tmp_path, tok, dataset, reward=flaky, max_steps=3)
    with pytest.raises(RewardFunctionError) as err:
        trainer.train()
    message = str(err.value)
    assert "'flaky' raised ZeroDivisionError" in message and "at step 1" in message
    assert "prompt='" in message and "answer='" in message


def test_a_wrong_length_fails_at_the_first_generation(tmp_path, tok, dataset):
    def short(completions, **kwargs):
        return [1.0]

    with pytest.raises(RewardFunctionError, match=r"'short' returned 1 values for 4 completions at step 0"):
        make_trainer(tmp_path, tok, dataset, reward=short).train()


# ------------------------------------------------------------------------------------ records and metrics
def group_stats(values, size):
    groups = [values[i : i + size] for i in range(0, len(values), size)]
    return [(statistics.mean(g), statistics.stdev(g)) for g in groups]


def test_metrics_and_completions_file(tmp_path, tok, dataset):
    seen = []

    def length_reward(completion_ids, **kwargs):
        seen.extend(completion_ids)
        return [float(len(ids) + sum(ids) % 3) for ids in completion_ids]

    trainer = make_trainer(
        tmp_path,
        tok,
        dataset,
        reward=length_reward,
        per_device_train_batch_size=8,
        max_steps=2,
        logging_steps=2,
        beta=0.1,
        log_completions=True,
        max_completion_length=3,
        reward_weights=[2.0],
    )
    trainer.train()
    logs = trainer.state.log_history[0]
    for key in (
        "reward",
        "reward_std",
        "rewards/length_reward/mean",
        "rewards/length_reward/std",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "kl",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "entropy",
        "loss",
    ):
        assert key in logs, key
    with open(tmp_path / "run" / "completions.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [0] * 8 + [1] * 8
    raw = [r["rewards"]["length_reward"] for r in records]
    assert raw == [float(len(ids) + sum(ids) % 3) for ids in seen]
    weighted = [2.0 * r for r in raw]  # reward_weights=[2.0]
    # both steps generate 8 completions: the logged means over the window are plain means
    assert logs["reward"] == pytest.approx(statistics.mean(weighted))
    assert logs["rewards/length_reward/mean"] == pytest.approx(statistics.mean(raw))
    stats = group_stats(weighted, 4)
    # reward_std as TRL 1.16: the std of each generation's rewards (then the mean over the 2 generations);
    # reward_group_std: the mean of the groups' stds
    assert logs["reward_std"] == pytest.approx(
        statistics.mean([statistics.stdev(weighted[:8]), statistics.stdev(weighted[8:])])
    )
    assert logs["reward_group_std"] == pytest.approx(statistics.mean(s for _, s in stats))
    assert logs["frac_reward_zero_std"] == pytest.approx(statistics.mean(float(s == 0) for _, s in stats))
    advantages = [(w - stats[i // 4][0]) / (stats[i // 4][1] + 1e-4) for i, w in enumerate(weighted)]
    assert [r["advantage"] for r in records] == pytest.approx(advantages, abs=1e-5)
    lengths = [len(ids) for ids in seen]
    assert logs["completions/mean_length"] == pytest.approx(statistics.mean(lengths))
    assert logs["completions/min_length"] == pytest.approx(statistics.mean([min(lengths[:8]), min(lengths[8:])]))
    truncated = [float(len(ids) == 3 and ids[-1] != EOS) for ids in seen]
    assert logs["completions/clipped_ratio"] == pytest.approx(statistics.mean(truncated))
    ended = [[len(ids) for ids in part if ids[-1] == EOS] or [0] for part in (seen[:8], seen[8:])]  # none: 0 (TRL)
    for name, stat in (("mean", statistics.mean), ("min", min), ("max", max)):
        expected = statistics.mean(stat(lengths) for lengths in ended)
        assert logs[f"completions/{name}_terminated_length"] == pytest.approx(expected)
    assert records[0]["prompt"] in dataset["prompt"] and isinstance(records[0]["completion"], str)
    assert 0 <= logs["kl"] < 1e-2  # the policy starts at the reference; one small step away


def test_kl_is_zero_while_the_policy_is_the_reference(tmp_path, tok, dataset):
    trainer = make_trainer(tmp_path, tok, dataset, beta=0.5, max_steps=1, logging_steps=1)
    trainer.train()
    assert trainer.state.log_history[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    ref = dict(trainer.ref_model.named_parameters())
    assert all(not p.requires_grad for p in ref.values())
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, ref[n])]
    assert changed  # the policy moved, the reference did not


def fake_generation(completions):
    """A `generate` replacement returning fixed completions (token lists) for each prompt's group."""

    def generate(prompt_ids, *, num_generations, generator=None):
        rows = len(prompt_ids) * num_generations
        ids, mask = left_pad([p for p in prompt_ids for _ in range(num_generations)], 0)
        raw = torch.tensor([completions[i % len(completions)] for i in range(rows)])
        completion_ids, completion_mask, truncated = completion_masks(raw, (EOS,), 0)
        return GenerationOutput(ids, mask, completion_ids, completion_mask, truncated)

    return generate


def test_num_tokens_counts_each_generation_once(tmp_path, tok, dataset):
    """TRL's ``num_tokens``: each generation's prompt tokens and completion lengths (EOS included), counted when it is
    sampled. With ``num_iterations=2`` step 1's generation trains step 2 too: step 2 logs no ``num_tokens`` (as TRL:
    no generation since the last log) and step 3 adds its own generation's."""
    trainer = make_trainer(tmp_path, tok, dataset, num_iterations=2, max_steps=3, logging_steps=1)
    prompts = []
    fake = fake_generation([[10, EOS, 0], [10, 11, 12], [EOS, 0, 0], [13, 14, EOS]])  # lengths 2, 3, 1, 3

    def generate(ids, **kw):  # each distinct prompt's tokens count once per completion of its group
        prompts.append(sum(map(len, ids)) * kw["num_generations"])
        return fake(ids, **kw)

    trainer.generate = generate
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h.get("num_tokens") for h in logs] == [prompts[0] + 9, None, prompts[0] + prompts[1] + 18]
    assert trainer.state.num_tokens == prompts[0] + prompts[1] + 18
    terminated = [h["completions/mean_terminated_length"] for h in logs if "num_tokens" in h]
    assert terminated == [2.0, 2.0] and logs[0]["completions/max_terminated_length"] == 3.0


def test_mask_truncated_completions(tmp_path, tok, dataset):
    trainer = make_trainer(tmp_path, tok, dataset, mask_truncated_completions=True, max_completion_length=3)
    trainer.generate = fake_generation([[10, EOS, 0], [10, 11, 12], [EOS, 0, 0], [13, 14, EOS]])
    rows = next(iter(trainer.get_train_dataloader()))
    (batch,) = trainer.prepare_window([Ticket(0, rows, 0)])
    completion_attention = batch.attention_mask[:, -3:]
    assert completion_attention.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
    assert batch.completion_mask.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]]  # row 1: no EOS


def test_chat_prompts_use_the_template_and_get_chat_completions(tmp_path, tok, dataset):
    chat = dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    seen, prompt_ids = {}, []

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [1.0] * len(completions)

    trainer = make_trainer(tmp_path, tok, chat, reward=spy, max_steps=1)
    generate = trainer.generate

    def capture(ids, **kwargs):
        prompt_ids.extend(ids)
        return generate(ids, **kwargs)

    trainer.generate = capture
    trainer.train()
    prompt = seen["prompts"][0]
    assert prompt[0]["role"] == "user" and prompt[0]["content"] in dataset["prompt"]
    rendered = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|user|>") and rendered.endswith("<|assistant|>")
    assert prompt_ids[0] == tok(rendered, add_special_tokens=False)["input_ids"]
    for completion in seen["completions"]:
        assert isinstance(completion, list) and len(completion) == 1
        assert completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)


def test_max_prompt_length_keeps_the_end(tmp_path, tok, dataset):
    trainer = make_trainer(tmp_path, tok, dataset, max_prompt_length=3)
    prompt_ids = []
    trainer.generate = lambda ids, **kw: prompt_ids.extend(ids) or fake_generation([[EOS, 0]])(ids, **kw)
    trainer.prepare_window([Ticket(0, next(iter(trainer.get_train_dataloader())), 0)])
    assert all(len(p) == 3 for p in prompt_ids)
    assert all(tok.decode(p).endswith("=") for p in prompt_ids)


# ---------------------------------------------------------------------------------- resume and evaluate
def test_resume_inside_a_generation_buffer_is_exact(tmp_path, tok, dataset):
    """spg = 2, accumulation 1: each buffer spans two optimizer steps. Stopping after step 1 (mid-buffer) and
    resuming gives the same weights and logs as the uninterrupted run."""
    common = dict(
        steps_per_generation=2,
        max_steps=4,
        save_strategy="steps",
        save_steps=1,
        logging_steps=1,
        max_completion_length=3,
        learning_rate=1e-2,
    )
    full = make_trainer(tmp_path / "full", tok, dataset, **common)
    full.train()
    checkpoint = tmp_path / "full" / "run" / "checkpoint-1"
    assert (checkpoint / "extra_state_0.pt").is_file()
    resumed_dir = tmp_path / "resumed" / "run"
    os.makedirs(resumed_dir)
    shutil.copytree(checkpoint, resumed_dir / "checkpoint-1")
    resumed = make_trainer(tmp_path / "resumed", tok, dataset, model_seed=5, **common)  # weights come from disk
    calls = []
    generate = resumed.generate
    resumed.generate = lambda ids, **kw: calls.append(1) or generate(ids, **kw)
    resumed.train(resume_from_checkpoint=True)
    assert len(calls) == 1  # step 2 used the saved buffer; only step 3's generation ran
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    later = lambda history: [h for h in untimed(history) if h["step"] > 1 and "reward" in h]  # noqa: E731
    assert later(resumed.state.log_history) == later(full.state.log_history)


def test_a_checkpoint_in_the_first_release_layout_resumes_exactly(tmp_path, tok, dataset):
    """Checkpoints written before the metrics window kept the unlogged loss in trainer_state.json and GRPO's
    buffers and metric sums at the top of extra_state_0.pt. Rewritten into that layout, checkpoint-1 (mid-buffer,
    mid-logging-window) still resumes into the uninterrupted run's weights and logs."""
    common = dict(
        steps_per_generation=2,
        max_steps=4,
        save_strategy="steps",
        save_steps=1,
        logging_steps=2,
        max_completion_length=3,
        learning_rate=1e-2,
    )
    full = make_trainer(tmp_path / "full", tok, dataset, **common)
    full.train()
    old = tmp_path / "old" / "run" / "checkpoint-1"
    shutil.copytree(tmp_path / "full" / "run" / "checkpoint-1", old)
    extra = torch.load(old / "extra_state_0.pt", weights_only=True)
    window = extra["metrics"]["train"]
    rows = {name: window["sums"][i].tolist() for i, name in enumerate(window["names"])}
    loss_sum, items = rows.pop("loss")
    torch.save(
        {"micro_step": 1, "buffers": extra["trainer"]["buffer"]["slices"], "metric_sums": rows},
        old / "extra_state_0.pt",
    )
    state = json.loads((old / "trainer_state.json").read_text())
    state["stateful_callbacks"]["_log_window"] = {"loss_sum": loss_sum, "items": items}
    (old / "trainer_state.json").write_text(json.dumps(state))
    os.remove(old / MARKER)  # checkpoints of the first release had no digests marker
    resumed = make_trainer(tmp_path / "old", tok, dataset, model_seed=5, **common)
    resumed.train(resume_from_checkpoint=True)
    for (name, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    logged = lambda history: [h for h in untimed(history) if "loss" in h]  # noqa: E731
    assert [h["step"] for h in logged(resumed.state.log_history)] == [2, 4]
    assert logged(resumed.state.log_history) == logged(full.state.log_history)  # step 2 holds step 1's window


def test_resume_without_the_buffer_warns(tmp_path, tok, dataset):
    common = dict(steps_per_generation=2, max_steps=2, save_strategy="steps", save_steps=1)
    make_trainer(tmp_path, tok, dataset, **common).train()
    os.remove(tmp_path / "run" / "checkpoint-1" / "extra_state_0.pt")
    os.remove(tmp_path / "run" / "checkpoint-1" / MARKER)  # as a checkpoint written without the buffer would be
    shutil.rmtree(tmp_path / "run" / "checkpoint-2")
    with pytest.warns(UserWarning, match="not an exact continuation"):
        make_trainer(tmp_path, tok, dataset, **common).train(resume_from_checkpoint=True)


def test_sampling_is_seeded(tmp_path, tok, dataset):
    runs = []
    for name in ("a", "b"):
        trainer = make_trainer(tmp_path / name, tok, dataset, max_steps=2, log_completions=True)
        trainer.train()
        with open(tmp_path / name / "run" / "completions.jsonl") as f:
            runs.append([json.loads(line)["completion"] for line in f])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1
    other = make_trainer(tmp_path / "c", tok, dataset, max_steps=2, log_completions=True, seed=7)
    other.train()
    with open(tmp_path / "c" / "run" / "completions.jsonl") as f:
        assert [json.loads(line)["completion"] for line in f] != runs[0]


def test_evaluate_reports_sampled_rewards(tmp_path, tok, dataset):
    scored = []

    def length_reward(completion_ids, **kwargs):
        values = [float(len(ids)) for ids in completion_ids]
        scored.extend(values)
        return values

    class Recorder(TrainerCallback):
        metrics = None

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            Recorder.metrics = metrics

    trainer = make_trainer(tmp_path, tok, dataset, reward=length_reward, per_device_eval_batch_size=4)
    trainer.add_callback(Recorder())
    eval_set = dataset.select(range(6))  # two batches, the second one partial
    metrics = trainer.evaluate(eval_set)
    assert len(scored) == 6 * 4  # G completions for every prompt
    assert metrics["eval_reward"] == pytest.approx(statistics.mean(scored))
    assert metrics["eval_rewards/length_reward/mean"] == pytest.approx(statistics.mean(scored))
    assert metrics["eval_completions/mean_length"] == pytest.approx(statistics.mean(scored))
    assert Recorder.metrics == metrics
    assert trainer.evaluate(eval_set) == metrics  # seeded: the same samples for the same weights


def test_evaluation_during_training_keeps_the_best_checkpoint(tmp_path, tok, dataset):
    trainer = make_trainer(
        tmp_path,
        tok,
        dataset,
        max_steps=2,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        metric_for_best_model="reward",
        logging_steps=1,
    )
    trainer.eval_dataset = dataset.select(range(4))
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert [h["step"] for h in evals] == [1, 2]
    best = max(evals, key=lambda h: h["eval_reward"])  # greater is better for a reward
    assert trainer.state.best_metric == best["eval_reward"]
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best['step']}")
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all("reward" in h and not any(k.startswith("eval_") for k in h) for h in train_logs)


# ----------------------------------------------------------------------------------- learning signal
def sft_warm(model, tok, dataset, steps, lr=1e-2, batch_size=64, seed=0):
    """A few steps of plain supervised training on prompt -> answer + eos (loss on the answer)."""
    rows = []
    for row in dataset:
        prompt = tok(row["prompt"])["input_ids"]
        answer = tok(row["answer"])["input_ids"] + [tok.eos_token_id]
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        picked = [rows[i] for i in torch.randint(0, len(rows), (batch_size,), generator=g).tolist()]
        width = max(len(ids) for ids, _ in picked)
        ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in picked])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in picked])
        model(input_ids=ids, attention_mask=(ids != 0).long(), labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


PAIRS = [
    (12, 34),
    (7, 58),
    (40, 41),
    (23, 9),
    (66, 13),
    (5, 5),
    (81, 17),
    (30, 62),
    (14, 28),
    (55, 21),
    (3, 90),
    (47, 47),
    (26, 11),
    (72, 8),
    (19, 60),
    (38, 15),
]


@pytest.mark.slow
def test_reward_rises_on_toy_addition(tmp_path, tok):
    """SFT-warm the tiny model on 16 addition problems until greedy decoding gets some right, then GRPO with
    the exact-match reward: the sampled reward (and the greedy accuracy) rise clearly within 40 steps."""
    from datasets import Dataset

    problems = Dataset.from_list([{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in PAIRS])
    model = toy.build_model("tiny", tokenizer=tok)
    for round_ in range(30):  # warm in rounds of 5 steps: the number needed depends on the initial weights
        sft_warm(model, tok, problems, steps=5, seed=round_)
        accuracy_before = toy.exact_match_accuracy(model, tok, problems)
        if accuracy_before >= 0.4:
            break
    assert 0.4 <= accuracy_before < 0.9
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=128,
        num_generations=8,
        max_completion_length=4,
        max_steps=40,
        logging_steps=1,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        disable_tqdm=True,
        save_strategy="no",
    )
    trainer = GRPOTrainer(model, toy.addition_reward, args=args, train_dataset=problems, processing_class=tok)
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    assert len(rewards) == 40
    assert last > first + 0.15, rewards
    assert toy.exact_match_accuracy(model, tok, problems) > accuracy_before


# ------------------------------------------------------------------------------------ golden regression
def test_golden_losses_of_a_fixed_seed(tmp_path, tok):
    """The first 5 logged losses of a fixed-seed run, recorded before generation moved to prepare_window and the
    metrics to the Trainer's window: any change to sampling, rewards, advantages, the loss or the loop shows."""
    trainer = golden_run(tmp_path, tok)
    trainer.train()
    # abs: the padding-free forward (default) sums in another order; a near-zero loss moved by 3e-8
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h] == pytest.approx(
        GOLDEN_GRPO, rel=1e-5, abs=1e-7
    )
    assert {"kl", "entropy", "reward", "completions/mean_length"} <= set(trainer.state.log_history[0])


def test_every_trainable_parameter_changes_and_the_reference_does_not(tmp_path, tok):
    trainer = golden_run(tmp_path, tok)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    reference = {k: v.clone() for k, v in trainer.ref_model.state_dict().items()}
    trainer.train()
    unchanged = [k for k, v in trainer.model.state_dict().items() if torch.equal(v, before[k])]
    assert unchanged == []
    assert all(torch.equal(v, reference[k]) for k, v in trainer.ref_model.state_dict().items())
