"""Tokenizer wrapper and streaming detokenizer, against a made tiny checkpoint."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tandem.common.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

MIXED_TEXT = "Hello 你好，世界! 🎉👨‍👩‍👧 café naïve 日本語のテキスト 😀 def f(x): return x\n"
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi 🎉, 你好"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Again?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.tools.checkpoint_maker import make_model

    return make_model(tmp_path_factory.mktemp("tok") / "llama", arch="llama", size="tiny")


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tok(model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _copy_with(model_dir: Path, dst: Path, **json_edits: dict) -> Path:
    """Copy a checkpoint's tokenizer files, replacing keys of the named JSON files."""
    shutil.copytree(model_dir, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    for stem, changes in json_edits.items():
        path = dst / f"{stem}.json"
        data = json.loads(path.read_text())
        data.update(changes)
        path.write_text(json.dumps(data))
    return dst


# --- Tokenizer ------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "def f(x):\n    return x + 1", MIXED_TEXT, "  spaces  "])
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_special_token_ids(tok: Tokenizer) -> None:
    bos = tok.encode("<|bos|>", add_special_tokens=False)
    eos, end_of_turn = (tok.encode(t, add_special_tokens=False) for t in ("<|eos|>", "<|im_end|>"))
    assert [tok.bos_token_id] == bos
    assert tok.eos_token_ids == frozenset(eos + end_of_turn)
    assert tok.encode("x")[0] == tok.bos_token_id
    assert tok.bos_token_id not in tok.encode("x", add_special_tokens=False)
    assert tok.vocab_size == 4096
    specials = "<|bos|><|eos|><|pad|><|im_start|><|im_end|>"
    assert tok.special_token_ids == frozenset(tok.encode(specials, add_special_tokens=False))


def test_eos_ids_are_the_union_of_int_and_list_fields(model_dir: Path, tmp_path: Path) -> None:
    d = _copy_with(
        model_dir,
        tmp_path / "m",
        config={"eos_token_id": 7},
        generation_config={"eos_token_id": [8, 9]},
        tokenizer_config={"eos_token": {"content": "<|pad|>", "special": True}},
    )
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token_ids == frozenset({7, 8, 9, tok.encode("<|pad|>", False)[0]})


def test_bos_falls_back_to_config_and_may_be_absent(model_dir: Path, tmp_path: Path) -> None:
    from_config = _copy_with(
        model_dir, tmp_path / "a", tokenizer_config={"bos_token": None}, config={"bos_token_id": 5}
    )
    assert Tokenizer.from_dir(from_config).bos_token_id == 5
    absent = _copy_with(
        model_dir,
        tmp_path / "b",
        tokenizer_config={"bos_token": None},
        config={"bos_token_id": None},
    )
    assert Tokenizer.from_dir(absent).bos_token_id is None


@pytest.mark.parametrize("text", ["def f(x):\n    return x", MIXED_TEXT, "<|im_start|>user\nhi"])
def test_ids_match_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text) == hf_tok(text).input_ids
    assert tok.encode(text, False) == hf_tok(text, add_special_tokens=False).input_ids
    ids = tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok, add_generation_prompt: bool
) -> None:
    ours = tok.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ours.startswith("<|bos|><|im_start|>system\nYou are terse.<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Lyon, and the time?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": {"city": "Paris"}}},
            {"id": "b", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": {"city": "Lyon"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "18 C"},
    {"role": "tool", "tool_call_id": "b", "content": "20 C"},
    {"role": "assistant", "content": "Checking the time.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": {}}}
    ]},
    {"role": "tool", "tool_call_id": "c", "content": "12:00"},
]  # fmt: skip


@pytest.mark.parametrize("with_system", [True, False])
def test_tools_render_as_transformers_renders_them(tok: Tokenizer, hf_tok, with_system) -> None:
    """Tools listed in the system turn, calls as <tool_call> blocks, results as
    <tool_response> blocks of one user turn: the same text as transformers renders."""
    chat = TOOL_CHAT if with_system else TOOL_CHAT[1:]
    ours = tok.apply_chat_template(chat, tools=TOOLS)
    theirs = hf_tok.apply_chat_template(
        chat, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert ours.count('<tool_call>\n{"name": "') == 3  # the instructions show the form
    assert ours.count("<tool_response>") == 3
    assert '{"name": "get_weather", "arguments": {"city": "Lyon"}}' in ours
    assert ours.count("<|im_start|>system") == 1
    assert ("Be brief." in ours) == with_system
    # Without tools the same template is plain ChatML.
    assert tok.apply_chat_template(CHAT) == hf_tok.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )


def test_the_developer_role_is_a_system_turn(tok: Tokenizer, hf_tok) -> None:
    """OpenAI's newer name for instructions, which agent frameworks send."""
    developer = [{"role": "developer", "content": "Be brief."}, *CHAT[1:]]
    ours = tok.apply_chat_template(developer)
    assert ours == tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *CHAT[1:]])
    assert ours == hf_tok.apply_chat_template(developer, tokenize=False, add_generation_prompt=True)
    with_tools = tok.apply_chat_template(developer, tools=TOOLS)
    assert with_tools.count("<|im_start|>system") == 1 and "Be brief.\n\nFunctions" in with_tools


def test_template_kwargs_reach_the_template(model_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(model_dir).with_chat_template(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"
    )
    assert tok.apply_chat_template(CHAT[:1]) == "You are terse."
    assert tok.apply_chat_template(CHAT[:1], enable_thinking=False) == "You are terse. /no_think"


def test_chat_template_flag_reads_a_file_or_the_template(tmp_path: Path) -> None:
    from tandem.common.tokenizer import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert read_chat_template(str(path)) == "{{ messages[0].content }}"
    assert read_chat_template("{% for m in messages %}x{% endfor %}").startswith("{% for")
    with pytest.raises(ChatTemplateError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_a_broken_override_template_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.with_chat_template("{% for m in messages %}")


def test_a_template_that_trips_on_a_message_is_a_chat_template_error(tok: Tokenizer) -> None:
    broken = tok.with_chat_template("{{ messages[0].tool_calls[0].function.arguments | items }}")
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        broken.apply_chat_template(CHAT)


def test_chat_messages_may_be_role_content_pairs(tok: Tokenizer) -> None:
    pairs = [(m["role"], m["content"]) for m in CHAT]
    assert tok.apply_chat_template(pairs) == tok.apply_chat_template(CHAT)


def test_template_raise_exception_becomes_value_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="Unknown chat role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_missing_chat_template_raises(model_dir: Path, tmp_path: Path) -> None:
    d = _copy_with(model_dir, tmp_path / "m")
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(d)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(CHAT)


def test_chat_template_jinja_file_wins(model_dir: Path, tmp_path: Path) -> None:
    d = _copy_with(model_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content | tojson }}\n{% endfor %}"
    )
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template([("user", "ü<b>")]) == '[user] "ü<b>"\n'


# --- IncrementalDetokenizer -----------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], skip: bool = True, chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*pieces, detok.flush()]


def _byte_tokens(tok: Tokenizer, char: str) -> list[int]:
    ids = tok.encode(char, add_special_tokens=False)
    assert len(ids) == len(char.encode()), "premise: the character is split into byte tokens"
    return ids


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stream_never_splits_a_character(tok: Tokenizer, chunk: int) -> None:
    ids = tok.encode(MIXED_TEXT * 3, add_special_tokens=False)
    pieces = _stream(tok, ids, chunk=chunk)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == MIXED_TEXT * 3
    assert pieces[-1] == ""


def test_multibyte_character_is_held_until_complete(tok: Tokenizer) -> None:
    first, second, third = _byte_tokens(tok, "中")
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([t]) for t in (first, second, third)] == ["", "", "中"]


def test_flush_returns_an_incomplete_tail_as_the_full_decode_does(tok: Tokenizer) -> None:
    ids = tok.encode("ok ", add_special_tokens=False) + _byte_tokens(tok, "🎉")[:2]
    pieces = _stream(tok, ids)
    assert "".join(pieces[:-1]) == "ok "
    assert "".join(pieces) == tok.decode(ids) == "ok \ufffd"


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    skipped = "".join(_stream(tok, ids, skip=True))
    assert skipped == tok.decode(ids) and "<|im_start|>" not in skipped and "你好" in skipped
    kept = "".join(_stream(tok, ids, skip=False))
    assert kept == tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(CHAT)


def test_invalid_bytes_are_released_within_three_tokens(tok: Tokenizer) -> None:
    continuation = _byte_tokens(tok, "中")[1]  # a lone continuation byte never completes
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push([continuation]) for _ in range(100))
    assert out == "\ufffd" * 97
    assert out + detok.flush() == tok.decode([continuation] * 100)


def test_push_after_flush_raises(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok)
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.push([5])


@pytest.mark.parametrize("skip", [True, False])
def test_random_streams_equal_full_decode(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234)
    # Mostly single-byte tokens and specials, where holding back is exercised hardest.
    byte_ids = sorted({i for ch in "中🎉é日ß" for i in tok.encode(ch, False)})
    pool = byte_ids + sorted(tok.special_token_ids) + tok.encode(MIXED_TEXT, False)
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        pieces = _stream(tok, ids, skip=skip, chunk=rng.choice([1, 1, 2, 3]))
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), ids
