"""Per-step overhead of treadle's Trainer against a plain PyTorch loop (and transformers.Trainer when installed).

The same model, data, batch, optimizer (AdamW), clipping and schedule, in one process; the contenders are
interleaved and repeated, and we report the median and the best ms per optimizer step over the timed steps
(this VM's speed wanders by tens of percent for tens of seconds, so only same-run ratios mean anything).

    python benchmarks/overhead.py            # small model (~3.5M params), 5 rounds
    python benchmarks/overhead.py --quick    # tiny model, 2 rounds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from _machine import machine_header  # noqa: E402  (this folder is on sys.path when a script in it runs)

SIZES = {  # name: (hidden, layers, heads, vocab, seq_len, batch)
    "tiny": (64, 2, 4, 128, 64, 8),
    "small": (256, 4, 8, 1024, 128, 8),
}


def build_model(size: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, vocab, _, _ = SIZES[size]
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config)


def build_rows(size: str, n: int):
    _, _, _, vocab, seq, _ = SIZES[size]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r} for r in ids]


def plain_loop(size: str, steps: int) -> list[float]:
    """The baseline: what a careful engineer writes by hand."""
    from torch.utils.data import DataLoader

    batch = SIZES[size][-1]
    model = build_model(size)
    model.train()
    loader = DataLoader(
        build_rows(size, steps * batch),
        batch_size=batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
        collate_fn=lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]},
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / steps)
    times = [time.perf_counter()]
    for inputs in loader:
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


def treadle_loop(size: str, steps: int, tqdm: bool = False) -> list[float]:
    from treadle import Trainer, TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.times:
                self.times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    batch = SIZES[size][-1]
    clock = Clock()
    args = TrainingArguments(
        output_dir="/tmp/treadle-bench-overhead",
        max_steps=steps,
        per_device_train_batch_size=batch,
        learning_rate=1e-4,
        logging_steps=10**6,
        save_strategy="no",
        disable_tqdm=not tqdm,
        report_to="none",
    )
    trainer = Trainer(build_model(size), args, train_dataset=build_rows(size, steps * batch), callbacks=[clock])
    trainer.pop_callback(trainer.callback_handler.callbacks[1])  # metrics.jsonl: the final summary line only
    if tqdm:
        sys.stderr, saved = open(os.devnull, "w"), sys.stderr
    try:
        trainer.train()
    finally:
        if tqdm:
            sys.stderr = saved
    return [b - a for a, b in zip(clock.times, clock.times[1:])]


def transformers_loop(size: str, steps: int) -> list[float] | None:
    try:
        import transformers
    except ImportError:
        return None

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.times:
                self.times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    batch = SIZES[size][-1]
    clock = Clock()
    args = transformers.TrainingArguments(
        output_dir="/tmp/treadle-bench-hf",
        max_steps=steps,
        per_device_train_batch_size=batch,
        learning_rate=1e-4,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_pin_memory=False,
    )
    trainer = transformers.Trainer(
        model=build_model(size), args=args, train_dataset=build_rows(size, steps * batch), callbacks=[clock]
    )
    trainer.train()
    return [b - a for a, b in zip(clock.times, clock.times[1:])]


def summarise(samples: list[float], warmup: int) -> list[float]:
    return [1000 * s for s in samples[warmup:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rounds")
    parser.add_argument("--size", choices=sorted(SIZES), default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=30)
    opts = parser.parse_args()
    size = opts.size or ("tiny" if opts.quick else "small")
    rounds = opts.rounds or (2 if opts.quick else 5)
    warmup = 3
    contenders = {
        "plain PyTorch": plain_loop,
        "treadle": treadle_loop,
        "treadle + tqdm": lambda s, n: treadle_loop(s, n, tqdm=True),
        "transformers.Trainer": transformers_loop,
    }
    results: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        for name, fn in contenders.items():  # interleaved: each round runs every contender once
            samples = fn(size, opts.steps)
            if samples is None:
                continue
            results[name].extend(summarise(samples, warmup))
            print(
                f"round {r + 1}/{rounds} {name:22s} median {statistics.median(summarise(samples, warmup)):8.2f} ms",
                file=sys.stderr,
            )
    base = statistics.median(results["plain PyTorch"])
    print(f"\n{machine_header()}")
    print(
        f"\n### Per-step overhead, {size} model, batch {SIZES[size][-1]} x {SIZES[size][4]} tokens, "
        f"{rounds} rounds x {opts.steps - warmup} timed steps, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads\n"
    )
    print("| contender | median ms/step | best ms/step | median vs plain |")
    print("|---|---:|---:|---:|")
    for name, samples in results.items():
        if not samples:
            print(f"| {name} | not installed | | |")
            continue
        med = statistics.median(samples)
        print(f"| {name} | {med:.2f} | {min(samples):.2f} | {med / base:.3f}x |")


if __name__ == "__main__":
    main()
