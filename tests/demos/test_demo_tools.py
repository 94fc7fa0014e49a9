"""``treadle demo --task tools``: the calculator, the SFT transcripts, the toy task's split, the CLI dispatch, the
held-out scorer (GRPOTrainer.evaluate) and a short run of the whole demo (its figures: docs/demos.md)."""

import json
from pathlib import Path

import pytest
import torch

from treadle import TrainerControl, TrainerState
from treadle.cli import command as cli
from treadle.demos import tools as demo_tools, toy
from treadle.rollouts.tools import ToolEnvironment, check_tool


def test_calc_by_hand_and_its_errors():
    assert check_tool(toy.calc) == "calc"
    assert (toy.calc("123+456"), toy.calc("(2-3)*4"), toy.calc("-5+2")) == (579, -4, -3)
    for bad in ('__import__("os")', "2**10", "1/2", "1+"):
        with pytest.raises(ValueError, match="calc"):
            toy.calc(bad)


def test_the_transcripts_call_the_tool_as_the_tool_environment_parses_it():
    rows = toy.tool_transcripts(toy.load_task("tools", kind="rl", n=3))
    assert len(rows) == 6
    call, answer = rows[0], rows[1]
    env = ToolEnvironment([toy.calc])
    observation, reward, done = env.step(call["completion"])
    assert (reward, done) == (None, False) and env.failed_calls == 0
    assert answer["prompt"] == f"{call['prompt']}{call['completion']}</s>{observation}"
    assert observation == f"<result>{answer['completion']}</result>"


def test_the_tools_task_is_three_digit_and_its_splits_are_disjoint():
    train, test = toy.load_task("tools", "train", kind="rl"), toy.load_task("tools", "test", kind="rl")
    assert (len(train), len(test)) == (20000, 1000)
    assert not set(train["prompt"]) & set(test["prompt"])
    a, b = test[0]["prompt"].rstrip("=").split("+")
    assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999 and test[0]["answer"] == str(int(a) + int(b))
    assert {f"{y}+{x}=" for x, y in (p.rstrip("=").split("+") for p in test["prompt"])} == set(test["prompt"])


def test_the_cli_runs_the_tools_demo_and_keeps_the_default(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the command claims the default folder (runs/demo-...) before the demo
    calls = []
    monkeypatch.setattr(demo_tools, "run_tools_demo", lambda settings, out: calls.append(("tools", settings)) or 0)
    from treadle.demos import addition as demo

    monkeypatch.setattr(demo, "run_demo", lambda settings, out: calls.append(("addition", settings)) or 0)
    assert cli.main(["demo", "--task", "tools", "--seed", "3", "--grpo-steps", "7"]) == 0
    assert cli.main(["demo"]) == 0
    (task, settings), (default_task, _) = calls
    assert (task, settings.seed, settings.grpo_steps, default_task) == ("tools", 3, 7, "addition")
    with pytest.raises(ValueError, match="--sft-steps"):
        demo_tools.ToolsDemoSettings(sft_steps=0)


def test_the_score_is_evaluate_and_the_written_transcripts_agree_with_it(tmp_path, monkeypatch):
    """score_tools is GRPOTrainer.evaluate()'s greedy eval_pass@1 under the exact-match reward (here replaced by
    one that passes the problems with an even answer), and the transcripts it writes mark the same problems."""
    tok = toy.build_tokenizer()
    test = toy.load_task("tools", "test", kind="rl", n=12)
    monkeypatch.setattr(
        toy, "addition_reward", lambda completions, answer, **k: [float(int(a) % 2 == 0) for a in answer]
    )
    model = toy.build_model("tiny", tokenizer=tok, seed=0)
    score, calls = demo_tools.score_tools(model, tok, test, demo_tools.ToolsDemoSettings(), tmp_path / "scored.jsonl")
    records = [json.loads(line) for line in open(tmp_path / "scored.jsonl")]
    assert [r["prompt"] for r in records] == test["prompt"] and [r["answer"] for r in records] == test["answer"]
    assert [r["correct"] for r in records] == [int(a) % 2 == 0 for a in test["answer"]]
    assert score == pytest.approx(sum(int(a) % 2 == 0 for a in test["answer"]) / 12) and 0 < score < 1
    assert all(r["transcript"][0]["role"] == "assistant" for r in records)
    assert calls == sum(demo_tools.right_call(r["prompt"], r["transcript"]) for r in records) / 12


def test_the_warm_start_probes_finer_and_slower_near_the_target_and_stops_after_two_probes_at_both(monkeypatch):
    """Every sft_check_every steps; every sft_check_every_near steps while the last probe solved sft_near_accuracy
    (one lucky probe at step 20 falls back); at sft_near_lr_factor of the learning rate once two probes in a row
    did (steps 30, 32). SFT stops at the second probe in a row that solves sft_target_accuracy with the right call
    on sft_target_calls (the probe scores here are scripted): neither a lucky probe (0.31 at step 34, then 0.19)
    nor a solve rate with wrong calls (0.25 with the right call on 40%, step 38) stops it."""
    Score = demo_tools.ToolScore
    scores = iter(
        [
            Score(0.0, 0.3),
            Score(0.11, 0.9),
            Score(0.05, 0.9),
            Score(0.12, 0.95),
            Score(0.15, 0.95),
            Score(0.31, 0.95),
            Score(0.19, 0.99),
            Score(0.25, 0.4),
            Score(0.22, 0.5),
            Score(0.2, 0.93),
        ]
    )
    probed, rates = [], []
    monkeypatch.setattr(demo_tools, "score_tools", lambda *a, label, **k: probed.append(label) or next(scores))
    settings = demo_tools.ToolsDemoSettings()
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=settings.sft_learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 4))  # 4 warm-up steps
    stop = demo_tools._StopWithTool(None, None, settings)
    state, control = TrainerState(max_steps=800), TrainerControl()
    for step in range(1, 60):
        optimizer.step()
        scheduler.step()
        state.global_step = step
        stop.on_step_end(None, state, control, optimizer=optimizer, lr_scheduler=scheduler)
        rates.append(optimizer.param_groups[0]["lr"])  # the rate of the next step
        if control.should_training_stop:
            break
    assert probed == [f"SFT step {s}: probe of training problems" for s in (10, 20, 22, 30, 32, 34, 36, 38, 40, 42)]
    assert step == 42
    assert rates[4:31] == [5e-3] * 27 and rates[31:] == pytest.approx([1.25e-3] * 11)  # steps 33-43: dropped


@pytest.mark.parametrize("met_on", [1, 2, None])
def test_the_warm_start_starts_again_from_the_same_weights_in_another_order_until_at_its_targets(monkeypatch, met_on):
    """An attempt not at the targets after sft_steps is dropped: the next starts from the initial weights of
    ``seed`` (not from the dropped attempt's) on the same transcripts in the order of data_seed seed + 1000 x
    attempt; the first attempt at the targets is kept, else the last (sft_attempts of them)."""
    settings = demo_tools.ToolsDemoSettings(seed=4, sft_problems=40, sft_steps=30, sft_attempts=3)
    calls = []

    def fake_sft(model, tokenizer, dataset, settings, output_dir, *, stop, data_seed):
        calls.append((model, model.model.embed_tokens.weight.clone(), dataset.to_list(), output_dir.name, data_seed))
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(1.0)  # the attempt trains it
        met = len(calls) == met_on
        stop.in_a_row = settings.sft_stop_probes if met else settings.sft_stop_probes - 1
        return (10 if met else settings.sft_steps), 2.0

    monkeypatch.setattr(demo_tools, "tools_sft", fake_sft)
    tok = toy.build_tokenizer()
    model, steps, seconds, attempts = demo_tools.warm_start(tok, settings, Path("run"))
    n = met_on or 3
    assert (attempts, len(calls), steps, seconds) == (n, n, 10 if met_on else 30, 2.0 * n)
    assert (
        model is calls[-1][0]
        and [c[3:] for c in calls] == [("sft", 4), ("sft-attempt-2", 1004), ("sft-attempt-3", 2004)][:n]
    )
    initial = toy.build_model("tiny", seed=4, tokenizer=tok).model.embed_tokens.weight
    assert all(torch.equal(c[1], initial) for c in calls)
    transcripts = toy.tool_transcripts(toy.load_task("tools", "train", kind="rl", n=40, seed=4)).to_list()
    assert all(c[2] == transcripts for c in calls)


def test_a_right_call_is_the_taught_call_in_the_first_turn_whatever_follows():
    """right_call on hand-made transcripts: exactly the call of the prompt's own numbers, in their order."""
    call = [{"role": "assistant", "content": '<call>calc("123+456")</call>'}]
    after = [{"role": "tool", "content": "<result>579</result>"}, {"role": "assistant", "content": "578"}]
    assert demo_tools.right_call("123+456=", call + after) and demo_tools.right_call("123+456=", call)
    for wrong in (
        '<call>calc("123+465")</call>',
        '<call>calc("456+123")</call>',
        "579",
        "",
        '<call>calc("123+456")</call> 579',
    ):
        assert not demo_tools.right_call("123+456=", [{"role": "assistant", "content": wrong}] + after), wrong
    assert not demo_tools.right_call("123+456=", [])


@pytest.mark.slow
def test_a_short_tools_demo_writes_its_run_folder(tmp_path, capsys):
    """... and each probe or score line says the stage and step it belongs to (they all read [step 0] before)."""
    settings = demo_tools.ToolsDemoSettings(
        eval_size=16,
        sft_problems=64,
        sft_steps=4,
        sft_probe_size=8,
        sft_check_every=2,
        grpo_steps=2,
        grpo_batch_size=16,
    )
    assert demo_tools.run_tools_demo(settings, str(tmp_path)) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    stages = {s["stage"]: s for s in results["stages"]}
    assert list(stages) == ["untrained", "after SFT", "GRPO + tool", "no-tool ctrl"]
    assert stages["GRPO + tool"]["steps"] == 2 and results["heldout_problems"] == 16
    for name, stage in zip(("untrained", "sft", "grpo", "control"), stages.values()):
        records = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
        assert len(records) == 16 and stage["accuracy"] == sum(r["correct"] for r in records) / 16
    assert (tmp_path / "grpo" / "metrics.jsonl").is_file() and (tmp_path / "grpo" / "plots" / "training.png").is_file()
    checks = {
        run: json.loads((tmp_path / run / "training_args.json").read_text())["health_checks"]
        for run in ("grpo", "control_grpo")
    }  # the control solves nothing by design: not a stalled run
    assert checks["grpo"]["no_learning_signal"] is True and checks["control_grpo"]["no_learning_signal"] is False
    out = capsys.readouterr().out
    assert "[SFT step 2: probe of training problems] " in out and "[after SFT: held-out] " in out
    # the tiny model is never at its targets in 4 steps: three attempts, the last kept
    assert "SFT attempt 2 is not at its targets after 4 steps; starting again" in out and results["sft_attempts"] == 3
    assert (tmp_path / "sft-attempt-3" / "metrics.jsonl").is_file() and stages["after SFT"]["steps"] == 4
    # the control: the same problems, as many times, in as many steps (half the rows: one per problem, not two)
    control = json.loads((tmp_path / "control_sft" / "training_args.json").read_text())
    assert (control["per_device_train_batch_size"], control["max_steps"]) == (settings.sft_batch_size // 2, 4)
    tool_problems = toy.load_task("tools", "train", kind="rl", n=64, seed=0)
    assert toy.load_task("tools", "train", kind="sft", n=64, seed=0)["prompt"] == tool_problems["prompt"]
    assert "[step 0]" not in out and max(len(line) for line in out.splitlines() if line.startswith("[step")) < 200
