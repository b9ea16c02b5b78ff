"""From a public ``GenerateRequest`` to a validated, tokenized ``ValidatedRequest``.

Everything a client can get wrong is caught here, before any worker sees the request,
and reported as one ``InvalidRequest`` naming the field at fault (the router maps it
to ``INVALID_ARGUMENT``). Torch-free: only the checkpoint's tokenizer and config.

Inputs: a text ``prompt`` is encoded with the tokenizer's special tokens (e.g. BOS);
``chat`` messages are rendered with the checkpoint's chat template, which inserts BOS
itself, so the rendering is encoded without adding special tokens again; ``token_ids``
are taken as they are, checked against the model's vocabulary.

Sampling: ``tandem.common.wire`` maps the wire's ``SamplingParams`` onto tandem's (the same
mapping every hop uses; ``tandem.common.wire.sampling_to_proto`` is its inverse, exact since
the floats are doubles); this module adds the checks and the field-naming errors, and the
served model's sampling defaults (``tandem.common.generation_config``) for the fields a
request leaves unset, so the workers get every field resolved.
"""

from __future__ import annotations

import contextlib
import json
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.common.constraints import check_constraint
from tandem.common.generation_config import AUTO, SamplingDefaults, load_sampling_defaults
from tandem.common.model_config import ModelConfig
from tandem.common.sampling_params import SamplingParams
from tandem.common.tokenizer import ChatTemplateError, Tokenizer, read_chat_template
from tandem.common.wire import sampling_from_proto
from tandem.protos import common_pb2, generation_pb2

# Checked for NaN and infinity, which SamplingParams' range checks let through.
_FLOAT_FIELDS = tuple(
    field.name
    for field in common_pb2.SamplingParams.DESCRIPTOR.fields
    if field.type in (field.TYPE_DOUBLE, field.TYPE_FLOAT)
)


class InvalidRequest(ValueError):
    """A request the router refuses; ``str(err)`` is the message for the client.

    ``field`` names the request field at fault (``"prompt"``, ``"sampling.top_p"``...),
    and the message starts with it.
    """

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that passed every check, in the router's own types.

    ``prompt_text`` is the text prompt, or the chat as rendered by the template;
    ``None`` for a token-id prompt. ``prompt_token_ids`` is never empty and fits the
    model's context with room for at least one generated token.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int
    prompt_text: str | None
    lora_name: str | None = None
    """The LoRA adapter the request names as its model (``None``: the base model)."""
    kv_namespace: str = ""
    """The root of its prompt's block hashes (the adapter's; empty for the base)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class RequestValidator:
    """Validates requests for one served model; built once at router start-up.

    ``max_model_len`` (prompt plus output) defaults to the checkpoint's
    ``max_position_embeddings`` and may not exceed it; ``workers_max_model_len()``
    (called per request; ``None`` when no live worker says) lowers it to what the
    workers take, which may be less (a worker's own ``--max-model-len``, or a context
    its engine fitted to its KV cache). ``sampling_defaults`` fill the sampling fields a
    request leaves unset. Stateless after construction, so one instance serves all
    requests concurrently.
    """

    def __init__(
        self,
        model_name: str,
        tokenizer: Tokenizer,
        config: ModelConfig,
        max_model_len: int | None = None,
        sampling_defaults: SamplingDefaults | None = None,
        workers_max_model_len: Callable[[], int | None] = lambda: None,
        adapters: Callable[[], Mapping[str, str]] = dict,
    ):
        """``adapters()``: the LoRA adapters the workers hold now, name -> KV namespace
        (a request may name one as its model)."""
        limit = config.max_position_embeddings
        if max_model_len is None:
            max_model_len = limit
        if not 2 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}], got {max_model_len}")
        self.model_name = model_name
        self.served_names: tuple[str, ...] = (model_name,)
        """Every name a request may give the model, ``model_name`` first."""
        self.configured_max_model_len = max_model_len
        self._workers_max_model_len = workers_max_model_len
        self.adapters = adapters
        self.vocab_size = config.vocab_size
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self._tokenizer = tokenizer

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        model_name: str,
        max_model_len: int | None = None,
        generation_config: str = AUTO,
        workers_max_model_len: Callable[[], int | None] = lambda: None,
        chat_template: str | None = None,
        aliases: Sequence[str] = (),
        adapters: Callable[[], Mapping[str, str]] = dict,
    ) -> RequestValidator:
        """Read the tokenizer, config and sampling defaults (``generation_config``: see
        ``load_sampling_defaults``) from a HF checkpoint directory; ``chat_template``
        (``--chat-template``: a file or the template itself) replaces the checkpoint's."""
        config = ModelConfig.from_dir(model_dir)
        defaults = load_sampling_defaults(generation_config, model_dir)
        tokenizer = Tokenizer.from_dir(model_dir)
        if chat_template is not None:
            tokenizer = tokenizer.with_chat_template(read_chat_template(chat_template))
        validator = cls(
            model_name,
            tokenizer,
            config,
            max_model_len,
            defaults,
            workers_max_model_len,
            adapters,
        )
        validator.served_names = (model_name, *(a for a in aliases if a != model_name))
        return validator

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output accepted now: the router's own limit, or the live
        workers' smallest when that is less."""
        own, workers = self.configured_max_model_len, self._workers_max_model_len()
        return own if workers is None else min(own, workers)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt accepted: one position is left for the first output token."""
        return self.max_model_len - 1

    def validate(self, request: generation_pb2.GenerateRequest) -> ValidatedRequest:
        """The validated request; raises ``InvalidRequest`` on the first problem found."""
        lora_name, namespace = self._adapter(request.model)
        field, text, token_ids = self._prompt(request)
        self._check_length(field, len(token_ids))
        proto = request.sampling
        if field == "chat" and not proto.HasField("max_tokens"):
            # A chat runs to its end, as in vLLM and OpenAI: the rest of the context,
            # or the model's max_new_tokens when that is less.
            rest = self.max_model_len - len(token_ids)
            cap = self.sampling_defaults.max_tokens
            proto = common_pb2.SamplingParams()
            proto.CopyFrom(request.sampling)
            proto.max_tokens = rest if cap is None else min(rest, cap)
        sampling = validate_sampling(proto, self.sampling_defaults)
        self._check_token_ids("sampling.stop_token_ids", sampling.stop_token_ids)
        outside = [t for t, _ in sampling.logit_bias if t >= self.vocab_size]
        if outside:
            raise InvalidRequest(
                "sampling.logit_bias",
                f"has token id {outside[0]}, out of range: this model's vocabulary has ids "
                f"0..{self.vocab_size - 1}",
            )
        return ValidatedRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_token_ids=tuple(token_ids),
            sampling=sampling,
            priority=request.priority,
            prompt_text=text,
            lora_name=lora_name,
            kv_namespace=namespace,
        )

    def _adapter(self, model: str) -> tuple[str | None, str]:
        """The LoRA adapter ``model`` names and its KV namespace; ``(None, "")`` for the
        base model (or no name); ``InvalidRequest`` for a name nothing serves."""
        if not model or model in self.served_names:
            return None, ""
        adapters = self.adapters()
        if model in adapters:
            return model, adapters[model]
        listed = ", ".join(repr(n) for n in (*self.served_names, *sorted(adapters)))
        raise InvalidRequest(
            "model",
            f"{model!r} is not served here (this router serves {listed}); leave it empty "
            "or name the served model or one of its LoRA adapters",
        )

    def tokenize(
        self, request: generation_pb2.GenerateRequest, add_special_tokens: bool | None = None
    ) -> list[int]:
        """The token ids ``request``'s input encodes to, as ``validate`` encodes it (or
        with / without the special tokens when ``add_special_tokens`` says), without the
        length check (``/tokenize``). ``InvalidRequest`` as ``validate``."""
        _, text, token_ids = self._prompt(request)
        if add_special_tokens is not None and text is not None:
            token_ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(token_ids)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens kept (``/detokenize``); ids outside
        the vocabulary are an ``InvalidRequest`` naming ``tokens[i]``."""
        self._check_token_ids("tokens", token_ids)
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)

    def _prompt(
        self, request: generation_pb2.GenerateRequest
    ) -> tuple[str, str | None, Sequence[int]]:
        """(field name, prompt text or None, token ids) of the request's input."""
        match request.WhichOneof("input"):
            case "prompt":
                if not request.prompt:
                    raise InvalidRequest("prompt", "must not be empty")
                return "prompt", request.prompt, self._tokenizer.encode(request.prompt)
            case "token_ids":
                ids = request.token_ids.ids
                if not ids:
                    raise InvalidRequest("token_ids", "must not be empty")
                self._check_token_ids("token_ids", ids)
                return "token_ids", None, ids
            case "chat":
                text = self._render_chat(request.chat)
                return "chat", text, self._tokenizer.encode(text, add_special_tokens=False)
        raise InvalidRequest("input", "is not set: send one of prompt, token_ids or chat")

    def _render_chat(self, chat: generation_pb2.ChatMessages) -> str:
        if not chat.messages:
            raise InvalidRequest("chat.messages", "must not be empty")
        if not self._tokenizer.has_chat_template:
            raise InvalidRequest(
                "chat",
                "is not supported: this model's checkpoint has no chat template; "
                "send a text prompt instead",
            )
        add_generation_prompt = (
            chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        )
        messages = [_chat_message(i, m) for i, m in enumerate(chat.messages)]
        tools = _json_field("chat.tools_json", chat.tools_json, list)
        kwargs = _json_field("chat.template_kwargs_json", chat.template_kwargs_json, dict)
        reserved = {"messages", "tools", "add_generation_prompt"}.intersection(kwargs or ())
        if reserved:
            raise InvalidRequest(
                "chat.template_kwargs_json", f"may not set {', '.join(sorted(reserved))}"
            )
        try:
            return self._tokenizer.apply_chat_template(
                messages, add_generation_prompt, tools, **(kwargs or {})
            )
        except ChatTemplateError as err:
            raise InvalidRequest("chat.messages", f"were rejected: {err}") from err

    def _check_token_ids(self, field: str, ids: Sequence[int]) -> None:
        if not ids or max(ids) < self.vocab_size:  # the common case, without a Python loop
            return
        for i, token_id in enumerate(ids):
            if token_id >= self.vocab_size:
                raise InvalidRequest(
                    f"{field}[{i}]",
                    f"= {token_id} is out of range: this model's "
                    f"vocabulary has ids 0..{self.vocab_size - 1}",
                )

    def _check_length(self, field: str, num_tokens: int) -> None:
        if num_tokens == 0:
            raise InvalidRequest(field, "encodes to no tokens")
        limit = self.max_model_len
        if num_tokens > limit - 1:
            raise InvalidRequest(
                field,
                f"is {num_tokens} tokens long, more than the {limit - 1} "
                f"this model accepts (max_model_len {limit}, less one position "
                "for the first generated token)",
            )


def validate_sampling(
    proto: common_pb2.SamplingParams, defaults: SamplingDefaults | None = None
) -> SamplingParams:
    """Tandem's ``SamplingParams`` for a wire message (``tandem.common.wire`` does the mapping:
    unset optional fields take ``defaults``, else the tandem defaults; ``top_k`` unset
    with no default means no top-k).

    Raises ``InvalidRequest`` (field ``sampling.<name>``) for a float that is not
    finite, and where ``SamplingParams`` rejects a value, with its message.
    """
    for name in _FLOAT_FIELDS:
        if not math.isfinite(value := getattr(proto, name)):
            raise InvalidRequest(f"sampling.{name}", f"must be a finite number, got {value}")
    try:
        sampling = sampling_from_proto(proto, defaults)
        if sampling.structured is not None:
            check_constraint(sampling.structured)
    except ValueError as err:  # the message starts with the field's name
        name, _, problem = str(err).partition(" ")
        raise InvalidRequest(f"sampling.{name}", problem) from err
    return sampling


def _chat_message(index: int, message: generation_pb2.ChatMessage) -> dict[str, object]:
    """A message as chat templates read it. A tool call's ``arguments`` (JSON text on
    the wire, as OpenAI sends them) become an object, as HF templates expect."""
    out: dict[str, object] = {"role": message.role, "content": message.content}
    where = f"chat.messages[{index}]"
    calls = _json_field(f"{where}.tool_calls_json", message.tool_calls_json, list)
    if calls is not None:
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise InvalidRequest(
                    f"{where}.tool_calls[{j}]", "needs function.name, the function called"
                )
            arguments = function.get("arguments")
            if isinstance(arguments, str):  # left as written when it is not JSON
                with contextlib.suppress(json.JSONDecodeError):
                    function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        out["tool_calls"] = calls
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def _json_field(field: str, text: str, kind: type) -> object | None:
    """A JSON field of the wire (``None`` when empty) that must decode to ``kind``."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidRequest(field, f"is not JSON: {err}") from None
    except RecursionError:
        raise InvalidRequest(field, "is JSON nested too deep to read") from None
    if not isinstance(value, kind):
        expected = "an array" if kind is list else "an object"
        raise InvalidRequest(field, f"must be a JSON {expected}")
    return value
