"""When a request is done, at the token level (stop strings live in ``tandem.common.text_stream``).

Torch-free. The finish reasons match vLLM's strings: ``stop`` for EOS / stop tokens /
stop strings, ``length`` for ``max_tokens`` or a full context.
"""

from __future__ import annotations

from collections.abc import Collection

from tandem.common.sampling_params import SamplingParams
from tandem.engine.request import FinishReason, Request


def check_token_stop(
    request: Request, eos_token_ids: Collection[int], max_model_len: int
) -> FinishReason | None:
    """Checked after each appended output token."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens and (
        last in params.stop_token_ids or (not params.ignore_eos and last in eos_token_ids)
    ):
        return FinishReason.STOP
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def banned_tokens(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: Collection[int]
) -> tuple[int, ...]:
    """Token ids the sampler must not pick as output token number ``num_output_tokens``
    (counting from 0): EOS and stop tokens while under ``min_tokens``."""
    if num_output_tokens >= params.min_tokens:
        return ()
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return (*eos, *params.stop_token_ids)
