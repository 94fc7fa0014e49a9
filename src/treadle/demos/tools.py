"""``treadle demo --task tools``: the tiny model learns to use a calculator tool for 3-digit addition.

The tiny toy model cannot learn 3-digit addition in a few minutes on a CPU, but it can learn to *call* the
``calc`` tool (``treadle.toy.calc``) and copy the result. ``run_tools_demo(ToolsDemoSettings(...), output_dir)``:

1. builds the toy model and scores it (untrained);
2. a short SFT warm start on ``sft_problems`` tool-using transcripts (``toy.tool_transcripts``: the call, then
   the answer after the tool's result), started again from the same weights with another data order when an
   attempt is not at its targets (``warm_start``), then scores it;
3. GRPO from there with ``tools=[toy.calc]``, the exact-match reward and a KL term to the warm start:
   multi-turn rollouts, loss on the model's tokens only (``treadle.rollouts``), then scores it;
4. the control without tools from the same initial weights: the same problems as direct answers (``123+456=``
   -> ``579``), as many times in as many SFT steps, then the same GRPO, rolled out and scored without tools.

Every score is greedy held-out exact match on the same ``eval_size`` test problems (the first three with the
tool available, the control without). The run folder holds ``results.json``, ``sft/`` (and
``sft-attempt-2/`` ... when the warm start started again), ``grpo/``,
``control_sft/``, ``control_grpo/`` (each a trainer output_dir with metrics.jsonl and plots; ``grpo/`` also
``completions.jsonl`` with whole transcripts) and ``heldout_completions.jsonl`` per scored stage.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from treadle.callbacks import TrainerCallback
from treadle.console import PrinterCallback
from treadle.demos import toy
from treadle.demos.addition import results_table, sft_warm_start, start_demo
from treadle.record.plots import print_plots
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer
from treadle.trainers.sft import SFTTrainer


@dataclasses.dataclass
class ToolsDemoSettings:
    """What ``treadle demo --task tools`` trains; tuned on 2 busy CPU cores (docs/demos.md: seeds 0-4 on two sets of
    CPU kernels, ``python -m benchmarks.demos --variants tools``)."""

    seed: int = 0  # model initialisation, data order and sampling
    model_size: str = "tiny"  # a treadle.toy.MODEL_SIZES key
    eval_size: int = 300  # held-out problems scored after each stage
    sft_problems: int = 4000  # tool-using transcripts in the warm start (two SFT rows each)
    sft_steps: int = 800  # at most this many SFT steps per attempt (the runs that met the targets took 228-750)
    sft_attempts: int = 3  # an attempt not at the targets after sft_steps starts again from the same initial
    # weights with another data order: seed 3 on AVX512 kernels learned to add the units itself and never to copy
    # them (0-9% solved from step 680 to 1,600; 800 more steps with a quarter, half or all of the tool results
    # another problem's answer did not move it); with the next data order it copied within 454 steps
    sft_target_accuracy: float = 0.2  # stop SFT once this fraction of a probe of training problems is solved ...
    sft_target_calls: float = 0.5  # ... and the first turn is the right calc() call on this fraction of it ...
    sft_stop_probes: int = 2  # ... on this many probes in a row (one lucky probe of 100 read 7%, 25%, then 15%)
    sft_probe_size: int = 100  # training problems in the probe (rolled out with the tool)
    sft_check_every: int = 10  # SFT steps between probes (accuracy can jump from 5% to 60% within 25 steps)
    sft_near_accuracy: float = 0.1  # once a probe solves this fraction, probe every sft_check_every_near steps
    sft_check_every_near: int = 2  # near the target: the probe went 17% -> 44% within 10 steps (seed 0, README)
    sft_learning_rate: float = 5e-3  # copying digits "clicks" after 250-900 steps at this rate
    sft_near_lr_factor: float = 0.25  # near the target the rate drops to this fraction: at the full rate the probe
    # went 8%, 18%, 43%, 25%, 62% in 8 steps (seed 3, default kernels), too fast and too noisy to stop in time
    sft_warmup_steps: int = 40  # steps, not a fraction of sft_steps: raising the cap must not change the run
    sft_batch_size: int = 64
    grpo_steps: int = 200  # GRPO optimizer steps (120 before the KL term: with it seed 2, AVX512, gained 10.3 in 120)
    grpo_learning_rate: float = 1e-3  # with 120 steps, T 0.7 and no KL term: largest gain on seed 2 (docs/demos.md)
    grpo_beta: float = 0.04  # KL to the warm start: without it a start that copies badly drifted into garbage
    # (seed 3, AVX512: +5.7 points; at twice the rate "<call>cal>2+2258" within 26 steps); with it +24.0
    num_generations: int = 8  # G: rollouts per prompt
    temperature: float = 0.7  # GRPO's sampling temperature: more rewarded samples per group than at 1.0
    grpo_batch_size: int = 128  # rollouts per GRPO step: 16 prompts x G
    max_completion_length: int = 64  # sampled plus tool tokens per rollout (a solved problem takes ~52)

    def __post_init__(self) -> None:
        if self.sft_steps < 1 or self.grpo_steps < 1 or self.eval_size < 1 or self.sft_attempts < 1:
            raise ValueError("--sft-steps, --grpo-steps, --eval-size and sft_attempts must be >= 1")


def run_tools_demo(settings: ToolsDemoSettings, output_dir: str | None = None) -> int:
    """Warm-start SFT, GRPO with the tool, and the no-tool control; print held-out exact match of each."""
    title = (
        f"treadle demo --task tools: the {settings.model_size} toy model learns to call calc() for 3-digit "
        f"addition (SFT warm start, then GRPO with the tool)"
    )
    out, start = start_demo("tools", output_dir, title)
    tokenizer = toy.build_tokenizer()
    test = toy.load_task("tools", "test", kind="rl", n=min(settings.eval_size, 1000), seed=settings.seed)
    held_out = HeldOut(tokenizer, test, settings, out)
    rows, sft_steps, attempts = tool_stages(tokenizer, settings, out, held_out)
    rows.append(control_stage(tokenizer, settings, out, held_out, sft_steps))
    write_results(out, settings, rows, held_out.calls, len(test), attempts, start)
    for run in ("sft", "grpo"):
        print_plots(out / run)

    print(results_table(rows, len(test)))
    print(f"treadle demo --task tools: done in {time.time() - start:.0f} s; results in {out / 'results.json'}")
    return 0


@dataclasses.dataclass
class HeldOut:
    """Scores a stage's policy on the held-out problems ``test`` (transcripts in ``out``/<name>.jsonl) and
    returns the fraction solved; ``calls`` holds each stage's fraction with the right first call, in order."""

    tokenizer: object
    test: object
    settings: ToolsDemoSettings
    out: Path
    calls: dict[str, float] = dataclasses.field(default_factory=dict)

    def __call__(self, stage: str, policy, name: str, use_tools: bool = True) -> float:
        score = score_tools(
            policy,
            self.tokenizer,
            self.test,
            self.settings,
            self.out / f"{name}.jsonl",
            use_tools=use_tools,
            label=f"{stage}: held-out",
        )
        self.calls[stage] = score.right_call
        return score.solved


def tool_stages(tokenizer, settings: ToolsDemoSettings, out: Path, held_out: HeldOut):
    """The untrained model, the SFT warm start and GRPO with the tool, each scored: (their rows of (stage,
    accuracy, steps, seconds), the warm start's SFT steps, its attempts)."""
    model = toy.build_model(settings.model_size, seed=settings.seed, tokenizer=tokenizer)
    rows = [("untrained", held_out("untrained", model, "untrained"), 0, 0.0)]
    model, sft_steps, seconds, attempts = warm_start(tokenizer, settings, out)
    rows.append(("after SFT", held_out("after SFT", model, "sft"), sft_steps, seconds))
    steps, seconds = tools_grpo(model, tokenizer, settings, out / "grpo", use_tools=True)
    rows.append(("GRPO + tool", held_out("GRPO + tool", model, "grpo"), steps, seconds))
    return rows, sft_steps, attempts


def control_stage(tokenizer, settings: ToolsDemoSettings, out: Path, held_out: HeldOut, sft_steps: int):
    """The no-tool control, ``sft_steps`` SFT steps then GRPO, scored without the tool: its row."""
    control = toy.build_model(settings.model_size, seed=settings.seed, tokenizer=tokenizer)
    direct = toy.load_task("tools", "train", kind="sft", n=settings.sft_problems, seed=settings.seed)
    # the control gets the same budget: the same problems, as many times, in as many SFT steps (those of the attempt
    # kept) from the same initial weights, as direct answers: half as many rows per step, since each problem is two
    # rows (two turns) in the tool run; then as many GRPO steps
    _, sft_seconds = tools_sft(
        control,
        tokenizer,
        direct,
        settings,
        out / "control_sft",
        max_steps=sft_steps,
        batch_size=settings.sft_batch_size // 2,
    )
    steps, seconds = tools_grpo(control, tokenizer, settings, out / "control_grpo", use_tools=False)
    return (
        "no-tool ctrl",
        held_out("no-tool control", control, "control", use_tools=False),
        sft_steps + steps,
        sft_seconds + seconds,
    )


def write_results(
    out: Path,
    settings: ToolsDemoSettings,
    rows: list,
    calls: dict[str, float],
    problems: int,
    attempts: int,
    start: float,
) -> None:
    """results.json: the settings, and each stage's accuracy, right calls, steps and seconds (``calls`` in the
    order of ``rows``); the total seconds since ``start``."""
    (out / "results.json").write_text(
        json.dumps(
            {
                "task": "tools",
                "settings": dataclasses.asdict(settings),
                "heldout_problems": problems,
                "sft_attempts": attempts,
                "stages": [
                    {
                        "stage": name,
                        "accuracy": accuracy,
                        "right_call": right,
                        "steps": steps,
                        "train_seconds": round(seconds, 1),
                    }
                    for (name, accuracy, steps, seconds), right in zip(rows, calls.values())
                ],
                "total_seconds": round(time.time() - start, 1),
            },
            indent=2,
        )
        + "\n"
    )


class _StopWithTool(TrainerCallback):
    """Stops SFT once greedy rollouts with the tool solve ``sft_target_accuracy`` of ``probe`` (training problems)
    and make the right call on ``sft_target_calls`` of it, on ``sft_stop_probes`` probes in a row; probes every
    ``sft_check_every`` steps, every ``sft_check_every_near`` steps while the last probe solved
    ``sft_near_accuracy``, and once ``sft_stop_probes`` probes in a row have, goes on at ``sft_near_lr_factor`` of
    the learning rate. When the tiny model "gets" copying varies with the seed and the CPU's kernels, and it
    gets it within a few steps, so a coarse probe let SFT overshoot (44% on the probe, 49.7% held-out) and left
    GRPO, which ends near 52-63% from a start with the right call, no room. The solve rate alone stopped seed 3
    (``default`` kernels) on a lucky probe (7%, then 25%) with the right call on 41% of held-out problems, and
    GRPO, which mostly learns to copy the result, gained 13 points from there."""

    def __init__(self, probe, tokenizer, settings: ToolsDemoSettings):
        self.probe, self.tokenizer, self.settings = probe, tokenizer, settings
        self.near = 0  # probes in a row that solved sft_near_accuracy: probe every sft_check_every_near steps
        self.slowed = False  # the learning rate has dropped (after sft_stop_probes probes in a row near)
        self.in_a_row = 0  # probes in a row that met both targets

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        every = self.settings.sft_check_every_near if self.near else self.settings.sft_check_every
        if state.global_step % every == 0 and state.global_step < state.max_steps:
            label = f"SFT step {state.global_step}: probe of training problems"
            score = score_tools(model, self.tokenizer, self.probe, self.settings, label=label)
            self.near = self.near + 1 if score.solved >= self.settings.sft_near_accuracy else 0
            if self.near >= self.settings.sft_stop_probes and not self.slowed:
                self.slowed = True  # not on one lucky probe: seed 3 (AVX512) read 11% once among 2-9% at step 830
                scale_learning_rate(optimizer, lr_scheduler, self.settings.sft_near_lr_factor)
            self.in_a_row = self.in_a_row + 1 if meets_targets(score, self.settings) else 0
            control.should_training_stop = self.done

    @property
    def done(self) -> bool:
        """Whether the targets were met on ``sft_stop_probes`` probes in a row."""
        return self.in_a_row >= self.settings.sft_stop_probes


def scale_learning_rate(optimizer, lr_scheduler, factor: float) -> None:
    """Multiply the learning rate by ``factor`` from the next step on: the optimizer's current rate and the rate
    the (lambda) scheduler sets at each step from its ``base_lrs``."""
    if lr_scheduler is not None:
        lr_scheduler.base_lrs = [lr * factor for lr in lr_scheduler.base_lrs]
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["lr"] *= factor


def meets_targets(score: ToolScore, settings: ToolsDemoSettings) -> bool:
    """Whether one probe's ``score`` meets the warm start's two targets (solved and right call)."""
    return score.solved >= settings.sft_target_accuracy and score.right_call >= settings.sft_target_calls


def right_call(prompt: str, transcript: list[dict]) -> bool:
    """Whether the first turn of ``transcript`` (a rollout of ``prompt``, e.g. ``"123+456="``) is exactly the call
    the demo's transcripts teach, ``<call>calc("123+456")</call>``, whatever the model wrote after the result."""
    turns = [turn for turn in transcript if turn["role"] == "assistant"]
    return bool(turns) and turns[0]["content"].strip() == f'<call>calc("{prompt.rstrip("=")}")</call>'


def warm_start(tokenizer, settings: ToolsDemoSettings, out: Path):
    """The SFT warm start on ``sft_problems`` tool transcripts, stopped by ``_StopWithTool`` on a probe of other
    training problems: up to ``sft_attempts`` attempts of at most ``sft_steps`` steps, each from the same initial
    weights (``seed``) with its own data order (``data_seed`` seed + 1000 x attempt); the first at the targets is
    kept, else the last. Returns (model, its SFT steps, seconds of every attempt, attempts); attempt k > 1 trains
    in ``out``/sft-attempt-k."""
    rows = toy.tool_transcripts(
        toy.load_task("tools", "train", kind="rl", n=settings.sft_problems, seed=settings.seed)
    )
    probe = toy.load_task("tools", "train", kind="rl", n=settings.sft_probe_size, seed=settings.seed + 1)
    spent = 0.0
    for attempt in range(1, settings.sft_attempts + 1):
        model = toy.build_model(settings.model_size, seed=settings.seed, tokenizer=tokenizer)
        stop = _StopWithTool(probe, tokenizer, settings)
        steps, seconds = tools_sft(
            model,
            tokenizer,
            rows,
            settings,
            out / ("sft" if attempt == 1 else f"sft-attempt-{attempt}"),
            stop=stop,
            data_seed=settings.seed + 1000 * (attempt - 1),
        )
        spent += seconds
        if stop.done or attempt == settings.sft_attempts:
            return model, steps, spent, attempt
        print(
            f"treadle demo --task tools: SFT attempt {attempt} is not at its targets after {steps} steps; "
            f"starting again from the same initial weights with another data order",
            flush=True,
        )


def tools_sft(
    model,
    tokenizer,
    dataset,
    settings: ToolsDemoSettings,
    output_dir: Path,
    *,
    stop: _StopWithTool | None = None,
    max_steps: int | None = None,
    data_seed: int | None = None,
    batch_size: int | None = None,
) -> tuple[int, float]:
    """SFT ``model`` in place on ``dataset`` (prompt, completion) for ``max_steps`` (default ``sft_steps``) of
    ``batch_size`` rows (default ``sft_batch_size``) in the order of ``data_seed`` (default ``seed``), or until
    ``stop`` stops it; returns (steps, seconds)."""
    args = sft_warm_start(
        settings,
        output_dir,
        max_steps=max_steps or settings.sft_steps,
        data_seed=data_seed,
        per_device_train_batch_size=batch_size or settings.sft_batch_size,
        warmup_steps=settings.sft_warmup_steps,
        logging_steps=10,
        save_strategy="no",
        max_length=64,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(
        model, args, train_dataset=dataset, processing_class=tokenizer, callbacks=[] if stop is None else [stop]
    )
    start = time.time()
    trainer.train()
    return trainer.state.global_step, time.time() - start


def tools_grpo(model, tokenizer, settings: ToolsDemoSettings, output_dir: Path, *, use_tools: bool):
    """GRPO ``model`` in place with the exact-match reward, with or without the ``calc`` tool; returns (steps,
    seconds)."""
    args = GRPOConfig(
        output_dir=str(output_dir),
        max_steps=settings.grpo_steps,
        seed=settings.seed,
        learning_rate=settings.grpo_learning_rate,
        per_device_train_batch_size=settings.grpo_batch_size,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        beta=settings.grpo_beta,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=0.1,
        logging_steps=5,
        save_strategy="no",
        log_completions=use_tools,
        disable_tqdm=True,
        rollout_workers=0,  # calc takes microseconds: stepping it in the loop makes a seed exact
        # the no-tool control shows that GRPO has nothing to learn from without the tool (every reward
        # 0 on sums it cannot do): that is its expected result, not a fault, so its no-signal stop and
        # constant-reward warning are off (they stopped it at step 80 of seed 0); the tool run keeps all
        health_checks=None if use_tools else {"no_learning_signal": False, "constant_reward": False},
    )
    trainer = GRPOTrainer(
        model,
        reward_funcs=toy.addition_reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=toy.load_task("tools", "train", kind="rl", seed=settings.seed),
        tools=[toy.calc] if use_tools else None,
    )
    start = time.time()
    trainer.train()  # rollout_workers=0: no thread pool to close
    return trainer.state.global_step, time.time() - start


class ToolScore(NamedTuple):
    """One scoring of a policy: the fraction of problems solved (greedy exact match) and the fraction whose first
    turn is the right ``calc`` call (``right_call``; 0 without the tool)."""

    solved: float
    right_call: float


def score_tools(
    model,
    tokenizer,
    dataset,
    settings: ToolsDemoSettings,
    completions_file: Path | None = None,
    *,
    use_tools: bool = True,
    batch_size: int = 250,
    label: str | None = None,
) -> ToolScore:
    """Greedy held-out exact match through ``GRPOTrainer.evaluate()``, the one way treadle measures a policy (as
    ``treadle.demos.addition``): each problem rolled out greedily (``eval_temperature=0``; with the ``calc`` tool
    unless ``use_tools`` is False) and scored by the exact-match reward, so ``eval_pass@1`` is the fraction solved; a
    ``compute_metrics`` counts the right calls and writes each transcript to ``completions_file``. Prints one line,
    ``[label] 35.3% of 300 solved, right call on 92.0%``, when a ``label`` (what is scored, at which stage and step) is
    given; never the evaluation's own log line, whose ``[step 0]`` would be the scoring trainer's step, not the
    stage's."""

    def calls_and_transcripts(prompts, completions, reward, answer, transcript=None, **columns):
        turns = transcript or [[{"role": "assistant", "content": completion}] for completion in completions]
        if completions_file is not None:
            with open(completions_file, "w") as f:
                for prompt, turn, ok, gold in zip(prompts, turns, reward, answer):
                    f.write(
                        json.dumps({"prompt": prompt, "transcript": turn, "answer": gold, "correct": ok == 1.0}) + "\n"
                    )
        return {"right_call": sum(map(right_call, prompts, turns)) / max(len(prompts), 1)}

    with tempfile.TemporaryDirectory(prefix="treadle-score-") as folder:
        args = GRPOConfig(
            output_dir=folder,
            seed=settings.seed,
            max_completion_length=settings.max_completion_length,
            num_generations_eval=1,
            eval_temperature=0.0,
            per_device_eval_batch_size=batch_size,
            disable_tqdm=True,
            save_strategy="no",
            rollout_workers=0,
        )
        trainer = GRPOTrainer(
            model,
            reward_funcs=toy.addition_reward,
            args=args,
            processing_class=tokenizer,
            eval_dataset=dataset,
            tools=[toy.calc] if use_tools else None,
            compute_metrics=calls_and_transcripts,
        )
        trainer.pop_callback(PrinterCallback)
        metrics = trainer.evaluate()  # rollout_workers=0: no thread pool to close
    score = ToolScore(metrics["eval_pass@1"], metrics["eval_right_call"])
    if label is not None:
        print(
            f"[{label}] {score.solved:.1%} of {len(dataset)} solved, right call on {score.right_call:.1%}", flush=True
        )
    return score
