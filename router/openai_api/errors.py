"""The error the OpenAI layer's request translation raises."""

from __future__ import annotations


class Unsupported(ValueError):
    """A request field Tandem does not do (yet), or cannot read; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
