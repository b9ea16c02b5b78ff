"""Prefix-cache events, from a worker's block pool to the routers' KV indexes.

- ``events``: the typed events (block stored / evicted, cache cleared) and their batches;
- ``wire``: the Redis stream they travel on and their protobuf codec;
- ``publisher``: the worker side, engine callbacks into the stream.

The router's side (index, indexer, stream consumer) is ``tandem.router.kv_index``.
"""
