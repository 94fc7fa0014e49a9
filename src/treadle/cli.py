"""The ``treadle`` command (also ``python -m treadle``)::

    treadle demo [--output-dir DIR] [--seed N] [--sft-steps N] [--grpo-steps N] [--eval-size N]
    treadle train CONFIG.yaml [--resume] [--key value ...]
    treadle report RUN_DIR [RUN_DIR ...] [--output-dir DIR]

``demo`` (treadle.demo) fine-tunes the tiny toy model on 2-digit addition (SFT), measures exact-match accuracy
on held-out problems, improves it with GRPO and measures again. ``train`` runs one trainer from a YAML file:
the keys ``trainer``, ``model``, ``dataset``, ``eval_dataset`` and ``reward_funcs`` say what to train, every
other key is a field of the trainer's config (read by ``TrainingArguments.from_mapping``; ``--key value``
overrides one). ``report`` redraws the plots of a run folder, writes its report.html and prints a summary; given
several folders it also overlays them (plots and report.html in ``--output-dir``). A mistake a user can make (a
missing file, an unknown key ...) is one line on stderr and exit status 2; anything else is a bug and shows its
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any

# trainer name -> (module, trainer class, config class, toy dataset kind)
TRAINERS = {
    "sft": ("treadle.trainers.sft", "SFTTrainer", "SFTConfig", "sft"),
    "dpo": ("treadle.trainers.dpo", "DPOTrainer", "DPOConfig", "preference"),
    "grpo": ("treadle.trainers.grpo", "GRPOTrainer", "GRPOConfig", "rl"),
}
RUN_KEYS = ("trainer", "model", "dataset", "eval_dataset", "reward_funcs")  # the keys that are not config fields


class UserError(Exception):
    """A mistake in the command line, a config or a path: reported as one line, exit status 2."""


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        raise UserError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="treadle", description="Train language models: SFT, DPO and GRPO on one short loop.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    # the demo's numbers have no default here: a flag left out is absent from args, so DemoSettings' own default
    # applies and treadle.demo is imported only when the demo runs
    demo = commands.add_parser("demo", argument_default=argparse.SUPPRESS,
                               help="SFT then GRPO the tiny model on addition; compare held-out accuracy")
    demo.add_argument("--output-dir", default=None, help="run folder (default: runs/demo-<time>)")
    demo.add_argument("--seed", type=int, help="seed of model, data and sampling")
    demo.add_argument("--sft-steps", type=int, help="at most this many SFT steps")
    demo.add_argument("--grpo-steps", type=int, help="GRPO optimizer steps")
    demo.add_argument("--eval-size", type=int, help="held-out problems scored")
    train = commands.add_parser("train", allow_abbrev=False, help="train from a YAML config",
                                description="Train from CONFIG.yaml; --key value overrides one key of it.")
    train.add_argument("config", help="YAML file: trainer, model, dataset, [eval_dataset, reward_funcs], config keys")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in output_dir")
    report = commands.add_parser("report", help="redraw a run's plots, write its report.html, print its summary; "
                                                "several runs are also overlaid")
    report.add_argument("run_dir", nargs="+", help="a run's output_dir (holding metrics.jsonl), or a folder of runs")
    report.add_argument("--output-dir", help="where the overlay of several runs goes (default: <their folder>/compare)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command in ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "train":
            raise UserError(f"unrecognized arguments: {' '.join(extra)} (see `treadle {args.command} --help`)")
        if args.command == "demo":
            return run_demo(args)
        if args.command == "train":
            return run_train(args.config, extra, resume=args.resume)
        return run_report(args.run_dir, args.output_dir)
    except UserError as error:
        print(f"treadle: error: {error}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------------------
# treadle train
# ---------------------------------------------------------------------------------------------------------
def run_train(config_path: str, overrides: list[str], *, resume: bool = False) -> int:
    config = load_config(config_path, overrides)
    checkpoint = None
    if resume:  # before building anything: a run with nothing to resume fails at once
        from treadle.checkpoint import CheckpointError, resolve

        try:
            checkpoint = resolve(True, str(config.get("output_dir") or default_output_dir(config)))
        except CheckpointError as error:
            raise UserError(str(error)) from None
    trainer = build_trainer(config, base_dir=Path(config_path).parent)
    trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()
    output_dir = trainer.args.output_dir
    if trainer.state.is_world_process_zero:  # under torchrun, one report, not one per rank
        from treadle.report import print_plots

        print(f"treadle: model saved in {output_dir}")
        print_plots(output_dir)
    return 0


def load_config(path: str, overrides: list[str] = ()) -> dict[str, Any]:
    """The YAML mapping in ``path`` with ``--key value`` overrides applied (values read as YAML)."""
    import yaml

    if not os.path.isfile(path):
        raise UserError(f"config file {path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.load(f, Loader=yaml_loader())
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise UserError(f"{path} is not valid YAML{line}: {getattr(error, 'problem', None) or error}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a mapping of keys to values (trainer: sft, model: ..., dataset: ...), "
                        f"got {type(config).__name__}")
    config.update(parse_overrides(overrides))
    return config


def yaml_loader():
    """PyYAML's safe loader with YAML 1.2 scalars: only true/false are booleans (``eval_strategy: no`` stays the
    string "no"), and ``1e-3`` is a float (YAML 1.1 wants ``1.0e-3``)."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:bool",
                                                                            "tag:yaml.org,2002:float")]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$"),
        list("-+0123456789."))
    return Loader


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``['--lr', '1e-3', '--max_steps=5']`` -> ``{'lr': 0.001, 'max_steps': 5}``; dashes in keys become
    underscores; values are parsed as YAML (numbers, booleans, lists), else kept as strings."""
    import yaml

    out, i = {}, 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--") or item == "--":
            raise UserError(f"unexpected argument {item!r}: overrides are written --key value")
        key, eq, value = item[2:].partition("=")
        if not eq:
            if i + 1 >= len(items) or items[i + 1].startswith("--"):
                raise UserError(f"--{key} needs a value (--{key} VALUE)")
            i, value = i + 1, items[i + 1]
        try:
            out[key.replace("-", "_")] = yaml.load(value, Loader=yaml_loader())
        except yaml.YAMLError:
            out[key.replace("-", "_")] = value
        i += 1
    return out


def build_trainer(config: dict[str, Any], base_dir: Path = Path(".")):
    """The trainer a config describes: the model, tokenizer, datasets and config class it names."""
    name = config.get("trainer")
    if name not in TRAINERS:
        raise UserError(f"unknown trainer {name!r}; set trainer: to one of {sorted(TRAINERS)}"
                        if name is not None else f"the config has no trainer: key; set it to one of {sorted(TRAINERS)}")
    for key in ("model", "dataset"):
        if not config.get(key):
            raise UserError(f"the config has no {key}: key (see examples/{name}.yaml)")
    module_name, trainer_class, config_class, kind = TRAINERS[name]
    module = importlib.import_module(module_name)
    config_cls = getattr(module, config_class)
    fields = {k: v for k, v in config.items() if k not in RUN_KEYS}
    fields.setdefault("output_dir", default_output_dir(config))
    try:
        args = config_cls.from_mapping(fields, other_keys=RUN_KEYS, context=f"trainer {name}")
    except (ValueError, TypeError) as error:
        raise UserError(f"{config_class}: {error}") from None
    if name != "grpo" and config.get("reward_funcs"):
        raise UserError(f"reward_funcs is a GRPO key; the {name} trainer takes no reward functions")
    try:
        kwargs = load_run_objects(config, kind=kind, seed=args.seed, base_dir=base_dir)
    except ValueError as error:  # a path, a row or a name that is wrong
        raise UserError(str(error)) from None
    try:
        return getattr(module, trainer_class)(args=args, **kwargs)
    except (ValueError, TypeError) as error:
        raise UserError(f"{trainer_class}: {error}") from None


def load_run_objects(config: dict[str, Any], *, kind: str, seed: int, base_dir: Path) -> dict[str, Any]:
    """The trainer's keyword arguments that a config names: reward functions (GRPO), datasets, model and
    tokenizer -- the cheap ones first, so that a typo in a path fails before a model is loaded."""
    from treadle.data import load_dataset
    from treadle.models import load_model
    from treadle.rewards import load_reward_funcs

    kwargs: dict[str, Any] = {}
    if config.get("trainer") == "grpo":
        kwargs["reward_funcs"] = load_reward_funcs(config.get("reward_funcs"), base_dir)
    kwargs["train_dataset"] = load_dataset(str(config["dataset"]), kind=kind, split="train", base_dir=base_dir)
    evaluation = config.get("eval_dataset")
    if evaluation:
        kwargs["eval_dataset"] = load_dataset(str(evaluation), kind=kind, split="test", base_dir=base_dir)
    kwargs["model"], kwargs["processing_class"] = load_model(str(config["model"]), seed=seed)
    return kwargs


def default_output_dir(config: dict[str, Any]) -> str:
    """Where a run goes when its config names no output_dir: runs/<trainer>."""
    return os.path.join("runs", str(config.get("trainer")))


# ---------------------------------------------------------------------------------------------------------
# treadle report
# ---------------------------------------------------------------------------------------------------------
def run_report(run_dirs: list[str], output_dir: str | None = None) -> int:
    """Plots, report.html and a summary for each run folder (or each run folder directly inside one: a demo
    folder); with several folders, their overlay too."""
    from treadle import report

    runs = []
    for run_dir in run_dirs:
        root = Path(run_dir)
        if not root.exists():
            raise UserError(f"run folder {run_dir} not found")
        found = [root] if (root / report.METRICS_FILE).is_file() else sorted(
            p for p in root.iterdir() if (p / report.METRICS_FILE).is_file())
        if not found:
            raise UserError(f"{run_dir} holds no {report.METRICS_FILE} (nor do its subfolders): is it the output_dir "
                            f"of a treadle run?")
        runs += found
    try:
        for run in runs:
            print(report.summarize(run))
            print(f"treadle: report in {report.write_html(run, plots=report.print_plots(run))}")
        if len(run_dirs) > 1:
            out = Path(output_dir or Path(os.path.commonpath([str(r.resolve()) for r in runs])) / "compare")
            print(f"treadle: {len(runs)} runs overlaid in {report.write_overlay(runs, out)}")
    except ValueError as error:
        raise UserError(str(error)) from None
    return 0


# ---------------------------------------------------------------------------------------------------------
# treadle demo
# ---------------------------------------------------------------------------------------------------------
def run_demo(args: argparse.Namespace) -> int:
    """``treadle demo`` with the flags in ``args``; the demo itself is treadle.demo."""
    from treadle import demo

    given = {name: getattr(args, name) for name in ("seed", "sft_steps", "grpo_steps", "eval_size") if name in args}
    try:
        settings = demo.DemoSettings(**given)
    except ValueError as error:
        raise UserError(str(error)) from None
    return demo.run_demo(settings, args.output_dir)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
