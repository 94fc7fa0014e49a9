"""SFT and DPO steps on the real model, SmolLM2-135M-Instruct (134.5M, float32): treadle (eager, and with
``torch_compile``), TRL 1.16 and a bare PyTorch loop doing the same work, against the machine's float32 matmul roof
measured in the same run.

    python benchmarks/real.py [--rounds 3] [--steps 5] [--threads 2] [--only sft,dpo] [--contenders ...]

The same work for every contender (each in its own process, so that its peak RSS is its own; the contenders of a
workload run one after another, round by round, interleaved):

- model: the cached HF folder of ``treadle.demos.smollm2``, float32, in train mode; AdamW (torch, for-loop), lr 1e-5,
  no weight decay, gradient clipping at 1.0, a constant schedule; one micro-batch per optimizer step; no evaluation,
  no checkpoints, no progress bars.
- SFT: 8 rows of exactly 128 tokens of English text (slices of one tokenised passage), already tokenised
  (``input_ids``), loss on every token; 6 x 134.5M x 1,024 = 826 GFLOP a step.
- DPO (sigmoid, beta 0.1): 8 pairs, a 96-token prompt and 32-token responses (chosen and rejected differ), a
  frozen reference model run each step; 6 x N x 2,048 (policy) + 2 x N x 2,048 (reference) = 2,203 GFLOP a step.

The bare loops are what a careful engineer writes by hand: the model's own loss (SFT: ``model(ids, labels=ids)``,
full float32 logits) or the DPO loss from ``log_softmax(...).gather`` over the completion tokens; no framework.

Each contender's step time is the median interval between consecutive optimizer-step ends after the first
(the first pays allocation, and compilation when compiled); GFLOP/s is the step's FLOP count over that; the roof is
the best of torch float32 matmuls of the shapes the model runs (1,024 x 576 by 576 x {576, 1536, 49152}, with this
run's threads), measured before each round.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

N_PARAMS = 134_515_008  # SmolLM2-135M-Instruct, tied embeddings counted once
BATCH, SFT_LEN, PROMPT, RESPONSE = 8, 128, 96, 32
PASSAGE = (
    "The history of the calculator begins with the abacus, a frame of beads that merchants used to add and subtract "
    "long before paper was cheap. In the seventeenth century Pascal built a machine of gears that carried tens by "
    "itself, and Leibniz improved it so that it could multiply. Mechanical calculators spread through offices in the "
    "nineteenth century, and by the middle of the twentieth, electronic machines filled whole rooms. The pocket "
    "calculator arrived in the nineteen seventies and changed schools, shops and laboratories within a decade. "
)
CONTENDERS = ("bare", "treadle", "treadle-compiled", "trl")


def flops_per_step(kind: str) -> float:
    tokens = BATCH * SFT_LEN if kind == "sft" else 2 * BATCH * (PROMPT + RESPONSE)
    return 6 * N_PARAMS * tokens + (2 * N_PARAMS * tokens if kind == "dpo" else 0)


def token_rows(tokenizer, kind: str, n: int) -> list[dict]:
    """``n`` rows cut from the passage's tokens (repeated as needed); the same rows for every contender."""
    ids = tokenizer(PASSAGE * 40)["input_ids"]
    rows = []
    for i in range(n):
        start = (37 * i) % (len(ids) - 2 * SFT_LEN)
        if kind == "sft":
            rows.append({"input_ids": ids[start : start + SFT_LEN]})
        else:  # text, as DPO users give it: each trainer tokenises prompt and responses itself
            prompt = ids[start : start + PROMPT]
            chosen = ids[start + PROMPT : start + PROMPT + RESPONSE]
            rejected = ids[start + PROMPT + 7 : start + PROMPT + 7 + RESPONSE]
            rows.append(
                {k: tokenizer.decode(v) for k, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected))}
            )
    return rows


def matmul_roof(threads: int) -> float:
    """Best float32 GFLOP/s of the model's own matmul shapes at 1,024 rows."""
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for cols in (576, 1536, 49152):
        a, b = torch.randn(1024, 576), torch.randn(576, cols)
        a @ b
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * 1024 * 576 * cols / (time.perf_counter() - start) / 1e9)
    return best


# ---------------------------------------------------------------------------------------------------------
# One contender's run, in a child process
# ---------------------------------------------------------------------------------------------------------
class StepEnds:
    """Seconds between consecutive optimizer-step ends (the first measured from the start of training)."""

    def __init__(self):
        self.last, self.times = time.perf_counter(), []

    def tick(self) -> None:
        now = time.perf_counter()
        self.times.append(now - self.last)
        self.last = now


def bare(kind: str, model, tokenizer, steps: int, clock: StepEnds) -> dict:
    import torch
    import torch.nn.functional as F

    rows = token_rows(tokenizer, kind, BATCH * steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, foreach=False)
    reference = None
    if kind == "dpo":
        import copy

        reference = copy.deepcopy(model).eval().requires_grad_(False)
    clock.last = time.perf_counter()
    for step in range(steps):
        batch = rows[step * BATCH : (step + 1) * BATCH]
        if kind == "sft":
            ids = torch.tensor([r["input_ids"] for r in batch])
            loss = model(input_ids=ids, labels=ids).loss
        else:
            ids, mask, completion = dpo_batch(tokenizer, batch)  # (2B, T): chosen rows, then rejected

            policy = dpo_logps(model, ids, mask, completion)
            with torch.no_grad():
                ref = dpo_logps(reference, ids, mask, completion)
            margin = (policy[:BATCH] - ref[:BATCH]) - (policy[BATCH:] - ref[BATCH:])
            loss = -F.logsigmoid(0.1 * margin).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
    return {"loss": loss.item(), "settings": "hand-written loop, model's own loss (SFT) / log_softmax.gather (DPO)"}


def dpo_logps(model, ids, mask, completion):
    """Summed log-probs ``(2B,)`` of the completion tokens, from the full float32 logits."""
    import torch.nn.functional as F

    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    token = F.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (token * completion[:, 1:]).sum(-1)


def dpo_batch(tokenizer, batch: list[dict]):
    """Right-padded ``(input_ids, attention_mask, completion_mask)`` of the chosen rows then the rejected ones: the
    prompt and each response tokenised apart, eos after the response (as TRL and treadle build them)."""
    import torch

    seqs = []
    for key in ("chosen", "rejected"):
        for row in batch:
            prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            answer = tokenizer(row[key], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            seqs.append((prompt, answer))
    width = max(len(p) + len(a) for p, a in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    mask, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, a) in enumerate(seqs):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        mask[i, : len(p) + len(a)] = 1
        completion[i, len(p) : len(p) + len(a)] = 1
    return ids, mask, completion


def framework(name: str, kind: str, model, tokenizer, steps: int, clock: StepEnds) -> dict:
    common = dict(
        output_dir=tempfile.mkdtemp(prefix=f"real-{name}-{kind}-"),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-5,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=steps,
        seed=0,
        max_length=None,
    )
    from datasets import Dataset

    rows = Dataset.from_list(token_rows(tokenizer, kind, BATCH * steps))
    if name == "trl":
        import transformers
        import trl

        callback_base = transformers.TrainerCallback
        config_class, trainer_class = (
            (trl.SFTConfig, trl.SFTTrainer) if kind == "sft" else (trl.DPOConfig, trl.DPOTrainer)
        )
        common.update(bf16=False, dataloader_num_workers=0)
    else:
        import treadle

        callback_base = treadle.TrainerCallback
        config_class, trainer_class = (
            (treadle.SFTConfig, treadle.SFTTrainer) if kind == "sft" else (treadle.DPOConfig, treadle.DPOTrainer)
        )
        common.update(torch_compile=name == "treadle-compiled")
    if kind == "dpo":
        common.update(beta=0.1, loss_type="sigmoid")
    else:
        common.update(packing=False)

    class Tick(callback_base):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    trainer = trainer_class(model=model, args=config_class(**common), train_dataset=rows, processing_class=tokenizer)
    trainer.add_callback(Tick())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    args = trainer.args
    settings = f"{type(trainer).__name__}, optim {args.optim}, lr {args.learning_rate}, clip {args.max_grad_norm}"
    if kind == "sft":
        settings += f", loss_type {getattr(args, 'loss_type', 'nll (the model loss, chunked on large logits)')}"
    if name == "treadle-compiled":
        settings += f", torch_compile {args.torch_compile_backend}"
    return {"loss": losses[-1] if losses else float("nan"), "settings": settings}


def child(spec: str, steps: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    name, kind = spec.split(":")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treadle.demos import smollm2

    folder = smollm2.folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model.train()
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    clock = StepEnds()
    run = (
        bare(kind, model, tokenizer, steps, clock)
        if name == "bare"
        else framework(name, kind, model, tokenizer, steps, clock)
    )
    return {
        **run,
        "contender": name,
        "kind": kind,
        "times": clock.times,
        "loaded_rss_mib": loaded,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------
def spawn(spec: str, steps: int, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(
        [sys.executable, __file__, "--child", spec, "--steps", str(steps), "--threads", str(threads)],
        capture_output=True,
        text=True,
        env=env,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{spec} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="sft,dpo")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--json", default=None, help="also write every run's raw figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.steps, args.threads)), flush=True)
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from _machine import machine_header

    print(machine_header())
    print(
        f"{args.rounds} rounds x {args.steps} steps per run, {args.threads} threads; the first step of a run untimed"
    )
    runs, roofs = [], []
    for round_ in range(args.rounds):
        roofs.append(matmul_roof(args.threads))
        for kind in args.only.split(","):
            for name in args.contenders.split(","):
                run = spawn(f"{name}:{kind}", args.steps, args.threads)
                run["round"] = round_
                runs.append(run)
                step = statistics.median(run["times"][1:])
                print(f"  round {round_} {kind} {name}: {step:.2f} s/step, loss {run['loss']:.4f}", flush=True)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(table(runs, roofs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "roofs": roofs}, f, indent=1)


def table(runs: list[dict], roofs: list[float]) -> str:
    roof = max(roofs)
    lines = [
        f"float32 matmul roof: {roof:.0f} GFLOP/s (best of the rounds; each round: "
        f"{', '.join(f'{r:.0f}' for r in roofs)})",
        "",
        "| workload | contender | s/step (median; every round) | vs bare | GFLOP/s | share of roof | peak RSS | "
        "above loaded | final loss | settings |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in dict.fromkeys(r["kind"] for r in runs):
        mine = [r for r in runs if r["kind"] == kind]
        medians = {}
        for name in dict.fromkeys(r["contender"] for r in mine):
            medians[name] = [statistics.median(r["times"][1:]) for r in mine if r["contender"] == name]
        for name, per_round in medians.items():
            last = [r for r in mine if r["contender"] == name][-1]
            step = statistics.median(per_round)
            gflops = flops_per_step(kind) / step / 1e9
            vs = f"{step / statistics.median(medians['bare']):.2f}x" if "bare" in medians else "-"
            lines.append(
                f"| {kind.upper()} | {name} | {step:.2f} ({', '.join(f'{s:.2f}' for s in per_round)}) | {vs} | "
                f"{gflops:.0f} | {gflops / roof:.0%} | {last['peak_rss_mib']:.0f} MiB | "
                f"{last['peak_rss_mib'] - last['loaded_rss_mib']:.0f} MiB | {last['loss']:.4f} | {last['settings']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
