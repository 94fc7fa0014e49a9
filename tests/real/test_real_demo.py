"""``treadle demo --model smollm2`` end to end on the real model, shortened: two GRPO steps, 8 held-out chats."""

import json

from treadle.demos import real as demo
from treadle.demos.addition import ACCURACY


def test_a_short_real_demo_writes_its_run_folder_and_a_loadable_model(tmp_path, capsys, smollm2_folder):
    out = tmp_path / "demo"
    settings = demo.RealDemoSettings(
        grpo_steps=2, eval_size=8, eval_every=1, prompts_per_step=2, num_generations=2, max_completion_length=8
    )
    assert demo.run_real_demo(settings, str(out)) == 0
    stdout = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert [s["stage"] for s in results["stages"]] == ["pretrained", "after GRPO"]
    assert results["heldout_problems"] == 8 and results["settings"]["grpo_steps"] == 2
    evals = [e for e in map(json.loads, (out / "grpo" / "metrics.jsonl").read_text().splitlines()) if ACCURACY in e]
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert [(p["step"], p["accuracy"]) for p in results["grpo_curve"]] == [(e["step"], e[ACCURACY]) for e in evals]
    assert all(0 <= e[ACCURACY] <= 1 and e[ACCURACY] * 8 == round(e[ACCURACY] * 8) for e in evals)
    assert "held-out exact match" in stdout and "pretrained" in stdout
    assert (out / "grpo" / "plots" / "training.png").is_file()
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out / "grpo" / "final")
    pretrained = AutoModelForCausalLM.from_pretrained(smollm2_folder)
    shapes = {n: p.shape for n, p in pretrained.named_parameters()}
    assert {n: p.shape for n, p in trained.named_parameters()} == shapes  # the whole model, plain transformers
    assert results["stages"][1]["steps"] == 2 and results["stages"][1]["train_seconds"] > 0
