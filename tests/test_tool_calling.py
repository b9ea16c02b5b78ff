"""Tool calling's parts without a cluster: the output parsers (whole and fed in any
pieces alike), what ``tool_choice`` asks for, and the schemas forced calls are held to.
The cluster-level behaviour (the real ``openai`` client, streamed and not) is in
``test_openai_api.py``."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.router.openai_api.errors import Unsupported
from tandem.router.openai_api.tools import (
    ForcedCallsParser,
    HermesParser,
    Llama3JsonParser,
    NamedCallParser,
    OutputParser,
    PythonicParser,
    Settled,
    ToolUse,
    assemble,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


def _parse(parser: OutputParser, text: str, cuts: list[int] = ()) -> tuple[str, list[dict]]:
    """Content and calls of ``text`` fed in the pieces ``cuts`` makes."""
    out, start = Settled(), 0
    for end in [*sorted(cuts), len(text)]:
        out.add(parser.feed(text[start:end]))
        start = end
    out.add(parser.finish())
    calls = [
        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
        for c in assemble(out.calls)
    ]
    assert all(c["id"].startswith("call_") for c in assemble(out.calls))
    return out.content, calls


HERMES_CASES = [
    (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n',
        "Checking.",
        [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}],
    ),
    # no calls: the text exactly as written, trailing spaces and a half marker included
    ("Just text.  \n", "Just text.  \n", []),
    ("a <tool_ca", "a <tool_ca", []),
    # a block that is not a call stays in the content
    ("<tool_call>{not json}</tool_call> ok", "<tool_call>{not json}</tool_call> ok", []),
    # a block the model did not close still counts when it holds a whole call
    ('<tool_call>{"name": "now", "arguments": {}}', "", [{"name": "now", "arguments": {}}]),
    # arguments written as JSON text
    ('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', "",
     [{"name": "now", "arguments": {}}]),
]  # fmt: skip
LLAMA_CASES = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", '
        '"parameters": {}}',
        "",
        [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}],
    ),
    ('<|python_tag|>{"name": "now", "parameters": {}}', "", [{"name": "now", "arguments": {}}]),
    ("The answer is {1}.", "The answer is {1}.", []),
    ('{"name": "now", "param', '{"name": "now", "param', []),  # cut short: text
    ('{"x": 1} and more', '{"x": 1} and more', []),  # JSON, but not a call
]  # fmt: skip


PYTHONIC_CASES = [
    (
        '[get_weather(city="Paris", days=2), now()]',
        "",
        [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
         {"name": "now", "arguments": {}}],
    ),
    ("[f(x=[1, {'a': None}], y=True)]", "",
     [{"name": "f", "arguments": {"x": [1, {"a": None}], "y": True}}]),
    ("Not a call.", "Not a call.", []),
    ("[1, 2]", "[1, 2]", []),  # a list, but not of calls
    ("[f(x=open('/etc/passwd'))]", "[f(x=open('/etc/passwd'))]", []),  # never evaluated
    ("[f(1)]", "[f(1)]", []),  # positional: no name to give it
    ('[f(x="unclosed)]', '[f(x="unclosed)]', []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), PYTHONIC_CASES)
def test_pythonic_parser(text: str, content: str, calls: list[dict]) -> None:
    assert _parse(PythonicParser(), text) == (content, calls)


def test_the_cli_offers_every_parser() -> None:
    from tandem.cli.router import TOOL_CALL_PARSERS
    from tandem.router.openai_api.tools import PARSERS

    assert tuple(PARSERS) == TOOL_CALL_PARSERS


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_parser(text: str, content: str, calls: list[dict]) -> None:
    assert _parse(HermesParser(), text) == (content, calls)


def test_output_nested_past_the_stack_is_content() -> None:
    deep = "[" * 50_000 + "]" * 50_000
    for make, text in (
        (HermesParser, f"<tool_call>{deep}</tool_call>"),
        (Llama3JsonParser, "{" + '"a":' * 1 + deep + "}"),
        (ForcedCallsParser, f'[{{"name": "f", "parameters": {deep}}}]'),
    ):
        content, calls = _parse(make(), text)
        assert calls == [] and content, make


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json_parser(text: str, content: str, calls: list[dict]) -> None:
    assert _parse(Llama3JsonParser(), text) == (content, calls)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_parsers_settle_the_same_whatever_the_pieces(data: st.DataObject) -> None:
    """A stream's pieces end anywhere (tokens split markers and JSON): the content and
    calls are those of the whole text."""
    kind, text = data.draw(
        st.sampled_from(
            [("hermes", t) for t, _, _ in HERMES_CASES]
            + [("llama", t) for t, _, _ in LLAMA_CASES]
            + [("pythonic", t) for t, _, _ in PYTHONIC_CASES]
            + [("forced", '[{"name": "a", "parameters": {"x": [1, {"y": "}"}]}}, '
                          '{"name": "b", "parameters": {}}]')]
        )
    )  # fmt: skip
    make = {
        "hermes": HermesParser,
        "llama": Llama3JsonParser,
        "pythonic": PythonicParser,
        "forced": ForcedCallsParser,
    }[kind]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12, unique=True))
    assert _parse(make(), text, cuts) == _parse(make(), text)


def test_forced_calls_parser_reads_the_constrained_array() -> None:
    text = '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}]'
    content, calls = _parse(ForcedCallsParser(), text, [5, 30])
    assert (content, calls) == (
        "",
        [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}],
    )
    # cut short by the length limit: the calls completed, the rest as content
    content, calls = _parse(ForcedCallsParser(), text[:-1] + ', {"name": "no')
    assert [c["name"] for c in calls] == ["get_weather"] and content == '{"name": "no'


def test_named_call_streams_its_arguments() -> None:
    parser = NamedCallParser("get_weather")
    first = parser.feed('{"city"')
    rest = parser.feed(': "Paris"}')
    end = parser.finish()
    assert first.calls[0].id and first.calls[0].name == "get_weather"
    assert rest.calls[0].id is None and rest.calls[0].name is None  # continuation pieces
    (call,) = assemble(first.calls + rest.calls + end.calls)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.mark.parametrize(
    ("choice", "mode"),
    [(None, "auto"), ("auto", "auto"), ("none", "none"), ("required", "required"),
     ({"type": "function", "function": {"name": "now"}}, "named")],
)  # fmt: skip
def test_tool_choice_modes(choice, mode: str) -> None:
    use = ToolUse.of([WEATHER, NOW], choice, None, "hermes")
    assert use is not None and use.mode == mode
    assert (use.constraint() is None) == (mode in ("auto", "none"))
    assert (use.parser() is None) == (mode == "none")


@pytest.mark.parametrize(
    ("tools", "choice", "parser", "param"),
    [
        ([WEATHER], "auto", None, "tool_choice"),  # auto needs the server's parser
        ([WEATHER], None, None, "tool_choice"),  # ... and is the default with tools
        (None, "required", "hermes", "tool_choice"),
        ([WEATHER], "sometimes", "hermes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "hermes",
         "tool_choice.function.name"),
        ([WEATHER], {"type": "function"}, "hermes", "tool_choice"),
        ([{"type": "retrieval"}], "required", "hermes", "tools[0]"),
        ([{"type": "function", "function": {"name": ""}}], "required", "hermes",
         "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "required",
         "hermes", "tools[0].function.parameters"),
    ],
)  # fmt: skip
def test_tool_choice_errors_name_the_field(tools, choice, parser, param: str) -> None:
    with pytest.raises(Unsupported) as err:
        ToolUse.of(tools, choice, None, parser)
    assert err.value.param == param
    assert (
        ToolUse.of(None, None, None, None) is None and ToolUse.of(None, "none", None, None) is None
    )


def test_required_schema_holds_calls_to_the_given_functions() -> None:
    for parallel, allowed in ((True, 2), (False, 1)):
        use = ToolUse.of([WEATHER, NOW], "required", parallel, None)
        schema = json.loads(use.constraint().json_schema)
        jsonschema.validate([{"name": "now", "parameters": {}}] * allowed, schema)
        bad = [
            [],
            [{"name": "now", "parameters": {}}] * (allowed + 1) if not parallel else [{}],
            [{"name": "sleep", "parameters": {}}],
            [{"name": "get_weather", "parameters": {"town": "Paris"}}],
        ]
        for value in bad:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(value, schema)
    named = ToolUse.of(
        [WEATHER, NOW], {"type": "function", "function": {"name": "get_weather"}}, None, None
    )
    assert json.loads(named.constraint().json_schema) == WEATHER["function"]["parameters"]


def test_finish_reason_says_tool_calls_when_the_model_chose_to_call() -> None:
    auto = ToolUse.of([WEATHER], "auto", None, "hermes")
    named = ToolUse.of(
        [WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, None
    )
    assert auto.finish_reason("stop", 1) == "tool_calls"
    assert auto.finish_reason("stop", 0) == "stop" and auto.finish_reason("length", 1) == "length"
    assert named.finish_reason("stop", 1) == "stop"
