"""``treadle demo``: SFT then GRPO of the tiny toy model on 2-digit addition, scored on held-out problems.

``run_demo(DemoSettings(...), output_dir)`` (``DemoSettings`` refuses step or problem counts below 1):

1. builds the toy model and tokenizer (``treadle.toy``) and scores the untrained model;
2. SFT on the training problems until greedy exact match on a probe of *training* problems reaches
   ``sft_target_accuracy`` (``StopAtAccuracy``) or ``sft_steps`` run out, then scores the model;
3. GRPO from the SFT checkpoint with the exact-match reward for ``grpo_steps`` steps, then scores it.

Every score is greedy exact match on the same ``eval_size`` held-out test problems (at most 1,000, the whole
test split). It prints a start line, each stage's plots and the before/after table (``results_table``), and
writes into the run folder (default ``runs/demo-<time>``)::

    results.json             the settings; per stage its accuracy, steps and training seconds
    sft/, grpo/              each a trainer output_dir (metrics.jsonl, checkpoint-N/, plots/) plus
                             heldout_completions.jsonl: prompt, completion, answer, correct per held-out problem
    grpo/completions.jsonl   the sampled completions with their rewards (log_completions)

Unless OMP_NUM_THREADS is set, torch runs on one thread (see ``run_demo``). torch, transformers and the
trainers are imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from treadle.callbacks import TrainerCallback
from treadle.report import print_plots


@dataclasses.dataclass
class DemoSettings:
    """What ``treadle demo`` trains; tuned on 2 CPU cores (README: figures for seeds 0, 1, 2).

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

    def __post_init__(self) -> None:
        # named by their `treadle demo` flags: the command line is where these come from
        if self.sft_steps < 1 or self.grpo_steps < 1 or self.eval_size < 1:
            raise ValueError("--sft-steps, --grpo-steps and --eval-size must be >= 1")


class StopAtAccuracy(TrainerCallback):
    """Stops training (saving a checkpoint) once greedy exact match on ``problems`` reaches ``target``; checked
    every ``every`` steps. ``history`` keeps (step, accuracy) of each check."""

    def __init__(self, problems, tokenizer, *, target: float, every: int):
        self.problems, self.tokenizer, self.target, self.every = problems, tokenizer, target, every
        self.history: list[tuple[int, float]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every or state.global_step >= state.max_steps:
            return
        from treadle import toy

        accuracy = toy.exact_match_accuracy(model, self.tokenizer, self.problems, batch_size=256, max_new_tokens=5)
        self.history.append((state.global_step, accuracy))
        if accuracy >= self.target:
            control.should_training_stop = control.should_save = control.should_log = True


def run_demo(settings: DemoSettings, output_dir: str | None = None) -> int:
    """SFT the tiny model on addition, then GRPO from the SFT checkpoint; print held-out accuracy of each."""
    from treadle import toy

    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # the tiny model's matrices are too small for a second thread to pay: on 2 busy cores the demo took
        # 55 s with one thread and 175 s with two
        torch.set_num_threads(1)
    out = Path(output_dir or os.path.join("runs", time.strftime("demo-%Y%m%d-%H%M%S")))
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    tokenizer = toy.build_tokenizer()
    test = toy.load_task("addition", "test", kind="rl", n=min(settings.eval_size, 1000), seed=settings.seed)
    print(f"treadle demo: SFT then GRPO of the {settings.model_size} toy model on 2-digit addition; "
          f"run folder {out}", flush=True)
    model = toy.build_model(settings.model_size, seed=settings.seed, tokenizer=tokenizer)
    rows = [("untrained", score_heldout(model, tokenizer, test, None), 0, 0.0)]
    checkpoint, steps, seconds = demo_sft(model, tokenizer, settings, out / "sft")
    rows.append(("after SFT", score_heldout(model, tokenizer, test, out / "sft" / "heldout_completions.jsonl"),
                 steps, seconds))
    model, steps, seconds = demo_grpo(checkpoint, tokenizer, settings, out / "grpo")
    rows.append(("after GRPO", score_heldout(model, tokenizer, test, out / "grpo" / "heldout_completions.jsonl"),
                 steps, seconds))
    (out / "results.json").write_text(json.dumps(
        {"settings": dataclasses.asdict(settings), "heldout_problems": len(test),
         "stages": [{"stage": name, "accuracy": accuracy, "steps": steps, "train_seconds": round(seconds, 1)}
                    for name, accuracy, steps, seconds in rows],
         "total_seconds": round(time.time() - start, 1)}, indent=2) + "\n")
    for run in (out / "sft", out / "grpo"):
        print_plots(run)
    print(results_table(rows, len(test)))
    print(f"treadle demo: done in {time.time() - start:.0f} s; results in {out / 'results.json'}; "
          f"see `treadle report {out}`")
    return 0


def demo_sft(model, tokenizer, settings: DemoSettings, output_dir: Path) -> tuple[str, int, float]:
    """Train ``model`` in place with SFT until the probe target or ``sft_steps``; returns (its checkpoint
    folder, steps, training seconds)."""
    from treadle import toy
    from treadle.trainers.sft import SFTConfig, SFTTrainer

    train = toy.load_task("addition", "train", seed=settings.seed)
    probe = toy.load_task("addition", "train", kind="rl", n=settings.sft_probe_size, seed=settings.seed + 1)
    stop = StopAtAccuracy(probe, tokenizer, target=settings.sft_target_accuracy, every=settings.sft_check_every)
    args = SFTConfig(output_dir=str(output_dir), max_steps=settings.sft_steps, seed=settings.seed,
                     learning_rate=settings.sft_learning_rate, per_device_train_batch_size=settings.sft_batch_size,
                     lr_scheduler_type="constant_with_warmup", warmup_steps=0.05, logging_steps=25,
                     save_steps=settings.sft_steps, max_length=32)
    trainer = SFTTrainer(model, args, train_dataset=train, processing_class=tokenizer, callbacks=[stop])
    start = time.time()
    trainer.train()
    steps = trainer.state.global_step
    return os.path.join(output_dir, f"checkpoint-{steps}"), steps, time.time() - start


def demo_grpo(checkpoint: str, tokenizer, settings: DemoSettings, output_dir: Path):
    """GRPO from the SFT checkpoint with the exact-match reward; returns (the model, steps, training seconds)."""
    from treadle import toy
    from treadle.models import load_model
    from treadle.trainers.grpo import GRPOConfig, GRPOTrainer

    model, _ = load_model(checkpoint, tokenizer=tokenizer)
    args = GRPOConfig(output_dir=str(output_dir), max_steps=settings.grpo_steps, seed=settings.seed,
                      learning_rate=settings.grpo_learning_rate, per_device_train_batch_size=settings.grpo_batch_size,
                      num_generations=settings.num_generations, steps_per_generation=settings.steps_per_generation,
                      temperature=settings.temperature, max_completion_length=4, lr_scheduler_type="cosine",
                      warmup_steps=settings.grpo_warmup, logging_steps=max(1, settings.grpo_steps // 40),
                      save_steps=settings.grpo_steps, log_completions=True)
    trainer = GRPOTrainer(model, reward_funcs=toy.addition_reward, args=args, processing_class=tokenizer,
                          train_dataset=toy.load_task("addition", "train", kind="rl", seed=settings.seed))
    start = time.time()
    trainer.train()
    return model, trainer.state.global_step, time.time() - start


def score_heldout(model, tokenizer, dataset, completions_file: Path | None, batch_size: int = 250) -> float:
    """Greedy exact-match accuracy on ``dataset`` (prompt, answer), with a progress bar; the completions go to
    ``completions_file`` as JSON lines when given."""
    from tqdm.auto import tqdm

    from treadle import toy
    from treadle.models import eval_mode

    prompts, answers = dataset["prompt"], dataset["answer"]
    completions = []
    with eval_mode(model):
        for start in tqdm(range(0, len(prompts), batch_size), desc="held-out accuracy", unit=" batch",
                          dynamic_ncols=True, leave=False):
            completions += toy.greedy_completions(model, tokenizer, prompts[start:start + batch_size],
                                                  batch_size=batch_size, max_new_tokens=5)
    correct = [toy.extract_answer(c) == a for c, a in zip(completions, answers)]
    if completions_file is not None:
        with open(completions_file, "w") as f:
            for p, c, a, ok in zip(prompts, completions, answers, correct):
                f.write(json.dumps({"prompt": p, "completion": c, "answer": a, "correct": ok}) + "\n")
    return sum(correct) / len(correct)


def results_table(rows: list[tuple[str, float, int, float]], problems: int) -> str:
    """The before/after table: stage, held-out exact match, steps, training time."""
    lines = [f"{'stage':<12} {'held-out exact match':>22} {'steps':>6} {'train time':>11}",
             f"{'-' * 12} {'-' * 22} {'-' * 6} {'-' * 11}"]
    for stage, accuracy, steps, seconds in rows:
        lines.append(f"{stage:<12} {f'{accuracy:6.1%} of {problems}':>22} {steps:>6} {f'{seconds:.0f} s':>11}")
    return "\n".join(lines)
