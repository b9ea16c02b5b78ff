"""Building Tandem's C kernels: the CPU's instruction set, chosen once, and one compiled
library per source, instruction set, flags and compiler, cached on disk.

Every native kernel (quantized matmuls, paged attention, fused norm / rotary) is C
compiled with the system compiler on first use into the user cache
(``$XDG_CACHE_HOME/tandem/kernels``) and loaded with ``ctypes``: no build step at install
time, no torch headers. Each links OpenMP by soname, so it shares torch's own OpenMP
runtime and thread pool. ``select_isa`` picks the best instruction set the CPU's flags
allow (``avx512`` includes VNNI; a CPU with AVX-512 but no VNNI gets ``avx2``), and
``TANDEM_CPU_ISA=avx512|avx2|portable`` forces one for every kernel alike; each kernel
module keeps its own compiler flags per instruction set.
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

ISA_ENV = "TANDEM_CPU_ISA"


class Isa(enum.Enum):
    AVX512 = "avx512"
    AVX2 = "avx2"
    PORTABLE = "portable"


_CPU_FLAGS_NEEDED: dict[Isa, frozenset[str]] = {
    Isa.AVX512: frozenset(
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma"}
    ),
    Isa.AVX2: frozenset({"avx2", "fma"}),
    Isa.PORTABLE: frozenset(),
}


class KernelBuildError(RuntimeError):
    """The C compiler is missing or rejected the source; carries the compiler's output."""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``); empty where that file is missing."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return frozenset()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def supported_isas() -> list[Isa]:
    """The instruction sets this machine runs, best first (``portable`` always)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [Isa.PORTABLE]
    flags = cpu_flags()
    return [isa for isa in Isa if _CPU_FLAGS_NEEDED[isa] <= flags]


def select_isa() -> Isa:
    """``TANDEM_CPU_ISA`` if set (``ValueError`` when unknown or unsupported here), else
    the best this CPU supports."""
    forced = os.environ.get(ISA_ENV)
    supported = supported_isas()
    if not forced:
        return supported[0]
    try:
        isa = Isa(forced)
    except ValueError:
        valid = ", ".join(i.value for i in Isa)
        raise ValueError(f"{ISA_ENV} must be one of {valid}, got {forced!r}") from None
    if isa not in supported:
        raise ValueError(
            f"{ISA_ENV}={forced} but this CPU lacks it (supported: "
            f"{', '.join(i.value for i in supported)})"
        )
    return isa


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tandem" / "kernels"


def build_library(
    source: Path, isa: Isa, flags: Sequence[str], compile_flags: Sequence[str] = ()
) -> ctypes.CDLL:
    """``source`` compiled with ``flags`` (compiler and linker flags) for ``isa``, loaded.
    ``compile_flags`` apply to compiling only, not to linking (``-ffast-math``: linked, it
    would bring ``crtfastmath.o``, which sets flush-to-zero for the whole process when the
    library loads). Built once per source, flags and compiler (the file name carries
    their hash), then reused; ``KernelBuildError`` when no compiler is found (``$CC``,
    else ``cc``) or it fails."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise KernelBuildError(f"{source.name} needs a C compiler (cc / $CC)")
    all_flags = " ".join((*flags, "|", *compile_flags))
    key = hashlib.sha256(source.read_bytes() + all_flags.encode() + compiler.encode())
    target = cache_dir() / f"{source.stem}-{isa.value}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            if compile_flags:
                obj = Path(tmp) / f"{source.stem}.o"
                steps = [
                    [compiler, "-c", str(source), "-o", str(obj), *flags, *compile_flags],
                    [compiler, str(obj), "-o", str(built), *flags],
                ]
            else:
                steps = [[compiler, str(source), "-o", str(built), *flags]]
            for step in steps:
                result = subprocess.run(step, capture_output=True, text=True)
                if result.returncode != 0:
                    raise KernelBuildError(
                        f"building {source.name} for {isa.value} failed:\n{result.stderr}"
                    )
            built.replace(target)  # atomic: concurrent builders never see half a file
    return ctypes.CDLL(str(target))
