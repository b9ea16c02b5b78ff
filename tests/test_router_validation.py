"""What the router accepts, what it refuses, and how it says so."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.common.generation_config import SamplingDefaults
from tandem.common.model_config import ModelConfig
from tandem.common.sampling_params import SamplingParams
from tandem.common.tokenizer import Tokenizer
from tandem.common.wire import sampling_to_proto
from tandem.protos import common_pb2, generation_pb2
from tandem.router.validation import (
    InvalidRequest,
    RequestValidator,
    ValidatedRequest,
    validate_sampling,
)

MODEL = "llama-tiny"


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint()


@pytest.fixture(scope="module")
def validator(model_dir: Path) -> RequestValidator:
    return RequestValidator.from_dir(model_dir, MODEL)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def request(**fields: object) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(**fields)


def token_ids(*ids: int) -> common_pb2.TokenIds:
    return common_pb2.TokenIds(ids=list(ids))


def chat(*turns: tuple[str, str], **kw: bool) -> generation_pb2.ChatMessages:
    messages = [generation_pb2.ChatMessage(role=r, content=c) for r, c in turns]
    return generation_pb2.ChatMessages(messages=messages, **kw)


def refusal(validator: RequestValidator, req: generation_pb2.GenerateRequest) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        validator.validate(req)
    return info.value


# --- accepted inputs -------------------------------------------------------------------


def test_text_prompt_is_encoded_with_special_tokens(
    validator: RequestValidator, tokenizer: Tokenizer
) -> None:
    out = validator.validate(request(request_id="r1", prompt="Hello there", priority=3))
    assert out == ValidatedRequest(
        request_id="r1",
        prompt_token_ids=tuple(tokenizer.encode("Hello there")),
        sampling=SamplingParams(),
        priority=3,
        prompt_text="Hello there",
    )
    assert out.prompt_token_ids[0] == tokenizer.bos_token_id


def test_chat_is_rendered_by_the_template_with_a_single_bos(
    validator: RequestValidator, tokenizer: Tokenizer
) -> None:
    out = validator.validate(request(chat=chat(("system", "Be brief."), ("user", "Hi"))))
    expected = tokenizer.apply_chat_template([("system", "Be brief."), ("user", "Hi")])
    assert out.prompt_text == expected
    assert out.prompt_text.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tuple(tokenizer.encode(expected, add_special_tokens=False))
    assert out.prompt_token_ids.count(tokenizer.bos_token_id) == 1


def test_chat_can_leave_out_the_generation_prompt(validator: RequestValidator) -> None:
    turns = chat(("user", "Hi"), add_generation_prompt=False)
    assert not validator.validate(request(chat=turns)).prompt_text.endswith("assistant\n")


def test_token_ids_are_taken_as_they_are(validator: RequestValidator) -> None:
    out = validator.validate(request(token_ids=token_ids(5, 6, validator.vocab_size - 1)))
    assert out.prompt_token_ids == (5, 6, validator.vocab_size - 1)
    assert out.prompt_text is None


def test_missing_request_id_gets_a_fresh_one(validator: RequestValidator) -> None:
    first, second = (validator.validate(request(prompt="x")).request_id for _ in range(2))
    assert len(first) == 32 and int(first, 16) >= 0
    assert first != second


def test_the_served_model_name_is_accepted(validator: RequestValidator) -> None:
    assert validator.validate(request(model=MODEL, prompt="x")).prompt_text == "x"


def test_prompt_of_exactly_max_model_len_minus_one_is_accepted(model_dir: Path) -> None:
    validator = RequestValidator.from_dir(model_dir, MODEL, max_model_len=8)
    assert validator.validate(request(token_ids=token_ids(*[7] * 7))).num_prompt_tokens == 7


# --- refused inputs: the message names the field -----------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "input is not set: send one of prompt, token_ids or chat"),
        ({"prompt": ""}, "prompt must not be empty"),
        ({"token_ids": token_ids()}, "token_ids must not be empty"),
        ({"chat": chat()}, "chat.messages must not be empty"),
        ({"model": "gpt-9", "prompt": "x"}, "model 'gpt-9' is not served here"),
    ],
)
def test_refusals_name_the_field(
    validator: RequestValidator, fields: dict[str, object], message: str
) -> None:
    assert str(refusal(validator, request(**fields))).startswith(message)


def test_token_id_out_of_range_names_its_position_and_the_vocabulary(
    validator: RequestValidator,
) -> None:
    vocab = validator.vocab_size
    err = refusal(validator, request(token_ids=token_ids(1, 2, vocab)))
    assert err.field == "token_ids[2]"
    assert str(err) == (
        f"token_ids[2] = {vocab} is out of range: this model's vocabulary has ids 0..{vocab - 1}"
    )


def test_stop_token_id_out_of_range_is_refused(validator: RequestValidator) -> None:
    sampling = common_pb2.SamplingParams(stop_token_ids=[10**6])
    err = refusal(validator, request(prompt="x", sampling=sampling))
    assert err.field == "sampling.stop_token_ids[0]"


def test_too_long_prompt_names_both_lengths(model_dir: Path) -> None:
    validator = RequestValidator.from_dir(model_dir, MODEL, max_model_len=8)
    err = refusal(validator, request(token_ids=token_ids(*[7] * 8)))
    assert str(err) == (
        "token_ids is 8 tokens long, more than the 7 this model accepts "
        "(max_model_len 8, less one position for the first generated token)"
    )


def test_too_long_text_counts_tokens_not_characters(model_dir: Path, tokenizer: Tokenizer) -> None:
    validator = RequestValidator.from_dir(model_dir, MODEL, max_model_len=8)
    text = "the quick brown fox jumps over the lazy dog"
    num_tokens = len(tokenizer.encode(text))
    err = refusal(validator, request(prompt=text))
    assert str(err).startswith(f"prompt is {num_tokens} tokens long, more than the 7")


def test_max_model_len_defaults_to_the_checkpoint_and_cannot_exceed_it(model_dir: Path) -> None:
    limit = ModelConfig.from_dir(model_dir).max_position_embeddings
    assert RequestValidator.from_dir(model_dir, MODEL).max_model_len == limit
    with pytest.raises(ValueError, match="max_model_len"):
        RequestValidator.from_dir(model_dir, MODEL, max_model_len=limit + 1)


def test_chat_without_a_template_is_refused_clearly(model_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "no-template"
    shutil.copytree(model_dir, bare)
    config_path = bare / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    validator = RequestValidator.from_dir(bare, MODEL)
    err = refusal(validator, request(chat=chat(("user", "Hi"))))
    assert err.field == "chat"
    assert "no chat template" in str(err) and "send a text prompt" in str(err)
    assert validator.validate(request(prompt="Hi")).prompt_text == "Hi"


def test_chat_the_template_rejects_is_refused(validator: RequestValidator) -> None:
    err = refusal(validator, request(chat=chat(("robot", "beep"))))
    assert err.field == "chat.messages"
    assert "Unknown chat role: robot" in str(err)


# --- sampling parameters ------------------------------------------------------------------


def test_unset_sampling_fields_take_tandem_defaults() -> None:
    assert validate_sampling(common_pb2.SamplingParams()) == SamplingParams()
    assert validate_sampling(common_pb2.SamplingParams()).top_k is None


def test_explicit_zeros_are_kept_not_replaced_by_defaults() -> None:
    proto = common_pb2.SamplingParams(temperature=0.0, skip_special_tokens=False, seed=0)
    params = validate_sampling(proto)
    assert params.temperature == 0.0 and params.greedy
    assert params.skip_special_tokens is False
    assert params.seed == 0


def test_top_k_zero_turns_the_filter_off_over_the_models_default() -> None:
    """vLLM's -1 / 0 (the OpenAI front sends -1 as 0): no top-k, whatever
    generation_config.json says; unset keeps the model's default."""
    defaults = SamplingDefaults(top_k=20)
    assert validate_sampling(common_pb2.SamplingParams(top_k=0), defaults).top_k is None
    assert validate_sampling(common_pb2.SamplingParams(), defaults).top_k == 20
    assert validate_sampling(common_pb2.SamplingParams(top_k=5), defaults).top_k == 5


def test_floats_arrive_exactly_as_sent() -> None:
    proto = common_pb2.SamplingParams(temperature=0.7, top_p=0.123456789, min_p=1e-9)
    wire = common_pb2.SamplingParams.FromString(proto.SerializeToString())
    params = validate_sampling(wire)
    assert (params.temperature, params.top_p, params.min_p) == (0.7, 0.123456789, 1e-9)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(
            max_tokens=300,
            min_tokens=4,
            temperature=0.7,
            top_k=40,
            top_p=0.9,
            min_p=0.1,
            repetition_penalty=1.1,
            presence_penalty=-0.5,
            frequency_penalty=1.5,
            seed=2**63 + 5,
            stop=("\n\n", "END"),
            stop_token_ids=(3, 4),
            ignore_eos=True,
            include_stop_str_in_output=True,
            logprobs=0,
            skip_special_tokens=False,
            logit_bias={7: -100, 3: 0.25},
        ),
    ],
)
def test_sampling_forwarded_to_workers_round_trips_exactly(params: SamplingParams) -> None:
    proto = sampling_to_proto(params)
    assert validate_sampling(proto) == params
    wire = common_pb2.SamplingParams.FromString(proto.SerializeToString())
    assert validate_sampling(wire) == params


@pytest.mark.parametrize(
    ("proto", "message"),
    [
        (common_pb2.SamplingParams(max_tokens=0), "sampling.max_tokens must be >= 1, got 0"),
        (common_pb2.SamplingParams(top_p=0.0), "sampling.top_p must be in (0, 1], got 0.0"),
        (common_pb2.SamplingParams(temperature=-1), "sampling.temperature must be >= 0"),
        (common_pb2.SamplingParams(logprobs=21), "sampling.logprobs must be in [0, 20], got 21"),
        (common_pb2.SamplingParams(stop=[""]), "sampling.stop stop strings must be non-empty"),
        (
            common_pb2.SamplingParams(max_tokens=4, min_tokens=5),
            "sampling.min_tokens must be in [0, max_tokens=4], got 5",
        ),
        (
            common_pb2.SamplingParams(temperature=float("inf")),
            "sampling.temperature must be a finite number, got inf",
        ),
        (
            common_pb2.SamplingParams(presence_penalty=float("nan")),
            "sampling.presence_penalty must be a finite number, got nan",
        ),
    ],
)
def test_bad_sampling_is_refused_with_the_field_and_reason(
    validator: RequestValidator, proto: common_pb2.SamplingParams, message: str
) -> None:
    err = refusal(validator, request(prompt="x", sampling=proto))
    assert str(err).startswith(message)
    assert err.field == message.split(" ")[0]


@pytest.mark.parametrize(
    ("structured", "field", "words"),
    [
        (common_pb2.StructuredOutput(regex="[0-9"), "sampling.structured.regex", "not usable"),
        (
            common_pb2.StructuredOutput(grammar="start: nothing\n"),
            "sampling.structured.grammar",
            "not usable",
        ),
        (
            common_pb2.StructuredOutput(json_schema="{oops"),
            "sampling.structured.json_schema",
            "not valid JSON",
        ),
    ],
)
def test_a_constraint_that_cannot_compile_is_refused_at_the_router(
    validator: RequestValidator, structured: common_pb2.StructuredOutput, field: str, words: str
) -> None:
    request = generation_pb2.GenerateRequest(token_ids=token_ids(5, 6, 7))
    request.sampling.structured.CopyFrom(structured)
    error = refusal(validator, request)
    assert error.field == field and words in str(error)


def test_a_usable_constraint_reaches_the_workers_as_sent(validator: RequestValidator) -> None:
    request = generation_pb2.GenerateRequest(token_ids=token_ids(5, 6, 7))
    request.sampling.structured.regex = "[a-z]+"
    validated = validator.validate(request)
    assert validated.sampling.structured.spec == "[a-z]+"


def test_a_chat_without_max_tokens_runs_to_the_end_of_the_context(model_dir: Path) -> None:
    """As vLLM and OpenAI: a chat's max_tokens left out is the rest of the context (or
    the model's max_new_tokens when that is less); a text prompt's stays 16."""
    validator = RequestValidator.from_dir(model_dir, MODEL, max_model_len=300)
    conversation = chat(("user", "hello there"))
    chat_request = validator.validate(request(chat=conversation))
    assert chat_request.sampling.max_tokens == 300 - chat_request.num_prompt_tokens
    given = common_pb2.SamplingParams(max_tokens=9)
    assert validator.validate(request(chat=conversation, sampling=given)).sampling.max_tokens == 9
    assert validator.validate(request(prompt="hello")).sampling.max_tokens == 16
    capped = RequestValidator(
        MODEL,
        Tokenizer.from_dir(model_dir),
        ModelConfig.from_dir(model_dir),
        300,
        SamplingDefaults(max_tokens=5),
    )
    assert capped.validate(request(chat=conversation)).sampling.max_tokens == 5


def test_grpc_chat_carries_tools_calls_and_template_kwargs(
    validator: RequestValidator, tokenizer: Tokenizer
) -> None:
    """What the OpenAI layer sends over the wire, a gRPC client can send too."""
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    turns = chat(("user", "Time?"))
    turns.tools_json = json.dumps(tools)
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    turns.messages.add(role="assistant", tool_calls_json=json.dumps([call]))
    turns.messages.add(role="tool", content="12:00", tool_call_id="c", name="now")
    out = validator.validate(request(chat=turns))
    call["function"]["arguments"] = {}  # templates get the arguments as an object
    expected = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "12:00", "tool_call_id": "c", "name": "now"},
        ],
        tools=tools,
    )
    assert out.prompt_text == expected
    assert '{"name": "now", "arguments": {}}' in expected and "<tool_response>\n12:00" in expected


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda c: setattr(c, "tools_json", "[{"), "chat.tools_json"),
        (lambda c: setattr(c, "tools_json", "{}"), "chat.tools_json"),
        (lambda c: setattr(c, "tools_json", "[" * 100_000 + "]" * 100_000), "chat.tools_json"),
        (lambda c: setattr(c, "template_kwargs_json", "[]"), "chat.template_kwargs_json"),
        (lambda c: setattr(c, "template_kwargs_json", '{"messages": []}'),
         "chat.template_kwargs_json"),
        (lambda c: setattr(c.messages[0], "tool_calls_json", '[{"function": {}}]'),
         "chat.messages[0].tool_calls[0]"),
    ],
)  # fmt: skip
def test_malformed_tool_fields_are_refused_by_name(
    validator: RequestValidator, edit, field: str
) -> None:
    turns = chat(("user", "Hi"))
    edit(turns)
    assert refusal(validator, request(chat=turns)).field == field


def test_logit_bias_outside_the_vocabulary_is_refused(validator: RequestValidator) -> None:
    sampling = common_pb2.SamplingParams(logit_bias={5: 1.0, validator.vocab_size: 2.0})
    err = refusal(validator, request(prompt="Hi", sampling=sampling))
    assert err.field == "sampling.logit_bias"
    assert f"token id {validator.vocab_size}, out of range" in str(err)


def test_further_served_names_are_accepted(model_dir: Path) -> None:
    validator = RequestValidator.from_dir(model_dir, MODEL, aliases=("gpt-4o", MODEL))
    assert validator.served_names == (MODEL, "gpt-4o")
    for name in ("", MODEL, "gpt-4o"):
        validator.validate(request(model=name, prompt="Hi"))
    assert refusal(validator, request(model="other", prompt="Hi")).field == "model"


def test_constraints_nested_past_any_stack_are_refused_by_name(
    validator: RequestValidator,
) -> None:
    deep = {
        "json_schema": '{"a":' * 5000 + "1" + "}" * 5000,
        "regex": "(" * 20000 + ")" * 20000,
        "grammar": "start: " + "(" * 20000 + '"a"' + ")" * 20000,
    }
    for kind, spec in deep.items():
        sampling = common_pb2.SamplingParams(structured=common_pb2.StructuredOutput(**{kind: spec}))
        err = refusal(validator, request(prompt="Hi", sampling=sampling))
        assert err.field.startswith("sampling.structured"), (kind, str(err))
