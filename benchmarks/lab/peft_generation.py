"""GRPO sampling from a LoRA policy: adapters applied on the fly (what treadle does) against merged into the base
weights for the call (docs/peft.md, why the adapters stay unmerged).

    python -m benchmarks.lab.peft_generation                  # toy:small, 8 prompts x 8 completions x 32 tokens
    python -m benchmarks.lab.peft_generation --size base
    python -m benchmarks.lab.peft_generation --quick          # toy:tiny, 2 x 2 x 8, 2 repeats

Both sample the same distribution (greedy decoding gives the same tokens, checked here). The merged variant pays, per
generation call, one merge (W += B A s for each adapted layer) and one restore of the saved base weights; an
``unmerge_adapter()`` subtraction instead of the restore would leave the base weights off by rounding after every
call. Times are the median of ``--repeats`` calls, interleaved, one thread.
"""

from __future__ import annotations

import time

import torch

from benchmarks import harness
from treadle import peft as treadle_peft
from treadle.demos import toy
from treadle.generation import generate_completions


def contenders(model, prompts, sample: dict) -> dict:
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

    return {"adapters on the fly": unmerged, "merged for the call": merged}


def main(argv=None) -> None:
    from peft import LoraConfig  # optional: the peft extra

    p = harness.parser(__doc__, "toy tiny, 2 prompts x 2 x 8 tokens, 2 repeats")
    p.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    opts = p.parse_args(argv)
    if opts.quick:
        opts.size, opts.prompts, opts.generations, opts.tokens, opts.repeats = "tiny", 2, 2, 8, 2
    allocator = harness.apply_allocator(opts.allocator)
    torch.set_num_threads(1)
    run = harness.Run("lab.peft_generation", opts)
    tokenizer = toy.build_tokenizer()
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM", init_lora_weights=False)
    model = treadle_peft.apply_peft(toy.build_model(opts.size, tokenizer=tokenizer), lora).to(opts.device)
    prompts = [tokenizer.encode(f"{10 + i}+{50 + i}=") for i in range(opts.prompts)]
    sample = dict(
        num_generations=opts.generations,
        max_new_tokens=opts.tokens,
        eos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    calls = contenders(model, prompts, sample)
    times, ids = {name: [] for name in calls}, {name: fn() for name, fn in calls.items()}  # warm-up, and the tokens
    for name in calls:
        run.contender(name, model=f"toy {opts.size} + LoRA r 16 all-linear", greedy=True, allocator=allocator)
    for _, name in harness.interleaved(list(calls), opts.repeats):
        sync = torch.cuda.synchronize if opts.device.startswith("cuda") else (lambda: None)
        sync()
        start = time.perf_counter()
        calls[name]()
        sync()
        times[name].append(time.perf_counter() - start)
    assert torch.equal(*ids.values()), "greedy tokens differ"
    rows = []
    for name, spent in times.items():
        s = harness.spread(spent)
        run.row(variant=name, seconds=s)
        rows.append([name, f"{s['median']:.3f}", f"{s['min']:.3f} - {s['max']:.3f}"])
    shape = f"{opts.prompts} prompts x {opts.generations} x {opts.tokens} tokens, greedy"
    print(f"\n### toy {opts.size} + LoRA on {opts.device}: {shape}\n")
    print(harness.table(["variant", "seconds per call (median)", "range"], rows))
    run.finish()


if __name__ == "__main__":
    main()
