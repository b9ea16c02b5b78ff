"""One request's output text: incremental detokenization plus stop strings.

Torch-free; used by the engine (offline API) and by the router (which turns the
workers' token streams into text). Text is released only when final: a multi-byte
character is held until complete, and while stop strings are set, the last
``len(longest stop) - 1`` characters are held until the request finishes, since they
may still turn into a stop string. The concatenation of all released pieces is the
request's final text.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tandem.common.sampling_params import SamplingParams
from tandem.common.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class TextUpdate:
    new_text: str
    stop_string_hit: bool
    """A stop string matched: the request must finish now (reason ``stop``)."""


class TextStream:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=params.skip_special_tokens
        )
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._hold_back = max((len(s) for s in params.stop), default=1) - 1
        self.text = ""
        self._num_released = 0

    def push(self, token_ids: list[int], finishing: bool) -> TextUpdate:
        """Add generated tokens; ``finishing``: no more will come (release everything)."""
        piece = self._detokenizer.push(token_ids)
        if finishing:
            piece += self._detokenizer.flush()
        self.text += piece
        keep = find_stop_string(self.text, len(piece), self._stops, self._include_stop)
        if keep is not None:
            self.text = self.text[:keep]
        if finishing or keep is not None:
            release_to = len(self.text)
        else:
            release_to = max(self._num_released, len(self.text) - self._hold_back)
        new_text = self.text[self._num_released : release_to]
        self._num_released = release_to
        return TextUpdate(new_text, keep is not None)


def find_stop_string(
    text: str, num_new_chars: int, stops: Collection[str], include_stop: bool
) -> int | None:
    """Where ``text`` is cut if a stop string ends inside its last ``num_new_chars``
    characters (the earliest match wins), else ``None``."""
    if not stops or not num_new_chars:
        return None
    longest = max(len(s) for s in stops)
    window_start = max(0, len(text) - num_new_chars - longest + 1)
    matches = [(at, stop) for stop in stops if (at := text.find(stop, window_start)) >= 0]
    if not matches:
        return None
    at, stop = min(matches)
    return at + len(stop) if include_stop else at
