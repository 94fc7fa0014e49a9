"""``treadle eval MODEL``: score a model on reasoning-gym tasks (or a JSONL dataset with reward functions) and print
one table; ``DIR/eval.json`` holds the figures (docs/tasks.md)::

    treadle eval MODEL --tasks chain_sum,leg_counting --n 200 --seed S --system-prompt simple --max-new-tokens 96 \\
        --output-dir DIR [--num-samples k --temperature T] [--use-vllm]
    treadle eval MODEL --dataset rows.jsonl --reward-funcs package.module.function [...]

The items of a task are ``reasoning_gym.create_dataset(name, size=N, seed=S, **config)`` in order (``--tasks`` also
takes a YAML mapping ``{chain_sum: {max_terms: 2}}`` or a .yaml file holding one, for the config keywords). The
scoring is ``GRPOTrainer.evaluate`` itself, the code a GRPO run's evaluation runs: the own sampler (or vLLM),
reasoning-gym's verifiers as reward functions (``tasks.eval_rewards``) and ``tasks.TaskMetrics`` scoring each task
apart; greedy unless ``--num-samples k`` (then pass@k, at ``--temperature``, default 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml

from treadle import tasks
from treadle.cli.configfile import load as load_yaml
from treadle.cli.loading import load_any_model, load_dataset, load_reward_funcs
from treadle.errors import UserError
from treadle.text import eos_ids
from treadle.trainers.grpo import GRPOConfig, GRPOTrainer
from treadle.vision import tokenizer_of

__all__ = ["build_parser", "main"]

EVAL_FILE = "eval.json"


def build_parser(parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser = parser_class(
        prog="treadle eval",
        description="Score MODEL on reasoning-gym tasks (or a JSONL dataset with reward functions); print one "
        "table and write DIR/eval.json.",
    )
    parser.add_argument("model", help="toy:<size>, a model folder, Hub id, .gguf file, run folder, checkpoint or LoRA")
    parser.add_argument(
        "--tasks",
        help="reasoning-gym tasks: a,b or a YAML mapping {chain_sum: {max_terms: 2}}, or a .yaml file of one (or a "
        "training config: its dataset's tasks)",
    )
    parser.add_argument("--n", type=int, default=200, help="items per task (default 200)")
    parser.add_argument(
        "--seed",
        type=int,
        default=tasks.EVAL_SEED_OFFSET,
        help=f"the items' seed (default {tasks.EVAL_SEED_OFFSET}: held out from training seeds below it)",
    )
    parser.add_argument("--system-prompt", help="one of reasoning-gym's SYSTEM_PROMPTS by name, or a text")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--output-dir", help="where eval.json goes (default runs/eval-<time>)")
    parser.add_argument("--num-samples", type=int, default=1, help="samples per item: pass@k (default 1, greedy)")
    parser.add_argument("--temperature", type=float, help="0 decodes greedily (default: 0, or 1 with --num-samples)")
    parser.add_argument("--batch-size", type=int, default=50, help="prompts sampled at once")
    parser.add_argument("--use-vllm", "--use_vllm", action="store_true", help="sample with vLLM (docs/vllm.md)")
    parser.add_argument("--dataset", help="a .jsonl / .json / .csv / .parquet file of prompts, instead of --tasks")
    parser.add_argument("--reward-funcs", help="with --dataset: dotted paths or file.py:function, comma separated")
    return parser


def main(argv: list[str], parser_class=argparse.ArgumentParser) -> int:
    """``treadle eval``: load, score, print the table, write eval.json; returns the exit status."""
    args = build_parser(parser_class).parse_args(argv)
    check_args(args)
    try:
        dataset, rewards, described = eval_inputs(args)
        model, tokenizer = load_any_model(args.model)
    except (ValueError, ImportError) as error:  # a path, a name or a package that is missing
        raise UserError(str(error)) from None
    out = Path(args.output_dir or os.path.join("runs", time.strftime("eval-%Y%m%d-%H%M%S")))
    out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    scores = score(model, tokenizer, dataset, rewards, args, out)
    report = {
        "model": args.model,
        "tasks": described,
        "settings": {k: v for k, v in vars(args).items() if k not in ("model", "output_dir", "tasks")},
        "system_prompt": tasks.system_prompt_text(args.system_prompt) if args.dataset is None else None,
        "per_task": scores["per_task"],
        "mean": scores["mean"],
        "seconds": round(time.time() - began, 1),
    }
    (out / EVAL_FILE).write_text(json.dumps(report, indent=2) + "\n")
    print(table(scores, args.num_samples))
    print(f"treadle: eval of {args.model} in {report['seconds']:.0f} s; figures in {out / EVAL_FILE}")
    return 0


def check_args(args: argparse.Namespace) -> None:
    if (args.tasks is None) == (args.dataset is None):
        raise UserError("treadle eval takes --tasks (reasoning-gym) or --dataset FILE with --reward-funcs, not both")
    if args.dataset is not None and not args.reward_funcs:
        raise UserError("--dataset needs --reward-funcs (dotted paths or file.py:function) to score its completions")
    for name in ("n", "num_samples", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.temperature is None:
        args.temperature = 1.0 if args.num_samples > 1 else 0.0
    if args.num_samples > 1 and args.temperature == 0:
        raise UserError(
            "--num-samples > 1 with --temperature 0 draws the same greedy reply k times; set --temperature"
        )


def eval_inputs(args: argparse.Namespace):
    """The evaluation rows, their reward functions and what eval.json says of the tasks."""
    if args.dataset is not None:
        dataset = load_dataset(args.dataset, kind="rl", split="test")
        return dataset, load_reward_funcs(args.reward_funcs.split(",")), {"dataset": args.dataset}
    import datasets  # ~1 s to import: here, after the flags are checked

    chosen = tasks.gym_tasks(task_spec(args.tasks))
    rows = [
        row
        for task in chosen
        for row in tasks.gym_rows(tasks.task_items(task, args.n, args.seed), [task], args.system_prompt)
    ]
    described = [{"name": t.name, "config": dict(t.config), "seed": args.seed, "size": args.n} for t in chosen]
    return datasets.Dataset.from_list(rows), tasks.eval_rewards(), described


def task_spec(text: str):
    """``--tasks``: a .yaml file (a mapping of tasks to configs, or a training config: its dataset's tasks) or inline
    YAML, else comma-separated names."""
    if text.endswith((".yaml", ".yml")) or text.lstrip().startswith("{"):
        if text.endswith((".yaml", ".yml")):
            if not os.path.isfile(text):
                raise ValueError(f"--tasks {text}: file not found")
            text = Path(text).read_text(encoding="utf-8")
        try:
            spec = load_yaml(text)
        except yaml.YAMLError as error:
            raise ValueError(f"--tasks is not valid YAML: {getattr(error, 'problem', None) or error}") from None
        spec = spec.get("dataset", spec) if isinstance(spec, dict) else spec  # a training config's own tasks
        spec = spec.get("reasoning_gym", spec) if isinstance(spec, dict) else spec
        spec = spec.get("tasks", spec) if isinstance(spec, dict) else spec
        if not isinstance(spec, dict):
            raise ValueError(
                "--tasks YAML must be a mapping of task names to configs, e.g. {chain_sum: {max_terms: 2}}"
            )
        return spec
    return text


def score(model, tokenizer, dataset, rewards, args, out: Path) -> dict:
    """``GRPOTrainer.evaluate`` on ``dataset``: ``{"per_task": {task: {figure: value}}, "mean": {...}}``."""
    config = GRPOConfig(
        output_dir=str(out),
        seed=args.seed,
        report_to=[],
        per_device_eval_batch_size=args.batch_size,
        num_generations_eval=args.num_samples,
        eval_temperature=args.temperature,
        eval_pass_at_k=[1, args.num_samples] if args.num_samples > 1 else [1],
        max_completion_length=args.max_new_tokens,
        max_prompt_length=None,
        reward_weights=[1.0] + [0.0] * (len(rewards) - 1),  # the first function is the evaluation's reward
        use_vllm=args.use_vllm,
    )
    eos = eos_ids(tokenizer_of(tokenizer).eos_token_id)
    trainer = GRPOTrainer(
        model,
        args=config,
        reward_funcs=rewards,
        processing_class=tokenizer,
        compute_metrics=tasks.TaskMetrics(args.num_samples, args.max_new_tokens, eos),
    )
    try:
        metrics = trainer.evaluate(dataset)
    finally:
        trainer.close()
    return per_task(metrics)


def per_task(metrics: dict[str, float], prefix: str = "eval_") -> dict:
    """``TaskMetrics``' figures of an evaluation's metrics, by task: ``{"per_task": {...}, "mean": {...}}``."""
    grouped: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if (
            key.startswith(prefix)
            and "/" in key
            and not key.startswith((prefix + "rewards/", prefix + "completions/"))
        ):
            task, _, figure = key.removeprefix(prefix).partition("/")
            grouped.setdefault(task, {})[figure] = value
    mean = grouped.pop("mean", {})
    return {"per_task": grouped, "mean": mean}


def table(scores: dict, num_samples: int) -> str:
    """One table: a row per task and the mean, a column per figure (scores as percentages)."""
    rows = scores["per_task"]
    figures = [f for f in next(iter(rows.values()), {}) if f not in ("items", "mean_length", "truncated")]
    figures += ["mean_length", "truncated"]
    width = max([len("task")] + [len(name) for name in rows])
    head = f"{'task':<{width}}  {'items':>5}  " + "  ".join(f"{f.replace('_', ' '):>11}" for f in figures)
    lines = [head, "-" * len(head)]
    for name, values in [*rows.items(), ("mean", scores["mean"])]:
        items = f"{values['items']:>5.0f}" if "items" in values else " " * 5
        cells = [_cell(f, values.get(f)) for f in figures]
        lines.append(f"{name:<{width}}  {items}  " + "  ".join(f"{c:>11}" for c in cells))
    if num_samples > 1:
        lines.append(f"{num_samples} samples per item; scores are means over samples, pass@{num_samples} per item")
    return "\n".join(lines)


def _cell(figure: str, value) -> str:
    if value is None:
        return ""
    return f"{value:.1f}" if figure == "mean_length" else f"{100 * value:.1f}%"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
