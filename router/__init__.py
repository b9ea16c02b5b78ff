"""The front door: the public ``Generation`` service, validation, routing policies and
the prefill -> decode orchestration. Imports no torch (a test enforces it)."""
