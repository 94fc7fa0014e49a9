"""``treadle demo --task distill``: on-policy distillation against GRPO and SFT on a teacher's answers, from the
same SFT warm start, with the same number of steps and prompts per step.

``run_distill_demo(DistillDemoSettings(...), output_dir)``:

1. the teacher: the toy model trained by SFT on the addition training problems until it solves
   ``teacher_target_accuracy`` of a probe of *training* problems (or ``teacher_steps`` run out); saved in
   ``teacher_dir`` (default ``<run folder>/teacher``) and reused from there when it holds one;
2. the student: the GRPO demo's SFT warm start (``demos.addition.demo_sft``: the same model, seed, data and stop);
3. from that one checkpoint, ``grpo_steps`` optimizer steps of each method, every step on 64 training prompts:
   - **GRPO**: the GRPO demo's trainer (``treadle.demos.addition.heldout_trainer``: 8 samples per prompt, exact-match
     reward, its learning rate and schedule);
   - **distillation**: ``DistillationTrainer``, one sample per prompt, the teacher's per-token distributions
     (``distill_beta``: the JSD); GRPO and distillation draw the same 64 prompts at each step (same sampler seed);
   - **SFT on the teacher's answers**: the teacher's greedy answers to the training prompts as SFT targets;
4. every method's held-out greedy exact match (``toy.exact_match_accuracy`` on the same ``eval_size`` test
   problems) before its first step and every ``eval_every`` steps, and its training wall time (evaluations
   excluded); for each method, the first step (and training seconds) at which it reaches GRPO's final accuracy.

Each method has its own learning rate (GRPO's is the GRPO demo's; the others were chosen once on seed 0, see
docs/distillation.md). The run folder holds ``results.json``, ``teacher/`` (unless ``teacher_dir`` is
elsewhere), ``sft/`` and one trainer output_dir per method (metrics.jsonl, plots).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from treadle.callbacks import TrainerCallback
from treadle.demos import toy
from treadle.demos.addition import (
    DemoSettings,
    StopAtAccuracy,
    demo_sft,
    heldout_trainer,
    sft_warm_start,
    start_demo,
)
from treadle.models import load_pretrained
from treadle.trainers.distillation import DistillationConfig, DistillationTrainer
from treadle.trainers.sft import SFTConfig, SFTTrainer

METHODS = ("GRPO", "distillation", "SFT on teacher answers")


@dataclasses.dataclass
class DistillDemoSettings(DemoSettings):
    """The GRPO demo's settings (the SFT warm start, GRPO, ``grpo_steps`` for every method) plus the teacher's and
    the other two methods'."""

    eval_every: int = 10  # steps between held-out evaluations of each method
    teacher_seed: int = 1000  # the teacher's initialisation and data order (one teacher for every demo seed)
    teacher_steps: int = 6000  # at most this many SFT steps for the teacher
    teacher_target_accuracy: float = 0.95  # stop once the teacher solves this fraction of a training probe
    teacher_check_every: int = 250  # teacher SFT steps between probes
    teacher_dir: str | None = None  # a teacher folder to reuse or create; None: <run folder>/teacher
    distill_learning_rate: float = 2e-3  # distillation's peak step size (the dense signal takes SFT's rate)
    distill_beta: float = 0.5  # the divergence: 0.5 (JSD) reached the most at step 50 on seed 0 (docs/distillation.md)
    distill_temperature: float = 1.0  # sampling and divergence temperature
    teacher_sft_learning_rate: float = 2e-3  # SFT on the teacher's answers: the warm start's rate


class HeldoutCurve(TrainerCallback):
    """Held-out greedy exact match every ``every`` steps and at the last step, and the training seconds so far
    (the time of these evaluations left out): ``curve`` holds (step, accuracy, seconds)."""

    def __init__(self, problems, tokenizer, every: int):
        self.problems, self.tokenizer, self.every = problems, tokenizer, every
        self.curve: list[tuple[int, float, float]] = []
        self.start, self.eval_seconds = 0.0, 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.start, self.eval_seconds = time.time(), 0.0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every and state.global_step < state.max_steps:
            return
        began = time.time()
        trained = began - self.start - self.eval_seconds  # seconds of training so far
        accuracy = score(model, self.tokenizer, self.problems)
        self.eval_seconds += time.time() - began
        self.curve.append((state.global_step, accuracy, trained))


def score(model, tokenizer, problems) -> float:
    """The demo's score: greedy exact match on ``problems``."""
    return toy.exact_match_accuracy(model, tokenizer, problems, batch_size=250, max_new_tokens=4)


def run_distill_demo(settings: DistillDemoSettings, output_dir: str | None = None) -> int:
    """Teacher, SFT warm start, then GRPO / distillation / SFT on the teacher's answers; print the table."""
    title = (
        f"treadle demo --task distill: a teacher, the SFT warm start, then GRPO vs on-policy distillation vs "
        f"SFT on the teacher's answers, {settings.grpo_steps} steps each"
    )
    out, start = start_demo("distill", output_dir, title)
    tokenizer = toy.build_tokenizer()
    problems = toy.load_task("addition", "test", kind="rl", n=min(settings.eval_size, 1000), seed=settings.seed)
    teacher, teacher_record = load_or_train_teacher(
        settings, tokenizer, Path(settings.teacher_dir or out / "teacher"), problems
    )
    model = toy.build_model(settings.model_size, seed=settings.seed, tokenizer=tokenizer)
    checkpoint, sft_steps, sft_seconds = demo_sft(model, tokenizer, settings, out / "sft")
    start_accuracy = score(load_pretrained(checkpoint, tokenizer=tokenizer)[0], tokenizer, problems)
    runs = {name: train_method(name, checkpoint, teacher, tokenizer, settings, out, problems) for name in METHODS}
    results = summarise(settings, teacher_record, (sft_steps, sft_seconds, start_accuracy), runs, len(problems))
    results["total_seconds"] = round(time.time() - start, 1)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    for name, curve in runs.items():
        print(f"{name}: " + ", ".join(f"{step}: {accuracy:.1%}" for step, accuracy, _ in curve))
    print(results_table(results))
    print(f"treadle demo --task distill: done in {time.time() - start:.0f} s; results in {out / 'results.json'}")
    return 0


def load_or_train_teacher(settings: DistillDemoSettings, tokenizer, folder: Path, problems):
    """The teacher saved in ``folder`` (with its ``teacher.json``), or one trained now and saved there."""
    record_path = folder / "teacher.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        print(f"teacher: reused from {folder} ({record['heldout_accuracy']:.1%} held-out)", flush=True)
        return load_pretrained(str(folder), tokenizer=tokenizer)[0], record
    teacher = toy.build_model(settings.model_size, seed=settings.teacher_seed, tokenizer=tokenizer)
    probe = toy.load_task("addition", "train", kind="rl", n=512, seed=settings.teacher_seed + 1)
    stop = StopAtAccuracy(
        probe, tokenizer, target=settings.teacher_target_accuracy, every=settings.teacher_check_every
    )
    args = sft_warm_start(
        settings,
        folder / "run",
        max_steps=settings.teacher_steps,
        seed=settings.teacher_seed,
        warmup_steps=0.02,
        logging_steps=100,
        save_strategy="no",
        max_length=32,
        disable_tqdm=True,
    )
    began = time.time()
    trainer = SFTTrainer(
        teacher,
        args,
        train_dataset=toy.load_task("addition", "train", seed=settings.teacher_seed),
        processing_class=tokenizer,
        callbacks=[stop],
    )
    trainer.train()
    record = {
        "steps": trainer.state.global_step,
        "train_seconds": round(time.time() - began, 1),
        "heldout_accuracy": score(teacher, tokenizer, problems),
        "probe_accuracy": stop.history[-1][1] if stop.history else None,
        "seed": settings.teacher_seed,
    }
    teacher.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"teacher: {record['steps']} SFT steps, {record['heldout_accuracy']:.1%} held-out, saved in {folder}",
        flush=True,
    )
    return teacher, record


def train_method(
    name: str, checkpoint: str, teacher, tokenizer, settings: DistillDemoSettings, out: Path, problems
) -> list[tuple[int, float, float]]:
    """``grpo_steps`` steps of one method from the SFT checkpoint; its curve [(step, accuracy, train seconds)]."""
    model, _ = load_pretrained(checkpoint, tokenizer=tokenizer)
    curve = HeldoutCurve(problems, tokenizer, settings.eval_every)
    schedule = dict(
        max_steps=settings.grpo_steps,
        lr_scheduler_type="cosine",
        warmup_steps=settings.grpo_warmup,
        logging_steps=max(1, settings.grpo_steps // 20),
        save_strategy="no",
        disable_tqdm=True,
    )
    folder = out / name.split()[0].lower() if name != "SFT on teacher answers" else out / "sft_teacher"
    prompts = toy.load_task("addition", "train", kind="rl", seed=settings.seed)
    if name == "GRPO":
        trainer = heldout_trainer(
            model, tokenizer, settings, folder, learning_rate=settings.grpo_learning_rate, **schedule
        )
    elif name == "distillation":
        trainer = distillation_trainer(model, teacher, tokenizer, settings, folder, prompts, schedule)
    else:
        trainer = teacher_answers_trainer(model, teacher, tokenizer, settings, folder, prompts, schedule)
    trainer.add_callback(curve)
    print(f"{name}: training from the SFT checkpoint", flush=True)
    trainer.train()
    return curve.curve


def distillation_trainer(
    model, teacher, tokenizer, settings: DistillDemoSettings, folder: Path, prompts, schedule: dict
) -> DistillationTrainer:
    """The distillation method: one sample per prompt, scored by the teacher's per-token distributions."""
    args = DistillationConfig(
        output_dir=str(folder),
        seed=settings.seed,
        max_completion_length=4,
        per_device_train_batch_size=settings.grpo_batch_size // settings.num_generations,
        temperature=settings.distill_temperature,
        beta=settings.distill_beta,
        learning_rate=settings.distill_learning_rate,
        **schedule,
    )
    return DistillationTrainer(model, teacher, args=args, train_dataset=prompts, processing_class=tokenizer)


def teacher_answers_trainer(
    model, teacher, tokenizer, settings: DistillDemoSettings, folder: Path, prompts, schedule: dict
) -> SFTTrainer:
    """The SFT method: the teacher's greedy answers to ``prompts`` as targets (those holding no number left out)."""
    answers = toy.greedy_completions(teacher, tokenizer, prompts["prompt"], batch_size=250, max_new_tokens=4)
    rows = prompts.add_column("completion", [toy.extract_answer(a) for a in answers])
    rows = rows.filter(lambda row: row["completion"] != "")  # no digits: nothing to learn (SFT refuses it)
    if len(rows) < len(prompts):
        print(
            f"SFT on teacher answers: {len(prompts) - len(rows)} of {len(prompts)} teacher answers hold no "
            f"number and are left out",
            flush=True,
        )
    args = SFTConfig(
        output_dir=str(folder),
        seed=settings.seed,
        max_length=32,
        per_device_train_batch_size=settings.grpo_batch_size // settings.num_generations,
        learning_rate=settings.teacher_sft_learning_rate,
        **schedule,
    )
    return SFTTrainer(
        model, args, train_dataset=rows.select_columns(["prompt", "completion"]), processing_class=tokenizer
    )


def first_reaching(curve: list[tuple[int, float, float]], accuracy: float) -> tuple[int, float] | None:
    """The first evaluated (step, train seconds) at which ``curve`` reaches ``accuracy`` (None: never)."""
    return next(((step, seconds) for step, value, seconds in curve if value >= accuracy), None)


def summarise(settings, teacher: dict, start: tuple[int, float, float], runs: dict, problems: int) -> dict:
    """results.json: the settings, the teacher, the warm start, each method's curve and final figures, and for
    each other method the first step at which it reaches GRPO's final accuracy (and that over GRPO's steps)."""
    target = runs["GRPO"][-1][1]
    methods = {}
    for name, curve in runs.items():
        reached = first_reaching(curve, target)
        methods[name] = {
            "final_accuracy": curve[-1][1],
            "steps": curve[-1][0],
            "train_seconds": round(curve[-1][2], 1),
            "steps_to_grpo_final": None if reached is None else reached[0],
            "seconds_to_grpo_final": None if reached is None else round(reached[1], 1),
            "fraction_of_grpo_steps": None if reached is None else reached[0] / runs["GRPO"][-1][0],
            "curve": [{"step": s, "accuracy": a, "train_seconds": round(t, 1)} for s, a, t in curve],
        }
    sft_steps, sft_seconds, start_accuracy = start
    return {
        "settings": dataclasses.asdict(settings),
        "heldout_problems": problems,
        "teacher": teacher,
        "warm_start": {"steps": sft_steps, "train_seconds": round(sft_seconds, 1), "accuracy": start_accuracy},
        "grpo_final_accuracy": target,
        "methods": methods,
    }


def results_table(results: dict) -> str:
    """Held-out exact match, steps, training time, and steps to reach GRPO's final accuracy, per method."""
    n = results["heldout_problems"]
    lines = [
        f"{'method':<24} {'held-out exact match':>21} {'steps':>6} {'train time':>11} {'at GRPO final':>25}",
        f"{'-' * 24} {'-' * 21} {'-' * 6} {'-' * 11} {'-' * 25}",
    ]
    teacher, start = results["teacher"], results["warm_start"]
    rows = [
        ("teacher", teacher["heldout_accuracy"], teacher["steps"], teacher["train_seconds"], ""),
        ("SFT warm start", start["accuracy"], start["steps"], start["train_seconds"], ""),
    ]
    for name, method in results["methods"].items():
        reached = method["steps_to_grpo_final"]
        where = (
            "never"
            if reached is None
            else (f"step {reached} ({method['fraction_of_grpo_steps']:.2f}), {method['seconds_to_grpo_final']:.0f} s")
        )
        rows.append((name, method["final_accuracy"], method["steps"], method["train_seconds"], where))
    for name, accuracy, steps, seconds, where in rows:
        lines.append(f"{name:<24} {f'{accuracy:6.1%} of {n}':>21} {steps:>6} {f'{seconds:.0f} s':>11} {where:>25}")
    return "\n".join(lines)
