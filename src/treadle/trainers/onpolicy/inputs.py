"""What an on-policy trainer is given, checked and seeded (GRPO, distillation): its reward functions and their
weights, its tokenizer and its dataset checked before training, prompts tokenised, and the generators that seed
sampling by (seed, key, rank)."""

from __future__ import annotations

import random

import torch

from treadle import distributed as dist
from treadle.data import column_names, require_columns
from treadle.errors import PreflightError
from treadle.models import max_positions
from treadle.rewards import RewardFunction, from_reward_model, reward_name
from treadle.text import check_chat_template, encode_prompt, is_conversation

__all__ = [
    "check_dataset",
    "check_positions",
    "check_prompt_positions",
    "check_tokenizer",
    "generator_seed",
    "reward_list",
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


def check_prompt_positions(lengths: list[int], args, limit: int | None, where: str) -> None:
    """Refuse (PreflightError, one line) prompts of ``lengths`` tokens (cut to ``args.max_prompt_length``) that, with
    ``args.max_completion_length`` tokens sampled after them, need more positions than the model's ``limit``
    (``max_position_embeddings``): learned positions fail at the first generation, rotary ones run out of what the
    model was trained on. ``where``: the prompts' source, named in the message."""
    if limit is None or not lengths:
        return
    cap = args.max_prompt_length or max(lengths)
    longest = min(max(lengths), cap)
    if longest + args.max_completion_length <= limit:
        return
    cut = f" (cut to max_prompt_length={args.max_prompt_length})" if max(lengths) > cap else ""
    room = limit - args.max_completion_length
    fix = (
        f"lower max_prompt_length to {room} (or max_completion_length), or shorten the prompts"
        if room > 0
        else f"lower max_completion_length below {limit}"
    )
    raise PreflightError(
        f"{where}: the longest prompt has {longest} tokens{cut} and max_completion_length="
        f"{args.max_completion_length} more are sampled after it, {longest + args.max_completion_length} positions, "
        f"more than the model's max_position_embeddings={limit}; {fix}"
    )


def check_positions(model, processing_class, args, datasets: dict) -> None:
    """Before training: :func:`check_prompt_positions` on every prompt of ``datasets`` (``{name: dataset}``; a stream
    or a dataset with images is checked as it is sampled instead), tokenised only when ``max_prompt_length`` and
    ``max_completion_length`` alone could exceed the model's positions."""
    limit = max_positions(model)
    if limit is None or (args.max_prompt_length and args.max_prompt_length + args.max_completion_length <= limit):
        return
    for name, dataset in datasets.items():
        if isinstance(dataset, list):
            columns = list(dataset[0]) if dataset else None
        else:
            columns = column_names(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
        if not columns or "prompt" not in columns or {"image", "images"} & set(columns):
            continue
        prompts = dataset["prompt"] if not isinstance(dataset, list) else [row["prompt"] for row in dataset]
        distinct = list({repr(p): p for p in prompts}.values())
        lengths = [len(ids) for ids in tokenize_prompts(processing_class, distinct)]
        check_prompt_positions(lengths, args, limit, f"the {name} dataset")
