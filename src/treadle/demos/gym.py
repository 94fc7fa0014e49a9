"""``treadle demo --model smollm2 --task gym``: GRPO of SmolLM2-135M-Instruct on a mixture of reasoning-gym tasks,
each scored on its own held-out items before, during and after.

``run_gym_demo(GymDemoSettings(...), output_dir)``:

1. loads SmolLM2-135M-Instruct (``treadle.demos.smollm2``), float32, every weight trained;
2. scores it on ``eval_size`` held-out items of each task of ``DEMO_TASKS`` (``create_dataset(name, size,
   seed=tasks.EVAL_SEED_OFFSET, **config)``: the items of docs/tasks.md's base table, the same for every seed) with
   ``GRPOTrainer.evaluate()``: greedy, reasoning-gym's strict and lenient scores per task (``tasks.TaskMetrics``,
   the figures ``treadle eval`` prints);
3. an SFT warm start (``sft_steps``) on gold answers in the tag format, other items of the mixture, scored again;
4. GRPO on reasoning-gym's own weighted mixture of the tasks (seed ``seed``; no training item asks a held-out
   question), no reference model: the strict score (``reasoning_gym_score``) plus the format
   reward with partial credit (``answer_format``, weight ``format_weight``); the held-out items are scored every
   ``eval_every`` steps. The base model never writes the answer tag (0 of 750 greedy replies, 0 of 160 samples at
   temperature 1), so neither the strict score alone (issue 58: 320 zero rewards) nor a format reward would give
   GRPO anything to learn from: the warm start makes the tag appear, and the claim is measured from it.

The tasks and their easy configs were chosen by measuring the base model first, before any training (docs/tasks.md
lists every task and config measured). Writes ``results.json`` (``tasks`` with their configs, ``system_prompt``,
``stages`` with each stage's per-task strict and lenient scores and their means, the curve, the load), the GRPO run
folder (metrics.jsonl, completions.jsonl, plots) and the trained model in ``grpo/final`` (``treadle eval`` scores
it). Unless OMP_NUM_THREADS is set, torch uses every core (as ``treadle demo --model smollm2``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from treadle import tasks
from treadle.callbacks import TrainerCallback
from treadle.demos import smollm2
from treadle.demos.addition import sft_warm_start, start_demo
from treadle.demos.real import demo_grpo_config
from treadle.generation.single import generate_completions
from treadle.models import load_pretrained
from treadle.peft import apply_peft, lora_config
from treadle.record.plots import print_plots
from treadle.text import eos_ids, render_chat_prompt
from treadle.trainers.grpo.trainer import GRPOTrainer
from treadle.trainers.sft import SFTTrainer

# chosen from the base model's scores (docs/tasks.md): lenient between about 5% and 60%, before any training
DEMO_TASKS = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "gcd": {"min_value": 1, "max_value": 20},
    "lcm": {"min_value": 1, "max_value": 10},
    "letter_counting": {"min_words": 3, "max_words": 5},
}
STAGE_SCORES = ("strict", "lenient")
WARM_STARTS = ("gold", "own")
TRAINED_SCORES = (*STAGE_SCORES, "both")


@dataclasses.dataclass
class GymDemoSettings:
    """What ``treadle demo --model smollm2 --task gym`` trains (docs/demos.md: every run, its seed, load and wall)."""

    seed: int = 0  # the training mixture's items and order, and sampling (the held-out items are fixed)
    eval_size: int = 30  # held-out items per task, scored before, during and after
    grpo_steps: int = 20  # GRPO optimizer steps
    learning_rate: float = 2e-5  # AdamW, constant
    prompts_per_step: int = 4  # training items per step
    num_generations: int = 8  # G: completions per item
    max_completion_length: int = 48  # tokens, in training and in the held-out scores (the base table's)
    temperature: float = 1.0
    format_weight: float = 0.5  # the format reward's weight beside the score's 1
    # the verifier score GRPO trains on: "strict" (the tag's content), "lenient" (an untagged reply's last number
    # too: a right answer counts before the tag is learned) or "both" (their sum: a right answer earns 1, a right
    # answer in the tag 2, a wrong one 0 with or without the tag); a score not trained on is only recorded
    trained_score: str = "strict"
    # the strict score's weight where it is trained on ("strict", "both"); above 1 under "both", a right answer pays
    # more in the tag than without it (run G11)
    strict_weight: float = 1.0
    # an SFT warm start on gold answers in the tag format before GRPO (0: none): the base model wrote the tag in none
    # of 160 samples at temperature 1 (docs/tasks.md), so a format reward alone would have nothing to reward. One step
    # makes the tag appear in about a third of the replies and leaves the policy's entropy high; 10 steps made it
    # near deterministic (entropy 0.02-0.19), and GRPO then found few groups with a signal (docs/tasks.md)
    sft_steps: int = 1
    sft_learning_rate: float = 5e-5
    sft_batch_size: int = 8
    # what the warm start shows: "gold" (the gold answer alone in the tag) or "own" (the model's own sampled replies
    # whose last number is right, with that number appended in the tag: its reasoning kept, so that GRPO starts from
    # replies that work before they answer); "own" samples ``warm_start_samples`` replies for each of the mixture's
    # first ``warm_start_pool`` items and keeps one right reply per item
    warm_start: str = "gold"
    warm_start_pool: int = 32
    warm_start_samples: int = 4
    # where the warm start stops (0: after exactly ``sft_steps`` steps): after the first step at which this share of
    # greedy replies to the warm start's own items carries the tag (training items, never held-out ones), at most
    # ``sft_steps``. One step at a fixed rate left the tag on 12-57% of the held-out replies by seed (docs/tasks.md)
    warm_start_tag_rate: float = 0.0
    eval_every: int = 10  # GRPO steps between held-out scores
    # the KL term's weight (GRPOConfig.beta); its reference is the policy GRPO starts from (after the warm start)
    beta: float = 0.0
    # a LoRA policy of this rank on every linear layer (0: every weight trains); the warm start and GRPO train the
    # same adapters, at ``lora_rate_scale`` times the learning rates above (adapters start at zero and move slowly)
    lora_rank: int = 0
    lora_rate_scale: float = 10.0

    def __post_init__(self) -> None:
        if min(self.grpo_steps, self.eval_size, self.eval_every) < 1:
            raise ValueError("--grpo-steps and --eval-size must be >= 1")
        if self.trained_score not in TRAINED_SCORES:
            raise ValueError(f"trained_score must be one of {TRAINED_SCORES}, got {self.trained_score!r}")
        if self.strict_weight <= 0:
            raise ValueError(f"strict_weight must be > 0, got {self.strict_weight}")
        if self.warm_start not in WARM_STARTS:
            raise ValueError(f"warm_start must be one of {WARM_STARTS}, got {self.warm_start!r}")
        if not 0 <= self.warm_start_tag_rate <= 1:
            raise ValueError(f"warm_start_tag_rate must lie in [0, 1], got {self.warm_start_tag_rate}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank {self.lora_rank}: give a rank >= 1, or 0 to train every weight")

    def applied(self) -> GymDemoSettings:
        """These settings with the learning rates the run applies: scaled by ``lora_rate_scale`` for a LoRA policy."""
        if not self.lora_rank:
            return self
        scale = self.lora_rate_scale
        rates = dict(learning_rate=self.learning_rate * scale, sft_learning_rate=self.sft_learning_rate * scale)
        return dataclasses.replace(self, lora_rate_scale=1.0, **rates)


def demo_tasks() -> list[tasks.GymTask]:
    return tasks.gym_tasks({name: dict(config) for name, config in DEMO_TASKS.items()})


def heldout_rows(settings: GymDemoSettings) -> list[dict]:
    """Each task's ``eval_size`` held-out items (seed ``tasks.EVAL_SEED_OFFSET``), task after task."""
    return [
        row
        for task in demo_tasks()
        for row in tasks.gym_rows(tasks.task_items(task, settings.eval_size, tasks.EVAL_SEED_OFFSET), [task])
    ]


def training_rows(settings: GymDemoSettings, held_out: list[dict]) -> list[dict]:
    """The rows of GRPO's ``grpo_steps`` steps: reasoning-gym's weighted mixture of the tasks (seed ``seed``) after
    the warm start's items, every held-out question left out; a run of more steps extends a shorter one's rows."""
    first = warm_start_items(settings)
    return _mixture_rows(settings, held_out)[first : first + settings.prompts_per_step * settings.grpo_steps]


def warm_start_items(settings: GymDemoSettings) -> int:
    """How many of the mixture's first items the warm start uses (GRPO's rows come after them)."""
    if not settings.sft_steps:
        return 0
    return settings.warm_start_pool if settings.warm_start == "own" else settings.sft_steps * settings.sft_batch_size


def warm_start_rows(settings: GymDemoSettings, held_out: list[dict]) -> list[dict]:
    """The gold warm start's rows (``sft_steps`` > 0): the mixture's first items, each gold answer in the tag."""
    rows = _mixture_rows(settings, held_out)[: warm_start_items(settings)]
    return [
        {"prompt": r["prompt"], "completion": [{"role": "assistant", "content": f"<answer>{r['answer']}</answer>"}]}
        for r in rows
    ]


def own_warm_start_rows(model, tokenizer, settings: GymDemoSettings, held_out: list[dict]) -> list[dict]:
    """The "own" warm start's rows: for each of the mixture's first ``warm_start_pool`` items, the first of
    ``warm_start_samples`` replies (temperature ``temperature``) that ends within ``max_completion_length`` tokens
    with a right last number (reasoning-gym's lenient score), with that number appended in the tag."""
    import torch

    rows = _mixture_rows(settings, held_out)[: warm_start_items(settings)]
    k = settings.warm_start_samples
    texts, truncated = sample_replies(
        model,
        tokenizer,
        rows,
        settings,
        generator=torch.Generator().manual_seed(settings.seed),
        num_generations=k,
        temperature=settings.temperature,
        do_sample=True,
    )
    kept = []
    for i, row in enumerate(rows):
        for j in range(i * k, (i + 1) * k):
            if truncated[j] or not _lenient(texts[j], row):
                continue
            reply = f"{texts[j].rstrip()}\n<answer>{tasks.last_number(texts[j])}</answer>"
            kept.append({"prompt": row["prompt"], "completion": [{"role": "assistant", "content": reply}]})
            break
    return kept[: settings.sft_steps * settings.sft_batch_size]


def sample_replies(model, tokenizer, rows: list[dict], settings: GymDemoSettings, **sampling) -> tuple[list, list]:
    """``model``'s decoded replies to ``rows``' chat prompts, at most ``max_completion_length`` tokens each, and
    whether each was cut there; ``sampling``: ``generate_completions``' other settings (``num_generations``,
    ``do_sample``, ...)."""
    prompts = [tokenizer(render_chat_prompt(tokenizer, r["prompt"]), add_special_tokens=False).input_ids for r in rows]
    out = generate_completions(
        model,
        prompts,
        max_new_tokens=settings.max_completion_length,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **sampling,
    )
    lengths = out.completion_mask.sum(1).tolist()
    texts = [tokenizer.decode(ids[:n], skip_special_tokens=True) for ids, n in zip(out.completion_ids, lengths)]
    return texts, out.is_truncated.tolist()


def _lenient(text: str, row: dict) -> bool:
    return tasks.reasoning_gym_lenient([text], [row["task"]], [row["entry"]], [row["task_config"]])[0] == 1.0


def _mixture_rows(settings: GymDemoSettings, held_out: list[dict]) -> list[dict]:
    size = settings.prompts_per_step * settings.grpo_steps + warm_start_items(settings)
    questions = {row["prompt"][-1]["content"] for row in held_out}
    items = tasks.mixture_items(demo_tasks(), 2 * size, settings.seed)  # twice: room for the questions left out
    return tasks.gym_rows(items, demo_tasks(), exclude=questions)


def warm_start(
    model, tokenizer, settings: GymDemoSettings, held_out: list[dict], output_dir: Path
) -> tuple[float, int]:
    """SFT of ``model`` in place on the warm start's rows (``warm_start``), saved in ``warm_start_rows.jsonl``, the
    tag rates of ``warm_start_tag_rate``'s checks in ``tag_rates.json``; returns its seconds (the sampling of "own"
    included) and steps."""
    import datasets  # ~1 s to import

    args = sft_warm_start(  # no warm-up: with one step, a warm-up would make it a step at rate 0
        settings, output_dir, save_strategy="no", logging_steps=5, max_length=None, warmup_steps=0
    )
    began = time.time()
    if settings.warm_start == "own":
        rows = datasets.Dataset.from_list(own_warm_start_rows(model, tokenizer, settings, held_out))
    else:
        rows = datasets.Dataset.from_list(warm_start_rows(settings, held_out))
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "warm_start_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows.to_list()))
    if not len(rows):  # "own": no sampled reply was right
        print(f"treadle demo: no warm start: none of the {settings.warm_start_pool} items got a right reply")
        return time.time() - began, 0
    stop = None
    if settings.warm_start_tag_rate:
        stop = StopAtTagRate(_mixture_rows(settings, held_out)[: warm_start_items(settings)], tokenizer, settings)
    callbacks = [stop] if stop else []
    trainer = SFTTrainer(model, args, train_dataset=rows, processing_class=tokenizer, callbacks=callbacks)
    trainer.train()
    if stop:
        (output_dir / "tag_rates.json").write_text(json.dumps(stop.history) + "\n")
    return time.time() - began, trainer.state.global_step


class StopAtTagRate(TrainerCallback):
    """Stops the warm start after the first step at which ``warm_start_tag_rate`` of the greedy replies to ``rows``'
    chat prompts carry the answer tag; ``history`` keeps (step, tag rate) of each check."""

    def __init__(self, rows: list[dict], tokenizer, settings: GymDemoSettings):
        self.rows, self.tokenizer, self.settings = rows, tokenizer, settings
        self.history: list[tuple[int, float]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        texts, _ = sample_replies(model, self.tokenizer, self.rows, self.settings, num_generations=1, do_sample=False)
        rate = sum(tasks.answer_tag(texts)) / len(texts)
        step = state.global_step
        self.history.append((step, rate))
        print(f"treadle demo: warm start step {step}: the tag on {rate:.0%} of greedy replies", flush=True)
        if rate >= self.settings.warm_start_tag_rate:
            control.should_training_stop = True


def gym_trainer(settings: GymDemoSettings, output_dir: Path, model, tokenizer, held_out) -> GRPOTrainer:
    """The demo's GRPOTrainer: ``model``, the mixture's training rows, the held-out rows, its rewards."""
    import datasets  # ~1 s to import

    rewards = [tasks.reasoning_gym_score, tasks.answer_format, tasks.reasoning_gym_lenient, tasks.answer_tag]
    args = demo_grpo_config(
        settings,
        output_dir,
        max_prompt_length=None,
        reward_weights=reward_weights(settings),
        eval_temperature=0.0,  # greedy
        per_device_eval_batch_size=50,
        beta=settings.beta,
    )
    return GRPOTrainer(
        model,
        reward_funcs=rewards,
        args=args,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(training_rows(settings, held_out)),
        eval_dataset=datasets.Dataset.from_list(held_out),
        compute_metrics=tasks.TaskMetrics(1, settings.max_completion_length, eos_ids(tokenizer.eos_token_id)),
    )


def reward_weights(settings: GymDemoSettings) -> list[float]:
    """The weights of the trainer's rewards (the strict score, the format, the lenient score, the tag rate): the
    trained score's (the strict score's ``strict_weight``, the lenient score's 1), the format's ``format_weight``; the
    tag rate is only recorded."""
    strict = settings.strict_weight if settings.trained_score in ("strict", "both") else 0.0
    lenient = 1.0 if settings.trained_score in ("lenient", "both") else 0.0
    return [strict, settings.format_weight, lenient, 0.0]


def policy(model, settings: GymDemoSettings):
    """``model`` itself, or (``lora_rank`` > 0) ``model`` with LoRA adapters of that rank on every linear layer."""
    if not settings.lora_rank:
        return model
    config = lora_config(
        {"r": settings.lora_rank, "lora_alpha": 2 * settings.lora_rank, "target_modules": "all-linear"}
    )
    return apply_peft(model, config, seed=settings.seed)


def stage(name: str, metrics: dict[str, float], step: int, seconds: float) -> dict:
    """One stage of results.json: per task its strict and lenient held-out scores, and their means over tasks."""
    per_task = {
        task.name: {score: metrics[f"eval_{task.name}/{score}"] for score in STAGE_SCORES} for task in demo_tasks()
    }
    mean = {score: sum(t[score] for t in per_task.values()) / len(per_task) for score in STAGE_SCORES}
    return {"stage": name, "step": step, "train_seconds": round(seconds, 1), "per_task": per_task, "mean": mean}


def run_gym_demo(settings: GymDemoSettings, output_dir: str | None = None) -> int:
    """GRPO of SmolLM2-135M-Instruct on the reasoning-gym mixture; print the per-task held-out table."""
    title = "treadle demo: GRPO of SmolLM2-135M-Instruct on 5 reasoning-gym tasks"
    out, start = start_demo("gym", output_dir, title, one_thread=False)  # its matmuls pay for every core
    load_before, given, settings = os.getloadavg(), settings, settings.applied()
    model, tokenizer = load_pretrained(smollm2.folder())
    model = policy(model, settings)
    held_out = heldout_rows(settings)
    trainer = gym_trainer(settings, out / "grpo", model, tokenizer, held_out)
    stages = [stage("pretrained", trainer.evaluate(), 0, 0.0)]
    if settings.sft_steps:  # the same model object: the trainer evaluates and trains it after the warm start
        seconds, steps = warm_start(model, tokenizer, settings, held_out, out / "sft")
        stages.append(stage("warm start", trainer.evaluate(), steps, seconds))
        if trainer.ref_model is not None:  # the KL term's reference: the warm-started policy, not the pretrained one
            trainer.ref_model = trainer.build_reference_model()
    began = time.time()
    trainer.train()
    seconds = time.time() - began  # training time, the held-out scores on the way included
    evals = [h for h in trainer.state.log_history if "eval_mean/strict" in h]
    stages.append(stage("after GRPO", evals[-1], trainer.state.global_step, seconds))
    trainer.save_model(str(out / "grpo" / "final"))
    curve = [{"step": 0, **stages[-2]["mean"]}] + [  # from the stage GRPO starts from
        {"step": h["step"], **{s: h[f"eval_mean/{s}"] for s in STAGE_SCORES}} for h in evals
    ]
    record = {
        "settings": dataclasses.asdict(given),
        "learning_rates": {"grpo": settings.learning_rate, "warm_start": settings.sft_learning_rate},
        "model": "SmolLM2-135M-Instruct" + (f" + LoRA rank {settings.lora_rank}" if settings.lora_rank else ""),
        "tasks": [{"name": t.name, "config": dict(t.config)} for t in demo_tasks()],
        "system_prompt": tasks.system_prompt_text(None),
        "heldout_items_per_task": settings.eval_size,
        "stages": stages,
        "curve": curve,
        "threads": int(os.environ.get("OMP_NUM_THREADS", 0)) or _torch_threads(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "total_seconds": round(time.time() - start, 1),
    }
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")
    print_plots(out / "grpo")
    print(stage_table(stages))
    print(f"treadle demo: done in {time.time() - start:.0f} s; results in {out / 'results.json'}")
    return 0


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def stage_table(stages: list[dict]) -> str:
    """Per task, the strict / lenient held-out scores of each stage, and the means."""
    names = list(stages[0]["per_task"]) + ["mean"]
    head = f"{'task':<18}" + "".join(f"{s['stage'] + ' strict/lenient':>30}" for s in stages)
    lines = [head, "-" * len(head)]
    for name in names:
        cells = []
        for s in stages:
            values = s["mean"] if name == "mean" else s["per_task"][name]
            pair = f"{values['strict']:6.1%} / {values['lenient']:6.1%}"
            cells.append(f"{pair:>30}")
        lines.append(f"{name:<18}" + "".join(cells))
    return "\n".join(lines)
