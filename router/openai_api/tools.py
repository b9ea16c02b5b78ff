"""Tool calling on the OpenAI chat API: what ``tools`` / ``tool_choice`` ask for, the
constraint that makes a forced call valid, and the parsers that find calls in output.

``tool_choice`` decides how the model's output becomes ``tool_calls``:

- ``none``: the tools are shown to the model (the chat template lists them) but its
  output is text, never parsed;
- ``auto`` (the default when tools are given): the output is parsed by the server's
  ``--tool-call-parser`` (``hermes``: ``<tool_call>{...}</tool_call>`` blocks;
  ``llama3_json``: an output that is one or more ``{"name", "parameters"}`` objects;
  ``pythonic``: an output that is a list of calls, ``[f(a=1), g()]``),
  which needs ``--enable-auto-tool-choice``, as in vLLM;
- ``required``: the structured-output engine constrains the output to a JSON array of
  one or more ``{"name", "parameters"}`` objects, each naming a given function with
  arguments valid under its schema (so even a small model makes valid calls);
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is
  constrained to that function's parameter schema and is its arguments.

Every parser is incremental: ``feed`` takes each new piece of text and returns what it
settled (content to show, tool-call deltas in OpenAI's streaming shape), ``finish``
flushes the rest. A whole answer is the same parser fed once, so streamed and whole
answers agree by construction. A call's arguments arrive whole, except for a named
function, whose arguments stream as the model writes them.
"""

from __future__ import annotations

import abc
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.protos import common_pb2
from tandem.router.openai_api.errors import Unsupported

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass
class CallDelta:
    """A piece of one tool call, as a streamed ``delta.tool_calls`` item: the first of a
    call carries its ``id`` and ``name``; ``arguments`` pieces concatenate."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function = {"name": self.name, **function}
        out["function"] = function
        return out


@dataclass
class Settled:
    """What a piece of output turned out to be."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add(self, other: Settled) -> Settled:
        self.content += other.content
        self.calls += other.calls
        return self


class OutputParser(abc.ABC):
    """Finds tool calls in one choice's output, piece by piece."""

    def __init__(self) -> None:
        self.num_calls = 0

    @abc.abstractmethod
    def feed(self, text: str) -> Settled:
        """What ``text``, the output's next piece, settles."""

    @abc.abstractmethod
    def finish(self) -> Settled:
        """What is left once the output has ended."""

    def _call(self, name: str, arguments: str) -> CallDelta:
        self.num_calls += 1
        return CallDelta(self.num_calls - 1, arguments, new_call_id(), name)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def assemble(deltas: Sequence[CallDelta]) -> list[dict[str, Any]]:
    """A message's ``tool_calls`` from its deltas, as a client accumulates a stream."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.setdefault(
            delta.index, {"id": None, "type": "function", "function": {"arguments": ""}}
        )
        if delta.id is not None:
            call["id"] = delta.id
        if delta.name is not None:
            call["function"] = {"name": delta.name, **call["function"]}
        call["function"]["arguments"] += delta.arguments
    return [calls[i] for i in sorted(calls)]


def _call_object(value: Any) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a decoded ``{"name", "arguments" | "parameters"}``
    object, or ``None`` when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that starts ``marker`` (kept back, as the
    marker may be arriving)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class HermesParser(OutputParser):
    """Calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks (Hermes, Qwen 2.5 / 3 and Tandem's own checkpoints). Text outside blocks is
    content; whitespace between a call and the text beside it is dropped; a block that
    does not hold a call object is left in the content as written."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._inside = False
        self._held_space = ""
        self._after_call = False

    def feed(self, text: str) -> Settled:
        self._pending += text
        out = Settled()
        while True:
            if self._inside:
                end = self._pending.find(self.CLOSE)
                if end < 0:
                    return out
                body = self._pending[:end]
                self._pending = self._pending[end + len(self.CLOSE) :]
                self._inside = False
                out.add(self._block(body))
                continue
            start = self._pending.find(self.OPEN)
            if start < 0:
                keep = _held_prefix(self._pending, self.OPEN)
                cut = len(self._pending) - keep
                out.content += self._text(self._pending[:cut])
                self._pending = self._pending[cut:]
                return out
            out.content += self._text(self._pending[:start], before_call=True)
            self._pending = self._pending[start + len(self.OPEN) :]
            self._inside = True

    def finish(self) -> Settled:
        out = Settled()
        if self._inside:  # a block the model did not close (it stopped after the JSON)
            self._inside = False
            out.add(self._block(self._pending, closed=False))
        else:
            out.content += self._text(self._pending)
        if not self.num_calls:
            out.content += self._held_space
        self._pending = self._held_space = ""
        return out

    def _block(self, body: str, closed: bool = True) -> Settled:
        try:
            call = _call_object(json.loads(body))
        except (ValueError, RecursionError):
            call = None
        if call is None:
            raw = self.OPEN + body + (self.CLOSE if closed else "")
            return Settled(self._text(raw))
        self._after_call = True
        return Settled(calls=[self._call(*call)])

    def _text(self, text: str, before_call: bool = False) -> str:
        """Content to show now: trailing whitespace is held back until text follows it
        (and dropped before a call); leading whitespace after a call is dropped."""
        text = self._held_space + text
        if self._after_call:
            text = text.lstrip()
        body = text.rstrip()
        self._held_space = "" if before_call else text[len(body) :]
        if body:
            self._after_call = False
        return body


class _OpeningParser(OutputParser):
    """Formats where the output's opening decides: calls from the first character on,
    or else plain content, passed through as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._state: Literal["undecided", "calls", "text"] = "undecided"

    @abc.abstractmethod
    def _opens(self, head: str) -> str | None:
        """For the output so far (leading whitespace stripped): the text the calls start
        with, ``""`` for content, ``None`` while it cannot tell yet."""

    def _more_calls(self, text: str) -> Settled:
        """What a new piece settles once the output is calls (default: wait for the end)."""
        return Settled()

    def feed(self, text: str) -> Settled:
        self._pending += text
        if self._state == "undecided":
            calls = self._opens(self._pending.lstrip())
            if calls is None:
                return Settled()
            if calls:
                self._state, self._pending = "calls", calls
            else:
                self._state = "text"
        if self._state == "text":
            out, self._pending = Settled(self._pending), ""
            return out
        return self._more_calls(text)


class Llama3JsonParser(_OpeningParser):
    """Llama 3.1+ JSON calls: an output that starts with ``{`` (after Llama's
    ``<|python_tag|>`` when special tokens are kept) is one or more
    ``{"name": ..., "parameters": {...}}`` objects separated by ``;``. An output that
    starts otherwise is content; so is whatever follows the last object that decodes."""

    PYTHON_TAG = "<|python_tag|>"

    def _opens(self, head: str) -> str | None:
        if head.startswith(self.PYTHON_TAG):
            head = head[len(self.PYTHON_TAG) :].lstrip()
        elif self.PYTHON_TAG.startswith(head):
            return None  # nothing yet, or what may be the tag arriving
        if not head:
            return None
        return head if head.startswith("{") else ""

    def _more_calls(self, text: str) -> Settled:
        return self._calls(final=False) if "}" in text else Settled()

    def finish(self) -> Settled:
        out = self._calls(final=True) if self._state == "calls" else Settled()
        out.content += self._pending
        self._pending = ""
        return out

    def _calls(self, final: bool) -> Settled:
        out = Settled()
        decoder = json.JSONDecoder()
        while True:
            rest = self._pending.lstrip().lstrip(";").lstrip()
            if not rest:
                self._pending = ""
                return out
            try:
                value, end = decoder.raw_decode(rest)
            except (ValueError, RecursionError):  # not JSON (yet), or nested past the stack
                if final:
                    self._pending = rest
                return out  # not complete yet (or, at the end, text)
            call = _call_object(value)
            if call is None:  # JSON, but not a call: the rest is text
                self._state, self._pending = "text", ""
                out.content += rest
                return out
            out.calls.append(self._call(*call))
            self._pending = rest[end:]


class ForcedCallsParser(OutputParser):
    """``tool_choice: required``: the output is constrained to a JSON array of
    ``{"name", "parameters"}`` objects; each is a call as soon as it is complete."""

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._opened = False

    def feed(self, text: str) -> Settled:
        self._pending += text
        out = Settled()
        decoder = json.JSONDecoder()
        while "}" in self._pending:
            rest = self._pending.lstrip()
            if not self._opened:
                if not rest.startswith("["):
                    return out
                self._opened, rest = True, rest[1:]
            rest = rest.lstrip().lstrip(",").lstrip()
            try:
                value, end = decoder.raw_decode(rest)
            except (ValueError, RecursionError):  # not JSON (yet), or nested past the stack
                self._pending = rest
                return out
            call = _call_object(value)
            if call is not None:
                out.calls.append(self._call(*call))
            self._pending = rest[end:]
        return out

    def finish(self) -> Settled:
        rest = self._pending.strip().lstrip(",").lstrip()
        self._pending = ""
        # The closing bracket; anything else is output the length limit cut short.
        return Settled("" if rest in ("]", "") and self.num_calls else rest)


class NamedCallParser(OutputParser):
    """A named ``tool_choice``: the whole output is the function's arguments, streamed
    as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, text: str) -> Settled:
        if not self.num_calls:
            return Settled(calls=[self._call(self._name, text)])
        return Settled(calls=[CallDelta(0, text)]) if text else Settled()

    def finish(self) -> Settled:
        return Settled() if self.num_calls else Settled(calls=[self._call(self._name, "")])


class PythonicParser(_OpeningParser):
    """Calls written as a Python list of calls with literal keyword arguments,
    ``[get_weather(city="Paris", days=2), now()]`` (Llama 3.2 / 4's pythonic format).
    An output that starts with ``[`` is held until it ends and read with ``ast`` (never
    evaluated); one that starts otherwise, or does not read as such a list, is content."""

    def _opens(self, head: str) -> str | None:
        if not head:
            return None
        return head if head.startswith("[") else ""

    def finish(self) -> Settled:
        text, self._pending = self._pending, ""
        if self._state != "calls":
            return Settled(text)
        calls = _pythonic_calls(text.strip())
        if calls is None:
            return Settled(text)
        return Settled(calls=[self._call(name, arguments) for name, arguments in calls])


def _pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """``(name, arguments JSON)`` of each call in ``[f(a=1), g()]``, or ``None``."""
    import ast

    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        try:
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes, ...)
            return None
    return calls


PARSERS: dict[str, type[OutputParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
}
"""``--tool-call-parser`` names (vLLM's) and the parsers they select."""


@dataclass(frozen=True)
class ToolUse:
    """What one chat request asks of its tools."""

    mode: ToolMode
    tools: tuple[Mapping[str, Any], ...]
    function: str | None = None
    parallel: bool = True
    parser_name: str | None = None

    @classmethod
    def of(
        cls,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: str | Mapping[str, Any] | None,
        parallel: bool | None,
        auto_parser: str | None,
    ) -> ToolUse | None:
        """``None`` when the request names no tools; ``Unsupported`` (naming the field)
        for a choice the request or the server cannot honour."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise Unsupported("tool_choice", "tool_choice needs tools")
            return None
        names = _function_names(tools)
        function = None
        if tool_choice is None:
            mode: ToolMode = "auto"
        elif isinstance(tool_choice, str):
            if tool_choice not in ("none", "auto", "required"):
                raise Unsupported(
                    "tool_choice",
                    f"tool_choice must be none, auto, required or a named function, got "
                    f"{tool_choice!r}",
                )
            mode = tool_choice  # type: ignore[assignment]
        else:
            chosen = tool_choice.get("function")
            function = chosen.get("name") if isinstance(chosen, Mapping) else None
            if tool_choice.get("type") != "function" or not isinstance(function, str):
                raise Unsupported(
                    "tool_choice",
                    'a named tool_choice is {"type": "function", "function": {"name": ...}}',
                )
            if function not in names:
                raise Unsupported(
                    "tool_choice.function.name",
                    f"tool_choice names {function!r}, which is not among the tools "
                    f"({', '.join(names)})",
                )
            mode = "named"
        if mode == "auto" and auto_parser is None:
            raise Unsupported(
                "tool_choice",
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                'and --tool-call-parser; send tool_choice "required", "none" or a named '
                "function instead",
            )
        return cls(mode, tuple(tools), function, parallel is not False, auto_parser)

    def constraint(self) -> common_pb2.StructuredOutput | None:
        """The structured output a forced call needs (``None`` for none / auto)."""
        if self.mode == "named":
            schema = self._parameters(self.function)
            return common_pb2.StructuredOutput(json_schema=json.dumps(schema))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": self._parameters(name),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name in _function_names(self.tools)
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return common_pb2.StructuredOutput(json_schema=json.dumps(schema))

    def parser(self) -> OutputParser | None:
        """A fresh parser for one choice's output (``None``: the output is content)."""
        if self.mode == "named":
            assert self.function is not None
            return NamedCallParser(self.function)
        if self.mode == "required":
            return ForcedCallsParser()
        if self.mode == "auto":
            assert self.parser_name is not None
            return PARSERS[self.parser_name]()
        return None

    def finish_reason(self, finish: str | None, num_calls: int) -> str | None:
        """OpenAI's: ``tool_calls`` when the model chose to call (a named function is
        the caller's choice, so it stays ``stop``)."""
        if finish == "stop" and num_calls and self.mode != "named":
            return "tool_calls"
        return finish

    def _parameters(self, name: str | None) -> dict[str, Any]:
        for tool in self.tools:
            function = tool["function"]
            if function["name"] == name:
                parameters = function.get("parameters")
                return parameters if isinstance(parameters, dict) else {"type": "object"}
        raise KeyError(name)


def _function_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if tool.get("type", "function") != "function" or not isinstance(function, Mapping):
            raise Unsupported(
                f"tools[{i}]", f'tools[{i}] must be {{"type": "function", "function": {{...}}}}'
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise Unsupported(
                f"tools[{i}].function.name", f"tools[{i}].function.name must be a name"
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise Unsupported(
                f"tools[{i}].function.parameters",
                f"tools[{i}].function.parameters must be a JSON schema object",
            )
        names.append(name)
    return names
