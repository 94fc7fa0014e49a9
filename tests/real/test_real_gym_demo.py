"""``treadle demo --model smollm2 --task gym`` end to end on the real model, shortened: one SFT step, one GRPO step,
2 held-out items per task."""

import json

from treadle.demos import gym as demo


def test_a_short_gym_demo_writes_its_stages_and_a_model_treadle_eval_loads(tmp_path, capsys):
    out = tmp_path / "demo"
    settings = demo.GymDemoSettings(
        eval_size=2,
        grpo_steps=1,
        eval_every=1,
        prompts_per_step=2,
        num_generations=2,
        max_completion_length=8,
        sft_steps=1,
        sft_batch_size=2,
    )
    assert demo.run_gym_demo(settings, str(out)) == 0
    results = json.loads((out / "results.json").read_text())
    assert [s["stage"] for s in results["stages"]] == ["pretrained", "warm start", "after GRPO"]
    assert [t["name"] for t in results["tasks"]] == list(demo.DEMO_TASKS)
    assert results["tasks"][0]["config"] == demo.DEMO_TASKS["chain_sum"]
    assert "<answer>" in results["system_prompt"]
    for stage in results["stages"]:
        assert set(stage["per_task"]) == set(demo.DEMO_TASKS)
        strict = [task["strict"] for task in stage["per_task"].values()]
        assert stage["mean"]["strict"] == sum(strict) / len(strict)
    assert results["stages"][0]["mean"]["strict"] == 0.0  # the base model never writes the tag
    assert "after GRPO strict/lenient" in capsys.readouterr().out
    assert (out / "grpo" / "final" / "model.safetensors").is_file()
    assert (out / "grpo" / "plots" / "training.png").is_file()
