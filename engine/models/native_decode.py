"""A small model's whole forward in one native call, for a few tokens at a time.

A draft model proposes one token per forward, several times per step, and a small
model's forward on the CPU is mostly per-operator overhead: a 2-layer, d=64 draft steps
in about half the time of the 4-layer, d=192 target it drafts for, whatever their sizes.
``NativeDecoder`` runs the forward of every given token (embedding to logits, all layers)
in one call of ``tandem_llama_rows_f32`` (``engine/attention/csrc/paged_decode.c``),
reading the model's own weights and writing the same paged KV cache the torch path
writes, so the two can take turns on a sequence.

Tokens run one at a time, in order (a chunk's tokens causally, like the decode kernel's
rows), so the cost grows with the number of tokens; ``MAX_ROWS`` bounds what it takes.
Results equal the torch path's up to float rounding (summation order, ``-ffast-math``):
fine for a draft, whose proposals the target verifies, and whose probabilities are the
ones this path computed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from tandem.engine.attention.native import paged_decode_library
from tandem.engine.scheduler import ScheduledChunk

MAX_ROWS = 32
"""Beyond this many tokens in one call the torch path's batched products win."""


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_void_p) for name in (
            "input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down",
            "k_cache", "v_cache",
        )),
        ("window", ctypes.c_int64),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in (
            "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
            "vocab", "block_size", "max_positions",
        )),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("embed", "final_norm", "lm_head", "cos", "sin")),
    ]  # fmt: skip


class NativeDecoder:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int) -> None:
        """``model``: a loaded Llama-family model (``LlamaForCausalLM`` or a subclass) in
        float32 on the CPU with plain ``nn.Linear`` layers; ``kv_caches``: its allocated
        cache. Use ``NativeDecoder.supports(...)`` first."""
        library = paged_decode_library()
        assert library is not None and self.supports(model)
        self._fn = library.tandem_llama_rows_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [
            ctypes.POINTER(_Model),
            ctypes.POINTER(_Layer),
            ctypes.c_int64,
            *[ctypes.c_void_p] * 3,
            ctypes.c_int64,
            *[ctypes.c_void_p] * 3,
            ctypes.c_int,
        ]
        for cache in kv_caches:
            if not cache.is_contiguous():
                raise ValueError(
                    "NativeDecoder writes the KV cache in place: it must be contiguous"
                )
        self._owners = (model, list(kv_caches))  # the pointers below stay valid while these live
        config = model.config
        stack = model.model
        self.vocab = config.vocab_size
        self._keep = [stack.rotary.cos.contiguous(), stack.rotary.sin.contiguous()]
        self._model = _Model(
            num_layers=config.num_layers,
            hidden=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            block_size=block_size,
            max_positions=stack.rotary.cos.shape[0],
            eps=stack.norm.eps,
            scale=config.head_dim**-0.5,
            embed=self._ptr(stack.embed_tokens.weight),
            final_norm=self._ptr(stack.norm.weight),
            lm_head=self._ptr(model.lm_head.weight),
            cos=self._keep[0].data_ptr(),
            sin=self._keep[1].data_ptr(),
        )
        layers = []
        for layer, cache in zip(stack.layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            bias = attn.qkv_proj.bias
            layers.append(
                _Layer(
                    input_norm=self._ptr(layer.input_layernorm.weight),
                    qkv=self._ptr(attn.qkv_proj.weight),
                    qkv_bias=None if bias is None else self._ptr(bias),
                    o=self._ptr(attn.o_proj.weight),
                    post_norm=self._ptr(layer.post_attention_layernorm.weight),
                    gate_up=self._ptr(mlp.gate_up_proj.weight),
                    down=self._ptr(mlp.down_proj.weight),
                    k_cache=self._ptr(cache[0]),
                    v_cache=self._ptr(cache[1]),
                    window=attn.sliding_window or 0,
                )
            )
        self._layers = (_Layer * len(layers))(*layers)

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """A Llama-family model in float32 on the CPU with plain linear layers and a
        head_dim the attention kernel takes, and the native library built."""
        from tandem.common.model_config import Architecture
        from tandem.engine.models.llama import LlamaForCausalLM

        library = paged_decode_library()
        if not isinstance(model, LlamaForCausalLM) or library is None:
            return False
        plain = (Architecture.LLAMA, Architecture.QWEN2, Architecture.MISTRAL)
        if model.config.architecture not in plain:  # q/k norms, experts, partial rope...
            return False
        if model.config.head_dim > library.tandem_paged_decode_max_head_dim():
            return False
        linears = [model.lm_head]
        for layer in model.model.layers:
            mlp = layer.mlp
            linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            linears += [getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)]
        if not all(isinstance(linear, nn.Linear) for linear in linears):
            return False
        weights = [linear.weight for linear in linears] + [model.model.embed_tokens.weight]
        return all(w.dtype == torch.float32 and w.device.type == "cpu" for w in weights)

    def _ptr(self, tensor: torch.Tensor) -> int:
        tensor = tensor.detach()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
            self._keep.append(tensor)
        return tensor.data_ptr()

    @torch.inference_mode()
    def last_logits(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Run ``chunks`` (writing their KV) and return the logits at each chunk's last
        position, ``[len(chunks), V]`` in the given order (``ModelRunner.last_logits``)."""
        tokens, positions, row_table, logit_rows = [], [], [], []
        for i, chunk in enumerate(chunks):
            if chunk.num_tokens < 1 or chunk.draft_token_ids:
                raise ValueError("NativeDecoder runs chunks of at least one token, without drafts")
            own = chunk.request.all_token_ids[chunk.start : chunk.end]
            tokens.extend(own)
            positions.extend(range(chunk.start, chunk.end))
            row_table.extend([i] * len(own))
            logit_rows.extend([-1] * (len(own) - 1) + [i])
        width = max(len(c.block_ids) for c in chunks)
        tables = np.zeros((len(chunks), width), dtype=np.int64)
        for i, chunk in enumerate(chunks):
            tables[i, : len(chunk.block_ids)] = chunk.block_ids
        arrays = [np.asarray(a, dtype=np.int64) for a in (tokens, positions, row_table, logit_rows)]
        logits = torch.empty(len(chunks), self.vocab, dtype=torch.float32)
        status = self._fn(
            self._model,
            self._layers,
            len(tokens),
            arrays[0].ctypes.data,
            arrays[1].ctypes.data,
            tables.ctypes.data,
            width,
            arrays[2].ctypes.data,
            arrays[3].ctypes.data,
            logits.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            why = _FAILURES.get(status, f"status {status}")
            raise RuntimeError(f"native decode failed: {why}")
        return logits


_FAILURES = {
    -1: "out of memory for work buffers",
    -2: "a position outside the rotary tables",
    -3: "a token id outside the vocabulary",
    -4: "a position past the end of its block table",
    -5: "a head_dim beyond the attention kernel's",
}
