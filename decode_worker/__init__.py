"""The decode worker: pulls each request's prompt KV from its prefill worker (only the
blocks its own prefix cache lacks), then decodes with continuous batching and streams
tokens back. Without a KV handle, or when the pull fails, it prefills locally."""
