"""Prometheus metrics without a client library: a histogram, the text exposition
format (version 0.0.4) and a tiny HTTP endpoint on the event loop.

Why not ``prometheus_client``: its default registry is module-level mutable state and
its HTTP server a thread of its own; a process here exposes a handful of numbers it
already holds, rendered on demand from one ``render()`` callable. Torch-free.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger(__name__)

Labels = Mapping[str, str]


@dataclass(frozen=True)
class Sample:
    labels: Labels
    value: float


def format_family(name: str, kind: str, help_text: str, samples: Iterable[Sample]) -> str:
    """One metric family: ``# HELP``, ``# TYPE`` and a line per sample."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{_labels(s.labels)} {_number(s.value)}" for s in samples]
    return "\n".join(lines) + "\n"


class Histogram:
    """Cumulative buckets for Prometheus plus the latest ``window`` observations, from
    which ``quantile`` is read exactly (for benchmarks and tests)."""

    def __init__(self, buckets: Sequence[float], window: int = 100_000) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * len(self.buckets)
        self.count = 0
        self.sum = 0.0
        self.recent: collections.deque[float] = collections.deque(maxlen=window)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.count += 1
        self.sum += value
        self.recent.append(value)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0-1) of the recent window; ``None`` when empty."""
        if not self.recent:
            return None
        ordered = sorted(self.recent)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def render(self, name: str, help_text: str) -> str:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts, strict=True):
            cumulative += count
            lines.append(f'{name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {_number(self.sum)}")
        lines.append(f"{name}_count {self.count}")
        return "\n".join(lines) + "\n"


async def serve_metrics(host: str, port: int, render: Callable[[], str]) -> asyncio.Server:
    """Serve ``GET /metrics`` (``render()``'s text) on ``host:port`` (0: a free port)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await reader.readline()
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # headers
            parts = request_line.decode("latin-1").split()
            if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                status, body = "200 OK", render().encode()
            else:
                status, body = "404 Not Found", b"only GET /metrics is served here\n"
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (ConnectionError, UnicodeDecodeError) as err:
            log.debug("metrics request failed: %r", err)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return await asyncio.start_server(handle, host, port)


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))
