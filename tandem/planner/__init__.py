"""The SLO planner: how many prefill and decode replicas to run (``tandem planner``)."""
