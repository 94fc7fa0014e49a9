"""Tasks users bring: reasoning-gym's procedural generators as dataset rows, and its own verifiers as rewards.

reasoning-gym (``pip install 'treadle[gym]'``) is imported by the functions that use it, never at import: it is an
optional package and takes about a second to import.

- **Tasks**: ``gym_tasks(spec)`` reads ``{name: {weight: w, **config}}`` (YAML's ``tasks:``), a list of names or
  ``"a,b"``; names and config keys are checked against reasoning-gym's registry (a wrong one: one line with the close
  names or the task's keys).
- **Items**: one task's items are ``reasoning_gym.create_dataset(name, size=N, seed=S, **config)``, in order
  (``task_items``: what ``treadle eval`` scores, regenerable by anyone); a mixture's are reasoning-gym's own
  ``CompositeDataset`` of ``size`` items, weighted, with seed S (its task i draws from seed S + i + 1).
- **Rows** (``gym_rows``): ``prompt`` (a system prompt, then the question), ``answer`` (the gold answer), ``task``
  (its reasoning-gym name), ``entry`` (the item as JSON: what its verifier reads) and ``task_config`` (its config
  keywords as JSON: the verifier is the task's own, built with that config).
- **Rewards**: ``reasoning_gym_score`` (strict) is the task's ``score_answer`` of the last ``<answer>`` tag's content
  (reasoning-gym's ``extract_answer``; 0 without a tag), one call per completion, the entry passed through;
  ``reasoning_gym_lenient`` scores a reply without a tag on its last number instead; ``answer_tag`` is 1 when the
  reply holds a tag; ``answer_format`` gives partial credit for the format alone.

**Train and evaluation never share items**: a split's seed is ``split_seed(seed, split)``: training draws from
``seed``, evaluation from ``seed + EVAL_SEED_OFFSET`` (``seed: S`` written in an evaluation mapping is used as
given, and ``overlap_warning`` names a configuration whose two splits draw from the same seeds). Easy configs have
few distinct questions (2 one-digit terms: a few hundred), so seeds alone cannot keep them apart:
``gym_rows(..., exclude=questions)`` drops every training row whose question is an evaluation one.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from treadle.errors import UserError
from treadle.metrics import pass_at_k
from treadle.rewards import completion_text

__all__ = [
    "ANSWER_PROMPT",
    "EVAL_SEED_OFFSET",
    "GymError",
    "GymTask",
    "TaskMetrics",
    "answer_format",
    "answer_tag",
    "eval_rewards",
    "gym_dataset",
    "gym_rows",
    "gym_tasks",
    "overlap_warning",
    "reasoning_gym_lenient",
    "reasoning_gym_score",
    "split_seed",
    "system_prompt_text",
    "task_items",
]

GYM_INSTALL = "pip install 'treadle[gym]'"
EVAL_SEED_OFFSET = 10_000  # evaluation items draw from seed + 10,000: a mixture's task i draws from seed + i + 1
# the default system prompt: short, as a 135M model reads it, and it names the tag. No example answer: SmolLM2 copied
# an example's number ("e.g. <answer>42</answer>") into a third to a half of its GRPO samples, a mode the format
# reward paid for (docs/tasks.md)
ANSWER_PROMPT = "Answer the question. Put only the final answer between <answer> and </answer> tags."
# the rewards a config's reasoning-gym dataset trains on when it names none: the verifier, and the format with partial
# credit (GRPO cannot find the tag from the strict score alone: a small model never writes it unasked)
AUTO_REWARDS = ("treadle.tasks.reasoning_gym_score", "treadle.tasks.answer_format")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class GymError(UserError, ValueError):
    """A reasoning-gym task, config or package problem: one line naming the fix."""


def require_gym():
    """The ``reasoning_gym`` module, or a one-line error naming the extra that installs it."""
    try:
        import reasoning_gym  # optional, ~1 s to import: only where tasks are used
    except ImportError:
        raise GymError(
            f"reasoning-gym tasks need the reasoning-gym package, which is not installed: {GYM_INSTALL}"
        ) from None
    return reasoning_gym


@dataclasses.dataclass(frozen=True)
class GymTask:
    """One reasoning-gym task: its registered ``name``, its config keywords and its weight in a mixture."""

    name: str
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    weight: float = 1.0

    def describe(self) -> dict[str, Any]:
        """``{"name": ..., "config": {...}, "weight": ...}`` as results.json and eval.json write it."""
        return {"name": self.name, "config": dict(self.config), "weight": self.weight}


def gym_tasks(spec) -> list[GymTask]:
    """The tasks ``spec`` names: ``{name: {weight: w, key: value, ...}}`` (a config's ``tasks:``), a list of names
    or of ``GymTask``, or ``"name,name"``. Each name and config key is checked (``GymError`` names the close names
    or the task's keys), and each config is validated by reasoning-gym's own config class."""
    if isinstance(spec, str):
        spec = [name.strip() for name in spec.split(",") if name.strip()]
    if isinstance(spec, Mapping):
        items = [(name, dict(options or {})) for name, options in spec.items()]
    else:
        items = [(t.name, {**t.config, "weight": t.weight}) if isinstance(t, GymTask) else (str(t), {}) for t in spec]
    if not items:
        raise GymError("no reasoning-gym task named; e.g. tasks: {chain_sum: {}, leg_counting: {}}")
    tasks = []
    for name, options in items:
        weight = options.pop("weight", 1.0)
        if not isinstance(weight, (int, float)) or weight <= 0:
            raise GymError(f"reasoning-gym task {name}: weight must be a number > 0, got {weight!r}")
        tasks.append(GymTask(name, options, float(weight)))
        _check_task(tasks[-1])
    return tasks


def _check_task(task: GymTask) -> None:
    """A ``GymError`` for a name reasoning-gym does not know, a key its config lacks, or a value it refuses."""
    require_gym()
    from reasoning_gym.factory import DATASETS  # the registry of task names and config classes

    if task.name not in DATASETS:
        close = difflib.get_close_matches(task.name, list(DATASETS), n=5, cutoff=0.5)
        hint = (
            f"close names: {', '.join(close)}" if close else f"{len(DATASETS)} tasks: reasoning_gym.factory.DATASETS"
        )
        raise GymError(f"reasoning-gym has no task {task.name!r}; {hint}")
    fields = [f.name for f in dataclasses.fields(DATASETS[task.name][1]) if f.name not in ("seed", "size")]
    unknown = [key for key in task.config if key not in fields]
    if unknown:
        raise GymError(f"reasoning-gym task {task.name} has no config key {unknown[0]!r}; its keys: {fields}")
    try:
        _task_dataset(task.name, _config_json(task.config))[0]  # an item too: some configs fail only there
    except (AssertionError, ValueError, TypeError) as error:  # its config's validate() asserts
        raise GymError(f"reasoning-gym task {task.name} refuses its config {dict(task.config)}: {error}") from None


def _config_json(config: Mapping[str, Any]) -> str:
    return json.dumps(dict(config), sort_keys=True)


@functools.lru_cache(maxsize=256)
def _task_dataset(name: str, config_json: str):
    """The task's reasoning-gym dataset with this config: its verifier (``score_answer``) for rows of the task."""
    return require_gym().create_dataset(name, size=1, seed=0, **json.loads(config_json))


def system_prompt_text(prompt: str | None = None) -> str:
    """The system prompt: ``ANSWER_PROMPT`` when None, one of ``reasoning_gym.utils.SYSTEM_PROMPTS`` by name
    ("simple", "default", "direct", ...), else the text itself."""
    if prompt is None:
        return ANSWER_PROMPT
    require_gym()
    from reasoning_gym.utils import SYSTEM_PROMPTS  # reasoning-gym's named prompts

    return SYSTEM_PROMPTS.get(prompt, prompt)


def split_seed(seed: int, split: str) -> int:
    """The seed a split's items draw from: ``seed`` for "train", ``seed + EVAL_SEED_OFFSET`` otherwise."""
    return seed if split == "train" else seed + EVAL_SEED_OFFSET


def task_items(task: GymTask, size: int, seed: int) -> list[dict]:
    """``create_dataset(task.name, size=size, seed=seed, **task.config)``'s items, in order."""
    dataset = require_gym().create_dataset(task.name, size=size, seed=seed, **dict(task.config))
    return [dataset[i] for i in range(size)]


def mixture_items(tasks: list[GymTask], size: int, seed: int) -> list[dict]:
    """``size`` items of reasoning-gym's ``CompositeDataset`` of ``tasks`` (weighted; task i seeded seed + i + 1)."""
    require_gym()
    from reasoning_gym.composite import DatasetSpec  # reasoning-gym's own mixture

    specs = [DatasetSpec(t.name, t.weight, dict(t.config)) for t in tasks]
    dataset = require_gym().create_dataset("composite", size=size, seed=seed, datasets=specs)
    return [dataset[i] for i in range(size)]


def gym_rows(items: Iterable[dict], tasks: list[GymTask], system_prompt: str | None = None, exclude=()) -> list[dict]:
    """Training or evaluation rows of reasoning-gym ``items`` (see the module docstring for the columns), with the
    system prompt ``system_prompt_text(system_prompt)``; items whose question is in ``exclude`` are dropped."""
    configs = {t.name: _config_json(t.config) for t in tasks}
    system, excluded = system_prompt_text(system_prompt), set(exclude)
    return [
        {
            "prompt": [{"role": "system", "content": system}, {"role": "user", "content": item["question"]}],
            "answer": str(item["answer"]),
            "task": item["metadata"]["source_dataset"],
            "entry": json.dumps(item, default=str),
            "task_config": configs[item["metadata"]["source_dataset"]],
        }
        for item in items
        if item["question"] not in excluded
    ]


def gym_dataset(spec: Mapping[str, Any], split: str = "train", *, exclude=(), train_seed: int | None = None):
    """A ``datasets.Dataset`` of a config's ``reasoning_gym:`` mapping: ``tasks`` (see ``gym_tasks``), ``size``
    (default 1000), ``seed`` (default 0; evaluation: ``train_seed`` + ``EVAL_SEED_OFFSET`` unless written) and
    ``system_prompt`` (a name or a text; default ``ANSWER_PROMPT``)."""
    import datasets  # ~1 s to import: where rows are built

    unknown = sorted(set(spec) - {"tasks", "size", "seed", "system_prompt"})
    if unknown or "tasks" not in spec:
        raise GymError(
            f"a reasoning_gym dataset takes tasks:, size:, seed: and system_prompt:, got {sorted(spec)}; e.g. "
            f"dataset: {{reasoning_gym: {{tasks: {{chain_sum: {{weight: 2}}, leg_counting: {{}}}}, size: 4000}}}}"
        )
    tasks, size = gym_tasks(spec["tasks"]), spec.get("size", 1000)
    if not isinstance(size, int) or size < 1:
        raise GymError(f"a reasoning_gym dataset's size must be a whole number >= 1, got {size!r}")
    seed = spec["seed"] if "seed" in spec else split_seed(train_seed or 0, split)
    rows = gym_rows(mixture_items(tasks, size, seed), tasks, spec.get("system_prompt"), exclude)
    if not rows:
        raise GymError("every training item of the reasoning_gym dataset is an evaluation question; raise its size")
    return datasets.Dataset.from_list(rows)


def mixture_seeds(spec: Mapping[str, Any], split: str, train_seed: int = 0) -> set[tuple[str, int]]:
    """``(task, seed)`` of each task of a ``reasoning_gym:`` mapping, as ``gym_dataset`` seeds them."""
    seed = spec["seed"] if "seed" in spec else split_seed(train_seed, split)
    return {(t.name, seed + i + 1) for i, t in enumerate(gym_tasks(spec["tasks"]))} if "tasks" in spec else set()


def overlap_warning(train: Mapping[str, Any], evaluation: Mapping[str, Any]) -> str | None:
    """One line when the training and evaluation mappings draw a task from the same seed (the same items)."""
    shared = sorted(mixture_seeds(train, "train") & mixture_seeds(evaluation, "test", train.get("seed", 0)))
    if not shared:
        return None
    names = ", ".join(f"{name} (seed {seed})" for name, seed in shared)
    return (
        f"treadle: warning: the reasoning_gym dataset and eval_dataset draw {names} from the same seed, so they share "
        f"items; leave seed: out of eval_dataset (it then draws from seed + {EVAL_SEED_OFFSET})"
    )


# ---- rewards: reasoning-gym's verifiers, one call per completion
def answer_text(completion) -> str | None:
    """The last ``<answer>`` tag's content (reasoning-gym's ``extract_answer``), None without a tag."""
    require_gym()
    from reasoning_gym.utils import extract_answer  # its own rule: the last tag, stripped

    return extract_answer(completion_text(completion))


def last_number(completion) -> str | None:
    """The reply's last number (commas dropped), None without one."""
    numbers = _NUMBER.findall(completion_text(completion).replace(",", ""))
    return numbers[-1] if numbers else None


def _score(answer: str | None, task: str, entry: str, task_config: str) -> float:
    """The task's own ``score_answer(answer, entry)``; 0.0 without an answer."""
    if answer is None:
        return 0.0
    verifier = _task_dataset(task, task_config)
    try:
        return float(verifier.score_answer(answer, json.loads(entry)))
    except Exception:  # noqa: BLE001 - a verifier may raise on a malformed reply (reasoning-gym's code): it scores 0
        return 0.0


def reasoning_gym_score(completions, task, entry, task_config, **_) -> list[float]:
    """Strict: reasoning-gym's ``score_answer`` of the last ``<answer>`` tag's content (0 without a tag)."""
    return [_score(answer_text(c), t, e, k) for c, t, e, k in zip(completions, task, entry, task_config)]


def reasoning_gym_lenient(completions, task, entry, task_config, **_) -> list[float]:
    """Lenient: as ``reasoning_gym_score``, but a reply without a tag is scored on its last number."""
    scores = []
    for completion, t, e, k in zip(completions, task, entry, task_config):
        answer = answer_text(completion)
        scores.append(_score(answer if answer is not None else last_number(completion), t, e, k))
    return scores


def answer_tag(completions, **_) -> list[float]:
    """1.0 when the reply holds an ``<answer>...</answer>`` tag, else 0.0 (the tag rate)."""
    return [float(answer_text(c) is not None) for c in completions]


def answer_format(completions, **_) -> list[float]:
    """The format alone, with partial credit: 1.0 for a non-empty ``<answer>`` tag that ends the reply, 0.75 for one
    with text after it, 0.5 for an empty tag, 0.25 for an opening ``<answer>`` without its close, else 0."""
    scores = []
    for completion in completions:
        text, answer = completion_text(completion), answer_text(completion)
        if answer:
            scores.append(1.0 if text.rstrip().endswith("</answer>") else 0.75)
        else:
            scores.append(0.5 if answer is not None else 0.25 if "<answer>" in text else 0.0)
    return scores


# ---- evaluation: GRPOTrainer.evaluate's samples, scored per task
SCORE_NAMES = {"reasoning_gym_score": "strict", "reasoning_gym_lenient": "lenient", "answer_tag": "tag_rate"}


def eval_rewards() -> list:
    """The reward functions of a reasoning-gym evaluation, strict first: with weights ``[1, 0, 0]`` the evaluation's
    ``reward`` is the strict score, and every figure of ``TaskMetrics`` is there."""
    return [reasoning_gym_score, reasoning_gym_lenient, answer_tag]


class TaskMetrics:
    """A ``compute_metrics`` for ``GRPOTrainer.evaluate`` (its contract: treadle.rewards) that scores each task of
    the evaluation set apart (its ``task`` column; "all" without one): per task and reward function, the mean and
    the unbiased pass@k of ``num_samples`` samples per prompt (a sample passes with a score >= ``threshold``), named
    ``<task>/strict``, ``/lenient``, ``/tag_rate`` for the reasoning-gym rewards (``<task>/<function>`` for others),
    ``<task>/pass@k`` of the first function; ``<task>/mean_length`` (tokens, EOS included), ``<task>/truncated`` (no
    EOS within ``max_new_tokens``), ``<task>/items``; and ``mean/<score>``, the mean over tasks of each score."""

    def __init__(self, num_samples: int, max_new_tokens: int, eos_token_ids, threshold: float = 1.0):
        self.num_samples, self.max_new_tokens, self.threshold = num_samples, max_new_tokens, threshold
        self.eos = set(eos_token_ids if isinstance(eos_token_ids, (list, tuple, set)) else [eos_token_ids])
        self.__name__ = "task_metrics"  # the name its errors go by (rewards.reward_name)

    def __call__(self, prompts, completions, completion_ids, rewards, reward, task=None, **_) -> dict[str, float]:
        names = list(task) if task is not None else ["all"] * len(completions)
        out: dict[str, float] = {}
        for name in dict.fromkeys(names):
            rows = [i for i, n in enumerate(names) if n == name]
            out.update(self._scores(name, rows, completion_ids, rewards))
        for key in sorted({k.split("/", 1)[1] for k in out if not k.endswith("/items")}):
            values = [v for k, v in out.items() if k.split("/", 1)[1] == key]
            out[f"mean/{key}"] = sum(values) / len(values)
        return out

    def _scores(self, name: str, rows: list[int], completion_ids, rewards) -> dict[str, float]:
        k = self.num_samples
        out = {f"{name}/items": len(rows) / k}
        for j, (function, values) in enumerate(rewards.items()):
            scores = [0.0 if values[i] is None else values[i] for i in rows]
            label = SCORE_NAMES.get(function, function)
            out[f"{name}/{label}"] = sum(scores) / len(scores)
            if j == 0 and k > 1:
                groups = [scores[g : g + k] for g in range(0, len(scores), k)]
                passed = [pass_at_k(k, sum(s >= self.threshold for s in group), k) for group in groups]
                out[f"{name}/pass@{k}"] = sum(passed) / len(passed)
        lengths = [len(completion_ids[i]) for i in rows]
        cut = [n >= self.max_new_tokens and completion_ids[i][-1] not in self.eos for i, n in zip(rows, lengths)]
        out[f"{name}/mean_length"] = sum(lengths) / len(lengths)
        out[f"{name}/truncated"] = sum(cut) / len(cut)
        return out
