"""Tandem's native attention kernels (``csrc/paged_decode.c``), built on first use.

The C source next to this file is compiled with the system C compiler into the user
cache, once per instruction set (``engine/quantization/kernels.py``'s choice:
``select_isa``, so ``TANDEM_CPU_ISA=avx512|avx2|portable`` forces one here too), keyed by
the source, the flags and the compiler, and loaded with ``ctypes``: no build step at
install time, no torch headers (a few seconds, once). It links OpenMP by soname, so it
shares torch's own OpenMP runtime and thread pool instead of starting a second one.
``None`` when no compiler is available or the build fails: callers then use the
pure-torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
COMMON_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_AVX2 = ("-mavx2", "-mfma", "-mf16c")  # F16C (fp8 decoding): in every AVX2 CPU
_ISA_FLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", *_AVX2),
    "avx2": _AVX2,
    "portable": (),
}
"""By ``Isa`` value: what the source's ``#if``s test (no VNNI: the kernels use none)."""


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tandem" / "kernels"


def _decode_args() -> list[type]:
    """q, k_cache, v_cache, block_table, seq_lens, out; num_seqs, num_heads, num_kv_heads,
    head_dim, block_size, max_blocks, max_seq_len; scale, window, num_threads."""
    i64 = ctypes.c_int64
    return [*[ctypes.c_void_p] * 6, *[i64] * 7, ctypes.c_float, i64, ctypes.c_int]


@cache
def paged_decode_library() -> ctypes.CDLL | None:
    """The compiled kernels for this CPU's instruction set, or ``None`` (logged) when they
    cannot be built here. ``ValueError`` for a bad ``TANDEM_CPU_ISA``."""
    from tandem.engine.quantization.kernels import select_isa

    isa = select_isa()
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler found: decode attention falls back to torch")
        return None
    flags = (*COMMON_FLAGS, *_ISA_FLAGS[isa.value], "-mtune=native")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + compiler.encode())
    target = _cache_dir() / f"paged_decode-{isa.value}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", str(built), "-lm"],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                log.warning("building the paged-attention kernel failed:\n%s", result.stderr)
                return None
            built.replace(target)  # atomic: concurrent builders never see half a file
    library = ctypes.CDLL(str(target))
    library.tandem_paged_decode_isa.restype = ctypes.c_char_p
    for name in ("tandem_paged_decode_f32", "tandem_paged_decode_i8", "tandem_paged_decode_fp8"):
        fn = getattr(library, name)
        fn.restype = ctypes.c_int
        fn.argtypes = _decode_args()
    library.tandem_kv_write_q8.restype = None
    # fp8?, k, v, k_stride, v_stride, slots, num_tokens, num_kv_heads, head_dim, k_cache,
    # v_cache, num_threads
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.tandem_kv_write_q8.argtypes = [
        ctypes.c_int,
        ptr,
        ptr,
        i64,
        i64,
        ptr,
        i64,
        i64,
        i64,
        ptr,
        ptr,
        ctypes.c_int,
    ]
    library.tandem_fp8_decode.restype = None
    library.tandem_fp8_decode.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return library
