"""Loading Tandem's native kernels leaves the process's floating-point state alone: no
flush-to-zero or denormals-are-zero for torch or Python afterwards. (A shared object
linked with ``-ffast-math`` sets both when it loads; the attention kernel is compiled
with it and linked without: ``engine.native_build.build_library``.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_do_not_flush_subnormals() -> None:
    code = (
        "import torch\n"
        "from tandem.engine.attention.native import paged_decode_library\n"
        "from tandem.engine.layers.native_ops import fused_ops\n"
        "from tandem.engine.quantization.kernels import quant_kernels\n"
        "from tandem.engine.native_build import select_isa\n"
        "isa = select_isa()\n"
        "libraries = [paged_decode_library(), fused_ops(isa), quant_kernels(isa)]\n"
        "assert all(lib is not None for lib in libraries), libraries\n"
        "tiny = 5e-324\n"
        "assert tiny * 1.0 == tiny, 'Python floats flush subnormals'\n"
        "t = torch.tensor([1e-40], dtype=torch.float32)\n"
        "assert (t * 1.0).item() != 0.0, 'torch flushes subnormals'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)
