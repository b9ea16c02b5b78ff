"""Helpers for tests that drive an ``LLMEngine`` directly."""

from __future__ import annotations

from tandem.engine.llm_engine import LLMEngine


def run_to_completion(engine: LLMEngine, request_id: str) -> list[int]:
    """Step ``engine`` until nothing is left; the new token ids of ``request_id``."""
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id == request_id:
                tokens += delta.new_token_ids
    return tokens
