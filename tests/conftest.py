"""Shared pytest fixtures."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from tandem.common.redis_server import resolve_redis_url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real Redis for the session: ``$TANDEM_TEST_REDIS_URL`` if set (CI), else embedded.

    Tests share it, so each one keeps to its own key prefix.
    """
    url, server = resolve_redis_url(os.environ.get("TANDEM_TEST_REDIS_URL") or None)
    try:
        yield url
    finally:
        if server is not None:
            server.stop()


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own, so tests sharing one Redis never meet.

    Its keys are deleted afterwards: CI's Redis outlives the test session.
    """
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    yield prefix
    with redis.Redis.from_url(redis_url) as client:
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make_checkpoint(arch="llama", size="tiny", **make_model_kwargs) -> Path``: a
    seeded random HuggingFace checkpoint, made once per session per argument set."""
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", size: str = "tiny", **kwargs: object) -> Path:
        key = (arch, size, *sorted(kwargs.items()))
        if key not in made:
            from tandem.tools.checkpoint_maker import make_model

            out = tmp_path_factory.mktemp(f"{arch}-{size}")
            made[key] = make_model(out, arch=arch, size=size, **kwargs)
        return made[key]

    return make
