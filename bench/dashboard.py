"""Render the Grafana dashboard (``deploy/grafana/tandem.json``) from a real run.

Grafana itself cannot be installed here (no apt, PyPI or npm package ships it), so
this draws the dashboard's own panels — the same PromQL, the same legends, the same
grid — from a real Prometheus (Debian's ``prometheus``) scraping a real cluster under
load: ``tandem serve``'s layout (router, prefill and decode workers, each with
``/metrics``), open-loop traffic in three phases of different rates over shared
prefixes, and one decode worker killed mid-run (restarted by the launcher) so the
fail-over panels have something to show.

    python -m tandem.bench.dashboard --out docs/images/dashboard.png

``--prometheus URL`` renders from an existing Prometheus instead of running anything
(``--minutes`` of history).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tandem.bench.loadgen import LoadSpec, plan_requests, run_load
from tandem.bench.workloads import IntRange, TokenPool
from tandem.cli.launcher import ClusterSpec, LocalCluster
from tandem.cli.serve import default_model
from tandem.common.client import AsyncGenerationClient

DASHBOARD = Path("deploy/grafana/tandem.json")
"""Relative to the repository root (``--dashboard`` elsewhere)."""
RATE_INTERVAL = "20s"
PHASES = ((60, 1.0), (60, 3.0), (60, 1.5))
"""(seconds, requests/s) of the load."""


def expand(expr: str) -> str:
    """A panel's PromQL with Grafana's variables filled in as the dashboard's defaults."""
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model", ".*")


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list:
    params = urllib.parse.urlencode(
        {"query": expand(expr), "start": start, "end": end, "step": step}
    )
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as r:
        answer = json.load(r)
    if answer.get("status") != "success":
        raise RuntimeError(f"query failed: {expr}: {answer}")
    return answer["data"]["result"]


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def render(
    prometheus: str, start: float, end: float, out: Path, dashboard: Path = DASHBOARD
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = json.loads(dashboard.read_text())
    panels = board["panels"]
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    plt.style.use("dark_background")
    fig = plt.figure(figsize=(24, height * 0.62), facecolor="#111217")
    grid = fig.add_gridspec(
        height, 24, hspace=0.0, wspace=0.6, top=0.975, bottom=0.01, left=0.03, right=0.99
    )
    step = max(1.0, (end - start) / 240)
    for panel in panels:
        g = panel["gridPos"]
        if panel["type"] == "row":
            ax = fig.add_subplot(grid[g["y"], :])
            ax.axis("off")
            ax.text(0, 0.2, panel["title"], fontsize=15, color="#d8d9da", weight="bold")
            continue
        ax = fig.add_subplot(grid[g["y"] + 1 : g["y"] + g["h"] - 1, g["x"] : g["x"] + g["w"]])
        ax.set_facecolor("#181b1f")
        ax.set_title(panel["title"], fontsize=11, loc="left", color="#d8d9da")
        for target in panel["targets"]:
            for series in query_range(prometheus, target["expr"], start, end, step):
                points = [(float(t) - start, float(v)) for t, v in series["values"]]
                points = [(t, v) for t, v in points if math.isfinite(v)]
                if points:
                    xs, ys = zip(*points, strict=True)
                    label = legend(target["legendFormat"], series["metric"]) or target["refId"]
                    ax.plot(xs, ys, linewidth=1.3, label=label)
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        ax.set_ylabel({"percentunit": "share", "Bps": "bytes/s"}.get(unit, unit), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlim(0, end - start)
        ax.grid(alpha=0.15)
        if ax.lines:
            ax.legend(fontsize=7, loc="upper left", framealpha=0.3)
        else:
            ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(
        f"{board['title']} — rendered from Prometheus ({(end - start) / 60:.0f} min, "
        "seconds since start on x)",
        fontsize=13,
        color="#d8d9da",
        y=0.995,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=70, facecolor=fig.get_facecolor(), bbox_inches="tight")
    print(f"wrote {out}")


def start_prometheus(targets: dict[str, int], workdir: Path, port: int) -> subprocess.Popen:
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus is not installed (apt-get install prometheus)")
    jobs = "".join(
        f'  - job_name: tandem-{name}\n    static_configs:\n      - targets: ["127.0.0.1:{p}"]\n'
        for name, p in targets.items()
    )
    config = workdir / "prometheus.yml"
    config.write_text(f"global:\n  scrape_interval: 2s\nscrape_configs:\n{jobs}")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "prometheus.log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2):
                return process
        except OSError:
            time.sleep(0.3)
    process.kill()
    raise SystemExit("prometheus did not become ready")


def drive(cluster: LocalCluster, model_dir: str) -> None:
    pool = TokenPool.from_checkpoint(model_dir)

    async def go() -> None:
        async with AsyncGenerationClient(cluster.router_address) as client:
            for i, (seconds, rate) in enumerate(PHASES):
                spec = LoadSpec(
                    num_requests=max(1, int(seconds * rate)),
                    rate=rate,
                    prompt_len=IntRange(16, 96),
                    output_len=IntRange(16, 64),
                    num_prefixes=4,
                    prefix_len=64,
                    seed=i,
                )
                if i == 1:  # mid-run: a decode worker dies, the launcher restarts it
                    asyncio.get_running_loop().call_later(
                        seconds / 2, cluster.kill, "decode-1", signal.SIGKILL
                    )
                results, _ = await run_load(client, plan_requests(spec, pool), timeout_s=120)
                failed = sum(not r.ok for r in results)
                print(f"phase {i}: {len(results)} requests at {rate}/s, {failed} failed")

    asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images/dashboard.png"))
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD, help="dashboard JSON")
    parser.add_argument("--prometheus", help="render from this Prometheus, run nothing")
    parser.add_argument("--minutes", type=float, default=15.0, help="with --prometheus")
    parser.add_argument("--metrics-port", type=int, default=9400)
    parser.add_argument("--prometheus-port", type=int, default=9490)
    args = parser.parse_args(argv)
    if args.prometheus:
        end = time.time()
        render(args.prometheus.rstrip("/"), end - args.minutes * 60, end, args.out, args.dashboard)
        return 0
    model = str(default_model())
    spec = ClusterSpec(
        model_dir=model,
        num_prefill=1,
        num_decode=2,
        router_port=50071,
        worker_args=("--dtype", "float32"),
        decode_args=("--speculative-method", "ngram"),
        metrics_port=args.metrics_port,
        restart=True,
        log_level="WARNING",
    )
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(spec) as cluster:
        prometheus = start_prometheus(cluster.metrics_ports, Path(tmp), args.prometheus_port)
        try:
            start = time.time()
            time.sleep(5)
            drive(cluster, model)
            time.sleep(10)  # the tail of the last requests into the last scrapes
            url = f"http://127.0.0.1:{args.prometheus_port}"
            render(url, start, time.time(), args.out, args.dashboard)
        finally:
            prometheus.terminate()
            prometheus.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
