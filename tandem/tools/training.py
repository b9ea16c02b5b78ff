"""Train small Llama checkpoints on the stdlib corpus, on the CPU.

Data: the checkpoint maker's tokenizer and stdlib corpus (``tandem.tools.checkpoint_tokenizer``),
each file encoded as ``<|bos|> text <|eos|>``, concatenated in corpus order. By default
every corpus file (about 10 MB, 2.7M tokens on Python 3.11), not only the first 3 MB the
tokenizer learnt from: on those 0.8M tokens alone the target memorised (training loss 2.4,
validation 4.0 after 1,200 steps). The last ``val_fraction`` of the token stream is held
out; training windows of ``seq_len + 1`` tokens start at random offsets in the rest.

Model: the engine's own Llama (``tandem.engine.models.llama``), so training and serving
share one definition of the architecture. ``TrainingLlama`` runs it over ``[B, T]``
batches flattened to ``B * T`` tokens with dense causal attention and no KV cache
(``tandem.engine.attention.dense``). The engine fuses q/k/v and gate/up into single
matrices; the checkpoint stores them split, under HuggingFace's names (``hf_views``).
Initialisation: N(0, 0.02) everywhere, the output projection of each attention and MLP
block further scaled by ``1/sqrt(2 L)`` (GPT-2), norm weights at one; drawn tensor by
tensor in checkpoint order, the fused matrices shard by shard.

Optimiser: AdamW, weight decay on matrices only, linear warmup then cosine decay to
``min_lr_ratio * lr``. The schedule follows *progress*, the larger of ``step / steps`` and
``elapsed / minutes``, so a wall-clock budget also ends at the decayed rate; training
stops when progress reaches 1. With only a step budget a run is deterministic on one
machine (same seed and thread count, same bytes); a wall-clock budget makes the number of
steps depend on the machine's speed.

Matrix products run in bfloat16 autocast where the CPU has native bfloat16 (about twice
as fast on AVX512-BF16), else in float32; parameters, optimiser state and the loss stay in
float32. Before the final evaluation the weights are rounded to the storage dtype, so the
reported validation loss is the written checkpoint's.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tandem.common.model_config import ModelConfig
from tandem.engine.attention.dense import NO_KV_CACHE, DenseCausalAttention, dense_batch_metadata
from tandem.engine.layers.moe import FusedExperts
from tandem.engine.models.llama import FUSED_SHARDS, LlamaForCausalLM
from tandem.tools.checkpoint_maker import DTYPES, CheckpointSpec, hf_config, save_checkpoint
from tandem.tools.checkpoint_tokenizer import (
    corpus_files,
    corpus_texts,
    load_or_train,
    special_token_ids,
)

INIT_STD = 0.02
TRAINABLE_ARCHS = ("llama", "qwen3_moe")
"""A dense Llama, and a mixture of experts (Qwen3-MoE: per-head q/k norms, experts on
the sparse layers, trained as one product per expert)."""
REPORT_FILE = "training.json"

Log = Callable[[str], None]


def _silent(message: str) -> None:
    pass


@dataclass(frozen=True)
class TrainConfig:
    """Budget and hyperparameters of one run; validated at construction.

    ``steps`` and ``minutes`` bound the run; at least one is required, and with both the
    first reached ends it. ``log_every``: steps between logged training losses;
    ``eval_every``: steps between validation losses. ``distill_weight``: the share of the
    loss that is cross-entropy against a teacher's next-token distribution (``train(...,
    teacher=...)``), the rest being cross-entropy against the corpus' next token.
    """

    steps: int | None = None
    minutes: float | None = None
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 25
    eval_every: int = 250
    val_fraction: float = 0.02
    corpus_bytes: int | None = None  # None: every corpus file (tandem.tools.checkpoint_tokenizer)
    distill_weight: float = 0.0
    bf16_autocast: bool | None = None  # None: where the CPU supports bfloat16 natively

    def __post_init__(self) -> None:
        _require(
            self.steps is not None or self.minutes is not None,
            "a training budget is required: steps and/or minutes",
        )
        _require(self.steps is None or self.steps >= 1, f"steps must be >= 1, got {self.steps}")
        _require(
            self.minutes is None or self.minutes > 0, f"minutes must be > 0, got {self.minutes}"
        )
        for name in ("batch_size", "seq_len", "warmup_steps", "log_every", "eval_every"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        _require(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self}")
        _require(
            0 < self.val_fraction < 1, f"val_fraction must be in (0, 1), got {self.val_fraction}"
        )
        _require(
            0 <= self.distill_weight <= 1,
            f"distill_weight must be in [0, 1], got {self.distill_weight}",
        )
        _require(
            self.corpus_bytes is None or self.corpus_bytes > 0,
            f"corpus_bytes must be > 0, got {self.corpus_bytes}",
        )

    @property
    def use_bf16_autocast(self) -> bool:
        if self.bf16_autocast is not None:
            return self.bf16_autocast
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# --- data ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    """The tokenised corpus: ``train`` and ``val`` are 1-D int64 token streams."""

    train: torch.Tensor
    val: torch.Tensor


def load_corpus(vocab_size: int, val_fraction: float, max_bytes: int | None = None) -> Corpus:
    """Encode the stdlib corpus (``corpus_files(max_bytes)``) with the checkpoint
    tokenizer; hold out the last ``val_fraction`` of the tokens."""
    tokenizer = load_or_train(vocab_size)
    eos = special_token_ids(tokenizer).eos
    ids: list[int] = []
    texts = corpus_texts(corpus_files(max_bytes))
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)  # <|bos|> first: the tokenizer's post-processor adds it
        ids.append(eos)
    stream = torch.tensor(ids, dtype=torch.int64)
    split = int(len(stream) * (1 - val_fraction))
    return Corpus(train=stream[:split], val=stream[split:])


def sample_batch(
    tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)``, each ``[batch_size, seq_len]``, from random windows."""
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]


def eval_windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Consecutive windows ``[N, seq_len + 1]`` covering ``tokens`` (one token overlap)."""
    return tokens.unfold(0, seq_len + 1, seq_len)


# --- model --------------------------------------------------------------------------------


class TrainingLlama(nn.Module):
    """The engine's ``LlamaForCausalLM`` (``llama``) run over ``[B, T]`` batches: token ids
    in, ``[B, T, vocab]`` logits out, every sequence starting at position 0, attention by
    ``DenseCausalAttention`` (no KV cache). Float32 ``nn.Linear`` weights, never packed, so
    autograd trains them. Untied output projection."""

    def __init__(self, config: ModelConfig, seed: int) -> None:
        super().__init__()
        _require(not config.tie_word_embeddings, "tied embeddings are not supported")
        _require(not config.qkv_bias, "q/k/v biases are not supported")
        _require(set(config.sliding_windows) == {None}, "sliding windows are not supported")
        self.config = config
        self.llama = LlamaForCausalLM(config, torch.float32)
        self.llama.model.rotary.materialize(torch.device("cpu"))
        for module in self.llama.modules():
            if isinstance(module, FusedExperts):
                # torch._grouped_mm has no CPU backward: one product per expert trains.
                module._grouped = False
        self.attention = DenseCausalAttention(config.head_dim**-0.5)
        self._init_parameters(seed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        meta = dense_batch_metadata(b, t, input_ids.device)
        positions = torch.arange(t, device=input_ids.device).repeat(b)
        caches = [NO_KV_CACHE] * self.config.num_layers
        self.attention.plan(meta)
        hidden = self.llama(input_ids.flatten(), positions, caches, self.attention, meta)
        return self.llama.compute_logits(hidden).view(b, t, -1)

    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """Detached copies of the weights under their HuggingFace checkpoint names."""
        return {name: view.detach().clone() for name, view in hf_views(self.llama).items()}

    def _init_parameters(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        branch_std = INIT_STD / math.sqrt(2 * self.config.num_layers)
        with torch.no_grad():
            for name, weight in hf_views(self.llama).items():  # fixed order: reproducible
                if weight.dim() == 1:
                    weight.fill_(1.0)
                    continue
                is_branch_out = name.endswith(("o_proj.weight", "down_proj.weight"))
                std = branch_std if is_branch_out else INIT_STD
                weight.normal_(0.0, std, generator=generator)


def hf_views(llama: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """``llama``'s parameters under their HuggingFace checkpoint names, in parameter
    order; a fused q/k/v or gate/up matrix appears as its shards (``FUSED_SHARDS``), each
    a view into it, and a mixture's stacked experts as each expert's gate / up / down
    (Qwen3-MoE's names). The inverse of ``LlamaForCausalLM.checkpoint_targets``."""
    shard_names = _shard_names()
    views: dict[str, torch.Tensor] = {}
    for name, param in llama.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        module_path, _, fused = prefix.rpartition(".")
        if prefix.endswith(".experts"):  # stacked [E, 2I, H] / [E, H, I]
            views.update(_expert_views(prefix, leaf, param))
            continue
        if fused not in shard_names:
            views[name] = param
            continue
        shards = param.split(llama.shard_sizes(name))
        for proj, shard in zip(shard_names[fused], shards, strict=True):
            views[f"{module_path}.{proj}.{leaf}"] = shard
    return views


def _expert_views(experts: str, leaf: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """``experts`` is ``...mlp.experts``; ``leaf`` its stacked ``gate_up_proj`` or
    ``down_proj``."""
    views = {}
    for e, weight in enumerate(param):
        if leaf == "gate_up_proj":
            gate, up = weight.chunk(2, dim=0)
            views[f"{experts}.{e}.gate_proj.weight"] = gate
            views[f"{experts}.{e}.up_proj.weight"] = up
        else:
            views[f"{experts}.{e}.down_proj.weight"] = weight
    return views


def _shard_names() -> dict[str, list[str]]:
    """Fused parameter suffix -> its checkpoint tensors' suffixes, in shard order."""
    names: dict[str, list[str]] = {}
    for proj, (fused, _) in sorted(FUSED_SHARDS.items(), key=lambda item: item[1]):
        names.setdefault(fused, []).append(proj)
    return names


def model_config_for(spec: CheckpointSpec) -> ModelConfig:
    """The engine's view of the checkpoint ``spec`` describes (what ``config.json`` says)."""
    ids = special_token_ids(load_or_train(spec.vocab_size))
    return ModelConfig.from_dict(hf_config(spec, ids))


# --- training -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingReport:
    """What ``training.json`` records: the run's settings, budget spent and losses (nats
    per token). ``curve``: ``(step, mean training loss over the steps since the previous
    entry)``; ``val_curve``: ``(step, validation loss)`` during training, in float32;
    ``val_loss`` is measured on the weights as stored (``dtype``). ``tokens_per_s``: training
    tokens per second of training (evaluation excluded)."""

    preset: str
    seed: int
    dtype: str
    parameters: int
    config: dict[str, object]
    steps: int
    minutes: float
    tokens_per_s: float
    train_loss: float
    val_loss: float
    val_tokens: int
    curve: list[tuple[int, float]]
    val_curve: list[tuple[int, float]]
    torch_version: str = torch.__version__
    python_version: str = platform.python_version()
    extra: dict[str, object] = field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"{self.preset}: {self.parameters / 1e6:.2f}M parameters, {self.steps} steps in "
            f"{self.minutes:.1f} min ({self.tokens_per_s:,.0f} tok/s), "
            f"train loss {self.train_loss:.3f}, val loss {self.val_loss:.3f}"
        )


@dataclass
class Trained:
    """A trained model with the spec it is written under and its report."""

    model: TrainingLlama
    spec: CheckpointSpec
    report: TrainingReport

    def save(self, out_dir: str | Path) -> Path:
        """Write the checkpoint (weights in ``spec.dtype``) and ``training.json``."""
        path = save_checkpoint(self.spec, Path(out_dir), self.model.checkpoint_weights())
        text = json.dumps(asdict(self.report), indent=2) + "\n"
        (path / REPORT_FILE).write_text(text, encoding="utf-8")
        return path


class _Budget:
    """Progress through a run in [0, 1]: the larger of the step and the time fraction.
    Time spent in periodic evaluation counts against the budget (``eval_seconds``)."""

    def __init__(self, config: TrainConfig) -> None:
        self.steps, self.seconds = config.steps, None
        if config.minutes is not None:
            self.seconds = config.minutes * 60
        self.start = time.perf_counter()
        self.eval_seconds = 0.0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def train_seconds(self) -> float:
        return self.elapsed - self.eval_seconds

    def progress(self, step: int) -> float:
        by_steps = step / self.steps if self.steps is not None else 0.0
        by_time = self.elapsed / self.seconds if self.seconds is not None else 0.0
        return max(by_steps, by_time)


def learning_rate(config: TrainConfig, step: int, progress: float) -> float:
    warmup = min(1.0, (step + 1) / config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.lr * warmup * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def train(
    spec: CheckpointSpec,
    config: TrainConfig,
    corpus: Corpus | None = None,
    log: Log = _silent,
    teacher: TrainingLlama | None = None,
) -> Trained:
    """Train the Llama ``spec`` describes (its ``size`` preset, ``seed``, ``vocab_size``)
    on ``corpus`` (default: ``load_corpus``) within ``config``'s budget; a ``teacher``
    (same vocabulary, not modified) is required exactly when ``config.distill_weight > 0``.
    The logged training loss is always the cross-entropy against the corpus."""
    _require(
        spec.arch in TRAINABLE_ARCHS,
        f"training supports arch {' or '.join(map(repr, TRAINABLE_ARCHS))}, not {spec.arch!r}",
    )
    _require(
        (teacher is not None) == (config.distill_weight > 0),
        "a teacher is needed exactly when distill_weight > 0",
    )
    corpus = corpus or load_corpus(spec.vocab_size, config.val_fraction, config.corpus_bytes)
    model = TrainingLlama(model_config_for(spec), spec.seed)
    optimizer = _optimizer(model, config)
    generator = torch.Generator().manual_seed(spec.seed)
    val_windows = eval_windows(corpus.val, config.seq_len)
    size = f"{_count(model) / 1e6:.2f}M parameters"
    log(f"training {spec.size}: {size} on {len(corpus.train):,} tokens")
    budget, curve, step = _Budget(config), _Curve(), 0
    while (progress := budget.progress(step)) < 1.0:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step, progress)
        inputs, targets = sample_batch(corpus.train, config.batch_size, config.seq_len, generator)
        curve.pending.append(_train_step(model, optimizer, inputs, targets, config, teacher))
        step += 1
        if step % config.log_every == 0:
            log(f"  step {step:5d}  loss {curve.flush(step):.3f}  {budget.elapsed / 60:5.1f} min")
        if step % config.eval_every == 0:
            started = time.perf_counter()
            curve.val.append((step, round(evaluate(model, val_windows, config.batch_size), 4)))
            budget.eval_seconds += time.perf_counter() - started
            log(f"  step {step:5d}  val loss {curve.val[-1][1]:.3f}")
    curve.flush(step)
    _round_to_storage(model, spec.dtype)
    report = TrainingReport(
        preset=spec.size,
        seed=spec.seed,
        dtype=spec.dtype,
        parameters=_count(model),
        config={**asdict(config), "bf16_autocast": config.use_bf16_autocast},
        steps=step,
        minutes=round(budget.elapsed / 60, 3),
        tokens_per_s=round(step * config.batch_size * config.seq_len / budget.train_seconds, 1),
        train_loss=curve.train[-1][1],
        val_loss=round(evaluate(model, val_windows, config.batch_size), 4),
        val_tokens=val_windows[:, 1:].numel(),
        curve=curve.train,
        val_curve=curve.val,
    )
    log(report.summary())
    return Trained(model.eval(), spec, report)


@dataclass
class _Curve:
    """Logged losses: ``train`` holds means over the steps since the previous entry."""

    train: list[tuple[int, float]] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    pending: list[float] = field(default_factory=list)

    def flush(self, step: int) -> float:
        """Record the mean of the pending losses at ``step`` (if any); return the latest."""
        if self.pending:
            self.train.append((step, round(sum(self.pending) / len(self.pending), 4)))
            self.pending = []
        return self.train[-1][1]


def _train_step(
    model: TrainingLlama,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    config: TrainConfig,
    teacher: TrainingLlama | None,
) -> float:
    """One optimiser step; returns the cross-entropy against the corpus' next tokens."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.use_bf16_autocast):
        logits = model(inputs).flatten(0, 1).float()
        if teacher is not None:
            with torch.no_grad():
                teacher_probs = teacher(inputs).flatten(0, 1).float().softmax(-1)
    hard = F.cross_entropy(logits, targets.flatten())
    loss = hard
    if teacher is not None:
        soft = -(teacher_probs * logits.log_softmax(-1)).sum(-1).mean()
        loss = (1 - config.distill_weight) * hard + config.distill_weight * soft
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return hard.item()


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": matrices, "weight_decay": config.weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8)


def _round_to_storage(model: nn.Module, dtype: str) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(DTYPES[dtype]))


# --- evaluation ---------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model: TrainingLlama, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over ``windows [N, T + 1]``, float32."""
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        logits = model(chunk[:, :-1])
        targets = chunk[:, 1:]
        total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        count += targets.numel()
    return total / count


@torch.no_grad()
def greedy_agreement(
    target: TrainingLlama, draft: TrainingLlama, windows: torch.Tensor, batch_size: int
) -> float:
    """Fraction of positions in ``windows`` where the draft's greedy next token equals the
    target's: a proxy for the per-token acceptance rate of greedy speculative decoding."""
    agree, total = 0, 0
    for chunk in windows.split(batch_size):
        inputs = chunk[:, :-1]
        same = target(inputs).argmax(-1) == draft(inputs).argmax(-1)
        agree += int(same.sum())
        total += same.numel()
    return agree / total


# --- target + draft -----------------------------------------------------------------------


@dataclass(frozen=True)
class PairReport:
    target: TrainingReport
    draft: TrainingReport
    greedy_agreement: float


def train_pair(
    out_dir: str | Path,
    target_spec: CheckpointSpec,
    draft_spec: CheckpointSpec,
    config: TrainConfig,
    log: Log = _silent,
) -> PairReport:
    """Train a target and a draft on the same corpus and tokenizer, each within
    ``config``'s budget; write ``out_dir/target`` and ``out_dir/draft``. With
    ``config.distill_weight > 0`` the draft also learns the trained target's next-token
    distribution (distillation raises its agreement with the target, which is what
    speculative decoding pays for); the target always trains on the corpus alone. The
    draft's ``training.json`` records its greedy agreement with the target on the
    held-out split (``extra.greedy_agreement``)."""
    _require(
        target_spec.vocab_size == draft_spec.vocab_size,
        "target and draft must share a vocabulary",
    )
    corpus = load_corpus(target_spec.vocab_size, config.val_fraction, config.corpus_bytes)
    target = train(target_spec, replace(config, distill_weight=0.0), corpus, log)
    teacher = target.model if config.distill_weight > 0 else None
    draft = train(draft_spec, config, corpus, log, teacher=teacher)
    windows = eval_windows(corpus.val, config.seq_len)
    agreement = greedy_agreement(target.model, draft.model, windows, config.batch_size)
    draft.report.extra["greedy_agreement"] = round(agreement, 4)
    log(f"greedy agreement (draft == target, held-out positions): {agreement:.1%}")
    out = Path(out_dir)
    target.save(out / "target")
    draft.save(out / "draft")
    return PairReport(target.report, draft.report, agreement)


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
