"""Start-up cost: import time of treadle against torch and the peers, and time to the first optimizer step.

    python -m benchmarks.startup [--rounds 5]
    python -m benchmarks.startup --quick          # 2 rounds

Each measurement is a fresh interpreter (``python -c CODE``, this process's environment: the same treadle), the
contenders interleaved and repeated; the tables give the median, the range over rounds and the ratio of medians to
``import torch`` (imports) or to the transformers.Trainer script (the first step). The first-step scripts build the
same tiny Llama and train it on the same 16 rows until the first optimizer step ends; each prints the seconds since
its interpreter started. Every contender runs as it ships (no allocator setting: nothing here allocates much).
"""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks import harness

IMPORTS = {
    "import torch": "import torch",
    "import treadle": "import treadle",
    "from treadle import Trainer": "from treadle import Trainer",
    "from treadle import GRPOTrainer": "from treadle import GRPOTrainer",
    "from transformers import Trainer": "from transformers import Trainer",
    "from trl import GRPOTrainer": "from trl import GRPOTrainer",
}
STOP_AT_FIRST_STEP = """
class Stop(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        print(time.perf_counter() - t0); sys.stdout.flush(); control.should_training_stop = True
model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4))
rows = [{"input_ids": [1, 2, 3, 4] * 8, "labels": [1, 2, 3, 4] * 8}] * 16
"""
FIRST_STEP = {
    "treadle Trainer": """import time, sys, tempfile; t0 = time.perf_counter()
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from treadle import Trainer, TrainingArguments, TrainerCallback
"""
    + STOP_AT_FIRST_STEP
    + """Trainer(model, TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=5, disable_tqdm=True,
        save_strategy="no", logging_steps=100), train_dataset=rows, callbacks=[Stop()]).train()
""",
    "transformers Trainer": """import time, sys, tempfile; t0 = time.perf_counter()
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, TrainerCallback
"""
    + STOP_AT_FIRST_STEP
    + """Trainer(model=model, args=TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=5, disable_tqdm=True,
        save_strategy="no", logging_steps=100, report_to="none", use_cpu=True), train_dataset=rows,
        callbacks=[Stop()]).train()
""",
}


def seconds(code: str) -> float:
    """Wall seconds of one fresh interpreter running ``code`` (or the seconds it printed last); NaN if it failed."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=harness.ROOT)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        return float("nan")
    try:
        return float(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return elapsed


def measure(run: harness.Run, title: str, table: dict[str, str], rounds: int, base: str) -> None:
    """Every contender of ``table`` in ``rounds`` interleaved rounds; prints the table and keeps its rows."""
    samples: dict[str, list[float]] = {name: [] for name in table}
    for round_, name in harness.interleaved(list(table), rounds):
        samples[name].append(seconds(table[name]))
        print(f"round {round_ + 1}/{rounds} {name}: {samples[name][-1]:.2f} s", file=sys.stderr, flush=True)
    ref = harness.spread(samples[base])["median"]
    rows = []
    for name, values in samples.items():
        s = harness.spread(values)
        run.row(table=title, contender=name, seconds=s)
        if s["median"] is None:
            rows.append([f"`{name}`", "failed (not installed?)", "", ""])
            continue
        ratio = f"{s['median'] / ref:.2f}x" if ref else ""
        rows.append([f"`{name}`", f"{s['median']:.2f}", f"{s['min']:.2f} - {s['max']:.2f}", ratio])
    print(f"\n### {title}\n\n" + harness.table(["what", "median s", "range s", f"vs {base}"], rows))


def main(argv=None) -> None:
    p = harness.parser(__doc__, "2 rounds", allocator=False)
    p.add_argument("--rounds", type=int, default=5)
    opts = p.parse_args(argv)
    rounds = 2 if opts.quick else opts.rounds
    run = harness.Run("startup", opts)
    for name in [*IMPORTS, *FIRST_STEP]:
        run.contender(name, process="a fresh interpreter, this environment", allocator="as shipped")
    measure(run, "Import time (fresh interpreter)", IMPORTS, rounds, "import torch")
    title = "Interpreter start to the end of the first optimizer step (tiny model)"
    measure(run, title, FIRST_STEP, rounds, "transformers Trainer")
    run.finish()


if __name__ == "__main__":
    main()
