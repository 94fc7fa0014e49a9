"""SFT, DPO and GRPO steps on the real model, SmolLM2-135M-Instruct (134.5M, float32): treadle (eager, with
``torch_compile``, and with ``gradient_checkpointing``), TRL and a bare PyTorch loop doing the same work, against the
machine's float32 matmul roof measured in the same run; the peak memory of each against the bare loop's.

    python -m benchmarks.real [--rounds 3] [--steps 5] [--threads 2] [--only sft,dpo,grpo] [--grpo 8x8x64]
                              [--contenders bare,treadle,treadle-compiled,treadle-checkpointed,trl]
                              [--allocator kept|glibc|as-shipped]
    python -m benchmarks.real --quick     # 1 round of 2 steps, 2 rows a step, GRPO 2x2x8; bare, treadle and TRL
    python -m benchmarks.real --only sft --rounds 1 --steps 4 --contenders all    # the memory rows: every contender

Contenders beyond the default five (``--contenders all`` or by name): treadle with torchao's low-bit AdamW,
``optim="adamw_torch_8bit"`` / ``"adamw_torch_4bit"`` (the moments in 8 or 4 bits), with and without
``gradient_checkpointing`` (``treadle-8bit``, ``treadle-4bit``, ``treadle-checkpointed-8bit``,
``treadle-checkpointed-4bit``). The bare loop keeps plain torch AdamW (float32 moments) whatever the others turn on:
its memory ratio is of what a user of treadle can switch on, not of the same optimizer.

The same work for every contender, each in its own process (its peak RSS is its own), the contenders of a workload
one after another, round by round, interleaved:

- TRL as the same work: ``bf16=False`` and ``gradient_checkpointing=False`` (TRL 1.16's SFT, DPO and GRPO configs
  default both to True; until 2026-12-06 this benchmark left TRL's checkpointing on, so its TRL rows before then
  measured TRL recomputing every block's forward and flattered treadle);
- process: the same threads and the same allocator for every contender: ``--allocator kept`` (the default) has every
  contender's process keep freed memory (``treadle.allocator.keep_freed_memory``, what treadle's train() applies on
  CPU), ``glibc`` leaves glibc's defaults to all, ``as-shipped`` keeps it for treadle's contenders only: TRL and the
  bare loop as they ship, a comparison of what ships rather than of the work. Each row prints its allocator;
- model: the cached HF folder of ``treadle.demos.smollm2``, float32, in train mode; AdamW (torch, for-loop), lr 1e-5,
  no weight decay, gradient clipping at 1.0, a constant schedule; one micro-batch per optimizer step; no evaluation,
  no checkpoints, no progress bars;
- SFT: 8 rows of exactly 128 tokens of English text (slices of one tokenised passage), already tokenised, loss on
  every token; 6 x 134.5M x 1,024 = 826 GFLOP a step;
- DPO (sigmoid, beta 0.1): 8 pairs, a 96-token prompt and 32-token responses (chosen and rejected differ), a frozen
  reference model run each step; 6 x N x 2,048 (policy) + 2 x N x 2,048 (reference) = 2,203 GFLOP a step;
- GRPO (``--grpo PROMPTSxGxTOKENS``, default 8 x 8 x 64): chat prompts "What is a + b? Reply with just the number.",
  G completions each, sampled at temperature 1 with both end tokens suppressed so that every completion is exactly
  TOKENS long; reward 1 when the answer's last number is the sum; no reference model (beta 0), loss_type dapo, one
  optimizer step per generation. Work: 2 x N per sampled or prompt token (the rollout) + 6 x N per token of every
  prompt + completion (the training pass); the trainers' own sampler (treadle) and transformers ``generate`` (TRL and
  the bare loop) do the same rollout.

The bare loops are what a careful engineer writes by hand: the model's own loss (SFT, full float32 logits), the DPO
loss from ``log_softmax(...).gather`` over the completion tokens, or GRPO as ``model.generate`` then the
group-normalised policy gradient; no framework. They take the rows in the trainers' seeded order, so that SFT and DPO
end at their loss. Each contender's step time is the median interval between consecutive optimizer-step ends after
the first (which pays allocation, and compilation when compiled); GFLOP/s is the step's FLOP count over that; the
roof is the best of float32 matmuls of the model's shapes (1,024 x 576 by 576 x {576, 1536, 49152}, this run's
threads), measured before each round. treadle's DPO and GRPO run less than the counted work (no padding, each prompt
once per pair or group), so their GFLOP/s can pass the roof: the time is the claim.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import harness

N_PARAMS = 134_515_008  # SmolLM2-135M-Instruct, tied embeddings counted once
SFT_LEN, PROMPT, RESPONSE = 128, 96, 32
PASSAGE = (
    "The history of the calculator begins with the abacus, a frame of beads that merchants used to add and subtract "
    "long before paper was cheap. In the seventeenth century Pascal built a machine of gears that carried tens by "
    "itself, and Leibniz improved it so that it could multiply. Mechanical calculators spread through offices in the "
    "nineteenth century, and by the middle of the twentieth, electronic machines filled whole rooms. The pocket "
    "calculator arrived in the nineteen seventies and changed schools, shops and laboratories within a decade. "
)
TREADLE = {  # treadle's contenders: the arguments each turns on over the eager run (framework_args)
    "treadle": {},
    "treadle-compiled": {"torch_compile": True},
    "treadle-checkpointed": {"gradient_checkpointing": True},
    "treadle-8bit": {"optim": "adamw_torch_8bit"},
    "treadle-4bit": {"optim": "adamw_torch_4bit"},
    "treadle-checkpointed-8bit": {"gradient_checkpointing": True, "optim": "adamw_torch_8bit"},
    "treadle-checkpointed-4bit": {"gradient_checkpointing": True, "optim": "adamw_torch_4bit"},
}
CONTENDERS = ("bare", "treadle", "treadle-compiled", "treadle-checkpointed", "trl")  # the default run
ALL_CONTENDERS = ("bare", *TREADLE, "trl")  # --contenders all
WORK = {"batch": 8, "prompts": 8, "g": 8, "tokens": 64}  # rows a step (SFT, DPO) and GRPO's shape: set by the options
ROOF_SHAPES = [(576, 576), (576, 1536), (576, 49152)]  # (K, N) of the model's matmuls, at 1,024 rows


def flops_per_step(kind: str, tokenizer=None) -> float:
    if kind == "grpo":  # every completion is exactly WORK["tokens"] long: see end_ids
        lengths = [len(prompt_ids(tokenizer, row)) for row in grpo_rows(WORK["prompts"])]
        return 8 * N_PARAMS * WORK["g"] * sum(n + WORK["tokens"] for n in lengths)
    tokens = WORK["batch"] * SFT_LEN if kind == "sft" else 2 * WORK["batch"] * (PROMPT + RESPONSE)
    return 6 * N_PARAMS * tokens + (2 * N_PARAMS * tokens if kind == "dpo" else 0)


def seeded_order(n: int) -> list[int]:
    """The trainers' order of ``n`` rows at seed 0, epoch 0 (treadle.data's sampler; TRL's gives the same losses)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()


def token_rows(tokenizer, kind: str, n: int) -> list[dict]:
    """``n`` rows cut from the passage's tokens (repeated as needed); the same rows for every contender."""
    ids = tokenizer(PASSAGE * 40)["input_ids"]
    rows = []
    for i in range(n):
        start = (37 * i) % (len(ids) - 2 * SFT_LEN)
        if kind == "sft":
            rows.append({"input_ids": ids[start : start + SFT_LEN]})
            continue
        prompt = ids[start : start + PROMPT]  # text, as DPO users give it: each trainer tokenises it itself
        chosen = ids[start + PROMPT : start + PROMPT + RESPONSE]
        rejected = ids[start + PROMPT + 7 : start + PROMPT + 7 + RESPONSE]
        rows.append(
            {k: tokenizer.decode(v) for k, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected))}
        )
    return rows


def grpo_rows(n: int) -> list[dict]:
    """``n`` addition prompts (chat), the same for every contender."""
    rows = []
    for i in range(n):
        a, b = 10 + (37 * i) % 90, 10 + (59 * i + 13) % 90
        content = f"What is {a} + {b}? Reply with just the number."
        rows.append({"prompt": [{"role": "user", "content": content}], "answer": str(a + b)})
    return rows


def prompt_ids(tokenizer, row: dict) -> list[int]:
    return tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)


def end_ids(tokenizer) -> list[int]:
    """The tokens that would end a completion (suppressed, so that every completion has the full length)."""
    return sorted({tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")})


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
    """The hand-written SFT or DPO loop (GRPO: ``bare_grpo``)."""
    if kind == "grpo":
        return bare_grpo(model, tokenizer, steps, clock)
    batch_size = WORK["batch"]
    rows = token_rows(tokenizer, kind, batch_size * steps)
    rows = [rows[i] for i in seeded_order(len(rows))]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, foreach=False)
    reference = copy.deepcopy(model).eval().requires_grad_(False) if kind == "dpo" else None
    losses, clock.last = [], time.perf_counter()
    for step in range(steps):
        batch = rows[step * batch_size : (step + 1) * batch_size]
        if kind == "sft":
            ids = torch.tensor([r["input_ids"] for r in batch])
            loss = model(input_ids=ids, labels=ids).loss
        else:
            ids, mask, completion = dpo_batch(tokenizer, batch)  # (2B, T): chosen rows, then rejected
            policy = dpo_logps(model, ids, mask, completion)
            with torch.no_grad():
                ref = dpo_logps(reference, ids, mask, completion)
            margin = (policy[:batch_size] - ref[:batch_size]) - (policy[batch_size:] - ref[batch_size:])
            loss = -F.logsigmoid(0.1 * margin).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        clock.tick()
    # the trainers log the mean loss of the steps since their last log (logging_steps = steps: all of them)
    settings = "hand-written loop, torch AdamW (float32 moments), model's own loss (SFT) / log_softmax.gather (DPO)"
    return {"loss": sum(losses) / len(losses), "settings": settings}


def dpo_logps(model, ids, mask, completion):
    """Summed log-probs ``(2B,)`` of the completion tokens, from the full float32 logits."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    token = F.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (token * completion[:, 1:]).sum(-1)


def dpo_batch(tokenizer, batch: list[dict]):
    """Right-padded ``(input_ids, attention_mask, completion_mask)`` of the chosen rows then the rejected ones: the
    prompt and each response tokenised apart, eos after the response (as TRL and treadle build them)."""
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


def bare_generate(model, tokenizer, batch: list[dict]):
    """``generate`` G completions of each prompt, end tokens suppressed: (sequences, prompt width, prompt mask)."""
    prompts = [prompt_ids(tokenizer, row) for row in batch]
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.repeat_interleave(WORK["g"], 0),
            attention_mask=mask.repeat_interleave(WORK["g"], 0),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=WORK["tokens"],
            suppress_tokens=end_ids(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
        )
    return out, width, mask.repeat_interleave(WORK["g"], 0)


def bare_grpo(model, tokenizer, steps: int, clock: StepEnds) -> dict:
    """``generate``, group-normalised rewards, one policy-gradient step (ratio 1 at the sampled weights, as one step
    per generation has it); the loss averaged over every completion token (dapo)."""
    from treadle.demos.real import last_number_is_sum  # the demo's reward, as the trainers get it

    P, G, T = WORK["prompts"], WORK["g"], WORK["tokens"]
    rows = grpo_rows(P * steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, foreach=False)
    clock.last = time.perf_counter()
    for step in range(steps):
        batch = rows[step * P : (step + 1) * P]
        out, width, mask = bare_generate(model, tokenizer, batch)
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        rewards = torch.tensor(last_number_is_sum(texts, [row["answer"] for row in batch for _ in range(G)]))
        rewards = rewards.view(P, G)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
        full_mask = torch.cat([mask, torch.ones(P * G, T, dtype=torch.long)], 1)
        logits = model(input_ids=out, attention_mask=full_mask).logits[:, width - 1 : -1].float()
        logps = F.log_softmax(logits, -1).gather(-1, out[:, width:, None]).squeeze(-1)
        loss = -(torch.exp(logps - logps.detach()) * advantages[:, None]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
    settings = f"hand-written loop, torch AdamW (float32 moments), model.generate, {P} prompts x G {G} x {T} tokens"
    return {"loss": loss.item(), "settings": settings}


def framework_args(name: str, kind: str, steps: int, tokenizer) -> dict:
    """The config fields of contender ``name`` (treadle or TRL) for ``kind``: the same work as the bare loop."""
    args = dict(
        output_dir=tempfile.mkdtemp(prefix=f"real-{name}-{kind}-"),
        max_steps=steps,
        per_device_train_batch_size=WORK["batch"],
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
    )
    if name == "trl":  # float32 and no activation recomputation as the others (TRL's configs default both on)
        args.update(bf16=False, gradient_checkpointing=False, dataloader_num_workers=0)
    else:
        args.update(TREADLE[name])
    if kind == "dpo":
        return dict(args, max_length=None, beta=0.1, loss_type="sigmoid")
    if kind == "sft":
        return dict(args, max_length=None, packing=False)
    return dict(
        args,
        per_device_train_batch_size=WORK["prompts"] * WORK["g"],
        num_generations=WORK["g"],
        max_completion_length=WORK["tokens"],
        steps_per_generation=1,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        generation_kwargs={"suppress_tokens": end_ids(tokenizer)},
    )


def framework(name: str, kind: str, model, tokenizer, steps: int, clock: StepEnds) -> dict:
    """treadle's or TRL's trainer of ``kind``, trained ``steps`` steps with ``clock`` ticking at each step's end."""
    from datasets import Dataset  # the trainers' own input type; the GPU image has none (see gpu_check)

    from treadle.demos.real import last_number_is_sum

    if name == "trl":
        import transformers
        import trl as lib  # the peer: imported only in its own process

        base = transformers.TrainerCallback
    else:
        import treadle as lib

        base = lib.TrainerCallback
    rows = grpo_rows(WORK["prompts"] * steps) if kind == "grpo" else token_rows(tokenizer, kind, WORK["batch"] * steps)
    config = getattr(lib, f"{kind.upper()}Config")(**framework_args(name, kind, steps, tokenizer))

    class Tick(base):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    more = {"reward_funcs": last_number_is_sum} if kind == "grpo" else {}
    trainer = getattr(lib, f"{kind.upper()}Trainer")(
        model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer, **more
    )
    trainer.add_callback(Tick())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"loss": losses[-1] if losses else float("nan"), "settings": settings_label(name, kind, trainer.args)}


def settings_label(name: str, kind: str, args) -> str:
    """What a framework contender ran, read from its trainer's arguments after training."""
    label = (
        f"{name}, optim {getattr(args.optim, 'value', args.optim)}, lr {args.learning_rate}, clip {args.max_grad_norm}"
    )
    if kind == "sft":
        label += f", loss_type {getattr(args, 'loss_type', 'nll (the model loss, chunked on large logits)')}"
    if kind == "grpo":
        sampler = "transformers generate" if name == "trl" else f"generation_backend {args.generation_backend}"
        label += f", {WORK['prompts']} prompts x G {args.num_generations} x {args.max_completion_length}, {sampler}"
    if getattr(args, "torch_compile", False) and name != "trl":
        label += f", torch_compile {args.torch_compile_backend}"
    if args.gradient_checkpointing:
        label += ", gradient_checkpointing"
    return label


def child(spec: str, steps: int, threads: int) -> dict:
    """One contender's run in this (its own) process: load the model, train, report."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treadle.demos import smollm2

    allocator = harness.apply_allocator()  # before the model is loaded: as allocator_env set this process up
    torch.set_num_threads(threads)
    name, kind = spec.split(":")
    folder = smollm2.folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    loaded, clock = harness.peak_rss_mib(), StepEnds()
    work = bare if name == "bare" else lambda *a: framework(name, *a)
    run = work(kind, model, tokenizer, steps, clock)
    return {
        **run,
        "settings": f"{run['settings']}, {allocator}",
        "contender": name,
        "kind": kind,
        "times": clock.times,
        "gflop": flops_per_step(kind, tokenizer) / 1e9,
        "loaded_rss_mib": loaded,
        "peak_rss_mib": harness.peak_rss_mib(),
        "workers_rss_mib": descendants_peak_rss_mib(),
        "threads": torch.get_num_threads(),
    }


def descendants_peak_rss_mib() -> float:
    """The resident high-water marks (VmHWM, MiB) of this process's live descendants, summed: the compile workers that
    ``torch.compile`` starts (torchao's optimizer step and ``torch_compile`` compile), whose memory the process's own
    peak leaves out. An upper bound: each counts the libraries it shares with the others."""
    total, parents = 0.0, [os.getpid()]
    while parents:
        for task in Path(f"/proc/{parents.pop()}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child_pid in children:
                parents.append(int(child_pid))
                status = Path(f"/proc/{child_pid}/status")
                lines = status.read_text().splitlines() if status.exists() else []
                total += sum(int(line.split()[1]) / 1024 for line in lines if line.startswith("VmHWM:"))
    return total


# ---------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------
def work_args() -> list[str]:
    """The options that fix the work, passed on to every contender's process."""
    grpo = "x".join(str(WORK[k]) for k in ("prompts", "g", "tokens"))
    return ["--grpo", grpo, "--batch", str(WORK["batch"])]


def spawn(spec: str, steps: int, threads: int, allocator: str) -> dict:
    env = harness.allocator_env(allocator, treadle_contender=spec.startswith("treadle"))
    env["OMP_NUM_THREADS"] = str(threads)
    args = ["--child", spec, "--steps", str(steps), "--threads", str(threads), *work_args()]
    return harness.spawn("real", args, env=env)


def parse_args(argv=None):
    p = harness.parser(__doc__, "1 round of 2 steps, 2 rows a step, GRPO 2x2x8; bare, treadle and TRL")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the first is not timed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", default="sft,dpo,grpo")
    p.add_argument("--grpo", default="8x8x64", help="GRPO's prompts x G x new tokens per step")
    p.add_argument("--batch", type=int, default=8, help="SFT rows / DPO pairs per step")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    opts.contenders = ",".join(ALL_CONTENDERS) if opts.contenders == "all" else opts.contenders
    unknown = sorted(set(opts.contenders.split(",")) - set(ALL_CONTENDERS))
    if unknown:
        p.error(f"--contenders: {unknown} unknown; use 'all' or names of {', '.join(ALL_CONTENDERS)}")
    if opts.quick:
        opts.rounds, opts.steps, opts.batch, opts.grpo = 1, 2, 2, "2x2x8"
        kept = ("bare", "treadle", "trl")  # the others are treadle with one flag more, each a process of its own
        opts.contenders = ",".join(c for c in opts.contenders.split(",") if c in kept)
    WORK.update(zip(("prompts", "g", "tokens"), map(int, opts.grpo.split("x"))), batch=opts.batch)
    return opts


def main(argv=None) -> None:
    opts = parse_args(argv)
    if opts.child:
        harness.child_result(child(opts.child, opts.steps, opts.threads))
        return
    torch.set_num_threads(opts.threads)  # the roof's threads: the contenders'
    run = harness.Run("real", opts)
    kinds, names = opts.only.split(","), opts.contenders.split(",")
    for name in names:
        treadle_side = name.startswith("treadle")
        shipped = "kept" if opts.allocator == "kept" or (opts.allocator == "as-shipped" and treadle_side) else "glibc"
        run.contender(name, process="its own", threads=opts.threads, allocator=shipped, work=WORK)
    runs, roofs = [], []
    for round_ in range(opts.rounds):
        roofs.append(harness.matmul_roof(1024, ROOF_SHAPES))
        for kind in kinds:
            for _, name in harness.interleaved(names, 1):
                result = dict(spawn(f"{name}:{kind}", opts.steps, opts.threads, opts.allocator), round=round_)
                runs.append(result)
                step = statistics.median(result["times"][1:])
                print(f"  round {round_} {kind} {name}: {step:.2f} s/step, loss {result['loss']:.4f}", flush=True)
    roofs.append(harness.matmul_roof(1024, ROOF_SHAPES))
    print(table(run, runs, roofs))
    run.figure(roofs=roofs)
    run.finish()


def table(run: harness.Run, runs: list[dict], roofs: list[float]) -> str:
    roof, rows = max(roofs), []
    for kind in dict.fromkeys(r["kind"] for r in runs):
        mine = [r for r in runs if r["kind"] == kind]
        medians = {}
        for name in dict.fromkeys(r["contender"] for r in mine):
            medians[name] = [statistics.median(r["times"][1:]) for r in mine if r["contender"] == name]
        bare_added = [added_mib(r) for r in mine if r["contender"] == "bare"]
        for name, per_round in medians.items():
            last = [r for r in mine if r["contender"] == name][-1]
            rows.append(kind_row(run, kind, name, per_round, medians, last, roof, bare_added[-1:]))
    header = ["workload", "contender", "s/step (median; every round)", "vs bare", "vs TRL", "GFLOP/s", "share of roof"]
    memory = ["peak RSS", "above loaded", "compile workers", "memory vs bare"]
    return (
        f"\nfloat32 matmul roof: {roof:.0f} GFLOP/s (the best; measured before each round and at the end: "
        f"{', '.join(f'{r:.0f}' for r in roofs)})\nmemory vs bare: the peak RSS above the loaded model plus the "
        f"compile workers' peaks, over the bare loop's (which keeps torch AdamW's float32 moments, whatever the row "
        f"turns on)\n\n" + harness.table(header + memory + ["final loss", "settings"], rows)
    )


def added_mib(result: dict) -> float:
    """The memory a run added (MiB): its process's peak RSS above the loaded model, plus its compile workers'."""
    return result["peak_rss_mib"] - result["loaded_rss_mib"] + result.get("workers_rss_mib", 0.0)


def kind_row(run, kind, name, per_round: list[float], medians: dict, last: dict, roof: float, bare: list) -> list:
    """One contender's row of one workload (and its record in the run); ``bare``: the bare loop's ``added_mib``."""
    step = statistics.median(per_round)
    memory = f"{added_mib(last) / bare[0]:.2f}x" if bare else "-"
    vs = [f"{step / statistics.median(medians[b]):.2f}x" if b in medians else "-" for b in ("bare", "trl")]
    gflops = last["gflop"] / step
    run.row(
        workload=kind,
        contender=name,
        seconds=harness.spread(per_round),
        vs_bare=vs[0],
        vs_trl=vs[1],
        gflop_per_s=gflops,
        share_of_roof=gflops / roof,
        peak_rss_mib=last["peak_rss_mib"],
        added_mib=added_mib(last),
        memory_vs_bare=memory,
        loss=last["loss"],
        settings=last["settings"],
    )
    return [
        kind.upper(),
        name,
        f"{step:.2f} ({', '.join(f'{s:.2f}' for s in per_round)})",
        *vs,
        f"{gflops:.0f}",
        f"{gflops / roof:.0%}",
        f"{last['peak_rss_mib']:.0f} MiB",
        f"{last['peak_rss_mib'] - last['loaded_rss_mib']:.0f} MiB",
        f"{last.get('workers_rss_mib', 0.0):.0f} MiB",
        memory,
        f"{last['loss']:.4f}",
        last["settings"],
    ]


if __name__ == "__main__":
    main()
