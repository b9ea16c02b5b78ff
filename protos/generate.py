"""Regenerate the Python stubs: ``python -m tandem.protos.generate`` (needs grpcio-tools).

The sources live in ``protos/`` but import, and are registered, as
``tandem/protos/*.proto`` so that the generated modules import each other as
``tandem.protos.*``: protoc maps an import path to a Python module one to one. The
sources are therefore staged under a ``tandem/protos/`` tree for protoc, and the stubs
it writes are copied back beside them.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
IMPORT_PREFIX = "tandem/protos"
PROTO_FILES = sorted(f"{IMPORT_PREFIX}/{p.name}" for p in SOURCE_DIR.glob("*.proto"))
"""The sources as protoc (and the descriptor pool) names them."""


@contextlib.contextmanager
def staged_sources() -> Iterator[Path]:
    """A temporary include root holding ``tandem/protos/*.proto``."""
    with tempfile.TemporaryDirectory(prefix="tandem-protos-") as tmp:
        root = Path(tmp)
        (root / IMPORT_PREFIX).mkdir(parents=True)
        for proto in SOURCE_DIR.glob("*.proto"):
            shutil.copy(proto, root / IMPORT_PREFIX / proto.name)
        yield root


def protoc_args(include_root: Path, out_dir: Path, descriptor_set: Path | None = None) -> list[str]:
    args = [
        "protoc",
        f"-I{include_root}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
    ]
    if descriptor_set is not None:
        args.append(f"--descriptor_set_out={descriptor_set}")
    return [*args, *PROTO_FILES]


def main() -> int:
    from grpc_tools import protoc

    with staged_sources() as root, tempfile.TemporaryDirectory() as out:
        if protoc.main(protoc_args(root, Path(out))) != 0:
            return 1
        for stub in (Path(out) / IMPORT_PREFIX).glob("*_pb2*.py"):
            shutil.copy(stub, SOURCE_DIR / stub.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
