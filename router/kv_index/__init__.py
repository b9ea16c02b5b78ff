"""The router's view of which worker caches which KV blocks.

- ``index``: ``PrefixIndex``, the data structure (block hash -> bitmask of workers);
- ``indexer``: ``KVIndexer``, the index kept honest by typed inputs (events, snapshots,
  membership) with per-worker epochs and batch numbers;
- ``consumer``: feeds the indexer from the model's Redis event stream and from worker
  snapshots.

The worker side of the events is ``tandem.common.kv_events``.
"""
