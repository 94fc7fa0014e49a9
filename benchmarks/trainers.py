"""ms per optimizer step of treadle's SFT, DPO and GRPO trainers against a plain PyTorch loop doing the same
work, and against TRL's SFTTrainer / DPOTrainer / GRPOTrainer when TRL is installed.

    python benchmarks/trainers.py            # tiny and small toy models, every workload, 3 rounds
    python benchmarks/trainers.py --quick    # tiny model, fewer steps, 2 rounds: checks that it all runs
    python benchmarks/trainers.py --only GRPO --sizes small --rounds 5

What "the same work" means here (each contender builds its own copy of the same model and data):

- Model: ``treadle.toy.build_model(size)`` (a Llama with the 103-token character vocabulary, seed 0) and the
  toy tokenizer. Data: few-shot 2-digit additions built in code, every row of a workload the same number of
  tokens, so no contender pads more than another whatever order its sampler draws.
- Optimizer: torch AdamW (lr 1e-5, no weight decay, the for-loop implementation for all three: TRL is given
  ``optim="adamw_torch"`` because transformers would otherwise pick the fused kernel), gradient clipping at
  1.0, a linear decay schedule, one micro-batch per optimizer step, no evaluation, no checkpoints, no
  progress bars, logging only at the end.
- SFT: 8 rows of 128 tokens (124-token prompt, 3-token answer + EOS), loss on the completion tokens only.
  One forward and backward per step.
- DPO (sigmoid loss, beta 0.1): 8 pairs, 60-token prompt and 16-token responses; one policy forward over the
  16 sequences (chosen and rejected stacked), one reference forward without gradients, backward.
- GRPO: 8 completions per micro-step, G = 8 completions per prompt (64-token prompts), temperature 1, every
  completion exactly L tokens (see ``build``), beta 0 (no reference model), loss "dapo". One generation of
  8 x spg completions feeds spg optimizer steps (``steps_per_generation``); with spg > 1 the old log-probs
  are computed once per slice (one extra forward without gradients), as all three do. Reward:
  ``treadle.toy.addition_reward``.
  Generation: treadle and the plain loop both call ``treadle.generation.generate_completions`` (the fast
  KV-cache path, each distinct prompt prefilled once); TRL calls ``model.generate`` on the B*G repeated
  prompts, which is the way it works on CPU (without vLLM) and is part of what is being compared.

The plain loops (``plain_sft``, ``plain_dpo``, ``plain_grpo``) are what a careful engineer writes by hand: a
DataLoader or an index permutation, the model's own loss (SFT) or a log-softmax + gather (DPO, GRPO), no
metrics. Whatever else treadle does per step (metrics such as token accuracy, entropy, reward statistics,
callbacks, bookkeeping for exact resume) is overhead it pays against them.

Timing, in lockstep: the contenders of one run are built in threads that take turns one optimizer step at a
time (a baton passed at the end of every step; only its holder runs), because this machine's speed wanders by
tens of percent over tens of seconds and a slow spell must hit every contender alike. A step is timed from
the moment its contender gets the baton to the end of the step, so data loading, generation, callbacks and
every hook are included. Per run and contender: the mean over the fastest half of the timed steps after
``warmup`` (for spg > 1, of whole generation cycles); other processes only ever add time. Each round repeats
every run with fresh models, rotating who steps first; the table reports the median and best of those figures
over rounds, and the median over rounds of each round's ratio to the plain loop.

Two settings keep the threads as comparable as separate single-threaded scripts would be, and were needed:
all contenders run on one CPU core (``--cpu``; else a contender whose thread the system put on the core that
another process kept busy ran 40% slower than its twin for a whole run), and glibc serves every thread from
one malloc arena (``single_malloc_arena``; with an arena per thread, the memory given back to the system and
faulted in again differed between contenders: the same MLP took 70% longer in one than in the other). With
both, two copies of the same contender agree within about 3%, except GRPO with long completions on the tiny
model (up to 7% over 3 rounds): ``--twin`` adds a second plain loop to the table, to show this floor.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from _machine import machine_header  # noqa: E402  (this folder is on sys.path when a script in it runs)

LR = 1e-5
BATCH = 8  # rows (SFT), pairs (DPO) or completions (GRPO) per optimizer step
GROUP = 8  # GRPO: completions per prompt
BETA_DPO = 0.1
EPSILON = 0.2  # GRPO clipping


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "sft", "dpo" or "grpo"
    warmup: int  # untimed optimizer steps
    timed: int  # timed optimizer steps (a multiple of spg)
    completion_length: int = 0  # GRPO: L, most tokens sampled per completion
    spg: int = 1  # GRPO: steps_per_generation

    @property
    def steps(self) -> int:
        return self.warmup + self.timed


def workloads(quick: bool) -> list[Workload]:
    scale = 1 if quick else 2
    rows = [Workload("SFT", "sft", warmup=3, timed=8 * scale), Workload("DPO", "dpo", warmup=3, timed=8 * scale)]
    for length in (16, 64):
        rows.append(Workload(f"GRPO L{length} spg1", "grpo", warmup=2, timed=4 * scale, completion_length=length))
        rows.append(
            Workload(f"GRPO L{length} spg4", "grpo", warmup=4, timed=8 * scale, completion_length=length, spg=4)
        )
    return rows


def seconds_per_step(steps: list[float], work: Workload) -> float:
    """Mean step time over the fastest half of the timed units: single steps for SFT and DPO (every step does
    the same work), whole generation cycles for GRPO with spg > 1. Other processes only ever add time, so the
    fastest half measures the work itself; the slower half is where they happened to run."""
    timed = steps[work.warmup : work.steps]
    units = sorted(statistics.fmean(timed[i : i + work.spg]) for i in range(0, len(timed), work.spg))
    return statistics.fmean(units[: max(1, len(units) // 2)])


# ---------------------------------------------------------------------------------------------------------
# Data: few-shot additions, every row of a workload exactly the same number of tokens
# ---------------------------------------------------------------------------------------------------------
SFT_PROMPT, DPO_PROMPT, GRPO_PROMPT = 124, 60, 64  # prompt lengths in characters (= toy tokens)


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
        rows.append(
            {"prompt": prompt, "chosen": f"{total:03d} is the sum.", "rejected": f"{wrong:03d} is the sum."}
        )  # 15 characters + EOS each
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


def build(size: str, *, sampled_lengths: bool = True):
    """(tokenizer, model) for one contender: the same weights every time.

    ``sampled_lengths=False`` (GRPO) makes every completion exactly L tokens: EOS becomes a new token that the
    model, whose vocabulary stays as it was, can never sample. An untrained model samples the real EOS about
    once per 100 tokens, which would give each contender a different amount of work by chance.
    """
    from treadle.demos import toy

    tokenizer = toy.build_tokenizer()
    model = toy.build_model(size, tokenizer=tokenizer, seed=0)
    if not sampled_lengths:
        tokenizer.add_special_tokens({"eos_token": "<never>"})
        model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.train()
    return tokenizer, model


def items_per_step(work: Workload) -> tuple[float, str]:
    """(throughput items in one optimizer step, their unit)."""
    if work.kind == "sft":
        return BATCH * (SFT_PROMPT + 4), "tokens/s"
    if work.kind == "dpo":
        return BATCH, "pairs/s"
    return BATCH, "completions/s"


def linear_schedule(optimizer, steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, (steps - s) / steps))


def plain_optimizer(model, steps: int):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    return optimizer, linear_schedule(optimizer, steps)


def optimizer_step(model, optimizer, scheduler) -> None:
    """Clip, step and schedule; with no scheduler (the bare loop), no clipping either."""
    if scheduler is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------------------
# Settings: what every contender reports beside its row, and which of them must match
# ---------------------------------------------------------------------------------------------------------
# Every contender of a run must do the same work: these settings must be equal in all of them...
MUST_MATCH = ("loss", "batch", "sampled tokens", "optimizer")
# ...and these in all of them but the row that shows TRL as its defaults configure it (labelled as such).
MUST_MATCH_COMPARED = ("precision", "grad checkpointing")
TRL_DEFAULTS = "TRL defaults (bf16 autocast + grad ckpt)"


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


# ---------------------------------------------------------------------------------------------------------
# Plain PyTorch loops: "bare" (an index permutation, no clipping, no schedule) and "plain" (a DataLoader for
# SFT / DPO, clipping at 1.0 and a linear schedule, as the trainers do)
# ---------------------------------------------------------------------------------------------------------
def batches(examples: list, collate: Callable, bare: bool):
    """Shuffled batches of BATCH examples: a DataLoader, or (bare) an index permutation and the collate call."""
    from torch.utils.data import DataLoader

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
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": torch.tensor([labels for _, labels in batch]),
        }

    clock.settings.update(plain_settings(work, bare))
    optimizer, scheduler = plain_optimizer(model, steps)
    for batch in batches(examples, collate, bare):
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizer_step(model, optimizer, None if bare else scheduler)
        clock.tick()


def sequence_logps(model, input_ids, attention_mask, completion_mask):
    """Summed log-probs of the completion tokens of each row: (rows,)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return (logps * completion_mask[:, 1:]).sum(dim=1)


def plain_dpo(work: Workload, size: str, steps: int, clock, bare: bool = False) -> None:
    import copy

    tokenizer, model = build(size)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    eos = tokenizer.eos_token_id
    pairs = []
    for row in rows_for(work, steps):
        prompt = tokenizer(row["prompt"])["input_ids"]
        pairs.append(
            (prompt, tokenizer(row["chosen"])["input_ids"] + [eos], tokenizer(row["rejected"])["input_ids"] + [eos])
        )

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
        loss = -F.logsigmoid(BETA_DPO * (chosen - rejected)).mean()
        loss.backward()
        optimizer_step(model, optimizer, None if bare else scheduler)
        clock.tick()


def completion_logps(model, input_ids, attention_mask, prompt_length: int):
    """Per-token log-probs of the completion tokens (after ``prompt_length``): (rows, C)."""
    completion = input_ids[:, prompt_length:]
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=completion.shape[1] + 1
    ).logits[:, :-1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, completion[:, :, None]).squeeze(-1)


def plain_grpo(work: Workload, size: str, steps: int, clock, bare: bool = False) -> None:
    from treadle.demos.toy import addition_reward
    from treadle.generation import generate_completions

    tokenizer, model = build(size, sampled_lengths=False)
    rows = rows_for(work, steps)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    generator = torch.Generator().manual_seed(0)
    prompts_per_generation = BATCH * work.spg // GROUP
    optimizer, scheduler = plain_optimizer(model, steps)
    sampled = []
    clock.settings.update(plain_settings(work, bare))
    for cycle in range(steps // work.spg):
        chosen = [rows[i] for i in order[cycle * prompts_per_generation : (cycle + 1) * prompts_per_generation]]
        out = generate_completions(
            model,
            [tokenizer(r["prompt"])["input_ids"] for r in chosen],
            num_generations=GROUP,
            max_new_tokens=work.completion_length,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            temperature=1.0,
            generator=generator,
            backend="fast",
        )
        lengths = out.completion_mask.sum(dim=1).tolist()
        sampled += lengths
        texts = tokenizer.batch_decode(
            [ids[:n] for ids, n in zip(out.completion_ids.tolist(), lengths)], skip_special_tokens=True
        )
        rewards = torch.tensor(
            addition_reward(
                [r["prompt"] for r in chosen for _ in range(GROUP)],
                texts,
                [r["answer"] for r in chosen for _ in range(GROUP)],
            )
        )
        grouped = rewards.view(-1, GROUP)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
        ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
        mask = torch.cat([out.prompt_mask, out.completion_mask], dim=1)
        completion_mask = out.completion_mask.float()
        prompt_length = out.prompt_ids.shape[1]
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
            loss = (per_token * completion_mask[s]).sum() / completion_mask[s].sum().clamp(min=1)
            loss.backward()
            optimizer_step(model, optimizer, None if bare else scheduler)
            clock.settings["sampled tokens"] = statistics.fmean(sampled)
            clock.tick()


# ---------------------------------------------------------------------------------------------------------
# treadle
# ---------------------------------------------------------------------------------------------------------
def _treadle_clock(clock):
    from treadle import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    return Clock()


def _common(output_dir: str, steps: int) -> dict:
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


def treadle_sft(work: Workload, size: str, steps: int, clock, output_dir: str) -> None:
    from treadle import SFTConfig, SFTTrainer

    tokenizer, model = build(size)
    args = SFTConfig(**_common(output_dir, steps), max_length=SFT_PROMPT + 4)
    trainer = SFTTrainer(
        model, args, train_dataset=rows_for(work, steps), processing_class=tokenizer, callbacks=[_treadle_clock(clock)]
    )
    trainer.train()
    clock.settings.update(trainer_settings(work, trainer, model))


def treadle_dpo(work: Workload, size: str, steps: int, clock, output_dir: str) -> None:
    from treadle import DPOConfig, DPOTrainer

    tokenizer, model = build(size)
    args = DPOConfig(**_common(output_dir, steps), beta=BETA_DPO, max_length=128, max_prompt_length=96)
    trainer = DPOTrainer(
        model,
        args=args,
        train_dataset=rows_for(work, steps),
        processing_class=tokenizer,
        callbacks=[_treadle_clock(clock)],
    )
    trainer.train()
    clock.settings.update(trainer_settings(work, trainer, model))


def treadle_grpo(work: Workload, size: str, steps: int, clock, output_dir: str) -> None:
    from treadle import GRPOConfig, GRPOTrainer
    from treadle.demos.toy import addition_reward

    tokenizer, model = build(size, sampled_lengths=False)
    args = GRPOConfig(
        **_common(output_dir, steps),
        num_generations=GROUP,
        steps_per_generation=work.spg,
        max_completion_length=work.completion_length,
        max_prompt_length=None,
        temperature=1.0,
        beta=0.0,
        epsilon=EPSILON,
        loss_type="dapo",
        scale_rewards="group",
    )
    trainer = GRPOTrainer(
        model,
        reward_funcs=addition_reward,
        args=args,
        train_dataset=rows_for(work, steps),
        processing_class=tokenizer,
        callbacks=[_treadle_clock(clock)],
    )
    trainer.train()
    clock.settings.update(trainer_settings(work, trainer, model))


# ---------------------------------------------------------------------------------------------------------
# TRL: float32 without checkpointing (the compared row), or as its defaults configure it (bf16=True, which on
# a CPU is bfloat16 autocast, and gradient_checkpointing=True: a separate, labelled row)
# ---------------------------------------------------------------------------------------------------------
def _trl_clock(clock):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    return Clock()


def _trl_common(output_dir: str, steps: int, defaults: bool) -> dict:
    # optim: transformers defaults to the fused AdamW kernel; the others run torch's for-loop AdamW
    precision = {} if defaults else dict(bf16=False, gradient_checkpointing=False)
    return dict(
        _common(output_dir, steps),
        use_cpu=True,
        dataloader_pin_memory=False,
        optim="adamw_torch",
        warmup_steps=0,
        gradient_accumulation_steps=1,
        **precision,
    )


def trl_sft(work: Workload, size: str, steps: int, clock, output_dir: str, defaults: bool = False) -> None:
    import trl
    from datasets import Dataset

    tokenizer, model = build(size)
    args = trl.SFTConfig(**_trl_common(output_dir, steps, defaults), max_length=SFT_PROMPT + 4, packing=False)
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows_for(work, steps)),
        processing_class=tokenizer,
        callbacks=[_trl_clock(clock)],
    )
    trainer.train()
    clock.settings.update(trainer_settings(work, trainer, model))


def trl_dpo(work: Workload, size: str, steps: int, clock, output_dir: str, defaults: bool = False) -> None:
    import copy

    import trl
    from datasets import Dataset

    tokenizer, model = build(size)
    args = trl.DPOConfig(
        **_trl_common(output_dir, steps, defaults),
        beta=BETA_DPO,
        max_length=128,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=False,
    )
    # TRL reloads its reference from the model's hub id when none is given; ours has none, so pass the copy
    # that treadle and the plain loop make themselves
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(rows_for(work, steps)),
        processing_class=tokenizer,
        callbacks=[_trl_clock(clock)],
    )
    trainer.train()
    clock.settings.update(trainer_settings(work, trainer, model))


def trl_grpo(work: Workload, size: str, steps: int, clock, output_dir: str, defaults: bool = False) -> None:
    import trl
    from datasets import Dataset

    from treadle.demos.toy import addition_reward

    tokenizer, model = build(size, sampled_lengths=False)
    args = trl.GRPOConfig(
        **_trl_common(output_dir, steps, defaults),
        num_generations=GROUP,
        steps_per_generation=work.spg,
        max_completion_length=work.completion_length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=EPSILON,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        log_completions=False,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=addition_reward,
        args=args,
        train_dataset=Dataset.from_list(rows_for(work, steps)),
        processing_class=tokenizer,
        callbacks=[_trl_clock(clock)],
    )
    trainer.train()
    clock.settings.update(trainer_settings(work, trainer, model))


# ---------------------------------------------------------------------------------------------------------
# Running and reporting
# ---------------------------------------------------------------------------------------------------------
def trl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


ROWS = ("bare loop", "plain PyTorch", "plain PyTorch (twin)", "treadle", "TRL float32", TRL_DEFAULTS)


def contenders(kind: str, with_trl: bool, twin: bool = False, trl_defaults: bool = True) -> dict[str, Callable]:
    """{row name: fn(work, size, steps, clock, output_dir)} for one workload kind, in ROWS order."""
    plain = {"sft": plain_sft, "dpo": plain_dpo, "grpo": plain_grpo}[kind]
    out = {
        "bare loop": lambda work, size, steps, clock, _dir: plain(work, size, steps, clock, bare=True),
        "plain PyTorch": lambda work, size, steps, clock, _dir: plain(work, size, steps, clock),
    }
    if twin:  # the plain loop again: its ratio to the first is the noise floor of this run
        out["plain PyTorch (twin)"] = out["plain PyTorch"]
    out["treadle"] = {"sft": treadle_sft, "dpo": treadle_dpo, "grpo": treadle_grpo}[kind]
    if with_trl:
        trl = {"sft": trl_sft, "dpo": trl_dpo, "grpo": trl_grpo}[kind]
        out["TRL float32"] = trl
        if trl_defaults:
            out[TRL_DEFAULTS] = lambda work, size, steps, clock, output_dir: trl(
                work, size, steps, clock, output_dir, defaults=True
            )
    return out


class Baton:
    """Contenders take turns, one optimizer step each, passing the baton at the end of every step: only the
    holder runs, and whatever slows this machine down for seconds at a time slows every contender alike."""

    def __init__(self, players: int):
        self.condition = threading.Condition()
        self.order = list(range(players))  # who is still playing, in turn order
        self.holder = 0

    def wait(self, player: int) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.holder == player)

    def pass_on(self, player: int, leave: bool = False) -> None:
        with self.condition:
            at = self.order.index(player)
            if leave:
                self.order.pop(at)
            else:
                at += 1
            self.holder = self.order[at % len(self.order)] if self.order else -1
            self.condition.notify_all()


class Stopwatch:
    """One contender's clock: the seconds of each optimizer step, from getting the baton to passing it on."""

    def __init__(self, baton: Baton, player: int):
        self.baton, self.player = baton, player
        self.steps: list[float] = []
        self.resumed = 0.0
        self.settings: dict = {}  # what the contender reports it did (see MUST_MATCH)

    def start(self) -> None:
        self.baton.wait(self.player)
        self.resumed = time.perf_counter()

    def tick(self) -> None:
        self.steps.append(time.perf_counter() - self.resumed)
        self.baton.pass_on(self.player)
        self.baton.wait(self.player)
        self.resumed = time.perf_counter()


@contextlib.contextmanager
def quiet():
    """Silence the trainers' own printing (warnings, progress lines) during a timed run."""
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
        warnings.simplefilter("ignore")
        yield


def run_lockstep(
    runners: list[tuple[str, Callable]], work: Workload, size: str, cpu: int | None, summary: Callable = None
) -> tuple[dict[str, float], dict[str, dict]]:
    """Run the contenders in threads that take turns step by step, all on CPU ``cpu`` (None: wherever the
    system puts them); {name: seconds per step, see ``seconds_per_step``} (NaN for a contender that failed:
    the error is printed and the others go on), and {name: the settings it reported}. ``summary(steps, work)``
    replaces ``seconds_per_step``."""
    summary = summary or seconds_per_step
    baton = Baton(len(runners))
    watches = [Stopwatch(baton, i) for i in range(len(runners))]
    errors: dict[str, str] = {}

    def play(i: int, name: str, fn: Callable) -> None:
        watch = watches[i]
        if cpu is not None:
            # one core for every contender: on a core that another process is busy on, a contender ran 40%
            # slower than its twin for a whole run
            os.sched_setaffinity(0, {cpu})  # 0 = this thread (Linux)
        try:
            watch.start()
            with tempfile.TemporaryDirectory(prefix="treadle-bench-") as output_dir:
                torch.manual_seed(0)
                fn(work, size, work.steps, watch, output_dir)
        except Exception as e:  # a peer that cannot run this configuration: reported, not fatal
            errors[name] = f"{type(e).__name__}: {e}"
        finally:
            baton.pass_on(i, leave=True)

    threads = [threading.Thread(target=play, args=(i, name, fn), daemon=True) for i, (name, fn) in enumerate(runners)]
    with quiet():
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    gc.collect()
    out = {}
    for (name, _), watch in zip(runners, watches):
        if name not in errors and len(watch.steps) < work.steps:
            errors[name] = f"made {len(watch.steps)} optimizer steps, expected {work.steps}"
        out[name] = float("nan") if name in errors else summary(watch.steps, work)
    for name, error in errors.items():
        print(f"  {name} failed on {size} {work.name}: {error}", file=sys.stderr)
    return out, {name: watch.settings for (name, _), watch in zip(runners, watches) if name not in errors}


def single_malloc_arena() -> bool:
    """Ask glibc to serve every thread from one malloc arena, as in a single-threaded training script. With
    an arena per contender thread, the memory each one returns to the system and faults back in depends on
    the interleaving: the same model's MLP took 70% longer in one contender than in another. True if set."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").mallopt(-8, 1) == 1  # M_ARENA_MAX = 1
    except (OSError, AttributeError):  # not glibc: nothing to do
        return False


def measure(
    sizes: list[str],
    works: list[Workload],
    rounds: int,
    with_trl: bool,
    cpu: int | None,
    twin: bool = False,
    trl_defaults: bool = True,
) -> tuple[dict, dict]:
    """({(size, workload name): {contender: [seconds per step, one per round]}}, {same key: {contender:
    settings}}); raises as soon as two contenders of a run did different work (``check_settings``)."""
    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    settings: dict[tuple[str, str], dict[str, dict]] = {}
    for r in range(rounds):
        for size in sizes:
            for work in works:
                runners = list(contenders(work.kind, with_trl, twin, trl_defaults).items())
                shift = r % len(runners)  # rotate who steps first
                runners = runners[shift:] + runners[:shift]
                cell = results.setdefault((size, work.name), {name: [] for name in ROWS if name in dict(runners)})
                seconds, reported = run_lockstep(runners, work, size, cpu)
                check_settings(size, work, reported)
                settings.setdefault((size, work.name), {}).update(reported)
                for name, value in seconds.items():
                    cell[name].append(value)
                line = "  ".join(f"{n} {1000 * v[-1]:.1f}" for n, v in cell.items())
                print(f"round {r + 1}/{rounds} {size:5s} {work.name:14s} ms/step: {line}", file=sys.stderr, flush=True)
    return results, settings


def settings_label(settings: dict, kind: str) -> str:
    """The contender's settings, short, for its row."""
    if not settings:
        return "(failed)"
    parts = [
        settings["precision"],
        "ckpt" if settings["grad checkpointing"] else "no ckpt",
        f"clip {settings['clip']}",
        f"sched {settings['schedule']}",
        settings["data"],
        settings["optimizer"],
    ]
    if kind == "grpo":
        parts.append(f"{settings['sampled tokens']:.1f} tok/compl")
    return ", ".join(str(p) for p in parts)


def ratio_to(samples: list[float], floor: list[float] | None) -> str:
    """Median over rounds of each round's ratio to the floor's figure in that round."""
    ratios = [s / f for s, f in zip(samples, floor or []) if s == s and f == f]
    return f"{statistics.median(ratios):.3f}x" if ratios else ""


def table(results: dict, settings: dict, works: list[Workload]) -> str:
    by_name = {w.name: w for w in works}
    lines = [
        "| model | workload | contender | median ms/step | best ms/step | throughput (median) | vs bare loop | "
        "vs plain PyTorch | settings |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for (size, name), cell in results.items():
        work = by_name[name]
        items, unit = items_per_step(work)
        for contender, samples in cell.items():
            label = settings_label(settings.get((size, name), {}).get(contender, {}), work.kind)
            ok = [s for s in samples if s == s]
            if not ok:
                lines.append(f"| {size} | {name} | {contender} | failed | | | | | |")
                continue
            med = statistics.median(ok)
            lines.append(
                f"| {size} | {name} | {contender} | {1000 * med:.1f} | {1000 * min(ok):.1f} | "
                f"{items / med:,.0f} {unit} | {ratio_to(samples, cell.get('bare loop'))} | "
                f"{ratio_to(samples, cell.get('plain PyTorch'))} | {label} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, fewer steps, 2 rounds")
    parser.add_argument("--sizes", default=None, help="comma-separated toy model sizes (default tiny,small)")
    parser.add_argument(
        "--only", default=None, help="run the workloads whose name starts with this (SFT, DPO, GRPO, 'GRPO L64')"
    )
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (2 with --quick)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared machine)"
    )
    parser.add_argument(
        "--cpu",
        type=int,
        default=None,
        help="the CPU all contenders run on (default: the lowest this process may use; -1: no pinning)",
    )
    parser.add_argument("--no-trl", action="store_true", help="skip TRL even when installed")
    parser.add_argument(
        "--twin",
        action="store_true",
        help="also run a second plain loop: its ratio to the first shows how far apart two equal contenders land",
    )
    parser.add_argument(
        "--no-trl-defaults",
        action="store_true",
        help="skip the row of TRL as its defaults configure it (bf16 autocast + grad ckpt)",
    )
    parser.add_argument("--json", default=None, help="also write the raw seconds per step to this file")
    opts = parser.parse_args(argv)
    single_malloc_arena()  # before any thread allocates
    torch.set_num_threads(opts.threads)
    logging.disable(logging.WARNING)  # transformers / TRL notices
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sizes = opts.sizes.split(",") if opts.sizes else (["tiny"] if opts.quick else ["tiny", "small"])
    rounds = opts.rounds or (2 if opts.quick else 3)
    works = [w for w in workloads(opts.quick) if opts.only is None or w.name.startswith(opts.only)]
    with_trl = not opts.no_trl and trl_installed()
    start = time.time()
    cpu = opts.cpu
    if cpu is None and hasattr(os, "sched_getaffinity"):
        cpu = min(os.sched_getaffinity(0))
    cpu = None if cpu is None or cpu < 0 else cpu
    header = machine_header()
    results, settings = measure(sizes, works, rounds, with_trl, cpu, opts.twin, not opts.no_trl_defaults)
    versions = f"torch {torch.__version__}"
    if with_trl:
        import transformers
        import trl

        versions += f", transformers {transformers.__version__}, TRL {trl.__version__}"
    where = f"CPU {cpu}" if cpu is not None else "unpinned"
    print(
        f"\n### Trainers: ms per optimizer step vs a plain PyTorch loop ({time.strftime('%Y-%m-%d')}, "
        f"{rounds} rounds in lockstep on {where}, {torch.get_num_threads()} torch thread(s), {versions}, "
        f"{time.time() - start:.0f} s)\n"
    )
    print(header + "\n")
    print(table(results, settings, works))
    print(
        f"\nEvery run asserted that its contenders match in {', '.join(MUST_MATCH)} and (all but the "
        f"{TRL_DEFAULTS!r} row) in {', '.join(MUST_MATCH_COMPARED)}."
    )
    if not with_trl:
        why = "skipped (--no-trl)" if opts.no_trl else "not installed (pip install -e '.[bench]')"
        print(f"\nTRL {why}: its rows are left out.")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({f"{size}|{name}": cell for (size, name), cell in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
