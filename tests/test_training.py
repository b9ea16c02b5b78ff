"""Training: the loss falls, the result is a normal checkpoint that transformers and the
engine load and agree on, the trained model is the engine's own, a run is reproducible
and stays within its budget, and the shipped target/draft pair is what its README says."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.common.model_config import ModelConfig
from tandem.engine.attention.base import AttentionBackendKind, make_backend
from tandem.engine.attention.dense import NO_KV_CACHE, DenseCausalAttention, dense_batch_metadata
from tandem.engine.loader import load_model
from tandem.tools.checkpoint_maker import PRESETS, checkpoint_spec
from tandem.tools.training import (
    REPORT_FILE,
    Corpus,
    TrainConfig,
    Trained,
    learning_rate,
    load_corpus,
    train,
    train_pair,
)
from tests.hf_reference import hf_greedy

transformers = pytest.importorskip("transformers")

PRESET = "trained-draft"  # the smallest preset: 0.6M parameters
STEPS = 40
CONFIG = TrainConfig(
    steps=STEPS, batch_size=8, seq_len=64, lr=1e-2, warmup_steps=5, log_every=10, eval_every=20
)
PROMPTS = ("def fibonacci(n):", "import os\nclass Foo:", "    return self.")
ASSETS = Path(__file__).resolve().parents[1] / "engine" / "assets" / "trained"
MAX_ASSET_BYTES = 13_000_000  # the pair under 8 MB, the MoE under 5
CORPUS_BYTES = 3_000_000  # the tokenizer's own share of the corpus: quick to encode


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The tokenizer cache goes to a temporary directory, not the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus(4096, CONFIG.val_fraction, CORPUS_BYTES)


@pytest.fixture(scope="module")
def trained(corpus: Corpus) -> Trained:
    return train(checkpoint_spec(size=PRESET, seed=1), CONFIG, corpus)


@pytest.fixture(scope="module")
def checkpoint(trained: Trained, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trained.save(tmp_path_factory.mktemp("trained"))


def test_loss_falls_from_chance(trained: Trained) -> None:
    report = trained.report
    first, last = report.curve[0][1], report.curve[-1][1]
    assert first < math.log(4096) + 0.5  # starts near chance: the initialisation is sane
    assert last < first - 1.0
    assert report.val_loss < first - 1.0
    assert [step for step, _ in report.val_curve] == [20, 40]


def test_step_budget_is_respected_and_recorded(trained: Trained, checkpoint: Path) -> None:
    assert trained.report.steps == STEPS
    assert [step for step, _ in trained.report.curve] == [10, 20, 30, 40]
    recorded = json.loads((checkpoint / REPORT_FILE).read_text())
    assert recorded["steps"] == STEPS
    assert recorded["val_loss"] == trained.report.val_loss
    assert recorded["seed"] == 1
    assert recorded["torch_version"] == torch.__version__


def test_minute_budget_stops_the_run(corpus: Corpus) -> None:
    config = TrainConfig(minutes=0.01, batch_size=2, seq_len=16, eval_every=10_000)
    report = train(checkpoint_spec(size=PRESET), config, corpus).report
    assert report.steps >= 1
    # Only the budget ends this run, so it ran at least that long; it stops at the first
    # step after it. A step takes milliseconds; the slack is for a loaded machine (and is
    # still far below what a budget read in the wrong unit gives: 60 times the run).
    assert 0.01 <= report.minutes < 0.01 + 0.1


def test_same_seed_same_weights_other_seed_other_weights(trained: Trained, corpus: Corpus) -> None:
    again = train(checkpoint_spec(size=PRESET, seed=1), CONFIG, corpus)
    other = train(checkpoint_spec(size=PRESET, seed=2), CONFIG, corpus)
    first = trained.model.checkpoint_weights()
    for name, tensor in again.model.checkpoint_weights().items():
        assert torch.equal(tensor, first[name]), name
    assert not torch.equal(
        other.model.checkpoint_weights()["lm_head.weight"], first["lm_head.weight"]
    )


def test_checkpoint_has_hf_names_and_matches_transformers_logits(
    trained: Trained, checkpoint: Path
) -> None:
    hf = _hf_model(checkpoint)
    stored = load_file(checkpoint / "model.safetensors")
    assert set(stored) == set(dict(hf.named_parameters()))
    ids = torch.tensor([list(range(5, 60))])
    with torch.no_grad():
        ours, theirs = trained.model(ids), hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_training_forward_is_the_engine_models_on_the_loaded_checkpoint(
    trained: Trained, checkpoint: Path
) -> None:
    """The trainer runs the engine's model: the checkpoint, loaded by the engine and run
    through its reference paged attention on a real cache, gives the same logits."""
    config = ModelConfig.from_dir(checkpoint)
    engine_model = load_model(checkpoint, config, torch.float32, torch.device("cpu"))
    assert type(engine_model) is type(trained.model.llama)
    ids = torch.randint(0, config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    meta = dense_batch_metadata(*ids.shape)
    cache = torch.zeros(2, ids.shape[0], ids.shape[1], config.num_kv_heads, config.head_dim)
    backend = make_backend(AttentionBackendKind.TORCH, config.head_dim**-0.5, ids.shape[1])
    positions = torch.arange(ids.shape[1]).repeat(ids.shape[0])
    with torch.no_grad():
        caches = [cache.clone() for _ in range(config.num_layers)]
        hidden = engine_model(ids.flatten(), positions, caches, backend, meta)
        expected = engine_model.compute_logits(hidden).view(*ids.shape, -1)
        torch.testing.assert_close(trained.model(ids), expected, atol=1e-5, rtol=1e-5)


def test_checkpoint_weights_are_the_fused_parameters_split(trained: Trained) -> None:
    weights = trained.model.checkpoint_weights()
    layer = trained.model.llama.model.layers[0]
    prefix = "model.layers.0"
    qkv = [weights[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"]
    gate_up = [weights[f"{prefix}.mlp.{p}_proj.weight"] for p in ("gate", "up")]
    assert torch.equal(torch.cat(qkv), layer.self_attn.qkv_proj.weight)
    assert torch.equal(torch.cat(gate_up), layer.mlp.gate_up_proj.weight)
    assert sum(t.numel() for t in weights.values()) == trained.report.parameters


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (4, 1, 5), (2, 2, None)])
def test_dense_attention_matches_the_paged_reference(heads: int, kv_heads: int, window) -> None:
    b, t, dim = 3, 9, 16
    torch.manual_seed(heads + kv_heads)
    q, k, v = (torch.randn(b * t, n, dim) for n in (heads, kv_heads, kv_heads))
    meta = dense_batch_metadata(b, t)
    reference = make_backend(AttentionBackendKind.TORCH, dim**-0.5, t)
    cache = torch.zeros(2, b, t, kv_heads, dim)
    expected = reference.forward(q, k, v, cache, meta, window)
    dense = DenseCausalAttention(dim**-0.5)
    dense.plan(meta)
    got = dense.forward(q, k, v, NO_KV_CACHE, meta, window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_engine_and_transformers_greedy_outputs_agree(checkpoint: Path) -> None:
    from tandem.engine import LLM, SamplingParams

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    llm = LLM(str(checkpoint), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for prompt, output in zip(PROMPTS, llm.generate(list(PROMPTS), params), strict=True):
        ids = tokenizer(prompt).input_ids
        assert [output.token_ids] == hf_greedy(checkpoint, [ids], 16), prompt


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    config = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert learning_rate(config, 0, 0.0) == pytest.approx(0.1)
    assert learning_rate(config, 4, 0.0) == pytest.approx(0.5)
    assert learning_rate(config, 50, 0.5) == pytest.approx(0.55)
    assert learning_rate(config, 100, 1.0) == pytest.approx(0.1)


def test_a_run_needs_a_budget() -> None:
    with pytest.raises(ValueError, match="budget"):
        TrainConfig()


def test_cli_trains_within_the_step_budget(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tandem.cli.main import main

    out = tmp_path / "cli"
    args = ["make-model", str(out), "--train", "--preset", PRESET, "--train-steps", "3"]
    args += ["--corpus-bytes", "200000"]
    assert main([*args, "--train-seq-len", "32", "--train-batch-size", "2"]) == 0
    assert json.loads((out / REPORT_FILE).read_text())["steps"] == 3
    assert "val loss" in capsys.readouterr().out


def test_train_pair_distils_a_draft_and_writes_both(tmp_path: Path) -> None:
    config = TrainConfig(
        steps=2, batch_size=2, seq_len=16, distill_weight=0.5, corpus_bytes=200_000
    )
    target, draft = (checkpoint_spec(size=p) for p in ("trained-target", "trained-draft"))
    report = train_pair(tmp_path, target, draft, config)
    assert (report.target.config["distill_weight"], report.draft.steps) == (0.0, 2)
    for role in ("target", "draft"):
        _hf_model(tmp_path / role)
    recorded = json.loads((tmp_path / "draft" / REPORT_FILE).read_text())
    assert recorded["extra"]["greedy_agreement"] == round(report.greedy_agreement, 4)


# --- the shipped pair ---------------------------------------------------------------------


@pytest.mark.skipif(not ASSETS.exists(), reason="no trained assets in this tree")
@pytest.mark.parametrize(
    "role, preset",
    [("target", "trained-target"), ("draft", "trained-draft"), ("moe", "trained-moe")],
)
def test_shipped_checkpoint_loads_and_has_its_preset_shape(role: str, preset: str) -> None:
    d = ASSETS / role
    model = _hf_model(d)
    p = PRESETS[preset]
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers) == (p.hidden_size, p.num_layers)
    assert (config.num_attention_heads, config.num_key_value_heads) == (p.num_heads, p.num_kv_heads)
    assert config.intermediate_size == p.intermediate_size
    report = json.loads((d / REPORT_FILE).read_text())
    assert report["preset"] == preset
    assert report["parameters"] == sum(t.numel() for t in model.parameters())
    assert report["val_loss"] < report["curve"][0][1]
    assert {t.dtype for t in load_file(d / "model.safetensors").values()} == {torch.bfloat16}


@pytest.mark.skipif(not ASSETS.exists(), reason="no trained assets in this tree")
def test_shipped_models_run_in_float32_offline_and_served_alike() -> None:
    """Stored bf16, run float32 by default everywhere: ``LLM(path)`` and ``tandem
    serve`` (which passes no dtype of its own) compute in the same dtype."""
    from tandem.engine import LLM

    for role in ("target", "draft", "moe"):
        assert ModelConfig.from_dir(ASSETS / role).dtype == "float32", role
    llm = LLM(ASSETS / "target", num_kv_blocks=64, max_model_len=256)
    assert llm.engine.runner.layout.dtype == torch.float32


@pytest.mark.skipif(not ASSETS.exists(), reason="no trained assets in this tree")
def test_shipped_pair_fits_its_size_budget_and_readme_states_its_losses() -> None:
    size = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert size <= MAX_ASSET_BYTES
    readme = (ASSETS / "README.md").read_text()
    for role in ("target", "draft", "moe"):
        report = json.loads((ASSETS / role / REPORT_FILE).read_text())
        assert f"{report['val_loss']:.3f}" in readme, role
    agreement = json.loads((ASSETS / "draft" / REPORT_FILE).read_text())["extra"]
    assert agreement["greedy_agreement"] > 0.6


def test_a_mixture_of_experts_trains_and_transformers_agrees(corpus: Corpus, tmp_path) -> None:
    """Qwen3-MoE trains like the dense Llama (one product per expert: the grouped product
    has no CPU backward); its checkpoint carries the experts under the hub's per-expert
    names, and transformers and the engine give the same greedy tokens."""
    config = TrainConfig(steps=12, batch_size=4, seq_len=64, lr=1e-2, warmup_steps=2)
    trained = train(checkpoint_spec(arch="qwen3_moe", size="tiny", seed=1), config, corpus)
    assert trained.report.val_loss < trained.report.curve[0][1] < math.log(4096) + 0.5
    model_dir = trained.save(tmp_path)
    names = load_file(model_dir / "model.safetensors").keys()
    assert "model.layers.0.mlp.experts.5.down_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # the dense layer
    prompts = [[5, 6, 7, 8], [300, 301]]
    from tandem.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == hf_greedy(model_dir, prompts, 8)


def _hf_model(model_dir: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}, "missing/unexpected/mismatched weights"
    return model.eval()
