"""Typed errors of the KV transfer path (torch-free).

``KVTransferError`` is the base. The prefill side maps its errors to gRPC status codes
(``service.py``); the decode side turns every failure of a pull into ``KVPullFailed``,
whose ``reason`` tells the caller whether retrying the same prefill worker can help.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class KVTransferError(Exception):
    """Base of every error raised by ``kvtransfer``."""


@dataclass(frozen=True)
class FieldMismatch:
    """One field on which the two ends of a transfer disagree."""

    field: str
    local: str | int
    remote: str | int

    def __str__(self) -> str:
        return f"{self.field}: local {self.local!r}, remote {self.remote!r}"


class IncompatibleKV(KVTransferError):
    """The two workers' KV caches differ, so received bytes would be misread.

    ``mismatches`` names every differing field, not just the first.
    """

    def __init__(self, mismatches: Sequence[FieldMismatch]) -> None:
        self.mismatches = tuple(mismatches)
        super().__init__("incompatible KV cache: " + "; ".join(map(str, self.mismatches)))


class PairBroken(KVTransferError):
    """A pair group is unusable (peer gone, closed, or an operation failed).

    It is never repaired: the decode worker handshakes again for a new generation.
    """


class PairTimeout(PairBroken):
    """An operation on a pair group, or the join itself, ran past its timeout.

    A timed-out gloo operation closes the connection (observed: "Application timeout
    caused pair closure"), and an NCCL one leaves the communicator in an unknown state,
    so a timeout always breaks the pair.
    """


class UnknownPair(KVTransferError):
    """The sender has no pair with this id, or the pair has moved to a newer generation."""


class LeaseCallFailed(KVTransferError):
    """A ``RenewLease`` / ``ReleaseLease`` call did not reach a verdict (RPC error)."""


class PullFailure(enum.Enum):
    """Why a pull failed; the decode worker falls back to local prefill on all of them."""

    INCOMPATIBLE = "incompatible"
    """Handshake refused: the KV layouts differ. This prefill worker will never do."""
    NOT_FOUND = "not found"
    """The sender does not know the lease (released, expired) or the pair generation."""
    BAD_REQUEST = "bad request"
    """The sender rejected the request (e.g. a block index beyond the lease)."""
    TIMEOUT = "timeout"
    """The pull's deadline passed (handshake, join, RPC or data)."""
    PEER_LOST = "peer lost"
    """The sender is unreachable, died, or the pair's connection broke."""
    RPC_ERROR = "rpc error"
    """Any other error status or protocol violation from the sender."""
    CORRUPT = "corrupt"
    """The bytes that arrived do not match the sender's checksum; they are never used."""


class KVPullFailed(KVTransferError):
    """A pull did not deliver its blocks; the receiver's buffer holds nothing usable.

    The pair with that sender has been torn down, so the next pull handshakes again.
    """

    def __init__(self, reason: PullFailure, endpoint: str, lease_id: str, detail: str) -> None:
        self.reason = reason
        self.endpoint = endpoint
        self.lease_id = lease_id
        self.detail = detail
        super().__init__(
            f"pull of lease {lease_id!r} from {endpoint} failed ({reason.value}): {detail}"
        )
