"""Executes a scheduled step: builds the flattened batch, runs the model, samples.

Owns everything that is a tensor — the weights, the paged KV cache, the attention
backend, per-request random generators — and makes no policy decisions. One call of
``execute`` is one forward pass over all scheduled tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from tandem.common.lora import LoRARequest
from tandem.common.model_config import ModelConfig
from tandem.engine import hugepages
from tandem.engine.attention.base import AttentionBackendKind, make_backend
from tandem.engine.attention.kv_quant import KVCacheDtype, cache_row
from tandem.engine.layers.linear import LinearBackend, pack_linear_layers
from tandem.engine.layers.moe import ExpertSplit
from tandem.engine.layers.native_ops import native_ops_for, use_native_ops
from tandem.engine.loader import load_model
from tandem.engine.lora.adapter import LoadedAdapter
from tandem.engine.lora.manager import LoRAConfig, LoRAManager
from tandem.engine.lora.targets import scan_targets
from tandem.engine.parallel.group import TensorParallelGroup
from tandem.engine.parallel.plan import (
    ForwardPlan,
    PlanChannel,
    PlanKind,
    decode_text,
    encode_text,
)
from tandem.engine.quantization.scheme import QuantizationConfig
from tandem.engine.sampler import RowGroup, Sampler, SamplingRow, TokenLogprobs
from tandem.engine.scheduler import ScheduledChunk, SchedulerOutput
from tandem.engine.stopping import banned_tokens
from tandem.engine.structured import MaskRow, StructuredOutputs, apply_bitmask

NO_DRAFT_PROBS: Mapping[str, torch.Tensor] = MappingProxyType({})
"""No drafted chunk of the step was sampled (the default of ``ModelRunner.execute``)."""


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]]


@dataclass(frozen=True)
class KVCacheLayout:
    """Per-layer cache tensor: ``[planes, num_blocks, block_size, num_kv_heads,
    row_width]`` of ``storage_dtype``: ``head_dim`` values of ``dtype``, or, quantized,
    ``head_dim`` one-byte codes + a float32 scale as uint8 (``kv_quant``). ``planes``
    is 2 (K, V), or 1 for a latent cache (multi-head latent attention: one row per
    token, ``attention.latent``)."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    """The model's compute dtype (what attention reads)."""
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    planes: int = 2

    @property
    def row_width(self) -> int:
        return cache_row(self.kv_cache_dtype, self.head_dim, self.dtype)[0]

    @property
    def storage_dtype(self) -> torch.dtype:
        return cache_row(self.kv_cache_dtype, self.head_dim, self.dtype)[1]

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.storage_dtype).element_size()
        return self.planes * self.num_layers * self.num_kv_heads * self.row_width * itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        model_config: ModelConfig,
        layout: KVCacheLayout,
        backend: AttentionBackendKind,
        linear_backend: LinearBackend,
        device: torch.device,
        eos_token_ids: Collection[int],
        seed: int,
        tp: TensorParallelGroup | None = None,
        quantization: QuantizationConfig | None = None,
        expert_split: ExpertSplit = ExpertSplit.TENSOR,
        batch_invariant: bool = False,
        lora: LoRAConfig | None = None,
    ) -> None:
        """``tp``: this rank's group when the model is split over ranks; ``layout``
        then describes this rank's heads. Rank 0 runs ``execute`` / ``last_logits`` and
        sends each forward's plan to the other ranks, which run ``run_plan``.
        ``quantization``: quantize the linear layers at load (a quantized checkpoint
        loads quantized regardless). ``expert_split``: how a mixture of experts splits
        over the ranks. ``batch_invariant``: every query row through the attention
        kernel (``EngineConfig.batch_invariant``). ``lora``: serve LoRA adapters
        (``engine/lora``): every adaptable layer gets slots for ``max_loras`` of them."""
        self.device = device
        self.layout = layout
        self.eos_token_ids = eos_token_ids
        self.tp = tp if tp is not None and tp.size > 1 else None
        self._plans = PlanChannel(self.tp) if self.tp is not None else None
        self.model = load_model(
            model_dir, model_config, layout.dtype, device, self.tp, quantization, expert_split
        )
        targets = None if lora is None else scan_targets(self.model, model_config)
        if linear_backend is not LinearBackend.TORCH:
            # adapters add to gate and up before the activation: no fused gated MLP then
            pack_linear_layers(self.model, linear_backend, fuse_gated_mlp=lora is None)
        native_ops = native_ops_for(device, layout.dtype)
        if native_ops is not None:
            use_native_ops(self.model, native_ops)
        self.lora: LoRAManager | None = None
        if lora is not None:
            self.lora = LoRAManager(self.model, targets, lora, layout.dtype, device, self.tp)
            if self._plans is not None:
                self.lora.on_fill = self._fill_on_ranks
        self.kv_caches: list[torch.Tensor] = []
        self.backend = make_backend(
            backend,
            model_config.attention_scale,
            layout.block_size,
            layout.kv_cache_dtype,
            model_config.attn_logit_softcap,
            None if model_config.mla is None else model_config.mla.kv_lora_rank,
            batch_invariant,
        )
        self.sampler = Sampler(device, seed)
        self._generators: dict[str, torch.Generator] = {}
        self.structured: StructuredOutputs | None = None
        """Set by the engine once a request is constrained (see ``engine.structured``)."""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Zero-filled, so padding slots never hold NaNs that a masked read could pick up;
        on the CPU, on transparent huge pages where Linux gives them (``hugepages``). On
        rank 0 of a replica, the other ranks allocate theirs too."""
        if self._plans is not None and self.tp.is_first:
            self._plans.send(PlanKind.ALLOCATE_KV, num_blocks)
        lay = self.layout
        shape = (lay.planes, num_blocks, lay.block_size, lay.num_kv_heads, lay.row_width)
        self.kv_caches = [
            hugepages.zeros(shape, lay.storage_dtype, self.device) for _ in range(lay.num_layers)
        ]

    def unpack_on_ranks(self, pull_id: int, block_ids: Sequence[int]) -> None:
        """Rank 0, engine thread: the other ranks write the KV they staged for pull
        ``pull_id`` into ``block_ids`` (their own heads), in step order."""
        if self._plans is not None:
            self._plans.send(PlanKind.UNPACK_KV, pull_id, np.asarray(block_ids))

    def _fill_on_ranks(self, slot: int, adapter: LoadedAdapter) -> None:
        """Rank 0: the other ranks put their slice of ``adapter`` in ``slot`` too."""
        text = json.dumps(dataclasses.asdict(adapter.request))
        self._plans.send(PlanKind.FILL_LORA, slot, encode_text(text))

    def fill_lora_slot(self, slot: int, payload: np.ndarray) -> None:
        """Ranks 1..N-1: what ``_fill_on_ranks`` sent."""
        request = LoRARequest(**json.loads(decode_text(payload)))
        self.lora.fill_from(slot, request)

    def stop_ranks(self) -> None:
        """Rank 0: tells the other ranks to leave their loop."""
        if self._plans is not None:
            self._plans.send(PlanKind.STOP)

    @torch.inference_mode()
    def execute(
        self, step: SchedulerOutput, draft_probs: Mapping[str, torch.Tensor] = NO_DRAFT_PROBS
    ) -> RunnerOutput:
        """Run the step. ``draft_probs``: this step's draft distributions by request id
        (``Drafts.probs`` of the proposal whose token ids ``step`` was scheduled with),
        ``[k, V]`` for a chunk with k drafts; a drafted chunk without one is verified as a
        deterministic proposal, an entry for a chunk without drafts is ignored."""
        for request_id in step.finished_request_ids:
            self._generators.pop(request_id, None)
        chunks, lora_slots = self._order(step.chunks)
        sampling = [(i, c) for i, c in enumerate(chunks) if c.samples]
        masks = self._start_masks([c for _, c in sampling])  # filled during the forward
        ends = np.cumsum([c.num_tokens for c in chunks])
        rows, groups, positions = [], [], []
        for i, chunk in sampling:
            drafts = chunk.draft_token_ids
            probs = draft_probs.get(chunk.request.request_id) if drafts else None
            groups.append(RowGroup(len(rows), drafts, probs))
            rows.extend(self._sampling_rows(chunk))
            positions.extend(range(ends[i] - len(drafts) - 1, ends[i]))
        logits = self._forward(chunks, positions, lora_slots)
        if logits is None:
            return RunnerOutput({}, {})
        if masks is not None:
            bitmask, masked_rows = self.structured.wait(masks[0]), masks[1]
            apply_bitmask(logits, bitmask, masked_rows)
        result = self.sampler(logits, rows, groups)
        sampled, logprobs = {}, {}
        for (_, chunk), tokens, lps in zip(
            sampling, result.token_ids, result.logprobs, strict=True
        ):
            sampled[chunk.request.request_id] = tokens
            if lps:
                logprobs[chunk.request.request_id] = lps
        return RunnerOutput(sampled, logprobs)

    def _start_masks(
        self, sampling: Sequence[ScheduledChunk]
    ) -> tuple[Future[torch.Tensor], list[int]] | None:
        """Start filling the token masks of the constrained rows (the bitmask's future and
        the logits rows it covers), or ``None`` when no sampled request is constrained."""
        if self.structured is None:
            return None
        mask_rows, covered, row = [], [], 0
        for chunk in sampling:
            num_rows = len(chunk.draft_token_ids) + 1
            grammar = chunk.request.grammar
            if grammar is not None:
                mask_rows.append(MaskRow(grammar, row, chunk.draft_token_ids))
                covered.extend(range(row, row + num_rows))
            row += num_rows
        if not mask_rows:
            return None
        return self.structured.start_fill(mask_rows, row), covered

    @torch.inference_mode()
    def last_logits(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Run ``chunks`` (writing their KV) and return the logits at each chunk's last
        position, ``[len(chunks), V]`` in the given order; no sampling (draft models)."""
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].num_tokens > 1)
        ordered = [chunks[i] for i in order]
        if self.lora is not None and any(c.request.lora_name for c in chunks):
            raise RuntimeError("last_logits runs draft models, which serve no adapters")
        logits = self._forward(ordered, np.cumsum([c.num_tokens for c in ordered]) - 1)
        restore = torch.empty(len(order), dtype=torch.long)
        restore[torch.tensor(order)] = torch.arange(len(order))
        return logits[restore.to(self.device)]

    def _order(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[list[ScheduledChunk], list[int] | None]:
        """A step's chunks in forward order, decodes first (the attention metadata's
        layout), and with adapters, by slot within each part (so each adapter's rows run
        in a few contiguous runs); the slot of each chunk (-1: base), or ``None`` when no
        chunk runs an adapter. Fills the slots the step's adapters need."""
        names = set() if self.lora is None else {c.request.lora_name for c in chunks} - {None}
        if not names:
            return sorted(chunks, key=lambda c: c.num_tokens > 1), None
        where = self.lora.activate(names)
        slot = {id(c): where.get(c.request.lora_name, -1) for c in chunks}
        ordered = sorted(chunks, key=lambda c: (c.num_tokens > 1, slot[id(c)]))
        return ordered, [slot[id(c)] for c in ordered]

    def _forward(
        self,
        chunks: list[ScheduledChunk],
        logit_rows: Sequence[int],
        lora_slots: Sequence[int] | None = None,
    ) -> torch.Tensor | None:
        """Runs ``chunks`` (writing their KV) and returns the logits of hidden rows
        ``logit_rows`` (``None`` when there are none). ``lora_slots``: each chunk's
        adapter slot. The other ranks of a replica run the same forward from its plan."""
        plan = self._prepare(chunks, logit_rows, lora_slots)
        if self._plans is not None:
            self._plans.send_forward(plan)
        return self.run_plan(plan)

    def run_plan(self, plan: ForwardPlan) -> torch.Tensor | None:
        """One forward from its plan, on every rank; logits on rank 0 only."""
        to = self.device
        meta = plan.metadata(self.layout.block_size, to)
        self.backend.plan(meta)
        input_ids = torch.from_numpy(plan.input_ids).to(to)
        positions = torch.from_numpy(plan.positions).to(to)
        if self.lora is not None:
            self.lora.set_batch(None if plan.lora_slots is None else plan.lora_slots, to)
        hidden = self.model(input_ids, positions, self.kv_caches, self.backend, meta)
        if not len(plan.logit_rows):
            return None
        return self.model.compute_logits(hidden[torch.from_numpy(plan.logit_rows).to(to)])

    def _prepare(
        self,
        chunks: list[ScheduledChunk],
        logit_rows: Sequence[int],
        lora_slots: Sequence[int] | None = None,
    ) -> ForwardPlan:
        bs = self.layout.block_size
        q_lens = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=len(chunks))
        starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=len(chunks))
        query_start_loc = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        seq_of_token = np.repeat(np.arange(len(chunks)), q_lens)
        positions = np.arange(int(query_start_loc[-1])) - np.repeat(
            query_start_loc[:-1] - starts, q_lens
        )
        max_blocks = max(len(c.block_ids) for c in chunks)
        table = np.zeros((len(chunks), max_blocks), dtype=np.int64)
        for i, c in enumerate(chunks):
            table[i, : len(c.block_ids)] = c.block_ids
        slots = table[seq_of_token, positions // bs] * bs + positions % bs
        input_ids = np.fromiter(
            (t for c in chunks for t in _chunk_tokens(c)), dtype=np.int64, count=len(positions)
        )
        return ForwardPlan(
            input_ids=input_ids,
            positions=positions,
            slots=slots,
            block_table=table,
            seq_lens=starts + q_lens,
            query_start_loc=query_start_loc,
            logit_rows=np.asarray(logit_rows, dtype=np.int64),
            num_decodes=int((q_lens == 1).sum()),
            lora_slots=None
            if lora_slots is None
            else np.repeat(np.asarray(lora_slots, dtype=np.int64), q_lens),
        )

    def _seeded_generator(self, seed: int, num_drawn: int) -> torch.Generator:
        """A request's generator, advanced past the ``num_drawn`` rows of noise its earlier
        tokens consumed (made on another worker), so its random sequence continues."""
        generator = torch.Generator(self.device).manual_seed(seed)
        vocab = self.model.config.vocab_size
        for _ in range(num_drawn):
            torch.empty(vocab, device=self.device).exponential_(generator=generator)
        return generator

    def _sampling_rows(self, chunk: ScheduledChunk) -> list[SamplingRow]:
        """One row per sampled position: the last token's, then one per draft (which then
        counts as already generated, for penalties and ``min_tokens``)."""
        request = chunk.request
        params = request.sampling_params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = self._seeded_generator(params.seed, request.num_output_tokens)
                self._generators[request.request_id] = generator
        rows = []
        for j in range(len(chunk.draft_token_ids) + 1):
            outputs = request.output_token_ids
            if j:
                outputs = [*outputs, *chunk.draft_token_ids[:j]]
            rows.append(
                SamplingRow(
                    params=params,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=outputs,
                    generator=generator,
                    # Under a constraint the grammar decides where the output may end.
                    banned_token_ids=()
                    if request.grammar is not None
                    else banned_tokens(params, len(outputs), self.eos_token_ids),
                )
            )
        return rows


def _chunk_tokens(chunk: ScheduledChunk) -> list[int]:
    """The input ids a chunk feeds: its own tokens, then its drafts."""
    own = chunk.request.all_token_ids[chunk.start : chunk.end - len(chunk.draft_token_ids)]
    return [*own, *chunk.draft_token_ids] if chunk.draft_token_ids else own
