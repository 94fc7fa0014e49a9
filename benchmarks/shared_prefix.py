"""GRPO step time with the shared-prefix forward vs padding-free vs padded, same rows, peak memory beside each.

    python benchmarks/shared_prefix.py --quick      # toy small, (P, C) = (256, 32), G 8: one line at the end
    python benchmarks/shared_prefix.py              # tiny, small, base (33.6M) x (256,32) (256,128) (64,64) x G 8, 16
    python benchmarks/shared_prefix.py --sizes small base --shapes 256x32 --groups 8 --rounds 3

The work (the same for every contender): one micro-batch of one prompt's G completions (B = G rows), prompt P
tokens, every completion C tokens (random ids; the toy tokenizer's vocabulary), ``GRPOTrainer`` with ``beta=0.04``
(a reference copy) and ``loss_type="dapo"``. One step = the old-policy log-probs (``frozen_logps`` of the policy),
the reference log-probs (``frozen_logps`` of the reference), then ``compute_loss`` and its backward: what a GRPO
step computes when old and reference log-probs are needed. Contenders: ``shared_prefix=False, padding_free=False``
(padded), ``shared_prefix=False, padding_free=True`` (padding-free), ``shared_prefix=True`` (shared). All
completions have length C, as in the issue's token ratio ``(P + G C) / (G (P + C))``: there is no padding in the
batch, so padding-free runs the padded forward (its rule: nothing to remove) and the two rows measure the same
path; the shared row is what changes.

The ``est.`` column is ``prefix.estimated_cost`` shared over unshared, and ``rule`` what the shipped rule decides
(share when est. <= ``MIN_SAVING``; else the "shared" contender runs padding-free). ``--force`` shares wherever it is
exact, to measure the curve past the rule.

Per round each contender runs ``--warmup`` then ``--steps`` timed steps, contenders interleaved; the table gives
the median over rounds of the mean step time and the median over rounds of each round's shared/padding-free ratio.
Peak memory: tensor memory above the start of one step (benchmarks/_memory.py; CUDA's peak allocator figure on GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from _machine import machine_header  # noqa: E402
from _memory import peak_memory  # noqa: E402

from treadle import GRPOConfig, GRPOTrainer
from treadle.demos import toy  # noqa: E402
from treadle.logprobs import prefix
from treadle.logprobs.prefix import estimated_cost, token_ratio  # noqa: E402

CONTENDERS = {
    "padded": dict(shared_prefix=False, padding_free=False),
    "padding-free": dict(shared_prefix=False, padding_free=True),
    "shared": dict(shared_prefix=True, padding_free=True),
}


def build_trainer(size: str, group: int, completion: int, device: str, output_dir: str) -> GRPOTrainer:
    tok = toy.build_tokenizer()
    model = toy.build_model(size, tokenizer=tok, seed=0).to(device)
    args = GRPOConfig(
        output_dir=output_dir,
        beta=0.04,
        per_device_train_batch_size=group,
        num_generations=group,
        max_completion_length=completion,
        loss_type="dapo",
        disable_tqdm=True,
        report_to="none",
    )
    return GRPOTrainer(
        model,
        lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=[{"prompt": "1+1="}] * group,
        processing_class=tok,
    )


def batch_of(prompt: int, completion: int, group: int, device: str) -> dict:
    """One prompt of ``prompt`` tokens and ``group`` completions of ``completion`` tokens (ids from 8 to 99)."""
    g = torch.Generator().manual_seed(prompt * 1000 + completion * 10 + group)
    ids = torch.cat(
        [
            torch.randint(8, 100, (1, prompt), generator=g).expand(group, prompt),
            torch.randint(8, 100, (group, completion), generator=g),
        ],
        dim=1,
    )
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        "completion_mask": torch.ones(group, completion, device=device),
        "advantages": torch.linspace(-1, 1, group, device=device),
    }


def step(trainer: GRPOTrainer, batch: dict) -> None:
    """Old and reference log-probs, then the policy's forward and backward."""
    batch = dict(
        batch,
        old_logps=trainer.frozen_logps(trainer.model, batch),
        ref_logps=trainer.frozen_logps(trainer.ref_model, batch),
    )
    loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=int(batch["completion_mask"].sum()))
    loss.backward()
    trainer.model.zero_grad(set_to_none=True)


def timed(trainer, batch, steps: int, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step(trainer, batch)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def measure(size: str, prompt: int, completion: int, group: int, options) -> dict:
    """{contender: (median ms per step, peak MiB)} and the median per-round shared/padding-free ratio."""
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(size, group, completion, options.device, out)
    batch = batch_of(prompt, completion, group, options.device)
    times = {name: [] for name in CONTENDERS}
    peaks = {}
    for name, settings in CONTENDERS.items():  # warm-up (and the one-time checks), then the peak of one step
        for key, value in settings.items():
            setattr(trainer.args, key, value)
        for _ in range(options.warmup):
            step(trainer, batch)
        peaks[name] = peak_memory(lambda: step(trainer, batch), options.device)[1]
    for _ in range(options.rounds):
        for name, settings in CONTENDERS.items():
            for key, value in settings.items():
                setattr(trainer.args, key, value)
            times[name].append(timed(trainer, batch, options.steps, options.device))
    ratios = [s / f for s, f in zip(times["shared"], times["padding-free"])]
    hidden = trainer.model.config.hidden_size
    estimate = estimated_cost(1, prompt + group * completion, hidden) / estimated_cost(
        [prompt + completion] * group, None, hidden
    )
    rule = "share" if estimate <= prefix.MIN_SAVING else "off"
    return {
        "ms": {n: 1000 * statistics.median(t) for n, t in times.items()},
        "peak": peaks,
        "ratio": statistics.median(ratios),
        "estimate": estimate,
        "rule": rule,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy small, (256, 32), G 8 only")
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small", "base"])
    parser.add_argument("--shapes", nargs="+", default=["256x32", "256x128", "64x64"], help="PROMPTxCOMPLETION")
    parser.add_argument("--groups", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round and contender")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--force", action="store_true", help="share wherever exact, past the cost rule (MIN_SAVING)")
    options = parser.parse_args()
    if options.quick:
        options.sizes, options.shapes, options.groups = ["small"], ["256x32"], [8]
    torch.set_num_threads(options.threads)
    if options.force:
        prefix.MIN_SAVING = float("inf")
    warnings.filterwarnings("ignore")
    print(machine_header())
    print(
        f"device {options.device}, {options.rounds} rounds x {options.steps} timed steps, {options.warmup} warm-up; "
        "step = old + ref log-probs + policy fwd/bwd, beta 0.04, dapo, B = G rows of one prompt"
    )
    print(
        f"{'model':<6} {'P':>4} {'C':>4} {'G':>3} {'tokens':>6} | {'padded ms':>10} {'MiB':>7} | "
        f"{'pad-free ms':>11} {'MiB':>7} | {'shared ms':>10} {'MiB':>7} | {'shared/pf':>9} | {'est.':>5} {'rule':>5}"
    )
    last = None
    for size in options.sizes:
        for shape in options.shapes:
            prompt, completion = map(int, shape.split("x"))
            for group in options.groups:
                r = measure(size, prompt, completion, group, options)
                ms, peak = r["ms"], r["peak"]
                print(
                    f"{size:<6} {prompt:>4} {completion:>4} {group:>3} "
                    f"{token_ratio([prompt], [[completion] * group]):>6.3f} | "
                    f"{ms['padded']:>10.1f} {peak['padded']:>7.1f} | {ms['padding-free']:>11.1f} "
                    f"{peak['padding-free']:>7.1f} | {ms['shared']:>10.1f} {peak['shared']:>7.1f} | "
                    f"{r['ratio']:>9.3f} | {r['estimate']:>5.2f} {r['rule']:>5}",
                    flush=True,
                )
                last = r["ratio"]
    if options.quick:
        print(f"shared/padding-free step time: {last:.3f}")


if __name__ == "__main__":
    main()
