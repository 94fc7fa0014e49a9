"""Reward functions for online RL (GRPO): the contract, its checks, and a few ready rewards.

The contract. A reward function is any callable

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

called with keyword arguments only, one entry per completion:

- ``prompts``: the prompt of each completion as the dataset holds it (a string, or a list of chat messages).
  A prompt sampled G times appears G times in a row.
- ``completions``: the decoded completion (special tokens dropped): a string, or for chat prompts
  ``[{"role": "assistant", "content": text}]``.
- ``completion_ids``: the completion's token ids (a list of ints, EOS included when one was generated).
- ``columns``: every other dataset column, as a list aligned with ``prompts`` (e.g. ``answer``). Accept
  ``**kwargs`` to ignore the columns you do not use.

It returns one number per completion (bool, int, float, a 0-d tensor or numpy scalar), or ``None`` for "no
opinion" (e.g. a code reward asked about a maths sample). The trainer sums the numbers across functions with
``reward_weights``; a completion that no function scores is an error. A function that raises, returns the
wrong number of values, a non-number, NaN or an infinity fails with :class:`RewardFunctionError`, naming the
function, the training step and one offending sample.

The ready rewards below follow the contract; :func:`exact_match` and :func:`regex_format` read the text of a
completion through :func:`completion_text`, so they work for plain and chat completions alike.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from treadle.errors import UserError
from treadle.models import load_pretrained
from treadle.packing import right_padded
from treadle.text import encode_prompt_responses, pad_token_id

RewardFunction = Callable[..., Sequence[Any]]

__all__ = [
    "RewardFunction",
    "RewardFunctionError",
    "call_reward_function",
    "completion_text",
    "exact_match",
    "from_reward_model",
    "overlong_penalty",
    "regex_format",
    "reward_name",
    "score_completions",
    "weighted_rewards",
]


class RewardFunctionError(UserError, ValueError):
    """A reward function broke the contract; the message names it, the step and one offending sample."""


def reward_name(fn: RewardFunction) -> str:
    """The name a reward function is logged under (``rewards/<name>/mean``): its ``__name__``, the wrapped
    function's name for a ``functools.partial``, else its class name."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """The text of a completion: itself, or the content of the last message of a chat completion."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


# ---------------------------------------------------------------------------------------------------------
# Calling and checking
# ---------------------------------------------------------------------------------------------------------
def call_reward_function(
    fn: RewardFunction, *, prompts: list, completions: list, completion_ids: list, columns: dict[str, list], step: int
) -> list[float]:
    """Call ``fn`` by the contract and check what it returns; ``None`` entries come back as NaN.

    ``fn`` gets its own copies of the arguments: a function that edits them (``completions[0] = ...``, a chat
    message's content) changes neither what the next function reads nor what completions.jsonl records.
    Raises RewardFunctionError (with the function's name, ``step`` and one sample) when the function raises,
    returns a number of values other than ``len(completions)``, a non-number, NaN or an infinity.
    """
    name = reward_name(fn)
    arguments = copy.deepcopy(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns))
    try:
        values = fn(**arguments)
    except Exception as e:
        raise RewardFunctionError(
            f"reward function {name!r} raised {type(e).__name__}: {e} at step {step}; its first sample was "
            f"{_describe(0, prompts, completions, columns)}. Reward functions are called as fn(prompts=..., "
            f"completions=..., completion_ids=..., {', '.join(f'{c}=...' for c in columns)}) and should "
            f"accept **kwargs"
        ) from e
    values = _as_list(values, name, step)
    if len(values) != len(completions):
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(values)} values for {len(completions)} completions at "
            f"step {step}; return one value (or None) per completion. First sample: "
            f"{_describe(0, prompts, completions, columns)}"
        )
    return [_check_value(v, i, name, step, prompts, completions, columns) for i, v in enumerate(values)]


def score_completions(
    reward_funcs: Sequence[RewardFunction],
    weights: Sequence[float],
    *,
    prompts: list,
    completions: list,
    completion_ids: list,
    columns: dict[str, list],
    step: int,
) -> torch.Tensor:
    """Every function's rewards as a float32 ``(N, F)`` tensor, NaN where a function had no opinion.

    Fails when some completion got no number from any function with a non-zero weight: its reward would
    be undefined.
    """
    per_function = [
        call_reward_function(
            fn, prompts=prompts, completions=completions, completion_ids=completion_ids, columns=columns, step=step
        )
        for fn in reward_funcs
    ]
    rewards = torch.tensor(per_function, dtype=torch.float32).T.reshape(len(completions), len(reward_funcs))
    overflowed = rewards.isinf()  # finite as Python floats (checked), beyond float32's range (3.4e38) here
    if overflowed.any():
        i, j = (int(k) for k in overflowed.nonzero()[0])
        raise RewardFunctionError(
            f"reward function {reward_name(reward_funcs[j])!r} returned {per_function[j][i]:g} for sample {i} at "
            f"step {step}, beyond the float32 range rewards are computed in (|r| < 3.4e38); return rewards of a "
            f"sensible scale (e.g. within +-1e6). Sample: {_describe(i, prompts, completions, columns)}"
        )
    weighted = [j for j, w in enumerate(weights) if w != 0]
    unscored = rewards[:, weighted].isnan().all(dim=1) if weighted else torch.zeros(len(completions), dtype=torch.bool)
    if unscored.any():
        i = int(unscored.nonzero()[0])
        names = [reward_name(fn) for fn in reward_funcs]
        raise RewardFunctionError(
            f"no reward function scored sample {i} at step {step} (all of {names} returned None): "
            f"{_describe(i, prompts, completions, columns)}; make at least one function return a number "
            f"for every completion"
        )
    return rewards


def weighted_rewards(rewards: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
    """``(N,)`` the weighted sum over functions of ``rewards`` ``(N, F)``, skipping NaN (no opinion)."""
    w = torch.as_tensor(list(weights), dtype=rewards.dtype, device=rewards.device)  # (F,)
    return torch.nansum(rewards * w, dim=1)  # (N,)


def _as_list(values, name: str, step: int) -> list:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().reshape(-1).tolist()
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # numpy arrays
        values = values.tolist()
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, Sequence):
        raise RewardFunctionError(
            f"reward function {name!r} returned a {type(values).__name__} at step {step}; "
            f"return a list with one float (or None) per completion"
        )
    return list(values)


def _check_value(value, i: int, name: str, step: int, prompts, completions, columns) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    elif hasattr(value, "item") and not isinstance(value, (int, float)):  # numpy scalars
        value = value.item()
    if not isinstance(value, (bool, int, float)):
        raise RewardFunctionError(
            f"reward function {name!r} returned {value!r} ({type(value).__name__}) for sample {i} at step "
            f"{step}; return a float or None. Sample: {_describe(i, prompts, completions, columns)}"
        )
    value = float(value)
    if not math.isfinite(value):
        raise RewardFunctionError(
            f"reward function {name!r} returned {value} for sample {i} at step {step}; rewards must be finite "
            f"(return None for 'no opinion'). Sample: {_describe(i, prompts, completions, columns)}"
        )
    return value


def _describe(i: int, prompts, completions, columns, limit: int = 200) -> str:
    def short(x) -> str:
        text = repr(x)
        return text if len(text) <= limit else text[:limit] + "...'"

    parts = [f"prompt={short(prompts[i])}", f"completion={short(completions[i])}"]
    parts += [f"{k}={short(v[i])}" for k, v in columns.items() if isinstance(v, (list, tuple)) and len(v) > i]
    return "{" + ", ".join(parts) + "}"


# ---------------------------------------------------------------------------------------------------------
# Ready rewards
# ---------------------------------------------------------------------------------------------------------
def exact_match(completions: list, answer: list, **kwargs: Any) -> list[float]:
    """1.0 where the completion's first line, stripped, equals the ``answer`` column (stripped), else 0.0.

    >>> exact_match(completions=["46\\nbecause", " 7"], answer=["46", "8"])
    [1.0, 0.0]
    """
    return [
        float(completion_text(c).split("\n", 1)[0].strip() == str(a).strip())
        for c, a in zip(completions, answer, strict=True)
    ]


def regex_format(pattern: str, *, name: str | None = None, flags: int = re.DOTALL) -> RewardFunction:
    """A reward that is 1.0 when the whole completion text matches ``pattern`` (``re.fullmatch``), else 0.0.

    Logged as ``name`` (default ``regex_format``). E.g. ``regex_format(r"<think>.*</think>\\s*<answer>.*</answer>")``.

    >>> digits = regex_format(r"\\d+", name="digits_only")
    >>> digits(completions=["123", "12a"]), digits.__name__
    ([1.0, 0.0], 'digits_only')
    """
    compiled = re.compile(pattern, flags)

    def reward(completions: list, **kwargs: Any) -> list[float]:
        return [float(compiled.fullmatch(completion_text(c)) is not None) for c in completions]

    reward.__name__ = reward.__qualname__ = name or "regex_format"
    return reward


def overlong_penalty(max_length: int, soft_cache: int) -> RewardFunction:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to ``max_length - soft_cache`` tokens,
    then falling linearly to -1 at ``max_length`` (and -1 beyond). Counts ``completion_ids``.

    >>> penalty = overlong_penalty(max_length=10, soft_cache=4)
    >>> penalty(completion_ids=[[1] * 6, [1] * 8, [1] * 12])
    [0.0, -0.5, -1.0]
    """
    if not 0 < soft_cache <= max_length:
        raise ValueError(f"need 0 < soft_cache <= max_length, got soft_cache={soft_cache}, max_length={max_length}")
    start = max_length - soft_cache

    def overlong_penalty(completion_ids: list, **kwargs: Any) -> list[float]:
        return [max(-1.0, min(0.0, (start - len(ids)) / soft_cache)) for ids in completion_ids]

    return overlong_penalty


def from_reward_model(
    model, tokenizer=None, *, batch_size: int = 32, device=None, name: str | None = None
) -> RewardFunction:
    """A trained reward model as a reward function: each completion's reward is the model's score of prompt +
    completion, tokenised as ``RewardTrainer`` tokenised its pairs (``data.encode_prompt_responses``).

    ``model``: a folder saved by ``RewardTrainer.save_model`` or a Hub id (any ``AutoModelForSequenceClassification``
    with one label, read by ``models.load_pretrained``; its tokenizer is loaded with it), or a loaded model, then
    with ``tokenizer``. A config names it as ``reward_funcs: [model:PATH_OR_ID]``.
    Scores ``batch_size`` completions per forward, without gradients, in eval mode, on ``device`` (default:
    where the model is). Logged as ``name`` (default: the folder's name, else ``reward_model``).

    >>> # reward = from_reward_model("runs/rm/final")
    >>> # GRPOTrainer(policy, [reward, toy.addition_reward], args=..., train_dataset=..., processing_class=tok)
    """
    if isinstance(model, (str, Path)):
        from transformers import AutoModelForSequenceClassification  # transformers' model classes load ~5 s

        name = name or Path(model).name
        model, tokenizer = load_pretrained(
            str(model), tokenizer=tokenizer, model_class=AutoModelForSequenceClassification
        )
    if tokenizer is None:
        raise ValueError("from_reward_model(model) with a loaded model needs tokenizer=<its tokenizer>")
    if device is not None:
        model = model.to(device)
    model.eval()
    pad, device = pad_token_id(tokenizer), next(model.parameters()).device

    @torch.no_grad()
    def reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
        rows = []
        for prompt, completion in zip(prompts, completions, strict=True):
            prompt_ids, (completion_ids,) = encode_prompt_responses(tokenizer, prompt, [completion])
            rows.append(prompt_ids + completion_ids)
        scores = []
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            width = max(len(r) for r in chunk)
            ids = right_padded(chunk, width, pad).to(device)
            mask = right_padded([[1] * len(r) for r in chunk], width, 0).to(device)
            scores += model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()
        return scores

    reward.__name__ = reward.__qualname__ = name or "reward_model"
    return reward


# ---------------------------------------------------------------------------------------------------------
# compute_metrics for online RL: custom metrics on the sampled evaluation completions
# ---------------------------------------------------------------------------------------------------------
METRICS_ARGUMENTS = ("prompts", "completions", "completion_ids", "rewards", "reward")


def check_compute_metrics(fn, columns=()) -> None:
    """Refuse a ``compute_metrics`` that cannot be called by the GRPO contract (at trainer construction)::

        compute_metrics(prompts, completions, completion_ids, rewards, reward, **columns) -> dict[str, float]

    called with keyword arguments once per evaluation, over the whole evaluation set (every rank's rows):
    ``prompts``, ``completions`` and ``completion_ids`` as reward functions get them (each prompt
    ``num_generations_eval`` times in a row); ``rewards`` maps each reward function's name to its values
    (None where it had no opinion); ``reward`` is the weighted total of each completion; ``columns`` are the
    evaluation set's other columns. It returns ``{name: number}``, logged as ``eval_<name>``. ``columns``: the
    names known now (the eval dataset's), checked too."""
    import inspect

    if not callable(fn):
        raise TypeError(
            f"compute_metrics={fn!r} is not callable; pass a function "
            f"fn({', '.join(METRICS_ARGUMENTS)}, **columns) -> dict[str, float]"
        )
    names = [*METRICS_ARGUMENTS, *(c for c in columns if c != "prompt")]
    try:
        inspect.signature(fn).bind(**dict.fromkeys(names))
    except TypeError as error:
        raise TypeError(
            f"compute_metrics {reward_name(fn)!r} cannot be called as fn({', '.join(names)}) "
            f"({error}); give it these keyword parameters or **kwargs"
        ) from None
    except ValueError:  # a builtin without a signature: checked when called
        return


def call_compute_metrics(fn, **arguments) -> dict[str, float]:
    """Call ``compute_metrics`` by the contract (see ``check_compute_metrics``) and check that it returned
    ``{str: number}``; the numbers come back as floats."""
    out = fn(**arguments)
    if not isinstance(out, dict):
        raise TypeError(
            f"compute_metrics {reward_name(fn)!r} returned {type(out).__name__}; return a dict {{metric name: number}}"
        )
    metrics = {}
    for key, value in out.items():
        try:
            metrics[str(key)] = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"compute_metrics {reward_name(fn)!r} returned {key!r}: {value!r}, which is not a "
                f"number; return numbers only (they are logged and plotted)"
            ) from None
    return metrics
