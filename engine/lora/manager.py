"""The adapters one model runner knows, holds in memory, and has in its slots.

Three tiers, as vLLM has them:

- **registered**: every adapter a request may name (``add``), checked when added;
- **resident**: read and sharded for this rank, in CPU memory: an LRU of
  ``max_cpu_loras`` (an adapter evicted from it is read again from disk when next used:
  a cold load);
- **active**: in one of ``max_loras`` slots of every wrapped layer's stacked weights,
  which is what a forward runs. ``activate`` fills slots for a batch's adapters,
  replacing the least recently used ones the batch does not need (the scheduler never
  puts more than ``max_loras`` distinct adapters in one batch).

Swapping an adapter in or out is a copy into the slot's rows between two forwards; the
engine keeps running, and no request of another adapter notices.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tandem.common.lora import LoRARequest
from tandem.engine.lora.adapter import LoadedAdapter, load_adapter
from tandem.engine.lora.kernels import lora_kernels_for
from tandem.engine.lora.layers import LoRABatch, LoRALinear
from tandem.engine.lora.targets import Target
from tandem.engine.parallel.group import TensorParallelGroup

log = logging.getLogger(__name__)

OnFill = Callable[[int, LoadedAdapter], None]

LORA_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1
    """Adapters one batch may mix (slots in every wrapped layer)."""
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    """Adapters kept read in CPU memory; ``None``: ``max_loras``."""
    dtype: str = "auto"
    """What adapter weights are held in: ``auto`` (the model's dtype), ``float32``,
    ``bfloat16`` or ``float16`` (vLLM's ``--lora-dtype``)."""

    def __post_init__(self) -> None:
        if self.dtype not in LORA_DTYPES:
            raise ValueError(
                f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.dtype!r}"
            )
        if not 1 <= self.max_loras <= 62:
            raise ValueError(f"max_loras must be in 1..62, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def weight_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.dtype == "auto" else LORA_DTYPES[self.dtype]


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        targets: dict[str, Target],
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
        group: TensorParallelGroup | None,
    ) -> None:
        """Wraps every layer of ``targets`` in ``model`` (loaded and packed) in a
        ``LoRALinear``; nothing else of the model changes."""
        self.model, self.targets, self.config = model, targets, config
        self.dtype = config.weight_dtype(dtype)
        """What the adapters' weights are held in."""
        self.batch = LoRABatch()
        kernels = lora_kernels_for(device, dtype, self.dtype)
        self.layers: dict[str, LoRALinear] = {}
        modules = dict(model.named_modules())
        for path, target in targets.items():
            parent_path, _, leaf = path.rpartition(".")
            parent = modules[parent_path]
            layer = LoRALinear(
                getattr(parent, leaf),
                target,
                config.max_loras,
                config.max_lora_rank,
                self.dtype,
                self.batch,
                kernels,
                group,
                device,
            )
            setattr(parent, leaf, layer)
            self.layers[path] = layer
        self._registered: dict[str, LoRARequest] = {}
        self._namespaces: dict[str, str] = {}
        """Of each registered adapter: the KV namespace of the files read at ``add``."""
        self._resident: OrderedDict[str, LoadedAdapter] = OrderedDict()
        self._slots: list[LoadedAdapter | None] = [None] * config.max_loras
        self._slot_used: list[int] = [0] * config.max_loras
        self._uses = 0
        self._lock = threading.Lock()  # add/remove come from server threads
        self.num_cold_loads = 0
        self.last_load_seconds = 0.0
        self.on_fill: OnFill | None = None
        """Called after each slot fill (rank 0 of a tensor-parallel replica tells the
        other ranks to fill theirs)."""

    # --- registry (any thread) ---------------------------------------------------------

    def add(self, request: LoRARequest) -> bool:
        """Register and read ``request`` (checked: ``ValueError`` by name, nothing
        changed). Returns whether the name is new here. Adding a name again with the same
        path reads it again (files changed on disk replace the old weights at the next
        step); with another path it is refused (remove it first)."""
        self._check_path(request)
        adapter = self._read(request)
        with self._lock:
            self._check_path(request, locked=True)  # a concurrent add of the name
            new = request.lora_name not in self._registered
            self._registered[request.lora_name] = request
            self._namespaces[request.lora_name] = adapter.kv_namespace
            self._keep_resident(adapter)
        return new

    def _check_path(self, request: LoRARequest, locked: bool = False) -> None:
        if locked:
            known = self._registered.get(request.lora_name)
        else:
            with self._lock:
                known = self._registered.get(request.lora_name)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} is already loaded from {known.lora_path}"
            )

    def remove(self, name: str) -> bool:
        """Forget adapter ``name``: unregistered, out of memory, its slot cleared at the
        next ``activate`` (requests still running under it finish first: the engine
        refuses removal while any does)."""
        with self._lock:
            if self._registered.pop(name, None) is None:
                return False
            self._namespaces.pop(name, None)
            self._resident.pop(name, None)
            return True

    def registered(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._registered.values())

    def get(self, name: str) -> LoRARequest | None:
        with self._lock:
            return self._registered.get(name)

    def namespace(self, name: str) -> str:
        """The KV namespace of registered adapter ``name`` (``KeyError`` if it is not)."""
        with self._lock:
            if name not in self._namespaces:
                raise KeyError(f"LoRA adapter {name!r} is not loaded")
            return self._namespaces[name]

    def namespaces(self) -> dict[str, str]:
        """Every registered adapter's KV namespace, by name (a copy; any thread)."""
        with self._lock:
            return dict(self._namespaces)

    # --- slots (the engine thread) -----------------------------------------------------

    def unreadable(self, names: Collection[str]) -> dict[str, str]:
        """Of ``names`` (registered adapters a batch may need), those neither in a slot
        nor in memory that cannot be read again (their files changed or went away), with
        why; reading the others brings them into memory."""
        failed = {}
        for name in names:
            if self._slot_of(name) is not None:
                continue
            try:
                self._resident_adapter(name)
            except (ValueError, KeyError, OSError) as err:
                failed[name] = str(err)
        return failed

    def activate(self, names: Collection[str]) -> dict[str, int]:
        """Slots for a batch's adapters (at most ``max_loras``), filling the missing ones;
        returns ``name -> slot``. Calls ``on_fill(slot, adapter)`` per slot filled."""
        if len(names) > self.config.max_loras:
            raise RuntimeError(
                f"{len(names)} adapters in one batch; max_loras is {self.config.max_loras}"
            )
        self._drop_removed()
        self._uses += 1
        where: dict[str, int] = {}
        for name in names:
            slot = self._slot_of(name)
            if slot is not None:
                self._slot_used[slot] = self._uses
                where[name] = slot
        for name in names:
            if name not in where:
                slot = self._free_slot(set(where.values()))
                adapter = self._resident_adapter(name)
                self.fill(slot, adapter)
                if self.on_fill is not None:
                    self.on_fill(slot, adapter)
                where[name] = slot
        return where

    def _slot_of(self, name: str) -> int | None:
        """The slot holding the registered version of ``name`` (an older version of the
        name, re-added since from changed files, does not count)."""
        with self._lock:
            namespace = self._namespaces.get(name)
        for slot, adapter in enumerate(self._slots):
            if adapter is not None and adapter.name == name:
                return slot if adapter.kv_namespace == namespace else None
        return None

    def fill(self, slot: int, adapter: LoadedAdapter) -> None:
        """Put ``adapter`` in ``slot`` of every wrapped layer (clearing what was there)."""
        for path, layer in self.layers.items():
            layer.set_slot(slot, adapter.weights.get(path, []))
        self._slots[slot] = adapter
        self._slot_used[slot] = self._uses

    def fill_from(self, slot: int, request: LoRARequest) -> None:
        """Ranks 1..N-1 of a tensor-parallel replica: put ``request``'s adapter (this
        rank's slice, read unless resident) in ``slot``, as rank 0 did."""
        with self._lock:
            adapter = self._resident.get(request.lora_name)
        if adapter is None or adapter.request != request:
            adapter = self._read(request)
            with self._lock:
                self._keep_resident(adapter)
        self.fill(slot, adapter)

    def set_batch(self, slots: np.ndarray | None, device: torch.device) -> None:
        """The current forward's row slots (``-1``: base; ``None``: all base), for every
        wrapped layer."""
        if slots is None:
            self.batch.mask, self.batch.runs = 0, ()
            return
        batch = LoRABatch.of(torch.from_numpy(slots))
        self.batch.slots, self.batch.runs, self.batch.mask = (
            batch.slots.to(device),
            batch.runs,
            batch.mask,
        )

    def resident(self) -> list[str]:
        """Adapters a batch can use without reading them from disk: in a slot or in
        memory (any thread)."""
        with self._lock:
            in_memory = set(self._resident)
        return sorted(in_memory | {a.name for a in self._slots if a is not None})

    # --- helpers -----------------------------------------------------------------------

    def _free_slot(self, taken: set[int]) -> int:
        free = [s for s in range(len(self._slots)) if s not in taken]
        empty = [s for s in free if self._slots[s] is None]
        if empty:
            return empty[0]
        return min(free, key=lambda s: self._slot_used[s])

    def _drop_removed(self) -> None:
        with self._lock:
            registered = set(self._registered)
        for slot, adapter in enumerate(self._slots):
            if adapter is not None and adapter.name not in registered:
                for layer in self.layers.values():
                    layer.clear_slot(slot)
                self._slots[slot] = None

    def _resident_adapter(self, name: str) -> LoadedAdapter:
        with self._lock:
            adapter = self._resident.get(name)
            if adapter is not None:
                self._resident.move_to_end(name)
                return adapter
            request = self._registered.get(name)
            namespace = self._namespaces.get(name)
        if request is None:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        adapter = self._read(request)  # evicted from memory: read again (a cold load)
        if adapter.kv_namespace != namespace:  # its KV would be hashed as the old files'
            raise ValueError(
                f"LoRA adapter {name!r}: the files in {request.lora_path} changed since it "
                "was loaded; load it again"
            )
        with self._lock:
            self._keep_resident(adapter)
        return adapter

    def _read(self, request: LoRARequest) -> LoadedAdapter:
        start = time.perf_counter()
        adapter = load_adapter(
            request, self.model, self.targets, self.config.max_lora_rank, self.dtype
        )
        self.last_load_seconds = time.perf_counter() - start
        self.num_cold_loads += 1
        log.info(
            "LoRA adapter %r read from %s: rank %d, %d layers, %.1f MB in %.1f ms",
            request.lora_name,
            request.lora_path,
            adapter.rank,
            len(adapter.weights),
            adapter.nbytes / 1e6,
            self.last_load_seconds * 1e3,
        )
        return adapter

    def _keep_resident(self, adapter: LoadedAdapter) -> None:
        self._resident[adapter.name] = adapter
        self._resident.move_to_end(adapter.name)
        while len(self._resident) > self.config.cpu_capacity:
            self._resident.popitem(last=False)
