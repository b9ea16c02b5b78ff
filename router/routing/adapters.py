"""Which workers a LoRA adapter's request may go to, and which it should.

Only workers that hold the adapter (it is in their registry record, under the same
KV namespace: the same files) can serve it. Of those not excluded already (suspects,
workers a retry already tried), the ones that have it in memory serve it at once; the
others first read it from disk (a cold load: tens of milliseconds for a rank-16 adapter
of a 110M model, ``docs/benchmarks/lora.md``). So the request goes to a warm worker
unless the warm ones have more work queued than the cold load costs:

    warm preferred  <=>  min work(warm) <= min work(holders) + cold_load_tokens
    work(w)         =  queued_prefill_tokens(w) + DECODE_SEQ_TOKENS * running_seqs(w)

``cold_load_tokens`` prices the load in prompt tokens (``--lora-cold-load-tokens``).
Beyond that the routing policy chooses as for any request, among the workers left; the
adapter's block hashes are its own, so prefix-aware routing keeps its conversations
where their KV is. A pure function of the pool's records.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from tandem.common.registry import WorkerRecord

DEFAULT_COLD_LOAD_TOKENS = 256
"""A cold load's price in queued prompt tokens: about the prefill time of 256 tokens of
the 110M model on 2 cores (~25 ms) is what reading a rank-16 adapter of it costs."""
DECODE_SEQ_TOKENS = 8
"""A running sequence's weight in the work ahead of a new request, in tokens."""


def work(record: WorkerRecord) -> int:
    load = record.load
    return load.num_queued_prefill_tokens + DECODE_SEQ_TOKENS * load.num_running_seqs


def excluded_for_adapter(
    records: Iterable[WorkerRecord],
    lora_name: str | None,
    namespace: str,
    cold_load_tokens: int,
    exclude: Collection[str] = (),
) -> frozenset[str]:
    """Worker ids a request of ``lora_name`` should not go to, besides ``exclude``
    (suspects, workers already tried): those without the adapter (or with other files
    under its name: another ``namespace``), and those without it in memory while a warm
    one is within ``cold_load_tokens`` of the least work (none for the base model)."""
    if lora_name is None:
        return frozenset()
    records = [r for r in records if r.info.worker_id not in exclude]
    holders = [r for r in records if r.load.adapters.get(lora_name) == namespace]
    lacking = {r.info.worker_id for r in records} - {r.info.worker_id for r in holders}
    warm = [r for r in holders if lora_name in r.load.resident_adapters]
    near = warm and min(map(work, warm)) <= min(map(work, holders)) + cold_load_tokens
    if near and len(warm) < len(holders):
        lacking |= {r.info.worker_id for r in holders if r not in warm}
    return frozenset(lacking)
