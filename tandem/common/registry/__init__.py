"""The worker registry in Redis: which workers serve a model, where, and how loaded.

Workers write their own entry (``WorkerRegistration``); routers read them
(``RegistryWatcher``). Liveness is the entry's TTL: a worker that stops heartbeating
disappears when its key expires, with no extra failure detector.

Key layout, with ``P`` the prefix (default ``tandem:``) and ``M`` the model name
(``P M`` is the plain concatenation ``f"{prefix}{model}"``, e.g.
``tandem:llama-3-8b:workers``):

    P M:worker:<worker_id>  string: one JSON ``WorkerRecord`` (``schema_version``,
                            ``info``, ``load``), written with a TTL (PX) by ``register``
                            and by every heartbeat, so it lives TTL past the last one.
    P M:workers             set of worker ids, the per-model index watchers scan.
                            Every write re-adds the id; watchers remove ids whose
                            entry has expired.
    P M:events              pub/sub channel; ``register`` publishes ``{"schema_version",
                            "event": "joined", "worker_id"}`` and ``deregister`` the
                            same with ``"left"``, so watchers re-read at once instead of
                            at their next poll. A notice is only a wake-up call: the
                            keys above are the truth.

Each entry is self-describing: decoding rejects an unknown ``schema_version`` instead
of guessing.

Files: ``records`` (the typed entry and its JSON codec), ``redis_io`` (key names,
notices, connections), ``registration`` (worker side), ``watcher`` (router side).
"""

from tandem.common.registry.records import (
    BUSY_WINDOW_S,
    SCHEMA_VERSION,
    RegistryDecodeError,
    WorkerCapacity,
    WorkerInfo,
    WorkerLoad,
    WorkerRecord,
    WorkerRole,
    decode_record,
    encode_record,
)
from tandem.common.registry.redis_io import DEFAULT_PREFIX, RegistryEvent, RegistryKeys
from tandem.common.registry.registration import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_TTL_S,
    NotRegisteredError,
    WorkerRegistration,
)
from tandem.common.registry.watcher import DEFAULT_POLL_INTERVAL_S, RegistryWatcher, WorkerCallback

__all__ = [
    "BUSY_WINDOW_S",
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_POLL_INTERVAL_S",
    "DEFAULT_PREFIX",
    "DEFAULT_TTL_S",
    "SCHEMA_VERSION",
    "NotRegisteredError",
    "RegistryDecodeError",
    "RegistryEvent",
    "RegistryKeys",
    "RegistryWatcher",
    "WorkerCallback",
    "WorkerCapacity",
    "WorkerInfo",
    "WorkerLoad",
    "WorkerRecord",
    "WorkerRegistration",
    "WorkerRole",
    "decode_record",
    "encode_record",
]
