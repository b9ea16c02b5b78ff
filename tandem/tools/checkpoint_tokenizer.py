"""The byte-level BPE tokenizer that made checkpoints ship with.

Nothing may be downloaded, so the tokenizer is trained here, with HF ``tokenizers``, on
text every machine has: the running Python's standard library. The corpus is the
top-level ``*.py`` files of the stdlib directory in sorted name order, up to
``CORPUS_BYTES`` (``corpus_files``); training on it takes under a second. The result is
deterministic for one Python installation (another Python version has other sources,
hence another vocabulary) and is cached under ``$XDG_CACHE_HOME/tandem`` (default
``~/.cache/tandem``), keyed by the vocabulary size and a hash of the corpus, so test
fixtures that make many checkpoints train it once.

Special tokens come first (ids 0..4, see ``SPECIAL_TOKENS``). ``encode`` prepends
``<|bos|>`` through a post-processor, as Llama 3's tokenizer does. The chat template is a
small ChatML dialect: it starts with ``bos_token``, so a rendered chat is encoded with
``add_special_tokens=False``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS_BYTES = 3_000_000
_NOT_CORPUS_DIRS = frozenset(
    {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "turtledemo"}
)
_RECIPE_VERSION = 1  # bump when the training recipe changes, to invalidate caches

BOS, EOS, PAD, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD, IM_START, IM_END)
MIN_VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] in ('system', 'developer') %}"
    "{{ messages[0]['content'] }}\n\n{% endif %}"
    "Functions you can call, one JSON schema each, between <tools> and </tools>:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}"
    "{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}"
    "{% endfor %}{{ '\\n' }}</tools>\n\n"
    "To call one, answer with its name and arguments as a JSON object between "
    "<tool_call> and </tool_call>, one block per call:\n<tool_call>\n"
    '{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
    "<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'system' if message['role'] == 'developer' else message['role'] %}"
    "{% if role not in ('system', 'user', 'assistant', 'tool') %}"
    "{{ raise_exception('Unknown chat role: ' ~ role) }}"
    "{% elif tools and loop.first and role == 'system' %}"
    "{% elif role == 'assistant' and message['tool_calls'] %}"
    "<|im_start|>assistant"
    "{% if message['content'] %}{{ '\\n' }}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    "{{ '\\n' }}<tool_call>\n{\"name\": {{ call['name'] | tojson }}, \"arguments\": "
    "{{ call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif role == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ role }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with tool use in the Hermes convention (the one ``--tool-call-parser hermes``
reads): the tools listed in a system turn, each call a ``<tool_call>`` JSON block, tool
results as ``<tool_response>`` blocks of a user turn. OpenAI's ``developer`` role (the
newer name for instructions) is a system turn. Without tools it renders as plain
ChatML."""


@dataclass(frozen=True)
class TokenIds:
    """Ids of the special tokens a checkpoint's configs refer to."""

    bos: int
    eos: int
    pad: int
    end_of_turn: int


def corpus_files(max_bytes: int | None = CORPUS_BYTES) -> list[Path]:
    """Stdlib sources in corpus order until ``max_bytes`` are reached (``None``: all).

    The order: the top-level ``*.py`` files by name, then the packages' sources by path,
    leaving out tests, generated tables and third-party ``site-packages``. The tokenizer
    trains on the default selection, which the top-level files alone fill; training a
    model (``tandem.tools.training``) may read further.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    packages = (
        path
        for path in sorted(stdlib.glob("*/**/*.py"))
        if not _NOT_CORPUS_DIRS.intersection(path.relative_to(stdlib).parts)
    )
    selected: list[Path] = []
    total = 0
    for path in itertools.chain(sorted(stdlib.glob("*.py")), packages):
        if max_bytes is not None and total >= max_bytes:
            break
        selected.append(path)
        total += path.stat().st_size
    return selected


def corpus_texts(files: list[Path] | None = None) -> list[str]:
    """The text of ``files`` (default: ``corpus_files()``), one string per file, in order."""
    paths = corpus_files() if files is None else files
    return [path.read_text(encoding="utf-8", errors="replace") for path in paths]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tandem"


def load_or_train(vocab_size: int) -> Tokenizer:
    """The trained tokenizer for ``vocab_size``, from the cache when it is there."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    files = corpus_files()
    path = cache_dir() / f"bpe-v{_RECIPE_VERSION}-{vocab_size}-{_corpus_hash(files)}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = train(files, vocab_size)
    _write_atomically(path, tokenizer.to_str())
    return tokenizer


def train(files: list[Path], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with exactly ``vocab_size`` tokens (specials included)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts(files), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"corpus too small for {vocab_size} tokens: got {tokenizer.get_vocab_size()}"
        )
    return tokenizer


def write_tokenizer(out_dir: Path, vocab_size: int, max_length: int) -> TokenIds:
    """Write ``tokenizer.json`` and ``tokenizer_config.json``; return the special ids."""
    tokenizer = load_or_train(vocab_size)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return special_token_ids(tokenizer)


def special_token_ids(tokenizer: Tokenizer) -> TokenIds:
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    return TokenIds(bos=ids[BOS], eos=ids[EOS], pad=ids[PAD], end_of_turn=ids[IM_END])


def _corpus_hash(files: list[Path]) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _write_atomically(path: Path, text: str) -> None:
    # Concurrent test processes may train at once; each renames a complete file into place.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
