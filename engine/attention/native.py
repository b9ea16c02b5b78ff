"""Tandem's one native kernel (paged decode attention on the CPU), built on first use.

The C source next to this file is compiled with the system C compiler into the user
cache, keyed by the source, the flags and the machine (``-march=native``), and loaded
with ``ctypes``: no build step at install time, no torch headers (it compiles in about a
second). It links OpenMP by soname, so it shares torch's own OpenMP runtime and thread
pool instead of starting a second one. ``None`` when no compiler is available: callers
then use the pure-torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tandem" / "kernels"


def _machine_key() -> str:
    cpu = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), "")
    return f"{platform.machine()}|{cpu}"


@cache
def paged_decode_library() -> ctypes.CDLL | None:
    """The compiled kernel, or ``None`` (logged) when it cannot be built here."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler found: decode attention falls back to torch")
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _machine_key().encode())
    target = _cache_dir() / f"paged_decode-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                log.warning("building the paged-attention kernel failed:\n%s", result.stderr)
                return None
            built.replace(target)  # atomic: concurrent builders never see half a file
    library = ctypes.CDLL(str(target))
    decode_args = (
        [ctypes.c_void_p] * 6
        + [ctypes.c_int64] * 7
        + [ctypes.c_float, ctypes.c_int64, ctypes.c_int]
    )
    for name, extra in (
        ("tandem_paged_decode_f32", []),
        ("tandem_paged_decode_i8", []),
        ("tandem_paged_decode_fp8", [ctypes.c_void_p]),  # the code -> value table
    ):
        fn = getattr(library, name)
        fn.restype = ctypes.c_int
        fn.argtypes = decode_args + extra
    return library
