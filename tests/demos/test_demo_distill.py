"""treadle.demos.distill: a short run end to end (its results and run folder), the teacher reused from its folder,
the summary's arithmetic and the table."""

import json

import pytest

from treadle.cli import command as cli
from treadle.demos import addition, distill as demo_distill
from treadle.demos.distill import DistillDemoSettings, first_reaching, results_table, summarise

TINY = dict(
    sft_steps=20,
    sft_check_every=10,
    grpo_steps=4,
    eval_size=40,
    eval_every=2,
    teacher_steps=20,
    teacher_check_every=10,
    grpo_batch_size=32,
    num_generations=4,
)


@pytest.mark.slow
def test_a_short_distill_demo_writes_its_results_and_reuses_the_teacher(tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo_distill.run_distill_demo(DistillDemoSettings(**TINY), str(out)) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["methods"]) == {"GRPO", "distillation", "SFT on teacher answers"}
    for name, method in results["methods"].items():
        assert [p["step"] for p in method["curve"]] == [2, 4], name  # every eval_every steps and the last
        assert method["steps"] == 4 and method["train_seconds"] >= 0
        assert 0.0 <= method["final_accuracy"] <= 1.0
    assert results["grpo_final_accuracy"] == results["methods"]["GRPO"]["final_accuracy"]
    assert results["heldout_problems"] == 40
    for folder in ("teacher", "sft", "grpo", "distillation", "sft_teacher"):
        assert (out / folder).is_dir(), folder
    assert (out / "distillation" / "metrics.jsonl").is_file()
    stdout = capsys.readouterr().out
    assert "at GRPO final" in stdout and "teacher: 20 SFT steps" in stdout
    # a second run with the first one's teacher folder trains no teacher
    again = tmp_path / "again"
    settings = DistillDemoSettings(**{**TINY, "grpo_steps": 2}, seed=1, teacher_dir=str(out / "teacher"))
    assert demo_distill.run_distill_demo(settings, str(again)) == 0
    assert "teacher: reused from" in capsys.readouterr().out
    assert not (again / "teacher").exists()


def test_summary_finds_the_first_step_at_grpo_final():
    curves = {
        "GRPO": [(10, 0.3, 5.0), (20, 0.5, 10.0)],
        "distillation": [(10, 0.6, 2.0), (20, 0.7, 4.0)],
        "SFT on teacher answers": [(10, 0.2, 1.0), (20, 0.4, 2.0)],
    }
    assert first_reaching(curves["distillation"], 0.5) == (10, 2.0)
    assert first_reaching(curves["SFT on teacher answers"], 0.5) is None
    results = summarise(
        DistillDemoSettings(),
        {"heldout_accuracy": 0.97, "steps": 3000, "train_seconds": 50.0},
        (400, 6.0, 0.22),
        curves,
        1000,
    )
    methods = results["methods"]
    assert results["grpo_final_accuracy"] == 0.5
    assert (methods["distillation"]["steps_to_grpo_final"], methods["distillation"]["fraction_of_grpo_steps"]) == (
        10,
        0.5,
    )
    assert (
        methods["GRPO"]["steps_to_grpo_final"] == 20
        and methods["SFT on teacher answers"]["steps_to_grpo_final"] is None
    )
    lines = results_table(results).splitlines()
    assert lines[0].split()[:2] == ["method", "held-out"]
    assert lines[2].split()[:2] == ["teacher", "97.0%"] and lines[3].split()[:4] == ["SFT", "warm", "start", "22.0%"]
    assert lines[5].split() == [
        "distillation",
        "70.0%",
        "of",
        "1000",
        "20",
        "4",
        "s",
        "step",
        "10",
        "(0.50),",
        "2",
        "s",
    ]
    assert methods["distillation"]["seconds_to_grpo_final"] == 2.0
    assert lines[6].split()[-1] == "never"


def test_the_command_line_hands_the_teacher_folder_to_the_distill_demo_only(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)  # the command claims the folder (x) before the demo
    calls = []
    monkeypatch.setattr(demo_distill, "run_distill_demo", lambda settings, out: calls.append((settings, out)) or 0)
    assert cli.main(["demo", "--task", "distill", "--seed", "3", "--teacher-dir", "t", "--output-dir", "x"]) == 0
    assert calls == [(DistillDemoSettings(seed=3, teacher_dir="t"), "x")]
    monkeypatch.setattr(addition, "run_demo", lambda *a: pytest.fail("the demo must not start"))
    assert cli.main(["demo", "--teacher-dir", "t"]) == 2
    assert (
        capsys.readouterr().err.strip() == "treadle: error: --teacher-dir has no use in --task addition; leave it out"
    )
