"""Process lifecycle helpers shared by every Tandem server process."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 20.0
"""How long a process may take to close down after its drain before it is ended."""
STUCK_EXIT_CODE = 75


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (the process then shuts down cleanly)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def arm_exit_watchdog(seconds: float) -> None:
    """Shutdown has begun: if the process is still alive ``seconds`` from now, print
    every thread's stack to stderr and end it with ``STUCK_EXIT_CODE``. A shutdown that
    hangs (a peer that never answers, a thread stuck in a collective) must not keep a
    pod or a launcher waiting, and the stacks say where it hung."""

    def watch() -> None:
        threading.Event().wait(seconds)
        log.error("shutdown did not finish in %.0f s; exiting (stacks follow)", seconds)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(STUCK_EXIT_CODE)

    threading.Thread(target=watch, name="exit-watchdog", daemon=True).start()
