"""The OpenAI request bodies the router accepts, and their translation to Tandem's own
``GenerateRequest``: one per choice (``n``), each prompt of a batch its own.

Fields follow OpenAI's API reference; the usual extras of OpenAI-compatible servers
(``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``min_tokens``, ``skip_special_tokens``) are accepted too. Unknown fields are ignored,
as OpenAI's own clients send some that do not apply (``user``, ``store``, ...). Value
checks beyond types are the router's validator's, so both APIs refuse the same things
with the same words.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.protos import common_pb2, generation_pb2
from tandem.router.openai_api.errors import Unsupported
from tandem.router.openai_api.tools import ToolUse

__all__ = ["Unsupported"]


UINT32_MAX = 2**32 - 1
Count = Annotated[int, Field(ge=0, le=UINT32_MAX)]
"""A non-negative count or token id the wire carries as uint32: out of range is a 400
naming the field (not a protobuf error and a 500)."""
TokenCount = Annotated[int, Field(ge=1, le=UINT32_MAX)]
Text = Annotated[str, Field(min_length=1)]
"""A prompt: empty is refused (it encodes to nothing to continue)."""


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with ``include_usage``, every chunk carries its choice's usage so far."""


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # Bounds as the validator checks them, so the OpenAPI schema says what is accepted.
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # extras of OpenAI-compatible servers
    top_k: int | None = Field(None, ge=-1, le=UINT32_MAX)
    """-1 or 0: no top-k filter, whatever the model's default (vLLM's meaning)."""
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[Count] | None = None
    min_tokens: Count | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    # structured-output extras (vLLM's names): at most one, and not with response_format
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> common_pb2.SamplingParams:
        _check_text(self.model, "model")
        sampling = common_pb2.SamplingParams(ignore_eos=self.ignore_eos)
        sampling.logit_bias.update(_logit_bias(self.logit_bias or {}))
        structured = self._structured()
        if structured is not None:
            sampling.structured.CopyFrom(structured)
        optional = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": None if self.top_k is None else max(self.top_k, 0),  # 0 on the wire: off
            "repetition_penalty": self.repetition_penalty,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
        }
        for name, value in optional.items():
            if value is not None:
                setattr(sampling, name, value)
        for name in ("presence_penalty", "frequency_penalty", "min_p", "min_tokens"):
            value = getattr(self, name)
            if value is not None:
                setattr(sampling, name, value)
        sampling.include_stop_str_in_output = self.include_stop_str_in_output
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            for i, stop in enumerate(stops):
                _check_text(stop, "stop" if isinstance(self.stop, str) else f"stop[{i}]")
            sampling.stop.extend(stops)
        if self.stop_token_ids:
            sampling.stop_token_ids.extend(self.stop_token_ids)
        return sampling

    def _structured(self) -> common_pb2.StructuredOutput | None:
        """The one constraint the body asks for (``response_format`` or a ``guided_*``
        extra); the router's validator checks that it compiles."""
        given: list[tuple[str, common_pb2.StructuredOutput]] = []
        if self.response_format is not None:
            found = _response_format(self.response_format)
            if found is not None:
                given.append(("response_format", found))
        if self.guided_json is not None:
            schema = self.guided_json
            text = schema if isinstance(schema, str) else json.dumps(schema)
            given.append(("guided_json", common_pb2.StructuredOutput(json_schema=text)))
        if self.guided_regex is not None:
            given.append(("guided_regex", common_pb2.StructuredOutput(regex=self.guided_regex)))
        if self.guided_grammar is not None:
            given.append(
                ("guided_grammar", common_pb2.StructuredOutput(grammar=self.guided_grammar))
            )
        if self.guided_choice is not None:
            if not self.guided_choice:
                raise Unsupported("guided_choice", "guided_choice must list at least one choice")
            regex = "|".join(f"({re.escape(c)})" for c in self.guided_choice)
            given.append(("guided_choice", common_pb2.StructuredOutput(regex=regex)))
        if len(given) > 1:
            names = " and ".join(name for name, _ in given)
            raise Unsupported(given[1][0], f"only one structured output constraint: got {names}")
        return given[0][1] if given else None

    def _choices(
        self, base: generation_pb2.GenerateRequest
    ) -> list[generation_pb2.GenerateRequest]:
        """``n`` requests; with a seed, choice ``i`` samples with ``seed + i`` (so the
        choices differ, and each is reproducible)."""
        out = []
        for i in range(self.n):
            request = generation_pb2.GenerateRequest()
            request.CopyFrom(base)
            if self.seed is not None:
                request.sampling.seed = (self.seed + i) % 2**64
            out.append(request)
        return out

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids as JSON keys (strings), biases in [-100, 100]."""
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not 0 <= token_id <= UINT32_MAX:
            raise Unsupported("logit_bias", f"logit_bias keys are token ids, got {key!r}")
        if not -100 <= value <= 100:  # NaN fails this too
            raise Unsupported(
                "logit_bias", f"logit_bias values must be in [-100, 100], got {value} for {key}"
            )
        out[token_id] = value
    return out


def _response_format(form: dict[str, Any]) -> common_pb2.StructuredOutput | None:
    kind = form.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = form.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            raise Unsupported(
                "response_format.json_schema.schema",
                "response_format json_schema needs json_schema.schema, a JSON schema object",
            )
        return common_pb2.StructuredOutput(json_schema=json.dumps(schema))
    raise Unsupported(
        "response_format.type",
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
    )


class CompletionRequest(_Sampling):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: TokenCount | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def requests(self) -> list[list[generation_pb2.GenerateRequest]]:
        """Per prompt of the batch, its ``n`` choices."""
        if self.echo and self.logprobs is not None:
            raise Unsupported(
                "echo",
                "echo with logprobs needs the prompt's log-probabilities, which Tandem does "
                "not compute yet: send echo or logprobs",
            )
        if self.suffix:
            raise Unsupported("suffix", "suffix is not supported")
        if self.best_of not in (None, 1, self.n):
            raise Unsupported("best_of", "best_of other than n is not supported")
        sampling = self._sampling(self.max_tokens, self.logprobs)
        return [
            self._choices(_with_prompt(generation_pb2.GenerateRequest(sampling=sampling), p))
            for p in _prompts(self.prompt)
        ]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str = Field(json_schema_extra={"enum": ["system", "user", "assistant", "tool"]})
    """Any role the chat template knows; the schema lists OpenAI's."""
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant turn's calls: ``[{"id", "type": "function", "function": {"name",
    "arguments"}}]`` (``arguments`` JSON text, as OpenAI sends them)."""
    tool_call_id: str | None = None
    """A ``tool`` turn: the call it answers."""
    name: str | None = None

    def add_to(self, chat: generation_pb2.ChatMessages, index: int) -> None:
        _check_text(self.role, f"messages[{index}].role")
        message = chat.messages.add(role=self.role, content=_text(self.content, index))
        if self.tool_calls:
            text = json.dumps(self.tool_calls, ensure_ascii=False)
            _check_text(text, f"messages[{index}].tool_calls")
            message.tool_calls_json = text
        for name in ("tool_call_id", "name"):
            value = getattr(self, name)
            if value:
                _check_text(value, f"messages[{index}].{name}")
                setattr(message, name, value)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's extra: more variables for the chat template (``enable_thinking``, ...)."""

    def tool_use(self, auto_parser: str | None) -> ToolUse | None:
        """What the request asks of its tools, with the server's ``--tool-call-parser``
        (``None`` when auto tool choice is off)."""
        return ToolUse.of(self.tools, self.tool_choice, self.parallel_tool_calls, auto_parser)

    def requests(self, tools: ToolUse | None = None) -> list[generation_pb2.GenerateRequest]:
        if self.top_logprobs and not self.logprobs:
            raise Unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        chat = _chat(self.messages, self.add_generation_prompt, self.tools)
        if self.chat_template_kwargs:
            text = json.dumps(self.chat_template_kwargs, ensure_ascii=False)
            _check_text(text, "chat_template_kwargs")
            chat.template_kwargs_json = text
        sampling = self._sampling(max_tokens, logprobs)
        constraint = None if tools is None else tools.constraint()
        if constraint is not None:
            if sampling.HasField("structured"):
                raise Unsupported(
                    "tool_choice",
                    f"tool_choice {tools.mode!r} constrains the output itself: send no "
                    "response_format or guided_* with it",
                )
            sampling.structured.CopyFrom(constraint)
        return self._choices(generation_pb2.GenerateRequest(chat=chat, sampling=sampling))


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages rendered by the template."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """``None``: as generation encodes (a prompt with the special tokens, a rendered chat
    without: its template adds them)."""
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None

    def request(self) -> generation_pb2.GenerateRequest:
        _check_text(self.model, "model")
        if (self.prompt is None) == (self.messages is None):
            raise Unsupported("prompt", "send exactly one of prompt and messages")
        if self.prompt is not None:
            _check_text(self.prompt, "prompt")
            return generation_pb2.GenerateRequest(prompt=self.prompt)
        chat = _chat(self.messages or [], self.add_generation_prompt, self.tools)
        return generation_pb2.GenerateRequest(chat=chat)


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text, special tokens kept."""

    model_config = ConfigDict(extra="ignore")

    model: str = ""
    tokens: list[Count]


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's): a PEFT adapter directory every worker
    reads, served under ``lora_name`` (what requests then give as their ``model``)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256, pattern=r"^[^\x00]+$")
    lora_path: str = Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=256, pattern=r"^[^\x00]+$")
    lora_int_id: int | None = None
    """Accepted for vLLM's clients; adapters are named by ``lora_name``."""


def _chat(
    messages: list[ChatMessage], add_generation_prompt: bool, tools: list[dict[str, Any]] | None
) -> generation_pb2.ChatMessages:
    chat = generation_pb2.ChatMessages(add_generation_prompt=add_generation_prompt)
    for i, message in enumerate(messages):
        message.add_to(chat, i)
    if tools:
        text = json.dumps(tools, ensure_ascii=False)
        _check_text(text, "tools")
        chat.tools_json = text
    return chat


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif not prompt:
        raise Unsupported("prompt", "prompt is empty")
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    for i, one in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(one, str):
            _check_text(one, where)
            continue
        for j, token_id in enumerate(one):
            if not 0 <= token_id <= UINT32_MAX:
                raise Unsupported(
                    f"{where}[{j}]", f"{where}[{j}] = {token_id} is not a token id (>= 0)"
                )
    return prompts


def _check_text(text: str, param: str) -> None:
    """Text the wire can carry: UTF-8, so no lone UTF-16 surrogate (JSON's "\\ud800"
    escapes decode to one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start : err.end].encode("unicode_escape").decode()
        raise Unsupported(
            param, f"{param} holds {bad} at {err.start}, a lone surrogate: not valid text"
        ) from None


def _with_prompt(
    request: generation_pb2.GenerateRequest, prompt: str | list[int]
) -> generation_pb2.GenerateRequest:
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def _text(content: str | list[dict[str, Any]] | None, index: int) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        _check_text(content, f"messages[{index}].content")
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise Unsupported(
                f"messages[{index}].content",
                f"content parts of type {part.get('type')!r} are not supported (text only)",
            )
        parts.append(str(part.get("text", "")))
    text = "".join(parts)
    _check_text(text, f"messages[{index}].content")
    return text


FinishReason = Literal["stop", "length", "abort"]
