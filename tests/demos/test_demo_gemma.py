"""treadle.demos.gemma (``treadle demo --model gemma3``): the held-out split, the prompt, the reward, the newline eos,
the command line; and the whole demo on the toy model in Gemma's place. On the real model: docs/demos.md's runs."""

import json

import pytest

from treadle.cli import command as cli
from treadle.demos import gemma as demo, real_models, toy
from treadle.demos.addition import ACCURACY


def pairs(rows):
    return {tuple(int(x) for x in r["prompt"].split("\n")[-1].removesuffix(" =").split(" + ")) for r in rows}


def test_the_held_out_problems_are_never_trained_on_nor_shown_and_every_answer_is_the_sum():
    train = demo.problems("train", 810 - demo.HELD_OUT, seed=3)
    test = demo.problems("test", demo.HELD_OUT, seed=0)
    assert demo.HELD_OUT == 162
    assert len(pairs(test)) == demo.HELD_OUT and len(pairs(train)) == 810 - demo.HELD_OUT  # every pair, once
    assert not pairs(train) & pairs(test) and not set(demo.SHOTS) & pairs(test)
    assert all(10 <= a <= 99 and 1 <= b <= 9 for a, b in pairs(train) | pairs(test))
    for row in train[:50] + test[:50]:
        (a, b), lines = next(iter(pairs([row]))), row["prompt"].split("\n")
        assert row["answer"] == str(a + b) and lines[:2] == ["47 + 8 = 55", "23 + 5 = 28"] and len(lines) == 3
    assert demo.problems("train", 20, seed=0) != demo.problems("train", 20, seed=1)


@pytest.mark.parametrize(
    "text, reward",
    [
        (" 55\n", 1.0),
        (" 55", 1.0),  # cut at max_completion_length before the newline
        (" 55\n\n47 + 8 = 55", 1.0),  # Gemma's blank line (one token, not the eos) and what it writes after
        (" 43\n\n55", 0.0),  # regression: the last number of the whole completion was rewarded
        (" 5 5\n", 0.0),
        ("\n55", 0.0),
        ("", 0.0),
    ],
)
def test_the_reward_reads_the_first_line(text, reward):
    assert demo.first_line_is_sum([text], ["55"]) == [reward]


def test_inside_the_demo_completions_end_at_the_newline_and_the_tokenizer_gets_its_eos_back(tmp_path):
    tokenizer, newline = toy.build_tokenizer(), toy.build_tokenizer().convert_tokens_to_ids("\n")
    model = toy.build_model("tiny", tokenizer=tokenizer)
    settings = demo.GemmaDemoSettings(grpo_steps=1, eval_size=2, prompts_per_step=1, num_generations=2)
    with demo.lines_end_completions(tokenizer):
        trainer = demo.gemma_trainer(settings, tmp_path, model, tokenizer)
        assert trainer.sampling_params().eos_token_ids == (newline,)
    assert tokenizer.eos_token == "</s>" and trainer.sampling_params().eos_token_ids == (2,)
    with pytest.raises(KeyError), demo.lines_end_completions(tokenizer):
        raise KeyError("the eos comes back on an error too")
    assert tokenizer.eos_token == "</s>"


def test_the_demo_runs_end_to_end_with_the_toy_model_in_gemma_s_place(tmp_path, monkeypatch, capsys):
    tokenizer = toy.build_tokenizer()
    monkeypatch.setattr(real_models, "check_available", lambda key: None)
    monkeypatch.setattr(real_models, "folder", lambda key: "gemma-folder")
    monkeypatch.setattr(demo, "load_pretrained", lambda f: (toy.build_model("tiny", tokenizer=tokenizer), tokenizer))
    out = tmp_path / "demo"
    settings = demo.GemmaDemoSettings(
        grpo_steps=2, eval_size=4, eval_every=1, prompts_per_step=2, num_generations=2, max_completion_length=4
    )
    assert demo.run_gemma_demo(settings, str(out)) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["model"] == "gemma-3-270m" and results["heldout_problems"] == 4
    assert [s["stage"] for s in results["stages"]] == ["pretrained", "after GRPO"]
    evals = [e for e in map(json.loads, (out / "grpo" / "metrics.jsonl").read_text().splitlines()) if ACCURACY in e]
    assert [(p["step"], p["accuracy"]) for p in results["grpo_curve"]] == [(e["step"], e[ACCURACY]) for e in evals]
    assert [e["step"] for e in evals] == [0, 1, 2]
    completions = [json.loads(line) for line in (out / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert all(c["prompt"].startswith("47 + 8 = 55\n23 + 5 = 28\n") for c in completions)
    assert all("\n" not in c["completion"][:-1] for c in completions)  # a newline ends a completion
    saved = json.loads((out / "grpo" / "final" / "tokenizer_config.json").read_text())
    assert saved["eos_token"] == "</s>"  # saved with the model's own eos, not the demo's newline
    assert "held-out exact match" in capsys.readouterr().out


def test_settings_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="--grpo-steps and --eval-size must be >= 1"):
        demo.GemmaDemoSettings(grpo_steps=0)
    with pytest.raises(ValueError, match="--eval-size is at most 162"):
        demo.GemmaDemoSettings(eval_size=163)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--task", "tools"], "--model gemma3 runs the addition demo, not --task tools; leave --task out"),
        (["--task", "gym"], "--model gemma3 runs the addition demo, not --task gym"),
        (["--sft-steps", "3"], "--sft-steps has no use in --model gemma3; leave it out"),
        (["--use-vllm"], "--use-vllm is for the addition demo's GRPO in --model gemma3"),
        (["--eval-size", "200"], "--eval-size is at most 162"),
    ],
)
def test_the_command_line_refuses_in_one_line(argv, needle, capsys, monkeypatch):
    monkeypatch.setattr(demo, "run_gemma_demo", lambda *a: pytest.fail("the demo must not start"))
    assert cli.main(["demo", "--model", "gemma3", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_the_command_line_hands_its_flags_to_the_gemma_demo(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr(demo, "run_gemma_demo", lambda settings, out: calls.append((settings, out)) or 0)
    assert cli.main(["demo", "--model", "gemma3", "--seed", "2", "--grpo-steps", "7", "--output-dir", "x"]) == 0
    assert cli.main(["demo", "--model", "gemma3"]) == 0
    assert calls[0] == (demo.GemmaDemoSettings(seed=2, grpo_steps=7), "x")
    assert calls[1][1].startswith("runs/demo-gemma3-")  # the default run folder names the model
