"""LoRA adapters through the disaggregated cluster (router, one prefill and one decode
worker, real gRPC, Redis and the ``openai`` client): adapters from ``--lora-modules``
listed by ``/v1/models`` with their parent and selected by ``model``; each adapter's
greedy tokens through prefill -> KV transfer -> decode equal PEFT's merged model, with
base and adapter requests in flight together; prefix-cache hits only within an adapter;
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` on every worker at run time,
a bad adapter refused by name; metrics per adapter."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.cli.launcher import LocalCluster
from tandem.common.client import AsyncGenerationClient, build_request
from tandem.common.tokenizer import Tokenizer
from tandem.tools.lora_maker import make_lora
from tests.cluster_util import cluster_spec, free_port, greedy, held_kv
from tests.hf_reference import hf_greedy, random_prompts
from tests.test_lora import peft_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NEW = 10


@pytest.fixture(scope="module")
def base(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cluster-adapters")
    return {
        "sql": make_lora(base, root / "sql", 8, 16.0, ("q_proj", "v_proj", "down_proj"), seed=1),
        "chat": make_lora(base, root / "chat", 16, 32.0, ("k_proj", "o_proj", "up_proj"), seed=2),
        "late": make_lora(base, root / "late", 4, 8.0, ("q_proj", "gate_proj"), seed=3),
    }


@pytest.fixture(scope="module")
def cluster(base, adapters, redis_url, tmp_path_factory) -> Iterator[tuple[LocalCluster, int]]:
    http_port = free_port()
    spec = cluster_spec(
        base,
        redis_url,
        tmp_path_factory.mktemp("lora-logs"),
        "lora",
        worker_args=(
            *("--num-kv-blocks", "256", "--enable-lora", "--max-loras", "2"),
            *("--lora-modules", f"sql={adapters['sql']}", f"chat={adapters['chat']}"),
        ),
        router_args=(
            *("--http-port", str(http_port), "--disaggregation-min-tokens", "16"),
            "--allow-runtime-lora-updating",
        ),
    )
    with LocalCluster(spec) as running:
        _wait_for_models(http_port, {"sql", "chat"})
        yield running, http_port


def _models(port: int) -> dict[str, dict]:
    body = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
    return {m["id"]: m for m in body["data"]}


def _wait_for_models(port: int, names: set[str], present: bool = True) -> dict[str, dict]:
    """``/v1/models`` once it lists (or no longer lists) ``names`` (heartbeats carry them)."""
    deadline = time.monotonic() + 30
    while True:
        models = _models(port)
        if (names <= set(models)) == present and (present or not names & set(models)):
            return models
        assert time.monotonic() < deadline, models
        time.sleep(0.2)


async def _generate(address: str, prompt: list[int], model: str) -> tuple[list[int], int]:
    async with AsyncGenerationClient(address) as client:
        tokens, cached = [], 0
        async for r in client.generate(build_request(prompt, greedy(NEW), model=model)):
            tokens += r.token_ids
            cached = r.usage.cached_prompt_tokens or cached
        return tokens, cached


def _run_all(address: str, jobs: list[tuple[list[int], str]]) -> list[tuple[list[int], int]]:
    async def go():
        return await asyncio.gather(*(_generate(address, p, m) for p, m in jobs))

    return asyncio.run(go())


def test_models_lists_adapters_with_their_parent(cluster) -> None:
    running, port = cluster
    models = _models(port)
    base = running.model_name
    assert models[base]["root"] == base and "parent" not in models[base]
    for name in ("sql", "chat"):
        assert models[name]["parent"] == base and models[name]["object"] == "model"


def test_adapters_through_the_cluster_equal_peft(cluster, base, adapters) -> None:
    """Base and adapter requests in flight together, disaggregated (prompts of 20+
    tokens go through the prefill worker and a KV pull)."""
    running, port = cluster
    prompts = random_prompts(3, 4096, (20, 60), seed=21)
    names = ["", "sql", "chat"]
    jobs = [(p, m) for p in prompts for m in names]
    results = _run_all(running.router_address, jobs)
    expected = {
        "": hf_greedy(base, prompts, NEW),
        "sql": peft_greedy(base, adapters["sql"], prompts, NEW),
        "chat": peft_greedy(base, adapters["chat"], prompts, NEW),
    }
    for (prompt, model), (tokens, _) in zip(jobs, results, strict=True):
        assert tokens == expected[model][prompts.index(prompt)], model
    # the OpenAI API selects the adapter by `model`; text is the tokens' text
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    out = client.completions.create(
        model="sql",
        prompt=prompts[0],
        max_tokens=NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = Tokenizer.from_dir(base).decode(expected["sql"][0])
    assert out.choices[0].text == text and out.model == "sql"
    deadline = time.monotonic() + 10
    while held_kv(running) != (0, 0, 0, 0):  # nothing leaked on either worker
        assert time.monotonic() < deadline, held_kv(running)
        time.sleep(0.1)


def test_prefix_cache_hits_stay_within_an_adapter(cluster) -> None:
    running, _ = cluster
    prompt = random_prompts(1, 4096, (80, 80), seed=33)[0]

    def cached(model: str) -> int:
        return _run_all(running.router_address, [(prompt, model)])[0][1]

    first, again, other, base = cached("sql"), cached("sql"), cached("chat"), cached("")
    assert first == 0 and again >= 64  # the adapter's own blocks are found again
    assert other == 0 and base == 0  # but never by another adapter or the base model


def test_runtime_load_and_unload_on_every_worker(cluster, base, adapters, tmp_path) -> None:
    running, port = cluster
    url = f"http://127.0.0.1:{port}/v1"
    bad = httpx.post(
        f"{url}/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}
    )
    assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]
    unknown = httpx.post(f"{url}/completions", json={"model": "late", "prompt": [5, 6, 7]})
    assert unknown.status_code == 404
    taken = httpx.post(
        f"{url}/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapters["late"])}
    )
    assert taken.status_code == 400 and "already loaded" in taken.json()["error"]["message"]
    base_name = {"lora_name": running.model_name, "lora_path": str(adapters["late"])}
    assert httpx.post(f"{url}/load_lora_adapter", json=base_name).status_code == 400
    ok = httpx.post(
        f"{url}/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["late"])}
    )
    assert ok.status_code == 200 and "on 2 workers" in ok.text
    _wait_for_models(port, {"late"})
    prompts = random_prompts(2, 4096, (20, 40), seed=5)
    results = _run_all(running.router_address, [(p, "late") for p in prompts])
    assert [t for t, _ in results] == peft_greedy(base, adapters["late"], prompts, NEW)
    gone = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 200, gone.text
    _wait_for_models(port, {"late"}, present=False)
    again = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "late"})
    assert again.status_code == 404


def test_metrics_count_requests_per_adapter(cluster) -> None:
    running, port = cluster
    _run_all(running.router_address, [([11, 12, 13, 14], "chat")])
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    samples = {
        (s.name, s.labels.get("adapter")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("tandem:router_lora_requests_total", "chat")] >= 1
    assert samples[("tandem:router_lora_generation_tokens_total", "chat")] >= NEW
