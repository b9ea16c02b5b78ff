"""Scheduler behaviour, driven without a model: every sampled token is 7 (torch-free)."""

from __future__ import annotations

import pytest

from tandem.common.sampling_params import SamplingParams
from tandem.engine.block_pool import BlockPool
from tandem.engine.kv_cache_manager import KVCacheManager
from tandem.engine.request import FinishReason, Request, RequestStatus
from tandem.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 1


def _scheduler(num_blocks: int = 64, block_size: int = 4, **config: int) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), block_size)
    return Scheduler(SchedulerConfig(max_model_len=256, **config), kv, {EOS})


def _request(rid: str, n: int, max_tokens: int = 4, priority: int = 0, **kw) -> Request:
    """Prompts of different requests share no block (the first token differs)."""
    tokens = [1000 + sum(map(ord, rid)) * 7, *range(100, 99 + n)]
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, **kw), priority=priority)


def _step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, {c.request.request_id: [token] for c in out.chunks if c.samples})
    return out


def test_chunked_prefill_respects_budget_and_mixes_with_decodes() -> None:
    s = _scheduler(max_num_batched_tokens=10)
    a = _request("a", 6)
    s.add(a)
    first = _step(s)
    assert [(c.request.request_id, c.num_tokens) for c in first.chunks] == [("a", 6)]
    s.add(_request("b", 25))
    out = _step(s)
    # a decodes (1 token) and b gets the rest of the budget (9 of its 25 prompt tokens)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [
        ("a", 6, 1),
        ("b", 0, 9),
    ]
    assert out.num_tokens == 10
    assert not out.chunks[1].samples  # a partial prefill samples nothing
    assert s.running[1].num_computed_tokens == 9


def test_requests_finish_on_max_tokens_and_eos_and_free_blocks() -> None:
    s = _scheduler()
    a, b = _request("a", 5, max_tokens=3), _request("b", 5, max_tokens=10)
    s.add(a)
    s.add(b)
    reported = []
    for _ in range(3):
        reported += _step(s).finished_request_ids
    assert a.finish_reason is FinishReason.LENGTH and a.output_token_ids == [7, 7, 7]
    reported += _step(s, token=EOS).finished_request_ids
    assert b.finish_reason is FinishReason.STOP and b.output_token_ids[-1] == EOS
    assert s.kv.pool.num_free_blocks == 64
    reported += s.schedule().finished_request_ids
    assert reported == ["a", "b"]  # each reported once, to the step after it left


def test_min_tokens_defers_eos() -> None:
    s = _scheduler()
    a = _request("a", 3, max_tokens=5, min_tokens=2)
    s.add(a)
    _step(s, token=EOS)
    assert a.status is RequestStatus.RUNNING  # 1 output < min_tokens: EOS does not stop
    _step(s, token=EOS)
    assert a.finish_reason is FinishReason.STOP


def test_preemption_evicts_latest_arrival_and_recomputes_its_tokens() -> None:
    s = _scheduler(num_blocks=6, block_size=4)
    a, b = _request("a", 8, max_tokens=12), _request("b", 8, max_tokens=12)
    s.add(a)
    s.add(b)
    # Each grows to 20 tokens (5 blocks); together they cannot fit in 6 blocks, so b,
    # the later arrival, must be preempted while a runs to completion.
    preempted = []
    for _ in range(12):
        out = _step(s)
        preempted += [r.request_id for r in out.preempted]
        if preempted:
            break
    assert preempted == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert len(b.output_token_ids) > 0  # produced tokens are kept and will be recomputed
    tokens_before = list(b.all_token_ids)
    while not a.is_finished:
        _step(s)
    out = _step(s)
    resumed = [c for c in out.chunks if c.request is b]
    # b recomputes prompt + its earlier outputs (minus what the prefix cache still holds)
    assert resumed and resumed[0].start == b.num_cached_tokens
    assert resumed[0].end == len(tokens_before)
    assert b.all_token_ids[: len(tokens_before)] == tokens_before
    while not b.is_finished:
        _step(s)
    assert b.num_output_tokens == 12 and s.kv.pool.num_free_blocks == 6


def test_priority_orders_admission_and_victims() -> None:
    s = _scheduler(max_num_seqs=1)
    low, high = _request("low", 4, priority=5), _request("high", 4, priority=-1)
    s.add(low)
    s.add(high)
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["high"]


def test_max_num_seqs_caps_running() -> None:
    s = _scheduler(max_num_seqs=2)
    for i in range(4):
        s.add(_request(f"r{i}", 3))
    out = _step(s)
    assert len(out.chunks) == 2 and len(s.waiting) == 2


def test_abort_waiting_and_running_frees_everything() -> None:
    s = _scheduler(num_blocks=8)
    a, b = _request("a", 9), _request("b", 40)
    s.add(a)
    s.add(b)
    _step(s)
    s.finish(a, FinishReason.ABORT)
    s.finish(b, FinishReason.ABORT)
    assert s.num_unfinished == 0 and s.kv.pool.num_free_blocks == 8
    assert a.finish_reason is FinishReason.ABORT


def test_prefix_hit_counts_as_computed_tokens() -> None:
    s = _scheduler(block_size=4)
    a = _request("a", 12, max_tokens=1)
    s.add(a)
    _step(s)
    b = Request("b", list(a.prompt_token_ids), SamplingParams(max_tokens=1))
    s.add(b)
    out = s.schedule()
    assert b.num_cached_tokens == 8
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(8, 4)]


def test_without_chunking_a_long_prompt_waits_for_a_full_budget() -> None:
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False),
        KVCacheManager(BlockPool(64), 4),
        {EOS},
    )
    s.add(_request("a", 20))
    s.add(_request("b", 20))
    out = s.schedule()
    assert [c.num_tokens for c in out.chunks] == [20]  # b does not fit the remaining 12


def test_a_request_that_can_never_fit_fails_loudly_instead_of_spinning() -> None:
    s = _scheduler(num_blocks=2, block_size=4)
    s.add(_request("a", 7, max_tokens=10))
    with pytest.raises(RuntimeError, match="KV cache"):
        for _ in range(10):
            _step(s)


# --- speculative decoding: drafts in, rejected drafts rolled back -----------------------


def _decoding(s: Scheduler, *requests: Request) -> None:
    """Prefill ``requests`` and sample their first token: each then has one to compute."""
    for request in requests:
        s.add(request)
    _step(s)
    assert all(r.num_uncomputed_tokens == 1 for r in requests)


def test_drafts_reach_the_scheduler_only_through_schedule() -> None:
    s = _scheduler()
    a, b = _request("a", 5, max_tokens=10), _request("b", 5, max_tokens=10)
    _decoding(s, a, b)
    out = s.schedule({"a": (11, 12, 13), "gone": (1, 2)})  # "gone" is not running: ignored
    chunks = {c.request.request_id: c for c in out.chunks}
    assert set(chunks) == {"a", "b"}
    assert chunks["a"].draft_token_ids == (11, 12, 13)
    assert (chunks["a"].start, chunks["a"].num_tokens) == (5, 1 + 3) and chunks["a"].samples
    assert chunks["b"].draft_token_ids == () and chunks["b"].num_tokens == 1
    s.update(out, {"a": [11, 7], "b": [7]})
    assert not hasattr(a, "draft_token_ids")  # nothing rides on the request
    again = s.schedule()  # and nothing is kept from one call to the next
    assert [(c.num_tokens, c.draft_token_ids) for c in again.chunks] == [(1, ()), (1, ())]


def test_drafts_that_do_not_fit_the_budget_are_dropped() -> None:
    s = _scheduler(max_num_batched_tokens=6)
    a = _request("a", 5, max_tokens=10)
    _decoding(s, a)
    s.add(_request("b", 20))
    out = s.schedule({"a": (11, 12, 13, 14, 15, 16)})  # 1 + 6 > 6: a decodes plainly
    assert [(c.request.request_id, c.num_tokens, c.draft_token_ids) for c in out.chunks] == [
        ("a", 1, ()),
        ("b", 5, ()),
    ]


@pytest.mark.parametrize(
    ("num_accepted", "computed", "blocks"),
    [(0, 6, 2), (1, 7, 2), (3, 9, 3)],
    ids=["none-accepted", "1-of-3", "all-accepted"],
)
def test_rejected_drafts_are_rolled_back(num_accepted: int, computed: int, blocks: int) -> None:
    # 6 tokens (5 computed) in blocks of 4; 3 drafts make a chunk of positions 5..8, which
    # reaches a third block. Accepting a of them leaves computed = min(9 - (3 - a), 6 + a + 1)
    # and only the blocks that 6 + a + 1 tokens need.
    s = _scheduler(block_size=4)
    a = _request("a", 5, max_tokens=10)
    _decoding(s, a)
    drafts = (11, 12, 13)
    out = s.schedule({"a": drafts})
    assert (out.chunks[0].start, out.chunks[0].end) == (5, 9)
    assert s.kv.num_blocks_held(a) == 3
    tokens = [*drafts[:num_accepted], 9]  # the accepted drafts, then the target's own token
    (update,) = s.update(out, {"a": tokens})
    assert (update.num_draft_tokens, update.num_accepted_drafts) == (3, num_accepted)
    assert update.new_token_ids == tokens and a.num_tokens == 6 + num_accepted + 1
    assert a.num_computed_tokens == computed
    assert s.kv.num_blocks_held(a) == blocks
    assert s.kv.pool.num_free_blocks == 64 - blocks
    nxt = s.schedule().chunks[0]
    assert (nxt.start, nxt.num_tokens) == (computed, 1)  # decodes the target's token next


def test_a_stop_inside_the_accepted_run_ends_the_request_there() -> None:
    s = _scheduler(block_size=4)
    a = _request("a", 5, max_tokens=3)  # one output so far: two more end it
    _decoding(s, a)
    out = s.schedule({"a": (11, 12, 13)})
    (update,) = s.update(out, {"a": [11, 12, 13, 9]})
    assert update.new_token_ids == [11, 12] and update.finish_reason is FinishReason.LENGTH
    assert a.num_computed_tokens == a.num_tokens == 8  # min(9 - 0, 8)
    assert s.kv.pool.num_free_blocks == 64
