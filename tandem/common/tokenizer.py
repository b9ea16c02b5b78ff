"""Tokenizer wrapper and streaming detokenizer, torch- and transformers-free.

``Tokenizer.from_dir`` reads a HuggingFace checkpoint directory: ``tokenizer.json``
(HF ``tokenizers``) for encode/decode, and ``tokenizer_config.json``,
``generation_config.json`` and ``config.json`` for the special tokens and the chat
template. Decoding is the raw ``tokenizers`` decode: ``clean_up_tokenization_spaces``
is ignored.

``IncrementalDetokenizer`` turns a request's output ids into text chunk by chunk in
the decode loop, holding back a character whose bytes are split across tokens.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from tandem.common.checkpoint_files import read_json

ChatMessages = Sequence[Mapping[str, Any]] | Sequence[tuple[str, str]]
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """The checkpoint has no chat template, or its template rejected the messages."""


class Tokenizer:
    """Encode/decode plus the special-token facts the engine needs.

    ``vocab_size`` counts the tokenizer's tokens (added tokens included); a model's
    embedding table may be larger. ``bos_token_id`` is ``None`` when the checkpoint
    names no BOS token. ``eos_token_ids`` is the union of ``eos_token_id`` in
    ``config.json`` and ``generation_config.json`` (an int or a list) and the
    tokenizer's ``eos_token``; it may be empty.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        special_tokens: Mapping[str, str],
        bos_token_id: int | None,
        eos_token_ids: frozenset[int],
        chat_template: str | None,
    ) -> None:
        self._backend = backend
        self._special_tokens = dict(special_tokens)
        self._bos_token_id = bos_token_id
        self._eos_token_ids = eos_token_ids
        # Compiled once here, so a broken template fails at start-up, not per request.
        self._chat_template = _jinja_env().from_string(chat_template) if chat_template else None
        added = backend.get_added_tokens_decoder()
        self._special_token_ids = frozenset(i for i, t in added.items() if t.special)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        """Load from a HF checkpoint directory; only ``tokenizer.json`` is required. A
        missing ``tokenizer.json``, or any of the files that does not parse, is a
        ``ValueError`` naming the file."""
        root = Path(model_dir)
        backend = _backend(root / "tokenizer.json")
        tok_config = read_json(root / "tokenizer_config.json", required=False)
        special = {k: v for k in _SPECIAL_TOKEN_KEYS if (v := _token_text(tok_config.get(k)))}
        bos_id = _token_id(backend, special.get("bos_token"))
        if bos_id is None:
            bos_id = _first_id(read_json(root / "config.json", required=False).get("bos_token_id"))
        eos_ids = _as_ids(_token_id(backend, special.get("eos_token")))
        for name in ("config.json", "generation_config.json"):
            eos_ids |= _as_ids(read_json(root / name, required=False).get("eos_token_id"))
        template = _chat_template(root, tok_config)
        return cls(backend, special, bos_id, frozenset(eos_ids), template)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
        return self._special_token_ids

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; ``add_special_tokens`` runs the post-processor (e.g. adds BOS)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: ChatMessages,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a chat as HF does (sandboxed jinja2, ``trim_blocks``/``lstrip_blocks``).

        ``messages`` are mappings (``role``, ``content``, and for tool use an assistant
        turn's ``tool_calls`` or a tool turn's ``tool_call_id`` / ``name``) or
        ``(role, content)`` pairs. The template sees ``messages``, ``tools`` (OpenAI's
        function objects; ``None`` without), ``add_generation_prompt``, the special token
        strings (``bos_token``, ``eos_token``, ...) and ``template_kwargs`` (e.g.
        ``enable_thinking``). Templates usually emit BOS themselves, so encode the result
        with ``add_special_tokens=False``. Raises ``ChatTemplateError`` when there is no
        template or the template rejects the chat.
        """
        if self._chat_template is None:
            raise ChatTemplateError(
                "this checkpoint has no chat template (none in tokenizer_config.json or "
                "chat_template.jinja); send a plain prompt instead of chat messages"
            )
        chat = [_as_message(m) for m in messages]
        variables = {**template_kwargs, **self._special_tokens}
        try:
            return self._chat_template.render(
                messages=chat,
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as e:
            # A template indexing a message or tool the way its model expects and this
            # chat does not (``tool_call.function.arguments|items`` on a string, ...).
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer with another chat template (``--chat-template``); a template
        that does not compile is a ``ChatTemplateError``."""
        try:
            return Tokenizer(
                self._backend,
                self._special_tokens,
                self._bos_token_id,
                self._eos_token_ids,
                template,
            )
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e


def read_chat_template(value: str) -> str:
    """``--chat-template``'s value, as vLLM reads it: a file's path, else the template
    text itself (which must hold a jinja tag, so a mistyped path is not taken for one)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ChatTemplateError(f"--chat-template {value}: no such file, nor a jinja template")


class IncrementalDetokenizer:
    """One request's output ids turned into text, one chunk per ``push``.

    Contract: each ``push`` returns only newly completed text and never a character
    whose bytes are still arriving (it is held back until complete), and
    ``"".join(pushes) + flush()`` equals ``tokenizer.decode(all_ids,
    skip_special_tokens)``. ``flush`` ends the stream: it returns whatever is still held
    (an incomplete trailing character comes out as U+FFFD, as in the full decode), and
    pushing afterwards raises ``RuntimeError``.

    Method: the window ``ids[prefix:]`` is decoded on each push, and the text beyond
    the already emitted ``ids[prefix:read]`` is new; keeping ``prefix`` one chunk back
    gives the decoder the context it needs (e.g. SentencePiece's leading space). When
    the text ends in U+FFFD the tail is held, normally for at most 3 tokens: a
    still-incomplete UTF-8 character has at most 3 bytes and every token decodes to at
    least one byte, so text before the last 3 tokens is final unless a character or a
    run of invalid bytes (one U+FFFD) straddles that boundary, which is checked by
    decoding both sides. Bytes that can never form a character come out as U+FFFD.
    Skipped special tokens are dropped before they reach the window.

    Cost: the window stays a few tokens long, so a push costs two ``tokenizers``
    decodes of a handful of ids (four while a tail is held), O(1) in the output
    length: about 8 µs per token with the made tokenizers.
    ``tokenizers.decoders.DecodeStream`` is not used: it has no way to flush a held
    tail, and holds an invalid-byte tail indefinitely.
    """

    _MAX_HELD_TOKENS = 3

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._dropped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._window: list[int] = []
        self._read = 0  # window[:read] is emitted; its text is self._prefix_text
        self._prefix_text = ""
        self._finished = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add the next ids; return the text they complete (often ``""`` or one piece)."""
        if self._finished:
            raise RuntimeError("push() after flush(): the stream has ended")
        before = len(self._window)
        self._window.extend(t for t in token_ids if t not in self._dropped)
        if len(self._window) == before:
            return ""
        text = self._decode(self._window)
        if not text.endswith("\ufffd"):
            return self._emit(text, len(self._window))
        return self._emit_final_part(text)

    def flush(self) -> str:
        """End the stream and return everything still held back."""
        self._finished = True
        if len(self._window) == self._read:
            return ""
        return self._emit(self._decode(self._window), len(self._window))

    def _emit_final_part(self, text: str) -> str:
        """Emit the text before the last ``_MAX_HELD_TOKENS`` ids if nothing straddles it."""
        end = len(self._window) - self._MAX_HELD_TOKENS
        if end <= self._read:
            return ""
        final = self._decode(self._window[:end])
        next_prefix_text = self._decode(self._window[self._read : end])
        rest = self._decode(self._window[self._read :])[len(next_prefix_text) :]
        if final + rest != text:  # `end` cuts a character or an invalid byte run in two
            return ""
        return self._advance(final, end, next_prefix_text)

    def _emit(self, text: str, end: int) -> str:
        """Emit ``text`` (the decode of ``window[:end]``) past the prefix; slide the window."""
        return self._advance(text, end, self._decode(self._window[self._read : end]))

    def _advance(self, text: str, end: int, next_prefix_text: str) -> str:
        new_text = text[len(self._prefix_text) :]
        self._window = self._window[self._read :]
        self._read = end - self._read
        self._prefix_text = next_prefix_text
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment HF renders chat templates in, with the helpers templates use."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _as_message(message: Mapping[str, Any] | tuple[str, str]) -> dict[str, Any]:
    if isinstance(message, tuple):
        role, content = message
        return {"role": role, "content": content}
    return dict(message)


def _chat_template(root: Path, tok_config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` (transformers 5) wins over ``tokenizer_config.json``."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _backend(path: Path) -> HFTokenizer:
    if not path.is_file():
        raise ValueError(f"model directory {path.parent} has no {path.name}")
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot read
        raise ValueError(f"{path} is not a tokenizers file: {err}") from None


def _token_text(value: str | Mapping[str, Any] | None) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _token_id(backend: HFTokenizer, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)


def _as_ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def _first_id(value: int | list[int] | None) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value
