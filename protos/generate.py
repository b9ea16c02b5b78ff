"""Regenerate the Python stubs: ``python -m protos.generate`` (needs grpcio-tools)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").glob("*.proto"))


def protoc_args(out_dir: Path, descriptor_set: Path | None = None) -> list[str]:
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if descriptor_set is not None:
        args.append(f"--descriptor_set_out={descriptor_set}")
    return [*args, *PROTO_FILES]


def main() -> int:
    from grpc_tools import protoc

    return protoc.main(protoc_args(ROOT))


if __name__ == "__main__":
    sys.exit(main())
