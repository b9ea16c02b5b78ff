"""LoRA adapters in the engine, checked against PEFT (the reference): every adapter's
greedy tokens equal PEFT's merged model in float32, in one batch that mixes the base and
three adapters of different ranks and targets, through the native and the torch
products, under tensor parallelism, preemption and n-gram speculation; KV never crosses
adapters; bad adapters are refused by name without touching running requests."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch

from tandem.common.lora import LoRARequest, kv_namespace, lora_requests
from tandem.engine import LLM, SamplingParams
from tandem.engine.lora.kernels import lora_kernels_for
from tandem.engine.lora.layers import LoRABatch
from tandem.tools.lora_maker import make_lora
from tests.hf_reference import random_prompts

peft = pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

ADAPTERS = {  # name -> (rank, alpha, targets, rslora)
    "all8": (8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"), False),
    "qv4": (4, 8.0, ("q_proj", "v_proj"), True),
    "mlp16": (16, 16.0, ("o_proj", "up_proj", "down_proj"), False),
}  # fmt: skip


@cache
def _peft_greedy(base: str, adapter: str | None, prompts: tuple[tuple[int, ...], ...], n: int):
    """PEFT's merged model (or the base), greedy, one prompt at a time, float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(n):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                ids.append(int(logits.argmax()))
            outputs.append(ids[len(prompt) :])
    return outputs


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], n: int):
    key = tuple(tuple(p) for p in prompts)
    return _peft_greedy(str(base), None if adapter is None else str(adapter), key, n)


@pytest.fixture(scope="module")
def base(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama")


def _adapters(base: Path, root: Path) -> dict[str, Path]:
    return {
        name: make_lora(base, root / name, r, alpha, targets, seed=i + 1, use_rslora=rs)
        for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _adapters(base, tmp_path_factory.mktemp("adapters"))


def _requests(adapters: dict[str, Path]) -> list[LoRARequest | None]:
    return [None, *(LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items()))]


def _mixed_batch_equals_peft(llm: LLM, base: Path, adapters: dict[str, Path], n: int = 3):
    prompts = random_prompts(n, 4096, (5, 40), seed=3)
    loras = _requests(adapters)
    batch = [p for p in prompts for _ in loras]
    which = [lora for _ in prompts for lora in loras]
    outs = llm.generate(batch, GREEDY, lora_request=which)
    for lora in loras:
        got = [o.token_ids for o, w in zip(outs, which, strict=True) if w is lora]
        path = None if lora is None else Path(lora.lora_path)
        assert got == peft_greedy(base, path, prompts, GREEDY.max_tokens), lora
    return outs


def test_mixed_batch_of_base_and_three_adapters_equals_peft(base, adapters) -> None:
    with LLM(base, dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=3) as llm:
        outs = _mixed_batch_equals_peft(llm, base, adapters)
        assert llm.engine.runner.lora.layers  # the native products ran (float32 CPU)
    assert len({tuple(o.token_ids) for o in outs[:4]}) == 4  # every adapter changes the output


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_torch_products_equal_the_native_kernel(weights: torch.dtype) -> None:
    kernels = lora_kernels_for(torch.device("cpu"), torch.float32)
    if kernels is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(0)
    slots_n, width, d_in, d_out, rank = 3, 2 * 8, 48, 40, 8
    a = torch.randn(slots_n, width, d_in, generator=g)
    bt = torch.randn(slots_n, width, d_out, generator=g)
    ranks = torch.tensor([8, 5, 0], dtype=torch.int32)
    for s, r in enumerate(ranks.tolist()):  # rows past a slot's rank are zero, as loaded
        for j in range(2):
            a[s, j * rank + r : (j + 1) * rank] = 0
            bt[s, j * rank + r : (j + 1) * rank] = 0
        bt[s, :rank, 20:] = 0  # slice 0 writes columns 0..19, slice 1 columns 20..39
        bt[s, rank:, :20] = 0
    a, bt = a.to(weights), bt.to(weights)  # bfloat16: lora_dtype, widened exactly
    offsets = torch.tensor([0, 20, 40])
    slots = torch.tensor([1, 1, -1, 0, 0, 0, 0, 0, 2, 1], dtype=torch.int64)
    x = torch.randn(len(slots), d_in, generator=g)
    y = torch.randn(len(slots), d_out, generator=g)
    expected = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[t] += (a[s].float() @ x[t]) @ bt[s].float()
    batched = y.clone()
    u = kernels.shrink(x, slots, a, ranks, rank)
    kernels.expand(u, batched, slots, bt, ranks, offsets, rank)
    torch.testing.assert_close(batched, expected, rtol=1e-5, atol=1e-5)
    for t in range(len(slots)):  # a row alone gives bitwise its result in the batch
        alone = y[t : t + 1].clone()
        u = kernels.shrink(x[t : t + 1], slots[t : t + 1], a, ranks, rank)
        kernels.expand(u, alone, slots[t : t + 1], bt, ranks, offsets, rank)
        assert torch.equal(alone[0], batched[t])
    assert LoRABatch.of(slots).runs == ((1, 0, 2), (0, 3, 8), (2, 8, 9), (1, 9, 10))


def test_torch_path_equals_peft(base, adapters) -> None:
    """The products as torch runs them (other devices and dtypes)."""
    with LLM(base, dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=3) as llm:
        for layer in llm.engine.runner.lora.layers.values():
            layer.kernels = None
        _mixed_batch_equals_peft(llm, base, adapters, n=2)


def test_kv_is_never_shared_across_adapters(base, adapters) -> None:
    prompt = random_prompts(1, 4096, (64, 64), seed=5)[0]
    loras = _requests(adapters)
    with LLM(base, dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=3) as llm:
        first = [llm.generate([prompt], GREEDY, lora_request=lora)[0] for lora in loras]
        again = [llm.generate([prompt], GREEDY, lora_request=lora)[0] for lora in loras]
    assert [o.num_cached_tokens for o in first] == [0, 0, 0, 0]  # a miss for every adapter
    assert all(o.num_cached_tokens == 48 for o in again)  # then each finds its own
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert kv_namespace("a", adapters["all8"]) != kv_namespace("b", adapters["all8"])


def test_more_adapters_than_slots_and_memory_swap_in(base, adapters) -> None:
    """max_loras=1, max_cpu_loras=1: every adapter change is a slot swap, and evicted
    adapters are read again; the engine never stops and the tokens stay PEFT's."""
    with LLM(
        base, dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=1, max_cpu_loras=1
    ) as llm:
        _mixed_batch_equals_peft(llm, base, adapters, n=2)
        assert llm.engine.runner.lora.num_cold_loads > len(adapters)


def test_preemption_and_ngram_speculation_with_adapters(base, adapters) -> None:
    with LLM(
        base,
        dtype="float32",
        num_kv_blocks=6,
        max_model_len=96,
        enable_lora=True,
        max_loras=3,
        speculative_method="ngram",
    ) as llm:
        _mixed_batch_equals_peft(llm, base, adapters, n=3)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.speculator.stats.num_verifications > 0


@pytest.mark.parametrize("arch", ["phi3", "qwen3"])
def test_other_families_equal_peft(arch, make_checkpoint, tmp_path) -> None:
    """Phi-3's adapters target its fused qkv_proj / gate_up_proj; Qwen3 has q/k norms."""
    model = make_checkpoint(arch)
    targets = (
        ("qkv_proj", "o_proj", "gate_up_proj")
        if arch == "phi3"
        else ("q_proj", "k_proj", "down_proj")
    )
    adapter = make_lora(model, tmp_path / "a", 8, 16.0, targets, seed=9)
    prompts = random_prompts(2, 1000, (5, 30), seed=1)
    with LLM(model, dtype="float32", num_kv_blocks=128, enable_lora=True) as llm:
        outs = llm.generate(prompts, GREEDY, lora_request=LoRARequest("a", 1, str(adapter)))
    assert [o.token_ids for o in outs] == peft_greedy(model, adapter, prompts, GREEDY.max_tokens)


@pytest.mark.slow
def test_tensor_parallel_adapters_equal_peft(base, adapters) -> None:
    with LLM(
        base,
        dtype="float32",
        num_kv_blocks=256,
        enable_lora=True,
        max_loras=3,
        tensor_parallel_size=2,
        num_threads=1,
    ) as llm:
        _mixed_batch_equals_peft(llm, base, adapters, n=2)


@pytest.mark.slow
def test_tensor_parallel_int8_base_with_adapters_equals_one_rank(base, adapters) -> None:
    """int8 weights split over two ranks (the row-parallel int8 product sums integers
    over the ranks; the adapters' partial products are summed apart) give the tokens of
    the same int8 model on one rank, adapters mixed in the batch."""
    prompts = random_prompts(2, 4096, (5, 30), seed=6)
    loras = _requests(adapters)
    batch = [p for p in prompts for _ in loras]
    which = [lo for _ in prompts for lo in loras]
    tokens = []
    for size in (1, 2):
        with LLM(
            base,
            dtype="float32",
            num_kv_blocks=256,
            enable_lora=True,
            max_loras=3,
            quantization="int8",
            tensor_parallel_size=size,
            num_threads=1,
        ) as llm:
            tokens.append([o.token_ids for o in llm.generate(batch, GREEDY, lora_request=which)])
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize(
    "settings", [{"quantization": "int8"}, {"lora_dtype": "bfloat16"}], ids=["int8", "lora-bf16"]
)
def test_int8_base_or_bf16_adapters(base, adapters, settings) -> None:
    """An int8 base runs the adapters on top of its quantized products, and adapters may
    be held in bfloat16 on a float32 model: an adapter's tokens are the same alone and in
    a mixed batch, and differ from the base's."""
    prompts = random_prompts(2, 4096, (5, 30), seed=4)
    loras = _requests(adapters)
    with LLM(
        base, dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=3, **settings
    ) as llm:
        alone = {
            lora: [o.token_ids for o in llm.generate(prompts, GREEDY, lora_request=lora)]
            for lora in loras
        }
        mixed = llm.generate(
            [p for p in prompts for _ in loras],
            GREEDY,
            lora_request=[lo for _ in prompts for lo in loras],
        )
    for i, out in enumerate(mixed):
        assert out.token_ids == alone[loras[i % len(loras)]][i // len(loras)]
    assert len({tuple(v[0]) for v in alone.values()}) == len(loras)


# --- refused by name ---------------------------------------------------------------------


def _broken(adapter: Path, tmp_path: Path, edit: Callable[[dict, dict], None]) -> Path:
    from safetensors.torch import load_file, save_file

    out = tmp_path / "broken"
    out.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(adapter / "adapter_model.safetensors")
    edit(config, tensors)
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, out / "adapter_model.safetensors")
    return out


def _rename(old: str, new: str) -> Callable[[dict, dict], None]:
    def edit(config: dict, tensors: dict) -> None:
        for key in [k for k in tensors if old in k]:
            tensors[key.replace(old, new)] = tensors.pop(key)

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c, t: c.update(r=32), r"rank 32, above max_lora_rank 16"),
        (
            _rename("mlp.down_proj", "mlp.mixer"),
            r"module model.layers.0.mlp.mixer: .*no such layer|mixer",
        ),
        (_rename("layers.0.self_attn.o_proj", "embed_tokens"), r"module model.embed_tokens: "),
        (lambda c, t: c.update(use_dora=True), r"uses DoRA"),
        (lambda c, t: c.update(rank_pattern=["q_proj"]), r"rank_pattern must map modules"),
        (_rename("lora_B", "lora_C"), r"not a LoRA A/B weight"),
    ],
    ids=["rank", "unknown-module", "embedding", "dora", "bad-pattern", "not-lora"],
)
def test_bad_adapters_are_refused_by_name(base, adapters, tmp_path, edit, message) -> None:
    bad = _broken(adapters["mlp16"], tmp_path, edit)
    with LLM(base, dtype="float32", num_kv_blocks=128, enable_lora=True) as llm:
        with pytest.raises(ValueError, match=message):
            llm.engine.add_lora(LoRARequest("bad", 9, str(bad)))
        assert llm.engine.list_loras() == []


def test_missing_files_and_other_base_models_are_refused(
    base, adapters, make_checkpoint, tmp_path
) -> None:
    other = make_lora(make_checkpoint("llama", "small"), tmp_path / "other", 4, 8.0, ("q_proj",))
    (tmp_path / "empty").mkdir()
    with LLM(base, dtype="float32", num_kv_blocks=128, enable_lora=True) as llm:
        engine = llm.engine
        with pytest.raises(ValueError, match=r"'x': no adapter_config.json in"):
            engine.add_lora(LoRARequest("x", 1, str(tmp_path / "empty")))
        with pytest.raises(ValueError, match=r"'y': .* is not a directory"):
            engine.add_lora(LoRARequest("y", 2, str(tmp_path / "nowhere")))
        with pytest.raises(
            ValueError, match=r"'z', module .*q_proj: lora_A takes .* another base model"
        ):
            engine.add_lora(LoRARequest("z", 3, str(other)))
        with pytest.raises(ValueError, match=r"LoRA adapter 'w' is not loaded"):
            engine.add_request([1, 2, 3], GREEDY, lora_request="w")
    with (
        LLM(base, dtype="float32", num_kv_blocks=128) as plain,
        pytest.raises(ValueError, match=r"enable_lora=True"),
    ):
        plain.generate([[1, 2, 3]], GREEDY, lora_request=_requests(adapters)[1])


def test_a_bad_load_leaves_running_requests_alone(base, adapters, tmp_path) -> None:
    prompts = random_prompts(2, 4096, (5, 20), seed=8)
    lora = _requests(adapters)[1]
    with LLM(base, dtype="float32", num_kv_blocks=128, enable_lora=True) as llm:
        engine = llm.engine
        for i, p in enumerate(prompts):
            engine.add_request(p, GREEDY, request_id=f"r{i}", lora_request=lora)
        tokens: dict[str, list[int]] = {"r0": [], "r1": []}
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
        with pytest.raises(ValueError):
            engine.add_lora(LoRARequest("bad", 5, str(tmp_path / "missing")))
        with pytest.raises(ValueError, match=r"has 2 unfinished requests"):
            engine.remove_lora(lora.lora_name)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id].extend(delta.new_token_ids)
        assert engine.remove_lora(lora.lora_name) and engine.list_loras() == []
    expected = peft_greedy(base, Path(lora.lora_path), prompts, GREEDY.max_tokens)
    assert [tokens["r0"], tokens["r1"]] == expected


def test_lora_modules_flag_forms(tmp_path) -> None:
    got = lora_requests(
        ["sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "m"}']
    )
    assert got == [LoRARequest("sql", 1, "/a/sql"), LoRARequest("chat", 2, "/a/chat", "m")]
    for bad in ("sql", "=x", '{"name": "a"}', "{nope"):
        with pytest.raises(ValueError, match="--lora-modules"):
            lora_requests([bad])
    with pytest.raises(ValueError, match="twice"):
        lora_requests(["a=/x", "a=/y"])


def test_workers_advertise_adapters_and_report_them(base, adapters) -> None:
    """The registry record carries name -> KV namespace; the worker's metrics report
    vLLM's ``lora_requests_info`` and running requests per adapter."""
    from tandem.common.worker_load import worker_load
    from tandem.common.worker_metrics import WorkerMetrics

    with LLM(base, dtype="float32", num_kv_blocks=128, enable_lora=True, max_loras=2) as llm:
        engine = llm.engine
        for lora in _requests(adapters)[1:3]:
            engine.add_lora(lora)
        engine.add_request([5, 6, 7, 8], GREEDY, request_id="r", lora_request="all8")
        engine.step()
        load = engine.load()
        published = worker_load(load)
        assert published.adapters == {
            "all8": kv_namespace("all8", adapters["all8"]),
            "qv4": kv_namespace("qv4", adapters["qv4"]),
        }
        metrics = WorkerMetrics("m", "decode", lambda: load)
        assert (
            metrics.value(
                "lora_requests_info",
                running_lora_adapters="all8",
                waiting_lora_adapters="",
                max_lora="2",
            )
            == 1
        )
        assert metrics.value("lora_requests_running", adapter="all8") == 1
        assert metrics.value("lora_adapters_loaded") == 2


def test_router_prefers_workers_with_the_adapter_in_memory() -> None:
    """Only holders serve an adapter; a warm one wins unless its queue is longer than
    the least by more than a cold load costs."""
    from tandem.common.registry import (
        WorkerCapacity,
        WorkerInfo,
        WorkerLoad,
        WorkerRecord,
        WorkerRole,
    )
    from tandem.router.routing.adapters import excluded_for_adapter

    def worker(name: str, queued: int, adapters: dict, resident: tuple = ()) -> WorkerRecord:
        info = WorkerInfo(name, WorkerRole.DECODE, "a:1", "m", WorkerCapacity(64, 16, 8))
        load = WorkerLoad(64, 0, 0, queued, adapters=adapters, resident_adapters=resident)
        return WorkerRecord(info, load)

    held, ns = {"sql": "lora:sql:1"}, "lora:sql:1"
    pool = [
        worker("bare", 0, {}),
        worker("cold", 0, held),
        worker("warm", 200, held, ("sql",)),
        worker("other-files", 0, {"sql": "lora:sql:2"}, ("sql",)),
    ]
    assert excluded_for_adapter(pool, None, "", 256) == frozenset()
    assert excluded_for_adapter(pool, "sql", ns, 256) == {"bare", "cold", "other-files"}
    assert excluded_for_adapter(pool, "sql", ns, 100) == {"bare", "other-files"}  # warm too busy
    only_cold = excluded_for_adapter(pool[:2], "sql", ns, 256)
    assert only_cold == {"bare"}  # none warm: any holder
    # the warm one failed (a retry excludes it): the cold holder takes the request
    assert excluded_for_adapter(pool, "sql", ns, 256, exclude={"warm"}) == {"bare", "other-files"}


def test_draft_model_speculation_leaves_adapter_requests_undrafted(base, adapters) -> None:
    """The draft model knows the base only: adapter requests run without drafts (and
    keep PEFT's tokens) while base requests speculate; asking for a draft explicitly
    with an adapter is refused by name."""
    from dataclasses import replace

    from tandem.common.sampling_params import SpecMethod, SpeculativeOptions

    prompts = random_prompts(2, 4096, (10, 30), seed=12)
    lora = _requests(adapters)[1]
    with LLM(
        base, dtype="float32", num_kv_blocks=256, enable_lora=True, draft_model=str(base)
    ) as llm:
        outs = llm.generate(prompts, GREEDY, lora_request=lora)
        stats = llm.engine.speculator.stats
        assert stats.num_verifications == 0
        assert [o.token_ids for o in outs] == peft_greedy(base, Path(lora.lora_path), prompts, 10)
        llm.generate(prompts, GREEDY)
        assert stats.num_verifications > 0
        explicit = replace(GREEDY, speculative=SpeculativeOptions(method=SpecMethod.DRAFT))
        with pytest.raises(ValueError, match="draft-model speculation does not run LoRA"):
            llm.generate(prompts, explicit, lora_request=lora)


def test_a_reloaded_name_runs_its_new_weights(base, adapters, tmp_path) -> None:
    """Unloaded and loaded again from other files (another path, or the same path with
    the files replaced): the next step runs the new weights, never the slot's old ones."""
    import shutil

    prompts = random_prompts(1, 4096, (10, 20), seed=14)
    here = tmp_path / "x"
    shutil.copytree(adapters["all8"], here)
    with LLM(base, dtype="float32", num_kv_blocks=128, enable_lora=True) as llm:
        engine = llm.engine
        first = llm.generate(prompts, GREEDY, lora_request=LoRARequest("x", 1, str(here)))
        assert engine.remove_lora("x")
        other = LoRARequest("x", 2, str(adapters["qv4"]))
        second = llm.generate(prompts, GREEDY, lora_request=other)
        engine.remove_lora("x")
        shutil.rmtree(here)
        shutil.copytree(adapters["mlp16"], here)  # the same path, other files
        assert engine.add_lora(LoRARequest("x", 3, str(here)))
        third = llm.generate(prompts, GREEDY, lora_request="x")
    for out, name in ((first, "all8"), (second, "qv4"), (third, "mlp16")):
        assert [o.token_ids for o in out] == peft_greedy(base, adapters[name], prompts, 10)


def test_an_adapter_whose_files_went_away_fails_only_its_requests(base, adapters, tmp_path) -> None:
    """Out of memory (max_cpu_loras) and its directory gone: its requests end with
    "abort", the base model's run on."""
    import shutil

    gone = tmp_path / "gone"
    shutil.copytree(adapters["qv4"], gone)
    with LLM(
        base, dtype="float32", num_kv_blocks=128, enable_lora=True, max_loras=1, max_cpu_loras=1
    ) as llm:
        engine = llm.engine
        engine.add_lora(LoRARequest("gone", 1, str(gone)))
        engine.add_lora(LoRARequest("kept", 2, str(adapters["all8"])))  # evicts "gone"
        shutil.rmtree(gone)
        prompt = random_prompts(1, 4096, (10, 20), seed=15)[0]
        outs = llm.generate(
            [prompt, prompt], GREEDY, lora_request=[LoRARequest("gone", 1, str(gone)), None]
        )
    assert outs[0].finish_reason == "abort" and outs[0].token_ids == []
    assert outs[1].finish_reason == "length"
    assert outs[1].token_ids == peft_greedy(base, None, [prompt], 10)[0]


def test_an_adapter_waiting_for_a_slot_is_not_starved(base, adapters) -> None:
    """max_loras=1 and a steady stream of one adapter's requests: a request of another
    adapter still gets its turn (the stream stops being admitted until it has)."""
    with LLM(base, dtype="float32", num_kv_blocks=256, enable_lora=True) as llm:
        engine = llm.engine
        for lora in _requests(adapters)[1:3]:
            engine.add_lora(lora)
        busy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        engine.add_request([11, 12, 13], busy, request_id="x0", lora_request="all8")
        engine.add_request([14, 15, 16], GREEDY, request_id="y", lora_request="qv4")
        for step in range(300):
            engine.add_request(
                [17, 18, step % 50 + 20], busy, request_id=f"x{step + 1}", lora_request="all8"
            )
            if any(d.request_id == "y" and d.finished for d in engine.step()):
                break
        else:
            pytest.fail("the qv4 request never ran")
        assert step > 20  # it did wait for the slot
