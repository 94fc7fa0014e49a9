"""GPU check for a lent machine: bf16 training of a ~0.5B-parameter Llama through treadle's Trainer, once
wrapped in DDP and once sharded with FSDP2, reporting tokens/s and peak memory. A few minutes on one H200.

    python -m benchmarks.gpu_check                        # one GPU: DDP, then FSDP2 (a 1-process group)
    torchrun --nproc_per_node 8 -m benchmarks.gpu_check   # N GPUs: the same, data-parallel over N
    python -m benchmarks.gpu_check --cpu-smoke            # CPU, tiny model, seconds: checks the script runs

One process per device. Without torchrun the script makes a one-process group itself
(``distributed.init_distributed(force=True)``) so that the Trainer really wraps the model in DDP / FSDP2 as it
would on N devices. The model is built from a ``LlamaConfig`` with random weights (nothing is downloaded) and
trained on random token ids: the numbers measure speed and memory, not learning. Each mode trains
``--warmup`` untimed steps then ``--steps`` timed ones with the same seed and data, so the two modes' first
losses must agree (both compute in bf16 autocast from fp32 weights); the script says FAIL when they do not,
when a loss is not finite, or when a mode crashes. It prints one JSON line per mode and a summary table;
``--out FILE`` also writes them as a JSON list.

Mode ``vllm`` (one process only; after the training modes): the colocated vLLM engine (``engines.vllm``) on the
same model in bf16 (``--cpu-smoke``: a float32 toy with head size 32, vLLM's smallest CPU kernel), twice: synced
as full weights, and as a LoRA policy (r 16 on every projection) synced as its adapter alone. Per row: start-up
seconds, the median of 3 syncs of changed weights (seconds, tensors, MB sent) and rollouts/s of 64 prompts x 8 x
128 tokens (EOS ignored; smoke 4 x 2 x 8). FAIL when the engine's weight-sync check finds a sync that did not
change its log-probs. Without vLLM (the main .venv) the rows are skipped with the reason printed.

Mode ``real`` (one process only; last): rollout tokens/s of the own sampler, transformers ``generate``, vLLM colocated
and vLLM served, and seconds per GRPO step, on SmolLM2-135M-Instruct's architecture (``benchmarks._gpu_rows``
says what each row runs; ``--real-rows``, ``--real-model``, ``--real-weights``). Each of its rows runs under
``--row-timeout`` seconds: one that runs out is reported and the next runs.

``--out FILE`` holds every mode's rows (``results``) and the failures, rewritten after each row, so that a run cut
short keeps what it measured; a run on a GPU also appends them to the results log (``--log``, benchmarks/results.jsonl
by default; ``--cpu-smoke`` appends nowhere). The default run (DDP, FSDP2, vLLM skipped without vLLM, real) takes a
few minutes on one H200, most of it imports and start-up.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import tempfile
import time

import torch

from benchmarks import _gpu_rows, harness  # noqa: E402
from treadle import Trainer, TrainerCallback, TrainingArguments, distributed as dist  # noqa: E402

# ~0.5B parameters (tied embeddings): 18 layers x 25.2M + 32000 x 1536 embeddings = 502M
GPU_MODEL = dict(
    vocab_size=32000,
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=18,
    num_attention_heads=12,
    num_key_value_heads=4,
)
SMOKE_MODEL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
VLLM_SMOKE_MODEL = dict(SMOKE_MODEL, hidden_size=64, num_attention_heads=2, num_key_value_heads=2)  # head size 32
H200_BF16_DENSE_TFLOPS = 989.0  # vendor peak, for a rough model-FLOPs utilisation
FIRST_LOSS_TOLERANCE = 2e-2  # bf16 autocast: DDP and FSDP2 run the same kernels on the same fp32 weights
MODES = ("ddp", "fsdp", "vllm", "real")  # ddp and fsdp in the order asked, then vllm, then real


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU, a few seconds")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default 10; smoke 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; smoke 1)")
    parser.add_argument("--batch", type=int, default=None, help="rows per device (default 8; smoke 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 1024; smoke 32)")
    parser.add_argument("--out", default=None, help="also write the results to this JSON file")
    parser.add_argument("--log", default=None, help="append the run to this log (default: the results log, on a GPU)")
    parser.add_argument("--no-log", action="store_true", help="append the run to no log")
    _gpu_rows.add_arguments(parser)
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    args.steps = args.steps or (3 if smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    args.batch = args.batch or (2 if smoke else 8)
    args.seq_len = args.seq_len or (32 if smoke else 1024)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1 (the clock starts at the end of the last warm-up step)")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; use {', '.join(MODES)}")
    _gpu_rows.check_arguments(args, parser)
    return args


def pick_device(cpu_smoke: bool) -> torch.device:
    if cpu_smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible; run with --cpu-smoke to check the script on a CPU")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def build_model(cpu_smoke: bool, device: torch.device, sizes: dict | None = None):
    """A Llama with random weights built directly on ``device`` (fp32 master weights; bf16 comes from autocast)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = sizes or (SMOKE_MODEL if cpu_smoke else GPU_MODEL)
    config = LlamaConfig(
        **sizes, max_position_embeddings=4096, tie_word_embeddings=True, attn_implementation="sdpa", use_cache=False
    )
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config)


def random_rows(n: int, seq_len: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (n, seq_len), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


class StepClock(TrainerCallback):
    """Times optimizer steps after the warm-up, synchronising the GPU so each time is the step's real end."""

    def __init__(self, warmup: int, device: torch.device):
        self.warmup, self.device, self.ends = warmup, device, []

    def on_step_end(self, args, state, control, **kwargs):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if state.global_step >= self.warmup:  # the end of the last warm-up step starts the clock
            self.ends.append(time.perf_counter())
        if state.global_step == self.warmup and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


def peak_memory_gib(device: torch.device) -> tuple[str, float]:
    if device.type == "cuda":
        return "peak_gpu_memory_gib", torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is in KiB on Linux: the process's high-water mark, from startup (not per mode)
    return "peak_process_rss_gib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def training_arguments(mode: str, opts, output_dir: str, steps: int) -> TrainingArguments:
    """Both modes' settings: bf16 autocast, a constant learning rate, every step logged, nothing saved."""
    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=opts.batch,
        max_steps=steps,
        learning_rate=1e-4,
        warmup_steps=0,
        lr_scheduler_type="constant",
        bf16=True,
        fsdp="full_shard" if mode == "fsdp" else "",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_pin_memory=True,
    )


def run_mode(mode: str, opts, device: torch.device) -> dict:
    """Train ``warmup + steps`` optimizer steps in one mode and measure the timed ones."""
    model = build_model(opts.cpu_smoke, device)
    params = sum(p.numel() for p in model.parameters())
    world = dist.get_world_size()
    steps = opts.warmup + opts.steps
    rows = random_rows(opts.batch * steps * world, opts.seq_len, model.config.vocab_size)
    clock = StepClock(opts.warmup, device)
    with tempfile.TemporaryDirectory() as output_dir:
        args = training_arguments(mode, opts, output_dir, steps)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trainer = Trainer(model, args, train_dataset=rows, callbacks=[clock])
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    seconds = clock.ends[-1] - clock.ends[0]
    tokens_per_s = opts.steps * opts.batch * opts.seq_len * world / seconds
    memory_key, memory = peak_memory_gib(device)
    result = {
        "mode": mode,
        "wrapper": type(trainer.model_wrapped).__name__,
        "device": str(device),
        "world_size": world,
        "params_m": round(params / 1e6, 3),
        "tokens_per_step": opts.batch * opts.seq_len * world,
        "timed_steps": opts.steps,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens_per_s, 1),
        "model_tflops_per_device": round(6 * params * tokens_per_s / world / 1e12, 2),
        memory_key: round(memory, 2),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    if device.type == "cuda":
        result["mfu_vs_h200_peak"] = round(result["model_tflops_per_device"] / H200_BF16_DENSE_TFLOPS, 3)
    del trainer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def problems(results: list[dict]) -> list[str]:
    found = [
        f"{r['mode']}: a loss is not finite ({r['first_loss']}, {r['last_loss']})"
        for r in results
        if not (math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"]))
    ]
    by_mode = {r["mode"]: r for r in results}
    if "ddp" in by_mode and "fsdp" in by_mode:
        gap = abs(by_mode["ddp"]["first_loss"] - by_mode["fsdp"]["first_loss"])
        if not gap <= FIRST_LOSS_TOLERANCE:
            found.append(f"first losses differ by {gap:.3g} between DDP and FSDP2 (> {FIRST_LOSS_TOLERANCE})")
    return found


def main(argv=None) -> int:
    opts = parse_args(argv)
    device = pick_device(opts.cpu_smoke)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny matrices: more threads only contend
    dist.init_distributed(device, force=True)
    out = Results(opts.out, dist.is_main_process())
    for mode in [m for m in opts.modes if m in ("ddp", "fsdp")]:
        try:
            out.add(run_mode(mode, opts, device))
        except Exception as e:  # report and go on: the other mode's numbers are still worth having
            out.fail(f"{mode}: {type(e).__name__}: {e}")
    out.fail(*problems(out.rows))
    if dist.is_main_process():
        report(out.rows, out.failures, opts)  # the machine; the training modes' table when they ran
    dist.barrier()
    world = dist.get_world_size()
    if dist.is_initialized():
        torch.distributed.destroy_process_group()
    if "vllm" in opts.modes:  # after the group is gone: the in-process engine makes its own
        out.fail(*vllm_rows(opts, device, world, out))
    if "real" in opts.modes and world > 1:
        print("real: skipped: its rows run in one process (without torchrun)")
    elif "real" in opts.modes:
        real_failures = _gpu_rows.real_rows(opts, device, out.add)
        _gpu_rows.report([r for r in out.rows if r["mode"] == "real"])
        print("\n".join(f"FAIL {f}" for f in real_failures) or "OK (real)")
        out.fail(*real_failures)
    out.log(opts)
    return 1 if out.failures else 0


class Results:
    """Every mode's rows and failures. The main process prints each row as one JSON line and rewrites ``--out``
    after each row and failure, so that a run cut short (a device's time limit) keeps what it measured."""

    def __init__(self, path: str | None, main_process: bool):
        self.path, self.main_process, self.rows, self.failures = path, main_process, [], []

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if self.main_process:
            print(json.dumps(row), flush=True)
        self.write()

    def fail(self, *failures: str) -> None:
        self.failures += failures
        self.write()

    def write(self) -> None:
        if self.path and self.main_process:
            with open(self.path, "w") as f:
                json.dump({"results": self.rows, "failures": self.failures}, f, indent=2)

    def log(self, opts) -> None:
        """Append the run to the results log (a GPU run; ``--cpu-smoke`` only where ``--log`` names a file)."""
        path = harness.log_path(opts, check=opts.cpu_smoke)
        if path and self.main_process:
            record = harness.record_head("gpu_check", quick=opts.cpu_smoke)
            harness.append_log(path, {**record, "results": self.rows, "failures": self.failures})


def vllm_rows(opts, device: torch.device, world: int, out: Results) -> list[str]:
    """The vLLM engine's rows (added to ``out``); returns failures. Skipped, with the reason, without vLLM or under
    torchrun."""
    if world > 1:
        print("vllm: skipped: the colocated engine rows run in one process (without torchrun)")
        return []
    try:
        from treadle.engines.vllm import VLLMEngine, require_vllm  # optional: .venv-vllm or a GPU install

        require_vllm()
    except ImportError as error:
        print(f"vllm: skipped: {error}")
        return []
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    failures, rows = [], []
    for sync in ("full", "lora"):
        try:
            rows.append(vllm_row(sync, opts, device, VLLMEngine))
            out.add(rows[-1])
            if rows[-1]["unchanged_syncs"]:
                failures.append(
                    f"vllm {sync}: {rows[-1]['unchanged_syncs']} syncs left the engine's log-probs as they were"
                )
        except Exception as e:  # report and go on, as the training modes
            failures.append(f"vllm {sync}: {type(e).__name__}: {e}")
    print(
        f"\n{'vllm sync':10} {'params(M)':>9} {'start s':>8} {'sync s':>8} {'tensors':>8} {'MB sent':>9} "
        f"{'rollouts/s':>11}"
    )
    for r in rows:
        print(
            f"{r['sync']:10} {r['params_m']:9.3f} {r['start_s']:8.1f} {r['sync_s']:8.3f} {r['tensors']:8d} "
            f"{r['mb_sent']:9.2f} {r['rollouts_per_s']:11.1f}"
        )
    print("\n".join(f"FAIL {f}" for f in failures) or "OK (vllm)")
    return failures


def vllm_row(sync: str, opts, device: torch.device, engine_class) -> dict:
    """One engine's start, 3 syncs of changed weights, one timed generation."""
    from treadle.generation.sampling import SamplingParams

    model = build_model(opts.cpu_smoke, device, VLLM_SMOKE_MODEL if opts.cpu_smoke else None)
    model = model if opts.cpu_smoke else model.to(torch.bfloat16)
    trained = "weight"
    if sync == "lora":
        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model, trained = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=targets)), "lora_B"
    prompts_, group, tokens = (4, 2, 8) if opts.cpu_smoke else (64, 8, 128)
    prompts = torch.randint(3, model.config.vocab_size, (prompts_, 16), generator=torch.Generator().manual_seed(2))
    params = SamplingParams(num_generations=group, max_new_tokens=tokens, eos_token_ids=(), pad_token_id=0)
    start = time.perf_counter()
    engine = engine_class(model, max_model_length=256, gpu_memory_utilization=0.3)
    started, syncs, unchanged = time.perf_counter() - start, [], 0
    try:
        for round_ in range(4):  # a generation (the sync check's probe), changed weights, one timed sync
            engine.generate(prompts.tolist()[:1], params, generator=torch.Generator().manual_seed(round_))
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if trained in name:
                        p.add_(1e-2 * torch.randn_like(p))
            start = time.perf_counter()
            engine.load_weights(model)
            syncs.append(time.perf_counter() - start)  # the push and the check's two one-sequence scorings
            unchanged += bool(engine.sync_unchanged)
        start = time.perf_counter()
        out = engine.generate(prompts.tolist(), params, generator=torch.Generator().manual_seed(9))
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    assert int(out.completion_mask.sum()) == prompts_ * group * tokens
    return {
        "mode": "vllm",
        "sync": engine.last_sync["kind"],
        "device": str(device),
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 3),
        "start_s": round(started, 1),
        "sync_s": round(sorted(syncs[1:])[1], 3),
        "tensors": engine.last_sync["tensors"],
        "mb_sent": round(engine.last_sync["bytes"] / 1e6, 3),
        "unchanged_syncs": unchanged,
        "rollouts_per_s": round(prompts_ * group / seconds, 1),
        "completion_tokens": tokens,
    }


def report(results: list[dict], failures: list[str], opts) -> None:
    memory_key = "peak_gpu_memory_gib" if not opts.cpu_smoke else "peak_process_rss_gib"
    gpu = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() and not opts.cpu_smoke else ""
    print(f"\n{harness.machine_line(harness.machine())}{gpu}")
    if not {"ddp", "fsdp"} & set(opts.modes):
        return
    print(
        f"\n{'mode':6} {'wrapper':28} {'params(M)':>9} {'tokens/s':>11} {'TFLOP/s/dev':>11} {memory_key:>21} "
        f"{'loss first -> last':>20}"
    )
    for r in [r for r in results if r["mode"] in ("ddp", "fsdp")]:
        print(
            f"{r['mode']:6} {r['wrapper']:28} {r['params_m']:9.3f} {r['tokens_per_s']:11.1f} "
            f"{r['model_tflops_per_device']:11.2f} {r[memory_key]:21.2f} "
            f"{r['first_loss']:9.4f} -> {r['last_loss']:.4f}"
        )
    print("\n".join(f"FAIL {f}" for f in failures) or "OK")


if __name__ == "__main__":
    raise SystemExit(main())
