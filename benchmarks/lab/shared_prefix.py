"""GRPO step time with the shared-prefix forward against padding-free and padded, same rows, peak memory beside each:
where sharing a group's prompt pays, and how ``prefix.estimated_cost`` predicts it (docs/performance.md, shared
prefix; docs/grpo.md).

    python -m benchmarks.lab.shared_prefix --quick     # toy small, (P, C) = (256, 32), G 8: one line at the end
    python -m benchmarks.lab.shared_prefix             # tiny, small, base x (256,32) (256,128) (64,64) x G 8, 16
    python -m benchmarks.lab.shared_prefix --sizes small base --shapes 256x32 --groups 8 --rounds 3 [--force]

The work (the same for every contender): one micro-batch of one prompt's G completions (B = G rows), prompt P tokens,
every completion C tokens (random ids), ``GRPOTrainer`` with ``beta=0.04`` (a reference copy) and ``loss_type="dapo"``.
One step = the old-policy log-probs (``frozen_logps`` of the policy), the reference log-probs, then ``compute_loss``
and its backward. Contenders: ``shared_prefix=False, padding_free=False`` (padded), ``shared_prefix=False,
padding_free=True`` (padding-free), ``shared_prefix=True`` (shared). All completions have length C, so there is no
padding and padding-free runs the padded forward: those two rows measure the same path (and show the noise). "est."
is ``prefix.estimated_cost`` shared over unshared, "rule" what the shipped rule decides (share when est. <=
``MIN_SAVING``); ``--force`` shares wherever it is exact, to measure the curve past the rule. Per round each contender
runs ``--warmup`` then ``--steps`` timed steps, contenders interleaved; the table gives the median over rounds of the
mean step time, and the median over rounds of each round's shared/padding-free ratio. Peak: tensor memory above the
start of one step (``harness.peak_memory``).
"""

from __future__ import annotations

import tempfile
import time
import warnings

import torch

from benchmarks import harness
from treadle import GRPOConfig, GRPOTrainer
from treadle.demos import toy
from treadle.logprobs import prefix
from treadle.logprobs.prefix import estimated_cost, token_ratio

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
    rows = [{"prompt": "1+1="}] * group
    return GRPOTrainer(
        model, lambda completions, **kw: [0.0] * len(completions), args=args, train_dataset=rows, processing_class=tok
    )


def batch_of(prompt: int, completion: int, group: int, device: str) -> dict:
    """One prompt of ``prompt`` tokens and ``group`` completions of ``completion`` tokens (ids from 8 to 99)."""
    g = torch.Generator().manual_seed(prompt * 1000 + completion * 10 + group)
    shared = torch.randint(8, 100, (1, prompt), generator=g).expand(group, prompt)
    ids = torch.cat([shared, torch.randint(8, 100, (group, completion), generator=g)], dim=1)
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


def configure(trainer: GRPOTrainer, settings: dict) -> None:
    for key, value in settings.items():
        setattr(trainer.args, key, value)


def timed(trainer, batch, steps: int, device: str) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step(trainer, batch)
    sync()
    return (time.perf_counter() - start) / steps


def measure(size: str, prompt: int, completion: int, group: int, opts) -> dict:
    """{contender: median ms per step}, {contender: peak MiB}, the median per-round shared/padding-free ratio, the
    estimate and the rule's decision."""
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(size, group, completion, opts.device, out)
    batch, times, peaks = batch_of(prompt, completion, group, opts.device), {n: [] for n in CONTENDERS}, {}
    for name, settings in CONTENDERS.items():  # warm-up (and the one-time checks), then the peak of one step
        configure(trainer, settings)
        for _ in range(opts.warmup):
            step(trainer, batch)
        peaks[name] = harness.peak_memory(lambda: step(trainer, batch), opts.device)[1]
    for _, name in harness.interleaved(list(CONTENDERS), opts.rounds):
        configure(trainer, CONTENDERS[name])
        times[name].append(timed(trainer, batch, opts.steps, opts.device))
    hidden = trainer.model.config.hidden_size
    unshared = estimated_cost([prompt + completion] * group, None, hidden)
    estimate = estimated_cost(1, prompt + group * completion, hidden) / unshared
    return {
        "ms": {n: 1000 * harness.spread(t)["median"] for n, t in times.items()},
        "peak": peaks,
        "ratio": harness.ratio_per_round(times["shared"], times["padding-free"]),
        "estimate": estimate,
        "rule": "share" if estimate <= prefix.MIN_SAVING else "off",
    }


def main(argv=None) -> None:
    p = harness.parser(__doc__, "toy small, (256, 32), G 8 only")
    p.add_argument("--sizes", nargs="+", default=["tiny", "small", "base"])
    p.add_argument("--shapes", nargs="+", default=["256x32", "256x128", "64x64"], help="PROMPTxCOMPLETION")
    p.add_argument("--groups", nargs="+", type=int, default=[8, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="timed steps per round and contender")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--force", action="store_true", help="share wherever exact, past the cost rule (MIN_SAVING)")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.sizes, opts.shapes, opts.groups = ["small"], ["256x32"], [8]
    allocator = harness.apply_allocator(opts.allocator)
    torch.set_num_threads(opts.threads)
    if opts.force:
        prefix.MIN_SAVING = float("inf")
    warnings.filterwarnings("ignore")
    run = harness.Run("lab.shared_prefix", opts)
    for name, settings in CONTENDERS.items():
        run.contender(name, **settings, beta=0.04, loss="dapo", allocator=allocator, device=opts.device)
    rows = []
    for size in opts.sizes:
        for prompt, completion in (map(int, shape.split("x")) for shape in opts.shapes):
            for group in opts.groups:
                r = measure(size, prompt, completion, group, opts)
                run.row(model=size, P=prompt, C=completion, G=group, **r)
                rows.append(
                    [size, prompt, completion, group, f"{token_ratio([prompt], [[completion] * group]):.3f}"]
                    + [f"{r['ms'][n]:.1f} ({r['peak'][n]:.1f} MiB)" for n in CONTENDERS]
                    + [f"{r['ratio']:.3f}", f"{r['estimate']:.2f}", r["rule"]]
                )
    header = ["model", "P", "C", "G", "tokens", "padded ms (peak)", "padding-free ms (peak)", "shared ms (peak)"]
    print("\n" + harness.table(header + ["shared/padding-free", "est.", "rule"], rows))
    if opts.quick:
        print(f"shared/padding-free step time: {r['ratio']:.3f}")
    run.finish()


if __name__ == "__main__":
    main()
