"""The OpenAI-compatible HTTP API, with the real ``openai`` client against a real cluster
(router with ``--http-port``, one prefill and one decode worker, API keys on): greedy
text equal to the offline engine's, streaming and not, usage, logprobs, ``n``, errors in
OpenAI's shape with the right statuses, and a client disconnect that frees the KV on
both workers."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tandem.cli.launcher import LocalCluster
from tandem.common.sampling_params import StructuredKind, StructuredOutput
from tandem.common.tokenizer import Tokenizer
from tandem.engine import LLM, SamplingParams
from tests.cluster_util import cluster_spec, free_port, held_kv, worker_status
from tests.hf_reference import random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

KEY = "sk-openai-test"
NEW = 12


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def cluster(
    model_dir: Path, redis_url: str, tmp_path_factory
) -> Iterator[tuple[LocalCluster, int]]:
    http_port = free_port()
    spec = cluster_spec(
        model_dir,
        redis_url,
        tmp_path_factory.mktemp("openai-logs"),
        "openai",
        worker_args=("--num-kv-blocks", "256", "--max-model-len", "512"),
        router_args=(
            *("--http-port", str(http_port), "--disaggregation-min-tokens", "16"),
            *("--max-model-len", "512"),
            *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
        ),
        api_keys=(KEY,),
        # 30 ms per decode step: a 450-token answer takes over 13 s, so the disconnect
        # test can tell a cancelled request from one that simply finished.
        worker_env={"decode-0": {"TANDEM_FAULTS": "engine.step:delay=0.03"}},
    )
    # A second name for the model (vLLM's --served-model-name A B); the registry uses A.
    names = ("--served-model-name", spec.model_name, "house-model")
    spec = dataclasses.replace(spec, router_args=(*spec.router_args, *names))
    with LocalCluster(spec) as running:
        yield running, http_port


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    _, port = cluster
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=256, max_model_len=512)


def _greedy(llm: LLM, prompt: list[int], n: int = NEW) -> tuple[list[int], str]:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    return out.token_ids, out.text


def test_models_lists_the_served_names(client: openai.OpenAI, cluster) -> None:
    running, _ = cluster
    assert [m.id for m in client.models.list().data] == [running.model_name, "house-model"]
    answer = client.completions.create(model="house-model", prompt="x", max_tokens=2)
    assert answer.model == "house-model"


def test_completions_whole_and_streamed_equal_the_offline_engine(
    client: openai.OpenAI, cluster, offline: LLM
) -> None:
    running, _ = cluster
    prompt = random_prompts(1, 4096, (30, 40), seed=70)[0]  # disaggregated: above 16
    _, text = _greedy(offline, prompt)
    extra = {"ignore_eos": True}
    whole = client.completions.create(
        model=running.model_name, prompt=prompt, max_tokens=NEW, temperature=0, extra_body=extra
    )
    assert whole.choices[0].text == text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == NEW
    assert whole.usage.total_tokens == len(prompt) + NEW

    chunks = list(
        client.completions.create(
            model=running.model_name,
            prompt=prompt,
            max_tokens=NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW
    assert worker_status(running, "decode-0").kv_blocks_received > 0  # the KV moved


def test_chat_whole_and_streamed_use_the_template(
    client: openai.OpenAI, cluster, offline: LLM, model_dir: Path
) -> None:
    running, _ = cluster
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tokenizer = Tokenizer.from_dir(model_dir)
    rendered = tokenizer.apply_chat_template([(m["role"], m["content"]) for m in messages])
    prompt = tokenizer.encode(rendered, add_special_tokens=False)
    _, text = _greedy(offline, prompt)
    extra = {"ignore_eos": True}
    whole = client.chat.completions.create(
        model=running.model_name,
        messages=messages,
        max_completion_tokens=NEW,
        temperature=0,
        extra_body=extra,
    )
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == text
    assert whole.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(
        model=running.model_name,
        messages=messages,
        max_tokens=NEW,
        temperature=0,
        stream=True,
        extra_body=extra,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_logprobs_and_n(client: openai.OpenAI, cluster) -> None:
    running, _ = cluster
    prompt = random_prompts(1, 4096, (10, 14), seed=71)[0]
    completion = client.completions.create(
        model=running.model_name,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(top) == 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=running.model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        n=3,
        seed=5,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    for choice in chat.choices:
        assert len(choice.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    # The prompt counts once for the three choices.
    assert chat.usage.completion_tokens == 12
    again = client.chat.completions.create(
        model=running.model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        n=3,
        seed=5,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    # Seeded: reproducible choice for choice.
    assert [c.message.content for c in again.choices] == [c.message.content for c in chat.choices]


def test_errors_have_openais_shape_and_status(client: openai.OpenAI, cluster) -> None:
    running, port = cluster
    name = running.model_name
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=name, prompt="hi", max_tokens=4, temperature=-1)
    assert bad.value.body["param"] == "temperature" and "temperature" in bad.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    for bias in ({"five": 1.0}, {"5": 101}, {"1000000": 1}):
        with pytest.raises(openai.BadRequestError) as bad_bias:
            client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], logit_bias=bias
            )
        assert bad_bias.value.body["param"] == "logit_bias", bad_bias.value.body
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.completions.create(model=name, prompt="hi", echo=True, logprobs=2)
    assert unsupported.value.body["param"] == "echo"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=name, prompt=list(range(600)), max_tokens=4)
    assert too_long.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as malformed:
        client.chat.completions.create(model=name, messages=[])
    assert malformed.value.body["param"] == "messages"
    stranger = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # probes need no key


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("completions", {"max_tokens": -1}, "max_tokens"),
        ("completions", {"max_tokens": 10**11}, "max_tokens"),
        ("completions", {"top_k": -2}, "top_k"),
        ("completions", {"prompt": [5, -3, 7]}, "prompt[1]"),
        ("completions", {"prompt": "a \ud800 b"}, "prompt"),
        ("chat/completions", {"max_completion_tokens": -3}, "max_completion_tokens"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x\udfff"}]},
            "messages[0].content",
        ),
        ("chat/completions", {"min_tokens": -1}, "min_tokens"),
        ("chat/completions", {"stop_token_ids": [3, -4]}, "stop_token_ids[1]"),
        ("chat/completions", {"stop": ["ok", "\ud83d"]}, "stop[1]"),
    ],
)
def test_out_of_range_and_unencodable_fields_are_400s_naming_them(
    cluster, path: str, fields: dict, param: str
) -> None:
    """Each of these was an HTTP 500 with a protobuf range or encoding error in the
    router's log (issue 33's list). Sent as JSON with ASCII escapes, as a client's
    encoder writes a lone surrogate (the openai package cannot encode one)."""
    running, port = cluster
    body = {"model": running.model_name, "max_tokens": 4}
    body |= (
        {"prompt": "hi"}
        if path == "completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/{path}",
        content=json.dumps(body | fields),  # ensure_ascii: "\\ud800" stays an escape
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_top_k_minus_one_and_zero_mean_no_top_k(client: openai.OpenAI, cluster) -> None:
    """vLLM's spelling of "no top-k": both answer, and greedily the same as without."""
    running, _ = cluster
    texts = {
        top_k: client.completions.create(
            model=running.model_name,
            prompt="def f(x):",
            max_tokens=6,
            temperature=0,
            extra_body={} if top_k is None else {"top_k": top_k},
        )
        .choices[0]
        .text
        for top_k in (None, -1, 0)
    }
    assert len(set(texts.values())) == 1, texts


def _post(port: int, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(f"http://127.0.0.1:{port}{path}", json=body, headers=headers, timeout=30)


def test_tokenize_detokenize_and_version_as_vllm_serves_them(
    client: openai.OpenAI, cluster, model_dir: Path
) -> None:
    running, port = cluster
    tokenizer = Tokenizer.from_dir(model_dir)
    text = "def f(x):\n    return x"
    answer = _post(port, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert answer["tokens"] == tokenizer.encode(text)  # with the special tokens, as generation
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 512
    assert "".join(answer["token_strs"]).endswith("return x")
    bare = _post(port, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    back = _post(port, "/detokenize", {"tokens": bare["tokens"]}).json()
    assert back == {"prompt": text}
    # A chat counts what a chat completion is charged for.
    messages = [{"role": "user", "content": "hello there"}]
    counted = _post(port, "/tokenize", {"messages": messages}).json()["count"]
    chat = client.chat.completions.create(model=running.model_name, messages=messages, max_tokens=1)
    assert counted == chat.usage.prompt_tokens
    version = httpx.get(f"http://127.0.0.1:{port}/version", timeout=10).json()["version"]
    assert version == importlib.metadata.version("tandem")
    # Errors name the field, as elsewhere.
    out_of_vocab = _post(port, "/detokenize", {"tokens": [1, 10**6]})
    assert out_of_vocab.status_code == 400
    assert out_of_vocab.json()["error"]["param"] == "tokens[1]"
    both = _post(port, "/tokenize", {"prompt": "a", "messages": messages})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    unknown = _post(port, "/tokenize", {"model": "other", "prompt": "a"})
    assert unknown.status_code == 404
    keyless = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"prompt": "a"}, timeout=10)
    assert keyless.status_code == 401


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("body", "structured"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMA},
                }
            },
            StructuredOutput.json_schema(SCHEMA),
        ),
        (
            {"response_format": {"type": "json_object"}},
            StructuredOutput(StructuredKind.JSON_OBJECT),
        ),
        (
            {"guided_regex": "[a-c]{2,6}-[0-9]{2}"},
            StructuredOutput(StructuredKind.REGEX, "[a-c]{2,6}-[0-9]{2}"),
        ),
        (
            {"guided_choice": ["yes", "no way"]},
            StructuredOutput(StructuredKind.REGEX, "(yes)|(no\\ way)"),
        ),
        (
            {"guided_grammar": 'start: "x" NUM\nNUM: /[0-9]{1,4}/\n'},
            StructuredOutput(StructuredKind.GRAMMAR, 'start: "x" NUM\nNUM: /[0-9]{1,4}/\n'),
        ),
    ],
)
def test_structured_outputs_through_the_disaggregated_path(
    client: openai.OpenAI, cluster, offline: LLM, body: dict, structured: StructuredOutput
) -> None:
    """The prefill worker's first token obeys the constraint too (the prompt is long
    enough to be disaggregated): the text equals the offline engine's, token for token."""
    running, _ = cluster
    prompt = random_prompts(1, 4096, (30, 40), seed=80)[0]
    params = SamplingParams(temperature=0, max_tokens=40, structured=structured)
    (expected,) = offline.generate([prompt], params)
    answer = client.completions.create(
        model=running.model_name, prompt=prompt, max_tokens=40, temperature=0, extra_body=body
    )
    assert answer.choices[0].text == expected.text
    assert answer.choices[0].finish_reason == expected.finish_reason
    streamed = client.completions.create(
        model=running.model_name, prompt=prompt, max_tokens=40, temperature=0, stream=True,
        extra_body=body,
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
    if "guided_choice" in body:
        assert expected.text in ("yes", "no way")


def test_structured_output_errors_name_the_field(client: openai.OpenAI, cluster) -> None:
    running, _ = cluster
    name = running.model_name
    cases = [
        ({"guided_regex": "[0-9"}, "structured.regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=name, prompt="hi", max_tokens=4, extra_body=body)
        assert param in bad.value.body["param"], bad.value.body


def test_a_client_that_disconnects_frees_the_kv_on_both_workers(cluster) -> None:
    running, port = cluster
    prompt = random_prompts(1, 4096, (40, 50), seed=72)[0]
    body = {
        "model": running.model_name,
        "prompt": prompt,
        "max_tokens": 450,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in received)
    # Closed after a few tokens of 450: both workers must be back to every block free
    # long before the answer would have finished (13.5 s at 30 ms a step).
    deadline = time.monotonic() + 5
    while True:
        busy = held_kv(running)
        if not any(busy):
            break
        assert time.monotonic() < deadline, f"still held after the disconnect: {busy}"
        time.sleep(0.2)


# --- tool calling ----------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Rome"]},
        "unit": {"type": "string", "enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _streamed_calls(stream) -> tuple[str, list[dict], str | None]:
    """Content, calls and finish reason of a streamed chat, accumulated as a client does."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] = delta.function.name or call["name"]
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _calls(message) -> list[dict]:
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or ()
    ]


def _valid(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("parallel", [False, True])
def test_required_tool_choice_makes_valid_calls(client: openai.OpenAI, cluster, parallel) -> None:
    """A random model held to the functions' schemas: every call names a given function
    with valid arguments, whole and streamed alike (greedy)."""
    running, _ = cluster
    kwargs = dict(
        model=running.model_name, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=parallel, temperature=0, max_tokens=300,
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls = _calls(whole.message)
    _valid(calls)
    if parallel:  # this model goes on calling until the length limit cuts it short
        assert len(calls) > 1 and whole.finish_reason == "length"
    else:
        assert len(calls) == 1 and whole.finish_reason == "tool_calls"
        assert whole.message.content is None
    content, streamed, finish = _streamed_calls(
        client.chat.completions.create(**kwargs, stream=True)
    )
    assert (content, finish) == (whole.message.content or "", whole.finish_reason)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        (c["name"], json.loads(c["arguments"])) for c in calls
    ]


def test_a_named_tool_choice_streams_the_arguments(client: openai.OpenAI, cluster) -> None:
    running, _ = cluster
    kwargs = dict(
        model=running.model_name, messages=ASK, tools=TOOLS, temperature=0, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop"  # the caller's choice, as OpenAI answers it
    (call,) = _calls(whole.message)
    _valid([call])
    assert call["name"] == "get_weather"
    pieces = [
        d.function.arguments
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        for d in (chunk.choices[0].delta.tool_calls or () if chunk.choices else ())
    ]
    assert len(pieces) > 2 and "".join(pieces) == call["arguments"]  # streamed as written


def test_auto_tool_choice_parses_hermes_calls(client: openai.OpenAI, cluster) -> None:
    """``auto`` reads the model's output with --tool-call-parser hermes. A random model
    writes no call of its own, so a regex makes it write one (the constraint shapes the
    raw text; the parser does the rest, as for a model that chose to call)."""
    running, _ = cluster
    said = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
        '"unit": "C"}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    kwargs = dict(
        model=running.model_name, messages=ASK, tools=TOOLS, temperature=0, max_tokens=200,
        extra_body={"guided_regex": re.escape(said)},
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    expected = [("get_weather", {"city": "Rome", "unit": "C"}), ("now", {})]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in _calls(whole.message)] == expected
    content, calls, finish = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert (content, finish) == ("Let me look.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected
    assert len({c["id"] for c in calls}) == 2


def test_auto_without_a_call_is_plain_text_with_the_tools_in_the_prompt(
    client: openai.OpenAI, cluster, offline: LLM
) -> None:
    running, port = cluster
    counted = _post(port, "/tokenize", {"messages": ASK, "tools": TOOLS}).json()["tokens"]
    bare = _post(port, "/tokenize", {"messages": ASK}).json()["tokens"]
    assert len(counted) > len(bare) + 50  # the tools are listed for the model
    _, text = _greedy(offline, counted)
    for tool_choice in ("auto", "none"):
        answer = client.chat.completions.create(
            model=running.model_name, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
            max_tokens=NEW, temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert answer.choices[0].message.content == text
        assert not answer.choices[0].message.tool_calls
        assert answer.usage.prompt_tokens == len(counted)


def test_tool_results_go_back_through_the_template(
    client: openai.OpenAI, cluster, model_dir: Path
) -> None:
    """A conversation with the assistant's calls (arguments as JSON text, as the client
    sends them) and the tools' answers: the prompt is the one transformers renders."""
    transformers = pytest.importorskip("transformers")
    running, port = cluster
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "C"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    ]  # fmt: skip
    ours = _post(port, "/tokenize", {"messages": messages, "tools": TOOLS}).json()["tokens"]
    hf_messages = json.loads(json.dumps(messages))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Rome", "unit": "C"}
    hf_messages[1]["content"] = ""
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = hf.apply_chat_template(
        hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in text
    assert ours == hf(text, add_special_tokens=False).input_ids
    answer = client.chat.completions.create(
        model=running.model_name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert answer.usage.prompt_tokens == len(ours)


def test_tool_errors_name_the_field(client: openai.OpenAI, cluster) -> None:
    running, _ = cluster
    cases = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}],
          "tool_choice": "required"}, "tools[0].function.parameters"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
         "messages[0].tool_calls[0]"),
    ]  # fmt: skip
    for body, param in cases:
        fields = {"messages": ASK, **body}
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=running.model_name, max_tokens=4, **fields)
        assert bad.value.body["param"] == param, bad.value.body


# --- logit_bias, echo, continuous usage ------------------------------------------------


def test_logit_bias_steers_the_cluster_as_the_offline_engine(
    client: openai.OpenAI, cluster, offline: LLM
) -> None:
    running, _ = cluster
    prompt = random_prompts(1, 4096, (30, 40), seed=81)[0]  # disaggregated: prefill samples too
    _, free = _greedy(offline, prompt)
    bias = {"11": 100.0, "12": 4.5}
    params = SamplingParams(
        temperature=0, max_tokens=NEW, ignore_eos=True, logit_bias={11: 100, 12: 4.5}
    )
    (expected,) = offline.generate([prompt], params)
    assert expected.token_ids == [11] * NEW and expected.text != free
    for stream in (False, True):
        answer = client.completions.create(
            model=running.model_name, prompt=prompt, max_tokens=NEW, temperature=0,
            logit_bias=bias, stream=stream, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text = "".join(c.choices[0].text for c in answer) if stream else answer.choices[0].text
        assert text == expected.text


def test_echo_repeats_the_prompt(client: openai.OpenAI, cluster, offline: LLM, model_dir) -> None:
    running, _ = cluster
    tokenizer = Tokenizer.from_dir(model_dir)
    text_prompt = "def add(a, b):"
    ids = tokenizer.encode(text_prompt)
    _, generated = _greedy(offline, ids)
    for prompt in (text_prompt, ids):  # a token-id prompt echoes its text
        kwargs = dict(
            model=running.model_name, prompt=prompt, max_tokens=NEW, temperature=0, echo=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        whole = client.completions.create(**kwargs)
        assert whole.choices[0].text == text_prompt + generated
        assert whole.usage.completion_tokens == NEW
        chunks = list(client.completions.create(**kwargs, stream=True))
        assert chunks[0].choices[0].text == text_prompt
        assert "".join(c.choices[0].text for c in chunks) == text_prompt + generated


def test_continuous_usage_stats_count_as_the_stream_goes(client: openai.OpenAI, cluster) -> None:
    running, _ = cluster
    stream = client.chat.completions.create(
        model=running.model_name, messages=ASK, max_tokens=NEW, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts[0] == 0 and counts[-1] == NEW and counts == sorted(counts)
    prompt = {c.usage.prompt_tokens for c in chunks}
    assert (
        len(prompt) == 1
        and chunks[-1].choices == []
        and chunks[-1].usage.total_tokens == (prompt.pop() + NEW)
    )
    plain = client.chat.completions.create(
        model=running.model_name, messages=ASK, max_tokens=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    *body, last = list(plain)
    assert body and all(c.usage is None for c in body) and last.usage is not None
