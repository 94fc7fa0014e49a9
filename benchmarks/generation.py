"""GRPO's own sampler against transformers ``generate``: completions/s on toy models, the decode step on the real
model against the machine's matmul roof, and multi-turn rollouts with the KV cache kept against re-prefilling.

    python -m benchmarks.generation --threads 1          # every part: toy, real, turns
    python -m benchmarks.generation --parts real --threads 1 --tokens 32 --rounds 3
    python -m benchmarks.generation --parts turns --latency-ms 5
    python -m benchmarks.generation --parts static --threads 1 --generations 4 --tokens 32 --rounds 3
    python -m benchmarks.generation --quick               # tiny model, 16 tokens; real at 4 tokens; turns: tiny

- ``toy``: randomly initialised Llamas (nothing downloaded), B distinct prompts of ~100 tokens (+-10%, so left padding
  is exercised), G completions each, temperature 1, EOS enabled: ``generate_completions(backend="fast")`` against
  ``model.generate(num_return_sequences=G)`` (how TRL's GRPO samples), interleaved. A second table splits one decode
  step into the backbone's forward (timed with forward hooks; the same work in both) and the rest (the LM head,
  sampling, bookkeeping): ``generate``'s step over the own sampler's backbone forward is the most that removing all of
  its own per-token work could give.
- ``real``: SmolLM2-135M-Instruct float32, 8 chat prompts x ``--generations`` completions, ``--tokens`` new tokens with
  EOS ignored, temperature 1, one seed: ``sample_completions(backend="fast")`` against ``backend="hf"``, interleaved.
  Per contender: tokens/s of the whole call, ms per decode step (the call with ``--tokens`` new tokens minus the call
  with one, over ``--tokens - 1`` steps), its GFLOP/s (2 x parameters x rows per step) and its share of the roof: the
  best float32 rate of the model's own matmul shapes at that many rows, measured before and after the rounds (the
  higher counts: a roof measured while another process holds a core reads low); and its share of the step's own
  matmuls replayed (``harness.matmul_replay``: every ``nn.Linear`` once on the model's own weights at that many rows,
  which, unlike the roof's one small weight, do not stay in cache). ``benchmarks.lab.profile --what decode`` splits
  the decode step op by op.
- ``static``: the same SmolLM2 work through the own sampler three ways: the dynamic cache (``real``'s own sampler),
  the static decode step run eagerly, and the static step compiled by inductor (``DecodeSettings("static",
  "eager" | "inductor")``, generation/static.py), interleaved; per contender tokens/s, ms per decode step (as in
  ``real``) and the first call's seconds (the compiled one pays its compilation there, once per bucket).
- ``turns``: the same B prompts x G rolled out for ``--turns`` tool turns, each model turn (ending at EOS) answered
  with a ~10-token observation, optionally after a random tool latency (``--latency-ms``, uniform in [0, 2x]):
  ``generation.sample_turns`` (the KV cache kept, a row waiting on its tool sits out) against
  ``generation.reprefill_turns`` (each turn prefills the whole transcript again and waits for every tool of the batch).
  The random toy models get a bias on the EOS logit so that a turn is ~8 tokens.

Every process keeps freed memory unless ``--allocator glibc``; on a shared machine ``--threads 1`` is steadier.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from benchmarks import harness
from treadle.demos import toy
from treadle.generation import SamplingParams, generate_completions, reprefill_turns, sample_turns
from treadle.generation.single import sample_completions
from treadle.generation.static import DecodeSettings

PARTS = ("toy", "real", "static", "turns")
STATIC_CONTENDERS = {  # part static: name -> how the own sampler decodes
    "dynamic cache": None,
    "static, eager": DecodeSettings("static", "eager"),
    "static, inductor": DecodeSettings("static", "inductor"),
}
TOY_MODELS = {"tiny": (64, 2, 4, 64), "small": (256, 4, 4, 1000)}  # name: (hidden, layers, heads, vocab)
N_PARAMS = 134_515_008  # SmolLM2-135M-Instruct, tied embeddings counted once (the head is a matmul, the lookup not)
ROOF_SHAPES = [(576, 192), (576, 576), (576, 1536), (1536, 576), (576, 49152)]  # (K, N) of SmolLM2's matmuls
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "Give me three names for a cat.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "List two uses of a paperclip.",
]
EOS, PAD = 2, 0


# ---------------------------------------------------------------------------------------------------------
# toy: completions/s and the decode step
# ---------------------------------------------------------------------------------------------------------
def toy_llama(hidden: int, layers: int, heads: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM  # transformers' modelling code: seconds to import

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
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config).eval()


def toy_prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(int(length * 0.9), int(length * 1.1) + 1, (batch,), generator=gen)
    return [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in lengths]


def run_hf(model, prompts, group: int, new_tokens: int) -> int:
    """transformers ``generate`` on the left-padded batch; returns the number of completions."""
    from transformers import GenerationConfig

    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        num_return_sequences=group,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=config).shape[0]


def run_fast(model, prompts, group: int, new_tokens: int) -> int:
    out = generate_completions(
        model,
        prompts,
        num_generations=group,
        max_new_tokens=new_tokens,
        eos_token_id=EOS,
        pad_token_id=PAD,
        backend="fast",
    )
    return out.completion_ids.shape[0]


TOY_CONTENDERS = {"transformers": run_hf, "treadle": run_fast}


class ForwardClock:
    """Forward hooks on the model: the start and end time of every top-level forward call."""

    def __init__(self, model):
        self.spans: list[tuple[float, float]] = []
        self.handles = [
            model.register_forward_pre_hook(lambda *_: self.spans.append((time.perf_counter(), 0.0))),
            model.register_forward_hook(lambda *_: self._end()),
        ]

    def _end(self) -> None:
        self.spans[-1] = (self.spans[-1][0], time.perf_counter())

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def decode_step_costs(fn, model, prompts, group, new_tokens, repeats: int) -> tuple[float, float]:
    """(seconds per decode step, of which the backbone's forward): medians over ``repeats`` calls. A decode step is
    every backbone forward after the first (the prefill), with the LM head and the sampling that follow it. The clock
    is on the backbone (``model.model``), not the whole model: the own sampler runs the backbone, then the head in
    slices of its own, never the model's top-level forward."""
    steps, forwards = [], []
    for _ in range(repeats):
        clock = ForwardClock(model.model)
        fn(model, prompts, group, new_tokens)
        end = time.perf_counter()
        clock.close()
        decode = clock.spans[1:]
        if decode:
            steps.append((end - clock.spans[0][1]) / len(decode))
            forwards.append(sum(e - s for s, e in decode) / len(decode))
    return statistics.median(steps), statistics.median(forwards)


def part_toy(run: harness.Run, opts) -> None:
    models, token_counts = (["tiny"], [16]) if opts.quick else (list(TOY_MODELS), [16, 64])
    repeats, rows, steps = 3 if opts.quick else opts.repeats, [], []
    for name in TOY_CONTENDERS:
        run.contender(name, part="toy", prompts=f"{opts.batch} x ~{opts.prompt_length} tokens", G=opts.group, T=1)
    for size in models:
        model = toy_llama(*TOY_MODELS[size])
        prompts = toy_prompts(opts.batch, opts.prompt_length, TOY_MODELS[size][3])
        for tokens in token_counts:
            rates = {name: [] for name in TOY_CONTENDERS}
            for fn in TOY_CONTENDERS.values():
                fn(model, prompts, opts.group, tokens)  # warm-up
            for _, name in harness.interleaved(list(TOY_CONTENDERS), repeats):
                start = time.perf_counter()
                count = TOY_CONTENDERS[name](model, prompts, opts.group, tokens)
                rates[name].append(count / (time.perf_counter() - start))
            hf, fast = harness.spread(rates["transformers"]), harness.spread(rates["treadle"])
            run.row(part="toy", model=size, new_tokens=tokens, transformers=hf, treadle=fast)
            rows.append([size, tokens, _rate(hf), _rate(fast), f"{fast['median'] / hf['median']:.2f}x"])
            costs = [decode_step_costs(fn, model, prompts, opts.group, tokens, repeats) for fn in (run_hf, run_fast)]
            steps.append(decode_row(size, tokens, costs, opts.batch * opts.group))
    print(f"\n### Completions/s, B={opts.batch} prompts, G={opts.group}, {repeats} interleaved repeats\n")
    header = ["model", "new tokens", "transformers median (range) compl/s", "treadle median (range) compl/s"]
    print(harness.table(header + ["speed-up (median)"], rows))
    print(f"\nOne decode step ({opts.batch * opts.group} rows; medians): the backbone's forward is the floor\n")
    header = ["model", "new tokens", "transformers ms/step (backbone)", "treadle ms/step (backbone)"]
    header += ["treadle µs per sampled token", "treadle non-backbone share", "transformers step / treadle backbone"]
    print(harness.table(header, steps))


def _rate(s: dict) -> str:
    return f"{s['median']:.0f} ({s['min']:.0f} - {s['max']:.0f})"


def decode_row(size: str, tokens: int, costs, rows: int) -> list:
    (hf_step, hf_fwd), (step, fwd) = costs
    return [
        size,
        tokens,
        f"{1000 * hf_step:.2f} ({1000 * hf_fwd:.2f})",
        f"{1000 * step:.2f} ({1000 * fwd:.2f})",
        f"{1e6 * step / rows:.0f}",
        f"{1 - fwd / step:.0%}",
        f"{hf_step / fwd:.2f}x",
    ]


# ---------------------------------------------------------------------------------------------------------
# real: the decode step on SmolLM2 against the roof
# ---------------------------------------------------------------------------------------------------------
def load_real(tokens: int, generations: int):
    """(SmolLM2-135M-Instruct float32 in eval mode, its 8 chat prompts' ids, the sampling settings)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from treadle.demos import smollm2

    folder = smollm2.folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chats = [[{"role": "user", "content": p}] for p in CHATS]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]  # 5.x returns a dict
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    params = SamplingParams(num_generations=generations, max_new_tokens=tokens, eos_token_ids=(), pad_token_id=pad)
    return model, prompts, params


def timed_call(model, prompts, params, backend: str, tokens: int, decode: DecodeSettings | None = None) -> float:
    generator = torch.Generator().manual_seed(0)
    params = replace(params, max_new_tokens=tokens)
    start = time.perf_counter()
    sample_completions(model, prompts, params, generator=generator, backend=backend, decode=decode)
    return time.perf_counter() - start


def part_real(run: harness.Run, opts) -> None:
    tokens, generations, rounds = (4, 2, 1) if opts.quick else (opts.tokens, opts.generations, opts.rounds)
    model, prompts, params = load_real(tokens, generations)
    rows = len(prompts) * generations
    for backend, name in (("fast", "own sampler"), ("hf", "generate")):
        run.contender(name, part="real", backend=backend, rows=f"{len(prompts)} x {generations}", tokens=tokens)
    roofs = [harness.matmul_roof(rows, ROOF_SHAPES, repeats=5)]
    replays = [harness.matmul_replay(model, rows)]
    times = {b: {"full": [], "one": []} for b in ("fast", "hf")}
    for backend in times:  # warm-up: first-call allocations and lazy imports
        timed_call(model, prompts, params, backend, 2)
    for _, backend in harness.interleaved(list(times), rounds):
        times[backend]["full"].append(timed_call(model, prompts, params, backend, tokens))
        times[backend]["one"].append(timed_call(model, prompts, params, backend, 1))
    roofs.append(harness.matmul_roof(rows, ROOF_SHAPES, repeats=5))
    replays.append(harness.matmul_replay(model, rows))
    print(
        f"\n### SmolLM2-135M-Instruct float32, {rows} rows, {tokens} new tokens, {rounds} rounds; roofs {roofs}; "
        f"the step's matmuls replayed {replays}\n"
    )
    print(real_table(run, times, tokens, rows, max(roofs), max(replays)))
    run.figure(real_roofs=roofs, real_replays=replays)


def part_static(run: harness.Run, opts) -> None:
    tokens, generations, rounds = (4, 2, 1) if opts.quick else (opts.tokens, opts.generations, opts.rounds)
    model, prompts, params = load_real(tokens, generations)
    rows, names = len(prompts) * generations, list(STATIC_CONTENDERS)
    for name, decode in STATIC_CONTENDERS.items():
        run.contender(name, part="static", decode=str(decode), rows=f"{len(prompts)} x {generations}", tokens=tokens)
    first = {name: timed_call(model, prompts, params, "fast", tokens, STATIC_CONTENDERS[name]) for name in names}
    times = {name: {"full": [], "one": []} for name in names}
    for _, name in harness.interleaved(names, rounds):
        times[name]["full"].append(timed_call(model, prompts, params, "fast", tokens, STATIC_CONTENDERS[name]))
        times[name]["one"].append(timed_call(model, prompts, params, "fast", 1, STATIC_CONTENDERS[name]))
    out = []
    for name, t in times.items():
        full, one = statistics.median(t["full"]), statistics.median(t["one"])
        step = (full - one) / max(1, tokens - 1)
        rate = rows * tokens / full
        versus = rate / (rows * tokens / statistics.median(times[names[0]]["full"]))
        run.row(part="static", contender=name, full_s=t["full"], one_token_s=t["one"], first_s=first[name])
        out.append([name, f"{rate:.1f}", f"{1e3 * step:.1f}", f"{versus:.2f}x", f"{first[name]:.1f}"])
        out[-1].append(", ".join(f"{x:.2f}" for x in t["full"]))
    print(f"\n### SmolLM2-135M-Instruct float32, {rows} rows, {tokens} new tokens, {rounds} rounds: the decode step\n")
    header = ["own sampler", "tokens/s", "ms per decode step", "vs dynamic", "first call (s)", "rounds (s)"]
    print(harness.table(header, out))


def real_table(run: harness.Run, times: dict, tokens: int, rows: int, roof: float, replay: float) -> str:
    out, rates = [], {}
    for backend, t in times.items():
        full, one = statistics.median(t["full"]), statistics.median(t["one"])
        rates[backend] = rows * tokens / full
        step = (full - one) / max(1, tokens - 1)
        gflops = 2 * N_PARAMS * rows / 1e9 / step if step > 0 else float("nan")
        name = {"fast": "own sampler", "hf": "generate"}[backend]
        versus = rates[backend] / rates["hf"] if "hf" in rates else None
        run.row(part="real", contender=name, full_s=t["full"], one_token_s=t["one"], ms_per_step=1e3 * step)
        rounds = ", ".join(f"{x:.2f}" for x in t["full"])
        out.append([name, f"{rates[backend]:.1f}", f"{1e3 * step:.1f}", f"{gflops:.1f}", f"{gflops / roof:.0%}"])
        out[-1] += [f"{gflops / replay:.0%}", f"{versus:.2f}x" if versus else "", rounds]
    header = ["contender", "tokens/s", "ms per decode step", "GFLOP/s", "% of roof", "% of its matmuls replayed"]
    header += ["vs generate", "rounds (s)"]
    return harness.table(header, out)


# ---------------------------------------------------------------------------------------------------------
# turns: multi-turn rollouts, the cache kept against re-prefilling
# ---------------------------------------------------------------------------------------------------------
def chatty_model(size: str, tokenizer, eos_bias: float):
    """A toy model whose head favours EOS by ``eos_bias``, so that a turn is a few tokens."""
    model = toy.build_model(size, tokenizer=tokenizer)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    head.weight = model.lm_head.weight
    with torch.no_grad():
        head.bias.zero_()
        head.bias[EOS] = eos_bias
    model.lm_head = head
    return model.eval()


def tool_responder(tokenizer, pool, turns: int, latency_ms: float, seed: int):
    """``respond(row, turn_ids)``: a future of the row's next observation (None after ``turns`` turns)."""
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


def part_turns(run: harness.Run, opts) -> None:
    tokenizer, pool, rows = toy.build_tokenizer(), ThreadPoolExecutor(8), []
    settings = [("tiny", 8, 8, 60)] if opts.quick else [("tiny", 16, 8, 60), ("small", 8, 8, 60)]
    repeats = 3 if opts.quick else opts.repeats
    contenders = {"kept": sample_turns, "re-prefill": reprefill_turns}
    for name in contenders:
        run.contender(name, part="turns", turns=opts.turns, latency_ms=opts.latency_ms, max_new_tokens=160)
    for size, prompts, group, prompt_len in settings:
        model = chatty_model(size, tokenizer, eos_bias=2.5 if size == "tiny" else 3.5)
        gen = torch.Generator().manual_seed(0)
        batch = [torch.randint(7, len(tokenizer), (prompt_len,), generator=gen).tolist() for _ in range(prompts)]
        params = SamplingParams(num_generations=group, max_new_tokens=160, eos_token_ids=(EOS,), pad_token_id=0)
        rates = {name: [] for name in contenders}
        for round_, name in harness.interleaved(list(contenders), repeats):
            respond = tool_responder(tokenizer, pool, opts.turns, opts.latency_ms, seed=round_)
            start = time.perf_counter()
            contenders[name](model, batch, respond, params, generator=torch.Generator().manual_seed(round_))
            rates[name].append(prompts * group / (time.perf_counter() - start))
        kept, again = harness.spread(rates["kept"]), harness.spread(rates["re-prefill"])
        run.row(part="turns", model=size, prompts=prompts, group=group, kept=kept, reprefill=again)
        ratio = kept["median"] / again["median"]
        rows.append([size, f"{prompts} x {group}", prompt_len, _rate1(kept), _rate1(again), f"{ratio:.2f}x"])
    pool.shutdown()
    print(f"\n### Multi-turn rollouts/s, {opts.turns} tool turns, tool latency {opts.latency_ms} ms mean\n")
    header = ["model", "prompts x G", "prompt tokens", "kept: rollouts/s", "re-prefill: rollouts/s", "ratio"]
    print(harness.table(header, rows))


def _rate1(s: dict) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f} - {s['max']:.1f})"


def parse_args(argv=None):
    p = harness.parser(
        __doc__, "toy tiny at 16 tokens, 3 repeats; real at 4 tokens, 16 rows; turns tiny 8 x 8, 3 repeats"
    )
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=7, help="toy and turns: interleaved repeats (turns: 5 is plenty)")
    p.add_argument("--prompt-length", type=int, default=100, help="toy: prompt tokens")
    p.add_argument("--batch", type=int, default=4, help="toy: B distinct prompts")
    p.add_argument("--group", type=int, default=8, help="toy: G completions per prompt")
    p.add_argument("--tokens", type=int, default=32, help="real, static: new tokens per completion (EOS ignored)")
    p.add_argument("--generations", type=int, default=8, help="real, static: completions per prompt (8 prompts)")
    p.add_argument("--rounds", type=int, default=3, help="real, static: interleaved rounds")
    p.add_argument("--turns", type=int, default=3, help="turns: tool turns per rollout")
    p.add_argument("--latency-ms", type=float, default=0.0, help="turns: mean tool latency")
    return p.parse_args(argv)


def main(argv=None) -> None:
    opts = parse_args(argv)
    harness.apply_allocator(opts.allocator)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    run = harness.Run("generation", opts)
    parts = {"toy": part_toy, "real": part_real, "static": part_static, "turns": part_turns}
    for name in opts.parts.split(","):
        parts[name](run, opts)
        print(f"(part {name} done; load average {harness.machine()['load']})", file=sys.stderr, flush=True)
    run.finish()


if __name__ == "__main__":
    main()
