"""``treadle eval`` (treadle.cli.evaluate) on the toy model: its figures equal a plain transformers ``generate`` loop
scored by reasoning-gym itself, pass@k, a dataset with reward functions, every kind of MODEL, the one-line errors;
and reasoning-gym datasets in a ``treadle train`` config (the verifier as the default reward, held-out items)."""

import json
import re
from pathlib import Path

import pytest
import torch
from reasoning_gym import create_dataset
from reasoning_gym.utils import extract_answer

from treadle.cli import command as cli
from treadle.cli.evaluate import task_spec
from treadle.cli.loading import load_any_model, load_model

TASKS = "{chain_sum: {min_terms: 2, max_terms: 2, max_digits: 1}, leg_counting: {min_animals: 1, max_animals: 2}}"
CONFIGS = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
    "leg_counting": {"min_animals": 1, "max_animals": 2},
}
SYSTEM = "Answer in tags."
ROOT = Path(__file__).resolve().parents[2]


def run(argv, capsys):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def evaluate(tmp_path, capsys, *flags, model="toy:tiny"):
    argv = ["eval", model, "--output-dir", tmp_path / "eval", "--system-prompt", SYSTEM, *flags]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    return json.loads((tmp_path / "eval" / "eval.json").read_text()), out


def plain_loop(model, tokenizer, name: str, n: int, seed: int, max_new_tokens: int) -> dict[str, float]:
    """Greedy ``generate`` one item at a time, scored by reasoning-gym's extract_answer and score_answer."""
    dataset = create_dataset(name, size=n, seed=seed, **CONFIGS[name])
    strict, lenient, lengths = [], [], []
    for i in range(n):
        item = dataset[i]
        chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item["question"]}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(ids) :].tolist()
        if tokenizer.eos_token_id in out:
            out = out[: out.index(tokenizer.eos_token_id) + 1]
        text = tokenizer.decode(out, skip_special_tokens=True)
        answer = extract_answer(text)
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
        fallback = answer if answer is not None else (numbers[-1] if numbers else None)
        strict.append(dataset.score_answer(answer, item) if answer is not None else 0.0)
        lenient.append(dataset.score_answer(fallback, item) if fallback is not None else 0.0)
        lengths.append(len(out))
    return {"strict": sum(strict) / n, "lenient": sum(lenient) / n, "mean_length": sum(lengths) / n}


def test_eval_equals_a_plain_generate_loop_scored_by_reasoning_gym(tmp_path, capsys):
    report, out = evaluate(tmp_path, capsys, "--tasks", TASKS, "--n", 5, "--seed", 3, "--max-new-tokens", 12)
    model, tokenizer = load_model("toy:tiny")
    for name in CONFIGS:
        expected = plain_loop(model.eval(), tokenizer, name, 5, 3, 12)
        got = report["per_task"][name]
        assert got["items"] == 5
        assert {k: got[k] for k in expected} == pytest.approx(expected)
        assert 0 <= got["truncated"] <= 1 and got["tag_rate"] == 0.0  # an untrained toy never writes the tag
    assert [t["name"] for t in report["tasks"]] == ["chain_sum", "leg_counting"]
    assert report["tasks"][0]["config"] == CONFIGS["chain_sum"] and report["system_prompt"] == SYSTEM
    assert report["mean"]["strict"] == pytest.approx(sum(report["per_task"][n]["strict"] for n in CONFIGS) / 2)
    table = out[out.index("task ") :].splitlines()
    assert table[0].split()[:4] == ["task", "items", "strict", "lenient"]
    assert [line.split()[0] for line in table[2:5]] == ["chain_sum", "leg_counting", "mean"]


def test_samples_give_pass_at_k(tmp_path, capsys):
    report, out = evaluate(
        tmp_path, capsys, "--tasks", "chain_sum", "--n", 3, "--num-samples", 2, "--max-new-tokens", 4
    )
    figures = report["per_task"]["chain_sum"]
    assert "pass@2" in figures and figures["items"] == 3 and report["settings"]["temperature"] == 1.0
    assert "2 samples per item" in out


def test_a_dataset_with_reward_functions(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(4)))
    argv = ["--dataset", rows, "--reward-funcs", "treadle.toy.addition_reward", "--max-new-tokens", 3]
    report, _ = evaluate(tmp_path, capsys, *argv)
    assert report["per_task"]["all"]["items"] == 4 and "addition_reward" in report["per_task"]["all"]


def test_a_lora_adapter_folder_loads_merged_into_its_base(tmp_path):
    peft = pytest.importorskip("peft")
    model, tokenizer = load_model("toy:tiny")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    wrapped.save_pretrained(tmp_path / "adapter")
    tokenizer.save_pretrained(tmp_path / "adapter")
    merged, _ = load_any_model(str(tmp_path / "adapter"))
    ids = torch.tensor([[10, 11, 12]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, wrapped(ids).logits, rtol=1e-4, atol=1e-5)
    plain, _ = load_model("toy:tiny")
    assert not torch.allclose(merged(ids).logits, plain(ids).logits)  # the adapter is there


@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--tasks", "chain_su"], ["no task 'chain_su'", "close names: chain_sum"]),
        (["--tasks", "gcd", "--dataset", "x.jsonl"], ["--tasks", "not both"]),
        (["--tasks", "gcd", "--num-samples", 2, "--temperature", 0], ["set --temperature"]),
        (["--tasks", "gcd", "--n", 0], ["--n must be >= 1"]),
        (["--tasks", "{gcd: [1]"], ["--tasks"]),
    ],
)
def test_mistakes_are_one_line(tmp_path, capsys, flags, needles):
    code, _, err = run(["eval", "toy:tiny", "--output-dir", tmp_path, *flags], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("treadle: error: "), err
    for needle in needles:
        assert needle in lines[0]


def test_a_run_folder_without_a_model_names_its_checkpoints(tmp_path, capsys):
    (tmp_path / "run" / "checkpoint-5").mkdir(parents=True)
    code, _, err = run(["eval", tmp_path / "run", "--tasks", "gcd"], capsys)
    assert code == 2 and "checkpoint-5" in err and "holds no model" in err


def test_a_config_trains_on_reasoning_gym_with_its_verifier_and_held_out_items(tmp_path, capsys):
    config = {
        "trainer": "grpo",
        "model": "toy:tiny",
        "output_dir": str(tmp_path / "run"),
        "dataset": {"reasoning_gym": {"tasks": {"chain_sum": dict(CONFIGS["chain_sum"], weight=2)}, "size": 60}},
        "eval_dataset": {"reasoning_gym": {"tasks": {"chain_sum": CONFIGS["chain_sum"]}, "size": 20}},
        "max_prompt_length": 200,
        "max_completion_length": 16,  # toy tiny has 256 positions
    }
    trainer = cli.build_trainer(config)
    assert [fn.__name__ for fn in trainer.reward_funcs] == ["reasoning_gym_score", "answer_format"]
    questions = {p[-1]["content"] for p in trainer.eval_dataset["prompt"]}
    assert len(trainer.train_dataset) < 60  # one-digit sums repeat: the held-out questions are dropped
    assert not questions & {p[-1]["content"] for p in trainer.train_dataset["prompt"]}
    assert "share items" not in capsys.readouterr().err
    config["eval_dataset"]["reasoning_gym"]["seed"] = 0  # the training seed: the same items
    cli.build_trainer(config)
    warning = [line for line in capsys.readouterr().err.splitlines() if "share items" in line]
    assert len(warning) == 1 and "chain_sum (seed 1)" in warning[0]


def test_the_example_config_builds_its_trainer_and_names_its_eval_tasks(tmp_path):
    config = cli.load_config(str(ROOT / "examples" / "grpo-gym.yaml"), ["--output_dir", str(tmp_path / "run")])
    trainer = cli.build_trainer(config, base_dir=ROOT / "examples")
    assert set(trainer.train_dataset["task"]) == {"chain_sum", "leg_counting"}
    assert task_spec(str(ROOT / "examples" / "grpo-gym.yaml")) == config["dataset"]["reasoning_gym"]["tasks"]
