"""GRPO sampling from a LoRA policy: adapters applied on the fly (what treadle does) vs merged into the base
weights for the call (``merge_adapter()`` before, the original weights put back after).

    python benchmarks/peft_generation.py                  # toy:small, 8 prompts x 8 completions x 32 tokens
    python benchmarks/peft_generation.py --size base

Both sample the same distribution (greedy decoding gives the same tokens, checked here). The merged variant
pays, per generation call, one merge (W += B A s for each adapted layer) and one restore of the saved base
weights; an ``unmerge_adapter()`` subtraction instead of the restore would leave the base weights off by
rounding after every call. Times are the median of ``--repeats`` calls, one thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def main(argv=None):
    from peft import LoraConfig

    from treadle import peft as treadle_peft
    from treadle.demos import toy
    from treadle.generation import generate_completions

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = toy.build_tokenizer()
    model = treadle_peft.apply_peft(
        toy.build_model(args.size, tokenizer=tokenizer),
        LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM", init_lora_weights=False),
    ).to(args.device)
    prompts = [tokenizer.encode(f"{10 + i}+{50 + i}=") for i in range(args.prompts)]
    sample = dict(
        num_generations=args.generations,
        max_new_tokens=args.tokens,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )

    def unmerged():
        return generate_completions(model, prompts, **sample).completion_ids

    def merged():
        layers = [m for m in model.modules() if hasattr(m, "merge") and hasattr(m, "base_layer")]
        saved = [layer.base_layer.weight.detach().clone() for layer in layers]
        model.merge_adapter()
        try:
            return generate_completions(model, prompts, **sample).completion_ids
        finally:
            for layer, weight in zip(layers, saved):
                layer.merged_adapters = []  # mark unmerged, then put the exact base weight back
                layer.base_layer.weight.data.copy_(weight)

    results = {}
    for name, fn in (("adapters on the fly", unmerged), ("merged for the call", merged)):
        fn()  # warm-up
        times = []
        for _ in range(args.repeats):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            ids = fn()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        results[name] = (statistics.median(times), ids)
    assert torch.equal(results["adapters on the fly"][1], results["merged for the call"][1]), "greedy tokens differ"
    print(
        f"toy:{args.size} + LoRA r=16 all-linear on {args.device}: {args.prompts} prompts x {args.generations} "
        f"completions x {args.tokens} tokens, greedy, median of {args.repeats}"
    )
    print("| variant | seconds per call |")
    print("|---|---|")
    for name, (seconds, _) in results.items():
        print(f"| {name} | {seconds:.3f} |")


if __name__ == "__main__":
    main()
