"""The prefill worker: computes prompts' KV (chunked, batched, prefix-cached), returns
each request's first token, and holds its KV under a lease until a decode worker pulls
it over the KV-transfer service."""
