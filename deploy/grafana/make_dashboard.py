"""Writes ``tandem.json``, the Grafana dashboard of Tandem's metrics, from the panel
list below, and its copy in the Helm chart (edit here, then ``python
deploy/grafana/make_dashboard.py``; tests check both files are this script's output and
that every query runs on a real Prometheus scraping a real cluster).

Variables: ``datasource`` (a Prometheus data source) and ``model`` (``model_name``).
Every panel is a time series of PromQL over the ``tandem:`` families
(``docs/metrics.md``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).with_name("tandem.json")
CHART_COPY = Path(__file__).parents[1] / "helm" / "tandem" / "dashboards" / "tandem.json"
"""The same file inside the chart (Helm reads only files under the chart)."""
SEL = 'model_name=~"$model"'


@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[tuple[str, str], ...]
    """(PromQL, legend) pairs."""
    unit: str = "short"
    description: str = ""


def q(quantile: float, family: str, role: str, by: str = "") -> str:
    group = f"le{', ' + by if by else ''}"
    return (
        f"histogram_quantile({quantile}, sum by ({group}) "
        f'(rate(tandem:{family}_bucket{{role="{role}", {SEL}}}[$__rate_interval])))'
    )


def rate(family: str, selector: str = "", by: str = "") -> str:
    inner = f"rate(tandem:{family}{{{SEL}{', ' + selector if selector else ''}}}[$__rate_interval])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def percentiles(family: str, role: str) -> tuple[tuple[str, str], ...]:
    return tuple((q(p, family, role), f"p{int(p * 100)}") for p in (0.5, 0.9, 0.99))


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "What users see (router)",
        (
            Panel(
                "Requests finished / s",
                (
                    (
                        rate("request_success_total", 'role="router"', "finished_reason"),
                        "{{finished_reason}}",
                    ),
                ),
                "reqps",
            ),
            Panel(
                "Errors / s by status",
                ((rate("request_errors_total", 'role="router"', "code"), "{{code}}"),),
                "reqps",
                "refused (INVALID_ARGUMENT, RESOURCE_EXHAUSTED) or failed (UNAVAILABLE, ...)",
            ),
            Panel(
                "Time to first token",
                percentiles("time_to_first_token_seconds", "router"),
                "s",
                "routing + prefill + KV transfer, as the client sees it",
            ),
            Panel(
                "Time per output token",
                percentiles("time_per_output_token_seconds", "router"),
                "s",
            ),
            Panel(
                "End-to-end latency",
                percentiles("e2e_request_latency_seconds", "router"),
                "s",
            ),
            Panel(
                "Tokens / s",
                (
                    (rate("prompt_tokens_total", 'role="router"'), "prompt"),
                    (rate("generation_tokens_total", 'role="router"'), "generated"),
                ),
                "short",
            ),
        ),
    ),
    (
        "Routing",
        (
            Panel(
                "Routing decisions / s",
                (
                    (
                        rate("router_routing_decisions_total", "", "pool, policy, prefix_match"),
                        "{{pool}} {{policy}} prefix {{prefix_match}}",
                    ),
                ),
                "ops",
            ),
            Panel(
                "Prompt tokens found cached (prefill pool)",
                (
                    (
                        f"{rate('router_cached_prompt_tokens_total', '', 'policy')} / "
                        f"{rate('router_prompt_tokens_total', '', 'policy')}",
                        "{{policy}}",
                    ),
                ),
                "percentunit",
                "share of the prompt tokens sent to prefill workers that they did not compute",
            ),
            Panel(
                "Decode streams moved / s",
                (
                    (
                        rate("router_decode_migrations_total", "", "cause, mode"),
                        "{{cause}} ({{mode}})",
                    ),
                    (rate("router_prefill_retries_total"), "prefill retries"),
                ),
                "ops",
                "streams moved to another decode worker, by cause: failure and stall "
                "(recomputed there), drain, rebalance and requested (handed over: kv when "
                "the KV moved with the stream)",
            ),
            Panel(
                "Requests in flight",
                (
                    ('sum(tandem:num_requests_running{role="router", ' + SEL + "})", "router"),
                    (
                        'sum by (role) (tandem:num_requests_running{role!="router", ' + SEL + "})",
                        "{{role}} running",
                    ),
                    (
                        "sum by (role) (tandem:num_requests_waiting{" + SEL + "})",
                        "{{role}} waiting",
                    ),
                ),
            ),
        ),
    ),
    (
        "Workers",
        (
            Panel(
                "KV cache usage",
                (
                    (
                        "max by (role, instance) (tandem:kv_cache_usage_perc{" + SEL + "})",
                        "{{role}} {{instance}}",
                    ),
                ),
                "percentunit",
            ),
            Panel(
                "Queue time p99",
                (
                    (q(0.99, "request_queue_time_seconds", "prefill"), "prefill"),
                    (q(0.99, "request_queue_time_seconds", "decode"), "decode"),
                ),
                "s",
                "arrival at a worker's engine to its admission",
            ),
            Panel(
                "Prefix cache hit rate (workers)",
                (
                    (
                        f"{rate('prefix_cache_hits_total', '', 'role')} / "
                        f"{rate('prefix_cache_queries_total', '', 'role')}",
                        "{{role}}",
                    ),
                ),
                "percentunit",
            ),
            Panel(
                "Speculative decoding acceptance",
                (
                    (
                        f"{rate('spec_decode_num_accepted_tokens_total')} / "
                        f"{rate('spec_decode_num_draft_tokens_total')}",
                        "accepted / drafted",
                    ),
                ),
                "percentunit",
            ),
            Panel(
                "Preemptions / s",
                ((rate("num_preemptions_total", "", "role"), "{{role}}"),),
                "ops",
            ),
            Panel(
                "Engine busy",
                (
                    (
                        rate("engine_busy_seconds_total", "", "role, instance"),
                        "{{role}} {{instance}}",
                    ),
                ),
                "percentunit",
                "share of wall time each engine spent stepping",
            ),
        ),
    ),
    (
        "KV transfer",
        (
            Panel(
                "KV bytes / s",
                (
                    (rate("kv_transfer_sent_bytes_total"), "sent (prefill)"),
                    (rate("kv_transfer_received_bytes_total"), "received (decode)"),
                ),
                "Bps",
            ),
            Panel(
                "KV pull duration",
                (
                    (q(0.5, "kv_transfer_pull_seconds", "decode"), "p50"),
                    (q(0.99, "kv_transfer_pull_seconds", "decode"), "p99"),
                ),
                "s",
            ),
            Panel(
                "KV fallbacks / s",
                (
                    (rate("kv_transfer_fallbacks_total"), "fell back to local prefill"),
                    (rate("kv_transfer_pull_failures_total", "", "reason"), "{{reason}}"),
                    (rate("kv_leases_expired_total"), "leases expired"),
                ),
                "ops",
            ),
        ),
    ),
)


def dashboard() -> dict:
    panels: list[dict] = []
    y = 0
    next_id = 1
    for row, row_panels in ROWS:
        panels.append(
            {"type": "row", "title": row, "id": next_id, "collapsed": False,
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []}
        )  # fmt: skip
        next_id += 1
        y += 1
        for i, panel in enumerate(row_panels):
            panels.append(
                {
                    "type": "timeseries",
                    "id": next_id,
                    "title": panel.title,
                    "description": panel.description,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": y + (i // 3) * 8},
                    "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                    "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                    "targets": [
                        {"refId": chr(ord("A") + k), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for k, (expr, legend) in enumerate(panel.exprs)
                    ],
                }
            )  # fmt: skip
            next_id += 1
        y += 8 * -(-len(row_panels) // 3)
    return {
        "title": "Tandem",
        "uid": "tandem",
        "description": "Disaggregated serving: router, prefill and decode pools, KV transfer",
        "tags": ["tandem", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "model",
                    "label": "Model",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {
                        "query": "label_values(tandem:num_requests_running, model_name)",
                        "refId": "model",
                    },
                    "definition": "label_values(tandem:num_requests_running, model_name)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "refresh": 2,
                    "current": {"text": "All", "value": "$__all"},
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    for path in (OUT, CHART_COPY):
        path.write_text(render())
        print(f"wrote {path}")
