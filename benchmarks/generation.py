"""Completions per second: treadle's fast sampling path vs transformers ``model.generate``.

Both contenders get the same randomly initialised Llama models (built from a config, nothing downloaded),
the same B distinct few-shot-length prompts, G completions per prompt, and the same sampling settings
(temperature 1, no top-k/top-p, EOS enabled). transformers generates with ``num_return_sequences=G``, which is
how TRL's GRPO samples. The contenders run interleaved so that noise from other processes hits both alike.

    python benchmarks/generation.py [--quick] [--threads N]

Prints a markdown table: median and best completions/s of each, and the ratio of the medians. On a shared
machine ``--threads 1`` gives steadier numbers (two contending intra-op threads slow both sides erratically).

A second table splits one decode step (one new token for every active row) into the model's forward and the
rest (sampling, bookkeeping), for treadle and for ``generate``, timed with forward hooks on the model: the
forward is the floor of any sampler that calls the model once per token, so ``generate``'s step time over
treadle's forward time is the most that removing all of treadle's own per-token work could give.

Figures and the commands that produced them: docs/performance.md (the README has the headline).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _machine import machine_header  # noqa: E402  (this folder is on sys.path when a script in it runs)

from treadle.generation import generate_completions  # noqa: E402

MODELS = {  # name: (hidden, layers, heads, vocab)
    "tiny": (64, 2, 4, 64),
    "small": (256, 4, 4, 1000),
}


def build_model(hidden: int, layers: int, heads: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def make_prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    """B prompts of length ``length`` +- 10%, so that left padding is exercised as in real few-shot batches."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(int(length * 0.9), int(length * 1.1) + 1, (batch,), generator=gen)
    return [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in lengths]


def run_hf(model, prompts, group: int, new_tokens: int, eos: int, pad: int) -> int:
    """Plain transformers generate on the left-padded batch; returns the number of completions."""
    from transformers import GenerationConfig

    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        num_return_sequences=group,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return out.shape[0]


def run_fast(model, prompts, group: int, new_tokens: int, eos: int, pad: int) -> int:
    out = generate_completions(
        model,
        prompts,
        num_generations=group,
        max_new_tokens=new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        backend="fast",
    )
    return out.completion_ids.shape[0]


def measure(model, prompts, group, new_tokens, eos, pad, repeats: int) -> dict[str, list[float]]:
    """Completions/s per repeat for each contender, run alternately after one warm-up call each."""
    contenders = {"transformers": run_hf, "treadle": run_fast}
    rates = {name: [] for name in contenders}
    for fn in contenders.values():
        fn(model, prompts, group, new_tokens, eos, pad)
    for _ in range(repeats):
        for name, fn in contenders.items():
            start = time.perf_counter()
            count = fn(model, prompts, group, new_tokens, eos, pad)
            rates[name].append(count / (time.perf_counter() - start))
    return rates


class ForwardClock:
    """Forward hooks on the model: the start and end time of every top-level forward call."""

    def __init__(self, model):
        self.spans: list[tuple[float, float]] = []
        self.handles = [
            model.register_forward_pre_hook(lambda *_: self.spans.append((time.perf_counter(), 0.0))),
            model.register_forward_hook(lambda *_: self._end()),
        ]

    def _end(self) -> None:
        start, _ = self.spans[-1]
        self.spans[-1] = (start, time.perf_counter())

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def decode_step_costs(fn, model, prompts, group, new_tokens, eos, pad, repeats: int) -> tuple[float, float, int]:
    """(seconds per decode step, of which the model's forward, steps per call): medians over ``repeats`` calls.
    A decode step is every forward after the first (the prefill), with the sampling that follows it."""
    steps, forwards, counts = [], [], []
    for _ in range(repeats):
        clock = ForwardClock(model)
        fn(model, prompts, group, new_tokens, eos, pad)
        end = time.perf_counter()
        clock.close()
        decode = clock.spans[1:]
        if not decode:
            continue
        steps.append((end - clock.spans[0][1]) / len(decode))
        forwards.append(sum(e - s for s, e in decode) / len(decode))
        counts.append(len(decode))
    return statistics.median(steps), statistics.median(forwards), int(statistics.median(counts))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, 16 new tokens, 3 repeats")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--prompt-length", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4, help="B distinct prompts")
    parser.add_argument("--group", type=int, default=8, help="G completions per prompt")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = ["tiny"] if args.quick else list(MODELS)
    token_counts = [16] if args.quick else [16, 64]
    repeats = 3 if args.quick else args.repeats
    eos, pad = 2, 0

    print(machine_header() + "\n")
    print(
        f"B={args.batch} prompts of ~{args.prompt_length} tokens, G={args.group}, sampling T=1, EOS id {eos}, "
        f"repeats={repeats}, torch threads={torch.get_num_threads()}\n"
    )
    print(
        "| model | new tokens | transformers median / best (compl/s) | treadle median / best (compl/s) "
        "| speed-up (median) |"
    )
    print("|---|---|---|---|---|")
    costs = {}
    for name in models:
        model = build_model(*MODELS[name])
        prompts = make_prompts(args.batch, args.prompt_length, MODELS[name][3])
        for new_tokens in token_counts:
            rates = measure(model, prompts, args.group, new_tokens, eos, pad, repeats)
            hf, fast = rates["transformers"], rates["treadle"]
            ratio = statistics.median(fast) / statistics.median(hf)
            print(
                f"| {name} | {new_tokens} | {statistics.median(hf):.0f} / {max(hf):.0f} "
                f"| {statistics.median(fast):.0f} / {max(fast):.0f} | {ratio:.2f}x |",
                flush=True,
            )
            costs[(name, new_tokens)] = [
                decode_step_costs(fn, model, prompts, args.group, new_tokens, eos, pad, repeats)
                for fn in (run_hf, run_fast)
            ]
    rows = args.batch * args.group
    print(f"\nOne decode step ({rows} rows, one new token each; medians): the model's forward is the floor\n")
    print(
        "| model | new tokens | transformers ms/step (forward) | treadle ms/step (forward) | treadle µs per sampled "
        "token | treadle non-forward share | floor: transformers step / treadle forward |"
    )
    print("|---|---|---|---|---:|---:|---:|")
    for (name, new_tokens), ((hf_step, hf_fwd, _), (step, fwd, _)) in costs.items():
        print(
            f"| {name} | {new_tokens} | {1000 * hf_step:.2f} ({1000 * hf_fwd:.2f}) | {1000 * step:.2f} "
            f"({1000 * fwd:.2f}) | {1e6 * step / rows:.0f} | {1 - fwd / step:.0%} | {hf_step / fwd:.2f}x |"
        )


if __name__ == "__main__":
    main()
