"""``treadle demo --task count``: a tiny vision-language model learns to count shapes, SFT then GRPO.

``run_count_demo(CountDemoSettings(...), output_dir)``:

1. builds a tiny LLaVA (``treadle.demos.toy_vision``: CLIP tower, projector, Llama; 9 image tokens per 42-pixel canvas,
   one per cell of its 3x3 grid) and scores the untrained model;
2. SFT (``SFTTrainer`` with the processor: loss on the answer only) until the expected exact-match reward of
   sampling on a probe of *training* canvases (``probe_scores``: the answer's teacher-forced probability) reaches
   ``sft_target_reward``, or ``sft_steps`` run out: a warm start that has learnt the answer's form (a digit, then
   eos) but not yet to count, stopped early on purpose so that GRPO has room;
3. GRPO from there with the exact-match reward (``toy_vision.count_reward``), the images in the sampler's prefill,
   scored on the held-out canvases before its first step and at the end.

The task (``what``): "How many shapes?" about 1-4 squares or circles of 10-13 pixels (default), or the harder
"How many squares?" about 1-4 squares of 8-10 pixels among 0-2 circles (``what="squares"``; docs/vision.md).

Every score is ``GRPOTrainer.evaluate()`` with ``eval_greedy`` on the same ``eval_size`` held-out canvases (their own
seed): greedy exact match. Writes ``results.json`` and each stage's run folder (metrics.jsonl, plots) in the run
folder (default ``runs/demo-count-<time>``).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from treadle.callbacks import TrainerCallback
from treadle.demos import toy_vision
from treadle.demos.addition import ACCURACY, results_table, sft_warm_start, start_demo, write_results
from treadle.record.plots import print_plots
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from treadle.trainers.sft import SFTTrainer
from treadle.vision import VisionCollator


@dataclasses.dataclass
class CountDemoSettings:
    """What ``treadle demo --task count`` trains (docs/demos.md: seeds 0 to 4, two kernel sets, 1 or 2 threads)."""

    seed: int = 0  # model initialisation, data order and sampling
    kind: str = "llava"  # a toy_vision model: llava or idefics3 (own sampler), qwen2_vl (generate)
    hidden: int = 64  # the language model's and the vision tower's width
    what: str = "shapes"  # count every shape ("How many shapes?") or the squares among circles ("squares")
    max_squares: int = 4  # what is counted: 1 .. max_squares per canvas (the answers)
    max_circles: int = 2  # distractor circles per canvas: 0 .. max_circles
    train_size: int = 2000  # training canvases
    eval_size: int = 200  # held-out canvases scored after each stage
    sft_steps: int = 1000  # at most this many SFT steps
    sft_target_reward: float = 0.25  # stop SFT once the probe's expected sampled reward reaches this
    sft_probe_size: int = 128  # training canvases in the probe
    sft_check_every: int = 5  # SFT steps between probes
    sft_learning_rate: float = 3e-3
    sft_batch_size: int = 32
    grpo_steps: int = 150  # GRPO optimizer steps
    grpo_learning_rate: float = 1e-3
    grpo_beta: float = 0.04  # KL to the SFT start. Without it seed 3 on AVX2 kernels (76% after SFT) collapsed to
    # one count for every canvas (24.0%) by GRPO step 35; with it every seed ends at 100% on three kernel sets
    # (docs/demos.md)
    num_generations: int = 8  # G: completions per canvas
    grpo_batch_size: int = 128  # completions per GRPO step: 16 canvases x G
    temperature: float = 1.0  # on the squares task 0.7 collapsed two of three seeds to 25% (docs/vision.md)

    def __post_init__(self) -> None:
        if self.sft_steps < 1 or self.grpo_steps < 1 or self.eval_size < 1:
            raise ValueError("--sft-steps, --grpo-steps and --eval-size must be >= 1")
        if self.what not in toy_vision.QUESTIONS:
            raise ValueError(f"what must be one of {sorted(toy_vision.QUESTIONS)}, got {self.what!r}")
        if not 1 <= self.max_squares <= 9 - self.max_circles or self.max_circles < 0:
            raise ValueError(
                f"a canvas holds at most 9 shapes: max_squares={self.max_squares} and "
                f"max_circles={self.max_circles} do not fit"
            )
        if self.kind not in toy_vision.VISION_TOKENS:
            raise ValueError(f"kind must be one of {sorted(toy_vision.VISION_TOKENS)}, got {self.kind!r}")


class StopAtProbeReward(TrainerCallback):
    """Stops SFT once the probe's expected exact-match reward at temperature 1 (:func:`probe_scores`: the mean
    probability of the whole answer, digit and eos, teacher-forced) reaches ``target``; checked every ``every``
    steps. ``history``: (step, argmax accuracy, expected reward)."""

    def __init__(self, processor, probe: list[dict], *, target: float, every: int):
        self.batch, self.target, self.every = VisionCollator(processor)(probe), target, every
        self.history: list[tuple[int, float, float]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every or state.global_step >= state.max_steps:
            return
        accuracy, reward = probe_scores(model, self.batch)
        self.history.append((state.global_step, accuracy, reward))
        if reward >= self.target:
            control.should_training_stop = control.should_log = True


@torch.no_grad()
def probe_scores(model, batch: dict) -> tuple[float, float]:
    """``(accuracy, expected reward)`` of one teacher-forced forward: the fraction of rows whose answer's first
    token is the model's argmax, and the mean probability of the whole answer (the labelled tokens), which is the
    exact-match reward expected when sampling at temperature 1."""
    labels = batch["labels"]  # (B, T)
    was_training = model.training
    logits = model.eval()(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()  # (B, T, V)
    model.train(was_training)
    targets, scored = labels[:, 1:], labels[:, 1:] != -100  # logits[:, t] predicts labels[:, t + 1]
    token = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    first = scored.int().argmax(dim=1)  # (B,) the answer's first token
    rows = torch.arange(len(labels))
    accuracy = (logits[rows, first].argmax(-1) == targets[rows, first]).float().mean()
    return float(accuracy), float((token * scored).sum(dim=1).exp().mean())


def run_count_demo(settings: CountDemoSettings, output_dir: str | None = None) -> int:
    """SFT the tiny VLM on counting, then GRPO; print the held-out greedy accuracy of each stage."""
    title = f"treadle demo: SFT then GRPO of a tiny {settings.kind} model counting {settings.what}"
    out, start = start_demo("count", output_dir, title)
    processor = toy_vision.build_processor(settings.kind)
    model = toy_vision.build_model(settings.kind, processor, seed=settings.seed, hidden=settings.hidden)
    grpo = count_grpo_trainer(model, processor, settings, out / "grpo")
    rows = [("untrained", grpo.evaluate()[ACCURACY], 0, 0.0)]
    sft_steps, sft_seconds = count_sft(model, processor, settings, out / "sft")
    if grpo.needs_reference_logps():  # the KL term's reference is the SFT start, not the untrained model that
        grpo.ref_model = grpo.build_reference_model()  # GRPOTrainer copied when it was built (to score it)
    rows.append(("after SFT", grpo.evaluate()[ACCURACY], sft_steps, sft_seconds))
    began = time.time()
    grpo.train()
    rows.append(("after GRPO", grpo.evaluate()[ACCURACY], grpo.state.global_step, time.time() - began))
    write_results(out, settings, rows, start, heldout_canvases=settings.eval_size)
    for run in (out / "sft", out / "grpo"):
        print_plots(run)
    print(results_table(rows, settings.eval_size))
    print(f"treadle demo: done in {time.time() - start:.0f} s; results in {out / 'results.json'}")
    return 0


def count_sft(model, processor, settings: CountDemoSettings, output_dir: Path) -> tuple[int, float]:
    """SFT of ``model`` in place until the probe target or ``sft_steps``; returns (steps, seconds)."""
    train = canvases(settings, "train", settings.train_size)
    probe = canvases(settings, "train", settings.sft_probe_size)  # the first training canvases
    stop = StopAtProbeReward(processor, probe, target=settings.sft_target_reward, every=settings.sft_check_every)
    args = sft_warm_start(settings, output_dir, save_strategy="no", max_length=64, report_to=[])
    trainer = SFTTrainer(model, args, train_dataset=train, processing_class=processor, callbacks=[stop])
    began = time.time()
    trainer.train()
    return trainer.state.global_step, time.time() - began


def count_grpo_trainer(model, processor, settings: CountDemoSettings, output_dir: Path) -> GRPOTrainer:
    """GRPO with the exact-match reward on the training canvases; ``evaluate()`` scores the held-out ones
    greedily (``eval_greedy/accuracy``)."""
    args = GRPOConfig(
        output_dir=str(output_dir),
        seed=settings.seed,
        max_steps=settings.grpo_steps,
        learning_rate=settings.grpo_learning_rate,
        beta=settings.grpo_beta,
        lr_scheduler_type="cosine",
        warmup_steps=0.1,
        per_device_train_batch_size=settings.grpo_batch_size,
        num_generations=settings.num_generations,
        temperature=settings.temperature,
        max_completion_length=3,
        logging_steps=5,
        save_strategy="no",
        num_generations_eval=1,
        eval_pass_at_k=[1],
        eval_greedy=True,
        per_device_eval_batch_size=100,
        report_to=[],
    )
    return GRPOTrainer(
        model,
        reward_funcs=toy_vision.count_reward,
        args=args,
        processing_class=processor,
        train_dataset=canvases(settings, "train", settings.train_size, kind="rl"),
        eval_dataset=canvases(settings, "test", settings.eval_size, kind="rl"),
    )


def canvases(settings: CountDemoSettings, split: str, n: int, kind: str = "sft") -> list[dict]:
    """``n`` rows of the counting task with the settings' numbers of squares and circles."""
    return toy_vision.count_task(
        split, n, kind=kind, what=settings.what, max_squares=settings.max_squares, max_circles=settings.max_circles
    )
