"""ms per optimizer step of treadle's GRPO and DPO with padded vs padding-free training forwards, and TRL's.

    python -m benchmarks.packing                 # tiny and small toy models, GRPO L64 / L256 and DPO, 3 rounds
    python -m benchmarks.packing --quick         # tiny model, fewer steps, 1 round: checks that it all runs
    python -m benchmarks.packing --sizes small --only "GRPO L256" --rounds 5

The work (the same for every contender; each builds its own copy of model and data):

- GRPO: G = 4 completions per prompt, 8 completions per micro-batch (2 prompts), one micro-batch per optimizer
  step, spg 1, beta 0, loss "dapo". Prompts are few-shot additions of 24 to 96 tokens. The completions are
  *prescribed*, not sampled: each is a function of its prompt's text and its index in the group, with a
  long-tailed length from 1 to L tokens (a Pareto tail: median about L/9, 1 in 30 truncated at L), ending
  with EOS when shorter than L. Sampling would give every contender different lengths by chance, and its cost
  is the same padded or not (``benchmarks.generation`` measures it): the step here is the training forwards and
  the backward, where padding costs. treadle gets the completions from an overridden ``generate`` hook, TRL
  from an overridden ``_generate_single_turn``; both record the (prompt, length) sequence they trained on and
  the run asserts that the sequences are equal (TRL is given the prompts in treadle's sampler order with
  ``shuffle_dataset=False``).
- DPO: 8 pairs per step, prompts of 16 to 64 tokens, chosen and rejected responses of different long-tailed
  lengths (1 to 128 tokens), sigmoid loss, beta 0.1; TRL gets the pairs in treadle's sampler order.
- Contenders, in lockstep (``benchmarks._lockstep``: threads that take turns one optimizer step at a time, on one
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

import copy
import logging
import os
import random
import zlib
from collections.abc import Callable

import torch

from benchmarks import harness
from benchmarks._lockstep import Workload, measure, pinned_cpu, single_malloc_arena, timed_mean
from benchmarks._toy import (
    BETA_DPO,
    EPSILON,
    build,
    check_settings,
    common_args,
    few_shot_prompt,
    step_clock,
    trainer_settings,
    trl_args,
)
from benchmarks.trainers import trl_installed
from treadle import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer
from treadle.data import RepeatSampler, seeded_sampler
from treadle.generation import GenerationOutput, completion_masks, left_pad

GROUP, BATCH, DPO_LENGTH = 4, 8, 128
PADDED, PACKED, TRL = "treadle padded", "treadle padding-free", "TRL float32 (padded)"


def workloads(quick: bool) -> list[Workload]:
    timed = 6 if quick else 16
    return [
        Workload("GRPO L64", "grpo", warmup=2, timed=timed, completion_length=64),
        Workload("GRPO L256", "grpo", warmup=2, timed=timed, completion_length=256),
        Workload("DPO", "dpo", warmup=2, timed=timed),
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
    return [{"prompt": few_shot_prompt(rng, rng.randrange(24, 97))[0]} for _ in range(n)]


def dpo_rows(n: int) -> list[dict]:
    rng = random.Random(4)
    rows = []
    for _ in range(n):
        prompt, _ = few_shot_prompt(rng, rng.randrange(16, 65))
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


def treadle_order(n: int, work: Workload) -> list[int]:
    """The order in which treadle's trainer draws the ``n`` rows (GRPO: distinct prompts; DPO: pairs), seed 0."""
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
    tokenizer, model = build(size)
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
        **common_args(output_dir, steps),
        num_generations=GROUP,
        steps_per_generation=1,
        max_completion_length=work.completion_length,
        max_prompt_length=None,
        beta=0.0,
        epsilon=EPSILON,
        loss_type="dapo",
        padding_free=padding_free,
    )
    trainer = Prescribed(
        model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=grpo_rows(steps * BATCH // GROUP),
        processing_class=tokenizer,
        callbacks=[step_clock(clock)],
    )
    trainer.train()
    clock.settings.update(
        trainer_settings(work, trainer, model),
        **{"padding free": padding_free, "work": zlib.crc32(str(trained).encode())},
    )


def trl_grpo(work, size, steps, clock, output_dir) -> None:
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback as TransformersCallback

    tokenizer, model = build(size)
    trained = []

    class Prescribed(trl.GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):  # TRL 1.x: one row per completion
            text = [tokenizer.decode(p, skip_special_tokens=True) for p in prompt_ids]
            rows = [completion_for(t, i % GROUP, work.completion_length, tokenizer) for i, t in enumerate(text)]
            trained.extend(len(r) for r in rows)
            return rows, None

    rows = grpo_rows(steps * BATCH // GROUP)
    args = trl.GRPOConfig(
        **trl_args(output_dir, steps, defaults=False),
        num_generations=GROUP,
        steps_per_generation=1,
        max_completion_length=work.completion_length,
        temperature=1.0,
        beta=0.0,
        epsilon=EPSILON,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        log_completions=False,
        shuffle_dataset=False,  # the prompts come in treadle's sampler order
    )
    trainer = Prescribed(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=Dataset.from_list([rows[i] for i in treadle_order(len(rows), work)]),
        processing_class=tokenizer,
        callbacks=[step_clock(clock, TransformersCallback)],
    )
    trainer.train()
    clock.settings.update(
        trainer_settings(work, trainer, model), **{"padding free": False, "work": zlib.crc32(str(trained).encode())}
    )


def treadle_dpo(work, size, steps, clock, output_dir, padding_free: bool) -> None:
    tokenizer, model = build(size)
    args = DPOConfig(
        **common_args(output_dir, steps),
        beta=BETA_DPO,
        max_length=None,
        max_prompt_length=None,
        padding_free=padding_free,
    )
    trainer = DPOTrainer(
        model,
        args=args,
        train_dataset=dpo_rows(steps * BATCH),
        processing_class=tokenizer,
        callbacks=[step_clock(clock)],
    )
    trainer.train()
    clock.settings.update(trainer_settings(work, trainer, model), **{"padding free": padding_free})


def trl_dpo(work, size, steps, clock, output_dir) -> None:
    import trl
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback as TransformersCallback

    tokenizer, model = build(size)

    class InOrder(trl.DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):  # the pairs come pre-ordered as treadle draws them
            return SequentialSampler(self.train_dataset)

    rows = dpo_rows(steps * BATCH)
    args = trl.DPOConfig(
        **trl_args(output_dir, steps, defaults=False),
        beta=BETA_DPO,
        max_length=None,
        loss_type=["sigmoid"],
        precompute_ref_log_probs=False,
    )
    trainer = InOrder(
        model=model,
        ref_model=copy.deepcopy(model).eval().requires_grad_(False),
        args=args,
        train_dataset=Dataset.from_list([rows[i] for i in treadle_order(len(rows), work)]),
        processing_class=tokenizer,
        callbacks=[step_clock(clock, TransformersCallback)],
    )
    trainer.train()
    clock.settings.update(trainer_settings(work, trainer, model), **{"padding free": args.padding_free})


def contenders(kind: str, with_trl: bool) -> dict[str, Callable]:
    treadle = {"grpo": treadle_grpo, "dpo": treadle_dpo}[kind]
    out = {PADDED: lambda *a: treadle(*a, padding_free=False), PACKED: lambda *a: treadle(*a, padding_free=True)}
    if with_trl:
        out[TRL] = {"grpo": trl_grpo, "dpo": trl_dpo}[kind]
    return out


# ---------------------------------------------------------------------------------------------------------
# Running and reporting
# ---------------------------------------------------------------------------------------------------------
def check_same_work(size: str, work: Workload, settings: dict[str, dict]) -> None:
    check_settings(size, work, settings)
    works = {name: s.get("work") for name, s in settings.items() if s.get("work") is not None}
    if len(set(works.values())) > 1:
        raise AssertionError(
            f"{size} {work.name}: the contenders trained on different (prompt, completion length) sequences: {works}"
        )


def label(s: dict, kind: str) -> str:
    if not s:
        return "(failed)"
    extra = f", {s['sampled tokens']:.1f} tok/compl" if kind == "grpo" else ""
    return (
        f"padding-free {s['padding free']}, {s['precision']}, {'ckpt' if s['grad checkpointing'] else 'no ckpt'}, "
        f"{s['loss']}, batch {s['batch']}{extra}"
    )


def report(run: harness.Run, results: dict, settings: dict) -> tuple[str, dict]:
    """(the markdown table, {model size: GRPO L256's padding-free / padded ratio})."""
    rows, packed = [], {}
    for (size, name), cell in results.items():
        kind = "grpo" if name.startswith("GRPO") else "dpo"
        for contender, values in cell.items():
            s, ratio = harness.spread(values), harness.ratio_per_round(values, cell[PADDED])
            shown = label(settings.get((size, name), {}).get(contender, {}), kind)
            run.row(model=size, workload=name, contender=contender, seconds=s, vs_padded=ratio, settings=shown)
            ms = "failed" if s["median"] is None else f"{1000 * s['median']:.1f}"
            spread = "" if s["median"] is None else f"{1000 * s['min']:.1f} - {1000 * s['max']:.1f}"
            rows.append([size, name, contender, ms, spread, "" if ratio is None else f"{ratio:.3f}x", shown])
            if name == "GRPO L256" and contender == PACKED and ratio is not None:
                packed[size] = ratio
    header = ["model", "workload", "contender", "mean ms/step (median of rounds)", "range", "vs treadle padded"]
    return harness.table(header + ["settings"], rows), packed


def main(argv=None) -> None:
    p = harness.parser(__doc__, "tiny model, fewer steps, 1 round")
    p.add_argument("--sizes", default=None, help="comma-separated toy model sizes (default tiny,small)")
    p.add_argument("--only", default=None, help="workloads whose name starts with this ('GRPO L256', 'DPO')")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (1 with --quick)")
    p.add_argument("--no-trl", action="store_true", help="skip TRL even when installed")
    opts = p.parse_args(argv)
    single_malloc_arena()  # before any thread allocates
    allocator = harness.apply_allocator(opts.allocator)
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run = harness.Run("packing", opts)
    sizes = opts.sizes.split(",") if opts.sizes else (["tiny"] if opts.quick else ["tiny", "small"])
    rounds = opts.rounds or (1 if opts.quick else 3)
    works = [w for w in workloads(opts.quick) if opts.only is None or w.name.startswith(opts.only)]
    with_trl, cpu = not opts.no_trl and trl_installed(), pinned_cpu(None)
    for name in contenders("grpo", with_trl):
        run.contender(name, allocator=allocator, cpu=cpu, threads=1)
    results, settings = measure(
        sizes, works, rounds, lambda w: contenders(w.kind, with_trl), check_same_work, timed_mean, cpu
    )
    print(f"\n### Padding-free GRPO / DPO: ms per optimizer step, {rounds} round(s) in lockstep on CPU {cpu}\n")
    text, packed = report(run, results, settings)
    print(text)
    for size, x in packed.items():
        print(f"\n{size}: GRPO L256 padding-free / padded step time {x:.3f}", end="")
    print()
    if packed:
        print(f"packed/padded step time: {max(packed.values()):.3f}")
        run.figure(packed_over_padded=max(packed.values()))
    run.finish()


if __name__ == "__main__":
    main()
