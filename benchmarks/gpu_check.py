"""GPU check for a lent machine: bf16 training of a ~0.5B-parameter Llama through treadle's Trainer, once
wrapped in DDP and once sharded with FSDP2, reporting tokens/s and peak memory. A few minutes on one H200.

    python benchmarks/gpu_check.py                       # one GPU: DDP, then FSDP2 (a 1-process group)
    torchrun --nproc_per_node 8 benchmarks/gpu_check.py  # N GPUs: the same, data-parallel over N
    python benchmarks/gpu_check.py --cpu-smoke           # CPU, tiny model, seconds: checks the script runs

One process per device. Without torchrun the script makes a one-process group itself
(``distributed.init_distributed(force=True)``) so that the Trainer really wraps the model in DDP / FSDP2 as it
would on N devices. The model is built from a ``LlamaConfig`` with random weights (nothing is downloaded) and
trained on random token ids: the numbers measure speed and memory, not learning. Each mode trains
``--warmup`` untimed steps then ``--steps`` timed ones with the same seed and data, so the two modes' first
losses must agree (both compute in bf16 autocast from fp32 weights); the script says FAIL when they do not,
when a loss is not finite, or when a mode crashes. It prints one JSON line per mode and a summary table;
``--out FILE`` also writes them as a JSON list.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from _machine import machine_header  # noqa: E402  (this folder is on sys.path when a script in it runs)

from treadle import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from treadle import distributed as dist  # noqa: E402

# ~0.5B parameters (tied embeddings): 18 layers x 25.2M + 32000 x 1536 embeddings = 502M
GPU_MODEL = dict(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=18,
                 num_attention_heads=12, num_key_value_heads=4)
SMOKE_MODEL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
H200_BF16_DENSE_TFLOPS = 989.0  # vendor peak, for a rough model-FLOPs utilisation
FIRST_LOSS_TOLERANCE = 2e-2  # bf16 autocast: DDP and FSDP2 run the same kernels on the same fp32 weights


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU, a few seconds")
    parser.add_argument("--modes", default="ddp,fsdp", help="comma-separated: ddp, fsdp")
    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps (default 10; smoke 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; smoke 1)")
    parser.add_argument("--batch", type=int, default=None, help="rows per device (default 8; smoke 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 1024; smoke 32)")
    parser.add_argument("--out", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    args.steps = args.steps or (3 if smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    args.batch = args.batch or (2 if smoke else 8)
    args.seq_len = args.seq_len or (32 if smoke else 1024)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be >= 1 (the clock starts at the end of the last warm-up step)")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - {"ddp", "fsdp"}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; use ddp and/or fsdp")
    return args


def pick_device(cpu_smoke: bool) -> torch.device:
    if cpu_smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible; run with --cpu-smoke to check the script on a CPU")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def build_model(cpu_smoke: bool, device: torch.device):
    """A Llama with random weights built directly on ``device`` (fp32 master weights; bf16 comes from autocast)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = SMOKE_MODEL if cpu_smoke else GPU_MODEL
    config = LlamaConfig(**sizes, max_position_embeddings=4096, tie_word_embeddings=True,
                         attn_implementation="sdpa", use_cache=False)
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


def run_mode(mode: str, opts, device: torch.device) -> dict:
    """Train ``warmup + steps`` optimizer steps in one mode and measure the timed ones."""
    model = build_model(opts.cpu_smoke, device)
    params = sum(p.numel() for p in model.parameters())
    world = dist.get_world_size()
    steps = opts.warmup + opts.steps
    rows = random_rows(opts.batch * steps * world, opts.seq_len, model.config.vocab_size)
    clock = StepClock(opts.warmup, device)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=opts.batch, max_steps=steps,
                                 learning_rate=1e-4, warmup_steps=0, lr_scheduler_type="constant", bf16=True,
                                 fsdp="full_shard" if mode == "fsdp" else "", logging_steps=1,
                                 save_strategy="no", disable_tqdm=True, seed=0, dataloader_pin_memory=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trainer = Trainer(model, args, train_dataset=rows, callbacks=[clock])
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    seconds = clock.ends[-1] - clock.ends[0]
    tokens_per_s = opts.steps * opts.batch * opts.seq_len * world / seconds
    memory_key, memory = peak_memory_gib(device)
    result = {"mode": mode, "wrapper": type(trainer.model_wrapped).__name__, "device": str(device),
              "world_size": world, "params_m": round(params / 1e6, 3),
              "tokens_per_step": opts.batch * opts.seq_len * world, "timed_steps": opts.steps,
              "seconds": round(seconds, 3), "tokens_per_s": round(tokens_per_s, 1),
              "model_tflops_per_device": round(6 * params * tokens_per_s / world / 1e12, 2),
              memory_key: round(memory, 2), "first_loss": losses[0], "last_loss": losses[-1]}
    if device.type == "cuda":
        result["mfu_vs_h200_peak"] = round(result["model_tflops_per_device"] / H200_BF16_DENSE_TFLOPS, 3)
    del trainer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def problems(results: list[dict]) -> list[str]:
    found = [f"{r['mode']}: a loss is not finite ({r['first_loss']}, {r['last_loss']})" for r in results
             if not (math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"]))]
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
    results, failures = [], []
    for mode in opts.modes:
        try:
            results.append(run_mode(mode, opts, device))
        except Exception as e:  # report and go on: the other mode's numbers are still worth having
            failures.append(f"{mode}: {type(e).__name__}: {e}")
        if dist.is_main_process() and results and results[-1]["mode"] == mode:
            print(json.dumps(results[-1]), flush=True)
    failures += problems(results)
    if dist.is_main_process():
        report(results, failures, opts)
    dist.barrier()
    if dist.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if failures else 0


def report(results: list[dict], failures: list[str], opts) -> None:
    memory_key = "peak_gpu_memory_gib" if not opts.cpu_smoke else "peak_process_rss_gib"
    gpu = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() and not opts.cpu_smoke else ""
    print(f"\n{machine_header()}{gpu}")
    print(f"\n{'mode':6} {'wrapper':28} {'params(M)':>9} {'tokens/s':>11} {'TFLOP/s/dev':>11} {memory_key:>21} "
          f"{'loss first -> last':>20}")
    for r in results:
        print(f"{r['mode']:6} {r['wrapper']:28} {r['params_m']:9.3f} {r['tokens_per_s']:11.1f} "
              f"{r['model_tflops_per_device']:11.2f} {r[memory_key]:21.2f} "
              f"{r['first_loss']:9.4f} -> {r['last_loss']:.4f}")
    print("\n".join(f"FAIL {f}" for f in failures) or "OK")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"results": results, "failures": failures}, f, indent=2)


if __name__ == "__main__":
    raise SystemExit(main())
