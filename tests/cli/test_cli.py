"""The `treadle` command: config parsing, user errors as one line with exit status 2, dataset and model
loading, the example configs end to end, `treadle report`, and how `treadle demo` hands its flags to
treadle.demos.addition (the demo itself: tests/test_demo.py)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from treadle.cli import command as cli
from treadle.cli.loading import load_dataset, load_reward_funcs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run(argv, capsys):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(argv, capsys, *needles):
    code, _, err = run(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("treadle: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def write(path, text):
    path.write_text(text)
    return path


# ---- overrides and configs ----------------------------------------------------------------------------------
def test_overrides_are_read_as_yaml_1_2_values():
    assert cli.parse_overrides(
        [
            "--max_steps",
            "5",
            "--learning-rate=1e-3",
            "--packing",
            "true",
            "--name",
            "x y",
            "--report_to",
            "[tensorboard]",
            "--eval_strategy",
            "no",
            "--max_length",
            "null",
        ]
    ) == {
        "max_steps": 5,
        "learning_rate": 0.001,
        "packing": True,
        "name": "x y",
        "report_to": ["tensorboard"],
        "eval_strategy": "no",
        "max_length": None,
    }


@pytest.mark.parametrize(
    "items, needle",
    [(["--max_steps"], "--max_steps needs a value"), (["max_steps", "5"], "unexpected argument 'max_steps'")],
)
def test_malformed_overrides(items, needle):
    with pytest.raises(cli.UserError, match=needle):
        cli.parse_overrides(items)


# ---- user errors: one line, exit status 2 -----------------------------------------------------------------
def test_missing_config_file(tmp_path, capsys):
    assert_user_error(["train", tmp_path / "nope.yaml"], capsys, "config file", "not found")


def test_bad_yaml_names_the_line(tmp_path, capsys):
    bad = write(tmp_path / "bad.yaml", "trainer: sft\nmodel: [toy:tiny\n")
    assert_user_error(["train", bad], capsys, "not valid YAML", "line")


def test_a_config_that_is_not_a_mapping(tmp_path, capsys):
    assert_user_error(["train", write(tmp_path / "list.yaml", "- sft\n")], capsys, "must hold a mapping")


def test_unknown_trainer(tmp_path, capsys):
    config = write(tmp_path / "c.yaml", "trainer: ppo\nmodel: toy:tiny\ndataset: toy:addition\n")
    assert_user_error(["train", config], capsys, "unknown trainer 'ppo'", "dpo", "grpo", "sft")


def test_unknown_key_suggests_the_closest(tmp_path, capsys):
    config = write(tmp_path / "c.yaml", "trainer: sft\nmodel: toy:tiny\ndataset: toy:addition\nlerning_rate: 0.1\n")
    assert_user_error(["train", config], capsys, "unknown key 'lerning_rate'", "did you mean 'learning_rate'")


def test_unknown_override_key(capsys):
    assert_user_error(
        ["train", EXAMPLES / "sft.yaml", "--beta", "0.1"],
        capsys,
        "unknown key 'beta' for trainer sft",
        "it is a key of trainer distillation, dpo, grpo, kto",
    )


def test_a_grpo_key_on_distillation_names_its_trainer(capsys):
    """GRPO and distillation are siblings: GRPO's objective settings are not distillation's, and the one line says
    whose they are (not "did you mean 'adam_epsilon'")."""
    assert_user_error(
        ["train", EXAMPLES / "distillation.yaml", "--epsilon", "0.3"],
        capsys,
        "DistillationConfig: unknown key 'epsilon' for trainer distillation; it is a key of trainer grpo",
    )


def test_invalid_config_value_is_one_line(capsys):
    assert_user_error(
        ["train", EXAMPLES / "sft.yaml", "--packing", "true", "--max_length", "null"],
        capsys,
        "SFTConfig",
        "packing=True needs max_length",
    )


def test_wrongly_typed_value_is_one_line_naming_the_key(capsys):
    assert_user_error(
        ["train", EXAMPLES / "sft.yaml", "--max_steps", "ten"],
        capsys,
        "SFTConfig: max_steps must be an integer, got 'ten'",
    )


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("model", "no/such/folder", "model folder no/such/folder not found"),
        ("model", "toy:huge", "unknown toy model 'toy:huge'"),
        ("dataset", "missing.jsonl", "dataset missing.jsonl not found"),
        ("dataset", "toy:subtraction", "unknown toy task 'toy:subtraction'"),
        ("dataset", "toy:addition:lots", "row count"),
    ],
)
def test_missing_model_and_dataset(capsys, key, value, needle):
    assert_user_error(["train", EXAMPLES / "sft.yaml", f"--{key}", value], capsys, needle)


def test_missing_required_keys(tmp_path, capsys):
    assert_user_error(
        ["train", write(tmp_path / "c.yaml", "trainer: sft\nmodel: toy:tiny\n")], capsys, "no dataset: key"
    )
    assert_user_error(["train", write(tmp_path / "d.yaml", "model: toy:tiny\n")], capsys, "no trainer: key")


@pytest.mark.parametrize(
    "funcs, needle",
    [
        ("[]", "needs reward_funcs"),
        ("[no_such_module.reward]", "cannot import no_such_module"),
        ("[treadle.toy.no_reward]", "has no function 'no_reward'"),
        ("[missing.py:reward]", "file missing.py not found"),
    ],
)
def test_reward_function_errors(capsys, funcs, needle):
    assert_user_error(["train", EXAMPLES / "grpo.yaml", "--reward_funcs", funcs], capsys, needle)


def test_reward_funcs_only_for_grpo(capsys):
    assert_user_error(
        ["train", EXAMPLES / "sft.yaml", "--reward_funcs", "[treadle.toy.addition_reward]"],
        capsys,
        "reward_funcs is a GRPO key",
    )


def test_bad_command_line(capsys):
    assert_user_error(["fly"], capsys, "invalid choice")
    assert_user_error(["report"], capsys, "run_dir")
    assert_user_error(["demo", "--sft-steps", "0"], capsys, ">= 1")


def test_demo_flags_reach_the_settings_and_the_rest_keep_their_defaults(tmp_path, monkeypatch, capsys):
    from treadle.demos import addition as demo

    calls = []
    monkeypatch.setattr(demo, "run_demo", lambda settings, output_dir: calls.append((settings, output_dir)) or 0)
    monkeypatch.chdir(tmp_path)
    assert run(["demo", "--seed", "3", "--eval-size", "40", "--output-dir", tmp_path / "d"], capsys)[0] == 0
    assert run(["demo"], capsys)[0] == 0
    (given, given_dir), (default, default_dir) = calls
    assert (given, given_dir, default) == (
        demo.DemoSettings(seed=3, eval_size=40),
        str(tmp_path / "d"),
        demo.DemoSettings(),
    )
    assert default_dir.startswith(os.path.join("runs", "demo-"))  # the folder the command claimed, the default's
    assert not (tmp_path / "d").exists()  # claimed, then removed: the demo (replaced here) wrote nothing


def test_report_of_a_missing_folder(tmp_path, capsys):
    assert_user_error(["report", tmp_path / "none"], capsys, "not found")
    assert_user_error(["report", tmp_path], capsys, "holds no metrics.jsonl")


def test_the_installed_command_exits_2_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "treadle", "train", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"treadle: error: config file {tmp_path / 'missing.yaml'} not found"


# ---- datasets from files ------------------------------------------------------------------------------------
ROWS = [{"prompt": "1+2=", "completion": "3"}, {"prompt": "4+4=", "completion": "8"}]


def test_datasets_load_from_every_supported_format(tmp_path):
    from datasets import Dataset, DatasetDict

    write(tmp_path / "a.jsonl", "\n".join(json.dumps(r) for r in ROWS) + "\n")
    write(tmp_path / "a.json", json.dumps(ROWS))
    write(tmp_path / "a.csv", "prompt,completion\n1+2=,3\n4+4=,8\n")
    Dataset.from_list(ROWS).to_parquet(str(tmp_path / "a.parquet"))
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "disk"))
    DatasetDict(train=Dataset.from_list(ROWS), test=Dataset.from_list(ROWS[:1])).save_to_disk(str(tmp_path / "dd"))
    for name in ("a.jsonl", "a.json", "a.parquet", "disk", "dd"):
        data = load_dataset(str(tmp_path / name), kind="sft", split="train")
        assert data.to_list() == ROWS, name
    csv = load_dataset(str(tmp_path / "a.csv"), kind="sft", split="train")
    assert [str(r["completion"]) for r in csv] == ["3", "8"]
    assert len(load_dataset(str(tmp_path / "dd"), kind="sft", split="test")) == 1
    # relative paths are also looked up next to the config file
    assert len(load_dataset("a.json", kind="sft", split="train", base_dir=tmp_path)) == 2


def test_json_lines_are_read_by_datasets_json_loader_memory_mapped(tmp_path):
    """A .jsonl file goes through datasets' json builder: an Arrow table on disk (memory-mapped), not rows in a
    Python list; a .json document stays on treadle's reader (parsed whole by any reader; it tells the shapes)."""
    write(tmp_path / "a.jsonl", "\n".join(json.dumps(r) for r in ROWS * 3) + "\n")
    data = load_dataset(str(tmp_path / "a.jsonl"), kind="sft", split="train")
    assert data.info.builder_name == "json" and data.cache_files and data.to_list() == ROWS * 3


def test_corrupt_json_lines_name_the_line(tmp_path):
    write(tmp_path / "bad.jsonl", json.dumps(ROWS[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON") as error:
        load_dataset(str(tmp_path / "bad.jsonl"), kind="sft", split="train")
    assert str(error.value).startswith(str(tmp_path / "bad.jsonl"))  # said once, not wrapped again


def test_toy_datasets_take_the_split_and_kind_of_the_trainer():
    train = load_dataset("toy:addition:16", kind="preference", split="train")
    test = load_dataset("toy:addition:16", kind="rl", split="test")
    assert len(train) == 16 and train.column_names == ["prompt", "chosen", "rejected"]
    assert test.column_names == ["prompt", "answer"]
    assert not set(train["prompt"]) & set(test["prompt"])


def test_reward_function_from_a_file(tmp_path):
    write(
        tmp_path / "my_rewards.py",
        "def length(prompts, completions, **kw):\n    return [len(c) for c in completions]\n",
    )
    [fn] = load_reward_funcs(["my_rewards.py:length"], base_dir=tmp_path)
    assert fn(prompts=["a"], completions=["abc"]) == [3]


# ---- end to end -----------------------------------------------------------------------------------------------
def metrics_of(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_sft_example_trains_saves_and_plots(tmp_path, capsys):
    out = tmp_path / "sft"
    code, stdout, _ = run(
        [
            "train",
            EXAMPLES / "sft.yaml",
            "--output_dir",
            out,
            "--max_steps",
            "6",
            "--eval_steps",
            "3",
            "--logging_steps",
            "2",
            "--disable_tqdm",
            "true",
        ],
        capsys,
    )
    assert code == 0
    events = metrics_of(out)
    losses = [e["loss"] for e in events if "loss" in e]
    assert len(losses) == 3 and all(loss == loss for loss in losses)  # finite
    assert any("eval_loss" in e for e in events)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "checkpoint-6").is_dir()
    assert {p.name for p in (out / "plots").iterdir()} >= {"training.png"}  # eval_loss is drawn over the loss
    assert "plots in" in stdout
    # the saved folder is a model for the next run
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.hidden_size == 64


def test_a_finished_run_leaves_the_process_group(tmp_path, capsys, monkeypatch):
    """Under torchrun, `treadle train` ends by leaving the process group (torch asks it of a normal exit): here in a
    one-process gloo group, the model wrapped in DDP as on N processes."""
    import torch

    from treadle import distributed

    for name, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(distributed._free_port())),
    ):
        monkeypatch.setenv(name, value)
    distributed.init_distributed(torch.device("cpu"), force=True)
    try:
        code, _, _ = run(
            [
                "train",
                EXAMPLES / "sft.yaml",
                "--output_dir",
                tmp_path / "sft",
                "--max_steps",
                "2",
                "--eval_strategy",
                "no",
                "--disable_tqdm",
                "true",
            ],
            capsys,
        )
        assert code == 0 and (tmp_path / "sft" / "model.safetensors").is_file()
        assert not distributed.is_initialized()
    finally:
        distributed.finish()  # not left to the tests after this one when the assertion failed


def test_resume_continues_from_the_newest_checkpoint(tmp_path, capsys):
    out = tmp_path / "sft"
    base = [
        "train",
        EXAMPLES / "sft.yaml",
        "--output_dir",
        out,
        "--disable_tqdm",
        "true",
        "--eval_strategy",
        "no",
        "--save_steps",
        "2",
        "--logging_steps",
        "1",
    ]
    assert run(base + ["--max_steps", "4"], capsys)[0] == 0
    shutil.rmtree(out / "checkpoint-4")  # as if the run had died after step 2's checkpoint
    assert run(base + ["--max_steps", "4", "--resume"], capsys)[0] == 0
    assert [e["step"] for e in metrics_of(out) if "loss" in e] == [1, 2, 3, 4]
    # a finished run's schedule is spent: more steps on resume are refused (issue 33)
    code, _, err = run(base + ["--max_steps", "6", "--resume"], capsys)
    assert code == 2 and "schedule was built for 4 steps and is spent" in err.strip().splitlines()[-1]
    assert_user_error(
        ["train", EXAMPLES / "sft.yaml", "--output_dir", tmp_path / "empty", "--resume"],
        capsys,
        "no complete checkpoint",
    )


@pytest.mark.slow
def test_dpo_and_grpo_examples_run(tmp_path, capsys):
    for name, extra in (("dpo", ["--eval_steps", "2"]), ("grpo", [])):
        out = tmp_path / name
        code, _, err = run(
            [
                "train",
                EXAMPLES / f"{name}.yaml",
                "--output_dir",
                out,
                "--max_steps",
                "4",
                "--logging_steps",
                "2",
                "--disable_tqdm",
                "true",
                *extra,
            ],
            capsys,
        )
        assert code == 0, err
        keys = set().union(*metrics_of(out))
        assert "loss" in keys
        assert (out / "plots" / "training.png").is_file() and (out / "plots" / "rewards.png").is_file()
    assert "eval_loss" in set().union(*metrics_of(tmp_path / "dpo"))
    grpo_keys = set().union(*metrics_of(tmp_path / "grpo"))
    assert {"rewards/addition_reward/mean", "rewards/is_a_number/mean"} <= grpo_keys  # both example rewards
    assert (tmp_path / "grpo" / "completions.jsonl").is_file()


def test_report_redraws_plots_and_prints_a_summary(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write(
        run_dir / "metrics.jsonl",
        "".join(
            json.dumps({"step": s, "epoch": s / 4, "loss": 2.0 / s, "learning_rate": 0.1}) + "\n" for s in (1, 2, 3, 4)
        ),
    )
    code, out, _ = run(["report", run_dir], capsys)
    assert code == 0
    assert (run_dir / "plots" / "training.png").is_file()
    loss_line = next(line for line in out.splitlines() if line.startswith("loss"))
    assert loss_line.split()[1:] == ["4", "2", "0.5", "0.5", "2"]  # count, first, last, min, max
    # a folder of runs (a demo folder) reports each run
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    code, out, _ = run(["report", tmp_path], capsys)
    assert code == 0 and out.count("4 events") == 2


def test_report_of_several_runs_writes_each_report_and_their_overlay(tmp_path, capsys):
    for name, scale in (("a", 1.0), ("b", 2.0)):
        (tmp_path / name).mkdir()
        write(
            tmp_path / name / "metrics.jsonl",
            "".join(json.dumps({"step": s, "loss": scale / s}) + "\n" for s in (1, 2, 3)),
        )
    code, out, _ = run(["report", tmp_path / "a", tmp_path / "b"], capsys)
    assert code == 0 and out.count("3 events") == 2
    assert (tmp_path / "a" / "report.html").is_file() and (tmp_path / "b" / "report.html").is_file()
    assert f"2 runs overlaid in {tmp_path / 'compare' / 'report.html'}" in out
    assert (tmp_path / "compare" / "training.png").is_file()
    code, out, _ = run(["report", tmp_path / "a", tmp_path / "b", "--output-dir", tmp_path / "elsewhere"], capsys)
    assert code == 0 and (tmp_path / "elsewhere" / "report.html").is_file()
    assert_user_error(["report", tmp_path / "a", tmp_path / "none"], capsys, "not found")


@pytest.mark.slow
def test_a_reward_model_trained_by_the_cli_is_a_grpo_reward_in_yaml(tmp_path, capsys):
    """`trainer: reward` (RewardTrainer), then `reward_funcs: [model:PATH]` in a GRPO config."""
    rm = tmp_path / "rm"
    code, _, err = run(
        [
            "train",
            EXAMPLES / "reward.yaml",
            "--output_dir",
            rm,
            "--max_steps",
            "2",
            "--eval_steps",
            "2",
            "--logging_steps",
            "1",
            "--disable_tqdm",
            "true",
        ],
        capsys,
    )
    assert code == 0, err
    assert {"loss", "accuracy", "eval_accuracy"} <= set().union(*metrics_of(rm))
    config = write(
        tmp_path / "grpo.yaml",
        f"""
trainer: grpo
model: toy:tiny
dataset: toy:addition:16
reward_funcs: ["model:{rm}", treadle.toy.addition_reward]
output_dir: {tmp_path / "grpo"}
max_steps: 1
per_device_train_batch_size: 8
num_generations: 4
max_completion_length: 4
logging_steps: 1
save_strategy: "no"
disable_tqdm: true
""",
    )
    code, _, err = run(["train", config], capsys)
    assert code == 0, err
    keys = set().union(*metrics_of(tmp_path / "grpo"))
    assert {"rewards/rm/mean", "rewards/addition_reward/mean"} <= keys
    assert_user_error(
        ["train", config, "--output_dir", tmp_path / "g2", "--reward_funcs", f"[model:{tmp_path / 'nowhere'}]"],
        capsys,
        "reward model model:",
        "not found",
    )


def save_toy_model(folder, seed):
    from treadle.demos import toy

    tokenizer = toy.build_tokenizer()
    toy.build_model("tiny", tokenizer=tokenizer, seed=seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_kto_and_distillation_examples_run_on_local_model_folders(tmp_path, capsys):
    """`trainer: kto` (paired toy rows split) and `trainer: distillation` with `teacher:` a model folder, both
    with `model:` a local folder."""
    student, teacher = save_toy_model(tmp_path / "student", 0), save_toy_model(tmp_path / "teacher", 1)
    common = ["--model", student, "--max_steps", "2", "--logging_steps", "1", "--disable_tqdm", "true"]
    code, _, err = run(["train", EXAMPLES / "kto.yaml", "--output_dir", tmp_path / "kto", *common], capsys)
    assert code == 0, err
    assert {"loss", "kl", "rewards/chosen", "rewards/rejected"} <= set().union(*metrics_of(tmp_path / "kto"))
    code, _, err = run(
        ["train", EXAMPLES / "distillation.yaml", "--output_dir", tmp_path / "distill", "--teacher", teacher, *common],
        capsys,
    )
    assert code == 0, err
    losses = [m["loss"] for m in metrics_of(tmp_path / "distill") if "loss" in m]
    assert len(losses) == 2 and all(v > 0 for v in losses)
    assert (tmp_path / "distill" / "checkpoint-2").is_dir() or (tmp_path / "distill" / "model.safetensors").exists()


def test_teacher_key_errors(tmp_path, capsys):
    assert_user_error(["train", EXAMPLES / "distillation.yaml", "--teacher", "null"], capsys, "names its teacher:")
    assert_user_error(
        ["train", EXAMPLES / "sft.yaml", "--teacher", "toy:tiny"], capsys, "teacher: is a distillation key"
    )
