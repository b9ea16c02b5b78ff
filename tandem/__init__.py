"""Tandem: a disaggregated LLM serving cluster.

One import namespace, one package per role:

- ``tandem.common``: the torch-free shared core (block hashing, sampling parameters,
  tokenizer and text stream, model-config parsing, the Redis registry, KV events, the
  gRPC server bootstrap). It imports no other Tandem package but ``tandem.protos``.
- ``tandem.engine``: the model runtime both workers share (source: ``engine/``).
- ``tandem.kvtransfer``: moving paged KV blocks between workers (``kvtransfer/``).
- ``tandem.router``: the gRPC front door, torch-free (``router/``).
- ``tandem.prefill_worker``, ``tandem.decode_worker``: the two worker services.
- ``tandem.protos``: the ``tandem.v1`` wire contracts and their stubs (``protos/``).
- ``tandem.cli``: the ``tandem`` command, the only package that imports every component.
- ``tandem.tools``: checkpoint maker, tokenizer and trainer (test and demo fixtures).
- ``tandem.bench``: benchmarks and the fleet simulator (``bench/``).
"""

__version__ = "0.1.0"
