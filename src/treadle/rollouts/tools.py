"""Tools as an environment (the contract in ``treadle.rollouts``): the call formats, the parsers of a model turn's
calls, and :class:`ToolEnvironment`, which runs them (each call with its deadline, ``rollouts.calls``) and answers
with their results."""

from __future__ import annotations

import ast
import inspect
import json
import re
from collections import Counter
from collections.abc import Callable, Sequence

from treadle.rollouts.calls import ToolError, ToolPool, call_with_timeout

__all__ = [
    "CALL_FORMATS",
    "ToolEnvironment",
    "check_json_schemas",
    "check_tool",
    "parse_json_call",
    "parse_tagged_call",
]

CALL_FORMATS = ("auto", "tagged", "json")


def check_tool(fn) -> str:
    """The name of tool ``fn``; raises TypeError naming it unless it is a named function with a docstring and
    a type annotation on every parameter (the model learns the call from them, as with TRL's tools)."""
    name = getattr(fn, "__name__", None)
    if not callable(fn) or not name or name == "<lambda>":
        raise TypeError(f"tool {fn!r} must be a named function (def name(...)), not a lambda or an object")
    if not inspect.getdoc(fn):
        raise TypeError(f"tool {name!r} has no docstring; add one that says what it does and what each argument is")
    missing = [
        p
        for p, v in inspect.signature(fn).parameters.items()
        if v.annotation is inspect.Parameter.empty and v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)
    ]
    if missing:
        raise TypeError(
            f"tool {name!r} has parameters without a type annotation: {missing}; annotate them "
            f"(e.g. def {name}({missing[0]}: int) -> int)"
        )
    return name


_TAGGED = re.compile(r"<call>(.*?)(?:</call>|$)", re.DOTALL)
_JSON = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_tagged_call(source: str) -> tuple[str, list, dict]:
    """``'add(1, b=2)'`` -> ``('add', [1], {'b': 2})``; raises ToolError when it is not NAME(literal args)."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError("not a call")
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        if len(kwargs) != len(node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            raise ValueError("no *args or **kwargs")
    except (SyntaxError, ValueError, TypeError) as e:
        raise ToolError(
            f"malformed call {source.strip()!r}: write <call>NAME(ARG, ..., KEY=VALUE)</call> with "
            f"Python literal arguments ({e})"
        ) from None
    return node.func.id, args, kwargs


def parse_json_call(source: str) -> tuple[str, list, dict]:
    """``'{"name": "add", "arguments": {"a": 1}}'`` -> ``('add', [], {'a': 1})``; ToolError when malformed."""
    try:
        call = json.loads(source)
        name, arguments = call["name"], call.get("arguments", {})
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise ValueError("name must be a string and arguments an object")
    except (ValueError, KeyError, TypeError) as e:
        raise ToolError(
            f'malformed call {source.strip()!r}: write <tool_call>{{"name": ..., "arguments": '
            f"{{...}}}}</tool_call> ({e})"
        ) from None
    return name, [], arguments


class ToolEnvironment:
    """The environment behind ``tools=``: runs the calls of each model turn and answers with their results.

    Counts ``calls``, ``failed_calls`` and ``calls_by_tool`` for the metrics. One instance per rollout. Calls
    with a timeout run in ``tool_pool`` (a RolloutRunner passes its own); without one, the environment owns a
    pool of its own, which ``close()`` closes."""

    role = "tool"

    def __init__(
        self,
        tools: Sequence[Callable],
        *,
        call_format: str = "tagged",
        max_tool_calling_iterations: int | None = None,
        tool_timeout: float | None = 10.0,
        tool_pool: ToolPool | None = None,
    ):
        if call_format not in ("tagged", "json"):
            raise ValueError(f"call_format must be 'tagged' or 'json', got {call_format!r}")
        self.tools = {check_tool(fn): fn for fn in tools}
        self.call_format, self.max_iterations, self.timeout = call_format, max_tool_calling_iterations, tool_timeout
        self.calls, self.failed_calls, self.iterations = 0, 0, 0
        self.calls_by_tool: Counter[str] = Counter()
        self.owns_pool = tool_pool is None
        self.tool_pool = tool_pool if tool_pool is not None else ToolPool()

    def reset(self, row: dict) -> str:
        return ""

    def close(self) -> None:
        """Close the tool pool if this environment owns it (a runner's pool is the runner's to close)."""
        if self.owns_pool:
            self.tool_pool.close()

    def step(self, text: str) -> tuple[str, float | None, bool]:
        found = (_TAGGED if self.call_format == "tagged" else _JSON).findall(text)
        if not found or (self.max_iterations is not None and self.iterations >= self.max_iterations):
            return "", None, True
        self.iterations += 1
        results = [self._run(source) for source in found]
        if self.call_format == "tagged":
            return "".join(f"<result>{r}</result>" for r in results), None, False
        return "\n".join(results), None, False

    def _run(self, source: str) -> str:
        self.calls += 1
        parse = parse_tagged_call if self.call_format == "tagged" else parse_json_call
        try:
            name, args, kwargs = parse(source)
            if name not in self.tools:
                raise ToolError(f"unknown tool {name!r}; the tools are {sorted(self.tools)}")
            self.calls_by_tool[name] += 1
            return str(call_with_timeout(self.tools[name], args, kwargs, self.timeout, self.tool_pool))
        except ToolError as e:
            self.failed_calls += 1
            return f"error: {e}"


def check_json_schemas(tools: list) -> None:
    """The chat template gets each tool as a JSON schema (transformers' ``get_json_schema``), which needs every
    argument described in the docstring; refuse a tool without, naming it."""
    from transformers.utils import get_json_schema

    for fn in tools:
        try:
            get_json_schema(fn)
        except Exception as e:
            raise TypeError(
                f"tool {fn.__name__!r} cannot be described to the chat template: {e}. Describe every "
                f"argument in an 'Args:' section of its docstring (Google style)"
            ) from None
