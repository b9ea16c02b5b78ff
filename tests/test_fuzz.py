"""Property-based fuzzing of every wire message against a real cluster (router, one
prefill and one decode worker as processes): whatever a caller sends — a random
message, a valid one with random fields merged over it, or bytes that are not a message
at all — the answer is a well-formed stream or a clean error status with a message, and
afterwards every server is healthy and every KV block is back in its pool.

``TANDEM_FUZZ_EXAMPLES`` sets the examples per target (default 30); under ``CI`` the
draw is derandomized so a CI run is repeatable, elsewhere each run explores anew
(hypothesis prints the failing example).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.cli.launcher import LocalCluster
from tandem.protos import (
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.cluster_util import cluster_spec, worker_status
from tests.fuzz_messages import messages, mutated

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

VOCAB = 4096
CALL_TIMEOUT_S = 60.0
CLEAN_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)
"""What a bad request may get. Never UNKNOWN or INTERNAL (a server bug), UNAVAILABLE (a
crash) or DEADLINE_EXCEEDED (a hang)."""

FUZZ = settings(
    max_examples=int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "30")),
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def cluster(
    make_checkpoint: Callable[..., Path], redis_url: str, tmp_path_factory
) -> Iterator[LocalCluster]:
    spec = cluster_spec(
        make_checkpoint("llama"),
        redis_url,
        tmp_path_factory.mktemp("fuzz-logs"),
        "fuzz",
        worker_args=("--num-kv-blocks", "160", "--max-num-seqs", "16", "--max-model-len", "512"),
        prefill_args=("--lease-ttl", "3"),  # leases of direct Prefill calls expire soon
        decode_args=("--kv-pull-timeout", "2"),
        router_args=("--disaggregation-min-tokens", "8"),
    )
    with LocalCluster(spec) as running:
        yield running


# --- what a valid request looks like (the base the mutations start from) --------------

_TOKENS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
_SAMPLING = st.builds(
    common_pb2.SamplingParams,
    max_tokens=st.integers(1, 12),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    seed=st.integers(0, 2**32),
)


def _generate_requests() -> st.SearchStrategy[generation_pb2.GenerateRequest]:
    prompt = st.one_of(
        st.text(min_size=1, max_size=60).map(lambda p: {"prompt": p}),
        _TOKENS.map(lambda t: {"token_ids": common_pb2.TokenIds(ids=t)}),
    )
    return st.builds(
        lambda p, s: generation_pb2.GenerateRequest(sampling=s, **p), prompt, _SAMPLING
    )


def _decode_requests() -> st.SearchStrategy[worker_pb2.DecodeRequest]:
    return st.builds(
        worker_pb2.DecodeRequest,
        request_id=st.uuids().map(str),
        prompt_token_ids=_TOKENS,
        sampling=_SAMPLING,
    )


def _prefill_requests() -> st.SearchStrategy[worker_pb2.PrefillRequest]:
    return st.builds(
        worker_pb2.PrefillRequest,
        request_id=st.uuids().map(str),
        prompt_token_ids=_TOKENS,
        sampling=_SAMPLING,
    )


def _any(descriptor, valid: st.SearchStrategy | None = None) -> st.SearchStrategy:
    random = messages(descriptor)
    return random if valid is None else st.one_of(random, mutated(valid), valid)


# --- what an answer must look like -----------------------------------------------------


OUTCOMES: Counter[str] = Counter()
"""Answers seen, by status code name (OK for a well-formed stream or reply): each target
must see both kinds, or the fuzzer never got past the first check."""


def _clean(error: grpc.RpcError) -> None:
    code, details = error.code(), error.details() or ""
    OUTCOMES[code.name] += 1
    assert code in CLEAN_ERRORS, f"{code.name}: {details}"
    assert details.strip(), f"{code.name} without a message"


def _check_stream(responses: list, final_has_usage: bool) -> None:
    """Token messages, then exactly one message with the finish reason, then nothing."""
    assert responses, "a stream that ended without a message"
    *body, last = responses
    assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in body)
    assert last.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    if final_has_usage:
        generated = sum(len(r.token_ids) for r in responses)
        assert last.HasField("usage") and last.usage.completion_tokens == generated


def _call_stream(call: Callable, request, final_has_usage: bool) -> None:
    try:
        responses = list(call(request, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as error:
        _clean(error)
        return
    _check_stream(responses, final_has_usage)
    OUTCOMES["OK"] += 1


def _call_unary(call: Callable, request) -> None:
    try:
        call(request, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as error:
        _clean(error)
        return
    OUTCOMES["OK"] += 1


# --- the targets -----------------------------------------------------------------------


def test_fuzz_the_public_generate_call(cluster: LocalCluster) -> None:
    with cluster.router_channel() as channel:
        generate = generation_pb2_grpc.GenerationStub(channel).Generate

        @FUZZ
        @given(_any(generation_pb2.GenerateRequest.DESCRIPTOR, _generate_requests()))
        def run(request: generation_pb2.GenerateRequest) -> None:
            _call_stream(generate, request, final_has_usage=True)

        run()
    _assert_cluster_healthy_and_idle(cluster)


def test_fuzz_the_worker_calls(cluster: LocalCluster) -> None:
    with cluster.worker_channel("prefill-0") as p, cluster.worker_channel("decode-0") as d:
        prefill, decode = worker_pb2_grpc.PrefillWorkerStub(p), worker_pb2_grpc.DecodeWorkerStub(d)
        kv = kv_transfer_pb2_grpc.KVTransferStub(p)
        unary_targets = [
            (prefill.Prefill, _any(worker_pb2.PrefillRequest.DESCRIPTOR, _prefill_requests())),
            (prefill.Abort, _any(worker_pb2.AbortRequest.DESCRIPTOR)),
            (decode.Abort, _any(worker_pb2.AbortRequest.DESCRIPTOR)),
            (prefill.ListCachedBlocks, _any(worker_pb2.ListCachedBlocksRequest.DESCRIPTOR)),
            (kv.Handshake, _any(kv_transfer_pb2.HandshakeRequest.DESCRIPTOR)),
            (kv.PullBlocks, _any(kv_transfer_pb2.PullBlocksRequest.DESCRIPTOR)),
            (kv.RenewLease, _any(kv_transfer_pb2.LeaseRequest.DESCRIPTOR)),
            (kv.ReleaseLease, _any(kv_transfer_pb2.LeaseRequest.DESCRIPTOR)),
        ]
        unary = st.one_of(*(st.tuples(st.just(c), s) for c, s in unary_targets))

        @FUZZ
        @given(_any(worker_pb2.DecodeRequest.DESCRIPTOR, _decode_requests()))
        def run_decode(request: worker_pb2.DecodeRequest) -> None:
            _call_stream(decode.Decode, request, final_has_usage=False)

        @FUZZ
        @given(unary)
        def run_unary(target: tuple[Callable, object]) -> None:
            _call_unary(*target)

        run_decode()
        run_unary()
    _assert_cluster_healthy_and_idle(cluster)


def test_fuzz_bytes_that_are_not_messages(cluster: LocalCluster) -> None:
    methods = [
        ("router", "/tandem.v1.Generation/Generate", True),
        ("prefill-0", "/tandem.v1.PrefillWorker/Prefill", False),
        ("decode-0", "/tandem.v1.DecodeWorker/Decode", True),
        ("prefill-0", "/tandem.v1.KVTransfer/PullBlocks", False),
    ]
    channels = {
        "router": cluster.router_channel(),
        "prefill-0": cluster.worker_channel("prefill-0"),
        "decode-0": cluster.worker_channel("decode-0"),
    }
    try:
        # Not a message at all (a truncated varint): INVALID_ARGUMENT naming the type.
        generate = channels["router"].unary_stream(methods[0][1])
        with pytest.raises(grpc.RpcError) as caught:
            list(generate(b"\xff", timeout=CALL_TIMEOUT_S))
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf message" in caught.value.details()
        assert "GenerateRequest" in caught.value.details()

        @FUZZ
        @given(st.sampled_from(methods), st.binary(max_size=256))
        def run(method: tuple[str, str, bool], payload: bytes) -> None:
            target, path, streaming = method
            channel = channels[target]
            make = channel.unary_stream if streaming else channel.unary_unary
            call = make(path, request_serializer=None, response_deserializer=None)
            try:
                answer = call(payload, timeout=CALL_TIMEOUT_S)
                if streaming:
                    list(answer)
            except grpc.RpcError as error:
                _clean(error)
                return
            OUTCOMES["OK"] += 1

        run()
    finally:
        for channel in channels.values():
            channel.close()
    _assert_cluster_healthy_and_idle(cluster, both_kinds=False)  # random bytes rarely parse


def _assert_cluster_healthy_and_idle(
    cluster: LocalCluster, both_kinds: bool = True, timeout_s: float = 30.0
) -> None:
    """Answers both good and refused were seen (``both_kinds``); every process alive
    and ready; both pools back to every block free, no lease, no sequence (leases of
    abandoned direct Prefill calls expire after the 3 s TTL)."""
    seen = dict(OUTCOMES)
    OUTCOMES.clear()
    print(f"answers: {seen}")
    if both_kinds:
        assert seen.get("OK") and sum(seen.values()) > seen["OK"], f"one kind only: {seen}"
    for name, child in cluster.children.items():
        assert child.process.poll() is None, f"{name} died"
    assert cluster.router_health() == health_pb2.HealthCheckResponse.SERVING
    for name in ("prefill-0", "decode-0"):
        with cluster.worker_channel(name) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert check.status == health_pb2.HealthCheckResponse.SERVING, name
    deadline = time.monotonic() + timeout_s
    while True:
        p, d = worker_status(cluster, "prefill-0"), worker_status(cluster, "decode-0")
        leaked = {
            "prefill blocks in use": p.num_kv_blocks - p.num_free_kv_blocks,
            "prefill leases": p.num_leases,
            "prefill running": p.num_running,
            "decode blocks in use": d.num_kv_blocks - d.num_free_kv_blocks,
            "decode running": d.num_running + d.num_waiting,
        }
        if not any(leaked.values()):
            return
        assert time.monotonic() < deadline, f"not back to idle: {leaked}"
        time.sleep(0.25)
