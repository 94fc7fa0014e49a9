"""Memory and time per step of every trainer on the real models, and whether any trainer builds a ``[B, T, V]`` logits
tensor. One step of SFT, DPO, KTO, GRPO, reward and on-policy distillation after a warm-up step, on
SmolLM2-135M-Instruct (V = 49,152) and Gemma 3 270M (V = 262,144), float32, each trainer in a process of its own (its
peak RSS is its own), on treadle's path (log-probs and losses from the hidden states through the LM head in row
chunks) and, with ``--paths chunked,full-logits``, on the full-logits path (the same trainer with the hidden-state
seam switched off, so every forward returns the model's own logits).

    python -m benchmarks.lab.vocab_memory --threads 2      # the table of docs/models.md: both models, every trainer
    python -m benchmarks.lab.vocab_memory --models gemma3 --paths chunked,full-logits --trainers sft,dpo
    python -m benchmarks.lab.vocab_memory --quick          # SFT on SmolLM2, chunked, one step

Each row gives the largest tensor the LM head returned during the steps (a forward hook on ``lm_head``: the full
path's ``[B, T, V]`` against the chunked path's ``[rows, 1, V]``; the own sampler's decode step multiplies by the
head's weight in vocabulary slices and never calls the module; the reward model has a one-output score head instead),
the seconds of the warm-up step (the one-time checks, the first allocations) and of the measured step after it (the
sampling included for GRPO and distillation), the process's RSS once the model(s) are loaded and its peak (VmHWM) at
the end. The optimizer is SGD, so that the peak is the model, its gradients and the step's activations and logits, not
an optimizer's moments (AdamW adds 8 bytes per parameter: 1.0 GiB for SmolLM2, 2.0 GiB for Gemma 3). Work per step,
the same on both paths: SFT 8 text rows of about 100 tokens; DPO 4 pairs (8 sequences); KTO 8 rows (and their 8 KL
rows); reward 4 pairs; GRPO 2 prompts x 4 completions x 32 new tokens (beta 0); distillation 2 prompts x 4 completions
x 32 new tokens, the teacher a second copy of the model.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch

from benchmarks import harness

TRAINERS = ("sft", "dpo", "kto", "grpo", "reward", "distillation")
MODELS = ("smollm2", "gemma3")
PATHS = ("chunked", "full-logits")
FACT = "The harbour ledger lists {} barrels of salt, {} crates of tea and {} sacks of grain, all counted twice."


def text_rows(kind: str, n: int) -> list[dict]:
    prompts = [f"Question: how much cargo came on day {i + 1}?\nAnswer:" for i in range(n)]
    answers = [" " + " ".join([FACT.format(12 + i, 7 + 2 * i, 30 + 3 * i)] * 3) for i in range(n)]  # ~110 tokens
    if kind == "sft":
        return [{"prompt": p, "completion": a} for p, a in zip(prompts, answers)]
    if kind in ("dpo", "reward"):
        return [{"prompt": p, "chosen": a, "rejected": a.replace("salt", "sand")} for p, a in zip(prompts, answers)]
    if kind == "kto":
        return [{"prompt": p, "completion": a, "label": i % 2 == 0} for i, (p, a) in enumerate(zip(prompts, answers))]
    return [{"prompt": p} for p in prompts]


def length_reward(completion_ids, **_):
    return [float(len(ids) % 5) for ids in completion_ids]


def build(kind: str, model, tokenizer, out: str):
    """The trainer of ``kind`` for a warm-up step and a measured one (``text_rows``' work, SGD); ``model`` is the
    reward model's folder for ``reward``."""
    from treadle import (
        DPOConfig,
        DPOTrainer,
        GRPOConfig,
        GRPOTrainer,
        KTOConfig,
        KTOTrainer,
        RewardConfig,
        RewardTrainer,
        SFTConfig,
        SFTTrainer,
    )
    from treadle.trainers.distillation import DistillationConfig, DistillationTrainer

    common = dict(output_dir=out, max_steps=2, learning_rate=1e-5, optim="sgd", seed=0, save_strategy="no")
    common.update(report_to="none", disable_tqdm=True, logging_steps=1)
    if kind == "sft":
        args = SFTConfig(**common, per_device_train_batch_size=8, max_length=256)
        return SFTTrainer(model, args, train_dataset=text_rows(kind, 16), processing_class=tokenizer)
    if kind == "dpo":
        args = DPOConfig(**common, per_device_train_batch_size=4, max_length=256)
        return DPOTrainer(model, args=args, train_dataset=text_rows(kind, 8), processing_class=tokenizer)
    if kind == "kto":
        args = KTOConfig(**common, per_device_train_batch_size=8, max_length=256)
        return KTOTrainer(model, args=args, train_dataset=text_rows(kind, 16), processing_class=tokenizer)
    if kind == "reward":
        args = RewardConfig(**common, per_device_train_batch_size=4, max_length=256)
        return RewardTrainer(model, args=args, train_dataset=text_rows(kind, 8), processing_class=tokenizer)
    online = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=32, temperature=1.0)
    if kind == "grpo":
        args = GRPOConfig(**common, **online, beta=0.0)
        return GRPOTrainer(
            model, length_reward, args=args, train_dataset=text_rows(kind, 4), processing_class=tokenizer
        )
    args = DistillationConfig(**common, **online)
    teacher = copy.deepcopy(model)
    with torch.no_grad():  # a teacher with other weights (treadle refuses the student's very weights as a teacher)
        teacher.get_decoder().norm.weight.mul_(0.7)
    return DistillationTrainer(model, teacher, args=args, train_dataset=text_rows(kind, 4), processing_class=tokenizer)


def step_clock():
    """A callback timing each optimizer step (``on_step_begin`` to ``on_step_end``) into its ``seconds`` list."""
    from treadle import TrainerCallback

    class StepClock(TrainerCallback):
        seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.started)

    return StepClock()


def child(kind: str, path: str, model_key: str, threads: int) -> dict:
    """A warm-up step and a measured step of ``kind`` on ``path`` in this process: the largest head output, the
    seconds of each step, RSS (MiB) once loaded and at its peak."""
    from transformers import AutoTokenizer

    from treadle.demos import real_models
    from treadle.logprobs import tokens
    from treadle.models import load_pretrained

    torch.set_num_threads(threads)
    folder = str(real_models.folder(model_key))
    if kind == "reward":  # the trainer loads the folder with a one-output score head (no LM head, no logits)
        model, tokenizer = folder, AutoTokenizer.from_pretrained(folder)
    else:
        model, tokenizer = load_pretrained(folder)
    largest = {"numel": 0, "shape": None}

    def record(_module, _args, output):
        if output.numel() > largest["numel"]:
            largest.update(numel=output.numel(), shape=list(output.shape))

    trainer = build(kind, model, tokenizer, tempfile.mkdtemp(prefix=f"vocab-{kind}-"))
    clock = step_clock()
    trainer.add_callback(clock)
    for each in {trainer.model, getattr(trainer, "teacher_model", None)} - {None}:
        head = each.get_output_embeddings() if kind != "reward" else None
        if head is not None:
            head.register_forward_hook(record)
        if path == "full-logits":
            tokens._FAST_PATH_CHECKED[each] = False  # the seam's own switch: fast_path_head() then says None
    loaded = harness.peak_rss_mib()
    trainer.train()
    warmup, step = clock.seconds
    return dict(largest, warmup_s=warmup, step_s=step, loaded_rss_mib=loaded, peak_rss_mib=harness.peak_rss_mib())


def run_one(kind: str, path: str, model_key: str, threads: int) -> dict:
    """``child`` in a process of its own, glibc's allocator defaults, ``threads`` OpenMP threads."""
    args = ["--child", kind, path, "--models", model_key, "--threads", str(threads)]
    env = dict(harness.allocator_env("glibc", treadle_contender=True), OMP_NUM_THREADS=str(threads))
    return harness.spawn("lab.vocab_memory", args, env)


def row_of(model_key: str, kind: str, path: str, r: dict) -> list[str]:
    shape = "x".join(map(str, r["shape"])) if r["shape"] else "none (score head)"
    seconds = [f"{r['warmup_s']:.1f}", f"{r['step_s']:.1f}"]
    memory = [f"{r['loaded_rss_mib']:,.0f}", f"{r['peak_rss_mib']:,.0f}"]
    return [model_key, kind, path, shape, *seconds, *memory, f"{r['peak_rss_mib'] - r['loaded_rss_mib']:,.0f}"]


def main(argv=None) -> None:
    p = harness.parser(__doc__, "SFT on SmolLM2, chunked, one step after the warm-up", allocator=False)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma-separated, of {', '.join(TRAINERS)}")
    p.add_argument("--paths", default="chunked", help=f"comma-separated, of {', '.join(PATHS)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", nargs=2, metavar=("TRAINER", "PATH"), help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.child:
        harness.child_result(child(*opts.child, opts.models, opts.threads))
        return
    run, rows = harness.Run("lab.vocab_memory", opts), []
    models, kinds, paths = (x.split(",") for x in (opts.models, opts.trainers, opts.paths))
    if opts.quick:
        models, kinds, paths = ["smollm2"], ["sft"], ["chunked"]
    for model_key in models:
        for kind in kinds:
            for path in paths:
                if kind == "reward" and path == "full-logits":
                    continue  # a score head: no vocabulary logits on either path
                run.contender(f"{model_key}/{kind}/{path}", model=model_key, threads=opts.threads)
                try:
                    r = run_one(kind, path, model_key, opts.threads)
                except RuntimeError as error:  # one trainer's failure keeps the others' rows; the message says why
                    print(f"row: {model_key} | {kind} | {path} | FAILED: {str(error)[-1500:]}", flush=True)
                    continue
                run.row(model=model_key, trainer=kind, path=path, **r)
                rows.append(row_of(model_key, kind, path, r))
                print("row: " + " | ".join(rows[-1]), flush=True)  # each as it comes: a later failure keeps it
    print(f"\n### A warm-up step, then one step measured: {opts.threads} thread(s), float32, SGD\n")
    header = ["model", "trainer", "path", "largest head output", "warm-up s", "step s", "RSS loaded MiB"]
    print(harness.table(header + ["peak RSS MiB", "steps add MiB"], rows))
    run.finish()


if __name__ == "__main__":
    main()
