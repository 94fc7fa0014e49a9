"""ms per optimizer step of treadle's GRPO and DPO with padded vs padding-free training forwards, and TRL's.

    python benchmarks/packing.py                 # tiny and small toy models, GRPO L64 / L256 and DPO, 3 rounds
    python benchmarks/packing.py --quick         # tiny model, fewer steps, 1 round: checks that it all runs
    python benchmarks/packing.py --sizes small --only "GRPO L256" --rounds 5

The work (the same for every contender; each builds its own copy of model and data):

- GRPO: G = 4 completions per prompt, 8 completions per micro-batch (2 prompts), one micro-batch per optimizer
  step, spg 1, beta 0, loss "dapo". Prompts are few-shot additions of 24 to 96 tokens. The completions are
  *prescribed*, not sampled: each is a function of its prompt's text and its index in the group, with a
  long-tailed length from 1 to L tokens (a Pareto tail: median about L/9, 1 in 30 truncated at L), ending
  with EOS when shorter than L. Sampling would give every contender different lengths by chance, and its cost
  is the same padded or not (benchmarks/generation.py measures it): the step here is the training forwards and
  the backward, where padding costs. treadle gets the completions from an overridden ``generate`` hook, TRL
  from an overridden ``_generate_single_turn``; both record the (prompt, length) sequence they trained on and
  the run asserts that the sequences are equal (TRL is given the prompts in treadle's sampler order with
  ``shuffle_dataset=False``).
- DPO: 8 pairs per step, prompts of 16 to 64 tokens, chosen and rejected responses of different long-tailed
  lengths (1 to 128 tokens), sigmoid loss, beta 0.1; TRL gets the pairs in treadle's sampler order.
- Contenders, in lockstep (benchmarks/trainers.py: threads that take turns one optimizer step at a time, on one
  core): treadle with ``padding_free=False`` (padded), treadle with ``padding_free=True`` (the default), and TRL
  float32 without gradient checkpointing (padded: TRL's GRPO has no padding-free option, and its DPO's is for
  flash attention). Each contender's settings are printed beside its row; the ones that must match are
  asserted.

Per run and contender: the mean over the timed steps (every step's work differs, in the same order for all);
the table gives the median over rounds, and the median over rounds of each round's ratio to treadle padded.
The last line is ``packed/padded step time: X`` for the GRPO L256 workload (the largest X over the model sizes
run).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time
import zlib
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import trainers as bench  # noqa: E402  (benchmarks/trainers.py: the lockstep runner and the shared settings)
from _machine import machine_header  # noqa: E402

GROUP, BATCH, DPO_LENGTH = 4, 8, 128
PADDED, PACKED, TRL = "treadle padded", "treadle padding-free", "TRL float32 (padded)"


def workloads(quick: bool) -> list[bench.Workload]:
    timed = 6 if quick else 16
    return [
        bench.Workload("GRPO L64", "grpo", warmup=2, timed=timed, completion_length=64),
        bench.Workload("GRPO L256", "grpo", warmup=2, timed=timed, completion_length=256),
        bench.Workload("DPO", "dpo", warmup=2, timed=timed),
    ]


def long_tailed_length(rng: random.Random, longest: int) -> int:
    """1..longest, Pareto-tailed: most short, a few long, about 1 in 30 at ``longest`` (for 64 and 256)."""
    return max(1, min(longest, int(rng.paretovariate(1.2) * longest / 16)))


def seeded(*key) -> random.Random:
    return random.Random(zlib.crc32("/".join(map(str, key)).encode()))


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------
def grpo_rows(n: int) -> list[dict]:
    rng = random.Random(3)
    return [{"prompt": bench.few_shot_prompt(rng, rng.randrange(24, 97))[0]} for _ in range(n)]


def dpo_rows(n: int) -> list[dict]:
    rng = random.Random(4)
    rows = []
    for _ in range(n):
        prompt, _ = bench.few_shot_prompt(rng, rng.randrange(16, 65))
        chosen, rejected = (
            "".join(rng.choice("0123456789+=") for _ in range(long_tailed_length(rng, DPO_LENGTH) - 1))
            for _ in range(2)
        )
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})  # + EOS each
    return rows


def completion_for(prompt: str, k: int, longest: int, tokenizer) -> list[int]:
    """The k-th completion of ``prompt``: digit tokens, EOS-terminated when shorter than ``longest``."""
    rng = seeded(prompt, k)
    n = long_tailed_length(rng, longest)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    ids = [rng.choice(digits) for _ in range(n)]
    if n < longest:
        ids[-1] = tokenizer.eos_token_id
    return ids


def length_reward(completion_ids, **kwargs) -> list[float]:
    return [float(len(ids) % 7) for ids in completion_ids]


def treadle_order(n: int, work: bench.Workload) -> list[int]:
    """The order in which treadle's trainer draws the ``n`` rows (GRPO: distinct prompts; DPO: pairs), seed 0."""
    from treadle.data import RepeatSampler, seeded_sampler

    if work.kind == "grpo":
        sampler = RepeatSampler(
            n, mini_repeat_count=GROUP, batch_size=BATCH // GROUP, repeat_count=1, shuffle=True, seed=0
        )
        return list(sampler)[::GROUP]
    return list(seeded_sampler(list(range(n)), seed=0, shuffle=True))


# ---------------------------------------------------------------------------------------------------------
# Contenders
# ---------------------------------------------------------------------------------------------------------
def treadle_grpo(work, size, steps, clock, output_dir, padding_free: bool) -> None:
    from treadle import GRPOConfig, GRPOTrainer
    from treadle.generation import GenerationOutput, completion_masks, left_pad

    tokenizer, model = bench.build(size)
    trained = []

    class Prescribed(GRPOTrainer):
        def generate(self, prompt_ids, *, num_generations, generator=None):
            rows = [
                completion_for(tokenizer.decode(p, skip_special_tokens=True), k, work.completion_length, tokenizer)
                for p in prompt_ids
                for k in range(num_generations)
            ]
            trained.extend(len(r) for r in rows)
            raw = torch.tensor([r + [tokenizer.pad_token_id] * (work.completion_length - len(r)) for r in rows])
            ids, mask = left_pad([p for p in prompt_ids for _ in range(num_generations)], tokenizer.pad_token_id)
            return GenerationOutput(
                ids, mask, *completion_masks(raw, (tokenizer.eos_token_id,), tokenizer.pad_token_id)
            )

    args = GRPOConfig(
        **bench._common(output_dir, steps),
        num_generations=GROUP,
        steps_per_generation=1,
        max_completion_length=work.completion_length,
        max_prompt_length=None,
        beta=0.0,
        epsilon=bench.EPSILON,
        loss_type="dapo",
        padding_free=padding_free,
    )
    trainer = Prescribed(
        model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=grpo_rows(steps * BATCH // GROUP),
        processing_class=tokenizer,
        callbacks=[bench._treadle_clock(clock)],
    )
    trainer.train()
    clock.settings.update(
        bench.trainer_settings(work, trainer, model),
        **{"padding free": padding_free, "work": zlib.crc32(str(trained).encode())},
    )


def trl_grpo(work, size, steps, clock, output_dir) -> None:
    import trl
    from datasets import Dataset

    tokenizer, model = bench.build(size)
    trained = []

    class Prescribed(trl.GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):  # TRL 1.x: one row per completion
            rows = [
                completion_for(
                    tokenizer.decode(p, skip_special_tokens=True), i % GROUP, work.completion_length, tokenizer
                )
                for i, p in enumerate(prompt_ids)
            ]
            trained.extend(len(r) for r in rows)
            return rows, None

    rows = grpo_rows(steps * BATCH // GROUP)
    rows = [rows[i] for i in treadle_order(len(rows), work)]
    args = trl.GRPOConfig(
        **bench._trl_common(output_dir, steps, defaults=False),
        num_generations=GROUP,
        steps_per_generation=1,
        max_completion_length=work.completion_length,
        temperature=1.0,
        beta=0.0,
        epsilon=bench.EPSILON,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        log_completions=False,
        shuffle_dataset=False,
    )
    trainer = Prescribed(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[bench._trl_clock(clock)],
    )
    trainer.train()
    clock.settings.update(
        bench.trainer_settings(work, trainer, model),
        **{"padding free": False, "work": zlib.crc32(str(trained).encode())},
    )


def treadle_dpo(work, size, steps, clock, output_dir, padding_free: bool) -> None:
    from treadle import DPOConfig, DPOTrainer

    tokenizer, model = bench.build(size)
    args = DPOConfig(
        **bench._common(output_dir, steps),
        beta=bench.BETA_DPO,
        max_length=None,
        max_prompt_length=None,
        padding_free=padding_free,
    )
    trainer = DPOTrainer(
        model,
        args=args,
        train_dataset=dpo_rows(steps * BATCH),
        processing_class=tokenizer,
        callbacks=[bench._treadle_clock(clock)],
    )
    trainer.train()
    clock.settings.update(bench.trainer_settings(work, trainer, model), **{"padding free": padding_free})


def trl_dpo(work, size, steps, clock, output_dir) -> None:
    import copy

    import trl
    from datasets import Dataset
    from torch.utils.data import SequentialSampler

    tokenizer, model = bench.build(size)

    class InOrder(trl.DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):  # the pairs come pre-ordered as treadle draws them
            return SequentialSampler(self.train_dataset)

    rows = dpo_rows(steps * BATCH)
    rows = [rows[i] for i in treadle_order(len(rows), work)]
    args = trl.DPOConfig(
        **bench._trl_common(output_dir, steps, defaults=False),
        beta=bench.BETA_DPO,
        max_length=None,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=False,
    )
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    trainer = InOrder(
        model=model,
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[bench._trl_clock(clock)],
    )
    trainer.train()
    clock.settings.update(bench.trainer_settings(work, trainer, model), **{"padding free": args.padding_free})


def contenders(kind: str, with_trl: bool) -> dict[str, Callable]:
    treadle = {"grpo": treadle_grpo, "dpo": treadle_dpo}[kind]
    out = {PADDED: lambda *a: treadle(*a, padding_free=False), PACKED: lambda *a: treadle(*a, padding_free=True)}
    if with_trl:
        out[TRL] = {"grpo": trl_grpo, "dpo": trl_dpo}[kind]
    return out


# ---------------------------------------------------------------------------------------------------------
# Running and reporting
# ---------------------------------------------------------------------------------------------------------
def timed_steps(steps: list[float], work: bench.Workload) -> list[float]:
    return steps[work.warmup : work.steps]


def check_same_work(size: str, work: bench.Workload, settings: dict[str, dict]) -> None:
    bench.check_settings(size, work, settings)
    works = {name: s.get("work") for name, s in settings.items() if s.get("work") is not None}
    if len(set(works.values())) > 1:
        raise AssertionError(
            f"{size} {work.name}: the contenders trained on different (prompt, completion length) sequences: {works}"
        )


def measure(sizes, works, rounds, with_trl, cpu) -> tuple[dict, dict]:
    results, settings = {}, {}
    for r in range(rounds):
        for size in sizes:
            for work in works:
                runners = list(contenders(work.kind, with_trl).items())
                shift = r % len(runners)
                runners = runners[shift:] + runners[:shift]
                seconds, reported = bench.run_lockstep(runners, work, size, cpu, summary=timed_steps)
                check_same_work(size, work, reported)
                settings.setdefault((size, work.name), {}).update(reported)
                cell = results.setdefault(
                    (size, work.name), {name: [] for name in (PADDED, PACKED, TRL) if name in dict(runners)}
                )
                for name, steps in seconds.items():
                    cell[name].append(statistics.fmean(steps) if isinstance(steps, list) else steps)
                line = "  ".join(f"{n} {1000 * v[-1]:.1f}" for n, v in cell.items())
                print(f"round {r + 1}/{rounds} {size:5s} {work.name:10s} ms/step: {line}", file=sys.stderr, flush=True)
    return results, settings


def label(s: dict, kind: str) -> str:
    if not s:
        return "(failed)"
    extra = f", {s['sampled tokens']:.1f} tok/compl" if kind == "grpo" else ""
    return (
        f"padding-free {s['padding free']}, {s['precision']}, {'ckpt' if s['grad checkpointing'] else 'no ckpt'}, "
        f"{s['loss']}, batch {s['batch']}{extra}"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, fewer steps, 1 round")
    parser.add_argument("--sizes", default=None, help="comma-separated toy model sizes (default tiny,small)")
    parser.add_argument("--only", default=None, help="workloads whose name starts with this ('GRPO L256', 'DPO')")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--no-trl", action="store_true", help="skip TRL even when installed")
    opts = parser.parse_args(argv)
    bench.single_malloc_arena()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sizes = opts.sizes.split(",") if opts.sizes else (["tiny"] if opts.quick else ["tiny", "small"])
    rounds = opts.rounds or (1 if opts.quick else 3)
    works = [w for w in workloads(opts.quick) if opts.only is None or w.name.startswith(opts.only)]
    with_trl = not opts.no_trl and bench.trl_installed()
    cpu = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    header, start = machine_header(), time.time()
    results, settings = measure(sizes, works, rounds, with_trl, cpu)
    print(
        f"\n### Padding-free GRPO / DPO: ms per optimizer step ({time.strftime('%Y-%m-%d')}, {rounds} round(s) in "
        f"lockstep on CPU {cpu}, 1 torch thread, {time.time() - start:.0f} s)\n\n{header}\n"
    )
    print("| model | workload | contender | mean ms/step (median of rounds) | vs treadle padded | settings |")
    print("|---|---|---|---:|---:|---|")
    worst = {}
    for (size, name), cell in results.items():
        kind = "grpo" if name.startswith("GRPO") else "dpo"
        for contender, values in cell.items():
            ok = [v for v in values if v == v]
            ratio = bench.ratio_to(values, cell[PADDED])
            med = f"{1000 * statistics.median(ok):.1f}" if ok else "failed"
            print(
                f"| {size} | {name} | {contender} | {med} | {ratio} | "
                f"{label(settings.get((size, name), {}).get(contender, {}), kind)} |"
            )
            if name == "GRPO L256" and contender == PACKED and ratio:
                worst[size] = float(ratio[:-1])
    for size, x in worst.items():
        print(f"\n{size}: GRPO L256 padding-free / padded step time {x:.3f}", end="")
    print()
    if worst:
        print(f"packed/padded step time: {max(worst.values()):.3f}")


if __name__ == "__main__":
    main()
