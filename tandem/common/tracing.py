"""OpenTelemetry traces across the components: one trace per request, from the HTTP or
gRPC front through routing, the prefill, the KV pull and decode.

Off unless a component is given ``--otlp-traces-endpoint`` (or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``): then ``setup`` installs a tracer provider with
a batching OTLP exporter, over gRPC or HTTP as ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` /
``OTEL_EXPORTER_OTLP_PROTOCOL`` say (``grpc`` by default, or ``http/protobuf``); the
exporters read the other ``OTEL_*`` settings themselves (headers, timeout, compression,
certificates), and ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` name the
process. While off, this module imports nothing of OpenTelemetry and every call here returns a
shared do-nothing span: the request path pays a function call per span.

Context moves explicitly, never through the current-context variable: spans here live
across ``await`` and ``yield`` points of async generators, where attaching and
detaching a context is unsafe. An entry point ``extract``s the caller's W3C
``traceparent`` (HTTP headers, gRPC metadata) into a parent; each span is started under
a parent given by name; ``metadata(span)`` is what an outgoing gRPC call carries so the
next component continues the trace.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
EXTRA = "tandem[otel]"

_tracer: Any = None
"""The OpenTelemetry tracer once ``setup`` ran with an endpoint; ``None``: off."""
_provider: Any = None
_propagator: Any = None


class _NoSpan:
    """What every call returns while tracing is off."""

    __slots__ = ()

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def record_exception(self, exception: BaseException) -> None:
        pass

    def fail(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass

    @property
    def recording(self) -> bool:
        return False


NO_SPAN = _NoSpan()


class Span:
    """A started span (a thin wrapper, so callers need no OpenTelemetry import)."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    def set_attribute(self, key: str, value: Any) -> None:
        self._span.set_attribute(key, value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self._span.set_attributes(dict(attributes))

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        self._span.add_event(name, dict(attributes or {}))

    def record_exception(self, exception: BaseException) -> None:
        self._span.record_exception(exception)
        self.fail(f"{type(exception).__name__}: {exception}")

    def fail(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        self._span.end()

    @property
    def recording(self) -> bool:
        return True


AnySpan = Span | _NoSpan
Parent = Any
"""A parent context (an OpenTelemetry ``Context``), a ``Span``, or ``None`` for a new
trace."""


def enabled() -> bool:
    return _tracer is not None


def setup(service_name: str, endpoint: str | None) -> bool:
    """Export this process's spans to ``endpoint`` (else ``$OTEL_EXPORTER_OTLP_TRACES_
    ENDPOINT``); without either, tracing stays off. ``service_name`` names the process
    unless ``OTEL_SERVICE_NAME`` does. ``ValueError`` (a one-line reason) when the
    OpenTelemetry packages are missing or the protocol is unknown."""
    global _tracer, _provider, _propagator
    endpoint = endpoint or os.environ.get(ENDPOINT_ENV)
    if not endpoint:
        return False
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        raise ValueError(
            f"--otlp-traces-endpoint needs OpenTelemetry: pip install '{EXTRA}'"
        ) from None
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    # Shut down (so flushed) at interpreter exit, which a component's SIGTERM reaches.
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
    _provider, _tracer = provider, provider.get_tracer("tandem")
    _propagator = TraceContextTextMapPropagator()
    log.info("tracing to %s as %s", endpoint, service_name)
    return True


def shutdown() -> None:
    """Flush what is still queued (also done at interpreter exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def _exporter(endpoint: str) -> Any:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = endpoint.startswith("http://") or None
        return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpSpanExporter,
        )

        return HttpSpanExporter(endpoint=endpoint)
    raise ValueError(
        f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: Tandem exports over grpc or "
        "http/protobuf"
    )


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> Parent:
    """The caller's trace context from HTTP headers or gRPC metadata (``None``: none
    sent, or tracing off)."""
    if _tracer is None or carrier is None:
        return None
    if not isinstance(carrier, Mapping):
        carrier = {key: value for key, value in carrier if isinstance(value, str)}
    if "traceparent" not in carrier:
        return None
    return _propagator.extract(carrier)


def start(
    name: str,
    parent: Parent = None,
    attributes: Mapping[str, Any] | None = None,
    server: bool = False,
) -> AnySpan:
    """A started span under ``parent``; ``server``: it answers a call from elsewhere.
    End it with ``end()`` (or use ``span``)."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry.trace import SpanKind

    kind = SpanKind.SERVER if server else SpanKind.INTERNAL
    return Span(
        _tracer.start_span(name, context=_context(parent), kind=kind, attributes=attributes)
    )


@contextmanager
def span(
    name: str,
    parent: Parent = None,
    attributes: Mapping[str, Any] | None = None,
    server: bool = False,
) -> Iterator[AnySpan]:
    """``start``, ended on exit; an exception marks it failed (and goes on)."""
    started = start(name, parent, attributes, server)
    try:
        yield started
    except BaseException as err:
        if started.recording and not isinstance(err, GeneratorExit):
            started.record_exception(err)
        raise
    finally:
        started.end()


def metadata(parent: Parent) -> tuple[tuple[str, str], ...] | None:
    """The gRPC metadata that carries ``parent``'s context to the callee (``None``:
    tracing off)."""
    if _tracer is None or parent is None or parent is NO_SPAN:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=_context(parent))
    return tuple(carrier.items())


def _context(parent: Parent) -> Any:
    if isinstance(parent, Span):
        from opentelemetry import trace

        return trace.set_span_in_context(parent._span)
    if parent is NO_SPAN:
        return None
    return parent
