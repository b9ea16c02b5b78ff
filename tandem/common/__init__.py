"""Tandem's torch-free shared core.

Everything here imports without torch and without any other Tandem package except the
wire contracts (``tandem.protos``), so the router, the workers and the command line can
all build on it (``tests/test_torch_free.py`` enforces both): block hashing, sampling
parameters, the tokenizer wrapper and text stream, model-config parsing, the Redis
registry and embedded Redis, prefix-cache events, wire conversions, the gRPC server
bootstrap shared by every process, and the gRPC client.
"""
