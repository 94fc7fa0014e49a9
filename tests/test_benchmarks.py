"""benchmarks/ stays a package that imports: every module of the suite and of the lab imports (no torch work, no
benchmark run: `python -m benchmarks --quick` is the check that they run), the runner lists every one, and none of
them reaches its siblings through sys.path. The imports run in one interpreter started in the repository's root, as
`python -m benchmarks` is, whatever the folder pytest was started from."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "benchmarks").rglob("*.py")
    if path.name != "__init__.py"
)
IMPORT_ALL = """import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
runner = importlib.import_module("benchmarks.__main__")
print(json.dumps(runner.SUITE + runner.LAB))
"""


def test_every_module_imports_and_the_runner_lists_every_benchmark():
    assert {"benchmarks.harness", "benchmarks.__main__", "benchmarks.trainers", "benchmarks.lab.profile"} <= set(
        MODULES
    )
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, *MODULES], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    listed = json.loads(proc.stdout.strip().splitlines()[-1])
    scripts = {m.removeprefix("benchmarks.") for m in MODULES if "._" not in m} - {"harness", "__main__"}
    assert sorted(listed) == sorted(scripts)


def test_no_module_reaches_its_siblings_through_sys_path():
    for name in MODULES:
        text = (ROOT / Path(*name.split("."))).with_suffix(".py").read_text()
        assert "sys.path" not in text, f"{name} reaches modules through sys.path"


@pytest.mark.slow
def test_demos_matrix_options_of_the_wrong_type_are_argparses_own_error_line():
    """The fourth hostile trial (issue 59): `--seeds a` was a ValueError traceback."""
    for flag in ("--seeds", "--threads"):
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.demos", flag, "a", "--no-log"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert f"error: argument {flag}: 'a' is not a comma-separated list of whole numbers" in proc.stderr


def test_matmul_replay_runs_each_linear_of_the_model_once_a_pass_on_its_own_weights(monkeypatch):
    """The decode step's second reference (docs/performance.md, generation): every ``nn.Linear`` in module order, on
    the model's own weights, with the rows asked for."""
    import torch

    from benchmarks import harness

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))
    calls, linear = [], torch.nn.functional.linear

    def recorded(x, weight, bias=None):
        calls.append((tuple(x.shape), weight.data_ptr(), bias is None))
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", recorded)
    rate = harness.matmul_replay(model, rows=3, repeats=2)
    one_pass = [((3, 8), model[0].weight.data_ptr(), False), ((3, 16), model[2].weight.data_ptr(), True)]
    assert calls == one_pass * 3  # a first pass that pays the allocations, then the timed repeats
    assert 0 < rate < float("inf")
