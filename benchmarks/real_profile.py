"""Where one SFT step of the real model spends its time: a per-op profile (torch.profiler) of treadle's SFT step on
SmolLM2-135M-Instruct (float32, 8 x 128 tokens, the settings of ``benchmarks/real.py``), grouped into what could
close the gap to the machine's float32 matmul roof, measured in the same run.

    python benchmarks/real_profile.py [--threads 2] [--compile] [--top 15]

The second optimizer step is profiled (the first pays allocation, and compilation with ``--compile``). Each op's
self time is its own (children excluded); matmul GFLOP/s is the profiler's FLOP count of ``mm`` / ``addmm`` /
``bmm`` / ``matmul`` over their self time. The groups:

- matmul: the linear layers and the LM head, forward and backward (``aten::mm``, ``addmm``, ``bmm``);
- attention: ``scaled_dot_product_attention`` and its backward (the flash / math kernels);
- elementwise and the rest: RMSNorm, SiLU, rotary embeddings, copies, the loss's softmax, AdamW's update, autograd's
  bookkeeping.

Beside the groups it prints the time under ``Optimizer.step`` (AdamW, all its ops) and the bfloat16 matmul rate of the
block's shapes against float32's: what moving the matmuls to bfloat16 would buy on this CPU (a CPU without AVX-512
BF16 or AMX converts and runs them far slower than float32).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))

from real import BATCH, matmul_roof, token_rows  # noqa: E402

MATMUL = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::matmul", "aten::linear")
ATTENTION = ("attention",)


def group(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if any(key in name for key in ATTENTION):
        return "attention"
    return "elementwise and the rest"


def profile_step(threads: int, compiled: bool):
    import torch
    from datasets import Dataset
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import treadle
    from treadle.demos import smollm2

    torch.set_num_threads(threads)
    folder = smollm2.folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    args = treadle.SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="real-profile-"),
        max_steps=2,
        per_device_train_batch_size=BATCH,
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
                state["prof"] = profile(activities=[ProfilerActivity.CPU], with_flops=True)
                state["prof"].__enter__()
                state["start"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kwargs):
            if "prof" in state and "wall" not in state:
                state["wall"] = time.perf_counter() - state["start"]
                state["prof"].__exit__(None, None, None)

    rows = Dataset.from_list(token_rows(tokenizer, "sft", BATCH * 2))
    trainer = treadle.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.add_callback(Profile())
    trainer.train()
    return state["prof"], state["wall"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="profile with torch_compile (inductor)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    from _machine import machine_header

    print(machine_header())
    roof = matmul_roof(args.threads)
    prof, wall = profile_step(args.threads, args.compile)
    roof = max(roof, matmul_roof(args.threads))
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    label = "treadle, torch_compile" if args.compile else "treadle"
    print(f"SFT step 2 ({label}), {args.threads} threads: wall {wall:.2f} s,")
    print(f"ops' self time {total:.2f} s; float32 matmul roof {roof:.0f} GFLOP/s (best of two measures)\n")
    print("| op | self s | share | calls | GFLOP/s |\n|---|---|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[: args.top]:
        seconds = e.self_cpu_time_total / 1e6
        rate = f"{e.flops / seconds / 1e9:.0f}" if e.flops else "-"
        print(f"| `{e.key}` | {seconds:.2f} | {seconds / total:.0%} | {e.count} | {rate} |")
    groups: dict[str, list[float]] = {}
    for e in events:
        seconds, flops = groups.setdefault(group(e.key), [0.0, 0.0])
        groups[group(e.key)] = [seconds + e.self_cpu_time_total / 1e6, flops + (e.flops or 0)]
    print("\n| group | self s | share | GFLOP/s | share of roof |\n|---|---|---|---|---|")
    for name, (seconds, flops) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        rate = flops / seconds / 1e9 if flops else 0.0
        cells = f"{rate:.0f} | {rate / roof:.0%}" if flops else "- | -"
        print(f"| {name} | {seconds:.2f} | {seconds / total:.0%} | {cells} |")
    step = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith("Optimizer.step")) / 1e6
    print(f"\nunder Optimizer.step (AdamW, every op): {step:.2f} s ({step / total:.0%})")
    bf16 = matmul_roof(args.threads, "bfloat16", cols=(576, 1536), repeats=1)  # the LM head's shape takes minutes
    fp32 = matmul_roof(args.threads, "float32", cols=(576, 1536), repeats=1)
    print(f"bfloat16 matmul, 1,024 x 576 by 576 x 576 and x 1,536: {bf16:.1f} GFLOP/s, {bf16 / fp32:.3f}x float32's")
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
