"""The tensor-parallel benchmark runs end to end on a tiny model and reports sane figures:
every collective of a TP=2 decode step counted and timed, shares of the step in (0, 1),
each rank holding half the weights, the same greedy tokens as TP=1."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem.bench.tensor_parallel import main


@pytest.mark.timeout(120)
def test_tensor_parallel_bench_reports_sane_figures(
    make_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = make_checkpoint("llama")  # 4 layers
    argv = ["--model", str(model_dir), "--setups", "1x1,2x1", "--batch-sizes", "1,4"]
    assert main([*argv, "--steps", "3", "--rounds", "1", "--results-dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report == json.loads((tmp_path / "tensor_parallel.json").read_text())
    tp1, tp2 = report["setups"]["1x1"], report["setups"]["2x1"]
    for batch in ("1", "4"):
        one, two = tp1["batches"][batch], tp2["batches"][batch]
        assert one["tokens_per_s"] > 0 and two["tokens_per_s"] > 0
        assert 0 < one["forward_ms"] < one["mean_step_ms"]
        assert "shares" not in one, "TP=1 has no collectives"
        assert two["calls_per_step"] == {
            "row_parallel_all_reduce": 8,  # o_proj and down_proj of 4 layers
            "embedding_all_reduce": 1,
            "logits_gather": 1,
            "plan_broadcast": 2,
        }
        assert all(0 < share < 1 for share in two["shares"].values())
        assert two["greedy_match"] == 1.0
        assert tp2["step_ratio_vs"]["1x1"][batch] > 0
        explained = tp2["explain"][batch]
        assert explained["compute_ms"] > 0 and explained["all_reduces_per_step"] == 9
    for probe in report["all_reduce_probe_us"].values():
        assert all(us > 0 for us in probe.values())
    (whole,) = tp1["memory"]["ranks"]
    halves = tp2["memory"]["ranks"]
    assert [r["rank"] for r in halves] == [0, 1]
    for rank in halves:
        assert 0.45 < rank["weights_mib"] / whole["weights_mib"] < 0.6
        assert rank["kv_cache_mib"] == whole["kv_cache_mib"] / 2  # 2 KV heads, 1 per rank
        assert rank["peak_rss_mib"] >= rank["rss_mib"] > rank["anon_mib"] > 0
