"""The issue's quality targets on the shipped trained model, measured by
``bench/quant_quality.py`` itself (its ``main`` with command-line arguments, in this
process to spare the imports, and its JSON read back): perplexity on held-out code within
+1% of float32 for int8 weights and for an int8 or fp8 KV cache, within +5% for int4
weights in groups of 64.

4,096 tokens (16 windows of 256) instead of the script's 16,384 keep the pair near a
minute on 2 cores (2-3 minutes while other jobs load them). The figures move little with
the size (16,384 tokens: int8 -0.12%, int4 g64 +0.76%, KV int8 -0.01%, fp8 +0.22%;
4,096: -0.17%, +0.92%, +0.00%, +0.25%), so the margins to the targets stay wide."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.engine.native_build import ISA_ENV, Isa, supported_isas

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "engine" / "assets" / "trained" / "target"
SIZES = ("--tokens", "4096", "--prompts", "4")


@pytest.fixture(autouse=True)
def _needs_the_trained_model() -> None:
    if not (MODEL / "config.json").exists():
        pytest.skip("no trained assets in this tree")


def _report(tmp_path: Path, *args: str) -> dict:
    from tandem.bench.quant_quality import main

    out = tmp_path / "report.json"
    assert main([*SIZES, *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_weight_quantization_meets_the_perplexity_targets(tmp_path: Path) -> None:
    report = _report(tmp_path, "--settings", "int8", "int4-g64")
    assert report["tokens"] == 4096
    assert set(report) == {"tokens", "prompts", "float32_ppl", "int8", "int4-g64"}
    assert report["int8"]["ppl_increase"] < 0.01
    assert report["int4-g64"]["ppl_increase"] < 0.05
    assert report["int4-g64"]["ppl"] == pytest.approx(
        report["float32_ppl"] * (1 + report["int4-g64"]["ppl_increase"])
    )


def test_kv_cache_quantization_meets_the_perplexity_target(tmp_path: Path) -> None:
    report = _report(tmp_path, "--kv-cache-dtype", "int8", "fp8")
    for kind in ("int8", "fp8"):
        assert report[kind]["ppl_increase"] < 0.01, kind
        # one-byte codes + a float32 scale per 32-value row instead of 32 floats
        assert report[kind]["kv_blocks"] > 3 * report["auto"]["kv_blocks"], kind


def test_int8_meets_the_target_with_avx2s_reduced_activation_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The AVX2 build rounds int8's batched activations to +-64 (129 levels, so its byte
    products cannot saturate; see csrc/quant_matmul.c): still within the target (16,384
    tokens: +0.16% against -0.12% with +-127)."""
    if Isa.AVX2 not in supported_isas():
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv(ISA_ENV, Isa.AVX2.value)
    report = _report(tmp_path, "--settings", "int8")
    assert report["int8"]["ppl_increase"] < 0.01
