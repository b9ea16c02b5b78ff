"""The ``hf`` system: HuggingFace transformers with static batching.

The whole workload is one left-padded batch (64 requests of at most 512 + 256 tokens fit
easily in memory at this model size). Every row generates ``max_new_tokens`` = the
longest request's ``max_tokens``, with ``min_new_tokens`` equal to it so EOS cannot stop
a row early; each request is then credited only the tokens it asked for, so a static
batch pays for the padding a continuous-batching engine avoids.

Run by ``throughput.py`` as ``python -m tandem.bench._hf_runner JOB.json RESULT.json``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import transformers
from transformers import AutoModelForCausalLM

from tandem.bench._runner import RunnerJob, run
from tandem.bench.workloads import Request


class HFStaticBatch:
    """A float32 ``AutoModelForCausalLM`` generating one static, left-padded batch per call."""

    def __init__(self, model_dir: str, threads: int) -> None:
        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        config = self.model.config
        self.pad_id = _first_id(config.pad_token_id, config.eos_token_id)

    def generate(self, requests: Sequence[Request]) -> list[list[int]]:
        input_ids, attention_mask = _left_pad(requests, self.pad_id)
        new_tokens = max(r.max_tokens for r in requests)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
            )
        generated = out[:, input_ids.shape[1] :]
        return [generated[i, : r.max_tokens].tolist() for i, r in enumerate(requests)]

    def kv_waste(self) -> float | None:
        return None

    def settings(self) -> dict[str, str]:
        return {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "torch_threads": str(torch.get_num_threads()),
            "attn_implementation": str(self.model.config._attn_implementation),
            "batching": "static: whole workload as one left-padded batch",
        }


def _left_pad(requests: Sequence[Request], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt_token_ids) for r in requests)
    ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, request in enumerate(requests):
        n = len(request.prompt_token_ids)
        ids[row, width - n :] = torch.tensor(request.prompt_token_ids)
        mask[row, width - n :] = 1
    return ids, mask


def _first_id(*candidates: int | list[int] | None, default: int = 0) -> int:
    """The first usable id: an int, or the head of a non-empty list (eos may be a list)."""
    for candidate in candidates:
        if isinstance(candidate, list) and candidate:
            return int(candidate[0])
        if isinstance(candidate, int):
            return candidate
    return default


def _load(job: RunnerJob) -> HFStaticBatch:
    return HFStaticBatch(job.model_dir, job.threads)


if __name__ == "__main__":
    sys.exit(run(_load))
