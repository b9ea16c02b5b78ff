"""The OpenAI-compatible HTTP API the router serves next to its gRPC one."""
