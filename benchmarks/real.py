"""SFT, DPO and GRPO steps on the real model, SmolLM2-135M-Instruct (134.5M, float32): treadle (eager, with
``torch_compile``, and with ``gradient_checkpointing``), TRL 1.16 and a bare PyTorch loop doing the same work, against
the machine's float32 matmul roof measured in the same run.

    python benchmarks/real.py [--rounds 3] [--steps 5] [--threads 2] [--only sft,dpo,grpo] [--grpo 8x8x64]
                              [--contenders bare,treadle,treadle-compiled,treadle-checkpointed,trl,trl-glibc]
                              [--keep-freed-memory 1]

The same work for every contender (each in its own process, so that its peak RSS is its own; the contenders of a
workload run one after another, round by round, interleaved):

- process: the same threads and the same glibc allocator settings for every contender: each imports treadle (TRL's
  and the bare loop's process to find the model's folder), whose ``keep_freed_memory`` keeps freed memory for reuse
  (``--keep-freed-memory 0``: glibc's defaults for all). ``trl-glibc`` is TRL as it ships, in glibc's defaults
  whatever the flag: the same run then compares treadle and TRL each as shipped, and TRL in treadle's setting;
- model: the cached HF folder of ``treadle.demos.smollm2``, float32, in train mode; AdamW (torch, for-loop), lr 1e-5,
  no weight decay, gradient clipping at 1.0, a constant schedule; one micro-batch per optimizer step; no evaluation,
  no checkpoints, no progress bars.
- SFT: 8 rows of exactly 128 tokens of English text (slices of one tokenised passage), already tokenised
  (``input_ids``), loss on every token; 6 x 134.5M x 1,024 = 826 GFLOP a step.
- DPO (sigmoid, beta 0.1): 8 pairs, a 96-token prompt and 32-token responses (chosen and rejected differ), a
  frozen reference model run each step; 6 x N x 2,048 (policy) + 2 x N x 2,048 (reference) = 2,203 GFLOP a step.
- GRPO (``--grpo PROMPTSxGxTOKENS``, default 8 x 8 x 64): chat prompts "What is a + b? Reply with just the number.",
  G completions each, sampled at temperature 1 with both end tokens suppressed so that every completion is exactly
  TOKENS long; reward 1 when the answer's last number is the sum; no reference model (beta 0), loss_type dapo, one
  optimizer step per generation. Work: 2 x N per sampled or prompt token (the rollout) + 6 x N per token of every
  prompt + completion (the training pass); the trainers' own sampler (treadle) and transformers ``generate`` (TRL and
  the bare loop) do the same rollout.

The bare loops are what a careful engineer writes by hand: the model's own loss (SFT: ``model(ids, labels=ids)``,
full float32 logits), the DPO loss from ``log_softmax(...).gather`` over the completion tokens, or GRPO as
``model.generate`` then the group-normalised policy gradient from ``log_softmax(...).gather``; no framework. They
take the rows in the trainers' seeded order (``torch.randperm`` of seed 0), so that SFT and DPO end at their loss.

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
CONTENDERS = ("bare", "treadle", "treadle-compiled", "treadle-checkpointed", "trl", "trl-glibc")
GLIBC = "-glibc"  # a contender name ending so runs in glibc's allocator defaults (TREADLE_KEEP_FREED_MEMORY=0)
GRPO = {"prompts": 8, "g": 8, "tokens": 64}  # set by --grpo


def flops_per_step(kind: str, tokenizer=None) -> float:
    if kind == "grpo":  # every completion is exactly GRPO["tokens"] long: see grpo_prompts
        lengths = [len(prompt_ids(tokenizer, row)) for row in grpo_rows(GRPO["prompts"])]
        return 8 * N_PARAMS * GRPO["g"] * sum(n + GRPO["tokens"] for n in lengths)
    tokens = BATCH * SFT_LEN if kind == "sft" else 2 * BATCH * (PROMPT + RESPONSE)
    return 6 * N_PARAMS * tokens + (2 * N_PARAMS * tokens if kind == "dpo" else 0)


def seeded_order(n: int) -> list[int]:
    """The trainers' order of ``n`` rows at seed 0, epoch 0 (treadle.data's sampler; TRL's gives the same losses)."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()


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


def matmul_roof(threads: int, dtype: str = "float32", cols=(576, 1536, 49152), repeats: int = 3) -> float:
    """Best GFLOP/s of the model's own matmul shapes at 1,024 rows (1,024 x 576 by 576 x ``cols``), float32 unless
    ``dtype`` says otherwise."""
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for n in cols:
        a, b = torch.randn(1024, 576, dtype=getattr(torch, dtype)), torch.randn(576, n, dtype=getattr(torch, dtype))
        a @ b
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = max(best, 2 * 1024 * 576 * n / (time.perf_counter() - start) / 1e9)
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

    if kind == "grpo":
        return bare_grpo(model, tokenizer, steps, clock)
    rows = token_rows(tokenizer, kind, BATCH * steps)
    rows = [rows[i] for i in seeded_order(len(rows))]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, foreach=False)
    losses, reference = [], None
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
        losses.append(loss.item())
        clock.tick()
    # the trainers log the mean loss of the steps since their last log (logging_steps = steps: all of them)
    settings = "hand-written loop, model's own loss (SFT) / log_softmax.gather (DPO)"
    return {"loss": sum(losses) / len(losses), "settings": settings}


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


def bare_grpo(model, tokenizer, steps: int, clock: StepEnds) -> dict:
    """``generate`` G completions of each prompt, group-normalised rewards, one policy-gradient step (ratio 1 at
    the sampled weights, as one step per generation has it); the loss averaged over every completion token (dapo)."""
    import torch
    import torch.nn.functional as F

    from treadle.demos.real import last_number_is_sum

    P, G, T = GRPO["prompts"], GRPO["g"], GRPO["tokens"]
    rows = grpo_rows(P * steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, foreach=False)
    clock.last = time.perf_counter()
    for step in range(steps):
        batch = rows[step * P : (step + 1) * P]
        prompts = [prompt_ids(tokenizer, row) for row in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.repeat_interleave(G, 0),
                attention_mask=mask.repeat_interleave(G, 0),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=T,
                suppress_tokens=end_ids(tokenizer),
                pad_token_id=tokenizer.pad_token_id,
            )
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        answers = [row["answer"] for row in batch for _ in range(G)]
        rewards = torch.tensor(last_number_is_sum(texts, answers)).view(P, G)  # treadle.demos.real's reward
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
        full_mask = torch.cat([mask.repeat_interleave(G, 0), torch.ones(P * G, T, dtype=torch.long)], 1)
        logits = model(input_ids=out, attention_mask=full_mask).logits[:, width - 1 : -1].float()
        logps = F.log_softmax(logits, -1).gather(-1, out[:, width:, None]).squeeze(-1)
        loss = -(torch.exp(logps - logps.detach()) * advantages[:, None]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
    return {"loss": loss.item(), "settings": f"hand-written loop, model.generate, {P} prompts x G {G} x {T} tokens"}


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

    if kind == "grpo":
        rows = Dataset.from_list(grpo_rows(GRPO["prompts"] * steps))
    else:
        rows = Dataset.from_list(token_rows(tokenizer, kind, BATCH * steps))
    lib, callback_base, extra = trainer_library(name)
    prefix = kind.upper()
    config_class, trainer_class = getattr(lib, f"{prefix}Config"), getattr(lib, f"{prefix}Trainer")
    common.update(extra)
    if kind == "dpo":
        common.update(beta=0.1, loss_type="sigmoid")
    elif kind == "sft":
        common.update(packing=False)
    else:
        del common["max_length"]
        common.update(
            per_device_train_batch_size=GRPO["prompts"] * GRPO["g"],
            num_generations=GRPO["g"],
            max_completion_length=GRPO["tokens"],
            steps_per_generation=1,
            temperature=1.0,
            beta=0.0,
            loss_type="dapo",
            generation_kwargs={"suppress_tokens": end_ids(tokenizer)},
        )

    class Tick(callback_base):
        def on_train_begin(self, args, state, control, **kwargs):
            clock.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            clock.tick()

    from treadle.demos.real import last_number_is_sum

    more = {"reward_funcs": last_number_is_sum} if kind == "grpo" else {}
    trainer = trainer_class(
        model=model, args=config_class(**common), train_dataset=rows, processing_class=tokenizer, **more
    )
    trainer.add_callback(Tick())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    args = trainer.args
    settings = f"{type(trainer).__name__}, optim {args.optim}, lr {args.learning_rate}, clip {args.max_grad_norm}"
    if kind == "sft":
        settings += f", loss_type {getattr(args, 'loss_type', 'nll (the model loss, chunked on large logits)')}"
    if kind == "grpo":
        sampler = "transformers generate" if name == "trl" else f"generation_backend {args.generation_backend}"
        settings += f", {GRPO['prompts']} prompts x G {args.num_generations} x {args.max_completion_length}, {sampler}"
    if name == "treadle-compiled":
        settings += f", torch_compile {args.torch_compile_backend}"
    if name == "treadle-checkpointed":
        settings += ", gradient_checkpointing"
    return {"loss": losses[-1] if losses else float("nan"), "settings": settings}


def trainer_library(name: str):
    """The module holding contender ``name``'s trainers and configs, its callback base class, and the settings it
    needs for the same work (TRL: float32, no loader workers; treadle: ``torch_compile`` for the compiled one)."""
    if name == "trl":
        import transformers
        import trl

        return trl, transformers.TrainerCallback, {"bf16": False, "dataloader_num_workers": 0}
    import treadle

    return (
        treadle,
        treadle.TrainerCallback,
        {
            "torch_compile": name == "treadle-compiled",
            "gradient_checkpointing": name == "treadle-checkpointed",
        },
    )


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
    library = name.removesuffix(GLIBC)
    run = (
        bare(kind, model, tokenizer, steps, clock)
        if library == "bare"
        else framework(library, kind, model, tokenizer, steps, clock)
    )
    import treadle

    kept = treadle.keep_freed_memory()  # what import treadle did in this process (the same call, idempotent)
    run["settings"] += ", freed memory kept (glibc)" if kept else ", glibc's allocator defaults"
    return {
        **run,
        "contender": name,
        "kind": kind,
        "times": clock.times,
        "gflop": flops_per_step(kind, tokenizer) / 1e9,
        "loaded_rss_mib": loaded,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------
def spawn(spec: str, steps: int, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if spec.split(":")[0].endswith(GLIBC):  # as it ships: glibc's defaults, whatever --keep-freed-memory says
        env["TREADLE_KEEP_FREED_MEMORY"] = "0"
    grpo = "x".join(str(GRPO[k]) for k in ("prompts", "g", "tokens"))
    out = subprocess.run(
        [sys.executable, __file__, "--child", spec, "--steps", str(steps), "--threads", str(threads), "--grpo", grpo],
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
    parser.add_argument("--only", default="sft,dpo,grpo")
    parser.add_argument("--grpo", default="8x8x64", help="GRPO's prompts x G x new tokens per step")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--json", default=None, help="also write every run's raw figures here")
    parser.add_argument(
        "--keep-freed-memory",
        choices=("1", "0"),
        default="1",
        help="TREADLE_KEEP_FREED_MEMORY for every contender alike (each imports treadle), except the '-glibc' ones",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    GRPO.update(zip(("prompts", "g", "tokens"), map(int, args.grpo.split("x"))))
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.steps, args.threads)), flush=True)
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from _machine import machine_header

    os.environ["TREADLE_KEEP_FREED_MEMORY"] = args.keep_freed_memory  # inherited by every contender's process
    print(machine_header())
    print(
        f"{args.rounds} rounds x {args.steps} steps per run, {args.threads} threads; the first step of a run untimed;"
        f" GRPO {args.grpo} (prompts x G x new tokens);"
        f" TREADLE_KEEP_FREED_MEMORY={args.keep_freed_memory} for every contender"
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
        "| workload | contender | s/step (median; every round) | vs bare | vs TRL | GFLOP/s | share of roof | "
        "peak RSS | above loaded | final loss | settings |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in dict.fromkeys(r["kind"] for r in runs):
        mine = [r for r in runs if r["kind"] == kind]
        medians = {}
        for name in dict.fromkeys(r["contender"] for r in mine):
            medians[name] = [statistics.median(r["times"][1:]) for r in mine if r["contender"] == name]
        for name, per_round in medians.items():
            last = [r for r in mine if r["contender"] == name][-1]
            step = statistics.median(per_round)
            gflops = last["gflop"] / step
            vs = f"{step / statistics.median(medians['bare']):.2f}x" if "bare" in medians else "-"
            vs += f" | {step / statistics.median(medians['trl']):.2f}x" if "trl" in medians else " | -"
            lines.append(
                f"| {kind.upper()} | {name} | {step:.2f} ({', '.join(f'{s:.2f}' for s in per_round)}) | {vs} | "
                f"{gflops:.0f} | {gflops / roof:.0%} | {last['peak_rss_mib']:.0f} MiB | "
                f"{last['peak_rss_mib'] - last['loaded_rss_mib']:.0f} MiB | {last['loss']:.4f} | {last['settings']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
