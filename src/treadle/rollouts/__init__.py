"""Multi-turn rollouts for online RL: the model talks to an environment (or calls tools) over several turns.

Contract. An **environment** is any object with two methods (:class:`Environment`)::

    reset(row: dict) -> str                                  # the first observation, appended to the prompt
    step(text: str) -> (observation: str, reward: float | None, done: bool)

One instance serves one rollout (``env_factory()`` is called once per rollout). A rollout is: the prompt (plus the
first observation), then model turns that each end at EOS; after each turn ``step`` gets the turn's text (special
tokens dropped) and answers with an observation that is appended as a turn of ``env.role`` (default ``"user"``), a
reward (summed over the rollout into the ``env_reward`` column; None: no opinion) and whether the rollout is over. It
also ends when ``max_completion_length`` tokens (sampled plus observation tokens) are used up: then it is *truncated*,
and an observation that does not fit is dropped. Each ``reset`` / ``step`` runs with a deadline, ``env_timeout``
seconds (``treadle.rollouts.calls.GuardedEnvironment``): past it the rollout ends there, unanswered, with a warning
naming the environment; what they return is checked against the contract above.

**Threads.** The environments of a batch run concurrently in a thread pool (``rollout_workers`` threads):
the steps of one rollout never overlap, but steps of *different* instances do, so whatever instances share
(a module-level cache, a client, a tool's global state) must be thread-safe. Sampling goes on meanwhile: a
rollout waiting for its environment sits out while the others keep sampling (the rollout engine's
``generate_turns``: the own sampler's ``generation.turns.sample_turns``).
Each row's random draws are keyed by its own position, so the same seed samples the same tokens whenever its
environment answers; but which rows share a forward then depends on the threads' timing, and a batched forward
can differ in the last bit with its batch, which can flip a later draw. ``rollout_workers=0`` steps the
environments in the sampling loop instead: the same seed gives the same rollouts bit for bit (right for fast
tools such as a calculator; a slow environment then holds up every row).

**Tools** are built on it: :class:`ToolEnvironment` parses the calls in a model turn, runs the functions and
answers with their results as a ``"tool"`` turn; a turn without a call ends the rollout. A tool is a plain
Python function with type-annotated parameters and a docstring (refused at construction otherwise). Call
formats (:data:`CALL_FORMATS`):

- ``"tagged"`` (the toy tokenizer, and any tokenizer without a tool-call chat template)::

      model:  <call>add(123, 456)</call></s>        NAME(ARGS), the arguments Python literals, keywords allowed
      tool:   <result>579</result>                  or <result>error: ...</result>

- ``"json"`` (chat templates in the Hermes/Qwen style, chosen by ``"auto"`` when the template mentions
  ``<tool_call>``): ``<tool_call>{"name": "add", "arguments": {"a": 123, "b": 456}}</tool_call>``, the result
  rendered by the chat template as a ``{"role": "tool"}`` message, the tools' schemas passed to the template.

A malformed call, an unknown tool, wrong arguments, a tool that raises (``SystemExit`` too) or runs past
``tool_timeout`` seconds (``None``: no limit, a warning after a minute; ``treadle.rollouts.calls``) all become a tool
turn with the error text (the model can learn from it) and count as failed calls; none crashes training. After
``max_tool_calling_iterations`` turns with calls (TRL's name and meaning) the next call ends the rollout unanswered.

**Training on the right tokens.** Observation tokens are in the context but not trained on: the rollout's
``sampled_mask`` is 1 exactly on the tokens the model sampled, and ``GRPOTrainer`` uses it as its
``completion_mask``, so the loss, the old / reference log-probs' use and the entropy cover only those.

**What reward functions get.** ``completions`` is the last model turn's text (for chat prompts, the list of
messages the rollout added, as TRL gives), ``completion_ids`` every completion token (observations included),
``transcript`` the messages (``role``, ``content``) the rollout added after the prompt, ``env_reward`` the
environment's summed reward (None when it gave none); :func:`environment_reward` is the reward function that
returns it (0.0 where it gave none).
"""

from treadle.rollouts.calls import (
    EnvironmentContractError,
    GuardedEnvironment,
    SlowCallWarning,
    ToolError,
    ToolPool,
    call_with_timeout,
)
from treadle.rollouts.runner import Environment, RolloutOutput, RolloutRunner, environment_reward, rollout_metrics
from treadle.rollouts.tools import CALL_FORMATS, ToolEnvironment, check_tool, parse_json_call, parse_tagged_call

__all__ = [
    "CALL_FORMATS",
    "Environment",
    "EnvironmentContractError",
    "GuardedEnvironment",
    "RolloutOutput",
    "RolloutRunner",
    "SlowCallWarning",
    "ToolEnvironment",
    "ToolError",
    "ToolPool",
    "call_with_timeout",
    "check_tool",
    "environment_reward",
    "parse_json_call",
    "parse_tagged_call",
    "rollout_metrics",
]
