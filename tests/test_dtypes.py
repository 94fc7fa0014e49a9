"""Models and their dtypes (the fourth hostile trial's cases, issue 59): ``model_init_kwargs`` on a toy model (dtype
honoured, the rest refused), a dtype treadle does not train in, and float16 weights under an AdamW whose epsilon is
0 in float16. The GGUF and folder cases: tests/test_gguf.py and tests/test_models.py. docs/runs.md lists every case."""

import json

import pytest
import torch
from test_run_errors import write_config

from treadle import TrainingArguments
from treadle.cli.command import main
from treadle.cli.loading import load_model
from treadle.optim import build_optimizer
from treadle.record import runfiles


def test_a_toy_model_is_built_in_the_dtype_model_init_kwargs_names_and_the_run_record_says_so(tmp_path):
    """Regression: `model: toy:tiny` with model_init_kwargs {dtype: bfloat16} trained in float32 and run.json said
    float32."""
    config = write_config(
        tmp_path,
        model_init_kwargs={"dtype": "bfloat16"},
        save_strategy="no",
        max_steps=1,
        output_dir=str(tmp_path / "run"),
    )
    assert main(["train", str(config)]) == 0
    assert runfiles.read_run_info(tmp_path / "run")["model"]["dtype"] == "torch.bfloat16"
    args = TrainingArguments(output_dir=str(tmp_path / "x"), model_init_kwargs={"torch_dtype": "auto"})
    assert next(load_model("toy:tiny", args=args)[0].parameters()).dtype == torch.float32  # auto: the toy's own


@pytest.mark.parametrize("kwargs", [{"gguf_file": "x.gguf"}, {"revision": "v1", "dtype": "float32"}])
def test_from_pretrained_keywords_a_toy_model_cannot_use_are_refused(tmp_path, kwargs):
    """Regression: `model: toy:tiny` with model_init_kwargs {gguf_file: ...} ignored it without a word."""
    args = TrainingArguments(output_dir=str(tmp_path), model_init_kwargs=kwargs)
    with pytest.raises(ValueError) as error:
        load_model("toy:tiny", args=args)
    wrong = sorted(set(kwargs) - {"dtype"})
    assert f"model_init_kwargs {wrong} mean nothing for toy:tiny, which treadle builds in code" in str(error.value)


@pytest.mark.parametrize("dtype", ["nonsense", "float8_e4m3fn", "int8"])
def test_a_dtype_treadle_does_not_train_in_is_one_line_before_anything_loads(tmp_path, dtype):
    """Regression: model_init_kwargs {dtype: nonsense} and {dtype: float8_e4m3fn} were torch tracebacks."""
    with pytest.raises(ValueError) as error:
        TrainingArguments(output_dir=str(tmp_path), model_init_kwargs={"dtype": dtype})
    message = str(error.value)
    assert f"model_init_kwargs: dtype={dtype!r} is not a dtype treadle trains weights in" in message
    assert "float32, bfloat16, float16 or auto" in message and "\n" not in message
    for fine in ("float32", "bfloat16", "auto", torch.bfloat16):  # names and torch dtypes alike
        TrainingArguments(output_dir=str(tmp_path), model_init_kwargs={"dtype": fine})


def test_the_cli_refuses_a_dtype_in_one_line(tmp_path):
    config = write_config(tmp_path, model_init_kwargs={"dtype": "float8_e4m3fn"})
    from test_run_errors import error_line, treadle

    line = error_line(treadle("train", config, cwd=tmp_path))
    assert "dtype='float8_e4m3fn' is not a dtype treadle trains weights in" in line
    assert not (tmp_path / "run").exists()  # refused before the run folder is claimed


def test_float16_weights_with_adamws_default_epsilon_are_refused_naming_the_fixes(tmp_path):
    """Regression: model_init_kwargs {dtype: float16} on CPU was "the training loss became nan ... lower
    learning_rate" at any learning rate: AdamW's eps 1e-8 is 0 in float16."""
    with pytest.raises(ValueError) as error:
        TrainingArguments(output_dir=str(tmp_path), model_init_kwargs={"dtype": "float16"})
    message = str(error.value)
    assert (
        "model_init_kwargs: dtype=float16 with optim=adamw and adam_epsilon=1e-08: the epsilon is 0 in float16"
        in message
    )
    assert "float32 weights" in message and "bfloat16 weights" in message and "adam_epsilon (e.g. 1e-4)" in message
    TrainingArguments(output_dir=str(tmp_path), model_init_kwargs={"dtype": "float16"}, adam_epsilon=1e-4)
    TrainingArguments(output_dir=str(tmp_path), model_init_kwargs={"dtype": "float16"}, optim="sgd")

    model = torch.nn.Linear(4, 4).half()  # a Python user's float16 model: the optimizer's build says the same
    with pytest.raises(ValueError, match="Linear's float16 weights with optim=adamw and adam_epsilon=1e-08"):
        build_optimizer(model, TrainingArguments(output_dir=str(tmp_path)))
    build_optimizer(model, TrainingArguments(output_dir=str(tmp_path), adam_epsilon=1e-4))


def test_float16_with_a_larger_epsilon_trains_a_finite_loss(tmp_path):
    """The fix the refusal names works: float16 toy weights with adam_epsilon 1e-4 train without a nan."""
    config = write_config(
        tmp_path,
        model_init_kwargs={"dtype": "float16"},
        adam_epsilon=1e-4,
        save_strategy="no",
        max_steps=3,
        output_dir=str(tmp_path / "run"),
    )
    assert main(["train", str(config)]) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]  # fmt: skip
    assert losses and all(loss == loss and abs(loss) < float("inf") for loss in losses)
