"""How both sides of the registry talk to Redis: key names, notices, connections."""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import dataclass

import redis
import redis.asyncio

from tandem.common.registry.records import SCHEMA_VERSION

DEFAULT_PREFIX = "tandem:"

REDIS_ERRORS = (redis.RedisError, OSError)
"""What a Redis call raises when the server is down, restarting or unreachable."""

# Bounds one Redis round trip so a black-holed server cannot hang a loop forever
# (redis-py then retries a failed command a few times with backoff, about 2 s).
_SOCKET_TIMEOUT_S = 2.0

_log = logging.getLogger(__name__)


class RegistryEvent(enum.Enum):
    """The notices published on a model's events channel."""

    JOINED = "joined"
    LEFT = "left"


@dataclass(frozen=True)
class RegistryKeys:
    """The Redis names of one model's registry (layout in the package docstring)."""

    model: str
    prefix: str = DEFAULT_PREFIX

    @property
    def index(self) -> str:
        return f"{self.prefix}{self.model}:workers"

    @property
    def events(self) -> str:
        return f"{self.prefix}{self.model}:events"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}{self.model}:worker:{worker_id}"

    @property
    def sentinel(self) -> str:
        """Set by watchers and never expired: gone means Redis lost its data."""
        return f"{self.prefix}{self.model}:sentinel"


def encode_notice(event: RegistryEvent, worker_id: str) -> str:
    """The message published on the events channel."""
    doc = {"schema_version": SCHEMA_VERSION, "event": event.value, "worker_id": worker_id}
    return json.dumps(doc, separators=(",", ":"))


def connect(redis_url: str) -> redis.asyncio.Redis:
    """A lazily connecting client (bytes replies) with bounded socket timeouts."""
    return redis.asyncio.Redis.from_url(
        redis_url, socket_timeout=_SOCKET_TIMEOUT_S, socket_connect_timeout=_SOCKET_TIMEOUT_S
    )


class FailureLog:
    """Logs the first error of a run of failures and the recovery, not every retry."""

    def __init__(self, what: str):
        self._what = what
        self._failing = False

    def failed(self, err: BaseException) -> None:
        if not self._failing:
            _log.warning("%s failed, will retry: %r", self._what, err)
        self._failing = True

    def succeeded(self) -> None:
        if self._failing:
            _log.info("%s works again", self._what)
        self._failing = False
