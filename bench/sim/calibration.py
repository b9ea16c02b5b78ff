"""Step costs of the real engine, as the simulator's workers spend them.

Measured by ``bench/sim/calibrate.py`` on this machine and stored as JSON next to this
file (``calibration_<size>.json``). All times in seconds:

    prefill step  = prefill_step_s + prefill_token_s * new tokens
                    + prefill_context_token_s * new tokens * attended / 1000
    attended      = context tokens + new tokens / 2   (a new token's mean causal span)
    decode step   = decode_step_s + decode_seq_s * sequences + decode_kv_token_s * KV tokens
    KV pull       = pull_call_s + pull_byte_s * bytes   (per request, prefill -> decode)

Torch-free (the simulator never loads a model).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Calibration:
    model: str
    """What was measured: model size, dtype, threads, machine."""
    block_size: int
    bytes_per_block: int
    prefill_step_s: float
    prefill_token_s: float
    prefill_context_token_s: float
    decode_step_s: float
    decode_seq_s: float
    decode_kv_token_s: float
    pull_call_s: float
    pull_byte_s: float
    max_num_batched_tokens: int

    @staticmethod
    def attended(new_tokens: int, context_tokens: int) -> float:
        """Keys a new token attends to, on average: the cached context and half the
        chunk it arrives in."""
        return context_tokens + new_tokens / 2

    def prefill_time(self, new_tokens: int, context_tokens: int) -> float:
        return (
            self.prefill_step_s
            + self.prefill_token_s * new_tokens
            + self.prefill_context_token_s
            * new_tokens
            * self.attended(new_tokens, context_tokens)
            / 1000
        )

    def decode_time(self, num_seqs: int, kv_tokens: int) -> float:
        return (
            self.decode_step_s + self.decode_seq_s * num_seqs + self.decode_kv_token_s * kv_tokens
        )

    def pull_time(self, num_blocks: int) -> float:
        return self.pull_call_s + self.pull_byte_s * num_blocks * self.bytes_per_block

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Calibration:
        return cls(**json.loads(path.read_text()))

    @classmethod
    def named(cls, size: str) -> Calibration:
        """The committed calibration of a ``tandem make-model`` size (``tiny``, ``medium``)."""
        return cls.load(HERE / f"calibration_{size}.json")
