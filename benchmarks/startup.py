"""Start-up cost: import time of treadle against torch and the peers, and time to the first optimizer step.

Each measurement is a fresh interpreter (`python -c ...`), the contenders interleaved and repeated; we report
median and best wall-clock seconds and the ratio to `import torch`.

    python benchmarks/startup.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")

IMPORTS = {
    "import torch": "import torch",
    "import treadle": "import treadle",
    "from treadle import Trainer": "from treadle import Trainer",
    "from treadle import GRPOTrainer": "from treadle import GRPOTrainer",
    "from transformers import Trainer": "from transformers import Trainer",
    "from trl import GRPOTrainer": "from trl import GRPOTrainer",
}

# Time from interpreter start to the end of the first optimizer step on the same tiny model and data.
FIRST_STEP = {
    "treadle Trainer": """
import time, sys, tempfile; t0 = time.perf_counter()
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from treadle import Trainer, TrainingArguments, TrainerCallback
class Stop(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        print(time.perf_counter() - t0); sys.stdout.flush(); control.should_training_stop = True
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4))
rows = [{"input_ids": [1, 2, 3, 4] * 8, "labels": [1, 2, 3, 4] * 8}] * 16
Trainer(model, TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=5, disable_tqdm=True,
        save_strategy="no", logging_steps=100), train_dataset=rows, callbacks=[Stop()]).train()
""",
    "transformers Trainer": """
import time, sys, tempfile; t0 = time.perf_counter()
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, TrainerCallback
class Stop(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        print(time.perf_counter() - t0); sys.stdout.flush(); control.should_training_stop = True
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4))
rows = [{"input_ids": [1, 2, 3, 4] * 8, "labels": [1, 2, 3, 4] * 8}] * 16
Trainer(model=model, args=TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=5, disable_tqdm=True,
        save_strategy="no", logging_steps=100, report_to="none", use_cpu=True), train_dataset=rows,
        callbacks=[Stop()]).train()
""",
}


def run(code: str) -> float | None:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        return None
    out = proc.stdout.strip().splitlines()
    return float(out[-1]) if out and _is_float(out[-1]) else elapsed


def _is_float(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def measure(table: dict[str, str], rounds: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {k: [] for k in table}
    for r in range(rounds):
        for name, code in table.items():
            t = run(code)
            if t is not None:
                results[name].append(t)
        print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    return results


def print_table(title: str, results: dict[str, list[float]], base: str) -> None:
    print(f"\n### {title}\n")
    print("| what | median s | best s | vs " + base + " |")
    print("|---|---:|---:|---:|")
    ref = statistics.median(results[base]) if results.get(base) else None
    for name, samples in results.items():
        if not samples:
            print(f"| {name} | not installed | | |")
            continue
        med = statistics.median(samples)
        ratio = f"{med / ref:.2f}x" if ref else ""
        print(f"| `{name}` | {med:.2f} | {min(samples):.2f} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    opts = parser.parse_args()
    rounds = 2 if opts.quick else opts.rounds
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _machine import machine_header

    print(machine_header())
    print_table("Import time (fresh interpreter)", measure(IMPORTS, rounds), "import torch")
    print_table(
        "Interpreter start to the end of the first optimizer step (tiny model)",
        measure(FIRST_STEP, rounds),
        "transformers Trainer",
    )


if __name__ == "__main__":
    main()
