"""Structured outputs in the engine: every token a constrained request emits is one its
constraint allows, finished outputs parse / match, and the constraint survives what the
engine does around it (batching with free requests, prefix-cache hits, preemption,
speculative decoding, a request resumed from tokens made elsewhere)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import llguidance
import pytest

from tandem.common.constraints import check_constraint, grammar_text
from tandem.common.sampling_params import StructuredKind, StructuredOutput
from tandem.engine import LLM, SamplingParams
from tests.hf_reference import random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"
ARITHMETIC = (
    'start: expr\nexpr: NUM | expr OP expr | "(" expr ")"\nOP: "+" | "*"\nNUM: /[0-9]{1,3}/\n'
)
CONSTRAINTS = {
    "json_schema": StructuredOutput.json_schema(SCHEMA),
    "json_object": StructuredOutput(StructuredKind.JSON_OBJECT),
    "regex": StructuredOutput(StructuredKind.REGEX, PHONE),
    "grammar": StructuredOutput(StructuredKind.GRAMMAR, ARITHMETIC),
}


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=256, max_model_len=512)


def allowed_throughout(llm: LLM, structured: StructuredOutput, tokens: list[int]) -> bool:
    """An independent matcher (not the engine's) accepts every token, in order."""
    engine = llm.engine
    tokenizer = llguidance.LLTokenizer(
        (Path(engine.config.model) / "tokenizer.json").read_text(),
        n_vocab=engine.model_config.vocab_size,
        eos_token=sorted(engine.eos_token_ids),
    )
    matcher = llguidance.LLMatcher(tokenizer, grammar_text(structured), log_level=0)
    return matcher.validate_tokens(tokens) == len(tokens)


def check_output(kind: str, text: str) -> None:
    if kind == "json_schema":
        value = json.loads(text)
        assert set(value) <= {"name", "age", "tags"} and {"name", "age"} <= set(value)
        assert isinstance(value["name"], str) and len(value["name"]) <= 12
        assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
        assert all(t in ("a", "b") for t in value.get("tags", []))
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(PHONE, text), text
    else:
        assert re.fullmatch(r"[0-9+*()]+", text) and text.count("(") == text.count(")")


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_token_is_allowed_and_finished_outputs_parse(
    llm: LLM, kind: str, temperature: float
) -> None:
    structured = CONSTRAINTS[kind]
    params = SamplingParams(max_tokens=200, temperature=temperature, seed=5, structured=structured)
    outputs = llm.generate(random_prompts(6, 200, (4, 24), seed=1), params)
    for out in outputs:
        assert allowed_throughout(llm, structured, out.token_ids)
        if out.finish_reason == "stop":
            check_output(kind, out.text)
    if kind == "regex":  # a bounded constraint always completes
        assert all(o.finish_reason == "stop" for o in outputs)


def test_constrained_rows_leave_the_rest_of_the_batch_alone(llm: LLM) -> None:
    prompts = random_prompts(6, 200, (8, 30), seed=2)
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(prompts, free)]
    constrained = SamplingParams(max_tokens=16, temperature=0, structured=CONSTRAINTS["regex"])
    mixed = llm.generate(prompts + prompts, [free] * len(prompts) + [constrained] * len(prompts))
    assert [o.token_ids for o in mixed[: len(prompts)]] == alone
    assert all(re.fullmatch(PHONE, o.text) for o in mixed[len(prompts) :])


def test_same_tokens_through_prefix_hits_preemption_and_speculation(model_dir: Path) -> None:
    prompts = random_prompts(8, 200, (40, 60), seed=3)
    params = SamplingParams(max_tokens=48, temperature=0, structured=CONSTRAINTS["json_schema"])
    reference = [
        o.token_ids for o in LLM(str(model_dir), num_kv_blocks=256).generate(prompts, params)
    ]
    # Prefix-cache hits: every prompt again, now cached.
    cached = LLM(str(model_dir), num_kv_blocks=256)
    cached.generate(prompts, params)
    assert [o.token_ids for o in cached.generate(prompts, params)] == reference
    # Preemption: too few blocks for the whole batch at once.
    tight = LLM(str(model_dir), num_kv_blocks=24, block_size=16, max_model_len=128)
    assert [o.token_ids for o in tight.generate(prompts, params)] == reference
    assert tight.engine.scheduler.num_preemptions > 0
    # Speculative decoding: n-gram drafts are cut at the grammar's first refusal and
    # verified against the masked distribution; greedy output does not change.
    spec = LLM(str(model_dir), num_kv_blocks=256, speculative_method="ngram")
    repetitive = [[*p[:8]] * 5 for p in prompts]
    plain_out = [o.token_ids for o in cached.generate(repetitive, params)]
    assert [o.token_ids for o in spec.generate(repetitive, params)] == plain_out
    assert spec.engine.speculator.stats.num_draft_tokens > 0


def test_a_request_resumed_from_tokens_made_elsewhere_continues_the_same(llm: LLM) -> None:
    """What a decode worker does with the prefill worker's first token, or a migrated
    stream with the tokens so far."""
    prompt = random_prompts(1, 200, (20, 20), seed=4)[0]
    params = SamplingParams(max_tokens=40, temperature=0, structured=CONSTRAINTS["json_object"])
    (whole,) = llm.generate([prompt], params)
    engine = llm.engine
    for cut in (1, 5):
        request = engine.add_request(prompt, params, output_token_ids=whole.token_ids[:cut])
        rest = []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                if delta.request_id == request.request_id:
                    rest += delta.new_token_ids
        assert whole.token_ids[:cut] + rest == whole.token_ids
    with pytest.raises(ValueError, match="break the structured output constraint"):
        engine.add_request(prompt, params, output_token_ids=[0, 0, 0])


@pytest.mark.parametrize(
    ("structured", "field"),
    [
        (StructuredOutput(StructuredKind.REGEX, "[0-9"), "structured.regex"),
        (StructuredOutput(StructuredKind.GRAMMAR, "start: missing_rule\n"), "structured.grammar"),
        (StructuredOutput.json_schema({"type": "no-such-type"}), "structured.json_schema"),
    ],
)
def test_a_constraint_that_cannot_compile_is_refused_by_name(
    llm: LLM, structured: StructuredOutput, field: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        check_constraint(structured)
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.engine.add_request([5, 6, 7], SamplingParams(structured=structured))
    assert not llm.engine.has_unfinished_requests()


def test_bad_specs_fail_before_compiling() -> None:
    with pytest.raises(ValueError, match=r"structured\.json_schema is not valid JSON"):
        StructuredOutput(StructuredKind.JSON_SCHEMA, "{nope")
    with pytest.raises(ValueError, match=r"structured\.regex must not be empty"):
        StructuredOutput(StructuredKind.REGEX, "  ")


def test_extreme_sampling_values_keep_to_the_constraint(llm: LLM) -> None:
    """Found by fuzzing the OpenAI API: a temperature or repetition penalty so small it is
    0 in float32 made NaN logits, and the NaN won over the mask (the worker died). A
    temperature under 1e-5 now samples greedily, a penalty under float32's range is
    refused, and the constraint holds."""
    prompt = random_prompts(1, 4096, (6, 6), seed=3)[0]
    empty = StructuredOutput(StructuredKind.REGEX, "()")  # only the empty string
    for temperature in (0.0, 1e-320, 1e-6):
        params = SamplingParams(
            temperature=temperature, top_p=5e-324, max_tokens=4, structured=empty
        )
        assert params.greedy
        (out,) = llm.generate([prompt], params)
        assert out.finish_reason == "stop" and out.text == ""
    with pytest.raises(ValueError, match=r"repetition_penalty must be > 0 \(at least 1.18e-38"):
        SamplingParams(repetition_penalty=5e-324)
    (out,) = llm.generate(
        [prompt + prompt],
        SamplingParams(temperature=0, repetition_penalty=1.2e-38, max_tokens=6, structured=empty),
    )
    assert out.finish_reason == "stop" and out.text == ""


def test_a_grammar_that_refuses_a_drawn_token_ends_that_request_alone(
    model_dir: Path, monkeypatch
) -> None:
    """If a drawn token is ever refused by its request's grammar (a fault no input can
    cause now, so it is made here), that request ends with ``abort`` and the engine goes
    on with the others, instead of failing every request."""
    from tandem.engine.structured import StructuredOutputs

    llm = LLM(str(model_dir), num_kv_blocks=256, max_model_len=512)
    real = StructuredOutputs.advance
    calls = {"n": 0}

    def refuse_third(matcher, token_ids):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("a token drawn under the mask was refused: (made here)")
        return real(matcher, token_ids)

    monkeypatch.setattr(StructuredOutputs, "advance", staticmethod(refuse_third))
    prompts = random_prompts(2, 4096, (8, 8), seed=4)
    constrained = SamplingParams(temperature=0, max_tokens=8, structured=CONSTRAINTS["json_object"])
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, [constrained, free])  # one batch: the engine goes on
    assert outs[0].finish_reason == "abort"
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8
