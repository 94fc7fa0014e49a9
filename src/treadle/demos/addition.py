"""``treadle demo``: SFT then GRPO of the tiny toy model on 2-digit addition, scored on held-out problems.

``run_demo(DemoSettings(...), output_dir)`` (``DemoSettings`` refuses step or problem counts below 1):

1. builds the toy model and tokenizer (``treadle.toy``) and scores the untrained model;
2. SFT on the training problems until greedy exact match on a probe of *training* problems reaches
   ``sft_target_accuracy`` (``StopAtAccuracy``) or ``sft_steps`` run out;
3. GRPO from the SFT checkpoint with the exact-match reward for ``grpo_steps`` steps, scoring the held-out
   problems before its first step (the SFT model) and every ``eval_every`` steps (the accuracy curve).

Every score is ``GRPOTrainer.evaluate()`` on the same ``eval_size`` held-out test problems (at most 1,000, the
whole test split) with the exact-match reward, the path any GRPO user has: the table shows greedy exact match
(``eval_greedy/accuracy``); the logs also hold pass@1 and pass@k of ``num_generations_eval`` samples per problem.
It prints a start line, each stage's plots, the accuracy curve and the before/after table (``results_table``),
and writes into the run folder (default ``runs/demo-<time>``)::

    results.json             the settings; per stage its accuracy, steps and training seconds; the curve
    untrained/               metrics.jsonl of the untrained model's evaluation
    sft/, grpo/              each a trainer output_dir (metrics.jsonl, checkpoint-N/, plots/); grpo's
                             eval_* metrics over its steps are drawn in grpo/plots/eval.png
    grpo/completions.jsonl   the sampled training completions with their rewards (log_completions)

Unless OMP_NUM_THREADS is set, torch runs on one thread (see ``start_demo``). torch, transformers and the
trainers are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from treadle.callbacks import TrainerCallback
from treadle.demos import toy
from treadle.models import load_pretrained
from treadle.record.plots import print_plots
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from treadle.trainers.sft import SFTConfig, SFTTrainer


@dataclasses.dataclass
class DemoSettings:
    """What ``treadle demo`` trains; tuned on 2 CPU cores (docs/demos.md: figures for seeds 0 to 5).

    SFT is a warm start: it stops as soon as the model solves ``sft_target_accuracy`` of a probe of *training*
    problems (never the held-out ones). When the tiny model "gets" addition varies a lot with the seed (after
    400 to 1,500 steps), so a fixed step count would hand GRPO a model that is either hopeless or finished.
    GRPO then trains on its own samples with the exact-match reward."""

    seed: int = 0  # model initialisation, data order and sampling
    model_size: str = "tiny"  # a treadle.toy.MODEL_SIZES key
    eval_size: int = 1000  # held-out problems scored after each stage (the whole test split)
    sft_steps: int = 2000  # at most this many SFT steps (~70 s on one core)
    sft_target_accuracy: float = 0.2  # stop SFT once this fraction of the training probe is solved
    sft_probe_size: int = 256  # training problems in the probe
    sft_check_every: int = 50  # SFT steps between probes (a probe costs about as much as 5 steps)
    sft_learning_rate: float = 2e-3  # constant after a 5% warm-up; 5e-3 learns slower
    sft_batch_size: int = 64  # problems per SFT step
    grpo_steps: int = 200  # GRPO optimizer steps (~50 s on one core)
    grpo_learning_rate: float = 3e-4  # GRPO peak step size; 1e-3 with fewer prompts per step is unstable
    grpo_warmup: float = 0.1  # fraction of GRPO steps warming up, then cosine decay to 0
    num_generations: int = 8  # G: completions per prompt
    grpo_batch_size: int = 512  # completions per GRPO step: 64 prompts x G; fewer prompts make it noisy
    steps_per_generation: int = 1  # optimizer steps fed by one generation
    temperature: float = 1.0  # sampling temperature during GRPO
    eval_every: int = 25  # GRPO steps between held-out evaluations (the accuracy curve)
    num_generations_eval: int = 4  # samples per held-out problem for pass@1 and pass@4 (greedy is extra)
    use_vllm: bool = False  # GRPO (training and its evaluations) samples with the colocated vLLM engine
    max_staleness: int = 0  # GRPO's asynchronous sampling (docs/async.md): batches up to N steps stale; 0: sync

    def __post_init__(self) -> None:
        if self.use_vllm and self.model_size == "tiny":  # vLLM's CPU attention needs head size >= 32 (tiny's: 16)
            self.model_size = "tiny32"
        # named by their `treadle demo` flags: the command line is where these come from
        if self.sft_steps < 1 or self.grpo_steps < 1 or self.eval_size < 1:
            raise ValueError("--sft-steps, --grpo-steps and --eval-size must be >= 1")
        if self.eval_every < 1 or self.num_generations_eval < 1:
            raise ValueError("eval_every and num_generations_eval must be >= 1")


class StopAtAccuracy(TrainerCallback):
    """Stops training (saving a checkpoint) once greedy exact match on ``problems`` reaches ``target``; checked
    every ``every`` steps. ``history`` keeps (step, accuracy) of each check."""

    def __init__(self, problems, tokenizer, *, target: float, every: int):
        self.problems, self.tokenizer, self.target, self.every = problems, tokenizer, target, every
        self.history: list[tuple[int, float]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every or state.global_step >= state.max_steps:
            return

        accuracy = toy.exact_match_accuracy(model, self.tokenizer, self.problems, batch_size=256, max_new_tokens=5)
        self.history.append((state.global_step, accuracy))
        if accuracy >= self.target:
            control.should_training_stop = control.should_save = control.should_log = True


def demo_folder(task: str, output_dir: str | None) -> Path:
    """A demo's run folder: ``output_dir``, or runs/demo[-task]-<time> (``treadle demo`` claims it before the demo
    starts: ``record.commands.claim_demo_folder``)."""
    name = f"demo-{task}" if task else "demo"
    return Path(output_dir or os.path.join("runs", time.strftime(f"{name}-%Y%m%d-%H%M%S")))


def start_demo(task: str, output_dir: str | None, title: str, *, one_thread: bool = True) -> tuple[Path, float]:
    """Every demo's start: one torch thread unless OMP_NUM_THREADS says otherwise (``one_thread=False``: torch's
    own choice, every core), its run folder (``output_dir``, or runs/demo[-task]-<time>) created, and its ``title``
    printed with the folder; (the folder, the start time)."""
    if one_thread and "OMP_NUM_THREADS" not in os.environ:
        import torch

        # the tiny models' matrices are too small for a second thread to pay: on 2 busy cores the addition demo
        # took 55 s with one thread and 175 s with two
        torch.set_num_threads(1)
    out = demo_folder(task, output_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{title}; run folder {out}", flush=True)
    return out, time.time()


def run_demo(settings: DemoSettings, output_dir: str | None = None) -> int:
    """SFT the tiny model on addition, then GRPO from the SFT checkpoint; print held-out accuracy of each."""
    vllm = " (GRPO samples with vLLM)" if settings.use_vllm else ""
    title = f"treadle demo: SFT then GRPO of the {settings.model_size} toy model on 2-digit addition{vllm}"
    out, start = start_demo("", output_dir, title)
    tokenizer = toy.build_tokenizer()
    problems = min(settings.eval_size, 1000)  # the held-out problems every stage is scored on
    model = toy.build_model(settings.model_size, seed=settings.seed, tokenizer=tokenizer)
    untrained = evaluate_heldout(model, tokenizer, settings, out / "untrained")
    rows = [("untrained", untrained[ACCURACY], 0, 0.0)]
    checkpoint, sft_steps, sft_seconds = demo_sft(model, tokenizer, settings, out / "sft")
    model, curve, steps, seconds = demo_grpo(checkpoint, tokenizer, settings, out / "grpo")
    rows += [("after SFT", curve[0][1], sft_steps, sft_seconds), ("after GRPO", curve[-1][1], steps, seconds)]
    write_results(out, settings, rows, start, curve=curve, heldout_problems=problems)
    for run in (out / "sft", out / "grpo"):
        print_plots(run)
    print(
        "held-out greedy exact match over GRPO steps: "
        + ", ".join(f"{step}: {accuracy:.1%}" for step, accuracy in curve)
    )
    print(results_table(rows, problems))
    print(
        f"treadle demo: done in {time.time() - start:.0f} s; results in {out / 'results.json'}; "
        f"see `treadle report {out}`"
    )
    return 0


def sft_warm_start(settings, output_dir: Path, **fields) -> SFTConfig:
    """The demos' SFT warm start: ``settings``' seed, ``sft_steps``, ``sft_learning_rate`` and ``sft_batch_size``, a
    constant rate after a warm-up of 5% of the steps, a log line every 25 steps; ``fields`` change or add fields."""
    values = dict(
        output_dir=str(output_dir),
        max_steps=settings.sft_steps,
        seed=settings.seed,
        learning_rate=settings.sft_learning_rate,
        per_device_train_batch_size=settings.sft_batch_size,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=0.05,
        logging_steps=25,
    )
    return SFTConfig(**{**values, **fields})


def demo_sft(model, tokenizer, settings: DemoSettings, output_dir: Path) -> tuple[str, int, float]:
    """Train ``model`` in place with SFT until the probe target or ``sft_steps``; returns (its checkpoint
    folder, steps, training seconds)."""
    train = toy.load_task("addition", "train", seed=settings.seed)
    probe = toy.load_task("addition", "train", kind="rl", n=settings.sft_probe_size, seed=settings.seed + 1)
    stop = StopAtAccuracy(probe, tokenizer, target=settings.sft_target_accuracy, every=settings.sft_check_every)
    args = sft_warm_start(settings, output_dir, save_steps=settings.sft_steps, max_length=32)
    trainer = SFTTrainer(model, args, train_dataset=train, processing_class=tokenizer, callbacks=[stop])
    start = time.time()
    trainer.train()
    steps = trainer.state.global_step
    return os.path.join(output_dir, f"checkpoint-{steps}"), steps, time.time() - start


ACCURACY = "eval_greedy/accuracy"  # the demo's score: greedy exact match on the held-out problems


def demo_grpo(checkpoint: str, tokenizer, settings: DemoSettings, output_dir: Path):
    """GRPO from the SFT checkpoint with the exact-match reward, evaluated on the held-out problems before its
    first step and every ``eval_every`` steps; returns (the model, the curve [(step, accuracy)], steps, seconds)."""
    model, _ = load_pretrained(checkpoint, tokenizer=tokenizer)
    trainer = heldout_trainer(
        model,
        tokenizer,
        settings,
        output_dir,
        max_steps=settings.grpo_steps,
        learning_rate=settings.grpo_learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=settings.grpo_warmup,
        logging_steps=max(1, settings.grpo_steps // 40),
        save_strategy="steps",
        save_steps=settings.grpo_steps,
        log_completions=True,
        eval_strategy="steps",
        eval_steps=settings.eval_every,
        use_vllm=settings.use_vllm,
    )
    curve = [(0, trainer.evaluate()[ACCURACY])]  # the SFT model (train() starts a new log_history)
    start = time.time()
    trainer.train()
    seconds = time.time() - start  # training time, evaluations included (the last step always evaluates)
    trainer.close()  # the vLLM engine, if any
    curve += [(h["step"], h[ACCURACY]) for h in trainer.state.log_history if ACCURACY in h]
    return model, curve, trainer.state.global_step, seconds


def heldout_trainer(model, tokenizer, settings: DemoSettings, output_dir: Path, **overrides):
    """The demo's GRPOTrainer: the exact-match reward, GRPO's settings, and the held-out problems as
    ``eval_dataset``, scored greedily (``eval_greedy``) and by pass@1 / pass@n of ``num_generations_eval``
    samples; ``overrides`` are further GRPOConfig fields (the training run's)."""
    n = settings.num_generations_eval
    values = dict(
        output_dir=str(output_dir),
        seed=settings.seed,
        per_device_train_batch_size=settings.grpo_batch_size,
        num_generations=settings.num_generations,
        steps_per_generation=settings.steps_per_generation,
        temperature=settings.temperature,
        max_completion_length=4,
        save_strategy="no",
        num_generations_eval=n,
        eval_pass_at_k=sorted({1, n}),
        eval_greedy=True,
        per_device_eval_batch_size=250,
        max_staleness=settings.max_staleness,
    )
    values.update(overrides)
    test = toy.load_task("addition", "test", kind="rl", n=min(settings.eval_size, 1000), seed=settings.seed)
    return GRPOTrainer(
        model,
        reward_funcs=toy.addition_reward,
        args=GRPOConfig(**values),
        processing_class=tokenizer,
        train_dataset=toy.load_task("addition", "train", kind="rl", seed=settings.seed),
        eval_dataset=test,
    )


def evaluate_heldout(model, tokenizer, settings: DemoSettings, output_dir: Path) -> dict[str, float]:
    """``GRPOTrainer.evaluate()`` of ``model`` on the held-out problems (its metrics also go to
    ``output_dir/metrics.jsonl``): ``eval_greedy/accuracy`` is the demo's score."""
    return heldout_trainer(model, tokenizer, settings, output_dir).evaluate()


def write_results(out: Path, settings, rows, start: float, *, curve=None, **about) -> None:
    """``out/results.json`` of a demo: its settings, ``about`` (e.g. the held-out count), ``stages`` (stage, accuracy,
    steps, training seconds for each of ``rows``), the GRPO ``curve`` [(step, accuracy)] if any, and the seconds since
    ``start``."""
    record = {
        "settings": dataclasses.asdict(settings),
        **about,
        "stages": [
            {"stage": name, "accuracy": accuracy, "steps": steps, "train_seconds": round(seconds, 1)}
            for name, accuracy, steps, seconds in rows
        ],
    }
    if curve is not None:
        record["grpo_curve"] = [{"step": step, "accuracy": accuracy} for step, accuracy in curve]
    record["total_seconds"] = round(time.time() - start, 1)
    (out / "results.json").write_text(json.dumps(record, indent=2) + "\n")


def results_table(rows: list[tuple[str, float, int, float]], problems: int) -> str:
    """The before/after table: stage, held-out exact match, steps, training time."""
    lines = [
        f"{'stage':<12} {'held-out exact match':>22} {'steps':>6} {'train time':>11}",
        f"{'-' * 12} {'-' * 22} {'-' * 6} {'-' * 11}",
    ]
    for stage, accuracy, steps, seconds in rows:
        lines.append(f"{stage:<12} {f'{accuracy:6.1%} of {problems}':>22} {steps:>6} {f'{seconds:.0f} s':>11}")
    return "\n".join(lines)
