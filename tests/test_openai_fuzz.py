"""No input gets a 5xx: schemathesis drives every operation of the router's own OpenAPI
schema (``/openapi.json``, as served) with bodies that follow it and bodies that break
it, against a real cluster; then the inputs a schema cannot describe (bytes that are not
UTF-8, JSON nested past any parser's depth, bodies that are not JSON).

Bounded in time: a small context (``--max-model-len 96``) keeps every generation short,
and each operation gets a fixed number of examples."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from tandem.cli.launcher import LocalCluster  # noqa: E402
from tests.cluster_util import cluster_spec, free_port, held_kv  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "sk-fuzz"
EXAMPLES = 30
"""Per operation and mode; with 7 operations and 2 modes about 400 requests."""


@pytest.fixture(scope="module")
def base_url(
    make_checkpoint: Callable[..., Path], redis_url: str, tmp_path_factory
) -> Iterator[str]:
    http_port = free_port()
    spec = cluster_spec(
        make_checkpoint("llama"),
        redis_url,
        tmp_path_factory.mktemp("fuzz-logs"),
        "fuzz",
        worker_args=("--num-kv-blocks", "128", "--max-model-len", "96"),
        router_args=(
            *("--http-port", str(http_port), "--max-model-len", "96"),
            *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
        ),
        api_keys=(KEY,),
    )
    with LocalCluster(spec) as running:
        yield f"http://127.0.0.1:{http_port}"
        # Every request the fuzzing made has ended: nothing left running or holding KV.
        assert held_kv(running) == (0, 0, 0, 0)


@pytest.fixture(scope="module")
def api_schema(base_url: str):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES
    )
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")
SEEN: collections.Counter[tuple[str, str, int]] = collections.Counter()
"""(method, path, status) of every fuzzed request, for the check that follows."""


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)
def test_no_operation_answers_5xx(case, base_url: str) -> None:
    response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    SEEN[(case.method, case.path, response.status_code)] += 1
    assert response.status_code < 500, (
        f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text}"
    )
    if response.status_code >= 400:
        # OpenAI's shape, with a message a person reads
        error = response.json().get("error", {})
        assert error.get("message") and error.get("type"), (
            f"{case.method} {case.path} -> {response.status_code} {response.text}"
        )


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b'{"model": "", "prompt": "caf\xe9", "max_tokens": 2}', "application/json"),  # latin-1
        (b"\xff\xfe\x00garbage", "application/json"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json"),  # deeper than any parser goes
        (b'{"prompt": ' + b'{"a": ' * 5_000 + b"1" + b"}" * 5_000 + b"}", "application/json"),
        (b"prompt=hi", "application/x-www-form-urlencoded"),
        (b'{"prompt": "hi", "max_tokens": 1e400}', "application/json"),
        (b'{"prompt": "hi", "n": 99999999999999999999999}', "application/json"),
        (b"", "application/json"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_bodies_no_schema_describes_are_400s(
    base_url: str, path: str, body: bytes, content_type: str
) -> None:
    if path == "/tokenize" and (b"max_tokens" in body or b'"n"' in body):
        pytest.skip("/tokenize takes no sampling fields")
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": content_type}
    response = httpx.post(f"{base_url}{path}", content=body, headers=headers, timeout=60)
    assert response.status_code in (400, 422), response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_fuzzing_reached_the_model() -> None:
    """The cases above ran many requests, and valid ones generated text (200s on both
    completion endpoints), so the no-5xx result covers real generation too."""
    print(sorted(SEEN.items()))
    assert sum(SEEN.values()) >= 100
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert SEEN[("POST", path, 200)] > 0, SEEN
        assert SEEN[("POST", path, 400)] > 0, SEEN
