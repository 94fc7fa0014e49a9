"""What every on-policy trainer records and checks: seeded generators, prompt tokens, a generation's completion
lengths and tokens (``completion_metrics``), the step clock (``StepClock``), evaluation sums (mean reward, pass@k)
and ``compute_metrics`` over every rank's evaluation samples; checks of the trainer's reward and data arguments.
Pure functions of their arguments, apart from the gathers over ranks."""

from __future__ import annotations

import math
import random

import torch

from treadle import distributed as dist
from treadle.data import require_columns
from treadle.metrics import NUM_TOKENS, pass_at_k_sums
from treadle.rewards import (
    METRICS_ARGUMENTS,
    RewardFunction,
    call_compute_metrics,
    from_reward_model,
    reward_name,
    weighted_rewards,
)
from treadle.text import check_chat_template, encode_prompt, is_conversation
from treadle.trainers.onpolicy.data import Rollout

__all__ = [
    "StepClock",
    "check_dataset",
    "check_tokenizer",
    "completion_metrics",
    "custom_eval_metrics",
    "generator_seed",
    "reward_list",
    "reward_sums",
    "reward_weights",
    "seeded_generator",
    "tokenize_prompts",
]


def generator_seed(seed: int, *key) -> int:
    """The seed of (seed, key, rank): sampling is reproducible and a resumed run samples alike."""
    return random.Random("/".join(str(k) for k in (seed, *key, dist.get_rank()))).getrandbits(63)


def seeded_generator(seed: int, device, *key) -> torch.Generator:
    """A generator on ``device`` seeded by (seed, key, rank) (``generator_seed``)."""
    return torch.Generator(device=device).manual_seed(generator_seed(seed, *key))


def tokenize_prompts(tokenizer, prompts: list) -> list[list[int]]:
    """Token ids of each prompt (``text.encode_prompt``: text with the tokenizer's special tokens, chat messages
    rendered with a generation prompt), whole (``text.cut_prompts`` cuts them to ``max_prompt_length``)."""
    cache: dict[str, list[int]] = {}  # a prompt repeats G times in a row: encode it once
    out = []
    for prompt in prompts:
        key = repr(prompt) if not isinstance(prompt, str) else prompt
        if key not in cache:
            cache[key] = encode_prompt(tokenizer, prompt)
        ids = cache[key]
        out.append(list(ids))
    return out


def completion_metrics(rollout: Rollout) -> dict[str, tuple[float, int]]:
    """TRL's length metrics of one training generation, every rank's completions together, and its ``num_tokens``.

    A completion's length is its sampled tokens, EOS included (multi-turn: not the tool results or observations fed
    between turns, as TRL's ``tool_mask``); ``completions/mean_length``, ``/min_length``, ``/max_length`` over the
    generation's completions, ``/clipped_ratio`` the fraction with no EOS within ``max_completion_length``, and
    ``/mean_terminated_length``, ``/min_terminated_length``, ``/max_terminated_length`` over those that ended with
    EOS (all three 0 when none did, as TRL). Each is one value per generation (``(value, 1)``: the log shows their
    mean over the generations since the last log). ``num_tokens`` adds this rank's prompt tokens and completion
    lengths to the run's total (``metrics.record_num_tokens``: summed over ranks; counted once per generation,
    however many times its samples are trained on, as TRL)."""
    generation = rollout.generation
    lengths_here = rollout.loss_mask.sum(dim=1).float().cpu()  # (N,) before any masking of the loss
    lengths = dist.gather_rows(lengths_here)  # (W*N,)
    truncated = dist.gather_rows(generation.is_truncated.bool().cpu())  # (W*N,)
    terminated = lengths[~truncated] if not truncated.all() else torch.zeros(1)
    return {
        NUM_TOKENS: (float(generation.prompt_mask.sum()) + float(lengths_here.sum()), 0),
        "completions/mean_length": (float(lengths.mean()), 1),
        "completions/min_length": (float(lengths.min()), 1),
        "completions/max_length": (float(lengths.max()), 1),
        "completions/clipped_ratio": (float(truncated.float().mean()), 1),
        "completions/mean_terminated_length": (float(terminated.mean()), 1),
        "completions/min_terminated_length": (float(terminated.min()), 1),
        "completions/max_terminated_length": (float(terminated.max()), 1),
    }


class StepClock:
    """TRL's ``step_time``: the wall time, in seconds, of one optimizer step's work before its optimizer update --
    its window's ``prepare_window`` (sampling and scoring, when the window starts a generation; TRL samples inside
    ``training_step``) and each of its micro-batches' ``training_step`` (forward and backward) -- without the
    gradient clipping, the optimizer step or the callbacks. Host time, as TRL's: no wait for the accelerator.

    >>> clock = StepClock()
    >>> clock.start(2.0, micro_steps=2)  # prepare_window took 2 s; two micro-batches follow
    >>> clock.add(0.5) is None  # the first one took 0.5 s
    True
    >>> clock.add(0.25)  # the last one: the step's time
    2.75
    >>> clock.add(1.0) is None  # a training_step outside a window is not timed
    True
    """

    def __init__(self):
        self.seconds, self.left = 0.0, 0

    def start(self, seconds: float, micro_steps: int) -> None:
        """A window starts: ``seconds`` spent preparing it, ``micro_steps`` training steps to come."""
        self.seconds, self.left = seconds, micro_steps

    def add(self, seconds: float) -> float | None:
        """One training step took ``seconds``: the step's total after its window's last one, else None."""
        if self.left <= 0:
            return None
        self.seconds += seconds
        self.left -= 1
        return self.seconds if self.left == 0 else None


def reward_sums(
    rewards: torch.Tensor,
    weights: list[float],
    names: list[str],
    group: int,
    ks,
    threshold: float,
    pass_key: str = "pass@{k}",
) -> dict[str, tuple[float, int]]:
    """``{metric: (sum, count)}`` of the mean reward and pass@k of the weighted total (``reward``, ``pass@k``) and
    of each function (``rewards/<name>/mean``, ``rewards/<name>/pass@k``) for ``rewards`` ``(N, F)``, N = prompts x
    ``group`` samples in a row; unscored (NaN) samples count in no mean and never pass."""
    columns = [("reward", "", weighted_rewards(rewards, weights))]  # (N,) each
    columns += [(f"rewards/{name}/mean", f"rewards/{name}/", rewards[:, j]) for j, name in enumerate(names)]
    out = {}
    for mean_key, stem, values in columns:
        out[mean_key] = (float(values.nan_to_num(0.0).sum()), int((~values.isnan()).sum()))
        for k, pair in pass_at_k_sums(values.view(-1, group), threshold, ks).items():
            out[stem + pass_key.format(k=k)] = pair
    return out


def custom_eval_metrics(
    compute_metrics, batches: list[dict | None], names: list[str], weights: list[float]
) -> dict[str, float]:
    """``compute_metrics`` on every sampled evaluation completion of every rank (called on each rank with the
    same arguments, so every rank logs the same values)."""
    mine = [b for b in batches if b is not None]
    parts = [b for rank_batches in dist.gather_objects(mine) for b in rank_batches]
    rewards = torch.tensor([r for b in parts for r in b["rewards"]], dtype=torch.float64).view(-1, len(names))
    columns = {key: [v for b in parts for v in b["columns"][key]] for key in (parts[0]["columns"] if parts else ())}
    clash = sorted(set(columns) & set(METRICS_ARGUMENTS))
    if clash:
        raise ValueError(
            f"evaluation column(s) {clash} clash with compute_metrics' own arguments "
            f"{list(METRICS_ARGUMENTS)}; rename the column(s)"
        )
    return call_compute_metrics(
        compute_metrics,
        prompts=[p for b in parts for p in b["prompts"]],
        completions=[c for b in parts for c in b["completions"]],
        completion_ids=[ids for b in parts for ids in b["completion_ids"]],
        rewards={name: [None if math.isnan(v) else v for v in rewards[:, j].tolist()] for j, name in enumerate(names)},
        reward=weighted_rewards(rewards, weights).tolist(),
        **columns,
    )


def reward_list(reward_funcs, required: bool = True) -> list[RewardFunction]:
    if not required and not reward_funcs:
        return []
    if reward_funcs is None:
        raise ValueError(
            "GRPOTrainer needs reward_funcs: a function or a list of functions "
            "fn(prompts, completions, completion_ids, **columns) -> list[float | None]"
        )
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    funcs = [from_reward_model(fn) if isinstance(fn, str) else fn for fn in funcs]  # a reward model's folder or Hub id
    if not funcs:
        raise ValueError("reward_funcs is empty; pass at least one reward function")
    for fn in funcs:
        if not callable(fn):
            raise TypeError(
                f"reward function {fn!r} is not callable; pass a function fn(prompts, completions, "
                f"completion_ids, **columns) or a reward model's folder or Hub id (a str)"
            )
    names = [reward_name(fn) for fn in funcs]
    if len(set(names)) != len(names):
        raise ValueError(
            f"reward functions need distinct names (they are logged as rewards/<name>/mean), got "
            f"{names}; rename one (e.g. set fn.__name__)"
        )
    return funcs


def reward_weights(weights, funcs: list) -> list[float]:
    if weights is None:
        return [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions "
            f"{[reward_name(f) for f in funcs]}; give one weight per function"
        )
    return [float(w) for w in weights]


def check_tokenizer(tokenizer) -> None:
    if tokenizer is None or not callable(getattr(tokenizer, "batch_decode", None)):
        raise ValueError(
            "GRPOTrainer needs processing_class=<a tokenizer> to encode prompts and decode "
            "completions (e.g. treadle.toy.build_tokenizer() or AutoTokenizer.from_pretrained(path))"
        )


def check_dataset(dataset, args, processing_class=None) -> None:
    """Before training: a prompt column, enough distinct prompts for one generation, and a chat template when the
    prompts are chat messages (the first row's says; a stream is not read ahead)."""
    if dataset is None:
        return
    require_columns(
        dataset,
        ["prompt"],
        what="GRPOTrainer",
        fix="Rename the column holding the prompts (text or chat messages) to 'prompt'.",
    )
    if hasattr(dataset, "__len__"):
        prompts = args.generation_batch_size * args.world_size // args.num_generations
        if len(dataset) < prompts:
            raise ValueError(
                f"one generation needs {prompts} distinct prompts (generation_batch_size "
                f"{args.generation_batch_size} x world_size {args.world_size} / num_generations "
                f"{args.num_generations}) but the dataset has {len(dataset)} rows; use more rows, "
                f"a smaller per_device_train_batch_size or steps_per_generation"
            )
        if len(dataset) and is_conversation(dataset[0]["prompt"]):
            check_chat_template(processing_class)
