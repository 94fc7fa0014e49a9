"""Where the real model's time goes, op by op (torch.profiler), beside the float32 matmul roof measured in the same
run: treadle's SFT step on SmolLM2-135M-Instruct (``--what sft``), or one decode step of the own sampler
(``--what decode``) (docs/performance.md, where a step's time goes).

    python -m benchmarks.lab.profile --what sft --threads 2 [--compile] [--top 15]
    OMP_NUM_THREADS=1 python -m benchmarks.lab.profile --what decode --threads 1 --tokens 32
    python -m benchmarks.lab.profile --quick      # both, SFT on 2 rows, decode of 4 tokens at 16 rows

- ``sft``: the second optimizer step of ``SFTTrainer`` (8 x 128 tokens, ``benchmarks.real``'s rows; the first step
  pays allocation, and compilation with ``--compile``), each op's self time, matmul GFLOP/s (the profiler's FLOP
  count of mm / addmm / bmm over their self time), grouped into matmul, attention and the rest; the time under
  ``Optimizer.step``; and the bfloat16 matmul rate of the block's shapes against float32's (what moving the matmuls
  to bfloat16 would buy on this CPU).
- ``decode``: the profile of a whole ``sample_completions(backend="fast")`` call minus that of a call with 1 new token
  (the prefill and the first draw cancel out), over ``--tokens - 1`` steps, 8 chat prompts x ``--generations``.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import harness, real
from benchmarks.generation import ROOF_SHAPES, load_real, timed_call

MATMUL = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::matmul", "aten::linear")


def group(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    return "attention" if "attention" in name else "elementwise and the rest"


def profile_sft(threads: int, compiled: bool, batch: int):
    """(the profile of treadle's second SFT step, its wall seconds)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import treadle
    from treadle.demos import smollm2

    folder = smollm2.folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    args = treadle.SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="real-profile-"),
        max_steps=2,
        per_device_train_batch_size=batch,
        learning_rate=1e-5,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=2,
        max_length=None,
        packing=False,
        torch_compile=compiled,
    )
    state = {}

    class Profile(treadle.TrainerCallback):
        def on_step_begin(self, args, st, control, **kwargs):
            if st.global_step == 1:
                state["prof"] = profile(activities=[ProfilerActivity.CPU], with_flops=True).__enter__()
                state["start"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kwargs):
            if "prof" in state and "wall" not in state:
                state["wall"] = time.perf_counter() - state["start"]
                state["prof"].__exit__(None, None, None)

    rows = Dataset.from_list(real.token_rows(tokenizer, "sft", batch * 2))
    trainer = treadle.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.add_callback(Profile())
    trainer.train()
    return state["prof"], state["wall"]


def print_ops(events, total: float, top: int, per: float = 1.0) -> None:
    rows = []
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        seconds = e.self_cpu_time_total / 1e6 / per
        rate = f"{e.flops / per / seconds / 1e9:.0f}" if e.flops else "-"
        rows.append([f"`{e.key}`", f"{seconds:.4f}", f"{seconds / total:.0%}", f"{e.count / per:.0f}", rate])
    print(harness.table(["op", "self s", "share", "calls", "GFLOP/s"], rows))


def part_sft(run: harness.Run, opts) -> None:
    shapes = [(576, 576), (576, 1536), (576, 49152)]
    roof = harness.matmul_roof(1024, shapes)
    prof, wall = profile_sft(opts.threads, opts.compile, 2 if opts.quick else 8)
    roof = max(roof, harness.matmul_roof(1024, shapes))
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    print(
        f"\n### SFT step 2 ({'compiled' if opts.compile else 'eager'}), {opts.threads} threads: wall {wall:.2f} s, "
        f"ops' self time {total:.2f} s, float32 matmul roof {roof:.0f} GFLOP/s\n"
    )
    print_ops(events, total, opts.top)
    groups: dict[str, list[float]] = {}
    for e in events:
        seconds, flops = groups.setdefault(group(e.key), [0.0, 0.0])
        groups[group(e.key)] = [seconds + e.self_cpu_time_total / 1e6, flops + (e.flops or 0)]
    rows = []
    for name, (seconds, flops) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        rate = flops / seconds / 1e9 if flops else 0.0
        rows.append(
            [name, f"{seconds:.2f}", f"{seconds / total:.0%}"]
            + ([f"{rate:.0f}", f"{rate / roof:.0%}"] if flops else ["-", "-"])
        )
    print("\n" + harness.table(["group", "self s", "share", "GFLOP/s", "share of roof"], rows))
    step = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith("Optimizer.step")) / 1e6
    bf16 = harness.matmul_roof(1024, shapes[:2], dtype="bfloat16", repeats=1)  # the head's shape takes minutes
    fp32 = harness.matmul_roof(1024, shapes[:2], repeats=1)
    print(
        f"\nunder Optimizer.step: {step:.2f} s ({step / total:.0%}); bfloat16 matmul {bf16:.1f} GFLOP/s, "
        f"{bf16 / fp32:.3f}x float32's"
    )
    run.row(what="sft", wall=wall, roof=roof, groups=groups, optimizer_s=step, bf16_over_fp32=bf16 / fp32)


def part_decode(run: harness.Run, opts) -> None:
    tokens, generations = (4, 2) if opts.quick else (opts.tokens, opts.generations)
    model, prompts, params = load_real(tokens, generations)
    roof = harness.matmul_roof(len(prompts) * generations, ROOF_SHAPES, repeats=5)
    timed_call(model, prompts, params, "fast", 2)  # warm

    def ops(n: int) -> dict:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            timed_call(model, prompts, replace(params, max_new_tokens=n), "fast", n)
        return {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()}

    steps, one, full = tokens - 1, ops(1), ops(tokens)
    diff = {
        k: ((ms - one.get(k, (0.0, 0))[0]) / steps, (n - one.get(k, (0.0, 0))[1]) / steps)
        for k, (ms, n) in full.items()
    }
    total = sum(ms for ms, _ in diff.values())
    print(
        f"\n### One decode step, {len(prompts) * generations} rows, per op (self ms; calls; the {tokens}-token call "
        f"minus the 1-token call over {steps} steps): total {total:.1f} ms; roof {roof:.0f} GFLOP/s\n"
    )
    rows = [
        [f"`{k}`", f"{ms:.1f}", f"{n:.0f}", f"{ms / total:.0%}"]
        for k, (ms, n) in sorted(diff.items(), key=lambda kv: -kv[1][0])[: opts.top]
    ]
    print(harness.table(["op", "self ms", "calls", "share"], rows))
    run.row(
        what="decode", total_ms=total, roof=roof, ops=dict(sorted(diff.items(), key=lambda kv: -kv[1][0])[: opts.top])
    )


def main(argv=None) -> None:
    p = harness.parser(__doc__, "both, SFT on 2 rows, decode of 4 tokens at 16 rows")
    p.add_argument("--what", default="sft", help="comma-separated: sft, decode")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="sft: profile with torch_compile (inductor)")
    p.add_argument("--tokens", type=int, default=32, help="decode: new tokens per completion")
    p.add_argument("--generations", type=int, default=8, help="decode: completions per prompt (8 prompts)")
    p.add_argument("--top", type=int, default=15, help="ops listed")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.what, opts.top = "sft,decode", 8
    allocator = harness.apply_allocator(opts.allocator)
    torch.set_num_threads(opts.threads)
    run = harness.Run("lab.profile", opts)
    for what in opts.what.split(","):
        run.contender(what, threads=opts.threads, allocator=allocator, compiled=opts.compile)
        {"sft": part_sft, "decode": part_decode}[what](run, opts)
    run.finish()


if __name__ == "__main__":
    main()
