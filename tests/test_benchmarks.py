"""benchmarks/ stays a package that imports: every module of the suite and of the lab imports (no torch work, no
benchmark run: `python -m benchmarks --quick` is the check that they run), the runner lists every one, and none of
them reaches its siblings through sys.path."""

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in (ROOT / "benchmarks").rglob("*.py")
    if path.name != "__init__.py"
)


def test_the_package_has_its_modules():
    assert {"benchmarks.harness", "benchmarks.__main__", "benchmarks.trainers", "benchmarks.gpu_check"} <= set(MODULES)
    assert "benchmarks.lab.shared_prefix" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_every_module_imports_without_sys_path(name):
    module = importlib.import_module(name)
    assert "sys.path" not in Path(module.__file__).read_text(), f"{name} reaches modules through sys.path"


def test_the_runner_lists_every_benchmark():
    runner = importlib.import_module("benchmarks.__main__")
    scripts = {m.removeprefix("benchmarks.") for m in MODULES if "._" not in m and m != "benchmarks.harness"}
    assert set(runner.SUITE) | set(runner.LAB) == scripts - {"__main__"}
