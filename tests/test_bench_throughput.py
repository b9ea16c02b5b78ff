"""The throughput benchmark end to end on the tiny model: every (system, workload) pair
runs in its own subprocess, ``--rounds`` repeats each in rotated orders and reports the
median round with every round's figure, and a quantized variant is set against float32
Tandem in the same run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench.throughput import main


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rounds_report_the_median_round_of_each_pair(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--quick", "--systems", "tandem,tandem-int8-kv8", "--workloads", "A"]
    argv += ["--kv-cache-memory-gb", "1"]  # each engine allocates the budget it is given
    assert main([*argv, "--rounds", "2", "--results-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "throughput.json").read_text())
    assert report["rounds"] == 2
    rows = {row["system"]: row for row in report["rows"]}
    assert set(rows) == {"tandem", "tandem-int8-kv8"}
    for row in rows.values():
        figures = row["tokens_per_s_rounds"]
        assert len(figures) == 2 and all(f > 0 for f in figures)
        assert row["tokens_per_s"] == min(figures)  # the lower middle of two
        assert row["log"].endswith(("-A-r1.log", "-A-r2.log"))
    for system in rows:
        for round_ in (1, 2):
            assert (tmp_path / "runs" / f"{system}-A-r{round_}.log").exists()
    quant = rows["tandem-int8-kv8"]
    ratio = quant["tokens_per_s"] / rows["tandem"]["tokens_per_s"]
    assert quant["vs_tandem"]["tokens_per_s"] == pytest.approx(ratio)
    assert quant["kv_pool"]["blocks"] > rows["tandem"]["kv_pool"]["blocks"] * 3  # int8 KV
    table = capsys.readouterr().out
    low, high = sorted(rows["tandem"]["tokens_per_s_rounds"])
    assert f"({low:.0f}-{high:.0f})" in table


def test_rounds_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--quick", "--systems", "tandem", "--rounds", "0"])
    assert "must be at least 1, got 0" in capsys.readouterr().err
