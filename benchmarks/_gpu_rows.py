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
  split into sampling and scoring (``prepare_window``) and the rest (forward, backward, optimizer).

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

ROWS = ("own", "hf", "vllm-colocate", "vllm-server", "grpo")
DEFAULT_MODEL = str(Path(__file__).resolve().parent / "data" / "smollm2-config")
SIZES = {  # (prompts, completions per prompt, new tokens), (timed rounds or steps)
    "sampler": {"gpu": ((64, 8, 128), 3), "smoke": ((2, 2, 8), 1)},
    "grpo": {"gpu": ((8, 8, 64), 3), "smoke": ((2, 2, 8), 1)},
}
SMOKE_LAYERS = 2


class RowTimeout(BaseException):
    """A row ran past ``--row-timeout`` (a BaseException, so that no ``except Exception`` on the way swallows it)."""


def add_arguments(parser) -> None:
    parser.add_argument("--real-rows", default=",".join(ROWS), help=f"mode real's rows: {', '.join(ROWS)}")
    parser.add_argument("--real-model", default=DEFAULT_MODEL, help="folder with config.json and the tokenizer")
    parser.add_argument("--real-weights", default="random", choices=["random", "file"], help="random or DIR's")
    parser.add_argument("--row-timeout", type=float, default=300.0, help="seconds one real row may take")


def check_arguments(args, parser) -> None:
    args.real_rows = [r.strip() for r in args.real_rows.split(",") if r.strip()]
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


def load_model(opts, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer, description) of ``--real-model`` on ``device`` in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(opts.real_model)
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
    model, tokenizer, source = load_model(opts, device, dtype)
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
    median = statistics.median(times)
    return {
        **row,
        "settings": f"{prompts_} chat prompts x {group} x {tokens} new tokens, temperature 1, EOS ignored; "
        f"1 untimed round, median of {rounds}",
        "seconds": round(median, 3),
        "rounds_s": [round(t, 3) for t in times],
        "tokens_per_s": round(sampled / median, 1),
        "gflop_per_s": round(2 * row["params_m"] * 1e6 * sampled / median / 1e9, 1),
    }


def start_engine(name: str, model, opts, device: torch.device, row: dict):
    """(engine, the device of its sampling generator); vLLM's start-up and first sync go into ``row``."""
    if name in ("own", "hf"):
        row["engine"] = f"LocalEngine backend {'fast' if name == 'own' else 'hf'}"
        return LocalEngine(model, backend="fast" if name == "own" else "hf"), device
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
    """Seconds of ``rounds`` generations after an untimed one, each checked to have sampled every token."""
    times = []
    for round_ in range(rounds + 1):
        generator = torch.Generator(device=generator_device).manual_seed(round_)
        sync(device)
        start = time.perf_counter()
        out = engine.generate(prompts, params, generator=generator)
        sync(device)
        if round_:
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
        args = GRPOConfig(**grpo_settings(output_dir, prompts_, group, tokens, timed, tokenizer, device))
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
    real.WORK.update(prompts=prompts_, g=group, tokens=tokens)
    gflop = real.flops_per_step("grpo", tokenizer) * sum(p.numel() for p in model.parameters()) / real.N_PARAMS
    return {
        **describe(model, device, "bf16 autocast, fp32 weights" if device.type == "cuda" else "float32", source),
        "engine": f"GRPOTrainer, generation_backend {args.generation_backend}",
        "settings": f"{prompts_} prompts x G {group} x {tokens} new tokens (end tokens suppressed), beta 0, "
        f"loss_type dapo, AdamW lr 1e-5; 1 untimed step, median of {timed}",
        "step_s": round(step, 3),
        "steps_s": [round(t, 3) for t in steps],
        "sample_and_score_s": round(sample, 3),
        "train_s": round(step - sample, 3),
        "tokens_per_s": round(prompts_ * group * tokens / step, 1),
        "gflop_per_s": round(gflop / step / 1e9, 1),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
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
    print(f"\n{'real row':14} {'engine':38} {'dtype':28} {'device':7} {'s':>8} {'tokens/s':>10} {'GFLOP/s':>8}  extra")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['row']:14} {r['status']}: {r['reason']}")
            continue
        seconds = r.get("seconds", r.get("step_s"))
        extra = (
            f"sample+score {r['sample_and_score_s']:.3f} s, train {r['train_s']:.3f} s"
            if "step_s" in r
            else (f"start {r['start_s']} s, sync {r['sync_s']} s" if "start_s" in r else "")
        )
        print(
            f"{r['row']:14} {r['engine']:38} {r['dtype']:28} {r['device']:7} {seconds:8.3f} {r['tokens_per_s']:10.1f} "
            f"{r['gflop_per_s']:8.1f}  {extra}"
        )


ROW_FUNCTIONS = {
    "own": sampler_row,
    "hf": sampler_row,
    "vllm-colocate": sampler_row,
    "vllm-server": sampler_row,
    "grpo": grpo_row,
}
