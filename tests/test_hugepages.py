"""The CPU KV cache is zero-filled memory that Linux was asked to back with huge pages."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tandem.engine import hugepages
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_available = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages unavailable",
)


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            if inside:
                break
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def test_zeros_are_zeros_of_the_shape_and_dtype() -> None:
    t = hugepages.zeros((3, 2**20), torch.uint8, torch.device("cpu"))
    assert t.shape == (3, 2**20) and t.dtype == torch.uint8
    assert not t.any()


def test_memory_without_a_whole_huge_page_is_not_advised() -> None:
    assert not hugepages.advise_huge_pages(torch.empty(2**20, dtype=torch.uint8))


@thp_available
def test_a_pool_is_advised_before_it_is_written() -> None:
    t = hugepages.zeros((16, 2**20), torch.float32, torch.device("cpu"))  # 64 MiB
    inside = -(-t.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE
    mapping = _mapping_of(inside)
    assert mapping["THPeligible"] == "1"
    # The zero fill faulted the pages in after the advice: most are huge ones (the kernel
    # may refuse a few when memory is fragmented).
    huge_kib = int(mapping["AnonHugePages"].split()[0])
    assert huge_kib >= 32 * 1024


@thp_available
def test_the_engine_kv_cache_is_on_advised_memory(make_checkpoint) -> None:
    engine = LLMEngine(
        EngineConfig(str(make_checkpoint("llama")), dtype="float32", kv_cache_memory_gb=0.05),
        detokenize=False,
    )
    cache = engine.runner.kv_caches[0]
    assert cache.numel() * cache.element_size() >= 2 * hugepages.HUGE_PAGE
    inside = -(-cache.data_ptr() // hugepages.HUGE_PAGE) * hugepages.HUGE_PAGE
    assert _mapping_of(inside)["THPeligible"] == "1"
    assert not cache.any()


@thp_available
def test_a_pool_gets_huge_pages_after_large_tensors_came_and_went() -> None:
    """A long-lived process frees large tensors; the allocator would then serve a pool
    from memory already faulted in on 4 KiB pages (0 kB huge, seen). The pool is a fresh
    mapping of its own, starting on a huge page."""
    for _ in range(4):
        scratch = torch.empty(30 * 2**20, dtype=torch.uint8)
        scratch.fill_(1)
        del scratch
    t = hugepages.zeros((3 * 2**20,), torch.float32, torch.device("cpu"))  # 12 MiB
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    mapping = _mapping_of(t.data_ptr())
    assert mapping["THPeligible"] == "1"
    assert int(mapping["AnonHugePages"].split()[0]) >= 6 * 1024  # a few may be refused
    assert not t.any()
