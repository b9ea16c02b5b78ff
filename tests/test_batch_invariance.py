"""Batch-invariant numerics (``batch_invariant=True``): a sequence's logits do not depend
on the rest of its batch, on how its prompt was chunked, or on whether its KV came from
a prefill or from incremental decode. Checked bitwise on the logprobs of every token,
on a bfloat16 checkpoint (where the default path's rounding does move with the batch)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.engine import SamplingParams
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tests.hf_reference import random_prompts

N = 24
PARAMS = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", dtype="bfloat16")


def _engine(model_dir: Path, **config: object) -> LLMEngine:
    return LLMEngine(
        EngineConfig(str(model_dir), num_kv_blocks=256, batch_invariant=True, **config),
        detokenize=False,
    )


def _run(engine: LLMEngine, rid: str) -> list[tuple[int, tuple]]:
    """Every token of ``rid`` with its top logprobs, until nothing is left."""
    out: list[tuple[int, tuple]] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id == rid:
                for token, lp in zip(delta.new_token_ids, delta.new_logprobs, strict=True):
                    out.append((token, (lp.token_logprob, lp.top)))
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, 4096, (20, 90), seed=81)


@pytest.fixture(scope="module")
def alone(model_dir: Path, prompts) -> list[tuple[int, tuple]]:
    engine = _engine(model_dir)
    engine.add_request(prompts[0], PARAMS, "x")
    return _run(engine, "x")


def test_a_batch_does_not_change_a_sequence(model_dir: Path, prompts, alone) -> None:
    engine = _engine(model_dir)
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(prompt, PARAMS, f"other-{i}")
    engine.add_request(prompts[0], PARAMS, "x")
    assert _run(engine, "x") == alone


def test_chunking_does_not_change_a_sequence(model_dir: Path, prompts, alone) -> None:
    engine = _engine(model_dir, max_num_batched_tokens=7)
    engine.add_request(prompts[0], PARAMS, "x")
    assert _run(engine, "x") == alone


def test_a_recomputed_sequence_continues_as_if_decoded(model_dir: Path, prompts, alone) -> None:
    """The failover case: the KV of prompt + 10 output tokens computed by one prefill
    (with company) gives the very logits incremental decode gave."""
    engine = _engine(model_dir)
    engine.add_request(prompts[3], PARAMS, "company")
    produced = [token for token, _ in alone[:10]]
    engine.add_request(prompts[0], PARAMS, "x", output_token_ids=produced)
    assert _run(engine, "x") == alone[10:]


def test_speculation_does_not_change_a_sequence(model_dir: Path, prompts, alone) -> None:
    engine = _engine(model_dir, speculative_method="ngram")
    engine.add_request(prompts[0], PARAMS, "x")
    assert _run(engine, "x") == alone


def test_settings_it_cannot_honour_are_refused(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="batch_invariant computes in float32"):
        EngineConfig(str(model_dir), dtype="bfloat16", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant needs the native attention kernel"):
        _engine(model_dir, attention_backend="sdpa")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigstop_with_batch_invariance_recomputes_every_stream_bitwise(
    model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    """The issue's test: 1 prefill + 2 decode workers on a bfloat16 checkpoint, 6 greedy
    480-token streams; a decode worker is SIGSTOPped mid-stream, so the router moves its
    streams on and the next worker recomputes them from their tokens. With
    ``--batch-invariant`` every stream equals the offline engine's single-sequence run."""
    import asyncio
    import os
    import signal
    import uuid

    from tandem.cli.launcher import ClusterSpec, LocalCluster
    from tandem.common.client import AsyncGenerationClient, build_request
    from tandem.engine import LLM
    from tandem.protos import common_pb2
    from tests.cluster_util import free_port, worker_status

    decoders = ("decode-0", "decode-1")
    spec = ClusterSpec(
        model_dir=str(model_dir),
        num_decode=2,
        router_port=free_port(),
        redis_url=redis_url,
        model_name=f"invariant-{uuid.uuid4().hex[:8]}",
        worker_args=("--num-kv-blocks", "512", "--batch-invariant"),
        router_args=("--decode-policy", "round_robin", "--stall-timeout", "1"),
        threads_per_worker=1,
        log_dir=tmp_path / "logs",
        worker_env={n: {"TANDEM_FAULTS": "engine.step:delay=0.01"} for n in decoders},
    )
    prompts = random_prompts(6, 4096, (40, 120), seed=82)
    greedy = common_pb2.SamplingParams(max_tokens=480, temperature=0, ignore_eos=True)
    offline = LLM(model_dir, num_kv_blocks=256, batch_invariant=True)
    expected = [
        offline.generate([p], SamplingParams(temperature=0, max_tokens=480, ignore_eos=True))[
            0
        ].token_ids
        for p in prompts
    ]
    stopped: list[int] = []
    with LocalCluster(spec) as cluster:

        def stop_busiest() -> None:
            running = {n: worker_status(cluster, n).num_running for n in decoders}
            name = max(running, key=running.__getitem__)
            assert running[name] > 0
            stopped.append(cluster.children[name].process.pid)
            os.kill(stopped[0], signal.SIGSTOP)

        async def run() -> list[list[int]]:
            acted = asyncio.Event()

            async def one(client, prompt) -> list[int]:
                tokens: list[int] = []
                async for response in client.generate(build_request(prompt, greedy), timeout_s=240):
                    tokens += response.token_ids
                    if len(tokens) >= 40 and not acted.is_set():
                        acted.set()
                        await asyncio.to_thread(stop_busiest)
                return tokens

            async with AsyncGenerationClient(cluster.router_address) as client:
                return list(await asyncio.gather(*(one(client, p) for p in prompts)))

        try:
            got = asyncio.run(run())
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
    assert stopped
    assert got == expected
