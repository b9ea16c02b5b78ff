"""Which workers hold which KV blocks: the data structure behind the router's KV index.

A chained block hash names a block *and every block before it*, so a flat map
``hash -> workers`` is enough: no tree is needed to know that two prompts share a
prefix. Each worker owns one bit; a hash maps to the bitmask (a Python int) of the
workers holding it. ``overlap`` walks a prompt's hashes in order, AND-ing the masks:
a worker drops out at the first block it lacks, which is exactly what its engine's
prefix cache would match (``KVCacheManager.find_cached_prefix`` stops there too).

The answer, a ``PrefixMatch``, keeps the workers as bitmasks grouped by how many
blocks they matched, so ``overlap`` costs O(prompt blocks) big-int ANDs (each
O(fleet / 64) machine words, tens of ns for 128 workers) whatever the number of
workers holding the prefix; naming them costs O(workers matched), and only when asked.
``add`` / ``remove`` are O(blocks given); ``clear_worker`` / ``drop_worker`` are
O(blocks the worker holds). Memory: one dict
entry per distinct hash plus one set entry per (worker, hash).

Not thread-safe; the router uses it from its event loop only. Torch-free.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence

from tandem.common.hashing import BlockHash


class PrefixIndex:
    def __init__(self) -> None:
        self._masks: dict[BlockHash, int] = {}
        self._held: dict[str, set[BlockHash]] = {}  # worker -> its hashes
        self._bit: dict[str, int] = {}  # worker -> its bit (1 << slot)
        self._slot_owner: list[str | None] = []  # slot -> worker
        self._free_slots: list[int] = []

    # --- reading -----------------------------------------------------------------------

    def overlap(self, block_hashes: Sequence[BlockHash]) -> PrefixMatch:
        """Worker id -> how many leading blocks of ``block_hashes`` it holds (only > 0).

        The answer reads this index's worker numbering: use it before the index next
        changes (the router decides right away, with no ``await`` in between)."""
        groups: list[tuple[int, int]] = []
        get = self._masks.get
        active = get(block_hashes[0], 0) if block_hashes else 0
        if active:
            depth = 1
            for h in itertools.islice(block_hashes, 1, None):
                still = active & get(h, 0)
                if still != active:
                    groups.append((depth, active & ~still))
                    active = still
                    if not active:
                        break
                depth += 1
            if active:
                groups.append((depth, active))
        return PrefixMatch(groups, self._bit, self._slot_owner)

    def workers(self) -> list[str]:
        return list(self._held)

    def blocks_of(self, worker_id: str) -> frozenset[BlockHash]:
        return frozenset(self._held.get(worker_id, ()))

    def num_blocks(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

    @property
    def num_hashes(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._masks)

    @property
    def num_entries(self) -> int:
        """(worker, block) pairs: the index's size."""
        return sum(len(held) for held in self._held.values())

    # --- changing ----------------------------------------------------------------------

    def add(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        bit = self._bit_of(worker_id)
        held = self._held[worker_id]
        masks = self._masks
        for h in block_hashes:
            if h not in held:
                held.add(h)
                masks[h] = masks.get(h, 0) | bit

    def remove(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        held = self._held.get(worker_id)
        if held is None:
            return
        bit = self._bit[worker_id]
        for h in block_hashes:
            if h in held:
                held.discard(h)
                self._unset(h, bit)

    def clear_worker(self, worker_id: str) -> None:
        """Forget every block of ``worker_id`` (its slot stays)."""
        held = self._held.get(worker_id)
        if held is None:
            return
        bit = self._bit[worker_id]
        for h in held:
            self._unset(h, bit)
        held.clear()

    def replace_worker(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """Make ``block_hashes`` the whole of what ``worker_id`` holds."""
        new = set(block_hashes)
        held = self._held.get(worker_id, set())
        self.remove(worker_id, held - new)
        self.add(worker_id, new - held)

    def drop_worker(self, worker_id: str) -> None:
        """Forget ``worker_id`` entirely and free its bit for reuse."""
        self.clear_worker(worker_id)
        bit = self._bit.pop(worker_id, None)
        if bit is None:
            return
        del self._held[worker_id]
        slot = bit.bit_length() - 1
        self._slot_owner[slot] = None
        self._free_slots.append(slot)

    # --- helpers -----------------------------------------------------------------------

    def _bit_of(self, worker_id: str) -> int:
        bit = self._bit.get(worker_id)
        if bit is not None:
            return bit
        if self._free_slots:
            slot = self._free_slots.pop()
            self._slot_owner[slot] = worker_id
        else:
            slot = len(self._slot_owner)
            self._slot_owner.append(worker_id)
        bit = self._bit[worker_id] = 1 << slot
        self._held[worker_id] = set()
        return bit

    def _unset(self, h: BlockHash, bit: int) -> None:
        mask = self._masks.get(h, 0) & ~bit
        if mask:
            self._masks[h] = mask
        else:
            self._masks.pop(h, None)


class PrefixMatch(Mapping[str, int]):
    """``overlap``'s answer: worker id -> matched leading blocks, for workers matching
    at least one. Kept as (blocks, bitmask) groups, shallowest first: ``len`` and
    ``max_blocks`` are O(groups), a lookup O(groups), iteration O(workers matched).
    ``PrefixMatch.of(mapping)`` builds one from a plain mapping (tests, simulators)."""

    def __init__(
        self, groups: list[tuple[int, int]], bit_of: Mapping[str, int], owners: Sequence[str | None]
    ) -> None:
        self._groups = groups
        self._bit_of = bit_of
        self._owners = owners

    @classmethod
    def of(cls, matched: Mapping[str, int]) -> PrefixMatch:
        ids = sorted(w for w, blocks in matched.items() if blocks > 0)
        bit_of = {w: 1 << i for i, w in enumerate(ids)}
        by_depth: dict[int, int] = {}
        for w in ids:
            by_depth[matched[w]] = by_depth.get(matched[w], 0) | bit_of[w]
        return cls(sorted(by_depth.items()), bit_of, ids)

    @property
    def max_blocks(self) -> int:
        """The most blocks any worker matched (0: none)."""
        return self._groups[-1][0] if self._groups else 0

    def sample(self, k: int, u: float) -> list[tuple[str, int]]:
        """Up to ``k`` (worker, blocks), deepest groups first; within a group, evenly
        spaced members starting at an offset set by ``u`` in [0, 1). O(workers matched)
        bit operations, O(k) names."""
        out: list[tuple[str, int]] = []
        for depth, mask in reversed(self._groups):
            if len(out) == k:
                break
            slots = _set_bits(mask)
            want = k - len(out)
            if len(slots) > want:
                step = len(slots) / want
                slots = [slots[int((i + u) * step)] for i in range(want)]
            for slot in slots:
                owner = self._owners[slot]
                if owner is not None:
                    out.append((owner, depth))
        return out

    def __getitem__(self, worker_id: str) -> int:
        bit = self._bit_of.get(worker_id, 0)
        if bit:
            for depth, mask in self._groups:
                if mask & bit:
                    return depth
        raise KeyError(worker_id)

    def __len__(self) -> int:
        return sum(mask.bit_count() for _, mask in self._groups)

    def __iter__(self) -> Iterator[str]:
        for owner, _ in self._pairs():
            yield owner

    def items(self) -> list[tuple[str, int]]:  # type: ignore[override]
        """(worker, blocks) pairs in one pass over the groups (not one lookup each)."""
        return list(self._pairs())

    def _pairs(self) -> Iterator[tuple[str, int]]:
        owners = self._owners
        for depth, mask in self._groups:
            for slot in _set_bits(mask):
                owner = owners[slot]
                if owner is not None:
                    yield owner, depth

    def __repr__(self) -> str:
        return f"PrefixMatch({dict(self.items())!r})"


EMPTY_MATCH = PrefixMatch([], {}, ())


def _set_bits(mask: int) -> list[int]:
    """Positions of the 1 bits of ``mask``, lowest first: one step per bit when they are
    few, one scan of the binary digits when they are many."""
    if mask.bit_count() <= 32:
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out
    digits = bin(mask)[:1:-1]  # least significant first, without "0b"
    return [i for i, digit in enumerate(digits) if digit == "1"]
