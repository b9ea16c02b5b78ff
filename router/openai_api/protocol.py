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

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.protos import common_pb2, generation_pb2


class Unsupported(ValueError):
    """A request field Tandem does not do (yet); ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # extras of OpenAI-compatible servers
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> common_pb2.SamplingParams:
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise Unsupported(
                "response_format", "structured outputs (response_format) are not supported yet"
            )
        if self.logit_bias:
            raise Unsupported("logit_bias", "logit_bias is not supported")
        sampling = common_pb2.SamplingParams(ignore_eos=self.ignore_eos)
        optional = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
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
            sampling.stop.extend([self.stop] if isinstance(self.stop, str) else self.stop)
        if self.stop_token_ids:
            sampling.stop_token_ids.extend(self.stop_token_ids)
        return sampling

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


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def requests(self) -> list[list[generation_pb2.GenerateRequest]]:
        """Per prompt of the batch, its ``n`` choices."""
        if self.echo:
            raise Unsupported("echo", "echo is not supported")
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

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None

    def requests(self) -> list[generation_pb2.GenerateRequest]:
        if self.tools:
            raise Unsupported("tools", "tool calling is not supported")
        if self.top_logprobs and not self.logprobs:
            raise Unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        chat = generation_pb2.ChatMessages(add_generation_prompt=self.add_generation_prompt)
        for i, message in enumerate(self.messages):
            chat.messages.add(role=message.role, content=_text(message.content, i))
        base = generation_pb2.GenerateRequest(
            chat=chat, sampling=self._sampling(max_tokens, logprobs)
        )
        return self._choices(base)


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise Unsupported("prompt", "prompt is empty")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


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
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise Unsupported(
                f"messages[{index}].content",
                f"content parts of type {part.get('type')!r} are not supported (text only)",
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


FinishReason = Literal["stop", "length", "abort"]
