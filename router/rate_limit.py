"""Per-key rate limits, held in Redis so they hold across router replicas.

A token bucket per API key: ``rate`` tokens a second up to ``burst``; each ``Generate``
takes one. The bucket lives in Redis (one hash per key, under a digest of the key,
never the key itself) and is updated by one Lua script, so every router sharing the
Redis draws from the same bucket atomically, with Redis's clock. Over the limit, the
call ends ``RESOURCE_EXHAUSTED`` with a retry hint (trailing metadata
``retry-after-ms``). When Redis cannot be reached the limiter lets calls through and
logs it once: a rate limiter must not take the service down with it.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass

from tandem.common.registry.redis_io import REDIS_ERRORS, FailureLog, connect

log = logging.getLogger(__name__)

# KEYS[1]: the bucket; ARGV: rate (tokens/s), burst. Returns {allowed, retry_after_ms}.
_TAKE = """
local now = redis.call('TIME')
local t = tonumber(now[1]) + tonumber(now[2]) / 1e6
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 't')
local tokens = tonumber(state[1]) or burst
local last = tonumber(state[2]) or t
tokens = math.min(burst, tokens + (t - last) * rate)
local allowed, wait_ms = 0, 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
else
  wait_ms = math.ceil((1 - tokens) / rate * 1000)
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 't', t)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, wait_ms}
"""


@dataclass(frozen=True)
class RateLimit:
    rate: float
    """Requests per second per key, sustained."""
    burst: int
    """Requests a key may make at once after being idle."""

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate limit must be > 0 requests/s, got {self.rate}")
        if self.burst < 1:
            raise ValueError(f"rate limit burst must be >= 1, got {self.burst}")


class RateLimiter:
    def __init__(self, redis_url: str, limit: RateLimit, prefix: str = "tandem:ratelimit:"):
        self.limit = limit
        self._client = connect(redis_url)
        self._take = self._client.register_script(_TAKE)
        self._prefix = prefix
        self._failures = FailureLog("rate limiter")

    async def take(self, api_key: str) -> int | None:
        """One request for ``api_key``: ``None`` if allowed, else the milliseconds until
        it would be."""
        bucket = self._prefix + hashlib.sha256(api_key.encode()).hexdigest()[:32]
        try:
            allowed, wait_ms = await self._take(
                keys=[bucket], args=[self.limit.rate, self.limit.burst]
            )
        except REDIS_ERRORS as err:
            self._failures.failed(err)
            return None
        self._failures.succeeded()
        return None if allowed else int(wait_ms)

    async def aclose(self) -> None:
        await self._client.aclose()
