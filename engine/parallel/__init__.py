"""Tensor parallelism: one model split across ranks, one process each.

- ``group``: the ranks' process groups (all-reduce / gather for the model, a CPU group
  for rank 0's step plans) and how they rendezvous;
- ``layers``: column-, row- and vocabulary-parallel layers;
- ``shard``: ``shard_model``, the one step that turns a full-size model (built on the
  meta device, before loading) into one rank's slice of it; model files know nothing of it;
- ``plan``: the typed step plan rank 0 sends the other ranks each forward;
- ``ranks``: how the other ranks are started (local processes or Ray actors) and the
  loop they run.
"""
