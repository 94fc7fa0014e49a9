"""``treadle demo --model gemma3`` end to end on the real Gemma 3 270M, shortened: two GRPO steps, 8 held-out
problems."""

import json

from treadle.demos import gemma as demo
from treadle.demos.addition import ACCURACY


def test_a_short_gemma_demo_stops_at_the_newline_and_saves_the_model_with_its_own_eos(tmp_path, capsys):
    out = tmp_path / "demo"
    settings = demo.GemmaDemoSettings(grpo_steps=2, eval_size=8, eval_every=1, prompts_per_step=2, num_generations=2)
    assert demo.run_gemma_demo(settings, str(out)) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["model"] == "gemma-3-270m"
    assert [s["stage"] for s in results["stages"]] == ["pretrained", "after GRPO"]
    evals = [e for e in map(json.loads, (out / "grpo" / "metrics.jsonl").read_text().splitlines()) if ACCURACY in e]
    assert [e["step"] for e in evals] == [0, 1, 2] and all(e[ACCURACY] * 8 == round(e[ACCURACY] * 8) for e in evals)
    completions = [json.loads(line) for line in (out / "grpo" / "completions.jsonl").read_text().splitlines()]
    assert len(completions) == 2 * 2 * 2
    # most stop at their first newline, before max_completion_length (the rest: cut, or Gemma's "\n\n", another token)
    one_line = [c for c in completions if c["completion"].endswith("\n") and "\n" not in c["completion"][:-1]]
    assert len(one_line) >= len(completions) // 2
    saved = json.loads((out / "grpo" / "final" / "tokenizer_config.json").read_text())
    assert saved["eos_token"] == "<eos>"
    assert "held-out exact match" in capsys.readouterr().out
