"""Per-request text side of the engine: incremental detokenization and stop strings.

Torch-free. Text is released only when it is final: a multi-byte character is held until
complete, and while stop strings are set, the last ``len(longest stop) - 1`` characters
are held until the request finishes, since they may still turn into a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.request import Request
from engine.stopping import find_stop_string
from tandem.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class TextState:
    detokenizer: IncrementalDetokenizer
    hold_back: int
    text: str = ""
    num_released: int = 0


@dataclass(frozen=True)
class TextUpdate:
    new_text: str
    stop_string_hit: bool


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, TextState] = {}

    def add(self, request: Request) -> None:
        params = request.sampling_params
        detok = IncrementalDetokenizer(
            self.tokenizer, skip_special_tokens=params.skip_special_tokens
        )
        hold_back = max((len(s) for s in params.stop), default=1) - 1
        self.states[request.request_id] = TextState(detok, hold_back)

    def remove(self, request_id: str) -> TextState | None:
        return self.states.pop(request_id, None)

    def process(self, request: Request, new_token_ids: list[int], finishing: bool) -> TextUpdate:
        """Detokenize new tokens and look for stop strings; returns the text now final.
        ``finishing``: the engine core already finished the request (flush everything)."""
        state = self.states[request.request_id]
        params = request.sampling_params
        piece = state.detokenizer.push(new_token_ids)
        if finishing:
            piece += state.detokenizer.flush()
        state.text += piece
        match = find_stop_string(
            state.text, len(piece), params.stop, params.include_stop_str_in_output
        )
        if match is not None:
            state.text = state.text[: match.keep_chars]
        final = finishing or match is not None
        release_to = (
            len(state.text) if final else max(state.num_released, len(state.text) - state.hold_back)
        )
        new_text = state.text[state.num_released : release_to]
        state.num_released = release_to
        return TextUpdate(new_text, match is not None)
