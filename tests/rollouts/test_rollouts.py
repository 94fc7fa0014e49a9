"""Multi-turn rollouts: tool checks and call parsing by hand, errors as tool turns, KV-cache-kept sampling against
re-prefilling and against re-scoring the transcript in one plain forward, no loss on observation tokens, the
GRPO metrics, columns and transcript records."""

import json
import queue
import runpy
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from _factories import add, chatty_model

from treadle.demos import toy
from treadle.engines.local import LocalEngine
from treadle.generation import SamplingParams, generate_turns
from treadle.rollouts.runner import RolloutRunner, environment_reward, rollout_metrics
from treadle.rollouts.tools import ToolEnvironment, check_tool, parse_json_call, parse_tagged_call
from treadle.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

EOS = 2  # the toy tokenizer's eos id


def settings(num_generations, max_new_tokens, **sampling) -> SamplingParams:
    """The sampling settings of a rollout batch with the toy tokenizer's EOS and pad ids."""
    return SamplingParams(
        num_generations=num_generations,
        max_new_tokens=max_new_tokens,
        eos_token_ids=(EOS,),
        pad_token_id=0,
        **sampling,
    )


class Counter:
    """An environment that answers every turn with ``[n]`` for ``turns`` turns, rewarding 0.5 per step."""

    role = "user"

    def __init__(self, turns=2):
        self.turns, self.n = turns, 0

    def reset(self, row):
        return ""

    def step(self, text):
        self.n += 1
        return f"[{self.n}]", 0.5, self.n > self.turns


# --------------------------------------------------------------------------------------------------- tools
def test_a_tool_needs_annotations_and_a_docstring_named_in_the_error(tok):
    def bare(a, b):
        """Adds."""
        return a + b

    def silent(a: int) -> int:
        return a

    with pytest.raises(TypeError, match=r"'bare' has parameters without a type annotation: \['a', 'b'\]"):
        check_tool(bare)
    with pytest.raises(TypeError, match="'silent' has no docstring"):
        check_tool(silent)
    with pytest.raises(TypeError, match="named function"):
        check_tool(lambda x: x)
    assert check_tool(add) == "add"
    with pytest.raises(TypeError, match="'bare'"):  # refused when the trainer is built, before any training
        GRPOTrainer(
            toy.build_model("tiny", tokenizer=tok),
            lambda **k: [0.0],
            args=GRPOConfig(output_dir="unused", per_device_train_batch_size=2, num_generations=2),
            processing_class=tok,
            train_dataset=toy.load_task("addition", kind="rl", n=4),
            tools=[add, bare],
        )


def test_call_parsing_by_hand():
    assert parse_tagged_call("add(1, b=2)") == ("add", [1], {"b": 2})
    assert parse_tagged_call(" f('x', [1, 2]) ") == ("f", ["x", [1, 2]], {})
    for bad in ("add(1,", "add(x)", "1+2", "a.b(1)", "f(**{'a': 1})"):
        with pytest.raises(Exception, match="malformed call"):
            parse_tagged_call(bad)
    assert parse_json_call('{"name": "add", "arguments": {"a": 1, "b": 2}}') == ("add", [], {"a": 1, "b": 2})
    with pytest.raises(Exception, match="malformed call"):
        parse_json_call('{"arguments": {}}')


def test_tool_turns_carry_results_and_errors_and_are_counted():
    release = threading.Event()

    def boom(x: int) -> int:
        """Always fails."""
        raise ZeroDivisionError("no")

    def hang(x: int) -> int:
        """Never answers in time."""
        release.wait(30)
        return x

    env = ToolEnvironment([add, boom, hang], tool_timeout=0.2)
    assert env.step("<call>add(2, 3)</call>") == ("<result>5</result>", None, False)
    observation, _, done = env.step("<call>add(2,</call><call>nope(1)</call><call>add(1)</call>")
    assert not done and observation.count("<result>error: ") == 3
    assert "malformed call" in observation and "unknown tool 'nope'" in observation
    assert "wrong arguments for add" in observation
    assert env.step("<call>boom(1)</call>")[0] == "<result>error: boom raised ZeroDivisionError: no</result>"
    assert env.step("<call>hang(1)</call>")[0] == "<result>error: hang timed out after 0.2 s</result>"
    release.set()
    assert env.step("the answer is 5") == ("", None, True)  # no call: the rollout is over
    assert (env.calls, env.failed_calls, dict(env.calls_by_tool)) == (6, 5, {"add": 2, "boom": 1, "hang": 1})
    metrics = rollout_metrics([[{"role": "assistant", "content": "x"}] * 2], [False], [env], ["add", "boom", "hang"])
    assert metrics["tools/call_frequency"] == (6, 1) and metrics["tools/failure_frequency"] == (5, 6)
    assert metrics["tools/add/calls"] == (2, 1) and metrics["rollouts/turns"] == (2, 1)

    limited = ToolEnvironment([add], max_tool_calling_iterations=1, call_format="json")
    assert limited.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>') == ("3", None, False)
    assert limited.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')[2] is True


def test_bad_runner_arguments_say_how_to_fix_them(tok):
    with pytest.raises(ValueError, match="either tools"):
        RolloutRunner(tok)
    with pytest.raises(ValueError, match="either tools"):
        RolloutRunner(tok, tools=[add], env_factory=Counter)
    with pytest.raises(TypeError, match="non-empty list"):
        RolloutRunner(tok, tools=add)
    with pytest.raises(ValueError, match="call_format"):
        RolloutRunner(tok, tools=[add], call_format="xml")
    with pytest.raises(ValueError, match="tool_timeout"):
        RolloutRunner(tok, tools=[add], tool_timeout=0)

    class Broken(Counter):
        def step(self, text):
            raise KeyError("oops")

    with pytest.raises(RuntimeError, match="Broken.step raised KeyError"):
        RolloutRunner(tok, env_factory=Broken).run(
            LocalEngine(chatty_model(tok)), [{"prompt": "1+1="}] * 2, settings(2, 40)
        )


def test_chat_prompts_get_template_turns_and_the_json_call_format(tok):
    runner = RolloutRunner(tok, tools=[add])
    assert runner.call_format == "tagged"  # the toy template has no tool-call format
    ids = runner.observation_ids("<result>5</result>", "tool", chat=True)
    assert tok.decode(ids) == "<|tool|><result>5</result>\n<|assistant|>"  # a tool turn, then the next prompt

    def mul(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return a * b

    hermes = toy.build_tokenizer()
    hermes.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }}{% endfor %}</tools>"
        "{% endif %}" + toy.CHAT_TEMPLATE + "{# answers in <tool_call> tags #}"
    )
    with pytest.raises(TypeError, match="'add' cannot be described to the chat template"):
        RolloutRunner(hermes, tools=[add])  # no Args: section
    runner = RolloutRunner(hermes, tools=[mul])
    assert runner.call_format == "json"
    prompt = runner.encode_prompts([[{"role": "user", "content": "6*7="}]], None)[0]
    assert hermes.decode(prompt) == "<tools>mul</tools><|user|>6*7=\n<|assistant|>"
    env = runner.new_environment()
    assert env.step('<tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>') == ("42", None, False)


# --------------------------------------------------------------------------------------------------- sampling
def test_kv_cache_kept_across_turns_equals_re_prefilling_each_turn(tok):
    """Greedy rollouts through generate_turns (one cache, observations fed) and through one generate_completions
    call per turn on the whole transcript give the same tokens, masks, transcripts and rewards."""
    model = chatty_model(tok, eos_bias=6.0)
    runner = RolloutRunner(tok, env_factory=lambda: Counter(turns=2))
    rows = [{"prompt": p} for p in ("12+34=", "12+34=", "7+8=", "7+8=", "99+1=", "99+1=")]
    outs = [
        runner.run(LocalEngine(model, backend=backend), rows, settings(2, 24, do_sample=False))
        for backend in ("fast", "hf")
    ]
    kv, again = (o.generation for o in outs)
    for name in ("completion_ids", "completion_mask", "sampled_mask", "is_truncated", "prompt_ids"):
        assert torch.equal(getattr(kv, name), getattr(again, name)), name
    assert outs[0].transcripts == outs[1].transcripts and outs[0].env_rewards == outs[1].env_rewards
    transcript = outs[0].transcripts[0]
    assert [m["role"] for m in transcript][:2] == ["assistant", "user"] and transcript[1]["content"] == "[1]"
    assert int((kv.sampled_mask != kv.completion_mask).sum()) > 0  # observations were fed
    runner.close()


def test_rollout_log_probs_equal_rescoring_the_whole_transcript(tok):
    """The log-probs of the sampled tokens, recorded while sampling with the cache kept across turns, equal a plain
    forward over prompt + whole transcript (observations included), read at the sampled tokens only."""
    model = chatty_model(tok).eval()
    pool = {}

    def respond(row, turn_ids):
        pool[row] = pool.get(row, 0) + 1
        return None if pool[row] > 2 else tok(f"<r>{row}:{len(turn_ids)}</r>")["input_ids"]

    out = generate_turns(
        model,
        [tok("12+34=")["input_ids"], tok("5+6=")["input_ids"]],
        respond,
        num_generations=3,
        max_new_tokens=40,
        eos_token_id=EOS,
        pad_token_id=0,
        temperature=0.7,
        generator=torch.Generator().manual_seed(0),
    )
    ids = torch.cat([out.prompt_ids, out.completion_ids], dim=1)
    mask = torch.cat([out.prompt_mask, out.completion_mask], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    width = out.prompt_ids.shape[1]
    reference = (
        (logits[:, width - 1 : -1].float() / 0.7).log_softmax(-1).gather(2, out.completion_ids[..., None]).squeeze(2)
    )  # (N, C)
    sampled = out.sampled_mask.bool()
    assert (out.completion_mask.bool() & ~sampled).any()  # the transcripts hold observation tokens
    assert torch.allclose(out.sampling_logps[sampled], reference[sampled], atol=1e-5)


def test_a_row_waiting_on_its_environment_does_not_stall_the_others(tok):
    """Row 0's first observation arrives only after every other row has finished its whole rollout: the others
    could only finish if sampling went on while row 0 waited."""
    from concurrent.futures import ThreadPoolExecutor

    model, executor = chatty_model(tok, eos_bias=6.0), ThreadPoolExecutor(4)
    others_done, finished, lock = threading.Event(), set(), threading.Lock()
    turns = {}

    def step(row):
        if row == 0 and turns[row] == 1:
            assert others_done.wait(30), "the other rows stalled behind row 0"
        if turns[row] <= 2:
            return tok("[ok]")["input_ids"]
        with lock:
            finished.add(row)
            if len(finished) == 5:
                others_done.set()

    def respond(row, turn_ids):
        turns[row] = turns.get(row, 0) + 1
        return executor.submit(step, row)

    out = generate_turns(
        model,
        [tok("1+1=")["input_ids"]],
        respond,
        num_generations=6,
        max_new_tokens=60,
        eos_token_id=EOS,
        pad_token_id=0,
        generator=torch.Generator().manual_seed(0),
    )
    assert others_done.is_set() and not out.is_truncated.any()
    executor.shutdown()


def test_sampled_rollouts_do_not_depend_on_when_the_environment_answers(tok):
    """The same seed gives the same transcripts whether each observation is ready at once or arrives after a
    random delay from a thread (so that rows sit out different sampling steps): a row's draws are keyed by its
    own position, not by the step. Rows must actually have waited for the check to mean something."""
    import random

    model, rng = chatty_model(tok, eos_bias=3.0), random.Random(0)
    turns, waited, pending = {}, [], queue.SimpleQueue()

    def observation(row):
        turns[row] = turns.get(row, 0) + 1
        return None if turns[row] > 2 else tok(f"[{row}]")["input_ids"]

    def release_in_shuffled_order():
        # answers the observations late by order, not by time: each may be put back behind the others twice
        while (item := pending.get()) is not None:
            row, future, delays = item
            if delays and rng.random() < 0.6:
                pending.put((row, future, delays - 1))
            else:
                future.set_result(observation(row))

    def respond_late(row, turn_ids):
        future = Future()
        pending.put((row, future, 2))
        waited.append(not future.done())
        return future

    outs = []
    releaser = threading.Thread(target=release_in_shuffled_order)
    releaser.start()
    try:
        for respond in (lambda row, turn_ids: observation(row), respond_late):
            turns.clear()
            outs.append(
                generate_turns(
                    model,
                    [tok("12+34=")["input_ids"], tok("5+6=")["input_ids"]],
                    respond,
                    num_generations=4,
                    max_new_tokens=48,
                    eos_token_id=EOS,
                    pad_token_id=0,
                    temperature=1.0,
                    generator=torch.Generator().manual_seed(3),
                )
            )
    finally:
        pending.put(None)
        releaser.join()
    assert any(waited) and (outs[0].sampled_mask.sum(1) > 0).all()
    assert torch.equal(outs[0].completion_ids, outs[1].completion_ids)
    assert torch.equal(outs[0].sampled_mask, outs[1].sampled_mask)


def test_multi_turn_sampling_draws_from_the_model_distribution(tok):
    """The first sampled token of 6,000 rollouts of one prompt: its frequencies match the softmax of the model's
    scores at temperature 0.8 by Pearson's chi-square (V - 1 degrees of freedom: mean V - 1, sd sqrt(2(V - 1));
    a sampler off by one token, or ignoring the temperature, is hundreds of sds away)."""
    model = chatty_model(tok).eval()
    prompt = tok("12+34=")["input_ids"]
    out = generate_turns(
        model,
        [prompt],
        lambda row, turn_ids: None,
        num_generations=6000,
        max_new_tokens=1,
        eos_token_id=EOS,
        pad_token_id=0,
        temperature=0.8,
        generator=torch.Generator().manual_seed(0),
    )
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    expected = (logits / 0.8).softmax(-1)
    counts = torch.bincount(out.completion_ids[:, 0], minlength=len(expected)).double()
    chi2, dof = float(((counts - 6000 * expected) ** 2 / (6000 * expected)).sum()), len(expected) - 1
    assert chi2 < dof + 5 * (2 * dof) ** 0.5, chi2


# --------------------------------------------------------------------------------------------------- GRPO
def grpo(tmp_path, tok, reward, run="run", workers=2, **kwargs):
    args = GRPOConfig(
        output_dir=str(tmp_path / run),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=16,
        max_steps=1,
        learning_rate=1e-3,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        log_completions=True,
        rollout_workers=workers,
    )
    return GRPOTrainer(
        chatty_model(tok, eos_bias=4.0),
        reward,
        args=args,
        processing_class=tok,
        train_dataset=toy.load_task("addition", kind="rl", n=8),
        **kwargs,
    )


def test_observation_tokens_get_no_loss_and_no_gradient(tmp_path, tok):
    """The loss of a multi-turn slice has zero gradient with respect to the log-probs of observation tokens, and
    equals the hand-computed REINFORCE value over the sampled tokens only (ratio 1: -sum(A) / sampled tokens)."""
    trainer = grpo(
        tmp_path, tok, lambda completion_ids, **k: [float(len(i) % 3) for i in completion_ids], env_factory=Counter
    )
    rows = trainer.train_dataset.to_list()[:2]
    batch = trainer.generate_and_score([rows[0], rows[0], rows[1], rows[1]], 0)[0]
    loss_mask, attention = batch.completion_mask, batch.attention_mask[:, -batch.completion_mask.shape[1] :]
    observation = attention.bool() & ~loss_mask.bool()
    assert observation.any() and loss_mask.any()
    loss, outputs = trainer.compute_loss(
        trainer.model, batch, return_outputs=True, num_items_in_batch=int(loss_mask.sum())
    )
    logps = outputs["logps"]
    logps.retain_grad()
    loss.backward()
    assert torch.all(logps.grad[observation] == 0) and torch.all(logps.grad[~loss_mask.bool()] == 0)
    expected = -(batch.advantages[:, None] * loss_mask).sum() / loss_mask.sum()
    assert torch.allclose(loss.detach(), expected, atol=1e-6)
    trainer.rollout_sampler.end()  # the runner's threads


def test_grpo_records_transcripts_columns_and_metrics(tmp_path, tok):
    seen = {}

    def judge(completions, transcript, env_reward, **kwargs):
        seen.update(completions=completions, transcript=transcript, env_reward=env_reward)
        return [1.0 if len(c) % 2 else 0.0 for c in completions]

    trainer = grpo(tmp_path, tok, [judge, environment_reward], env_factory=Counter)
    trainer.train()
    transcript = seen["transcript"][0]
    assert transcript[0]["role"] == "assistant" and seen["completions"][0] == transcript[-1]["content"]
    for reward, messages in zip(seen["env_reward"], seen["transcript"]):  # 0.5 per step; a cut last turn had none
        assert reward is None or reward / 0.5 in (sum(m["role"] == "assistant" for m in messages) - d for d in (0, 1))
    logged = trainer.state.log_history[0]
    assert 1 <= logged["rollouts/turns"] <= 3 and 0 <= logged["rollouts/truncated"] <= 1
    assert any(len(t) > 1 for t in seen["transcript"])  # some rollout went on after an observation
    records = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    assert len(records) == 4 and records[0]["transcript"] == seen["transcript"][0]
    assert {m["role"] for r in records for m in r["transcript"]} <= {"assistant", "user"}

    with_tools = grpo(tmp_path, tok, judge, run="tools", tools=[add])
    with_tools.train()
    logged = with_tools.state.log_history[0]
    assert {"tools/call_frequency", "tools/failed_calls", "tools/add/calls"} <= set(logged)


def test_environments_step_concurrently(tok):
    """Environments step concurrently: the first two steps of 8 rollouts meet at a barrier, which only threads
    running side by side can pass (the timeout only turns a sequential runner's hang into a failure)."""
    meet, lock, index = threading.Barrier(2, timeout=120), threading.Lock(), [0]

    class Meeting(Counter):
        def step(self, text):
            with lock:
                index[0] += 1
                first_two = index[0] <= 2
            if first_two:
                meet.wait()
            return "", None, True

    with RolloutRunner(tok, env_factory=Meeting, workers=8) as runner:
        runner.run(LocalEngine(chatty_model(tok, eos_bias=8.0)), [{"prompt": "1+1="}] * 8, settings(8, 8))
    assert index[0] >= 2 and not meet.broken
    assert runner.pool is None  # closed with the block


def test_a_timed_out_tool_call_does_not_block_and_closing_stops_the_tool_threads():
    """A call past its timeout becomes an error turn while its thread stays stuck; the next call runs on another
    thread; ``close()`` ends the idle threads and leaves the stuck one to end when its call returns."""
    release, started = threading.Event(), threading.Event()

    def stuck(x: int) -> int:
        """Waits until released."""
        started.set()
        release.wait()
        return x

    runner = RolloutRunner(toy.build_tokenizer(), tools=[add, stuck], tool_timeout=0.05)
    env = runner.new_environment()
    try:
        assert env.step("<call>stuck(1)</call>")[0] == "<result>error: stuck timed out after 0.05 s</result>"
        assert started.is_set()
        assert env.step("<call>add(2, 3)</call>")[0] == "<result>5</result>"  # not queued behind the stuck call
        assert len(runner.tool_pool.threads()) == 2
    finally:
        runner.close()
    alive = runner.tool_pool.threads()
    assert [t.name for t in alive] == ["treadle-tool-0"]  # only the stuck thread: the idle one was ended
    release.set()
    alive[0].join()  # it reads its stop signal once its call returns


def test_evaluation_rolls_out_through_the_environment(tmp_path, tok):
    """evaluate() with an environment samples num_generations_eval multi-turn rollouts per prompt at the evaluation
    temperature (and one greedy rollout per prompt with eval_greedy), so its rewards see transcripts, as training's
    do."""
    calls = []

    def judge(completions, transcript, **kwargs):
        calls.append(transcript)
        return [float(len(t)) for t in transcript]

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_generations=2,
        num_generations_eval=3,
        eval_pass_at_k=[1, 3],
        eval_greedy=True,
        eval_temperature=0.5,
        max_completion_length=16,
        max_steps=1,
        disable_tqdm=True,
        save_strategy="no",
        rollout_workers=2,
    )
    rows = toy.load_task("addition", kind="rl", n=8)
    trainer = GRPOTrainer(
        chatty_model(tok, eos_bias=4.0),
        judge,
        args=args,
        processing_class=tok,
        train_dataset=rows,
        eval_dataset=rows.select(range(2)),
        env_factory=Counter,
    )
    runner = trainer.rollout_sampler.runner
    run, settings = runner.run, []
    runner.run = lambda engine, rows, params, **k: settings.append(params) or run(engine, rows, params, **k)
    metrics = trainer.evaluate()
    sampled, greedy = calls
    assert [(s.num_generations, s.temperature, s.do_sample) for s in settings] == [(3, 0.5, True), (1, 1.0, False)]
    assert len(sampled) == 6 and len(greedy) == 2
    assert any(len(t) > 1 for t in sampled)  # the environment answered and the rollout went on
    assert metrics["eval_reward"] == pytest.approx(sum(len(t) for t in sampled) / 6)
    assert metrics["eval_greedy/reward"] == pytest.approx(sum(len(t) for t in greedy) / 2)
    trainer.rollout_sampler.end()  # the runner's threads


def test_rollout_workers_zero_steps_in_the_loop_and_a_seed_trains_the_same_weights(tmp_path, tok):
    """rollout_workers=0: no environment thread pool, the sampling loop waits for each step in turn (the step runs
    on a tool thread only so that env_timeout can cut it off: never two at once), and two runs of one seed train
    bit-identical weights; a negative count is refused."""
    threads, running, most = set(), [0], [0]

    class Recorder(Counter):
        def step(self, text):
            threads.add(threading.current_thread().name)
            running[0] += 1
            most[0] = max(most[0], running[0])
            try:
                return super().step(text)
            finally:
                running[0] -= 1

    weights = []
    for run in ("a", "b"):
        trainer = grpo(tmp_path, tok, environment_reward, run=run, workers=0, env_factory=Recorder)
        trainer.train()
        weights.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    assert most == [1] and all(name.startswith("treadle-tool-") for name in threads)
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    with pytest.raises(ValueError, match="rollout_workers must be an integer >= 0"):
        RolloutRunner(tok, env_factory=Counter, workers=-1)


def test_an_observation_longer_than_the_model_is_tokenised_without_a_tokenizer_warning():
    """A tool answer longer than the model's positions is the decode loop's to drop (it cannot fit in the rollout),
    not a tokenizer matter: transformers' "sequence length is longer than the specified maximum" warning stays
    silent (it used to appear once in every tools demo)."""
    import logging

    fresh = toy.build_tokenizer()  # the warning is given once per tokenizer
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        runner = RolloutRunner(fresh, env_factory=Counter, workers=0)
        ids = runner.observation_ids("9" * (fresh.model_max_length + 10), "user", chat=False)
    finally:
        logger.removeHandler(handler)
    assert len(ids) == fresh.model_max_length + 10
    assert not [m for m in seen if "longer than the specified maximum" in m]


def test_environment_reward_scores_an_unrewarded_rollout_zero_so_a_first_step_without_rewards_trains():
    """The docs' pattern reward_funcs=[environment_reward]: a rollout the environment never rewarded (env_reward
    None) scores 0.0, not None, so a batch in which no rollout earned anything is scored, not an error."""
    assert environment_reward(env_reward=[None, 0.5, 2.0, None], prompts=["p"] * 4) == [0.0, 0.5, 2.0, 0.0]


@pytest.mark.slow
def test_the_environment_example_runs_and_docs_agents_shows_its_code(tmp_path):
    """examples/environment.py (the complete env_factory example) trains two GRPO steps after a short warm start,
    its per-step rewards reach the logged reward, and docs/agents.md's environment blocks are its code verbatim."""
    root = Path(__file__).resolve().parents[2]
    source = (root / "examples" / "environment.py").read_text()
    page = (root / "docs" / "agents.md").read_text()
    for name in ("class GuessTheNumber:", "def main("):
        block = page[page.index(name) : page.index("```", page.index(name))].split("\n\n\nenv = ")[0]
        assert block.strip() in source, f"docs/agents.md's {name} block differs from examples/environment.py"
    example = runpy.run_path(str(root / "examples" / "environment.py"), run_name="example")
    env = example["GuessTheNumber"]()
    env.reset({"answer": "42"})
    assert env.step("50") == (" lower", pytest.approx(0.1 * 0.92), False) and env.step("x")[1] is None
    assert env.step("42") == ("", pytest.approx(1 / 3), True)
    trainer = example["main"](max_steps=2, output_dir=str(tmp_path), sft_steps=5)
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert trainer.state.global_step == 2 and len(logged) == 2
    assert all(h["rewards/environment_reward/mean"] == h["reward"] >= 0 for h in logged)
