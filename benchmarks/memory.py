"""Memory: per-token log-probs (chunked against the full log-softmax), a LoRA policy's reference (adapters off against
a full copy), and each trainer's step on the real model (seconds and peak RSS).

    python -m benchmarks.memory                           # every part: logprobs, peft, steps
    python -m benchmarks.memory --parts logprobs          # V = 128256, B x T = 8 x 1024, H = 1024
    python -m benchmarks.memory --parts peft --size base  # the `base` toy model (33.6M)
    python -m benchmarks.memory --parts steps --threads 1
    python -m benchmarks.memory --quick                   # V = 32000, 2 x 1024, H = 512; toy tiny; 2 real steps

- ``logprobs``: ``logp[label]`` for N = B x T rows from hidden states ``(N, H)`` and an LM head ``(V, H)``, forward and
  backward to both: "full" is ``log_softmax(hidden @ W.T).gather``, "chunked" ``treadle.logprobs.chunked_token_logps``.
  The peak of tensor memory allocated during the call above what was live before it (``harness.peak_memory``: on CPU
  every allocation and free of torch's allocator; scratch memory of BLAS libraries is not counted, in either).
- ``peft``: DPO and GRPO (beta > 0) with a LoRA policy (r 16, all-linear), each configuration in a process of its own:
  ``lora-adapters-off`` (no ``ref_model``: the policy with its adapters disabled is the reference, what treadle does),
  ``lora-full-copy`` (``ref_model=`` a frozen deep copy of the base model) and ``full-ft`` (full fine-tuning, the
  reference a frozen copy), for scale. Peak tensor memory from just before the trainer is built to the end of 3 steps,
  above the base model, and the process's peak RSS.
- ``steps``: SFT, DPO and GRPO on SmolLM2-135M-Instruct (float32, AdamW lr 1e-5, full fine-tuning, no eval, no
  saving), each in its own process: the seconds of each optimizer step (the median of steps 2..; the first pays the
  optimizer's state) and the peak RSS after loading and after training: what a user should expect on a small CPU.

Every process keeps freed memory unless ``--allocator glibc`` (each row says which): peak RSS depends on it.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch

from benchmarks import harness
from treadle.logprobs.tokens import chunked_token_logps

PARTS = ("logprobs", "peft", "steps")
PEFT_MODES = ("lora-adapters-off", "lora-full-copy", "full-ft")
ANSWER = "Adding the tens and then the ones gives the total. The answer is {}."


# ---------------------------------------------------------------------------------------------------------
# logprobs: full log-softmax against the chunked path
# ---------------------------------------------------------------------------------------------------------
def full_logps(hidden, weight, labels):
    logits = hidden @ weight.t()  # (N, V)
    return torch.log_softmax(logits.float(), dim=-1).gather(1, labels[:, None]).squeeze(1)


def logprob_inputs(n: int, vocab: int, hidden_size: int, dtype, device: str):
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = (torch.randn(n, hidden_size, generator=g) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).to(device, dtype).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, (n,), generator=g).to(device)


def part_logprobs(run: harness.Run, opts) -> None:
    vocab, batch, hidden_size = (32000, 2, 512) if opts.quick else (opts.vocab, opts.batch, opts.hidden)
    n, dtype = batch * opts.seq, getattr(torch, opts.dtype)
    hidden, weight, labels = logprob_inputs(n, vocab, hidden_size, dtype, opts.device)
    contenders = {
        "full log-softmax": full_logps,
        f"chunked ({opts.chunk_size} rows)": lambda h, w, y: chunked_token_logps(h, w, y, chunk_size=opts.chunk_size),
    }
    results, grads = {}, {}
    for name, fn in contenders.items():
        run.contender(name, part="logprobs", V=vocab, N=f"{batch}x{opts.seq}", H=hidden_size, dtype=opts.dtype)
        hidden.grad = weight.grad = None
        start = time.perf_counter()
        _, peak = harness.peak_memory(lambda fn=fn: fn(hidden, weight, labels).sum().backward(), opts.device)
        results[name] = (peak, time.perf_counter() - start)
        grads[name] = (hidden.grad.float(), weight.grad.float())
    (full_mib, _), (chunk_mib, _) = results.values()
    diff = max((a - b).abs().max().item() for a, b in zip(*grads.values()))
    rows = [[name, f"{mib:.0f}", f"{seconds:.2f}"] for name, (mib, seconds) in results.items()]
    for name, (mib, seconds) in results.items():
        run.row(part="logprobs", contender=name, peak_mib=mib, seconds=seconds)
    print(f"\n### Per-token log-probs, forward + backward: V={vocab}, N={n}, H={hidden_size}, {opts.device}\n")
    print(harness.table(["method", "peak above inputs (MiB)", "time (s)"], rows))
    print(f"\nratio chunked / full: {chunk_mib / full_mib:.3f}; max |grad difference|: {diff:.2e}")
    run.figure(logprobs_chunked_over_full=chunk_mib / full_mib, logprobs_grad_difference=diff)


# ---------------------------------------------------------------------------------------------------------
# peft: the reference of a LoRA policy
# ---------------------------------------------------------------------------------------------------------
def peft_trainer(trainer_name: str, mode: str, size: str, device: str, output_dir: str):
    """A function that builds the trainer of one configuration (on a base model built now)."""
    from peft import LoraConfig  # optional: the peft extra

    from treadle import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer
    from treadle.demos import toy

    tokenizer = toy.build_tokenizer()
    model = toy.build_model(size, tokenizer=tokenizer).to(device)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    kwargs = {} if mode == "full-ft" else {"peft_config": lora}
    common = dict(output_dir=output_dir, max_steps=3, learning_rate=1e-3, logging_steps=1, save_strategy="no")
    common.update(disable_tqdm=True, report_to="none")

    def make():
        kwargs["ref_model"] = copy.deepcopy(model) if mode == "lora-full-copy" else None
        if trainer_name == "dpo":
            args = DPOConfig(per_device_train_batch_size=8, **common)
            data = toy.load_task("addition", kind="preference", n=64)
            return DPOTrainer(model, args=args, train_dataset=data, processing_class=tokenizer, **kwargs)
        args = GRPOConfig(
            per_device_train_batch_size=16, num_generations=8, max_completion_length=8, beta=0.04, **common
        )
        data = toy.load_task("addition", kind="rl", n=64)
        return GRPOTrainer(
            model, toy.addition_reward, args=args, train_dataset=data, processing_class=tokenizer, **kwargs
        )

    return make


def peft_child(trainer_name: str, mode: str, size: str, device: str, output_dir: str) -> dict:
    from treadle.peft import parameter_counts

    allocator = harness.apply_allocator()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    make = peft_trainer(trainer_name, mode, size, device, output_dir)

    def build_and_train():
        trainer = make()
        trainer.train()
        return trainer

    trainer, peak = harness.peak_memory(build_and_train, device)
    trainable, total = parameter_counts(trainer.model)
    reference = getattr(trainer, "ref_model", None)
    ref_bytes = sum(p.numel() * p.element_size() for p in reference.parameters()) if reference is not None else 0
    return {
        "trainer": trainer_name,
        "mode": mode,
        "peak_mib": peak,
        "trainable": trainable,
        "total": total,
        "reference_copy_mib": ref_bytes / harness.MiB,
        "peak_rss_mib": harness.peak_rss_mib(),
        "allocator": allocator,
    }


def part_peft(run: harness.Run, opts) -> None:
    size, rows = "tiny" if opts.quick else opts.size, []
    for trainer_name in ("dpo", "grpo"):
        for mode in PEFT_MODES:  # a run folder belongs to one run: each configuration gets its own
            folder = str(run.out / f"peft-{trainer_name}-{mode}")
            env = harness.allocator_env(opts.allocator, treadle_contender=True)
            args = ["--child-peft", trainer_name, mode, "--size", size, "--device", opts.device, "--out", folder]
            r = harness.spawn("memory", args, env=env)
            run.contender(f"{trainer_name} {mode}", part="peft", model=f"toy {size}", allocator=r["allocator"])
            run.row(part="peft", **r)
            rows.append(
                [r["trainer"], r["mode"], f"{r['trainable']:,} / {r['total']:,}", f"{r['reference_copy_mib']:.1f}"]
                + [f"{r['peak_mib']:.1f}", f"{r['peak_rss_mib']:.0f}"]
            )
    print(f"\n### toy {size} on {opts.device}: peak tensor memory of building + 3 steps, above the base model\n")
    header = ["trainer", "mode", "trainable / total params", "reference copy (MiB)", "peak (MiB)", "peak RSS (MiB)"]
    print(harness.table(header, rows))


# ---------------------------------------------------------------------------------------------------------
# steps: each trainer on the real model
# ---------------------------------------------------------------------------------------------------------
def chat_rows(kind: str, n: int) -> list[dict]:
    pairs = [(17 + 3 * i, 25 + 5 * i) for i in range(n)]
    question = "What is {} + {}? Explain briefly, then give the number."
    user = [[{"role": "user", "content": question.format(a, b)}] for a, b in pairs]
    answer = [[{"role": "assistant", "content": ANSWER.format(a + b + wrong)}] for a, b in pairs for wrong in (0, 10)]
    if kind == "sft":
        return [{"prompt": u, "completion": answer[2 * i]} for i, u in enumerate(user)]
    if kind == "dpo":
        return [{"prompt": u, "chosen": answer[2 * i], "rejected": answer[2 * i + 1]} for i, u in enumerate(user)]
    return [{"prompt": u, "answer": str(a + b)} for u, (a, b) in zip(user, pairs)]


def contains_answer(completions, answer, **_):
    return [float(a in (c if isinstance(c, str) else c[-1]["content"])) for c, a in zip(completions, answer)]


def step_trainer(kind: str, steps: int, model, tokenizer):
    """(trainer, what one step does) of ``kind`` on the real model."""
    from treadle import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    common = dict(output_dir=tempfile.mkdtemp(prefix=f"real-{kind}-"), max_steps=steps, learning_rate=1e-5)
    common.update(save_strategy="no", report_to="none", disable_tqdm=True, logging_steps=1, seed=0)
    if kind == "sft":
        args = SFTConfig(**common, per_device_train_batch_size=8, max_length=256)
        trainer = SFTTrainer(model, args, train_dataset=chat_rows("sft", 8 * steps), processing_class=tokenizer)
        return trainer, "8 chat prompt/completion rows per step, full fine-tuning"
    if kind == "dpo":
        args = DPOConfig(**common, per_device_train_batch_size=4, max_length=256)
        trainer = DPOTrainer(model, args=args, train_dataset=chat_rows("dpo", 4 * steps), processing_class=tokenizer)
        return trainer, "4 chat pairs per step (8 sequences), a frozen reference copy"
    args = GRPOConfig(
        **common, per_device_train_batch_size=16, num_generations=8, max_completion_length=32, temperature=1.0, beta=0
    )
    data = chat_rows("grpo", 2 * steps)
    trainer = GRPOTrainer(model, contains_answer, args=args, train_dataset=data, processing_class=tokenizer)
    return trainer, "2 chat prompts x 8 completions x 32 new tokens per step (own sampler), beta 0"


def steps_child(kind: str, steps: int, threads: int) -> dict:
    """One trainer's run in this process: settings, step times, peak RSS (MiB)."""
    from treadle import TrainerCallback
    from treadle.demos import smollm2
    from treadle.models import load_pretrained

    allocator = harness.apply_allocator()
    torch.set_num_threads(threads)
    model, tokenizer = load_pretrained(smollm2.folder())
    loaded, times = harness.peak_rss_mib(), []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    trainer, settings = step_trainer(kind, steps, model, tokenizer)
    trainer.add_callback(Clock())
    trainer.train()
    result = {"kind": kind, "settings": settings, "allocator": allocator, "step_s": times}
    return dict(result, loaded_rss_mib=loaded, peak_rss_mib=harness.peak_rss_mib())


def part_steps(run: harness.Run, opts) -> None:
    steps, rows = 2 if opts.quick else opts.steps, []
    for kind in ("sft", "dpo", "grpo"):
        env = harness.allocator_env(opts.allocator, treadle_contender=True)
        env.update(OMP_NUM_THREADS=str(opts.threads), TOKENIZERS_PARALLELISM="false")
        args = ["--child-steps", kind, "--steps", str(steps), "--threads", str(opts.threads)]
        r = harness.spawn("memory", args, env)
        run.contender(kind, part="steps", threads=opts.threads, allocator=r["allocator"], work=r["settings"])
        median = statistics.median(r["step_s"][1:] or r["step_s"])
        run.row(part="steps", **r, median_s=median)
        rows.append(
            [kind, r["settings"], f"{median:.2f}", " ".join(f"{t:.2f}" for t in r["step_s"])]
            + [f"{r['loaded_rss_mib']:.0f} MiB", f"{r['peak_rss_mib']:.0f} MiB"]
        )
    print(f"\n### SmolLM2-135M-Instruct, each trainer in its own process, {opts.threads} thread(s)\n")
    header = ["trainer", "settings", f"s/step (median of steps 2..{steps})", "all steps (s)", "RSS loaded", "peak RSS"]
    print(harness.table(header, rows))


def parse_args(argv=None):
    p = harness.parser(__doc__, "logprobs at V 32000, N 2x1024, H 512; peft on toy tiny; 2 real-model steps each")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default="small", choices=["tiny", "small", "base"], help="peft: the toy model")
    p.add_argument("--steps", type=int, default=4, help="steps: optimizer steps of each trainer")
    p.add_argument("--threads", type=int, default=2, help="steps: torch threads of each trainer's process")
    p.add_argument("--child-peft", nargs=2, metavar=("TRAINER", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--child-steps", metavar="KIND", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    opts = parse_args(argv)
    if opts.child_peft:
        harness.child_result(peft_child(*opts.child_peft, opts.size, opts.device, opts.out))
        return
    if opts.child_steps:
        harness.child_result(steps_child(opts.child_steps, opts.steps, opts.threads))
        return
    run = harness.Run("memory", opts)
    parts = {"logprobs": part_logprobs, "peft": part_peft, "steps": part_steps}
    for name in opts.parts.split(","):
        parts[name](run, opts)
    run.finish()


if __name__ == "__main__":
    main()
