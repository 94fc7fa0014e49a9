"""A 262k vocabulary: does any trainer build a ``[B, T, V]`` logits tensor? One step of SFT, DPO, KTO, GRPO and
on-policy distillation on a real model (Gemma 3 270M by default: V = 262,144), each in a process of its own, on
treadle's path (log-probs and losses from the hidden states through the LM head in row chunks) and on the full-logits
path (the same trainer with the hidden-state seam switched off, so every forward returns the model's own logits).

    python -m benchmarks.lab.vocab_memory --threads 2                 # both paths, every trainer, Gemma 3 270M
    python -m benchmarks.lab.vocab_memory --model smollm2 --trainers sft,dpo
    python -m benchmarks.lab.vocab_memory --quick                     # SFT only, both paths

Each row gives the largest tensor the LM head returned during the step (a forward hook on ``lm_head``: the full path's
``[B, T, V]`` against the chunked path's ``[rows, V]``; the own sampler's decode step multiplies by the head's weight
in vocabulary slices and never calls the module), the seconds of the step, the process's RSS once the model(s) are
loaded and its peak (``ru_maxrss``) at the end. The optimizer is SGD, so that the peak is the model, its gradients
and the step's activations and logits, not an optimizer's moments. Work per step, the same on both paths: SFT 8 text
rows of about 120 tokens; DPO 4 pairs (8 sequences); KTO 8 rows; GRPO 2 prompts x 4 completions x 32 new tokens
(beta 0); distillation 2 prompts x 4 completions x 32 new tokens, the teacher a second copy of the model.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch

from benchmarks import harness

TRAINERS = ("sft", "dpo", "kto", "grpo", "distillation")
PATHS = ("chunked", "full-logits")
FACT = "The harbour ledger lists {} barrels of salt, {} crates of tea and {} sacks of grain, all counted twice."


def text_rows(kind: str, n: int) -> list[dict]:
    prompts = [f"Question: how much cargo came on day {i + 1}?\nAnswer:" for i in range(n)]
    answers = [" " + " ".join([FACT.format(12 + i, 7 + 2 * i, 30 + 3 * i)] * 3) for i in range(n)]  # ~110 tokens
    if kind == "sft":
        return [{"prompt": p, "completion": a} for p, a in zip(prompts, answers)]
    if kind == "dpo":
        return [{"prompt": p, "chosen": a, "rejected": a.replace("salt", "sand")} for p, a in zip(prompts, answers)]
    if kind == "kto":
        return [{"prompt": p, "completion": a, "label": i % 2 == 0} for i, (p, a) in enumerate(zip(prompts, answers))]
    return [{"prompt": p} for p in prompts]


def length_reward(completion_ids, **_):
    return [float(len(ids) % 5) for ids in completion_ids]


def build(kind: str, model, tokenizer, out: str):
    """The trainer of ``kind`` for one step (``text_rows``' work, SGD)."""
    from treadle import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer
    from treadle.trainers.distillation import DistillationConfig, DistillationTrainer

    common = dict(output_dir=out, max_steps=1, learning_rate=1e-5, optim="sgd", seed=0, save_strategy="no")
    common.update(report_to="none", disable_tqdm=True, logging_steps=1)
    if kind == "sft":
        args = SFTConfig(**common, per_device_train_batch_size=8, max_length=256)
        return SFTTrainer(model, args, train_dataset=text_rows(kind, 8), processing_class=tokenizer)
    if kind == "dpo":
        args = DPOConfig(**common, per_device_train_batch_size=4, max_length=256)
        return DPOTrainer(model, args=args, train_dataset=text_rows(kind, 4), processing_class=tokenizer)
    if kind == "kto":
        args = KTOConfig(**common, per_device_train_batch_size=8, max_length=256)
        return KTOTrainer(model, args=args, train_dataset=text_rows(kind, 8), processing_class=tokenizer)
    online = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=32, temperature=1.0)
    if kind == "grpo":
        args = GRPOConfig(**common, **online, beta=0.0)
        return GRPOTrainer(
            model, length_reward, args=args, train_dataset=text_rows(kind, 2), processing_class=tokenizer
        )
    args = DistillationConfig(**common, **online)
    teacher = copy.deepcopy(model)
    with torch.no_grad():  # a teacher with other weights (treadle refuses the student's very weights as a teacher)
        teacher.get_decoder().norm.weight.mul_(0.7)
    return DistillationTrainer(model, teacher, args=args, train_dataset=text_rows(kind, 2), processing_class=tokenizer)


def child(kind: str, path: str, model_key: str, threads: int) -> dict:
    """One step of ``kind`` on ``path`` in this process: the largest head output, seconds, RSS (MiB)."""
    from treadle.demos import real_models
    from treadle.logprobs import tokens
    from treadle.models import load_pretrained

    torch.set_num_threads(threads)
    model, tokenizer = load_pretrained(real_models.folder(model_key))
    largest = {"numel": 0, "shape": None}

    def record(_module, _args, output):
        if output.numel() > largest["numel"]:
            largest.update(numel=output.numel(), shape=list(output.shape))

    trainer = build(kind, model, tokenizer, tempfile.mkdtemp(prefix=f"vocab-{kind}-"))
    for each in {trainer.model, getattr(trainer, "teacher_model", None)} - {None}:
        each.get_output_embeddings().register_forward_hook(record)
        if path == "full-logits":
            tokens._FAST_PATH_CHECKED[each] = False  # the seam's own switch: fast_path_head() then says None
    loaded = harness.peak_rss_mib()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    return dict(largest, seconds=seconds, loaded_rss_mib=loaded, peak_rss_mib=harness.peak_rss_mib())


def main(argv=None) -> None:
    p = harness.parser(__doc__, "SFT only, both paths", allocator=False)
    p.add_argument("--model", default="gemma3", choices=("gemma3", "smollm2"))
    p.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma-separated, of {', '.join(TRAINERS)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", nargs=2, metavar=("TRAINER", "PATH"), help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.child:
        harness.child_result(child(*opts.child, opts.model, opts.threads))
        return
    run, rows = harness.Run("lab.vocab_memory", opts), []
    kinds = ["sft"] if opts.quick else opts.trainers.split(",")
    for kind in kinds:
        for path in PATHS:
            args = ["--child", kind, path, "--model", opts.model, "--threads", str(opts.threads)]
            env = dict(harness.allocator_env("glibc", treadle_contender=True), OMP_NUM_THREADS=str(opts.threads))
            r = harness.spawn("lab.vocab_memory", args, env)
            run.contender(f"{kind}/{path}", model=opts.model, threads=opts.threads)
            run.row(trainer=kind, path=path, **r)
            rows.append(
                [kind, path, "x".join(map(str, r["shape"] or [])), f"{r['seconds']:.1f}"]
                + [
                    f"{r['loaded_rss_mib']:.0f}",
                    f"{r['peak_rss_mib']:.0f}",
                    f"{r['peak_rss_mib'] - r['loaded_rss_mib']:.0f}",
                ]
            )
            print("row: " + " | ".join(rows[-1]), flush=True)  # each as it comes: a later failure keeps it
    print(f"\n### One step on {opts.model}, {opts.threads} thread(s), SGD: the chunked path against full logits\n")
    header = ["trainer", "path", "largest head output", "step s", "RSS loaded MiB", "peak RSS MiB", "step adds MiB"]
    print(harness.table(header, rows))
    run.finish()


if __name__ == "__main__":
    main()
