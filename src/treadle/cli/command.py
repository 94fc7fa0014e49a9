"""The ``treadle`` command (also ``python -m treadle``)::

    treadle demo [--task addition|tools|distill|count|gym] [--model toy|smollm2|gemma3] [--output-dir DIR]
                 [--seed N] [--sft-steps N] [--grpo-steps N] [--eval-size N] [--lora-rank N] [--teacher-dir DIR]
                 [--max_staleness N]
    treadle train CONFIG.yaml [--resume [CHECKPOINT | auto]] [--key value ...]
    treadle report RUN_DIR [RUN_DIR ...] [--output-dir DIR]
    treadle merge RUN_DIR [--output-dir DIR [--overwrite-output-dir]]
    treadle eval MODEL --tasks a,b [--n N --seed S ...] | --dataset FILE --reward-funcs F   (treadle.cli.evaluate)
    treadle vllm-serve MODEL [--host H] [--port P] ...   (vLLM for GRPO's vllm_mode: server; treadle.cli.vllm_serve)
    (any command: --debug, or TREADLE_DEBUG=1, shows the traceback of an error)

``demo`` (treadle.demos.addition): SFT then GRPO of a toy model, scored on held-out problems; ``--model smollm2``
(treadle.demos.real): GRPO of the real SmolLM2-135M-Instruct on addition chats; ``--model gemma3``
(treadle.demos.gemma): GRPO of the base model Gemma 3 270M on two-shot addition. ``train`` runs one
trainer: the keys ``trainer``, ``model``, ``dataset``, ``eval_dataset``, ``reward_funcs`` and ``peft`` (a LoRA mapping)
say what to train, every other key is a field of the trainer's config (read by ``TrainingArguments.from_mapping``;
``--key value`` overrides one). ``report`` redraws the plots of a run folder, writes its report.html and prints a
summary; given several folders it also overlays them (plots and report.html in ``--output-dir``). ``merge`` writes a
LoRA run's adapter merged into its base model. A mistake a user can make (a missing file, an unknown key, a run folder
in use ... see ``treadle.errors.is_user_error``) is one line on stderr and exit status 2; anything else is a bug and
shows its traceback. A run stopped by SIGTERM or Ctrl-C saves a checkpoint, prints the command that resumes it and
exits 143 or 130 (docs/runs.md).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import treadle.cli.configfile as configfile
import treadle.cli.report as report
from treadle.allocator import keep_freed_memory
from treadle.cli.registry import trainer_kinds
from treadle.errors import Interrupted, Preempted, UserError, is_user_error, one_line
from treadle.record import runfiles
from treadle.record.commands import check_merge_output, claim_demo_folder
from treadle.record.disk import disk_errors
from treadle.record.plots import print_plots
from treadle.record.runs import check_run_folder

RUN_KEYS = ("trainer", "model", "dataset", "eval_dataset", "reward_funcs", "peft", "teacher")  # not config fields


# ---------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        raise UserError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    """The ``treadle`` parser: ``--debug`` and one subcommand (demo, train, report, merge, eval, vllm-serve)."""
    parser = _Parser(
        prog="treadle", description="Train language models: SFT, DPO, reward models and GRPO on one loop."
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (or TREADLE_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_demo_command(commands)
    _add_train_command(commands)
    _add_report_command(commands)
    _add_merge_command(commands)
    # their flags are treadle.cli.evaluate's and treadle.cli.vllm_serve's, parsed there: argparse only names them
    commands.add_parser("eval", add_help=False, help="score a model on reasoning-gym tasks or a dataset with rewards")
    commands.add_parser("vllm-serve", add_help=False, help="serve a model with vLLM to GRPO (vllm_mode: server)")
    return parser


def _add_demo_command(commands) -> None:
    # the demo's numbers have no default here: a flag left out is absent from args, so DemoSettings' own default
    # applies and treadle.demos.addition is imported only when the demo runs
    demo = commands.add_parser(
        "demo",
        argument_default=argparse.SUPPRESS,
        help="SFT then GRPO the tiny model on addition; compare held-out accuracy",
    )
    demo.add_argument("--output-dir", default=None, help="run folder (default: runs/demo-<time>)")
    demo.add_argument("--seed", type=int, help="seed of model, data and sampling")
    demo.add_argument("--sft-steps", type=int, help="at most this many SFT steps (tools: per attempt)")
    demo.add_argument("--grpo-steps", type=int, help="GRPO optimizer steps")
    demo.add_argument("--eval-size", type=int, help="held-out problems scored")
    demo.add_argument("--lora-rank", type=int, help="gym: a LoRA policy of this rank (default: every weight trains)")
    demo.add_argument(
        "--teacher-dir", help="distill: the teacher's folder, reused when it holds one (default: RUN_FOLDER/teacher)"
    )
    demo.add_argument("--use-vllm", "--use_vllm", action="store_true", help="addition: GRPO samples with vLLM")
    demo.add_argument(
        "--max-staleness",
        "--max_staleness",
        type=int,
        help="addition: GRPO samples up to N steps ahead (docs/async.md)",
    )
    demo.add_argument(
        "--task",
        choices=("addition", "tools", "distill", "count", "gym"),
        help="addition (default); tools: "
        "3-digit addition with a calculator tool (multi-turn GRPO); distill: distillation vs GRPO vs SFT; "
        "count: a tiny VLM counts shapes; gym (with --model smollm2): 5 reasoning-gym tasks",
    )
    demo.add_argument(
        "--model",
        choices=("toy", "smollm2", "gemma3"),
        help="toy (default): a tiny model trained from scratch; smollm2: GRPO of the real SmolLM2-135M-Instruct "
        "on addition chats (about 15 minutes on 2 cores); gemma3: GRPO of the base model Gemma 3 270M on two-shot "
        "addition",
    )


def _add_train_command(commands) -> None:
    train = commands.add_parser(
        "train",
        allow_abbrev=False,
        help="train from a YAML config",
        description="Train from CONFIG.yaml; --key value overrides one key of it.",
    )
    train.add_argument("config", help="YAML file: trainer, model, dataset, [eval_dataset, reward_funcs], config keys")
    train.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="CHECKPOINT",
        help="the newest checkpoint in output_dir, or CHECKPOINT; auto: the newest or a fresh start",
    )


def _add_report_command(commands) -> None:
    report = commands.add_parser(
        "report", help="redraw a run's plots, write its report.html, print its summary; several runs are also overlaid"
    )
    report.add_argument("run_dir", nargs="+", help="a run's output_dir (holding metrics.jsonl), or a folder of runs")
    report.add_argument(
        "--output-dir", help="where the overlay of several runs goes (default: <their folder>/compare)"
    )


def _add_merge_command(commands) -> None:
    merge = commands.add_parser("merge", help="merge a LoRA run's adapter into its base model (a transformers folder)")
    merge.add_argument("run_dir", help="a folder holding adapter_config.json (a LoRA run's output_dir)")
    merge.add_argument("--output-dir", default=None, help="where the merged model goes (default: RUN_DIR/merged)")
    merge.add_argument(
        "--overwrite-output-dir",
        "--overwrite_output_dir",
        action="store_true",
        help="replace the run or model that --output-dir holds (refused without it)",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the command in ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    debug = os.environ.get("TREADLE_DEBUG", "0") not in ("", "0")
    try:
        args, extra = parser.parse_known_args(argv)
        debug = debug or args.debug
        if args.command == "vllm-serve":
            import treadle.cli.vllm_serve as vllm_serve  # heavy: torch, and vLLM once it starts

            return vllm_serve.main(extra, parser_class=_Parser)
        if args.command == "eval":
            import treadle.cli.evaluate as evaluate  # heavy: torch, transformers

            return evaluate.main(extra, parser_class=_Parser)
        if extra and args.command != "train":
            raise UserError(f"unrecognized arguments: {' '.join(extra)} (see `treadle {args.command} --help`)")
        if args.command == "demo":
            return run_demo(args)
        if args.command == "train":
            return run_train(args.config, extra, resume=args.resume)
        if args.command == "merge":
            return run_merge(args.run_dir, args.output_dir, overwrite=args.overwrite_output_dir)
        return run_report(args.run_dir, args.output_dir)
    except Exception as error:
        if debug or not is_user_error(error):
            raise
        print(one_line(error), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training began, or a second Ctrl-C: no checkpoint of the step in progress
        print("treadle: interrupted; nothing was saved since the last checkpoint", file=sys.stderr)
        return 130


# ---------------------------------------------------------------------------------------------------------
# treadle train
# ---------------------------------------------------------------------------------------------------------
def run_train(config_path: str, overrides: list[str], *, resume: bool | str | None = None) -> int:
    """Train the config at ``config_path``; the run folder is checked before anything is loaded. The command owns its
    process: glibc keeps freed memory from here on (treadle.allocator), unless the config says
    ``keep_freed_memory: false``."""
    config = load_config(config_path, overrides)
    if config.get("keep_freed_memory", True) is not False:
        keep_freed_memory()
    output_dir = str(config.get("output_dir") or default_output_dir(config))
    from treadle import distributed, resume as resuming  # heavy: torch

    # before building anything: a run with nothing to resume fails at once
    checkpoint = resuming.resolve(resume, output_dir, config.get("ignore_checkpoint_fingerprints") is True)
    model, overwrite = str(config.get("model") or ""), config.get("overwrite_output_dir") is True
    auto = resume == resuming.AUTO and checkpoint is None  # a fresh start in place of an attempt that saved none
    if distributed.launched("RANK") == 0:  # under torchrun, rank 0 owns the folder (and soon holds its lock)
        check_run_folder(
            output_dir,
            resume=checkpoint is not None,
            overwrite=overwrite,
            model_dir=None if model.startswith("toy:") else model,
            auto=auto,
        )
    status = train_and_save(
        build_trainer(config, base_dir=Path(config_path).parent),
        resuming.AUTO if auto else checkpoint,
        resume_command=["treadle", "train", config_path, *overrides, "--resume"],
    )
    distributed.finish()  # under torchrun, after the trainer is gone: a normal exit leaves the process group
    return status


def train_and_save(trainer, checkpoint: str | bool | None, resume_command: list[str]) -> int:
    """Train (from ``checkpoint``), save the model and print the report; the exit status. The whole run, final
    save included, is under the trainer's signal guard: a signal during training stops it at the next step with
    a checkpoint (exit 143 or 130, ``resume_command`` printed); one after the last step lets the final save
    complete, then exits 143 or 130 with the model whole on disk."""
    output_dir, preemption = trainer.args.output_dir, trainer.preemption
    with preemption.guard():
        try:
            trainer.train(resume_from_checkpoint=checkpoint)
        except (Preempted, Interrupted) as stop:  # its checkpoint is written: say how to go on
            print(f"treadle: resume with: {shlex.join(resume_command)}", file=sys.stderr)
            return stop.exit_status
        # a full or read-only disk at the final save: one line, as during training; a signal waits for the save
        with preemption.guard(hold=True), disk_errors(output_dir, final_save=True):
            trainer.save_model()
        main_process = trainer.state.is_world_process_zero  # under torchrun, one report, not one per rank
        if main_process:
            print(f"treadle: model saved in {output_dir}")
        if main_process and preemption.signal is None:
            print_plots(output_dir)
    if preemption.signal is not None:
        print(
            f"treadle: stopped by {signal.Signals(preemption.signal).name} after the last step "
            f"({trainer.state.global_step}): the final model is saved whole in {output_dir}; draw its plots "
            f"with: treadle report {output_dir}",
            file=sys.stderr,
        )
        return 128 + preemption.signal
    return 0


def load_config(path: str, overrides: list[str] = ()) -> dict[str, Any]:
    """The YAML mapping in ``path`` with ``--key value`` overrides applied (values read as YAML)."""
    import yaml

    if not os.path.isfile(path):
        raise UserError(f"config file {path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            config = configfile.load(f)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise UserError(f"{path} is not valid YAML{line}: {getattr(error, 'problem', None) or error}") from None
    if not isinstance(config, dict):
        raise UserError(
            f"{path} must hold a mapping of keys to values (trainer: sft, model: ..., dataset: ...), "
            f"got {type(config).__name__}"
        )
    config.update(parse_overrides(overrides))
    return config


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
            out[key.replace("-", "_")] = configfile.load(value)
        except yaml.YAMLError:
            out[key.replace("-", "_")] = value
        i += 1
    return out


def build_trainer(config: dict[str, Any], base_dir: Path = Path(".")):
    """The trainer a config describes: the model, tokenizer, datasets and config class it names."""
    from treadle.cli.loading import load_run_objects  # heavy, as above
    from treadle.data import require_eval_dataset  # heavy: torch
    from treadle.trackers import preflight  # heavy, as above

    name, kinds = config.get("trainer"), trainer_kinds()
    if name not in kinds:
        raise UserError(
            f"unknown trainer {name!r}; set trainer: to one of {sorted(kinds)}"
            if name is not None
            else f"the config has no trainer: key; set it to one of {sorted(kinds)}"
        )
    for key in ("model", "dataset"):
        if not config.get(key):
            raise UserError(f"the config has no {key}: key (see examples/{name}.yaml)")
    kind = kinds[name]
    config_cls, trainer_class = kind.trainer.config_class, kind.trainer.__name__
    fields = {k: v for k, v in config.items() if k not in RUN_KEYS}
    fields.setdefault("output_dir", default_output_dir(config))
    unknown = next((key for key in fields if key not in config_cls.field_names()), None)
    owners = sorted(other for other, k in kinds.items() if unknown in k.trainer.config_class.field_names())
    if owners:  # another trainer's setting (GRPO's epsilon on distillation): say whose, not a far-off near name
        raise UserError(
            f"{config_cls.__name__}: unknown key {unknown!r} for trainer {name}; it is a key of trainer "
            f"{', '.join(owners)}"
        )
    try:
        args = config_cls.from_mapping(fields, other_keys=RUN_KEYS, context=f"trainer {name}")
    except (ValueError, TypeError) as error:
        raise UserError(f"{config_cls.__name__}: {error}") from None
    require_eval_dataset(args, config.get("eval_dataset") or None)  # before the datasets and the model load
    preflight(args.report_to)  # a tracker that cannot start fails before the model loads, too
    if not kind.takes_reward_funcs and config.get("reward_funcs"):
        raise UserError(f"reward_funcs is a GRPO key; the {name} trainer takes no reward functions")
    try:
        kwargs = load_run_objects(config, kind=kind, args=args, base_dir=base_dir)
    except (ValueError, ImportError) as error:  # a path, a row or a name that is wrong; peft not installed
        raise UserError(str(error)) from None
    try:
        return kind.trainer(args=args, **kwargs)
    except ValueError as error:  # the trainers' checks of their inputs; any other exception is a bug: traceback
        raise UserError(f"{trainer_class}: {error}") from None


def default_output_dir(config: dict[str, Any]) -> str:
    """Where a run goes when its config names no output_dir: runs/<trainer>."""
    return os.path.join("runs", str(config.get("trainer")))


# ---------------------------------------------------------------------------------------------------------
# treadle report
# ---------------------------------------------------------------------------------------------------------
def run_report(run_dirs: list[str], output_dir: str | None = None) -> int:
    """Plots, report.html and a summary for each run folder (or each run folder directly inside one: a demo
    folder); with several folders, their overlay too."""
    runs = []
    for run_dir in run_dirs:
        root = Path(run_dir)
        if not root.exists():
            raise UserError(f"run folder {run_dir} not found")
        if root.is_file():
            if root.name != runfiles.METRICS_FILE:
                raise UserError(
                    f"{run_dir} is a file; treadle report takes a run folder (an output_dir holding "
                    f"{runfiles.METRICS_FILE}), e.g. treadle report {root.parent}"
                )
            root = root.parent
        found = (
            [root]
            if (root / runfiles.METRICS_FILE).is_file()
            else sorted(p for p in root.iterdir() if (p / runfiles.METRICS_FILE).is_file())
        )
        if not found:
            raise UserError(
                f"{run_dir} holds no {runfiles.METRICS_FILE} (nor do its subfolders): is it the output_dir "
                f"of a treadle run?"
            )
        runs += found
    try:
        for run in runs:
            print(report.summarize(run))
            print(f"treadle: report in {report.write_html(run, plots=print_plots(run))}")
        if len(run_dirs) > 1:
            out = Path(output_dir or Path(os.path.commonpath([str(r.resolve()) for r in runs])) / "compare")
            print(f"treadle: {len(runs)} runs overlaid in {report.write_overlay(runs, out)}")
    except ValueError as error:
        raise UserError(str(error)) from None
    return 0


def run_merge(run_dir: str, output_dir: str | None, *, overwrite: bool = False) -> int:
    """``treadle merge``: an ``output_dir`` that is a file or holds another run or model is refused before anything
    loads (``overwrite``: replace it); the default, RUN_DIR/merged, is the run's own merge, replaced each time."""
    if output_dir is not None:
        check_merge_output(output_dir, overwrite=overwrite)
    from treadle.cli.loading import merge_adapter_folder  # heavy: torch, transformers, peft

    try:
        print(f"treadle: merged model saved in {merge_adapter_folder(run_dir, output_dir)}")
    except (ValueError, ImportError) as error:
        raise UserError(str(error)) from None
    return 0


# ---------------------------------------------------------------------------------------------------------
# treadle demo
# ---------------------------------------------------------------------------------------------------------
def run_demo(args: argparse.Namespace) -> int:
    """``treadle demo`` with the flags in ``args``; the demo itself is treadle.demos.addition. The command owns its
    process: glibc keeps freed memory (treadle.allocator)."""
    keep_freed_memory()
    from treadle.demos import addition as demo  # heavy: torch, transformers

    names = ("seed", "sft_steps", "grpo_steps", "eval_size", "lora_rank", "teacher_dir", "use_vllm", "max_staleness")
    given = {name: getattr(args, name) for name in names if name in args}
    settings_class, run = demo.DemoSettings, demo.run_demo
    task = getattr(args, "task", None) or "addition"
    if task == "tools":
        from treadle.demos import tools as demo_tools  # heavy, as above

        settings_class, run = demo_tools.ToolsDemoSettings, demo_tools.run_tools_demo
    elif task == "distill":
        from treadle.demos import distill as demo_distill  # heavy, as above

        settings_class, run = demo_distill.DistillDemoSettings, demo_distill.run_distill_demo
    elif task == "count":
        from treadle.demos import count as demo_count  # heavy, as above

        settings_class, run = demo_count.CountDemoSettings, demo_count.run_count_demo
    where = f"--task {task}"
    model = getattr(args, "model", None) or "toy"
    if model != "toy":
        settings_class, run, where = _real_model_demo(model, task)
    elif task == "gym":
        raise UserError("--task gym trains the real model: add --model smollm2")
    for name in given:  # e.g. --sft-steps: the smollm2 demo has no SFT stage
        if not hasattr(settings_class, name):
            purpose = "is for the addition demo's GRPO" if name in ("use_vllm", "max_staleness") else "has no use"
            raise UserError(f"--{name.replace('_', '-')} {purpose} in {where}; leave it out")
    seed = given.get("seed", 0)
    if not 0 <= seed < 2**32:
        raise UserError(f"--seed {seed} is out of range: a seed is a whole number from 0 to {2**32 - 1}")
    try:
        settings = settings_class(**given)
    except ValueError as error:
        raise UserError(str(error)) from None
    name = where.removeprefix("--model ") if where.startswith("--model") else "" if task == "addition" else task
    folder = demo.demo_folder(name, args.output_dir)
    with claim_demo_folder(str(folder)) as output_dir:  # before the demo writes anything: one demo a folder
        return run(settings, output_dir)


def _real_model_demo(model: str, task: str):
    """The settings class, the run function and the flag that names them of ``--model smollm2|gemma3``'s demo."""
    if model == "gemma3":
        if task != "addition":
            raise UserError(f"--model gemma3 runs the addition demo, not --task {task}; leave --task out")
        from treadle.demos import gemma as demo_gemma  # heavy: torch, transformers

        return demo_gemma.GemmaDemoSettings, demo_gemma.run_gemma_demo, "--model gemma3"
    if task not in ("addition", "gym"):
        raise UserError(f"--model smollm2 runs the addition demo, not --task {task}; leave --task out (or --task gym)")
    from treadle.demos import gym as demo_gym, real as demo_real  # heavy, as above

    if task == "gym":
        return demo_gym.GymDemoSettings, demo_gym.run_gym_demo, "--task gym"
    return demo_real.RealDemoSettings, demo_real.run_real_demo, "--model smollm2"


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
