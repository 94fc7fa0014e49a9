"""treadle.demos.addition: the settings' checks, the SFT warm-start stop, held-out scoring, the results table, and a
short demo end to end (its run folder)."""

import json

import pytest

from treadle.demos import addition as demo


@pytest.mark.parametrize("field", ["sft_steps", "grpo_steps", "eval_size"])
def test_settings_refuse_counts_below_one(field):
    with pytest.raises(ValueError, match="--sft-steps, --grpo-steps and --eval-size must be >= 1"):
        demo.DemoSettings(**{field: 0})
    assert getattr(demo.DemoSettings(**{field: 1}), field) == 1


@pytest.mark.slow
def test_a_short_demo_writes_the_run_folder(tmp_path, capsys):
    out = tmp_path / "demo"
    settings = demo.DemoSettings(sft_steps=20, grpo_steps=3, eval_size=40, eval_every=2)
    assert demo.run_demo(settings, str(out)) == 0
    stdout = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert [s["stage"] for s in results["stages"]] == ["untrained", "after SFT", "after GRPO"]
    assert results["heldout_problems"] == 40
    for stage in ("sft", "grpo"):
        assert (out / stage / "metrics.jsonl").is_file()
        assert (out / stage / "plots" / "training.png").is_file()
    # every score is GRPOTrainer.evaluate()'s greedy exact match: before GRPO's first step, every 2 steps, at the end
    evals = [
        e for e in map(json.loads, (out / "grpo" / "metrics.jsonl").read_text().splitlines()) if demo.ACCURACY in e
    ]
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert [(p["step"], p["accuracy"]) for p in results["grpo_curve"]] == [
        (e["step"], e[demo.ACCURACY]) for e in evals
    ]
    accuracy = {s["stage"]: s["accuracy"] for s in results["stages"]}
    assert (accuracy["after SFT"], accuracy["after GRPO"]) == (evals[0][demo.ACCURACY], evals[-1][demo.ACCURACY])
    assert {"eval_pass@1", "eval_pass@4", "eval_reward"} <= set(evals[-1])
    assert (out / "grpo" / "plots" / "eval.png").is_file()  # the held-out accuracy over GRPO steps
    untrained = json.loads((out / "untrained" / "metrics.jsonl").read_text())
    assert accuracy["untrained"] == untrained[demo.ACCURACY]
    sft = next(s for s in results["stages"] if s["stage"] == "after SFT")
    assert sft["steps"] <= 20 and (out / "sft" / f"checkpoint-{sft['steps']}").is_dir()
    assert (out / "grpo" / "checkpoint-3").is_dir()
    assert (out / "grpo" / "completions.jsonl").is_file()
    assert "held-out exact match" in stdout and "after GRPO" in stdout
    assert "held-out greedy exact match over GRPO steps: 0: " in stdout
    assert stdout.count("treadle: plots in") == 2  # one line per stage


def test_results_table_layout():
    table = demo.results_table([("untrained", 0.0, 0, 0.0), ("after SFT", 0.4215, 1250, 61.2)], 1000)
    lines = table.splitlines()
    assert lines[0].split() == ["stage", "held-out", "exact", "match", "steps", "train", "time"]
    assert lines[3].split() == ["after", "SFT", "42.1%", "of", "1000", "1250", "61", "s"]


def test_sft_warm_start_stops_at_the_probe_target(tmp_path, monkeypatch):
    from treadle import SFTConfig, SFTTrainer
    from treadle.demos import toy

    scores = iter([0.05, 0.1, 0.25, 0.9])
    monkeypatch.setattr(toy, "exact_match_accuracy", lambda *a, **k: next(scores))
    tokenizer = toy.build_tokenizer()
    stop = demo.StopAtAccuracy(toy.load_task("addition", kind="rl", n=8), tokenizer, target=0.2, every=2)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=20, save_steps=20, logging_steps=100, disable_tqdm=True)
    trainer = SFTTrainer(
        toy.build_model("tiny", tokenizer=tokenizer),
        args,
        processing_class=tokenizer,
        train_dataset=toy.load_task("addition", n=64),
        callbacks=[stop],
    )
    trainer.train()
    assert stop.history == [(2, 0.05), (4, 0.1), (6, 0.25)]
    assert trainer.state.global_step == 6
    assert (tmp_path / "checkpoint-6").is_dir()  # the stop saves the checkpoint GRPO starts from
