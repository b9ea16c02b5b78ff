"""API keys on the public service: ``authorization: Bearer <key>`` in gRPC metadata.

The router checks every call to ``tandem.v1.Generation`` before its handler runs; a
call without a key, or with one it does not hold, ends ``UNAUTHENTICATED``. Health and
reflection stay open, so probes and ``grpcurl list`` need no key. Keys come from
``--api-key``, ``--api-key-file`` (one a line, ``#`` comments) or ``$TANDEM_API_KEYS``
(comma-separated); the router keeps only their SHA-256 digests, compares in constant
time, and never logs a key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path

import grpc

from tandem.router.rate_limit import RateLimiter

METADATA_KEY = "authorization"
SCHEME = "Bearer "
PROTECTED_PREFIX = "/tandem.v1.Generation/"
GENERATE = PROTECTED_PREFIX + "Generate"
ENV_VAR = "TANDEM_API_KEYS"


class ApiKeys:
    """The keys a router accepts, held as digests."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(k) for k in keys)
        if not self._digests:
            raise ValueError("no API keys given")

    @classmethod
    def gather(
        cls, keys: Sequence[str], files: Sequence[Path], env_value: str | None
    ) -> ApiKeys | None:
        """Keys from flags, files and the environment; ``None`` when there are none (the
        service is then open). ``ValueError`` for an empty key or an unreadable file."""
        found = [*keys, *(k.strip() for k in (env_value or "").split(",") if k.strip())]
        for path in files:
            try:
                lines = path.read_text().splitlines()
            except OSError as err:
                raise ValueError(f"cannot read API key file {path}: {err.strerror}") from None
            found += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        if any(not k.strip() for k in found):
            raise ValueError("an API key must not be empty")
        return cls(found) if found else None

    def __len__(self) -> int:
        return len(self._digests)

    def allows(self, key: str) -> bool:
        digest = _digest(key)
        return any(hmac.compare_digest(digest, known) for known in self._digests)

    def refusal(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """Why a call with this metadata is refused; ``None``: it may go on."""
        key = presented_key(metadata)
        if key is None:
            return f"missing API key: send metadata '{METADATA_KEY}: {SCHEME}<key>'"
        return None if self.allows(key) else "invalid API key"


def presented_key(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer key a call's metadata presents, or ``None``."""
    values = [v for k, v in metadata or () if k == METADATA_KEY]
    if not values:
        return None
    value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
    return value[len(SCHEME) :].strip() if value.startswith(SCHEME) else ""


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the public service without a valid key (``UNAUTHENTICATED``)
    and, with a ``limiter``, ``Generate`` calls over their key's rate
    (``RESOURCE_EXHAUSTED``, trailing metadata ``retry-after-ms``)."""

    def __init__(self, keys: ApiKeys, limiter: RateLimiter | None = None) -> None:
        self.keys = keys
        self.limiter = limiter

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PROTECTED_PREFIX):
            return handler
        reason = self.keys.refusal(details.invocation_metadata)
        if reason is not None:
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, reason)
        if self.limiter is None or details.method != GENERATE:
            return handler
        wait_ms = await self.limiter.take(presented_key(details.invocation_metadata) or "")
        if wait_ms is None:
            return handler
        limit = self.limiter.limit
        reason = (
            f"rate limit of {limit.rate:g} requests/s (burst {limit.burst}) for this API key "
            f"reached; retry in {wait_ms} ms"
        )
        trailer = (("retry-after-ms", str(wait_ms)),)
        return _refusing(handler, grpc.StatusCode.RESOURCE_EXHAUSTED, reason, trailer)


def _refusing(
    handler: grpc.RpcMethodHandler,
    code: grpc.StatusCode,
    reason: str,
    trailer: tuple[tuple[str, str], ...] = (),
) -> grpc.RpcMethodHandler:
    """A handler of the same kind that ends the call with ``code``."""

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        if trailer:
            context.set_trailing_metadata(trailer)
        await context.abort(code, reason)

    make = (
        grpc.unary_stream_rpc_method_handler
        if handler.unary_stream
        else grpc.unary_unary_rpc_method_handler
    )
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
