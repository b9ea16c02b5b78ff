"""Tandem's native attention kernels (``csrc/paged_decode.c``), built on first use.

Built like every native kernel (``engine/native_build.py``): compiled with the system C
compiler into the user cache once per instruction set (``select_isa``, so
``TANDEM_CPU_ISA=avx512|avx2|portable`` forces one here too) and loaded with ``ctypes``.
``None`` when no compiler is available or the build fails: callers then use the
pure-torch path.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

from tandem.engine.native_build import KernelBuildError, build_library, select_isa

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
COMPILE_FLAGS = ("-ffast-math",)
"""At compile time only (its vectorised ``expf`` among others). Linking a shared object
with ``-ffast-math`` links ``crtfastmath.o``, which sets flush-to-zero and
denormals-are-zero when the library loads, for every later float operation of the
process (torch's, Python's): so the kernel is compiled with it and linked without."""
_AVX2 = ("-mavx2", "-mfma", "-mf16c")  # F16C (fp8 decoding): in every AVX2 CPU
_ISA_FLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", *_AVX2),
    "avx2": _AVX2,
    "portable": (),
}
"""By ``Isa`` value: what the source's ``#if``s test (no VNNI: the kernels use none)."""


def _decode_args() -> list[type]:
    """q, k_cache, v_cache, block_table, seq_lens, out; num_seqs, num_heads, num_kv_heads,
    head_dim, block_size, max_blocks, max_seq_len; scale, window, num_threads."""
    i64 = ctypes.c_int64
    return [*[ctypes.c_void_p] * 6, *[i64] * 7, ctypes.c_float, i64, ctypes.c_int]


@cache
def paged_decode_library() -> ctypes.CDLL | None:
    """The compiled kernels for this CPU's instruction set, or ``None`` (logged) when they
    cannot be built here. ``ValueError`` for a bad ``TANDEM_CPU_ISA``."""
    isa = select_isa()
    flags = (*COMMON_FLAGS, *_ISA_FLAGS[isa.value], "-mtune=native", "-lm")
    try:
        library = build_library(SOURCE, isa, flags, COMPILE_FLAGS)
    except KernelBuildError as error:
        log.warning("paged-attention kernel unavailable, decode attention uses torch: %s", error)
        return None
    library.tandem_paged_decode_isa.restype = ctypes.c_char_p
    library.tandem_paged_decode_max_head_dim.restype = ctypes.c_int64
    library.tandem_paged_decode_max_head_dim.argtypes = []
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
