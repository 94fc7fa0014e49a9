"""torch_compile, torch_compile_backend, torch_compile_mode: transformers' fields with its meaning; the blocks of the
model compiled in place (treadle.compilation): a compiled run trains as the eager one, LoRA and resume included,
saves the same keys, and GRPO's sampler runs the compiled blocks eagerly. The backend in these tests is aot_eager
(dynamo's trace and autograd's graph without inductor's C++ build); tests/real/ runs inductor on the real model, and
the slow kernel-set test here runs it on the toy model, in subprocesses with a cache of their own."""

import os
import subprocess
import sys

import pytest
import torch
import transformers
from _factories import SFT_ROWS, golden_grpo_run, sft_trainer
from torch import nn

import treadle
from treadle import compilation
from treadle.demos import toy
from treadle.errors import PreflightError

pytestmark = pytest.mark.usefixtures("one_thread")

BACKEND = "aot_eager"


@pytest.fixture(scope="module")
def tok():
    return toy.build_tokenizer()


def frames_compiled() -> int:
    return int(torch._dynamo.utils.counters["frames"]["ok"])


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"torch_compile": True},
        {"torch_compile_backend": "aot_eager"},
        {"torch_compile_mode": "max-autotune-no-cudagraphs"},
        {"torch_compile": True, "torch_compile_mode": "reduce-overhead"},
    ],
)
def test_the_fields_mean_what_transformers_makes_them_mean(tmp_path, fields):
    theirs = transformers.TrainingArguments(output_dir=str(tmp_path), **fields)
    ours = treadle.TrainingArguments(output_dir=str(tmp_path), **fields)
    for name in ("torch_compile", "torch_compile_backend", "torch_compile_mode"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_a_model_without_blocks_is_refused_in_one_line():
    with pytest.raises(ValueError, match="torch_compile=True found no transformer blocks in Sequential .*yourself"):
        compilation.compile_blocks(nn.Sequential(nn.Linear(2, 2)), BACKEND)


def sft_run(folder, tok, compiled: bool, **kw):
    fields = {"max_steps": 3, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "save_strategy": "no", **kw}
    if compiled:
        fields["torch_compile_backend"] = BACKEND
    return sft_trainer(folder, tok, SFT_ROWS, **fields)


def test_a_compiled_sft_run_trains_and_saves_as_the_eager_one(tmp_path, tok, capsys):
    eager = sft_run(tmp_path / "eager", tok, compiled=False)
    eager.train()
    before = frames_compiled()
    compiled = sft_run(tmp_path / "compiled", tok, compiled=True)
    compiled.train()
    assert frames_compiled() > before  # dynamo compiled something: the run was not eager in disguise
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (eager, compiled)]
    assert len(losses[1]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert "torch_compile compiled 2 blocks with aot_eager: the first step took" in capsys.readouterr().out
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())  # no _orig_mod. prefixes
    compiled.save_model(str(tmp_path / "saved"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    ids = torch.tensor([[1, 9, 10, 79, 11]])
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, eager.model(ids).logits, atol=1e-4)


def test_a_compiled_lora_run_resumes_exactly(tmp_path, tok):
    import peft  # a test extra, always installed by make test

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    whole = sft_run(tmp_path / "whole", tok, compiled=True, peft_config=lora, max_steps=4)
    whole.train()
    first = sft_run(tmp_path / "cut", tok, compiled=True, peft_config=lora, max_steps=4, save_strategy="steps")
    first.args.save_steps = 2
    first.add_callback(StopAt(2))
    first.train()
    second = sft_run(tmp_path / "cut", tok, compiled=True, peft_config=lora, max_steps=4, save_strategy="steps")
    second.args.save_steps = 2
    second.train(resume_from_checkpoint=True)
    expected = [h["loss"] for h in whole.state.log_history if "loss" in h]
    resumed = [h["loss"] for h in second.state.log_history if "loss" in h]
    assert len(expected) == 4 and resumed == pytest.approx(expected, rel=1e-5)


class StopAt(treadle.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step


def test_grpo_compiled_trains_as_eager_and_samples_eagerly(tmp_path, tok):
    """The sampler's decode steps change shape at every token: compiled, they would recompile until dynamo's
    recompile limit (a warning, then eager). The engine runs them eagerly; the training forwards are compiled."""
    eager = golden_grpo_run(tmp_path / "eager", tok)
    eager.train()
    compiled = golden_grpo_run(tmp_path / "compiled", tok)
    compiled.args.torch_compile, compiled.args.torch_compile_backend = True, BACKEND
    before, limits = frames_compiled(), limit_hits()
    compiled.train()
    assert frames_compiled() > before
    assert limit_hits() == limits  # no function gave up on compiling (the sampler's shapes would)
    for name in ("loss", "reward", "kl", "completions/mean_length"):
        ours = [h[name] for h in compiled.state.log_history if name in h]
        theirs = [h[name] for h in eager.state.log_history if name in h]
        assert len(ours) == len(theirs) > 0 and ours == pytest.approx(theirs, rel=1e-5, abs=1e-7), name


def limit_hits() -> int:
    """How many times dynamo gave up on a function at its recompile limit (it then runs it eagerly)."""
    return sum(int(v) for k, v in torch._dynamo.utils.counters["unimplemented"].items() if "recompile limit" in k)


@pytest.mark.slow
def test_the_command_line_trains_compiled_from_a_yaml_config(tmp_path):
    """`treadle train` takes the fields from YAML as Python does: the blocks compile, the report prints, the run
    saves; the eager run of the same config ends at the same loss."""
    from test_run_errors import treadle as cli, write_config

    losses = {}
    for name, fields in (("eager", {}), ("compiled", {"torch_compile": True, "torch_compile_backend": BACKEND})):
        config = write_config(tmp_path, output_dir=name, save_strategy="no", **fields)
        result = cli("train", config, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("torch_compile compiled" in result.stdout + result.stderr) == (name == "compiled")
        assert (tmp_path / name / "model.safetensors").exists()
        losses[name] = [line for line in result.stdout.splitlines() if "train_loss=" in line][-1]
    assert "torch_compile compiled 2 blocks with aot_eager: the first step took" in result.stdout + result.stderr
    assert losses["eager"].split("train_loss=")[1] == losses["compiled"].split("train_loss=")[1]


# ---- the fourth hostile trial (issue 59): refused before the run folder is claimed ---------------------------------
@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("torch_compile_backend", "nonsense", "'nonsense' is not a torch.compile backend"),
        ("torch_compile_mode", "nonsense", "'nonsense' is not a torch.compile mode; use one of default, "),
    ],
)
def test_an_unknown_backend_or_mode_is_one_line_before_the_folder_is_claimed(tmp_path, tok, field, value, needle):
    trainer = sft_trainer(tmp_path / "run", tok, SFT_ROWS, max_steps=1, save_strategy="no", **{field: value})
    with pytest.raises(PreflightError, match=needle):
        trainer.train()
    assert not (tmp_path / "run").exists()


def test_inductor_without_a_cpp_compiler_names_the_ways_out(tmp_path, tok):
    """CXX naming a compiler that is not there: inductor's own search fails, at setup, not at step 1."""
    trainer = sft_trainer(tmp_path / "run", tok, SFT_ROWS, max_steps=1, save_strategy="no", torch_compile=True)
    with (
        torch._inductor.config.patch({"cpp.cxx": (str(tmp_path / "no-such-c++"),)}),
        pytest.raises(PreflightError) as error,
    ):
        trainer.train()
    message = str(error.value)
    assert "needs a C++ compiler" in message and "no-such-c++" in message
    assert "torch_compile_backend: aot_eager" in message and "apt install g++" in message
    assert not (tmp_path / "run").exists()
    compilation.check_cpp_compiler()  # this machine's compiler runs: no refusal


MAX_AUTOTUNE = {"max_autotune": True, "coordinate_descent_tuning": True}


@pytest.mark.parametrize(
    ("capability", "mode", "expected"),
    [
        (None, None, {"mode": None}),
        ("avx2", None, {"options": {"cpp.simdlen": 256}}),
        ("AVX512", "max-autotune-no-cudagraphs", {"options": {**MAX_AUTOTUNE, "cpp.simdlen": 512}}),
        ("default", None, {"options": {"cpp.simdlen": 0}}),
        ("vsx", "reduce-overhead", {"mode": "reduce-overhead"}),  # no x86 width to name: inductor's own choice
    ],
)
def test_inductor_is_told_the_vector_width_of_the_kernel_set_aten_runs(monkeypatch, capability, mode, expected):
    if capability is None:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    assert compilation.inductor_keywords("inductor", mode) == expected
    assert compilation.inductor_keywords("aot_eager", mode) == {"mode": mode}


COMPILE_UNDER = """import sys, torch
from treadle import compilation
from treadle.demos import toy
torch.manual_seed(0)
model = toy.build_model("tiny", tokenizer=toy.build_tokenizer()).eval()
ids = torch.randint(0, model.config.vocab_size, (2, 24))
with torch.no_grad():
    eager = model(ids).logits
    compilation.compile_blocks(model, "inductor")
    compiled = model(ids).logits
print("max error", float((compiled - eager).abs().max()))
"""


@pytest.mark.slow
def test_inductor_code_of_one_kernel_set_is_not_reused_under_another(tmp_path):
    """torch 2.13's inductor cache does not key on ATEN_CPU_CAPABILITY: blocks compiled natively (AVX2 or AVX-512
    vectors), then again under ``default`` in the same cache, reused the vector code and failed to build (under
    ``avx2`` on an AVX-512 CPU: wrong numbers). compilation.inductor_keywords names the width, which is in the key."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    for capability in (None, "default"):
        run_env = env if capability is None else {**env, "ATEN_CPU_CAPABILITY": capability}
        proc = subprocess.run(
            [sys.executable, "-c", COMPILE_UNDER], env=run_env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        error = float(proc.stdout.split("max error")[-1])
        assert error < 1e-4, (capability, error)
