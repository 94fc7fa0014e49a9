"""transformers' optimizer names for torchao's low-bit AdamW, ``adamw_torch_8bit`` and ``adamw_torch_4bit``: the same
class and settings as transformers builds, the same steps as transformers.Trainer on the same tiny Llama and rows,
a falling loss, and a checkpoint that resumes exactly with the quantized moments.

The tiny Llama here has a vocabulary of 128, so that its embedding and head (128 x 32 = 4,096 values) are the tensors
whose moments torchao quantizes (at least 4,096 values, a multiple of the block size); its other tensors keep float32
moments, as a real model's norm weights do. torchao compiles its step once per parameter shape: the runs pay that on
their first step (seconds), once per process.
"""

import importlib.util

import pytest
import torch
from _factories import lm_rows, tiny_llama

torchao_optim = pytest.importorskip("torchao.optim")  # the test extras install it (pyproject: torchao)
transformers = pytest.importorskip("transformers", minversion="5.24")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

from _parity import COMMON, run_both, train_logs  # noqa: E402  (after the skips: it imports transformers)

import treadle  # noqa: E402
from treadle import optim  # noqa: E402
from treadle.data import collator_for  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
NAMES = {"adamw_torch_8bit": torchao_optim.AdamW8bit, "adamw_torch_4bit": torchao_optim.AdamW4bit}
STATE = {"adamw_torch_8bit": "OptimState8bit", "adamw_torch_4bit": "OptimState4bit"}
VOCAB = 128  # embedding and head of 4,096 values each: quantized moments


def model():
    return tiny_llama(vocab_size=VOCAB)


@pytest.mark.parametrize("name", NAMES)
def test_the_name_builds_torchaos_class_with_transformers_settings(name):
    hf_args = transformers.TrainingArguments(output_dir="unused", optim=name, optim_args="block_size=128")
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(hf_args)
    ours = optim.build_optimizer(model(), treadle.TrainingArguments(optim=name, optim_args="block_size=128"))
    assert type(ours) is cls is NAMES[name]
    assert kwargs["block_size"] == "128"  # transformers passes optim_args' text on; treadle reads the number
    assert ours.block_size == 128 and ours.bf16_stochastic_round is False and not kwargs["bf16_stochastic_round"]
    for key in ("lr", "betas", "eps"):
        assert ours.defaults[key] == kwargs[key], key
    default = optim.build_optimizer(model(), treadle.TrainingArguments(optim=name))
    assert default.block_size == 256  # transformers' default


def test_a_missing_or_old_torchao_is_one_line_naming_the_install(monkeypatch):
    args = treadle.TrainingArguments(optim="adamw_torch_4bit")
    monkeypatch.setattr(optim.importlib.metadata, "version", lambda package: "0.11.0")
    with pytest.raises(ImportError, match=r"needs torchao>=0.15.0, found 0.11.0: pip install -U torchao"):
        optim.build_optimizer(model(), args)
    real = importlib.util.find_spec
    monkeypatch.setattr(optim.importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else real(n, *a))
    with pytest.raises(ImportError, match=r"^optim='adamw_torch_4bit' needs torchao .*: pip install torchao;"):
        optim.build_optimizer(model(), args)


def test_optim_args_are_checked_per_optimizer():
    with pytest.raises(ValueError, match="'momentum' is not a setting of optim='adamw_torch_8bit'; use block_size"):
        treadle.TrainingArguments(optim="adamw_torch_8bit", optim_args="momentum=0.9")
    with pytest.raises(ValueError, match="block_size='big' is not a number"):
        treadle.TrainingArguments(optim="adamw_torch_8bit", optim_args="block_size=big")


@pytest.mark.slow  # torchao compiles its step for each parameter shape: tens of seconds on a loaded 2-core machine
@pytest.mark.parametrize("name", NAMES)
def test_steps_match_transformers_trainer_and_the_loss_falls(tmp_path, name):
    # the same 4 rows at every step (batch 2 x accumulation 2, in order), so that the loss must fall
    rows = lm_rows(4, vocab_size=VOCAB) * 4
    hf, ours = run_both(tmp_path, rows, model=model(), optim=name)
    assert type(ours.optimizer) is type(hf.optimizer.optimizer) is NAMES[name]  # accelerate wraps theirs
    theirs, mine = train_logs(hf), train_logs(ours)
    assert [h["step"] for h in mine] == [h["step"] for h in theirs] == [1, 2, 3, 4]
    # the same class, settings, gradients and updates: measured on this machine, the weights and gradient norms were
    # equal bit for bit and the logged losses within 3.6e-7 (each sums its window's losses in its own precision);
    # 1e-6 leaves room for a sum order, while a moment one 8-bit code apart moves its weight by ~lr / 127 = 8e-5
    for key in ("loss", "grad_norm", "learning_rate"):
        assert [h[key] for h in mine] == pytest.approx([h[key] for h in theirs], abs=1e-6), key
    assert all(isinstance(h["learning_rate"], float) for h in mine)  # torchao keeps lr as a tensor: logged as a number
    for key, weight in hf.model.state_dict().items():
        torch.testing.assert_close(ours.model.state_dict()[key], weight, atol=1e-6, rtol=0, msg=key)
    assert mine[-1]["loss"] < mine[0]["loss"]
    quantized = [s["exp_avg"] for s in ours.optimizer.state.values() if type(s["exp_avg"]).__name__ == STATE[name]]
    assert len(quantized) == 2  # the embedding and the head, as the module docstring says


@pytest.mark.slow  # as above: torchao's compilation
@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_resumes_exactly_with_the_quantized_moments(tmp_path, name):
    rows = lm_rows(16, vocab_size=VOCAB)

    def run(folder, **more):
        settings = {**COMMON, "save_strategy": "steps", "save_steps": 2}
        args = treadle.TrainingArguments(output_dir=str(tmp_path / folder), optim=name, **settings)
        trainer = treadle.Trainer(model(), args, train_dataset=rows, data_collator=collator_for(None))
        trainer.train(**more)
        return trainer

    whole = run("whole")
    saved = torch.load(tmp_path / "whole/checkpoint-2/optimizer.pt", weights_only=True)  # no pickled code
    assert sorted(type(s["exp_avg"]).__name__ for s in saved["state"].values()).count(STATE[name]) == 2
    resumed = run("resumed", resume_from_checkpoint=str(tmp_path / "whole/checkpoint-2"))
    after = [[(h["step"], h["loss"]) for h in train_logs(t) if h["step"] > 2] for t in (whole, resumed)]
    assert after[0] == after[1] and len(after[0]) == 2  # steps 3 and 4, bit for bit
    for key, weight in whole.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], weight), key
