"""Multi-turn rollouts per second: the KV cache kept across turns vs re-prefilling the whole transcript each turn.

Both contenders roll out the same B prompts x G with the same environment: every model turn (ending at EOS) is
answered with a tool-like observation of ~10 tokens, for ``--turns`` turns, optionally after a random tool
latency (``--latency-ms``: uniform in [0, 2 x latency]) in the thread pool. "kept" is
``generation.turns.sample_turns`` (observations fed through the batched decode step, a row waiting on its tool sits
out); "re-prefill" is ``generation.reprefill_turns`` with the same fast sampler per turn (each turn prefills the
prompt and every earlier turn again, and waits for every tool of the batch). The random toy models get a bias on
the EOS logit so that a turn is ~8 tokens. Contenders run interleaved so that load from other processes hits
both alike; the ratio of medians is printed with the machine's load average.

    python benchmarks/rollouts.py [--quick] [--threads N] [--turns N] [--latency-ms X]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from treadle.demos import toy  # noqa: E402
from treadle.generation import SamplingParams, reprefill_turns, sample_turns  # noqa: E402

EOS = 2


def chatty_model(size: str, tokenizer, eos_bias: float):
    model = toy.build_model(size, tokenizer=tokenizer)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    head.weight = model.lm_head.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[EOS] = eos_bias
    model.lm_head = head
    return model.eval()


def make_respond(tokenizer, pool, turns: int, latency_ms: float, seed: int):
    counts: dict[int, int] = {}
    rng = random.Random(seed)
    delays = [rng.uniform(0, 2 * latency_ms) / 1000 for _ in range(100_000)]

    def step(row: int, n: int):
        if latency_ms:
            time.sleep(delays[(row * 31 + n) % len(delays)])
        if n > turns:
            return None
        return tokenizer(f"<result>{row * 7919 % 100000}</result>", add_special_tokens=False)["input_ids"]

    def respond(row, turn_ids):
        counts[row] = counts.get(row, 0) + 1
        return pool.submit(step, row, counts[row])

    return respond


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small setting, 3 repeats")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--turns", type=int, default=3, help="tool turns per rollout")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="mean tool latency")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = toy.build_tokenizer()
    settings = [("tiny", 8, 8, 60)] if args.quick else [("tiny", 16, 8, 60), ("small", 8, 8, 60)]
    repeats = 3 if args.quick else args.repeats
    print(
        f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; threads={args.threads}, "
        f"turns={args.turns}, tool latency={args.latency_ms} ms mean"
    )
    print("| model | prompts x G | prompt tokens | kept: rollouts/s | re-prefill: rollouts/s | ratio |")
    print("|---|---|---|---|---|---|")
    pool = ThreadPoolExecutor(8)
    for size, prompts, group, prompt_len in settings:
        model = chatty_model(size, tokenizer, eos_bias=2.5 if size == "tiny" else 3.5)
        gen = torch.Generator().manual_seed(0)
        batch = [torch.randint(7, len(tokenizer), (prompt_len,), generator=gen).tolist() for _ in range(prompts)]
        times: dict[str, list[float]] = {"kept": [], "re-prefill": []}
        for repeat in range(repeats):
            for name in ("kept", "re-prefill") if repeat % 2 == 0 else ("re-prefill", "kept"):
                respond = make_respond(tokenizer, pool, args.turns, args.latency_ms, seed=repeat)
                run = sample_turns if name == "kept" else reprefill_turns
                params = SamplingParams(
                    num_generations=group, max_new_tokens=160, eos_token_ids=(EOS,), pad_token_id=0
                )
                start = time.perf_counter()
                run(model, batch, respond, params, generator=torch.Generator().manual_seed(repeat))
                times[name].append(prompts * group / (time.perf_counter() - start))
        kept, again = statistics.median(times["kept"]), statistics.median(times["re-prefill"])
        print(
            f"| {size} | {prompts} x {group} | {prompt_len} | {kept:.1f} | {again:.1f} | {kept / again:.2f}x |",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    pool.shutdown()


if __name__ == "__main__":
    main()
