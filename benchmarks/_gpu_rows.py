"""Mode ``real`` of ``benchmarks.gpu_check``: rollout and GRPO figures on the real model's architecture,
SmolLM2-135M-Instruct (134.5M parameters, 30 layers, head size 64), in the same short run as the training modes.

The model is ``--real-model DIR`` (default ``benchmarks/data/smollm2-config``: the config and the tokenizer only,
3.4 MB, so that it travels with the working tree; the 93 MB GGUF does not) with ``--real-weights random`` (seeded
random weights: speed does not depend on them, and every completion runs to its full length anyway) or ``file``
(DIR holds the weights too). On a GPU the samplers run bf16 weights and GRPO trains fp32 weights under bf16
autocast; ``--cpu-smoke`` runs float32 on the CPU, with the config cut to 2 layers (random weights) and tiny sizes.
The rows (``--real-rows``; every one prints its settings, dtype and device):

- ``own``: treadle's own sampler (``LocalEngine``, backend "fast"): 64 chat prompts x 8 completions x 128 new tokens
  (smoke 2 x 2 x 8), temperature 1, EOS ignored; one untimed round, then the median of 3 (smoke 1).
- ``hf``: the same through transformers ``generate`` (``LocalEngine``, backend "hf": TRL's non-vLLM path).
- ``vllm-colocate``, ``vllm-server``: the same through ``VLLMEngine`` (in-process) and a ``treadle vllm-serve``
  subprocess (``benchmarks.engines``' ``start_vllm`` / ``start_server``), with start-up and one weight sync timed
  apart; skipped, with the reason, without vLLM.
- ``grpo``: ``GRPOTrainer`` steps, 8 prompts x G 8 x 64 new tokens (smoke 2 x 2 x 8), end tokens suppressed, no
  reference model (beta 0), loss_type dapo, the own sampler; one untimed step then 3 (smoke 1); seconds per step,
  split into sampling and scoring (``prepare_window``, its share of the step: ``sampling_share``) and the rest
  (forward, backward, optimizer).
- ``static``, ``grpo-static``: ``own`` and ``grpo`` with ``cache_implementation="static"`` (the static decode step,
  generation/static.py: CUDA graphs through ``torch.compile(mode="reduce-overhead")`` on a GPU, eager on CPU); the
  untimed first round or step pays the capture (``first_s``), ``captures`` counts the compiled buckets.
- ``hf-static``: ``hf`` with ``cache_implementation="static"`` (transformers compiles its own static-cache step).
- ``own-0.5b``, ``static-0.5b``, ``hf-0.5b``: ``own``, ``static``, ``hf`` on a Qwen2.5-0.5B-like Llama built in code
  (``HALF_B``: 24 layers, hidden 896, 14 heads / 2 KV heads, vocabulary 151,936, tied embeddings; 494M parameters;
  random weights; smoke: cut to 2 layers and hidden 64), where the GPU's work per token is larger.

``--real-rows capture`` runs the captured-decode set (own, hf, static, grpo, grpo-static and the 0.5B rows): the one
command for a lent GPU is in docs/performance.md.

Sampler tokens/s count the sampled tokens; GFLOP/s is 2 x N per sampled token, GRPO's that of ``benchmarks.real``
(``flops_per_step``). Each row runs under ``--row-timeout`` seconds (SIGALRM): a row that runs out is reported and the
next one runs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import real  # the GRPO prompts, the end tokens and the FLOP count, shared with the CPU figures
from benchmarks.engines import start_server, start_vllm
from treadle import GRPOConfig, GRPOTrainer, TrainerCallback
from treadle.demos.real import last_number_is_sum  # benchmarks.real's GRPO reward
from treadle.engines.local import LocalEngine
from treadle.engines.vllm import require_vllm
from treadle.generation.sampling import SamplingParams
from treadle.generation.static import DecodeSettings, static_decoder

ROWS = (
    "own",
    "hf",
    "static",
    "hf-static",
    "vllm-colocate",
    "vllm-server",
    "grpo",
    "grpo-static",
    "own-0.5b",
    "static-0.5b",
    "hf-0.5b",
)
DEFAULT_ROWS = ("own", "hf", "vllm-colocate", "vllm-server", "grpo")
CAPTURE_ROWS = ("own", "hf", "static", "grpo", "grpo-static", "own-0.5b", "static-0.5b", "hf-0.5b")
# Qwen2.5-0.5B's sizes as a Llama (no q/k/v bias): 24 x 14.9M + 151936 x 896 (tied) = 494M parameters
HALF_B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
HALF_B_SMOKE = dict(HALF_B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
DEFAULT_MODEL = str(Path(__file__).resolve().parent / "data" / "smollm2-config")
SIZES = {  # (prompts, completions per prompt, new tokens), (timed rounds or steps)
    "sampler": {"gpu": ((64, 8, 128), 3), "smoke": ((2, 2, 8), 1)},
    "grpo": {"gpu": ((8, 8, 64), 3), "smoke": ((2, 2, 8), 1)},
}
SMOKE_LAYERS = 2


class RowTimeout(BaseException):
    """A row ran past ``--row-timeout`` (a BaseException, so that no ``except Exception`` on the way swallows it)."""


def add_arguments(parser) -> None:
    parser.add_argument(
        "--real-rows",
        default=",".join(DEFAULT_ROWS),
        help=f"mode real's rows: {', '.join(ROWS)}; 'capture': {', '.join(CAPTURE_ROWS)}",
    )
    parser.add_argument("--real-model", default=DEFAULT_MODEL, help="folder with config.json and the tokenizer")
    parser.add_argument("--real-weights", default="random", choices=["random", "file"], help="random or DIR's")
    parser.add_argument("--row-timeout", type=float, default=300.0, help="seconds one real row may take")


def check_arguments(args, parser) -> None:
    args.real_rows = [r.strip() for r in args.real_rows.split(",") if r.strip()]
    if "capture" in args.real_rows:
        args.real_rows = [r for r in args.real_rows if r != "capture"] + list(CAPTURE_ROWS)
    unknown = set(args.real_rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown --real-rows {sorted(unknown)}; use {', '.join(ROWS)}")
    if not os.path.isfile(os.path.join(args.real_model, "config.json")):
        parser.error(f"--real-model {args.real_model}: no config.json there")
    if args.row_timeout <= 0:
        parser.error("--row-timeout must be > 0 seconds")


@contextlib.contextmanager
def time_limit(seconds: float):
    def expire(signum, frame):
        raise RowTimeout(f"ran past --row-timeout {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def real_rows(opts, device: torch.device, emit) -> list[str]:
    """Runs the asked rows one after another, each under the row timeout; ``emit(row)`` prints and keeps each row.
    Returns failures (a crash, a timeout, a loss that is not finite); a row skipped without vLLM is no failure."""
    failures = []
    for name in [r for r in ROWS if r in opts.real_rows]:
        started = time.perf_counter()
        try:
            with time_limit(opts.row_timeout):
                row = ROW_FUNCTIONS[name](name, opts, device)
        except RowTimeout as error:
            row = {"status": "timeout", "reason": str(error)}
        except ImportError as error:  # vLLM is optional: its rows are skipped, with the reason
            row = {"status": "skipped", "reason": str(error)}
        except Exception as error:  # report and go on: the other rows are still worth having
            row = {"status": "failed", "reason": f"{type(error).__name__}: {error}"}
        row = {"mode": "real", "row": name, "status": "ok", **row, "row_s": round(time.perf_counter() - started, 1)}
        emit(row)
        if row["status"] in ("timeout", "failed"):
            failures.append(f"real {name}: {row['status']}: {row['reason']}")
        elif name == "grpo" and not all(map(torch.isfinite, torch.tensor(row["losses"]))):
            failures.append(f"real grpo: a loss is not finite ({row['losses']})")
        release(device)
    return failures


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def scale(opts) -> str:
    return "smoke" if opts.cpu_smoke else "gpu"


def load_model(opts, device: torch.device, dtype: torch.dtype, half_b: bool = False):
    """(model, tokenizer, description) of ``--real-model`` on ``device`` in ``dtype``; ``half_b``: the
    Qwen2.5-0.5B-like Llama (``HALF_B``, random weights) with ``--real-model``'s tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(opts.real_model)
    if half_b:
        sizes = HALF_B_SMOKE if opts.cpu_smoke else HALF_B
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**sizes, attn_implementation="sdpa"), dtype=dtype)
        cut = " (smoke: 2 layers, hidden 64)" if opts.cpu_smoke else ""
        return model.eval(), tokenizer, f"Qwen2.5-0.5B-like Llama built in code, random weights (seed 0){cut}"
    if opts.real_weights == "file":
        model = AutoModelForCausalLM.from_pretrained(opts.real_model, dtype=dtype).to(device)
        return model.eval(), tokenizer, f"{opts.real_model} (its weights)"
    config = AutoConfig.from_pretrained(opts.real_model)
    layers = config.num_hidden_layers
    if opts.cpu_smoke:
        config.num_hidden_layers = SMOKE_LAYERS
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    cut = f", cut from {layers} to {SMOKE_LAYERS} layers" if opts.cpu_smoke else ""
    return model.eval(), tokenizer, f"{opts.real_model} config, random weights (seed 0){cut}"


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [real.prompt_ids(tokenizer, row) for row in real.grpo_rows(n)]


def describe(model, device: torch.device, dtype: str, source: str) -> dict:
    return {
        "device": str(device),
        "dtype": dtype,
        "model": source,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
    }


def sampler_row(name: str, opts, device: torch.device) -> dict:
    """Rollout tokens/s of one engine on the real model (rows own, hf, vllm-colocate, vllm-server)."""
    if name.startswith("vllm"):
        require_vllm()  # ImportError: the row is skipped with its reason, before a model is built for nothing
    dtype = torch.float32 if opts.cpu_smoke else torch.bfloat16
    model, tokenizer, source = load_model(opts, device, dtype, half_b=name.endswith("-0.5b"))
    (prompts_, group, tokens), rounds = SIZES["sampler"][scale(opts)]
    prompts = chat_prompts(tokenizer, prompts_)
    params = SamplingParams(
        num_generations=group, max_new_tokens=tokens, eos_token_ids=(), pad_token_id=tokenizer.pad_token_id
    )
    row = describe(model, device, str(dtype).removeprefix("torch."), source)
    engine, generator_device = start_engine(name, model, opts, device, row)
    try:
        times = timed_generation(engine, prompts, params, device, generator_device, rounds)
    finally:
        close_engine(engine)
    sampled = prompts_ * group * tokens
    first, times = times[0], times[1:]
    median = statistics.median(times)
    if "static" in name and name != "hf-static":
        row["captures"] = static_decoder(model, "auto", device).captures
    return {
        **row,
        "settings": f"{prompts_} chat prompts x {group} x {tokens} new tokens, temperature 1, EOS ignored; "
        f"1 untimed round, median of {rounds}",
        "seconds": round(median, 3),
        "first_s": round(first, 3),
        "rounds_s": [round(t, 3) for t in times],
        "tokens_per_s": round(sampled / median, 1),
        "gflop_per_s": round(2 * row["params_m"] * 1e6 * sampled / median / 1e9, 1),
    }


def start_engine(name: str, model, opts, device: torch.device, row: dict):
    """(engine, the device of its sampling generator); vLLM's start-up and first sync go into ``row``."""
    if not name.startswith("vllm"):
        backend = "hf" if name.startswith("hf") else "fast"
        decode = DecodeSettings("static" if "static" in name else None)
        static = ", cache_implementation static" if decode.static else ""
        row["engine"] = f"LocalEngine backend {backend}{static}"
        return LocalEngine(model, backend=backend, decode=decode), device
    if name == "vllm-colocate":
        engine, started, synced = start_vllm(model)
        process = None
    else:
        with tempfile.TemporaryDirectory() as folder:  # the server loads these, then gets them pushed again
            model.save_pretrained(folder)
            options = ("--dtype", row["dtype"]) + (
                ("--gpu-memory-utilization", "0.3") if device.type == "cuda" else ()
            )
            engine, started, synced, process = start_server(model, folder, options, timeout=opts.row_timeout)
    if engine is None:
        raise ImportError(started)  # start_* give the reason in place of the seconds
    engine.benchmark_process = process
    row.update(engine=type(engine).__name__, start_s=round(started, 1), sync_s=round(synced, 3))
    return engine, torch.device("cpu")  # vLLM draws its seeds from a CPU generator


def close_engine(engine) -> None:
    if isinstance(engine, LocalEngine):
        return
    engine.close()
    process = getattr(engine, "benchmark_process", None)
    if process is not None:
        process.terminate()
        process.wait(timeout=60)


def timed_generation(engine, prompts, params, device, generator_device, rounds: int) -> list[float]:
    """Seconds of an untimed generation (the first: allocation, a capture) then ``rounds`` timed ones, each checked
    to have sampled every token."""
    times = []
    for round_ in range(rounds + 1):
        generator = torch.Generator(device=generator_device).manual_seed(round_)
        sync(device)
        start = time.perf_counter()
        out = engine.generate(prompts, params, generator=generator)
        sync(device)
        times.append(time.perf_counter() - start)
        assert int(out.completion_mask.sum()) == len(prompts) * params.num_generations * params.max_new_tokens
    return times


def grpo_row(name: str, opts, device: torch.device) -> dict:
    """Seconds per GRPO step on the real model, split into sampling + scoring and the rest."""
    model, tokenizer, source = load_model(opts, device, torch.float32)  # fp32 master weights, bf16 from autocast
    (prompts_, group, tokens), timed = SIZES["grpo"][scale(opts)]
    ends, sampling = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            sync(device)
            ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as output_dir:
        settings = grpo_settings(output_dir, prompts_, group, tokens, timed, tokenizer, device)
        args = GRPOConfig(**settings, cache_implementation="static" if name == "grpo-static" else None)
        trainer = GRPOTrainer(
            model.train(),
            reward_funcs=last_number_is_sum,
            args=args,
            train_dataset=real.grpo_rows(prompts_ * (timed + 1)),
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        trainer.prepare_window = timed_call(trainer.prepare_window, device, sampling)
        start = time.perf_counter()
        trainer.train()
    steps = [b - a for a, b in zip([start, *ends], ends)][1:]  # the first step pays allocation: untimed
    step, sample = statistics.median(steps), statistics.median(sampling[1:])
    captures = {"captures": static_decoder(model, "auto", device).captures} if args.cache_implementation else {}
    real.WORK.update(prompts=prompts_, g=group, tokens=tokens)
    gflop = real.flops_per_step("grpo", tokenizer) * sum(p.numel() for p in model.parameters()) / real.N_PARAMS
    return {
        **describe(model, device, "bf16 autocast, fp32 weights" if device.type == "cuda" else "float32", source),
        "engine": f"GRPOTrainer, generation_backend {args.generation_backend}"
        + (", cache_implementation static" if args.cache_implementation else ""),
        "settings": f"{prompts_} prompts x G {group} x {tokens} new tokens (end tokens suppressed), beta 0, "
        f"loss_type dapo, AdamW lr 1e-5; 1 untimed step, median of {timed}",
        "step_s": round(step, 3),
        "steps_s": [round(t, 3) for t in steps],
        "sample_and_score_s": round(sample, 3),
        "sampling_share": round(sample / step, 3),
        "first_s": round(ends[0] - start, 3),
        "train_s": round(step - sample, 3),
        "tokens_per_s": round(prompts_ * group * tokens / step, 1),
        "gflop_per_s": round(gflop / step / 1e9, 1),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        **captures,
    }


def grpo_settings(output_dir, prompts_, group, tokens, timed, tokenizer, device) -> dict:
    """``benchmarks.real``'s GRPO settings (one optimizer step per generation), bf16 autocast on a GPU."""
    return dict(
        output_dir=output_dir,
        max_steps=timed + 1,
        per_device_train_batch_size=prompts_ * group,
        num_generations=group,
        max_completion_length=tokens,
        steps_per_generation=1,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
        generation_kwargs={"suppress_tokens": real.end_ids(tokenizer)},
        learning_rate=1e-5,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        bf16=device.type == "cuda",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
    )


def timed_call(function, device: torch.device, seconds: list[float]):
    """``function`` that appends its own seconds (the device synchronised at both ends) to ``seconds``."""

    def timed(*args, **kwargs):
        sync(device)
        start = time.perf_counter()
        result = function(*args, **kwargs)
        sync(device)
        seconds.append(time.perf_counter() - start)
        return result

    return timed


def report(rows: list[dict]) -> None:
    """Mode real's table: one line a row, with its engine, dtype, device and figures or why it has none."""
    print(f"\n{'real row':14} {'engine':66} {'dtype':28} {'device':7} {'s':>8} {'tokens/s':>10} {'GFLOP/s':>8}  extra")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['row']:14} {r['status']}: {r['reason']}")
            continue
        seconds = r.get("seconds", r.get("step_s"))
        extra = (
            f"sample+score {r['sample_and_score_s']:.3f} s ({r['sampling_share']:.0%}), train {r['train_s']:.3f} s"
            if "step_s" in r
            else (f"start {r['start_s']} s, sync {r['sync_s']} s" if "start_s" in r else "")
        )
        extra += f"; first {r['first_s']:.1f} s" + (f", {r['captures']} captures" if "captures" in r else "")
        print(
            f"{r['row']:14} {r['engine']:66} {r['dtype']:28} {r['device']:7} {seconds:8.3f} {r['tokens_per_s']:10.1f} "
            f"{r['gflop_per_s']:8.1f}  {extra}"
        )
    print("\n".join(ratios(rows)))


def ratios(rows: list[dict]) -> list[str]:
    """The issue's targets, as ratios of the rows that ran: static / generate tokens/s (>= 2x), the static GRPO
    step's sampling share (<= 50%)."""
    by_name = {r["row"]: r for r in rows if r["status"] == "ok"}
    lines = []
    for own, hf in (("static", "hf"), ("own", "hf"), ("static-0.5b", "hf-0.5b"), ("own-0.5b", "hf-0.5b")):
        if own in by_name and hf in by_name:
            ratio = by_name[own]["tokens_per_s"] / by_name[hf]["tokens_per_s"]
            lines.append(f"{own} / {hf} tokens/s: {ratio:.2f}x (target for static: >= 2x)")
    for name in ("grpo", "grpo-static"):
        if name in by_name:
            lines.append(f"{name} sampling share of the step: {by_name[name]['sampling_share']:.0%} (target <= 50%)")
    return lines


ROW_FUNCTIONS = {
    "own": sampler_row,
    "hf": sampler_row,
    "vllm-colocate": sampler_row,
    "vllm-server": sampler_row,
    "grpo": grpo_row,
    "static": sampler_row,
    "hf-static": sampler_row,
    "grpo-static": grpo_row,
    "own-0.5b": sampler_row,
    "static-0.5b": sampler_row,
    "hf-0.5b": sampler_row,
}
