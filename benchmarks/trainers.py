"""ms per optimizer step of treadle's SFT, DPO and GRPO trainers against a plain PyTorch loop doing the same work,
and against TRL's SFTTrainer / DPOTrainer / GRPOTrainer when TRL is installed.

    python -m benchmarks.trainers --twin     # tiny and small toy models, every workload, 3 rounds (~25 min quiet)
    python -m benchmarks.trainers --quick    # tiny model, fewer steps, 2 rounds: checks that it all runs
    python -m benchmarks.trainers --only GRPO --sizes small --rounds 5

The work, the same for every contender (each builds its own copy of model and data; ``benchmarks._toy`` has the
model, data, optimizer and the hand-written loops):

- SFT: 8 rows of 128 tokens (124-token prompt, 3-token answer + EOS), loss on the completion tokens only.
- DPO (sigmoid loss, beta 0.1): 8 pairs, 60-token prompt and 16-token responses; one policy forward over the 16
  sequences, one reference forward without gradients, backward.
- GRPO: 8 completions per micro-step, G = 8 per prompt (64-token prompts), temperature 1, every completion exactly L
  tokens (the end token suppressed in every contender, ``generate``'s ``suppress_tokens``), beta 0, loss "dapo"; one
  generation of 8 x spg completions feeds spg optimizer steps (with spg > 1 the old log-probs are computed once per
  slice, as all three do). Treadle and the plain loop sample with treadle's own sampler (``backend="fast"``); TRL
  calls ``model.generate`` on the B*G repeated prompts, the way it works on CPU without vLLM, which is part of what is
  being compared. Treadle also corrects for sampling from the truncated distribution (its sampler's log-probs are
  exact), at no extra forward with one step per generation.

Contenders, in lockstep on one core (``benchmarks._lockstep``): the bare loop, the plain loop, (``--twin``) the plain
loop again, treadle, TRL float32, and TRL as its defaults configure it (bf16 autocast + gradient checkpointing: other
work, a labelled row). Each reports what it did (read from the trainer after training) and the run asserts that the
contenders match in loss, batch, sampled tokens and optimizer, and all but the TRL-defaults row in precision and
checkpointing. Per run and contender: the mean over the fastest half of the timed steps (other processes only ever add
time); the table gives the median and best over rounds, and the median over rounds of each round's ratio to the bare
and the plain loop. With ``--twin``, the twin's ratio to the plain loop shows how far apart two equal contenders land.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os

import torch

from benchmarks import harness
from benchmarks._lockstep import Workload, fastest_half, measure, pinned_cpu, single_malloc_arena
from benchmarks._toy import (
    BATCH,
    BETA_DPO,
    EPSILON,
    GROUP,
    GRPO_HEALTH_CHECKS,
    MUST_MATCH,
    MUST_MATCH_COMPARED,
    SFT_PROMPT,
    TRL_DEFAULTS,
    build,
    check_settings,
    common_args,
    fixed_length,
    items_per_step,
    plain_dpo,
    plain_grpo,
    plain_sft,
    rows_for,
    step_clock,
    trainer_settings,
    trl_args,
)
from treadle import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from treadle.demos.toy import addition_reward

NOTES = {  # what each contender is; what it did in each workload is read back from it and printed in its row
    "bare loop": "hand-written: an index permutation, no clipping, no schedule",
    "plain PyTorch": "hand-written: a DataLoader (SFT, DPO), clipping at 1.0, a linear schedule",
    "plain PyTorch (twin)": "the plain loop again (--twin): the noise floor of this run",
    "treadle": "SFTTrainer / DPOTrainer / GRPOTrainer, float32",
    "TRL float32": "TRL with bf16=False, gradient_checkpointing=False, optim adamw_torch",
    TRL_DEFAULTS: "TRL as its defaults configure it: other work, a labelled row, not a comparison",
}


def workloads(quick: bool) -> list[Workload]:
    scale = 1 if quick else 2
    rows = [Workload("SFT", "sft", warmup=3, timed=8 * scale), Workload("DPO", "dpo", warmup=3, timed=8 * scale)]
    for length in (16, 64):
        rows.append(Workload(f"GRPO L{length} spg1", "grpo", warmup=2, timed=4 * scale, completion_length=length))
        rows.append(
            Workload(f"GRPO L{length} spg4", "grpo", warmup=4, timed=8 * scale, completion_length=length, spg=4)
        )
    return rows


# ---------------------------------------------------------------------------------------------------------
# treadle
# ---------------------------------------------------------------------------------------------------------
def treadle_sft(work: Workload, size: str, steps: int, clock, output_dir: str) -> None:
    tokenizer, model = build(size)
    args = SFTConfig(**common_args(output_dir, steps), max_length=SFT_PROMPT + 4)
    data = rows_for(work, steps)
    trainer = SFTTrainer(model, args, train_dataset=data, processing_class=tokenizer, callbacks=[step_clock(clock)])
    trainer.train()
    clock.settings.update(trainer_settings(work, trainer, model))


def treadle_dpo(work: Workload, size: str, steps: int, clock, output_dir: str) -> None:
    tokenizer, model = build(size)
    args = DPOConfig(**common_args(output_dir, steps), beta=BETA_DPO, max_length=128, max_prompt_length=96)
    data = rows_for(work, steps)
    trainer = DPOTrainer(
        model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[step_clock(clock)]
    )
    trainer.train()
    clock.settings.update(trainer_settings(work, trainer, model))


def treadle_grpo(work: Workload, size: str, steps: int, clock, output_dir: str) -> None:
    tokenizer, model = build(size)
    args = GRPOConfig(
        **common_args(output_dir, steps),
        num_generations=GROUP,
        steps_per_generation=work.spg,
        max_completion_length=work.completion_length,
        max_prompt_length=None,
        temperature=1.0,
        beta=0.0,
        epsilon=EPSILON,
        loss_type="dapo",
        scale_rewards="group",
        generation_kwargs=fixed_length(tokenizer),
        health_checks=GRPO_HEALTH_CHECKS,
    )
    trainer = GRPOTrainer(
        model,
        reward_funcs=addition_reward,
        args=args,
        train_dataset=rows_for(work, steps),
        processing_class=tokenizer,
        callbacks=[step_clock(clock)],
    )
    trainer.train()
    clock.settings.update(trainer_settings(work, trainer, model))


# ---------------------------------------------------------------------------------------------------------
# TRL (an optional peer: the bench extra), float32 or as its defaults configure it
# ---------------------------------------------------------------------------------------------------------
def trl_trainer(kind: str, work: Workload, size: str, steps: int, clock, output_dir: str, defaults: bool):
    """TRL's trainer of ``kind`` built on the same model and rows as the others, trained, its settings reported."""
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback as TransformersCallback

    tokenizer, model = build(size)
    config, more = trl_config(kind, work, output_dir, steps, defaults, tokenizer), {}
    if kind == "dpo":  # TRL reloads its reference from the hub id when given none; ours has none: the same copy
        more["ref_model"] = copy.deepcopy(model).eval().requires_grad_(False)
    if kind == "grpo":
        more["reward_funcs"] = addition_reward
    trainer = getattr(trl, f"{kind.upper()}Trainer")(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(rows_for(work, steps)),
        processing_class=tokenizer,
        callbacks=[step_clock(clock, TransformersCallback)],
        **more,
    )
    trainer.train()
    clock.settings.update(trainer_settings(work, trainer, model))


def trl_config(kind: str, work: Workload, output_dir: str, steps: int, defaults: bool, tokenizer):
    """TRL's config for ``kind`` doing the same work."""
    import trl

    common = trl_args(output_dir, steps, defaults)
    if kind == "sft":
        return trl.SFTConfig(**common, max_length=SFT_PROMPT + 4, packing=False)
    if kind == "dpo":
        return trl.DPOConfig(
            **common, beta=BETA_DPO, max_length=128, loss_type=["sigmoid"], precompute_ref_log_probs=False
        )
    return trl.GRPOConfig(
        **common,
        num_generations=GROUP,
        steps_per_generation=work.spg,
        max_completion_length=work.completion_length,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=EPSILON,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        log_completions=False,
        generation_kwargs=fixed_length(tokenizer),
    )


# ---------------------------------------------------------------------------------------------------------
# Running and reporting
# ---------------------------------------------------------------------------------------------------------
def trl_installed() -> bool:
    return importlib.util.find_spec("trl") is not None


def contenders(kind: str, with_trl: bool, twin: bool = False, trl_defaults: bool = True) -> dict:
    """{row name: fn(work, size, steps, clock, output_dir)} for one workload kind, in ROWS order."""
    plain = {"sft": plain_sft, "dpo": plain_dpo, "grpo": plain_grpo}[kind]
    out = {
        "bare loop": lambda work, size, steps, clock, _dir: plain(work, size, steps, clock, bare=True),
        "plain PyTorch": lambda work, size, steps, clock, _dir: plain(work, size, steps, clock),
    }
    if twin:  # the plain loop again: its ratio to the first is the noise floor of this run
        out["plain PyTorch (twin)"] = out["plain PyTorch"]
    out["treadle"] = {"sft": treadle_sft, "dpo": treadle_dpo, "grpo": treadle_grpo}[kind]
    if with_trl:
        out["TRL float32"] = lambda *a: trl_trainer(kind, *a, defaults=False)
        if trl_defaults:
            out[TRL_DEFAULTS] = lambda *a: trl_trainer(kind, *a, defaults=True)
    return out


def settings_label(settings: dict, kind: str) -> str:
    """The contender's settings, short, for its row."""
    if not settings:
        return "(failed)"
    parts = [
        settings["precision"],
        "ckpt" if settings["grad checkpointing"] else "no ckpt",
        f"clip {settings['clip']}",
        f"sched {settings['schedule']}",
        settings["data"],
        settings["optimizer"],
    ]
    if kind == "grpo":
        parts.append(f"{settings['sampled tokens']:.1f} tok/compl")
    return ", ".join(str(p) for p in parts)


def report(run: harness.Run, results: dict, settings: dict, works: list[Workload]) -> str:
    """The markdown table, one row per (model, workload, contender); every row also goes to the run's record."""
    by_name, rows = {w.name: w for w in works}, []
    for (size, name), cell in results.items():
        work = by_name[name]
        items, unit = items_per_step(work)
        for contender, samples in cell.items():
            label = settings_label(settings.get((size, name), {}).get(contender, {}), work.kind)
            s = harness.spread(samples)
            vs_bare = harness.ratio_per_round(samples, cell.get("bare loop"))
            vs_plain = harness.ratio_per_round(samples, cell.get("plain PyTorch"))
            run.row(
                model=size,
                workload=name,
                contender=contender,
                seconds=s,
                vs_bare=vs_bare,
                vs_plain=vs_plain,
                settings=label,
            )
            if s["median"] is None:
                rows.append([size, name, contender, "failed", "", "", "", "", ""])
                continue
            rows.append(
                [size, name, contender, f"{1000 * s['median']:.1f}", f"{1000 * s['min']:.1f} - {1000 * s['max']:.1f}"]
                + [f"{items / s['median']:,.0f} {unit}", _x(vs_bare), _x(vs_plain), label]
            )
    header = ["model", "workload", "contender", "median ms/step", "range over rounds", "throughput (median)"]
    return harness.table(header + ["vs bare loop", "vs plain PyTorch", "settings"], rows)


def _x(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.3f}x"


def parse_args(argv=None):
    p = harness.parser(__doc__, "tiny model, fewer steps, 2 rounds")
    p.add_argument("--sizes", default=None, help="comma-separated toy model sizes (default tiny,small)")
    p.add_argument("--only", default=None, help="the workloads whose name starts with this (SFT, DPO, 'GRPO L64')")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (2 with --quick)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared machine)")
    p.add_argument(
        "--cpu", type=int, default=None, help="the CPU every contender runs on (default: the lowest; -1: any)"
    )
    p.add_argument("--no-trl", action="store_true", help="skip TRL even when installed")
    p.add_argument("--twin", action="store_true", help="a second plain loop: how far apart two equal contenders land")
    p.add_argument("--no-trl-defaults", action="store_true", help="skip the row of TRL as its defaults configure it")
    return p.parse_args(argv)


def main(argv=None) -> None:
    opts = parse_args(argv)
    single_malloc_arena()  # before any thread allocates
    allocator = harness.apply_allocator(opts.allocator)
    torch.set_num_threads(opts.threads)
    logging.disable(logging.WARNING)  # transformers / TRL notices
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run = harness.Run("trainers", opts)
    sizes = opts.sizes.split(",") if opts.sizes else (["tiny"] if opts.quick else ["tiny", "small"])
    rounds = opts.rounds or (2 if opts.quick else 3)
    works = [w for w in workloads(opts.quick) if opts.only is None or w.name.startswith(opts.only)]
    with_trl, cpu = not opts.no_trl and trl_installed(), pinned_cpu(opts.cpu)
    for name in contenders("sft", with_trl, opts.twin, not opts.no_trl_defaults):
        run.contender(name, allocator=allocator, cpu=cpu, threads=torch.get_num_threads(), note=NOTES[name])
    results, settings = measure(
        sizes,
        works,
        rounds,
        lambda work: contenders(work.kind, with_trl, opts.twin, not opts.no_trl_defaults),
        check_settings,
        fastest_half,
        cpu,
    )
    print(f"\n### Trainers: ms per optimizer step, {rounds} rounds in lockstep on CPU {cpu}\n")
    print(report(run, results, settings, works))
    print(
        f"\nEvery run asserted that its contenders match in {', '.join(MUST_MATCH)} and (all but the "
        f"{TRL_DEFAULTS!r} row) in {', '.join(MUST_MATCH_COMPARED)}."
    )
    if not with_trl:
        why = "skipped (--no-trl)" if opts.no_trl else "not installed (pip install -e '.[bench]')"
        print(f"\nTRL {why}: its rows are left out.")
    run.figure(batch=BATCH, rounds=rounds, trl=with_trl)
    run.finish()


if __name__ == "__main__":
    main()
