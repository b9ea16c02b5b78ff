"""What a registry entry says about a worker, and its versioned JSON form.

The codec is explicit field by field, so an entry is either fully typed and
range-checked or rejected with ``RegistryDecodeError``: nothing untyped leaves here.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TypeVar

SCHEMA_VERSION = 1
"""Version of the JSON entry; bump it on any incompatible change of the fields below."""

BUSY_WINDOW_S = 10.0
"""Time constant (seconds) of the decayed average behind ``WorkerLoad.busy_fraction``."""

_T = TypeVar("_T")


class WorkerRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class WorkerCapacity:
    """A worker's fixed size: its KV cache, how many sequences it batches at most, and
    the longest prompt + output it takes (``max_model_len``, which the engine may have
    fitted to its KV cache; ``None`` from a worker that predates the field). The router
    checks prompts against the smallest ``max_model_len`` of the live workers."""

    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_num_seqs"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker serves and how to reach it; constant for the worker's lifetime.

    ``address`` is the host:port of its gRPC server. ``kv_endpoint`` is opaque to the
    registry (the KV-transfer layer defines it) and empty when the worker takes no part
    in KV transfer.
    """

    worker_id: str
    role: WorkerRole
    address: str
    model: str
    capacity: WorkerCapacity
    kv_endpoint: str = ""

    def __post_init__(self) -> None:
        for name in ("worker_id", "address", "model"):
            _check(bool(getattr(self, name)), f"{name} must not be empty")


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load at ``updated_at`` (seconds since the epoch, the worker's clock)."""

    free_kv_blocks: int
    num_running_seqs: int
    num_waiting_seqs: int
    num_queued_prefill_tokens: int
    updated_at: float = field(default_factory=time.time)
    busy_fraction: float = 0.0
    """Share of recent time the engine spent stepping (decayed average, ``BUSY_WINDOW_S``):
    what a momentary queue does not show, e.g. a worker idle at every report but busy
    three times as often as the others."""
    adapters: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)
    """LoRA adapters loaded here: name -> KV namespace (the root of their block hashes)."""
    resident_adapters: tuple[str, ...] = ()
    """Of those, the ones in memory (the others are read from disk when next used)."""
    max_loras: int = 0
    """Adapters one batch may mix here; 0: the worker serves no LoRA adapters."""

    def __post_init__(self) -> None:
        _check(self.busy_fraction >= 0, "busy_fraction must be >= 0")
        for name in (
            "free_kv_blocks",
            "num_running_seqs",
            "num_waiting_seqs",
            "num_queued_prefill_tokens",
        ):
            _check(getattr(self, name) >= 0, f"{name} must be >= 0")

    @classmethod
    def idle(cls, capacity: WorkerCapacity) -> WorkerLoad:
        """An empty worker, stamped now: every block free, nothing running or queued."""
        return cls(capacity.num_kv_blocks, 0, 0, 0)


@dataclass(frozen=True)
class WorkerRecord:
    """One registry entry: a worker's fixed info and its latest reported load."""

    info: WorkerInfo
    load: WorkerLoad


class RegistryDecodeError(ValueError):
    """An entry that cannot be read: not JSON, wrong shape, or unknown schema version."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"registry entry {key!r} is unreadable: {reason}")
        self.key = key
        self.reason = reason


def encode_record(record: WorkerRecord) -> str:
    """The JSON text stored under a worker's key."""
    info = {**asdict(record.info), "role": record.info.role.value}
    doc = {"schema_version": SCHEMA_VERSION, "info": info, "load": asdict(record.load)}
    return json.dumps(doc, separators=(",", ":"))


def decode_record(raw: bytes | str, key: str) -> WorkerRecord:
    """Parse what ``encode_record`` wrote; raises ``RegistryDecodeError`` naming ``key``."""
    try:
        return _record_from_json(json.loads(raw))
    except ValueError as err:  # bad UTF-8 or JSON, wrong shape, out-of-range values
        raise RegistryDecodeError(key, str(err)) from err


def _record_from_json(doc: object) -> WorkerRecord:
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    version = _require(doc, "schema_version", int)
    if version != SCHEMA_VERSION:
        raise ValueError(f"unknown schema_version {version} (this build reads {SCHEMA_VERSION})")
    return WorkerRecord(
        _info_from_json(_require(doc, "info", dict)), _load_from_json(_require(doc, "load", dict))
    )


def _info_from_json(info: Mapping[str, object]) -> WorkerInfo:
    capacity = _require(info, "capacity", dict)
    return WorkerInfo(
        worker_id=_require(info, "worker_id", str),
        role=WorkerRole(_require(info, "role", str)),
        address=_require(info, "address", str),
        model=_require(info, "model", str),
        kv_endpoint=_require(info, "kv_endpoint", str),
        capacity=WorkerCapacity(
            num_kv_blocks=_require(capacity, "num_kv_blocks", int),
            block_size=_require(capacity, "block_size", int),
            max_num_seqs=_require(capacity, "max_num_seqs", int),
            max_model_len=_optional(capacity, "max_model_len", int),  # absent from older workers
        ),
    )


def _load_from_json(load: Mapping[str, object]) -> WorkerLoad:
    return WorkerLoad(
        free_kv_blocks=_require(load, "free_kv_blocks", int),
        num_running_seqs=_require(load, "num_running_seqs", int),
        num_waiting_seqs=_require(load, "num_waiting_seqs", int),
        num_queued_prefill_tokens=_require(load, "num_queued_prefill_tokens", int),
        updated_at=float(_require(load, "updated_at", (int, float))),
        busy_fraction=float(load.get("busy_fraction", 0.0)),  # absent from older workers
        adapters=_adapters(load.get("adapters", {})),  # absent without LoRA
        resident_adapters=_names(load.get("resident_adapters", [])),
        max_loras=_optional(load, "max_loras", int) or 0,
    )


def _names(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("field 'resident_adapters' must be a list of adapter names")
    return tuple(value)


def _adapters(value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError("field 'adapters' must map adapter names to KV namespaces")
    return dict(value)


def _require(obj: Mapping[str, object], name: str, kind: type[_T] | tuple[type, ...]) -> _T:
    """``obj[name]`` if present and of type ``kind`` (JSON booleans never count as numbers)."""
    if name not in obj:
        raise ValueError(f"missing field {name!r}")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"field {name!r} has the wrong type ({type(value).__name__})")
    return value  # type: ignore[return-value]


def _optional(obj: Mapping[str, object], name: str, kind: type[_T]) -> _T | None:
    """``obj[name]`` as ``_require`` checks it, or ``None`` when absent or null."""
    return None if obj.get(name) is None else _require(obj, name, kind)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
