"""Structured-output constraints as ``llguidance`` grammars, and their validation.

Torch-free (``llguidance`` needs neither torch nor a tokenizer to check a grammar), so
the router refuses a constraint that cannot compile with ``INVALID_ARGUMENT`` before any
worker sees it; the engine compiles the same text against its tokenizer
(``tandem.engine.structured``).
"""

from __future__ import annotations

import functools

from tandem.common.sampling_params import StructuredKind, StructuredOutput


def grammar_text(structured: StructuredOutput) -> str:
    """The ``llguidance`` grammar of a constraint (also used by the router to validate
    it before any worker sees it)."""
    import llguidance

    matcher = llguidance.LLMatcher
    kind = structured.kind
    # Compact JSON (no free whitespace): a model must not be able to pad the output
    # with newlines until it hits max_tokens.
    compact = {"whitespace_flexible": False}
    if kind is StructuredKind.JSON_OBJECT:
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=compact)
    if kind is StructuredKind.JSON_SCHEMA:
        return matcher.grammar_from_json_schema(structured.spec, defaults=compact)
    if kind is StructuredKind.REGEX:
        return matcher.grammar_from_regex(structured.spec)
    return matcher.grammar_from_lark(structured.spec)


@functools.lru_cache(maxsize=256)
def check_constraint(structured: StructuredOutput) -> None:
    """``ValueError`` naming the field when the constraint cannot be compiled (cached:
    a constraint checked once is not compiled again)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_text(structured))
    if error:
        raise ValueError(unusable(structured, error))


def unusable(structured: StructuredOutput, error: str) -> str:
    """One line from ``llguidance``'s report: where, and the parser's own reason."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    reason = next((line for line in lines[1:] if line.startswith("error:")), "")
    detail = (
        f"{lines[0].removesuffix(':')}: {reason.removeprefix('error:').strip()}"
        if reason
        else lines[0]
    )
    return f"structured.{structured.kind.value} is not usable: {detail}"
