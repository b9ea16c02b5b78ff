"""The model families beyond Llama / Qwen2 / Mistral: Qwen3, Phi-3, Gemma 2 and 3,
Mixtral and Qwen3-MoE. ``test_engine_vs_hf.py`` and ``test_tensor_parallel.py`` run
each through the offline paths and TP=2; here: their config spellings, the experts'
execution and loading, expert parallelism's shards, speculative decoding, int8 weights,
bad configs, and the disaggregated cluster (prefill → KV pull → decode, TP=2 with
expert parallelism included)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.cli.launcher import LocalCluster
from tandem.common.model_config import ModelConfig
from tandem.engine import LLM, SamplingParams
from tandem.engine.layers import moe
from tandem.engine.loader import load_model
from tandem.engine.parallel.group import TensorParallelGroup
from tandem.protos import common_pb2
from tests.cluster_util import cluster_spec, complete_all, worker_status
from tests.hf_reference import hf_greedy, offline_greedy_checked, random_prompts

NUM_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
NEW_ARCHS = ["qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe", "deepseek_v2"]
"""The int8 test's families. DeepSeek-V3 is left out there: with its experts and latent
projections int8, 1 of its 6 prompts diverges between batched and alone at token 4 (a
routing choice flips on the float attention's batch-dependent rounding, not a logit
tie; float or half-quantized it is invariant): exact invariance of the float parts is
issue 34's batch-invariant mode. Its int8 path is tested below."""


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(6, vocab=4096, lengths=(1, 100))


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize(
    ("arch", "variant"),
    [
        ("gemma3", {"config_style": "v5"}),  # layer_types + rope_parameters per layer type
        ("gemma3", {"rope_scaling": "linear"}),  # the global layers' scaling only
        ("gemma3", {"rope_scaling": "linear", "config_style": "v5"}),
        ("qwen3", {"config_style": "v5"}),
        ("phi3", {"config_style": "v5"}),  # partial_rotary_factor inside rope_parameters
        ("qwen3_moe", {"kv_heads": 1}),
        ("gemma2", {"dtype": "bfloat16"}),  # stored bf16, run in float32
        ("deepseek_v2", {"config_style": "v5"}),  # YaRN inside rope_parameters
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_config_spellings_match_transformers(arch, variant, make_checkpoint, prompts) -> None:
    model_dir = make_checkpoint(arch, **variant)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256)
    assert _greedy(llm, prompts) == hf_greedy(model_dir, prompts, NUM_NEW)


def test_the_configs_read_what_each_family_changes(make_checkpoint) -> None:
    qwen3 = ModelConfig.from_dir(make_checkpoint("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 24 != qwen3.hidden_size // qwen3.num_heads
    phi3 = ModelConfig.from_dir(make_checkpoint("phi3"))
    assert phi3.rotary_dim == 12 and phi3.sliding_windows == (64,) * 4
    gemma2 = ModelConfig.from_dir(make_checkpoint("gemma2"))
    assert gemma2.sliding_windows == (64, None, 64, None)
    assert gemma2.attn_logit_softcap == 8.0 and gemma2.final_logit_softcap == 30.0
    assert gemma2.attention_scale == 32**-0.5  # query_pre_attn_scalar, not head_dim
    assert gemma2.hidden_act.value == "gelu_pytorch_tanh" and gemma2.tie_word_embeddings
    for style in ("legacy", "v5"):
        gemma3 = ModelConfig.from_dir(make_checkpoint("gemma3", config_style=style))
        assert gemma3.sliding_windows == (64, None, 64, None), style
        assert gemma3.local_rope.theta == 10_000.0 and gemma3.rope.theta == 1_000_000.0
        assert gemma3.attn_logit_softcap is None and gemma3.qk_norm
    mixtral = ModelConfig.from_dir(make_checkpoint("mixtral")).moe
    assert (mixtral.num_experts, mixtral.top_k, mixtral.renormalize) == (4, 2, True)
    assert mixtral.sparse_layers == (True,) * 4
    qwen3_moe = ModelConfig.from_dir(make_checkpoint("qwen3_moe")).moe
    assert (qwen3_moe.num_experts, qwen3_moe.intermediate_size) == (6, 48)
    assert not qwen3_moe.renormalize and qwen3_moe.weights_in_model_dtype
    assert qwen3_moe.sparse_layers == (True, False, True, True)  # mlp_only_layers [1]


def _config(make_checkpoint, arch: str) -> dict:
    return json.loads((make_checkpoint(arch) / "config.json").read_text())


@pytest.mark.parametrize(
    ("arch", "change", "message"),
    [
        ("mixtral", {"num_experts_per_tok": 5}, r"'num_experts_per_tok' \(5\) exceeds .* \(4\)"),
        ("qwen3_moe", {"num_experts": 0}, r"'num_experts' must be a positive integer, got 0"),
        ("phi3", {"rope_scaling": {"rope_type": "longrope"}}, r"rope type 'longrope'"),
        ("phi3", {"partial_rotary_factor": 0.2}, r"partial_rotary_factor.*must be even"),
        ("gemma2", {"hidden_activation": "relu"}, r"'hidden_activation' = 'relu'"),
        (
            "qwen3",
            {"architectures": ["Gemma3ForConditionalGeneration"]},
            r"Gemma3ForConditionalGeneration.*supported",
        ),
        ("qwen3", {"hidden_size": "64"}, r"'hidden_size' must be a positive integer"),
    ],
)
def test_bad_configs_are_refused_by_field(make_checkpoint, arch, change, message) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_config(make_checkpoint, arch) | change)


def test_expert_counts_that_do_not_divide_among_ranks_are_refused(make_checkpoint) -> None:
    from tandem.engine.layers.moe import ExpertSplit
    from tandem.engine.parallel.shard import check_tensor_parallel

    config = ModelConfig.from_dir(make_checkpoint("qwen3_moe"))  # 6 experts, 4 heads
    check_tensor_parallel(config, 2, ExpertSplit.EXPERT)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4 .*number of experts \(6"):
        check_tensor_parallel(config, 4, ExpertSplit.EXPERT)
    model_dir = make_checkpoint("qwen3_moe")
    with pytest.raises(ValueError, match=r"number of experts \(6; expert parallelism\)"):
        LLM(model_dir, tensor_parallel_size=4, enable_expert_parallel=True)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_grouped_experts_equal_one_product_per_expert(arch, make_checkpoint, prompts) -> None:
    """The grouped product and the per-expert fallback give the same tokens (and the
    grouped one is what runs here)."""
    model_dir = make_checkpoint(arch)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256)
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, moe.FusedExperts)]
    grouped = _greedy(llm, prompts)
    assert experts and all(e._grouped for e in experts), "torch._grouped_mm should run here"
    for e in experts:
        e._grouped = False
    assert _greedy(llm, prompts) == grouped == hf_greedy(model_dir, prompts, NUM_NEW)


@pytest.mark.parametrize("backend", ["native", "onednn"])
def test_packed_experts_match_at_tp1_and_with_expert_parallelism(
    backend, make_checkpoint, prompts
) -> None:
    """With a packing linear backend the experts are packed as the dense layers are: on
    the native GEMM's grouped kernel (one call per projection for all experts) or on
    oneDNN (one fused call per expert with rows), at TP=1 and with each rank packing its
    half of the experts; the router stays a plain product."""
    from tandem.engine.layers.linear import LinearBackend, linear_backend_available
    from tandem.engine.layers.native_gemm import native_gemm_supported

    cpu = torch.device("cpu")
    if not native_gemm_supported() or not linear_backend_available(
        LinearBackend(backend), cpu, torch.float32
    ):
        pytest.skip(f"the native GEMM or the {backend} backend is unavailable here")
    model_dir = make_checkpoint("qwen3_moe")
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    kwargs = {"dtype": "float32", "num_kv_blocks": 128, "linear_backend": backend}
    llm = LLM(model_dir, **kwargs)
    modules = list(llm.engine.runner.model.modules())
    packed = moe.PackedExperts if backend == "native" else moe.OneDnnExperts
    assert sum(isinstance(m, packed) for m in modules) == 3  # the sparse layers
    assert all(type(m.gate) is moe.Router for m in modules if isinstance(m, moe.SparseMoE))
    assert _greedy(llm, prompts) == expected
    with LLM(
        model_dir, tensor_parallel_size=2, num_threads=1, enable_expert_parallel=True, **kwargs
    ) as tp:
        assert _greedy(tp, prompts) == expected


def _copy_without_weights(source: Path, dest: Path) -> Path:
    """``dest`` with every file of checkpoint ``source`` but its safetensors."""
    dest.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_stacked_expert_tensors_load_like_per_expert_ones(make_checkpoint, prompts, tmp_path):
    """transformers 5 keeps experts stacked (``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``); such a checkpoint gives the same tokens."""
    source = make_checkpoint("qwen3_moe")
    stacked = _copy_without_weights(source, tmp_path / "stacked")
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    for layer in (0, 2, 3):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up, down = [], []
        for e in range(6):
            gate = tensors.pop(f"{prefix}{e}.gate_proj.weight")
            up = tensors.pop(f"{prefix}{e}.up_proj.weight")
            gate_up.append(torch.cat([gate, up]))
            down.append(tensors.pop(f"{prefix}{e}.down_proj.weight"))
        tensors[prefix + "gate_up_proj"] = torch.stack(gate_up)
        tensors[prefix + "down_proj"] = torch.stack(down)
    save_file(tensors, str(stacked / "model.safetensors"))
    llm = LLM(stacked, dtype="float32", num_kv_blocks=256)
    assert _greedy(llm, prompts) == hf_greedy(source, prompts, NUM_NEW)


def test_a_missing_expert_is_named(make_checkpoint, tmp_path) -> None:
    source = make_checkpoint("mixtral")
    broken = _copy_without_weights(source, tmp_path / "broken")
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        dropped = "model.layers.2.block_sparse_moe.experts.3.w2.weight"
        tensors = {n: f.get_tensor(n) for n in f.keys() if n != dropped}  # noqa: SIM118
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"missing tensors: model\.layers\.2\.mlp\.experts\.down_proj"
    ):
        LLM(broken, dtype="float32", num_kv_blocks=64)


class _Unconnected(TensorParallelGroup):
    """Rank ``rank`` of 2, for loading only: no collective is ever called."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank, 2, None, None, torch.device("cpu"))


@pytest.mark.parametrize("split", [moe.ExpertSplit.EXPERT, moe.ExpertSplit.TENSOR])
def test_each_rank_holds_its_experts_or_its_slice_of_each(split, make_checkpoint) -> None:
    model_dir = make_checkpoint("mixtral")
    config = ModelConfig.from_dir(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        w1 = {
            e: f.get_tensor(f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight")
            for e in range(4)
        }
        w2 = {
            e: f.get_tensor(f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight")
            for e in range(4)
        }
    inner = config.moe.intermediate_size
    for rank in (0, 1):
        model = load_model(
            model_dir, config, torch.float32, torch.device("cpu"), _Unconnected(rank), None, split
        )
        experts = model.model.layers[1].mlp.experts
        if split is moe.ExpertSplit.EXPERT:
            assert experts.gate_up_proj.shape == (2, 2 * inner, config.hidden_size)
            for local, e in enumerate((2 * rank, 2 * rank + 1)):
                assert torch.equal(experts.gate_up_proj[local, :inner], w1[e])
                assert torch.equal(experts.down_proj[local], w2[e])
        else:
            half = slice(rank * inner // 2, (rank + 1) * inner // 2)
            assert experts.gate_up_proj.shape == (4, inner, config.hidden_size)
            for e in range(4):
                assert torch.equal(experts.gate_up_proj[e, : inner // 2], w1[e][half])
                assert torch.equal(experts.down_proj[e], w2[e][:, half])


@pytest.mark.parametrize(
    ("arch", "draft_arch"), [("gemma2", "qwen3"), ("qwen3_moe", "phi3"), ("deepseek_v3", "llama")]
)
def test_speculation_keeps_greedy_output(arch, draft_arch, make_checkpoint, prompts) -> None:
    """Draft (a model of another family, same tokenizer) and n-gram speculation leave
    the greedy tokens as transformers gives them."""
    model_dir = make_checkpoint(arch)
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    draft = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=256,
        speculative_method="draft",
        draft_model=str(make_checkpoint(draft_arch)),
        speculative_adaptive=False,  # a random draft is rarely right: keep proposing
    )
    assert _greedy(draft, prompts) == expected
    assert draft.engine.speculator.stats.num_verifications > 0
    ngram = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=256,
        speculative_method="ngram",
        speculative_adaptive=False,
    )
    repeated = [p * 3 for p in prompts if p]  # repeats give n-gram matches to propose
    assert _greedy(ngram, repeated) == hf_greedy(model_dir, repeated, NUM_NEW)
    assert ngram.engine.speculator.stats.num_verifications > 0


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_int8_weights_stay_close_and_batch_invariant(arch, make_checkpoint, prompts) -> None:
    """int8 changes some tokens of a random model (near-ties; a MoE's routing flips on
    small changes), but the first step mostly agrees with float32 (broken weights would
    agree by chance, 1 in 4096), and a request's tokens do not depend on its batch."""
    model_dir = make_checkpoint(arch)
    expected = hf_greedy(model_dir, prompts, NUM_NEW)
    llm = LLM(model_dir, quantization="int8", num_kv_blocks=256)
    batched = _greedy(llm, prompts)
    alone = [_greedy(llm, [p])[0] for p in prompts]
    assert batched == alone
    first_steps_equal = sum(b[0] == e[0] for b, e in zip(batched, expected, strict=True))
    assert first_steps_equal >= len(prompts) // 2, (batched, expected)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_experts_and_latent_projections_quantize_at_load_and_in_checkpoints(
    arch, method, make_checkpoint, prompts, tmp_path
) -> None:
    """``--quantization`` quantizes every expert (one quantized product per expert and
    projection) and latent attention's projections (``kv_b_proj`` stays float: it is
    used as per-head factors). ``tandem quantize`` writes the experts float and the
    loader quantizes them once read, so the checkpoint gives the same tokens as
    quantizing at load."""
    from tandem.engine.quantization.checkpoint import quantize_checkpoint
    from tandem.engine.quantization.linear import QuantizedExperts, QuantizedLinear
    from tandem.engine.quantization.scheme import QuantizationConfig, QuantMethod

    model_dir = make_checkpoint(arch)
    llm = LLM(model_dir, quantization=method, num_kv_blocks=256)
    modules = list(llm.engine.runner.model.named_modules())
    assert not any(isinstance(m, moe.FusedExperts) for _, m in modules)
    experts = [m for _, m in modules if isinstance(m, QuantizedExperts)]
    assert len(experts) == ModelConfig.from_dir(model_dir).moe.sparse_layers.count(True)
    assert all(isinstance(p, QuantizedLinear) for e in experts for p in (*e.gate_up, *e.down))
    if arch == "deepseek_v3":
        attention = [m for name, m in modules if name.endswith("self_attn")]
        for layer in attention:
            for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
                assert isinstance(getattr(layer, name), QuantizedLinear), name
            assert isinstance(layer.kv_b_proj.weight, torch.nn.Parameter)
    at_load = _greedy(llm, prompts)
    quantized_dir = tmp_path / "quantized"
    quantize_checkpoint(model_dir, quantized_dir, QuantizationConfig(QuantMethod(method)))
    with safe_open(quantized_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names or (
        "model.layers.1.block_sparse_moe.experts.0.w1.weight" in names
    )
    assert not any(".experts." in n and n.endswith(".qweight") for n in names)
    assert _greedy(LLM(quantized_dir, num_kv_blocks=256), prompts) == at_load
    if method == "int8":
        expected = hf_greedy(model_dir, prompts, NUM_NEW)
        first_equal = sum(a[0] == e[0] for a, e in zip(at_load, expected, strict=True))
        assert first_equal >= len(prompts) // 2, (at_load, expected)


# -- the disaggregated cluster ---------------------------------------------------------

CLUSTER_ARCHS = ["gemma2", "qwen3_moe", "deepseek_v3"]
CLUSTER_GREEDY = common_pb2.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
WORKER_ARGS = ("--num-kv-blocks", "256", "--dtype", "float32")


@pytest.fixture(scope="module", params=CLUSTER_ARCHS)
def family_cluster(request, make_checkpoint, redis_url, tmp_path_factory) -> Iterator[tuple]:
    model_dir = make_checkpoint(request.param)
    spec = cluster_spec(
        model_dir,
        redis_url,
        tmp_path_factory.mktemp(f"{request.param}-logs"),
        request.param,
        worker_args=WORKER_ARGS,
        decode_args=("--kv-pull-timeout", "10"),
    )
    with LocalCluster(spec) as running:
        yield model_dir, running


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_disaggregated_streams_equal_transformers(family_cluster) -> None:
    model_dir, cluster = family_cluster
    prompts = random_prompts(4, 4096, (40, 90), seed=7)  # above the 32-token threshold
    expected = offline_greedy_checked(model_dir, prompts, 12)
    before = worker_status(cluster, "decode-0").kv_blocks_received
    results = asyncio.run(complete_all(cluster.router_address, prompts, CLUSTER_GREEDY))
    assert [r.token_ids for r in results] == expected
    assert worker_status(cluster, "decode-0").kv_blocks_received > before  # pulled, not local


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_tp2_replicas_transfer_and_match(
    arch: str, make_checkpoint: Callable[..., Path], redis_url: str, tmp_path_factory
) -> None:
    """1 prefill + 1 decode worker, each a TP=2 replica holding half of the experts per
    rank; the KV (DeepSeek: the latent rows every rank holds) moves rank to rank and the
    streams equal transformers."""
    model_dir = make_checkpoint(arch)
    tp2 = (*WORKER_ARGS, "--tensor-parallel-size", "2", "--enable-expert-parallel")
    spec = cluster_spec(
        model_dir,
        redis_url,
        tmp_path_factory.mktemp("ep-logs"),
        "ep",
        prefill_args=tp2,
        decode_args=(*tp2, "--kv-pull-timeout", "10"),
    )
    prompts = random_prompts(3, 4096, (40, 90), seed=11)
    expected = offline_greedy_checked(model_dir, prompts, 12)
    with LocalCluster(spec) as cluster:
        results = asyncio.run(complete_all(cluster.router_address, prompts, CLUSTER_GREEDY))
        received = worker_status(cluster, "decode-0").kv_blocks_received
    assert [r.token_ids for r in results] == expected
    assert received > 0
