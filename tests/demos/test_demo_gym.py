"""``treadle demo --model smollm2 --task gym`` without the real model: its tasks, held-out and training rows, the
stages of results.json and the command line (the run itself: tests/real/test_real_gym_demo.py)."""

import dataclasses
import re
from pathlib import Path

import pytest
from _factories import tiny_llama

from treadle import tasks
from treadle.cli import command as cli
from treadle.cli.evaluate import task_spec
from treadle.demos import gym as demo
from treadle.generation.single import GenerationOutput


def test_the_demo_tasks_are_five_valid_reasoning_gym_configs():
    chosen = demo.demo_tasks()
    assert len(chosen) >= 5 and [t.name for t in chosen] == list(demo.DEMO_TASKS)


def test_training_rows_never_ask_a_held_out_question():
    settings = demo.GymDemoSettings(eval_size=20, grpo_steps=10)
    held_out = demo.heldout_rows(settings)
    assert len(held_out) == 20 * len(demo.DEMO_TASKS)
    first = held_out[0]
    assert first["task"] == "chain_sum" and first["prompt"][0]["content"] == tasks.ANSWER_PROMPT
    expected = tasks.task_items(demo.demo_tasks()[0], 20, tasks.EVAL_SEED_OFFSET)[0]["question"]
    assert first["prompt"][-1]["content"] == expected  # the items of docs/tasks.md's base table
    train = demo.training_rows(settings, held_out)
    assert len(train) == settings.prompts_per_step * settings.grpo_steps
    assert not {r["prompt"][-1]["content"] for r in train} & {r["prompt"][-1]["content"] for r in held_out}
    assert len({r["task"] for r in train}) > 1


def test_a_stage_holds_each_tasks_scores_and_their_means():
    names = list(demo.DEMO_TASKS)
    metrics = {f"eval_{n}/strict": i / 10 for i, n in enumerate(names)}
    metrics |= {f"eval_{n}/lenient": 0.5 for n in names}
    stage = demo.stage("pretrained", metrics, 0, 0.0)
    assert stage["per_task"][names[1]] == {"strict": 0.1, "lenient": 0.5}
    assert stage["mean"] == {"strict": pytest.approx(sum(range(len(names))) / 10 / len(names)), "lenient": 0.5}
    table = demo.stage_table([stage, stage])
    assert all(name in table for name in names) and "mean" in table.splitlines()[-1]


def test_the_command_line_hands_its_flags_to_the_gym_demo(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(demo, "run_gym_demo", lambda settings, out: calls.append((settings, out)) or 0)
    argv = ["demo", "--model", "smollm2", "--task", "gym", "--seed", "1", "--grpo-steps", "3", "--output-dir", "x"]
    assert cli.main(argv) == 0
    assert calls == [(demo.GymDemoSettings(seed=1, grpo_steps=3), "x")]
    assert cli.main(["demo", "--task", "gym"]) == 2
    assert "add --model smollm2" in capsys.readouterr().err
    assert cli.main(["demo", "--model", "smollm2", "--task", "gym", "--use-vllm"]) == 2
    assert "--use-vllm is for the addition demo's GRPO in --task gym" in capsys.readouterr().err


def test_the_warm_start_shows_gold_answers_in_the_tag_on_other_items():
    settings = demo.GymDemoSettings(eval_size=10, grpo_steps=5, sft_steps=3, sft_batch_size=4)
    held_out = demo.heldout_rows(settings)
    warm = demo.warm_start_rows(settings, held_out)
    train = demo.training_rows(settings, held_out)
    assert len(warm) == 12 and len(train) == 20
    assert all(re.fullmatch(r"<answer>.+</answer>", row["completion"][0]["content"]) for row in warm)
    asked = {row["prompt"][-1]["content"] for row in held_out}
    assert not asked & {row["prompt"][-1]["content"] for row in warm}
    mixture = demo._mixture_rows(settings, held_out)
    assert [r["prompt"] for r in warm] == [r["prompt"] for r in mixture[:12]]  # the mixture's first items
    assert train == mixture[12:32]  # then GRPO's, so that a longer run extends a shorter one's rows
    longer_run = demo.GymDemoSettings(eval_size=10, grpo_steps=8, sft_steps=3, sft_batch_size=4)
    longer = demo.training_rows(longer_run, held_out)
    assert longer[:20] == train


def test_the_own_warm_start_keeps_the_models_right_replies_and_appends_the_tag(monkeypatch):
    import torch

    settings = demo.GymDemoSettings(
        eval_size=4, grpo_steps=2, warm_start="own", warm_start_pool=3, warm_start_samples=2
    )
    held_out = demo.heldout_rows(settings)
    mixture = demo._mixture_rows(settings, held_out)
    gold = [row["answer"] for row in mixture[:3]]
    texts = [  # item 0: wrong, then right; item 1: right but cut at the token limit, then wrong; item 2: right twice
        "I do not know",
        f"so it is {gold[0]}. ",
        f"it is {gold[1]}",
        "no idea",
        f"{gold[2]}",
        f"first {gold[2]}",
    ]
    sampled = []

    def sample(model, prompts, **options):
        sampled.append((prompts, options))
        n = len(texts)
        return GenerationOutput(
            prompt_ids=torch.zeros(n, 1, dtype=torch.long),
            prompt_mask=torch.ones(n, 1, dtype=torch.long),
            completion_ids=torch.arange(n).unsqueeze(1),
            completion_mask=torch.ones(n, 1, dtype=torch.long),
            is_truncated=torch.tensor([False, False, True, False, False, False]),
        )

    class Tokenizer:
        eos_token_id, pad_token_id = 2, 0

        def __call__(self, text, **_):
            return type("Encoding", (), {"input_ids": [1]})()

        def decode(self, ids, **_):
            return texts[int(ids[0])]

    monkeypatch.setattr(demo, "generate_completions", sample)
    monkeypatch.setattr(demo, "render_chat_prompt", lambda tokenizer, messages: "prompt")
    rows = demo.own_warm_start_rows(None, Tokenizer(), settings, held_out)
    assert [r["prompt"] for r in rows] == [mixture[0]["prompt"], mixture[2]["prompt"]]
    replies = [r["completion"][0]["content"] for r in rows]
    assert replies == [f"so it is {gold[0]}.\n<answer>{gold[0]}</answer>", f"{gold[2]}\n<answer>{gold[2]}</answer>"]
    assert len(sampled[0][0]) == 3 and sampled[0][1]["num_generations"] == 2 and sampled[0][1]["do_sample"]
    assert demo.training_rows(settings, held_out) == mixture[3:11]  # GRPO's rows come after the sampled pool
    fewer = demo.own_warm_start_rows(None, Tokenizer(), dataclasses.replace(settings, sft_batch_size=1), held_out)
    assert fewer == rows[:1]  # at most sft_steps x sft_batch_size rows
    with pytest.raises(ValueError, match="warm_start must be one of"):
        demo.GymDemoSettings(warm_start="both")


def test_the_warm_start_stops_at_the_first_step_whose_greedy_replies_carry_the_tag_often_enough(monkeypatch):
    import torch

    from treadle.callbacks import TrainerControl, TrainerState

    rounds = [["1", "2", "3", "<answer>4</answer>"], ["<answer>1</answer>", "2", "<answer>3</answer>", "4"]]
    calls = []

    def greedy(model, prompts, **options):
        calls.append((len(prompts), options))
        n = len(prompts)
        return GenerationOutput(
            prompt_ids=torch.zeros(n, 1, dtype=torch.long),
            prompt_mask=torch.ones(n, 1, dtype=torch.long),
            completion_ids=torch.full((n, 1), len(calls) - 1),
            completion_mask=torch.ones(n, 1, dtype=torch.long),
            is_truncated=torch.zeros(n, dtype=torch.bool),
        )

    class Tokenizer:
        eos_token_id, pad_token_id = 2, 0
        decoded = 0

        def __call__(self, text, **_):
            return type("Encoding", (), {"input_ids": [1]})()

        def decode(self, ids, **_):  # the i-th reply of round ids[0]
            text = rounds[int(ids[0])][self.decoded % 4]
            self.decoded += 1
            return text

    monkeypatch.setattr(demo, "generate_completions", greedy)
    monkeypatch.setattr(demo, "render_chat_prompt", lambda tokenizer, messages: "prompt")
    settings = demo.GymDemoSettings(warm_start="own", warm_start_tag_rate=0.5, max_completion_length=7)
    stop = demo.StopAtTagRate([{"prompt": [{"role": "user", "content": "q"}]}] * 4, Tokenizer(), settings)
    state, control = TrainerState(), TrainerControl()
    for step in (1, 2):
        state.global_step = step
        stop.on_step_end(None, state, control, model=None)
        assert control.should_training_stop == (step == 2)  # 1 of 4 replies tagged, then 2 of 4: the target's 50%
    assert stop.history == [(1, 0.25), (2, 0.5)]
    greedy_settings = {"num_generations": 1, "max_new_tokens": 7, "eos_token_id": 2, "pad_token_id": 0}
    assert calls[0] == (4, {**greedy_settings, "do_sample": False})
    for rate in (-0.1, 1.5):
        with pytest.raises(ValueError, match="warm_start_tag_rate must lie in"):
            demo.GymDemoSettings(warm_start_tag_rate=rate)


def test_the_kl_term_takes_beta_and_a_negative_one_is_refused(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(demo, "GRPOTrainer", lambda model, **kwargs: seen.update(kwargs))
    settings = demo.GymDemoSettings(eval_size=2, grpo_steps=1, beta=0.04)
    tokenizer = type("Tokenizer", (), {"eos_token_id": 2})()
    demo.gym_trainer(settings, tmp_path, None, tokenizer, demo.heldout_rows(settings))
    assert seen["args"].beta == 0.04
    assert demo.GymDemoSettings().beta == 0.0  # no reference model by default
    with pytest.raises(ValueError, match="beta must be >= 0"):
        demo.GymDemoSettings(beta=-0.1)


def test_the_trained_score_picks_the_reward_weights():
    weights = {
        name: demo.reward_weights(demo.GymDemoSettings(trained_score=name, format_weight=0.25))
        for name in ("strict", "lenient", "both")
    }
    assert weights == {
        "strict": [1.0, 0.25, 0.0, 0.0],
        "lenient": [0.0, 0.25, 1.0, 0.0],
        "both": [1.0, 0.25, 1.0, 0.0],
    }
    with pytest.raises(ValueError, match="trained_score must be one of"):
        demo.GymDemoSettings(trained_score="tag")
    heavier = demo.GymDemoSettings(trained_score="both", format_weight=0.0, strict_weight=2.0)
    assert demo.reward_weights(heavier) == [2.0, 0.0, 1.0, 0.0]  # right: 1 untagged, 3 tagged; wrong: 0
    assert demo.reward_weights(dataclasses.replace(heavier, trained_score="lenient"))[0] == 0.0
    with pytest.raises(ValueError, match="strict_weight"):
        demo.GymDemoSettings(strict_weight=0.0)


def test_the_example_tasks_file_is_the_demos_tasks():
    assert task_spec(str(Path(__file__).resolve().parents[2] / "examples" / "gym-tasks.yaml")) == demo.DEMO_TASKS


def test_a_one_step_warm_start_trains_at_its_rate_not_a_warm_up_rate(monkeypatch, tmp_path):
    seen = []

    class Recorder:
        def __init__(self, model, args, **_):
            seen.append(args)

        def train(self):
            pass

        state = type("State", (), {"global_step": 1})

    monkeypatch.setattr(demo, "SFTTrainer", Recorder)
    settings = demo.GymDemoSettings(eval_size=2, sft_steps=1, sft_batch_size=2, grpo_steps=1)
    demo.warm_start(None, None, settings, demo.heldout_rows(settings), tmp_path)
    # transformers' warm-up makes step 1 of N warm-up steps a step at rate 0: a one-step warm start would not train
    assert seen[0].max_steps == 1 and seen[0].warmup_steps == 0
    assert seen[0].learning_rate == settings.sft_learning_rate


def test_a_lora_policy_trains_adapters_alone_at_scaled_rates():
    pytest.importorskip("peft")
    settings = demo.GymDemoSettings(lora_rank=4, lora_rate_scale=10.0)
    applied = settings.applied()
    assert applied.learning_rate == pytest.approx(10 * settings.learning_rate)
    assert applied.sft_learning_rate == pytest.approx(10 * settings.sft_learning_rate)
    assert applied.applied() == applied  # applied once: the rates are not scaled again
    assert demo.GymDemoSettings().applied() == demo.GymDemoSettings()
    model = demo.policy(tiny_llama(), settings)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    with pytest.raises(ValueError, match="--lora-rank -1"):
        demo.GymDemoSettings(lora_rank=-1)


def test_the_command_line_hands_the_lora_rank_to_the_gym_demo_alone(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(demo, "run_gym_demo", lambda settings, out: calls.append(settings) or 0)
    assert cli.main(["demo", "--model", "smollm2", "--task", "gym", "--lora-rank", "16", "--output-dir", "y"]) == 0
    assert calls == [demo.GymDemoSettings(lora_rank=16)]
    assert cli.main(["demo", "--model", "smollm2", "--lora-rank", "16"]) == 2
    assert "--lora-rank has no use in --model smollm2" in capsys.readouterr().err


def test_the_demo_matrix_judges_the_gym_claim_from_the_stage_grpo_starts_from():
    from benchmarks.demos import gym_outcome

    def stage(strict, lenient):
        names = list(demo.DEMO_TASKS)
        per_task = {n: {"strict": s, "lenient": lenient} for n, s in zip(names, strict, strict=True)}
        return {"per_task": per_task, "mean": {"strict": sum(strict) / len(strict), "lenient": lenient}}

    pretrained, warm = stage([0.0] * 5, 0.30), stage([0.1] * 5, 0.25)
    short = gym_outcome([pretrained, warm, stage([0.3, 0.3, 0.3, 0.2, 0.1], 0.31)])
    assert short["start"] == pytest.approx(0.1)  # the warm start, not the pretrained model
    assert short["gain"] == pytest.approx(14) and not short["met"]  # the mean gains 14 strict points
    enough = gym_outcome([pretrained, warm, stage([0.4, 0.4, 0.3, 0.1, 0.1], 0.31)])
    assert enough["gain"] == pytest.approx(16) and enough["met"]
    format_only = gym_outcome([pretrained, warm, stage([0.4, 0.4, 0.3, 0.1, 0.1], 0.29)])
    assert not format_only["met"]  # lenient +4: the gain is the answer format's
    two_tasks = gym_outcome([pretrained, warm, stage([0.6, 0.5, 0.1, 0.1, 0.1], 0.40)])
    assert two_tasks["gain"] == pytest.approx(18) and not two_tasks["met"]  # 2 tasks moved
