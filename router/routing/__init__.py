"""Which worker gets a request: the policies and the load views they read.

- ``policy``: the policy interface, ``round_robin`` and ``least_loaded``, and the factory;
- ``prefix_aware``: prefix-aware routing (cached prefix vs load, with guards);
- ``pool_view``: the read-only questions a policy asks of one pool;
- ``live_pools``: pool views kept in step with the registry and in-flight work;
- ``inflight``: load this router has sent but workers have not reported yet.

A policy's decision is pure; the orchestrator records what it chose.
"""
