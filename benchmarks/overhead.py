"""Per-step overhead of treadle's base Trainer against a plain PyTorch loop and transformers.Trainer.

    python -m benchmarks.overhead            # small model (~3.5M params), 5 rounds
    python -m benchmarks.overhead --quick    # tiny model, 2 rounds

The same model, data, batch, optimizer (AdamW), clipping and schedule, in one process (one allocator setting for
all); the contenders run one after another in interleaved rounds (not in lockstep: their ratios carry the machine's
drift between runs, which ``benchmarks.trainers`` removes), and the table gives the median and the range of the ms
per optimizer step over every timed step of every round, and the ratio of medians to the plain loop.
"""

from __future__ import annotations

import io
import statistics
import sys
import tempfile
import time
from contextlib import redirect_stderr

import torch
from torch.utils.data import DataLoader

from benchmarks import harness
from treadle import Trainer, TrainerCallback, TrainingArguments

SIZES = {  # name: (hidden, layers, heads, vocab, seq_len, batch)
    "tiny": (64, 2, 4, 128, 64, 8),
    "small": (256, 4, 8, 1024, 128, 8),
}
WARMUP = 3  # untimed steps of each run


def build_model(size: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM  # transformers' modelling code: seconds to import

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
    ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r} for r in ids]


def plain_loop(size: str, steps: int) -> list[float]:
    """The baseline: what a careful engineer writes by hand."""
    batch = SIZES[size][-1]
    model = build_model(size).train()
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
        model(**inputs, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


def step_ends(base):
    """A callback (of treadle's or transformers' base class) that keeps the time of every step's end."""

    class Clock(base):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.times:
                self.times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    return Clock()


def treadle_loop(size: str, steps: int, tqdm: bool = False) -> list[float]:
    batch, clock = SIZES[size][-1], step_ends(TrainerCallback)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="treadle-bench-overhead-"),
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
    with redirect_stderr(io.StringIO()):  # the progress bar is drawn, not shown
        trainer.train()
    return [b - a for a, b in zip(clock.times, clock.times[1:])]


def transformers_loop(size: str, steps: int) -> list[float]:
    import transformers  # the peer, imported only for its own contender

    batch, clock = SIZES[size][-1], step_ends(transformers.TrainerCallback)
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="treadle-bench-hf-"),
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


CONTENDERS = {
    "plain PyTorch": (plain_loop, "DataLoader, AdamW lr 1e-4, clip 1.0, linear schedule"),
    "treadle": (treadle_loop, "Trainer, the same settings, no progress bar, metrics.jsonl's summary only"),
    "treadle + tqdm": (lambda s, n: treadle_loop(s, n, tqdm=True), "the same with its progress bar drawn"),
    "transformers.Trainer": (transformers_loop, "the same settings, use_cpu, no pinned memory"),
}


def main(argv=None) -> None:
    p = harness.parser(__doc__, "tiny model, 2 rounds")
    p.add_argument("--size", choices=sorted(SIZES), default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=30)
    opts = p.parse_args(argv)
    allocator = harness.apply_allocator(opts.allocator)
    size, rounds = opts.size or ("tiny" if opts.quick else "small"), opts.rounds or (2 if opts.quick else 5)
    run = harness.Run("overhead", opts)
    hidden, layers, _, vocab, seq, batch = SIZES[size]
    for name, (_, note) in CONTENDERS.items():
        run.contender(
            name,
            model=f"{size} Llama (hidden {hidden}, {layers} layers)",
            batch=f"{batch} x {seq}",
            allocator=allocator,
            settings=note,
        )
    results: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for round_, name in harness.interleaved(list(CONTENDERS), rounds):
        ms = [1000 * s for s in CONTENDERS[name][0](size, opts.steps)[WARMUP:]]
        results[name].extend(ms)
        print(f"round {round_ + 1}/{rounds} {name:22s} median {statistics.median(ms):8.2f} ms", file=sys.stderr)
    base, rows = statistics.median(results["plain PyTorch"]), []
    for name, samples in results.items():
        s = harness.spread(samples)
        run.row(contender=name, ms_per_step=s, vs_plain=s["median"] / base)
        rows.append([name, f"{s['median']:.2f}", f"{s['min']:.2f} - {s['max']:.2f}", f"{s['median'] / base:.3f}x"])
    print(f"\n### Per-step overhead, {size} model, {rounds} rounds x {opts.steps - WARMUP} timed steps\n")
    print(harness.table(["contender", "median ms/step", "range ms/step", "median vs plain"], rows))
    run.finish()


if __name__ == "__main__":
    main()
