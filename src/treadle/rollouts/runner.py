"""Running multi-turn rollouts (the contract in ``treadle.rollouts``): :class:`RolloutRunner` rolls out one
environment per row through a rollout engine's ``generate_turns``, owns the threads the environments step in, and
reports what each rollout added; the metrics of a batch."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from treadle import distributed as dist
from treadle.engines.base import RolloutEngine
from treadle.generation.sampling import SamplingParams
from treadle.generation.single import distinct_prompts
from treadle.generation.turns import MultiTurnOutput
from treadle.rollouts.calls import GuardedEnvironment, ToolPool
from treadle.rollouts.tools import CALL_FORMATS, ToolEnvironment, check_json_schemas, check_tool
from treadle.text import cut_prompts, encode_prompts, eos_ids, is_conversation

__all__ = ["Environment", "RolloutOutput", "RolloutRunner", "environment_reward", "rollout_metrics"]


class Environment(Protocol):
    """What a multi-turn environment provides; see the module docstring for the contract."""

    def reset(self, row: dict) -> str: ...

    def step(self, text: str) -> tuple[str, float | None, bool]: ...


def environment_reward(env_reward: list, **kwargs) -> list[float]:
    """A reward function that returns the environment's summed per-step rewards (the ``env_reward`` column),
    0.0 for a rollout the environment never rewarded (it ran out of turns or was cut off: it earned nothing).

    Not None: as the only reward function, None for every rollout of an untrained model (the usual first step)
    would leave the completions unscored, an error. Read the ``env_reward`` column in a function of your own to
    tell "earned nothing" from "no opinion".
    """
    return [0.0 if reward is None else reward for reward in env_reward]


# ---------------------------------------------------------------------------------------------------------
# Running rollouts
# ---------------------------------------------------------------------------------------------------------
@dataclass
class RolloutOutput:
    """One batch of rollouts, row i from ``rows[i]``; ``generation`` holds the tensors (see MultiTurnOutput)."""

    generation: MultiTurnOutput
    completions: list  # what reward functions get as ``completions`` (see the module docstring)
    completion_lists: list[list[int]]  # every completion token of each row, observations included
    transcripts: list[list[dict[str, str]]]  # the messages each rollout added after the prompt
    env_rewards: list[float | None]  # summed per-step environment rewards, None when there were none
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)  # (sum, count) per metric


class RolloutRunner:
    """Runs batches of multi-turn rollouts for a tokenizer and either ``tools`` or an ``env_factory``; ``run`` is
    the whole rollout of a batch of dataset rows.

    Owns its threads: the pool the environments step in (``workers`` threads, started by the first ``run``) and
    the :class:`ToolPool` its tool calls run in. ``close()`` (or leaving a ``with`` block) stops both; a ``run``
    after ``close()`` starts them again. GRPOTrainer closes its runner at the end of ``train`` and in ``close()``."""

    def __init__(
        self,
        tokenizer,
        *,
        tools: Sequence[Callable] | None = None,
        env_factory=None,
        call_format: str = "auto",
        max_tool_calling_iterations: int | None = None,
        tool_timeout: float | None = 10.0,
        workers: int = 8,
        env_timeout: float | None = 60.0,
    ):
        if (tools is None) == (env_factory is None):
            raise ValueError(
                "pass either tools=[functions] or env_factory=<callable returning an Environment>, "
                "not both (an environment can call your functions itself) and not neither"
            )
        if call_format not in CALL_FORMATS:
            raise ValueError(f"call_format must be one of {CALL_FORMATS}, got {call_format!r}")
        if tools is not None and (isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence) or not tools):
            raise TypeError(f"tools must be a non-empty list of functions, got {tools!r}")
        if env_factory is not None and not callable(env_factory):
            raise TypeError(f"env_factory must be a callable that returns a new environment, got {env_factory!r}")
        if not isinstance(workers, int) or workers < 0:
            raise ValueError(
                f"rollout_workers must be an integer >= 0 (0: step the environments in the sampling "
                f"loop), got {workers!r}"
            )
        for setting, seconds in (("tool_timeout", tool_timeout), ("env_timeout", env_timeout)):
            if seconds is not None and not seconds > 0:
                raise ValueError(f"{setting} must be > 0 seconds (or None for no limit), got {seconds!r}")
        self.tokenizer, self.env_factory = tokenizer, env_factory
        self.tools = list(tools or [])
        self.tool_names = [check_tool(fn) for fn in self.tools]  # refused here, naming the tool
        template = getattr(tokenizer, "chat_template", None) or ""
        self.call_format = (
            call_format if call_format != "auto" else ("json" if "<tool_call>" in template else "tagged")
        )
        if self.call_format == "json":
            check_json_schemas(self.tools)
        self.tool_options = dict(
            call_format=self.call_format,
            max_tool_calling_iterations=max_tool_calling_iterations,
            tool_timeout=tool_timeout,
        )
        self.workers, self.pool, self.env_timeout = workers, None, env_timeout
        self.prompt_cut_noted = False  # text.cut_prompts' note is shown once
        self.tool_pool = ToolPool()  # tool calls and environment calls run on its threads, with their deadlines

    def __enter__(self) -> RolloutRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _environment_pool(self) -> ThreadPoolExecutor | None:
        if self.pool is None and self.workers:
            self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="treadle-env")
        return self.pool

    def new_environment(self):
        """A fresh environment for one rollout."""
        if self.env_factory is not None:  # seen through its contract: a deadline, its answers' types checked
            return GuardedEnvironment(self.env_factory(), self.env_timeout, self.tool_pool)
        return ToolEnvironment(self.tools, tool_pool=self.tool_pool, **self.tool_options)

    def encode_prompts(self, prompts: list, max_prompt_length: int | None) -> list[list[int]]:
        """Token ids of each prompt, cut to its last ``max_prompt_length`` (``text.cut_prompts``: a note on stderr
        the first time one is); chat prompts see the tools' schemas
        when the call format is the chat template's (``"json"``)."""
        if self.call_format == "json" and self.tools and all(is_conversation(p) for p in prompts):
            texts = [
                self.tokenizer.apply_chat_template(
                    list(p), tools=self.tools, add_generation_prompt=True, tokenize=False
                )
                for p in prompts
            ]
            ids = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        else:
            ids = encode_prompts(self.tokenizer, prompts)
        ids, note = cut_prompts(self.tokenizer, ids, max_prompt_length)
        if note and not self.prompt_cut_noted and dist.is_main_process():
            print(f"{note}; shown once", file=sys.stderr)
        self.prompt_cut_noted |= note is not None
        return ids

    def observation_ids(self, text: str, role: str, chat: bool) -> list[int]:
        """The tokens an observation adds: its text (text prompts), or a ``role`` turn rendered by the chat
        template up to the next generation prompt (chat prompts)."""
        # verbose=False: an observation longer than the model's positions is not a tokenizer matter; the decode
        # loop drops one that does not fit in max_completion_length
        if not chat:
            return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]) if text else []
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        before = self.tokenizer.apply_chat_template(base, tokenize=False)
        after = self.tokenizer.apply_chat_template(
            base + [{"role": role, "content": text}], tokenize=False, add_generation_prompt=True
        )
        if not after.startswith(before):
            raise ValueError(
                f"the chat template does not render a {role!r} turn by appending to the conversation "
                f"({before!r} is not a prefix of {after!r}); give the rows as text prompts"
            )
        return list(self.tokenizer(after[len(before) :], add_special_tokens=False, verbose=False)["input_ids"])

    def run(
        self,
        engine: RolloutEngine,
        rows: list[dict],
        params: SamplingParams,
        *,
        max_prompt_length: int | None = None,
        generator: torch.Generator | None = None,
    ) -> RolloutOutput:
        """Roll out one environment per row with the sampling settings ``params`` (rows holding the same prompt
        ``params.num_generations`` times in a row are sampled as distinct prompts x G, else each row once), sampled
        by ``engine.generate_turns`` (the own sampler keeps each row's KV cache across turns, or re-prefills the
        transcript each turn: ``engines.LocalEngine``)."""
        pool = self._environment_pool()
        envs = [self.new_environment() for _ in rows]
        firsts = list((pool.map if pool else map)(lambda env, row: env.reset(row), envs, rows))
        prompts = [_with_first_observation(row["prompt"], first) for row, first in zip(rows, firsts)]
        chat = [is_conversation(p) for p in prompts]
        prompt_ids = self.encode_prompts(prompts, max_prompt_length)
        distinct, group = distinct_prompts(prompt_ids, params.num_generations)
        observations: list[list[str]] = [[] for _ in rows]
        rewards: list[list[float]] = [[] for _ in rows]

        def step(row: int, turn_ids: list[int]) -> list[int] | None:
            text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
            observation, reward, done = envs[row].step(text)  # GuardedEnvironment names a broken environment
            if reward is not None:
                rewards[row].append(float(reward))
            if done:
                return None
            observations[row].append(observation)
            return self.observation_ids(observation, getattr(envs[row], "role", "user"), chat[row])

        params = dataclasses.replace(params, num_generations=group)
        respond = step if pool is None else (lambda row, turn_ids: pool.submit(step, row, turn_ids))
        generation = engine.generate_turns(distinct, respond, params, generator=generator)
        return self._output(generation, envs, chat, observations, rewards)

    def _output(
        self,
        generation: MultiTurnOutput,
        envs: list,
        chat: list[bool],
        observations: list[list[str]],
        rewards: list[list[float]],
    ) -> RolloutOutput:
        eos = set(eos_ids(self.tokenizer.eos_token_id))
        lengths = generation.completion_mask.sum(dim=1).tolist()
        completion_lists = [ids[:n] for ids, n in zip(generation.completion_ids.tolist(), lengths)]
        sampled = generation.sampled_mask.tolist()
        transcripts, completions = [], []
        for row, ids in enumerate(completion_lists):
            turns = _model_turns(ids, sampled[row], eos)
            texts = self.tokenizer.batch_decode(turns, skip_special_tokens=True) if turns else [""]
            role = getattr(envs[row], "role", "user")
            messages = []
            for i, text in enumerate(texts):
                messages.append({"role": "assistant", "content": text})
                if i + 1 < len(texts):  # the observation after turn i is in the context iff a turn i+1 exists
                    messages.append({"role": role, "content": observations[row][i]})
            transcripts.append(messages)
            completions.append(messages if chat[row] else texts[-1])
        env_rewards = [sum(r) if r else None for r in rewards]
        return RolloutOutput(
            generation=generation,
            completions=completions,
            completion_lists=completion_lists,
            transcripts=transcripts,
            env_rewards=env_rewards,
            metrics=rollout_metrics(transcripts, generation.is_truncated.tolist(), envs, self.tool_names),
        )

    def close(self) -> None:
        """Stop the environment threads (waiting for steps in flight) and the tool threads (a tool still running
        past its timeout is left to finish on its own daemon thread, see :class:`ToolPool`)."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self.tool_pool.close()


def _with_first_observation(prompt, observation: str):
    """The prompt the model sees: text + the observation, or chat messages with it appended to the last one."""
    if not observation:
        return prompt
    if is_conversation(prompt):
        messages = [dict(m) for m in prompt]
        messages[-1]["content"] = messages[-1]["content"] + observation
        return messages
    return prompt + observation


def _model_turns(ids: list[int], sampled: list[int], eos: set[int]) -> list[list[int]]:
    """The model's turns in a completion: maximal runs of sampled tokens, each ending at (and keeping) an EOS."""
    turns: list[list[int]] = []
    current: list[int] | None = None
    for token, is_sampled in zip(ids, sampled):
        if not is_sampled:
            current = None
            continue
        if current is None:
            current = []
            turns.append(current)
        current.append(token)
        if token in eos:
            current = None
    return turns


def rollout_metrics(
    transcripts: list[list[dict]], truncated: list[bool], envs: list, tool_names: Sequence[str] = ()
) -> dict[str, tuple[float, float]]:
    """``{name: (sum, count)}`` of one batch: model turns per rollout, truncated fraction and, for tools, calls
    per rollout (``tools/call_frequency``, TRL's name), failed calls per rollout, failed / all calls
    (``tools/failure_frequency``, TRL's name) and each tool's calls per rollout."""
    n = len(transcripts)
    record = {
        "rollouts/turns": (sum(sum(m["role"] == "assistant" for m in t) for t in transcripts), n),
        "rollouts/truncated": (sum(truncated), n),
    }
    guarded = [e for e in envs if isinstance(e, GuardedEnvironment)]
    if guarded:
        record["rollouts/env_timeouts"] = (sum(e.timed_out for e in guarded), n)
    tool_envs = [e for e in envs if isinstance(e, ToolEnvironment)]
    if tool_envs:
        calls, failed = sum(e.calls for e in tool_envs), sum(e.failed_calls for e in tool_envs)
        record.update(
            {
                "tools/call_frequency": (calls, n),
                "tools/failed_calls": (failed, n),
                "tools/failure_frequency": (failed, calls),
            }
        )
        for name in tool_names:
            record[f"tools/{name}/calls"] = (sum(e.calls_by_tool[name] for e in tool_envs), n)
    return record
