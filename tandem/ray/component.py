"""One Tandem component — the router, or a prefill or decode replica's rank 0 — served
from a Ray actor's process, and the embedded Redis in an actor of its own.

A ``Component`` runs the same ``tandem <command> ...`` command line ``LocalCluster``
would start as a process (``ComponentCommands``), parsed here and served on a thread
with an asyncio loop, started from the constructor: when Ray restarts the actor, the
component comes back by itself. It announces itself as a process would, with its
``METRICS <port>`` and ``READY ...`` lines on stdout (Ray writes them to the actor's log);
this module reads them to answer ``ready`` and ``endpoint``.

Lifecycle: a component that fails before its first READY is reported by ``ready`` (a
bad setting must not restart forever); one that fails or stops later, or fails again
after a restart, ends its process (exit 1) so Ray restarts the actor — a tensor-parallel
replica's rank 0 takes its follower ranks with it (they are its actors). ``drain`` is the
clean stop: the worker leaves the registry, finishes its calls within its
``--drain-timeout``, and the thread ends; the caller then kills the actor.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import TextIO

import ray

from tandem.cli.launcher import HTTP_PREFIX, METRICS_PREFIX, READY_PREFIX
from tandem.cli.options import CommandError, setup_logging, setup_tracing

log = logging.getLogger(__name__)

RESTART_PAUSE_S = 5.0
"""A restarted component that fails again before READY waits this long before its
process exits, so a replica that cannot start does not restart in a tight loop."""
WILDCARD_HOSTS = ("0.0.0.0", "", "::")


class ComponentFailed(CommandError):
    """A component did not start; the message names it, the cause and its log."""


@dataclass(frozen=True)
class Endpoint:
    """Where a running component is. ``address``: its gRPC ``host:port``, reachable from
    the other nodes when the cluster listens on a wildcard ``--host``."""

    name: str
    address: str
    metrics_port: int | None
    pid: int
    node_ip: str
    log_dir: str
    """Ray's log folder on the component's node (its output: ``worker-*-<pid>.out``)."""
    http_port: int | None = None
    """The router's OpenAI API port, when it serves one."""

    @property
    def metrics_url(self) -> str | None:
        if self.metrics_port is None:
            return None
        return f"http://{self.address.rsplit(':', 1)[0]}:{self.metrics_port}/metrics"


class _Announcements:
    """``sys.stdout`` of a component's process: passes everything through and notes the
    ``METRICS <port>`` and ``READY <role> [id] <address>`` lines."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._partial = ""
        self._lock = threading.Lock()
        self.ready = threading.Event()
        self.ready_address = ""
        self.metrics_port: int | None = None
        self.http_port: int | None = None

    def write(self, text: str) -> int:
        with self._lock:
            self._out.write(text)
            *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            if line.startswith(METRICS_PREFIX):
                self.metrics_port = int(line.split()[1])
            elif line.startswith(HTTP_PREFIX):
                self.http_port = int(line.split()[1])
            elif line.startswith(READY_PREFIX):
                self.ready_address = line.split()[-1]
                self.ready.set()
        return len(text)

    def flush(self) -> None:
        self._out.flush()

    def __getattr__(self, name: str) -> object:
        return getattr(self._out, name)


class Component:
    """Ray actor class (see ``COMPONENT``): component ``name`` from its command line
    ``command`` (without ``tandem``), with ``env`` added to the process environment
    (the Redis URL, API keys: kept out of Ray's view of the actor)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str]) -> None:
        from tandem.cli.main import parse

        os.environ.update(env)
        self.name = name
        self._node_ip = ray.util.get_node_ip_address()
        self._restarted = _reconstructed()
        self._announced = _Announcements(sys.stdout)
        sys.stdout = self._announced
        self._error: str | None = None
        self._failed = threading.Event()
        self._drain = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        args = parse(command)
        if args.command != "router" and args.host in WILDCARD_HOSTS and not args.advertise_host:
            args.advertise_host = self._node_ip  # the address other nodes dial
        self._thread = threading.Thread(target=self._serve, args=(args,), name=name, daemon=True)
        self._thread.start()

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with it
        return self.name

    def ready(self, timeout_s: float) -> Endpoint:
        """Once the component announced READY; raises ``ComponentFailed`` if it failed
        or is not ready within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self._announced.ready.wait(0.1):
            if self._failed.is_set():
                raise ComponentFailed(f"{self.name} failed: {self._error} ({self._log_hint()})")
            if time.monotonic() > deadline:
                raise ComponentFailed(
                    f"{self.name} not ready after {timeout_s:.0f} s ({self._log_hint()})"
                )
        return self.endpoint()

    def endpoint(self) -> Endpoint | None:
        """Where it serves; ``None`` until READY."""
        if not self._announced.ready.is_set():
            return None
        host, port = self._announced.ready_address.rsplit(":", 1)
        if host in WILDCARD_HOSTS:
            host = self._node_ip
        return Endpoint(
            self.name,
            f"{host}:{port}",
            self._announced.metrics_port,
            os.getpid(),
            self._node_ip,
            _ray_log_dir(),
            self._announced.http_port,
        )

    def drain(self) -> None:
        """Stop as the component's SIGTERM would (a worker leaves the registry and lets
        its calls finish within ``--drain-timeout``); returns once it has stopped."""
        self._drain.set()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()

    def _serve(self, args: argparse.Namespace) -> None:
        setup_logging(args.log_level)
        try:
            setup_tracing(args)
            asyncio.run(self._main(args))
            error = "stopped by itself"
        except BaseException as err:  # SystemExit from a bad setting included
            log.exception("%s failed", self.name)
            error = f"{type(err).__name__}: {err}"
        if self._drain.is_set():
            return
        self._error = error
        self._failed.set()
        if self._announced.ready.is_set() or self._restarted:
            if not self._announced.ready.is_set():
                time.sleep(RESTART_PAUSE_S)
            log.error("%s: %s; exiting so that Ray restarts it", self.name, error)
            sys.stderr.flush()
            os._exit(1)

    async def _main(self, args: argparse.Namespace) -> None:
        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if self._drain.is_set():
            return
        if args.command == "router":
            from tandem.cli.router import router_options
            from tandem.router.main import run

            await run(router_options(args), self._stop)
        else:
            from tandem.cli.worker import serve_worker, worker_options

            await serve_worker(args)(worker_options(args), self._stop)

    def _log_hint(self) -> str:
        return f"its log: {_ray_log_dir()}/worker-*-{os.getpid()}.out on {self._node_ip}"


COMPONENT = ray.remote(max_concurrency=4)(Component)
"""The actor class; methods run on their own threads, so ``drain`` and ``endpoint``
answer while ``ready`` waits."""


def _reconstructed() -> bool:
    """Whether Ray restarted this actor (its ``__init__`` runs again after a crash)."""
    with warnings.catch_warnings():  # deprecated in Ray 2.5x with no replacement yet
        warnings.simplefilter("ignore", DeprecationWarning)
        return ray.get_runtime_context().was_current_actor_reconstructed


def _ray_log_dir() -> str:
    node = ray._private.worker.global_worker.node
    return node.get_logs_dir_path() if node is not None else "Ray's log folder"


class RedisServer:
    """Ray actor class (see ``REDIS``): the embedded Redis (``EmbeddedRedis``) of a
    cluster started without ``--redis-url``. It listens on 127.0.0.1 of its node, so it
    serves single-node clusters; ``stop`` before killing the actor (the server is a
    child process)."""

    def __init__(self) -> None:
        from tandem.common.redis_server import EmbeddedRedis

        self._redis = EmbeddedRedis().start()

    def __repr__(self) -> str:
        return "redis"

    def url(self) -> str:
        return self._redis.url

    def stop(self) -> None:
        self._redis.stop()


REDIS = ray.remote(num_cpus=0)(RedisServer)
