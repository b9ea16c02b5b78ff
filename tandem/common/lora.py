"""LoRA adapters as the serving side names them: ``LoRARequest`` (vLLM's), the
``--lora-modules`` flag's forms, and an adapter directory's identity.

Torch-free: the router parses ``--lora-modules``, and computes the prefix hashes of an
adapter's requests from its ``kv_namespace``, without loading any weight.

An adapter directory is PEFT's format: ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, ...) and ``adapter_model.safetensors``. Its
``kv_namespace`` roots the chained block hashes of every request that runs under it
(``tandem.common.hashing.root_hash``): ``lora:{name}:{digest}`` with the digest of the
two files, so KV computed under one adapter is never found by a request of another
(nor by the base model's, whose root is the empty namespace), and re-loading a name with
other weights never reuses the blocks of the old ones.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.common.checkpoint_files import read_json

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name: ``LoRARequest("sql", 1, "/adapters/sql")`` as in vLLM.
    ``lora_int_id`` is the caller's handle (unique per name; > 0); the engine keys
    adapters by name. ``base_model_name``: the model it was trained for, as listed by
    ``/v1/models`` (informational)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name or not isinstance(self.lora_name, str):
            raise ValueError("a LoRA adapter needs a non-empty name")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a path")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def parse_lora_module(spec: str) -> tuple[str, str, str | None]:
    """One ``--lora-modules`` value: ``name=path``, or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``; returns (name, path, base)."""
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            value: Any = json.loads(spec)
        except ValueError as err:
            raise ValueError(f"--lora-modules {spec!r} is not valid JSON: {err}") from None
        if not isinstance(value, dict) or not value.get("name") or not value.get("path"):
            raise ValueError(f"--lora-modules {spec!r} needs 'name' and 'path'")
        unknown = set(value) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules {spec!r}: unknown keys {sorted(unknown)}")
        return str(value["name"]), str(value["path"]), value.get("base_model_name")
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules takes name=path or a JSON object, not {spec!r}")
    return name.strip(), path.strip(), None


def lora_requests(specs: list[str] | tuple[str, ...]) -> list[LoRARequest]:
    """``--lora-modules`` values as requests, numbered from 1 in order; a name given
    twice is refused."""
    out: list[LoRARequest] = []
    for spec in specs:
        name, path, base = parse_lora_module(spec)
        if any(r.lora_name == name for r in out):
            raise ValueError(f"--lora-modules names adapter {name!r} twice")
        out.append(LoRARequest(name, len(out) + 1, path, base))
    return out


def read_adapter_config(path: str | Path, name: str) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``; ``ValueError`` naming the adapter and the
    file when the directory or the file is missing or not JSON."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"LoRA adapter {name!r}: {directory} is not a directory")
    if not (directory / ADAPTER_CONFIG).exists():
        raise ValueError(f"LoRA adapter {name!r}: no {ADAPTER_CONFIG} in {directory}")
    return read_json(directory / ADAPTER_CONFIG)


def adapter_weights_file(path: str | Path, name: str) -> Path:
    """The adapter's safetensors file; ``ValueError`` when it is missing (a ``.bin``
    pickle is refused: it runs code when read)."""
    directory = Path(path)
    weights = directory / ADAPTER_WEIGHTS
    if weights.exists():
        return weights
    if (directory / "adapter_model.bin").exists():
        raise ValueError(
            f"LoRA adapter {name!r}: {directory} holds adapter_model.bin; Tandem reads "
            f"only {ADAPTER_WEIGHTS} (save with safe_serialization=True)"
        )
    raise ValueError(f"LoRA adapter {name!r}: no {ADAPTER_WEIGHTS} in {directory}")


def kv_namespace(name: str, path: str | Path) -> str:
    """The root namespace of the block hashes of requests run under this adapter (module
    docstring): the name and a digest of the adapter's two files."""
    digest = hashlib.blake2b(digest_size=8)
    for file in (Path(path) / ADAPTER_CONFIG, adapter_weights_file(path, name)):
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return f"lora:{name}:{digest.hexdigest()}"
