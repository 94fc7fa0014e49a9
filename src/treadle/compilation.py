"""``torch_compile`` (transformers' ``TrainingArguments`` fields, same meaning): the training forward compiled with
``torch.compile`` (``torch_compile_backend``, default inductor; ``torch_compile_mode``).

transformers compiles the whole model; treadle compiles each transformer block in place (``nn.Module.compile``):
the parameters, state-dict keys, LoRA / DDP / FSDP wrappers and the hook the hidden-state losses set on the decoder
stay outside the graphs, the blocks of a model share one graph, and a new sequence length recompiles one block's
graph, not the model's. The first step pays the compilation; ``CompileReport`` prints what it cost.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from treadle import distributed as dist
from treadle.callbacks import TrainerCallback
from treadle.errors import PreflightError

EAGER_WAYS = "torch_compile_backend: aot_eager (or eager: no compilation at all)"
# The vector width (bits) of the CPU kernel set ATEN_CPU_CAPABILITY names, as inductor's cpp.simdlen (0: scalar code)
SIMD_BITS = {"default": 0, "avx2": 256, "avx512": 512}


def inductor_keywords(backend: str, mode: str | None) -> dict:
    """``torch.compile``'s keywords beside ``backend``: ``mode``, or, for inductor under ``ATEN_CPU_CAPABILITY``, the
    mode's options plus ``cpp.simdlen`` of that kernel set.

    Inductor picks its CPU vector width from ``ATEN_CPU_CAPABILITY``, but its compile cache does not key on it
    (torch 2.13): code generated for one kernel set is reused under another in the same cache, so 16-lane AVX-512
    kernels built against AVX2's 8-lane headers compute wrong numbers (a NaN loss on SmolLM2, an error of 36 on a
    sum), and under ``default`` they fail to build. ``cpp.simdlen`` is part of the key, so naming the width keeps
    each kernel set's code apart (tests/test_compile.py)."""
    bits = SIMD_BITS.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower()) if backend == "inductor" else None
    if bits is None:
        return {"mode": mode}
    return {"options": {**torch._inductor.list_mode_options(mode or "default"), "cpp.simdlen": bits}}


def check_settings(args) -> None:
    """Refuse (PreflightError, one line) what would fail at the first compiled step, before the run folder is
    claimed: an unknown ``torch_compile_backend`` or ``torch_compile_mode``, and inductor on the CPU without a
    working C++ compiler (a cheap probe: the compiler's ``--version``, as inductor itself finds it)."""
    if not args.torch_compile:
        return
    backend, mode = args.torch_compile_backend, args.torch_compile_mode
    backends = torch._dynamo.list_backends(exclude_tags=())
    if backend not in backends:
        raise PreflightError(
            f"torch_compile_backend: {backend!r} is not a torch.compile backend; use one of "
            f"{', '.join(torch._dynamo.list_backends())} or aot_eager / eager (inductor is the default)"
        )
    modes = ["default", *(m for m in torch._inductor.list_mode_options() if m != "default")]
    if mode is not None and mode not in modes:
        raise PreflightError(
            f"torch_compile_mode: {mode!r} is not a torch.compile mode; use one of {', '.join(modes)}"
        )
    if backend == "inductor" and args.device.type == "cpu":
        check_cpp_compiler()


def check_cpp_compiler() -> None:
    """Refuse (PreflightError) inductor on the CPU when no C++ compiler runs (``CXX`` naming a missing one, none
    installed): inductor would fail at the first step with a long traceback."""
    try:
        from torch._inductor import cpp_builder, exc  # inductor's own search (config.cpp.cxx, CXX)
    except ImportError:  # pragma: no cover -- a torch without inductor: torch.compile says so itself
        return
    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        tried = (
            [c for c in torch._inductor.config.cpp.cxx if c]
            if isinstance(torch._inductor.config.cpp.cxx, (list, tuple))
            else [torch._inductor.config.cpp.cxx]
        )
        raise PreflightError(
            f"torch_compile with the inductor backend needs a C++ compiler on the CPU, and none runs here (tried "
            f"{', '.join(map(str, tried))}; CXX names it); install one (e.g. apt install g++) or set CXX to it, or "
            f"train with {EAGER_WAYS}"
        ) from None


def compile_blocks(model: nn.Module, backend: str = "inductor", mode: str | None = None) -> int:
    """Compile each transformer block of ``model`` in place (once: a block compiled already is left); returns how
    many blocks there are. ValueError for a model without repeated blocks (``distributed.transformer_blocks``)."""
    blocks = dist.transformer_blocks(dist.unwrap_model(model))
    if not blocks:
        raise ValueError(
            f"torch_compile=True found no transformer blocks in {type(dist.unwrap_model(model)).__name__} (no "
            "_no_split_modules, no nn.ModuleList); call torch.compile on its parts yourself, or drop torch_compile"
        )
    for block in blocks:
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(backend=backend, **inductor_keywords(backend, mode))
    return len(blocks)


def compile_for_training(trainer) -> None:
    """What ``train()`` does for ``args.torch_compile``: compile the model's blocks and report the first steps."""
    args = trainer.args
    if not args.torch_compile:
        return
    blocks = compile_blocks(trainer.model, args.torch_compile_backend, args.torch_compile_mode)
    trainer.pop_callback(CompileReport)
    trainer.add_callback(CompileReport(blocks, args.torch_compile_backend, args.torch_compile_mode))


class CompileReport(TrainerCallback):
    """One line after the first two steps of a compiled run: how long the first step took (compilation included)
    against the second, so the compile cost is in the run's output (main process, stdout)."""

    def __init__(self, blocks: int, backend: str, mode: str | None):
        self.what = f"{blocks} blocks with {backend}" + (f" (mode {mode})" if mode else "")
        self.times: list[float] = []
        self.started = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if len(self.times) >= 2:
            return
        self.times.append(time.perf_counter() - self.started)
        if len(self.times) == 2 and state.is_world_process_zero:
            first, second = self.times
            print(
                f"treadle: torch_compile compiled {self.what}: the first step took {first:.1f} s, compilation "
                f"included; the second {second:.1f} s",
                flush=True,
            )
