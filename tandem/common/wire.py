"""Conversions between the wire types in ``protos/`` and Tandem's own types.

Torch-free; used by the router and both workers, so a field means the same thing at
every hop. Proto3 optional fields that are unset take the model's defaults where the
caller passes them (the router: ``tandem.common.generation_config``), else
``SamplingParams``' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tandem.common.generation_config import SamplingDefaults
from tandem.common.sampling_params import (
    SamplingParams,
    SpecMethod,
    SpeculativeOptions,
    StructuredKind,
    StructuredOutput,
)
from tandem.protos import common_pb2, worker_pb2

_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "seed",
    "logprobs",
    "skip_special_tokens",
)
_PLAIN_FIELDS = (
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "ignore_eos",
    "include_stop_str_in_output",
)

FINISH_REASON_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
FINISH_REASON_FROM_PROTO = {v: k for k, v in FINISH_REASON_TO_PROTO.items()}
MIGRATION_CAUSE_NAMES = {
    worker_pb2.MIGRATION_CAUSE_DRAIN: "drain",
    worker_pb2.MIGRATION_CAUSE_REBALANCE: "rebalance",
    worker_pb2.MIGRATION_CAUSE_REQUESTED: "requested",
}
"""A live migration's cause as metric labels (router and decode workers) name it."""


_METHOD_FROM_PROTO = {
    common_pb2.SPECULATIVE_METHOD_UNSPECIFIED: None,
    common_pb2.SPECULATIVE_METHOD_NGRAM: SpecMethod.NGRAM,
    common_pb2.SPECULATIVE_METHOD_DRAFT: SpecMethod.DRAFT,
}
_METHOD_TO_PROTO = {v: k for k, v in _METHOD_FROM_PROTO.items()}


def sampling_from_proto(
    msg: common_pb2.SamplingParams, defaults: SamplingDefaults | None = None
) -> SamplingParams:
    """``defaults``: values for the optional fields ``msg`` leaves unset (``None``:
    ``SamplingParams``' own). Raises ``ValueError`` (message starts with the field name)
    for invalid values."""
    kwargs: dict[str, object] = {f: getattr(msg, f) for f in _PLAIN_FIELDS}
    if defaults is not None:
        kwargs.update(defaults.given())
    kwargs.update({f: getattr(msg, f) for f in _OPTIONAL_FIELDS if msg.HasField(f)})
    if msg.HasField("top_k") and msg.top_k == 0:  # explicitly off, over any model default
        kwargs["top_k"] = None
    return SamplingParams(
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        speculative=_speculative_from_proto(msg.speculative),
        structured=_structured_from_proto(msg),
        logit_bias=dict(msg.logit_bias),
        **kwargs,
    )


def _structured_from_proto(msg: common_pb2.SamplingParams) -> StructuredOutput | None:
    if not msg.HasField("structured"):
        return None
    which = msg.structured.WhichOneof("constraint")
    if which is None:
        return None
    if which == "json_object":
        if not msg.structured.json_object:
            return None
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    return StructuredOutput(StructuredKind(which), getattr(msg.structured, which))


def _structured_to_proto(structured: StructuredOutput) -> common_pb2.StructuredOutput:
    if structured.kind is StructuredKind.JSON_OBJECT:
        return common_pb2.StructuredOutput(json_object=True)
    return common_pb2.StructuredOutput(**{structured.kind.value: structured.spec})


def _speculative_from_proto(msg: common_pb2.SpeculativeParams) -> SpeculativeOptions:
    if msg.method not in _METHOD_FROM_PROTO:
        raise ValueError(f"speculative.method {msg.method} is not a known method")
    return SpeculativeOptions(
        enabled=msg.enabled if msg.HasField("enabled") else None,
        method=_METHOD_FROM_PROTO[msg.method],
        num_tokens=msg.num_speculative_tokens if msg.HasField("num_speculative_tokens") else None,
    )


def _speculative_to_proto(options: SpeculativeOptions) -> common_pb2.SpeculativeParams:
    msg = common_pb2.SpeculativeParams(method=_METHOD_TO_PROTO[options.method])
    if options.enabled is not None:
        msg.enabled = options.enabled
    if options.num_tokens is not None:
        msg.num_speculative_tokens = options.num_tokens
    return msg


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        speculative=_speculative_to_proto(params.speculative),
    )
    if params.structured is not None:
        msg.structured.CopyFrom(_structured_to_proto(params.structured))
    msg.logit_bias.update(dict(params.logit_bias))
    for name in _PLAIN_FIELDS:
        setattr(msg, name, getattr(params, name))
    for name in _OPTIONAL_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


class LogprobsLike(Protocol):
    token_logprob: float
    top: tuple[tuple[int, float], ...]


def logprobs_to_proto(items: Sequence[LogprobsLike]) -> list[common_pb2.TokenLogprobs]:
    return [
        common_pb2.TokenLogprobs(
            logprob=lp.token_logprob,
            top=[common_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in items
    ]
