"""Moving paged KV blocks from prefill workers to decode workers.

Roles and files:

- both sides: ``layout`` (what must match, the handshake check), ``blocks`` (pack /
  unpack of paged blocks), ``pair`` (a two-rank gloo/NCCL group with timeouts),
  ``errors``;
- prefill side: ``leases`` (torch-free: which blocks are held for whom, and who frees
  them), ``sender`` (rendezvous store, pair groups, sends), ``service`` (the
  ``KVTransfer`` gRPC service);
- decode side: ``receiver`` (handshake, pull, release; ``KVPullFailed`` on any failure);
- ``testing``: a prefill-side server on random KV in a child process, for tests and
  benchmarks.

Nothing is imported here, so ``tandem.kvtransfer.leases`` and ``tandem.kvtransfer.errors`` stay
importable without torch.
"""
