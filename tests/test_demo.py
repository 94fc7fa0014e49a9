"""treadle.demo: the settings' checks, the SFT warm-start stop, held-out scoring, the results table, and a
short demo end to end (its run folder)."""

import json

import pytest

from treadle import demo


@pytest.mark.parametrize("field", ["sft_steps", "grpo_steps", "eval_size"])
def test_settings_refuse_counts_below_one(field):
    with pytest.raises(ValueError, match="--sft-steps, --grpo-steps and --eval-size must be >= 1"):
        demo.DemoSettings(**{field: 0})
    assert getattr(demo.DemoSettings(**{field: 1}), field) == 1


@pytest.mark.slow
def test_a_short_demo_writes_the_run_folder(tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo.run_demo(demo.DemoSettings(sft_steps=20, grpo_steps=2, eval_size=40), str(out)) == 0
    stdout = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert [s["stage"] for s in results["stages"]] == ["untrained", "after SFT", "after GRPO"]
    assert results["heldout_problems"] == 40
    for stage in ("sft", "grpo"):
        assert (out / stage / "metrics.jsonl").is_file()
        assert (out / stage / "plots" / "training.png").is_file()
        lines = (out / stage / "heldout_completions.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert len(records) == 40
        accuracy = next(s["accuracy"] for s in results["stages"] if s["stage"] == f"after {stage.upper()}")
        assert accuracy == sum(r["correct"] for r in records) / 40
    sft = next(s for s in results["stages"] if s["stage"] == "after SFT")
    assert sft["steps"] <= 20 and (out / "sft" / f"checkpoint-{sft['steps']}").is_dir()
    assert (out / "grpo" / "checkpoint-2").is_dir()
    assert (out / "grpo" / "completions.jsonl").is_file()
    assert "held-out exact match" in stdout and "after GRPO" in stdout
    assert stdout.count("treadle: plots in") == 2  # one line per stage


def test_heldout_scoring_agrees_with_toy_exact_match(tmp_path, monkeypatch):
    from treadle import toy

    tokenizer, model = toy.build_tokenizer(), toy.build_model("tiny", seed=3)
    data = toy.load_task("addition", "test", kind="rl", n=30)
    answers = dict(zip(data["prompt"], data["answer"]))

    def fake_greedy(model, tokenizer, prompts, **kw):  # right for every third prompt, else off by one
        return [answers[p] + "\n" if i % 3 == 0 else str(int(answers[p]) + 1) for i, p in enumerate(prompts)]

    monkeypatch.setattr(toy, "greedy_completions", fake_greedy)
    ours = demo.score_heldout(model, tokenizer, data, tmp_path / "c.jsonl", batch_size=6)
    assert ours == toy.exact_match_accuracy(model, tokenizer, data, batch_size=30) == 10 / 30
    records = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert [r["correct"] for r in records] == [i % 6 % 3 == 0 for i in range(30)]


def test_results_table_layout():
    table = demo.results_table([("untrained", 0.0, 0, 0.0), ("after SFT", 0.4215, 1250, 61.2)], 1000)
    lines = table.splitlines()
    assert lines[0].split() == ["stage", "held-out", "exact", "match", "steps", "train", "time"]
    assert lines[3].split() == ["after", "SFT", "42.1%", "of", "1000", "1250", "61", "s"]


def test_sft_warm_start_stops_at_the_probe_target(tmp_path, monkeypatch):
    from treadle import SFTConfig, SFTTrainer, toy

    scores = iter([0.05, 0.1, 0.25, 0.9])
    monkeypatch.setattr(toy, "exact_match_accuracy", lambda *a, **k: next(scores))
    tokenizer = toy.build_tokenizer()
    stop = demo.StopAtAccuracy(toy.load_task("addition", kind="rl", n=8), tokenizer, target=0.2, every=2)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=20, save_steps=20, logging_steps=100, disable_tqdm=True)
    trainer = SFTTrainer(toy.build_model("tiny", tokenizer=tokenizer), args, processing_class=tokenizer,
                         train_dataset=toy.load_task("addition", n=64), callbacks=[stop])
    trainer.train()
    assert stop.history == [(2, 0.05), (4, 0.1), (6, 0.25)]
    assert trainer.state.global_step == 6
    assert (tmp_path / "checkpoint-6").is_dir()  # the stop saves the checkpoint GRPO starts from
