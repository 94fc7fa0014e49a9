"""The toy trainers' work, shared by ``benchmarks.trainers`` and ``benchmarks.packing``: the model, the data, the
settings every contender reports (and which of them must match), and the hand-written PyTorch loops.

- Model: ``treadle.demos.toy.build_model(size)`` (a Llama with the 103-token character vocabulary, seed 0) and the
  toy tokenizer. Data: few-shot 2-digit additions built in code, every row of a workload the same number of tokens,
  so no contender pads more than another whatever order its sampler draws.
- Optimizer: torch AdamW (lr 1e-5, no weight decay, the for-loop implementation for all: TRL is given
  ``optim="adamw_torch"`` because transformers would otherwise pick the fused kernel), clipping at 1.0, a linear decay
  schedule, one micro-batch per optimizer step, no evaluation, no checkpoints, no progress bars, logging at the end.
- The loops are what a careful engineer writes by hand: "bare" (an index permutation, no clipping, no schedule) and
  "plain" (a DataLoader for SFT / DPO, clipping at 1.0 and a linear schedule, as the trainers do); the model's own
  loss (SFT) or a log-softmax + gather (DPO, GRPO), no metrics.
"""

from __future__ import annotations

import copy
import random
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from benchmarks._lockstep import Workload
from treadle import TrainerCallback
from treadle.demos import toy
from treadle.generation import SamplingParams
from treadle.generation.single import sample_completions

LR = 1e-5
BATCH = 8  # rows (SFT), pairs (DPO) or completions (GRPO) per optimizer step
GROUP = 8  # GRPO: completions per prompt
BETA_DPO = 0.1
EPSILON = 0.2  # GRPO clipping
SFT_PROMPT, DPO_PROMPT, GRPO_PROMPT = 124, 60, 64  # prompt lengths in characters (= toy tokens)
# Every contender of a run must do the same work: these settings must be equal in all of them...
MUST_MATCH = ("loss", "batch", "sampled tokens", "optimizer")
# ...and these in all of them but the row that shows TRL as its defaults configure it (labelled as such).
MUST_MATCH_COMPARED = ("precision", "grad checkpointing")
TRL_DEFAULTS = "TRL defaults (bf16 autocast + grad ckpt)"
# The two health checks that stop a run: an untrained model on the addition reward gets equal rewards in every group,
# and every completion is truncated (fixed_length), so they would stop treadle's GRPO at step 10 or 20. Their metrics
# and the warning checks still run: the per-step work stays what a user's run does.
GRPO_HEALTH_CHECKS = {"no_learning_signal": False, "all_truncated": False}


# ---------------------------------------------------------------------------------------------------------
# Data: few-shot additions, every row of a workload exactly the same number of tokens
# ---------------------------------------------------------------------------------------------------------
def few_shot_prompt(rng: random.Random, length: int) -> tuple[str, int]:
    """(prompt of exactly ``length`` characters ending with a question "a+b=", the answer a+b)."""
    a, b = rng.randrange(100), rng.randrange(100)
    question = f"{a}+{b}="
    shots = ""
    while len(shots) < length:
        x, y = rng.randrange(100), rng.randrange(100)
        shots += f"{x}+{y}={x + y}\n"
    return shots[len(shots) - (length - len(question)) :] + question, a + b


def sft_rows(n: int) -> list[dict]:
    rng = random.Random(1)
    rows = []
    for _ in range(n):
        prompt, total = few_shot_prompt(rng, SFT_PROMPT)
        rows.append({"prompt": prompt, "completion": f"{total:03d}"})  # + EOS = 128 tokens
    return rows


def dpo_rows(n: int) -> list[dict]:
    rng = random.Random(2)
    rows = []
    for _ in range(n):
        prompt, total = few_shot_prompt(rng, DPO_PROMPT)
        wrong = (total + rng.choice([-10, -1, 1, 10])) % 1000
        # 15 characters + EOS each
        rows.append({"prompt": prompt, "chosen": f"{total:03d} is the sum.", "rejected": f"{wrong:03d} is the sum."})
    return rows


def grpo_rows(n: int) -> list[dict]:
    rng = random.Random(3)
    rows = []
    for _ in range(n):
        prompt, total = few_shot_prompt(rng, GRPO_PROMPT)
        rows.append({"prompt": prompt, "answer": str(total)})
    return rows


def rows_for(work: Workload, steps: int) -> list[dict]:
    if work.kind == "sft":
        return sft_rows(steps * BATCH)
    if work.kind == "dpo":
        return dpo_rows(steps * BATCH)
    return grpo_rows(steps * BATCH // GROUP)


def build(size: str):
    """(tokenizer, model) for one contender: the same weights every time."""
    tokenizer = toy.build_tokenizer()
    model = toy.build_model(size, tokenizer=tokenizer, seed=0)
    return tokenizer, model.train()


def fixed_length(tokenizer) -> dict:
    """GRPO's generation settings that make every completion exactly L tokens: the end token suppressed, as
    ``generate``'s ``suppress_tokens`` does. An untrained model samples it about once per 100 tokens, which would give
    each contender a different amount of work by chance."""
    return {"suppress_tokens": [tokenizer.eos_token_id]}


def items_per_step(work: Workload) -> tuple[float, str]:
    """(throughput items in one optimizer step, their unit)."""
    if work.kind == "sft":
        return BATCH * (SFT_PROMPT + 4), "tokens/s"
    return BATCH, "pairs/s" if work.kind == "dpo" else "completions/s"


# ---------------------------------------------------------------------------------------------------------
# Settings: what every contender reports beside its row, and which of them must match
# ---------------------------------------------------------------------------------------------------------
def loss_label(work: Workload) -> str:
    return {
        "sft": "completion-token NLL",
        "dpo": f"sigmoid DPO, beta {BETA_DPO}",
        "grpo": f"dapo, eps {EPSILON}, beta 0",
    }[work.kind]


def plain_settings(work: Workload, bare: bool) -> dict:
    return {
        "precision": "float32",
        "grad checkpointing": False,
        "loss": loss_label(work),
        "batch": BATCH,
        "optimizer": "AdamW for-loop",
        "clip": "none" if bare else 1.0,
        "schedule": "none" if bare else "linear",
        "data": "index permutation" if bare or work.kind == "grpo" else "DataLoader",
    }


def optimizer_label(optimizer) -> str:
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    defaults = optimizer.defaults
    kind = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else "for-loop"
    return f"{type(optimizer).__name__} {kind}"


def trainer_settings(work: Workload, trainer, model) -> dict:
    """Settings read from a treadle or TRL trainer after it trained: what it did, not what was asked."""
    args = trainer.args
    history = {k: v for record in trainer.state.log_history for k, v in record.items()}
    out = {
        "precision": "bf16 autocast" if args.bf16 else str(next(model.parameters()).dtype).replace("torch.", ""),
        "grad checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
        "loss": loss_label(work) if _loss_matches(work, args) else f"other: {getattr(args, 'loss_type', '?')}",
        "batch": args.per_device_train_batch_size * args.gradient_accumulation_steps,
        "optimizer": optimizer_label(trainer.optimizer),
        "clip": args.max_grad_norm,
        "schedule": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "data": "DataLoader",
    }
    if work.kind == "grpo":
        out["sampled tokens"] = history.get("completions/mean_length", float("nan"))
    return out


def _loss_matches(work: Workload, args) -> bool:
    loss_type = getattr(args, "loss_type", None)
    if work.kind == "dpo":
        return loss_type in ("sigmoid", ["sigmoid"]) and args.beta == BETA_DPO
    if work.kind == "grpo":
        return loss_type == "dapo" and args.beta == 0.0 and args.epsilon == EPSILON
    return getattr(args, "completion_only_loss", True) in (True, None) and loss_type in (None, "nll")


def check_settings(size: str, work: Workload, settings: dict[str, dict]) -> None:
    """Raise if two contenders of one run did different work (see MUST_MATCH)."""
    for keys, names in (
        (MUST_MATCH, list(settings)),
        (MUST_MATCH_COMPARED, [n for n in settings if n != TRL_DEFAULTS]),
    ):
        for key in keys:
            values = {name: settings[name].get(key) for name in names if settings[name]}
            if len({repr(v) for v in values.values()}) > 1:
                raise AssertionError(
                    f"{size} {work.name}: the contenders differ in {key!r}: {values}; they must do the same work"
                )


def common_args(output_dir: str, steps: int) -> dict:
    """Arguments shared by treadle's and TRL's configs."""
    return dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="linear",
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )


def trl_args(output_dir: str, steps: int, defaults: bool) -> dict:
    """TRL float32 without checkpointing (the compared row), or as its defaults configure it (bf16=True, which on a
    CPU is bfloat16 autocast, and gradient_checkpointing=True: a separate, labelled row)."""
    # optim: transformers defaults to the fused AdamW kernel; the others run torch's for-loop AdamW
    precision = {} if defaults else dict(bf16=False, gradient_checkpointing=False)
    return dict(
        common_args(output_dir, steps),
        use_cpu=True,
        dataloader_pin_memory=False,
        optim="adamw_torch",
        warmup_steps=0,
        gradient_accumulation_steps=1,
        **precision,
    )


def step_clock(clock, base=TrainerCallback):
    """A callback (of ``base``: treadle's, or transformers' for TRL) that ticks the contender's stopwatch at the end
    of every optimizer step."""

    class Clock(base):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    return Clock()


# ---------------------------------------------------------------------------------------------------------
# The hand-written loops
# ---------------------------------------------------------------------------------------------------------
def plain_optimizer(model, steps: int):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, (steps - s) / steps))


def optimizer_step(model, optimizer, scheduler) -> None:
    """Clip, step and schedule; with no scheduler (the bare loop), no clipping either."""
    if scheduler is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def batches(examples: list, collate: Callable, bare: bool):
    """Shuffled batches of BATCH examples: a DataLoader, or (bare) an index permutation and the collate call."""
    if not bare:
        return DataLoader(
            examples, batch_size=BATCH, shuffle=True, collate_fn=collate, generator=torch.Generator().manual_seed(0)
        )
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(0)).tolist()
    return (collate([examples[i] for i in order[k : k + BATCH]]) for k in range(0, len(order) - BATCH + 1, BATCH))


def plain_sft(work: Workload, size: str, steps: int, clock, bare: bool = False) -> None:
    tokenizer, model = build(size)
    eos = tokenizer.eos_token_id
    examples = []
    for row in rows_for(work, steps):  # tokenised once, before training, as every trainer does
        prompt = tokenizer(row["prompt"])["input_ids"]
        completion = tokenizer(row["completion"])["input_ids"] + [eos]
        examples.append((prompt + completion, [-100] * len(prompt) + completion))

    def collate(batch):
        ids = torch.tensor([ids for ids, _ in batch])
        labels = torch.tensor([labels for _, labels in batch])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}

    clock.settings.update(plain_settings(work, bare))
    optimizer, scheduler = plain_optimizer(model, steps)
    for batch in batches(examples, collate, bare):
        model(**batch, use_cache=False).loss.backward()
        optimizer_step(model, optimizer, None if bare else scheduler)
        clock.tick()


def sequence_logps(model, input_ids, attention_mask, completion_mask):
    """Summed log-probs of the completion tokens of each row: (rows,)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return (logps * completion_mask[:, 1:]).sum(dim=1)


def plain_dpo(work: Workload, size: str, steps: int, clock, bare: bool = False) -> None:
    tokenizer, model = build(size)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    eos = tokenizer.eos_token_id
    pairs = []
    for row in rows_for(work, steps):
        prompt = tokenizer(row["prompt"])["input_ids"]
        chosen, rejected = (tokenizer(row[key])["input_ids"] + [eos] for key in ("chosen", "rejected"))
        pairs.append((prompt, chosen, rejected))

    def collate(batch):  # B chosen sequences, then the B rejected ones (all the same length)
        sequences = [(p, c) for p, c, _ in batch] + [(p, r) for p, _, r in batch]
        ids = torch.tensor([p + c for p, c in sequences])
        completion_mask = torch.tensor([[0.0] * len(p) + [1.0] * len(c) for p, c in sequences])
        return ids, torch.ones_like(ids), completion_mask

    clock.settings.update(plain_settings(work, bare))
    optimizer, scheduler = plain_optimizer(model, steps)
    for ids, mask, completion_mask in batches(pairs, collate, bare):
        policy = sequence_logps(model, ids, mask, completion_mask)
        with torch.no_grad():
            ref = sequence_logps(reference, ids, mask, completion_mask)
        chosen, rejected = (policy - ref).chunk(2)
        (-F.logsigmoid(BETA_DPO * (chosen - rejected)).mean()).backward()
        optimizer_step(model, optimizer, None if bare else scheduler)
        clock.tick()


def completion_logps(model, input_ids, attention_mask, prompt_length: int):
    """Per-token log-probs of the completion tokens (after ``prompt_length``): (rows, C)."""
    completion = input_ids[:, prompt_length:]
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=completion.shape[1] + 1
    ).logits[:, :-1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, completion[:, :, None]).squeeze(-1)


def sample_and_score(model, tokenizer, chosen: list[dict], work: Workload, generator):
    """One generation of GROUP completions per chosen row with the fast sampler, every completion L tokens (the end
    token suppressed: ``fixed_length``): (output, lengths, advantages)."""
    eos = tokenizer.eos_token_id
    params = SamplingParams(
        num_generations=GROUP,
        max_new_tokens=work.completion_length,
        eos_token_ids=(eos,),
        pad_token_id=tokenizer.pad_token_id,
        temperature=1.0,
        suppress_token_ids=tuple(fixed_length(tokenizer)["suppress_tokens"]),
    )
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in chosen]
    out = sample_completions(model, prompts, params, generator=generator, backend="fast")
    lengths = out.completion_mask.sum(dim=1).tolist()
    texts = tokenizer.batch_decode(
        [ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)], skip_special_tokens=True
    )
    repeat = [r for r in chosen for _ in range(GROUP)]
    rewards = torch.tensor(toy.addition_reward([r["prompt"] for r in repeat], texts, [r["answer"] for r in repeat]))
    grouped = rewards.view(-1, GROUP)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    return out, lengths, advantages


def plain_grpo(work: Workload, size: str, steps: int, clock, bare: bool = False) -> None:
    tokenizer, model = build(size)
    rows = rows_for(work, steps)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    generator, per_generation = torch.Generator().manual_seed(0), BATCH * work.spg // GROUP
    optimizer, scheduler = plain_optimizer(model, steps)
    sampled = []
    clock.settings.update(plain_settings(work, bare))
    for cycle in range(steps // work.spg):
        chosen = [rows[i] for i in order[cycle * per_generation : (cycle + 1) * per_generation]]
        out, lengths, advantages = sample_and_score(model, tokenizer, chosen, work, generator)
        sampled += lengths
        ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
        mask = torch.cat([out.prompt_mask, out.completion_mask], dim=1)
        completion_mask, prompt_length = out.completion_mask.float(), out.prompt_ids.shape[1]
        slices = [slice(k * BATCH, (k + 1) * BATCH) for k in range(work.spg)]
        old = None
        if work.spg > 1:  # the policy changes between generation and use: keep the sampling policy's log-probs
            with torch.no_grad():
                old = [completion_logps(model, ids[s], mask[s], prompt_length) for s in slices]
        for k, s in enumerate(slices):
            logps = completion_logps(model, ids[s], mask[s], prompt_length)
            ratio = torch.exp(logps - (old[k] if old else logps.detach()))
            advantage = advantages[s, None]
            per_token = -torch.min(ratio * advantage, ratio.clamp(1 - EPSILON, 1 + EPSILON) * advantage)
            (per_token * completion_mask[s]).sum().div(completion_mask[s].sum().clamp(min=1)).backward()
            optimizer_step(model, optimizer, None if bare else scheduler)
            clock.settings["sampled tokens"] = statistics.fmean(sampled)
            clock.tick()
