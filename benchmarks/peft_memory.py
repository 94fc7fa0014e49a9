"""Peak memory of DPO and GRPO (beta > 0) with a LoRA policy: the adapters-off reference vs a full reference copy.

    python benchmarks/peft_memory.py                 # the `small` toy model (4.2M parameters), CPU or CUDA
    python benchmarks/peft_memory.py --size base     # the `base` toy model (33.6M)

Each configuration runs in a process of its own (``--one TRAINER MODE``), so nothing one leaves behind is
counted in another. Modes:

- ``lora-adapters-off``: ``peft_config=LoraConfig(r=16, all-linear)``, no ``ref_model``: the policy with its
  adapters disabled is the reference (what treadle does).
- ``lora-full-copy``: the same LoRA policy, with ``ref_model=`` a frozen deep copy of the base model (what a
  trainer without the adapters-off path holds).
- ``full-ft``: full fine-tuning, the reference a frozen copy (treadle's default without PEFT), for scale.

What is measured, from just before the trainer is built (the base model already exists) to the end of
``train()``: the peak of tensor memory above what was live before, in MiB. On CUDA
``torch.cuda.max_memory_allocated``; on CPU the running sum of every allocation / free of torch's CPU
allocator (``torch.profiler`` with ``profile_memory=True``), plus the process's peak RSS for reference.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from _memory import MiB, peak_memory  # noqa: E402  (this folder is on sys.path when a script in it runs)

MODES = ("lora-adapters-off", "lora-full-copy", "full-ft")
TRAINERS = ("dpo", "grpo")


def build(trainer_name: str, mode: str, size: str, device: str, output_dir: str):
    from peft import LoraConfig

    from treadle import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer
    from treadle.demos import toy

    tokenizer = toy.build_tokenizer()
    model = toy.build_model(size, tokenizer=tokenizer).to(device)
    peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    kwargs = {} if mode == "full-ft" else {"peft_config": peft_config}
    common = dict(
        output_dir=output_dir,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
    )

    def make():
        ref_model = copy.deepcopy(model) if mode == "lora-full-copy" else None
        if trainer_name == "dpo":
            args = DPOConfig(per_device_train_batch_size=8, **common)
            data = toy.load_task("addition", kind="preference", n=64)
            return DPOTrainer(
                model, ref_model=ref_model, args=args, train_dataset=data, processing_class=tokenizer, **kwargs
            )
        args = GRPOConfig(
            per_device_train_batch_size=16, num_generations=8, max_completion_length=8, beta=0.04, **common
        )
        data = toy.load_task("addition", kind="rl", n=64)
        return GRPOTrainer(
            model,
            toy.addition_reward,
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
            ref_model=ref_model,
            **kwargs,
        )

    return make


def measure_one(trainer_name: str, mode: str, size: str, device: str, output_dir: str) -> dict:
    torch.manual_seed(0)
    make = build(trainer_name, mode, size, device, output_dir)

    def run():
        trainer = make()
        trainer.train()
        return trainer

    trainer, peak = peak_memory(run, device)
    from treadle.peft import parameter_counts

    trainable, total = parameter_counts(trainer.model)
    reference = getattr(trainer, "ref_model", None)
    ref_bytes = sum(p.numel() * p.element_size() for p in reference.parameters()) if reference is not None else 0
    return {
        "trainer": trainer_name,
        "mode": mode,
        "peak_mib": peak,
        "trainable": trainable,
        "total": total,
        "reference_copy_mib": ref_bytes / MiB,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loss": [e["loss"] for e in trainer.state.log_history if "loss" in e][:1],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--one", nargs=2, metavar=("TRAINER", "MODE"), help="measure one configuration (internal)")
    parser.add_argument("--output-dir", default=None, help="a folder for the runs (default: a new temporary one)")
    args = parser.parse_args(argv)
    if args.one:
        torch.set_num_threads(1)
        print(json.dumps(measure_one(*args.one, args.size, args.device, args.output_dir)))
        return
    rows, root = [], args.output_dir or tempfile.mkdtemp(prefix="treadle-peft-memory-")
    for trainer_name in TRAINERS:
        for mode in MODES:  # a run folder belongs to one run: each configuration gets its own
            run_dir = os.path.join(root, f"{trainer_name}-{mode}")
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    trainer_name,
                    mode,
                    "--size",
                    args.size,
                    "--device",
                    args.device,
                    "--output-dir",
                    run_dir,
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(
        f"toy:{args.size} on {args.device}; peak tensor memory during build + 3 training steps, above the base model"
    )
    print("| trainer | mode | trainable / total params | reference copy (MiB) | peak (MiB) | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['trainer']} | {r['mode']} | {r['trainable']:,} / {r['total']:,} | {r['reference_copy_mib']:.1f} | "
            f"{r['peak_mib']:.1f} | {r['peak_rss_mib']:.0f} |"
        )


if __name__ == "__main__":
    main()
