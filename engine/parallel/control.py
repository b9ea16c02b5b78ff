"""Rank 0's side calls into the other ranks, next to the step plans.

Step plans are strictly ordered with the forwards; some work is not: a KV transfer
between two replicas joins pair groups and moves bytes while the engines keep
stepping. For that each rank 1..N-1 serves a small call channel on a thread of its own
(``multiprocessing.connection`` over TCP, authenticated with the replica's rendezvous
key, the address published in rank 0's store), and rank 0 calls a named method of the
rank's handler object there. Calls to one rank run one at a time; ``call_all`` runs the
ranks in parallel. A failure inside a handler comes back as the same exception type
when it is one of ``PASSED_ERRORS``, else as ``RankLost``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch.distributed as dist

from tandem.engine.parallel.group import RankLost, Rendezvous

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 300.0


def _address_key(rendezvous: Rendezvous, rank: int) -> str:
    return f"{rendezvous.key}/control/{rank}"


class RankControlServer:
    """On rank r > 0: serves rank 0's calls to ``handler``'s methods on a thread."""

    def __init__(
        self, handler: object, rendezvous: Rendezvous, rank: int, store: dist.Store, host: str
    ) -> None:
        self._handler = handler
        self._listener = Listener((host, 0), authkey=rendezvous.key.encode())
        port = self._listener.address[1]
        store.set(_address_key(rendezvous, rank), f"{host}:{port}")
        self._thread = threading.Thread(target=self._serve, name="tp-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            connection = self._listener.accept()
        except OSError:
            return
        with connection:
            while True:
                try:
                    method, args = connection.recv()
                except (EOFError, OSError):
                    return  # rank 0 is gone; the plan loop notices too
                try:
                    result = ("ok", getattr(self._handler, method)(*args))
                except Exception as error:
                    result = ("error", type(error).__name__, str(error))
                connection.send(result)


class RankControl:
    """On rank 0: a connection to each rank r > 0's ``RankControlServer``."""

    def __init__(self, rendezvous: Rendezvous, store: dist.Store) -> None:
        self.size = rendezvous.world_size
        self._connections: dict[int, Connection] = {}
        self._locks = {r: threading.Lock() for r in range(1, self.size)}
        store.wait(
            [_address_key(rendezvous, r) for r in range(1, self.size)],
            _timedelta(CONNECT_TIMEOUT_S),
        )
        for r in range(1, self.size):
            host, port = store.get(_address_key(rendezvous, r)).decode().rsplit(":", 1)
            self._connections[r] = Client((host, int(port)), authkey=rendezvous.key.encode())
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(1, self.size - 1), thread_name_prefix="tp-control"
        )

    def call(self, rank: int, method: str, *args: Any) -> Any:
        connection = self._connections[rank]
        with self._locks[rank]:
            try:
                connection.send((method, args))
                reply = connection.recv()
            except (EOFError, OSError) as error:
                raise RankLost(f"tensor-parallel rank {rank} is gone: {error}") from error
        if reply[0] == "ok":
            return reply[1]
        _, kind, message = reply
        raise _error(kind, f"rank {rank}: {message}")

    def call_all(self, method: str, args_of: Callable[[int], Sequence[Any]]) -> list[Any]:
        """``method`` on every rank r > 0 with ``args_of(r)``, in parallel; results by
        rank (index 0 is rank 1). The first failure is raised after all have ended."""
        futures = [
            self._pool.submit(self.call, r, method, *args_of(r)) for r in range(1, self.size)
        ]
        concurrent.futures.wait(futures)
        return [f.result() for f in futures]

    def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._pool.shutdown(wait=False)


PASSED_ERRORS: dict[str, Callable[[str], Exception]] = {}
"""Exception types a handler's failure keeps across the call (registered by name)."""


def pass_error(kind: type[Exception]) -> None:
    PASSED_ERRORS[kind.__name__] = kind


def _error(kind: str, message: str) -> Exception:
    make = PASSED_ERRORS.get(kind)
    return make(message) if make is not None else RankLost(message)


def _timedelta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)
