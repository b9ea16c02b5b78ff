"""The committed stubs match the .proto sources.

Regenerate them with ``python -m tandem.protos.generate``."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tandem.protos.generate import PROTO_FILES, SOURCE_DIR, protoc_args, staged_sources

protoc = pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools (test extra) not installed")


def _without_json_names(file_proto):
    """Generated modules omit ``json_name``; protoc's descriptor sets include it."""
    stack = list(file_proto.message_type)
    while stack:
        message = stack.pop()
        for field in message.field:
            field.ClearField("json_name")
        stack.extend(message.nested_type)
    return file_proto


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    from google.protobuf import descriptor_pb2

    descriptor_set = tmp_path / "set.pb"
    with staged_sources() as include_root:
        assert protoc.main(protoc_args(include_root, tmp_path, descriptor_set)) == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes())
    assert sorted(f.name for f in fresh.file) == PROTO_FILES
    for file_proto in fresh.file:
        stem = file_proto.name.removesuffix(".proto")
        module = importlib.import_module(stem.replace("/", ".") + "_pb2")
        committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        assert committed == _without_json_names(file_proto), (
            f"{file_proto.name} changed since its stubs were generated: "
            "run `python -m tandem.protos.generate`"
        )
        grpc_stub = SOURCE_DIR / f"{Path(stem).name}_pb2_grpc.py"
        regenerated = (tmp_path / f"{stem}_pb2_grpc.py").read_text()
        assert _code_lines(grpc_stub.read_text()) == _code_lines(regenerated), (
            f"{grpc_stub.name} is stale: run `python -m tandem.protos.generate`"
        )


def _code_lines(source: str) -> list[str]:
    """Lines naming the generator's version differ between grpcio-tools releases."""
    return [line for line in source.splitlines() if "VERSION" not in line]
