"""A mixture-of-experts MLP: a router picks ``top_k`` of ``num_experts`` gated MLPs per
token, and their outputs are summed with the router's weights.

Execution is grouped, not a loop of small products per expert: the step's (token,
expert) pairs are sorted by expert, each token's row is gathered once per pair, and the
experts run as two grouped products (``torch._grouped_mm`` over the stacked expert
weights: every expert's rows in one native call) with the activation between them; the
weighted rows are added back into their tokens. Where the grouped product is not
available (a torch without it, or shapes it refuses) the same sorted layout runs one
product per expert that has rows.

The expert weights are stacked: ``gate_up_proj [E, 2 I, H]`` and ``down_proj [E, H, I]``
(the layout transformers 5 keeps in memory); checkpoints may hold them per expert (the
HF hub's ``experts.{e}.gate_proj`` / ``w1`` ...) or stacked, and each is read straight
into its slot.

Parallelism (``shard``): with tensor parallelism every expert's intermediate dims are
split across the ranks (``ExpertSplit.TENSOR``), or, with expert parallelism, each rank
holds whole experts, ``E / tp`` of them (``ExpertSplit.EXPERT``). Either way every rank
routes the full batch (the router is replicated), computes the pairs it holds and the
ranks' partial sums are added by one all-reduce: with replicated activations that is
the dispatch and combine of an all-to-all, without its two exchanges.
"""

from __future__ import annotations

import enum
import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tandem.common.model_config import Activation, MoEConfig
from tandem.engine.layers.mlp import GatedMLP, activate

if TYPE_CHECKING:
    from tandem.engine.parallel.group import TensorParallelGroup
    from tandem.engine.parallel.layers import CheckpointSlice


class ExpertSplit(enum.Enum):
    TENSOR = "tensor"
    """Every rank holds every expert's slice of the intermediate dims."""
    EXPERT = "expert"
    """Every rank holds ``num_experts / tp`` whole experts."""


GATE, UP = 0, 1
"""The two halves of ``gate_up_proj`` (the shard index of a per-expert gate / up)."""


@functools.cache
def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs (and is right) for ``dtype`` on ``device``:
    torch releases differ, and CUDA's wants bfloat16 on recent GPUs."""
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is None:
        return False
    try:
        a = torch.ones(2, 8, dtype=dtype, device=device)
        b = torch.ones(2, 8, 8, dtype=dtype, device=device)
        out = grouped(a, b, offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((out == 8).all())


class FusedExperts(nn.Module):
    """The experts' stacked weights (this rank's share) and their grouped forward."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, activation: Activation
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        """All experts of the model (routing ids run over these)."""
        self.first_expert, self.num_local = 0, num_experts
        self.intermediate_start, self.intermediate_size = 0, intermediate_size
        self.full_intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self._loaded: set[tuple[str, int, int]] = set()
        self._grouped: bool | None = None
        """Whether the grouped product runs here; found at the first forward."""

    def shard(self, split: ExpertSplit, rank: int, size: int) -> None:
        """Keep this rank's share (on the meta device, before loading)."""
        hidden = self.gate_up_proj.shape[-1]
        if split is ExpertSplit.EXPERT:
            self.num_local = self.num_experts // size
            self.first_expert = rank * self.num_local
        else:
            self.intermediate_size = self.full_intermediate_size // size
            self.intermediate_start = rank * self.intermediate_size
        inner = self.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden, inner))

    # -- loading ---------------------------------------------------------------------

    def load_slice(self, leaf: str, tensor: CheckpointSlice, shard: tuple[int, int] | None) -> None:
        """``shard``: ``(expert, GATE | UP)`` of a per-expert gate / up tensor, ``(expert,
        0)`` of a per-expert down tensor; ``None``: the stacked tensor of every expert."""
        start, size = self.intermediate_start, self.intermediate_size
        if shard is None:
            for local in range(self.num_local):
                expert = self.first_expert + local
                stacked = tensor.rows(expert, 1)[0]
                if leaf == "gate_up_proj":
                    full = self.full_intermediate_size
                    self._store(leaf, expert, GATE, stacked[start : start + size])
                    self._store(leaf, expert, UP, stacked[full + start : full + start + size])
                else:
                    self._store(leaf, expert, 0, stacked[:, start : start + size])
            return
        expert, part = shard
        if not self.first_expert <= expert < self.first_expert + self.num_local:
            return  # another rank's expert
        if leaf == "gate_up_proj":
            self._store(leaf, expert, part, tensor.rows(start, size))
        else:
            self._store(leaf, expert, part, tensor.cols(start, size))

    def _store(self, leaf: str, expert: int, part: int, source: torch.Tensor) -> None:
        local, size = expert - self.first_expert, self.intermediate_size
        if leaf == "gate_up_proj":
            dest = self.gate_up_proj.data[local].narrow(0, part * size, size)
        else:
            dest = self.down_proj.data[local]
        if dest.shape != source.shape:
            raise ValueError(
                f"expert {expert}'s {leaf} has shape {tuple(source.shape)} in the checkpoint, "
                f"expected {tuple(dest.shape)} (config.json's expert sizes?)"
            )
        dest.copy_(source)
        self._loaded.add((leaf, expert, part))

    def is_filled(self, leaf: str) -> bool:
        parts = (GATE, UP) if leaf == "gate_up_proj" else (0,)
        experts = range(self.first_expert, self.first_expert + self.num_local)
        return all((leaf, e, p) in self._loaded for e in experts for p in parts)

    # -- forward ---------------------------------------------------------------------

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, ``ids [T, k]`` (global expert ids), ``weights [T, k]`` → this
        rank's share of ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``."""
        if self._grouped is None:
            self._grouped = grouped_mm_works(x.device, x.dtype)
        return run_experts(self, x, ids, weights)

    def products(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert's MLP over its rows (``rows`` sorted by expert, ``counts`` each)."""
        gate_up = self._products(rows, self.gate_up_proj, counts)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self._products(activate(gate, self.activation) * up, self.down_proj, counts)

    def _products(
        self, rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """``rows`` sorted by expert (``counts`` of each) times each expert's ``weight``
        (``[E, out, in]``, applied as a linear layer)."""
        if self._grouped and rows.shape[0] and _grouped_shapes_ok(rows, weight):
            offsets = counts.cumsum(0).to(torch.int32)
            return torch._grouped_mm(rows, weight.transpose(1, 2), offs=offsets)
        out = rows.new_empty(rows.shape[0], weight.shape[1])
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                out[start : start + count] = rows[start : start + count] @ weight[expert].t()
                start += count
        return out


class PackedExperts(nn.Module):
    """``FusedExperts`` (SwiGLU, float32, CPU) on the native GEMM's packed panels: each
    expert's gate and up packed together, the SiLU product in the kernel's epilogue, and
    all experts of a step in one call per projection (``tandem_gemm_grouped_*``). Made by
    ``layers.linear.pack_linear_layers``; inference only."""

    def __init__(self, experts: FusedExperts) -> None:
        from tandem.engine.layers.native_gemm import native_gemm

        super().__init__()
        self.num_experts, self.first_expert = experts.num_experts, experts.first_expert
        self.num_local = experts.num_local
        self.gemm = native_gemm()
        inner = experts.intermediate_size
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        self.gate_up = self.gemm.stack(
            [self.gemm.pack_gated(w[:inner], w[inner:]) for w in gate_up]
        )
        self.down = self.gemm.stack([self.gemm.pack(w) for w in down])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return run_experts(self, x, ids, weights)

    def products(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.zeros(counts.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        hidden = self.gemm.grouped(rows, offsets, self.gate_up)
        return self.gemm.grouped(hidden, offsets, self.down)


class OneDnnExperts(nn.Module):
    """``FusedExperts`` (SwiGLU, float32, CPU) on oneDNN's packed weights, for CPUs where
    oneDNN packs the dense layers (AVX-512): each expert's gate (SiLU fused) and up (the
    product fused) and down, once per expert that has rows in the step. One fused,
    batched product per expert and projection; the experts follow each other from
    Python because oneDNN has no grouped call, and with AVX-512 its products run
    1.4-2.5x faster than the AVX2 grouped kernel of ``PackedExperts`` from 64 rows up
    (medium model's expert shapes, 2 threads). Made by ``layers.linear.pack_linear_layers``."""

    def __init__(self, experts: FusedExperts) -> None:
        super().__init__()
        self.num_experts, self.first_expert = experts.num_experts, experts.first_expert
        self.num_local = experts.num_local
        inner = experts.intermediate_size
        reorder = torch.ops.mkldnn._reorder_linear_weight
        self.packed = [
            (reorder(w[:inner].contiguous()), reorder(w[inner:].contiguous()), reorder(d))
            for w, d in zip(
                experts.gate_up_proj.detach(), experts.down_proj.detach().contiguous(), strict=True
            )
        ]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return run_experts(self, x, ids, weights)

    def products(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        linear = torch.ops.mkldnn._linear_pointwise
        out = torch.empty_like(rows)
        start = 0
        for (gate, up, down), count in zip(self.packed, counts.tolist(), strict=True):
            if count:
                part = rows[start : start + count]
                hidden = linear(part, gate, None, "swish", [], "")
                hidden = linear.binary(part, hidden, up, None, "mul")
                out[start : start + count] = linear(hidden, down, None, "none", [], "")
                start += count
        return out


def run_experts(
    experts: FusedExperts | PackedExperts | OneDnnExperts,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The pairs (token, expert) this rank holds, sorted by expert; each token's row
    gathered once per pair, the experts' ``products`` over them, and the rows scaled by
    their routing weights and added back into their tokens."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    pairs = None
    if experts.num_local != experts.num_experts:
        first = experts.first_expert
        held = (flat >= first) & (flat < first + experts.num_local)
        pairs = held.nonzero().squeeze(1)
        flat = flat[pairs] - first
    order = torch.argsort(flat, stable=True)
    pair_ids = order if pairs is None else pairs[order]
    tokens = pair_ids // top_k
    counts = torch.bincount(flat[order], minlength=experts.num_local)
    out_rows = experts.products(x.index_select(0, tokens), counts)
    scaled = out_rows * weights.reshape(-1).index_select(0, pair_ids).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, tokens, scaled.to(x.dtype))


def _grouped_shapes_ok(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """``_grouped_mm`` wants 16-byte-aligned rows of both operands."""
    align = 16 // rows.element_size()
    return rows.shape[1] % align == 0 and weight.shape[1] % align == 0


class Router(nn.Module):
    """The router's product ``x @ weight.T``: a linear layer of ``num_experts`` outputs,
    kept apart from ``nn.Linear`` so packing (``pack_linear_layers``) and quantization
    leave it alone: a 4-16-column product is faster unpacked (a packed oneDNN call
    measured 32 us against a few for ``F.linear`` at 32 rows), and routing decisions
    stay in float. With ``correction_bias`` it also holds DeepSeek-V3's per-expert
    ``e_score_correction_bias`` (added to the scores for the choice only)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        correction_bias: bool = False,
        float32: bool = False,
    ) -> None:
        """``float32``: the weights stay float32 in a bfloat16 / float16 model and the
        scores are computed in float32 (DeepSeek, as its checkpoints were trained; the
        loader honours ``float32_params``)."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts)) if correction_bias else None
        )
        self.float32_params = ("weight", "e_score_correction_bias") if float32 else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:  # a float32 router in a lower-precision model
            x = x.to(self.weight.dtype)
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    """Router + experts (+ DeepSeek's shared experts); ``forward(x [T, H]) -> [T, H]``."""

    def __init__(self, hidden_size: int, moe: MoEConfig, activation: Activation) -> None:
        super().__init__()
        self.moe = moe
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.weights_in_model_dtype = moe.weights_in_model_dtype
        self.gate = Router(
            hidden_size, moe.num_experts, moe.correction_bias, float32=moe.scoring_in_float32
        )
        self.experts = FusedExperts(moe.num_experts, hidden_size, moe.intermediate_size, activation)
        self.shared_experts = (
            GatedMLP(hidden_size, moe.shared_intermediate_size, activation)
            if moe.shared_intermediate_size
            else None
        )
        self.group: TensorParallelGroup | None = None
        """Set by ``shard``: the ranks whose partial sums are added."""
        self._plain = moe.scoring == "softmax" and moe.group_choice is None

    def shard(self, split: ExpertSplit, group: TensorParallelGroup) -> None:
        self.experts.shard(split, group.rank, group.size)
        self.group = group

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` expert ids and their weights (float32 unless the
        family rounds them to the model dtype)."""
        logits = self.gate(x)
        moe = self.moe
        if self._plain:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
        else:
            logits = logits.float()
            scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
            choice = scores
            if self.gate.e_score_correction_bias is not None:
                choice = scores + self.gate.e_score_correction_bias.float()
            if moe.group_choice is not None:
                choice = _best_groups_only(choice, moe)
            ids = torch.topk(choice, self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, ids, weights)
        if self.group is not None:
            out = self.group.all_reduce(out)
        if self.shared_experts is not None:  # sharded on its own (row-parallel down)
            out = out + self.shared_experts(x)
        return out


def _best_groups_only(choice: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """``choice [T, E]`` with every expert outside each token's ``topk_group`` best
    groups at -inf; a group scores its best expert (``max``) or its two best (``top2``)."""
    grouped = choice.view(choice.shape[0], moe.num_groups, -1)
    if moe.group_choice == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = torch.topk(group_scores, moe.topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
