"""Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral) over a flat ragged batch.

All tokens of a step (prefill chunks of some sequences, one decode token of
others) travel as one `[num_tokens, hidden]` tensor. Keys and values are written
into the paged cache through the slot mapping and read back through block tables;
every hot operation goes through `kernels`' dispatcher.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import kernels
from kernels import PagedAttentionMetadata, quant
from kernels.quant import QuantLinear


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "llama") -> ModelConfig:
        """From a Hugging Face `config.json` of a Llama, Qwen2, Mistral or SmolLM model."""
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # transformers 5 folds theta and scaling in here
        if params:
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 has biases on q/k/v without saying so in its config.
            attention_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            name=name,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, stretch low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"rope scaling {kind!r} is not supported (default, linear and llama3 are)")


class Linear:
    """y = x @ W.T + b, with W in the layout that runs fastest where it lives.

    On CPU, oneDNN's prepacked weight layout (the one PyTorch's own compiler uses
    for frozen CPU models) ran SmolLM2's matmuls faster than `F.linear`: 1.5-2.5x in
    bf16 on an AVX512-BF16 Xeon (lm_head at 64 tokens: 3.1 ms vs 7.8 ms), and in fp32
    on an AVX2 EPYC 1.1-1.8x for the layers and 2.4x for lm_head (35 ms vs 85 ms at
    64 tokens), where `F.linear` ran the tall, thin lm_head at 43 GFLOP/s. Where a compiled
    kernel takes every row count (bf16 with AVX512-BF16 and no AMX: `linear_panels`; bf16
    only emulated: `linear_small`), no oneDNN copy is made (kernels/linear.py).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False, few_rows: bool = True,
                 kernels_choice: str = "auto"):
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        # bf16 where the CPU dots it natively (no AMX): one compiled kernel at every row count,
        # over the weights packed into panels, which replace the plain ones (kernels.linear).
        panels = kernels.panel_linear_for(weight, kernels_choice) if few_rows else None
        if panels is not None:
            self.packed, self.small = panels
            self.small_rows = kernels.ALL_ROWS
            if not keep_weight:
                self.weight = None
            return
        # A step of a few tokens streams the weights: a kernel that reads them at full speed
        # (on a CPU that emulates bf16, it takes every row count).
        few = kernels.small_linear_for(weight, kernels_choice) if few_rows else None
        self.small, self.small_rows = few if few is not None else (None, 0)
        self.packed = None
        if (
            self.small_rows < kernels.ALL_ROWS
            and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and torch.backends.mkldnn.is_available()
        ):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
            except (RuntimeError, AttributeError):  # an older oneDNN without it: plain matmul
                self.packed = None
        if self.packed is not None and not keep_weight:
            # Only F.linear reads the plain layout, and oneDNN's packed copy replaces it: let it go
            # (a kernel that reads it, linear_small, keeps its own reference). With AMX's tiles
            # too, a layer otherwise held its weights three times: 212 MB more for SmolLM2.
            self.weight = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_rows:
            return self.small(x, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class GateUp:
    """A SwiGLU's input half, silu(x @ gate.T) * (x @ up.T), from gate and up stacked into one
    weight. Where linear_amx applies, a decode step's rows take both projections and the
    activation in one pass (bf16 on AMX); otherwise, and for long prefill chunks, one fused
    projection and the backend's silu_and_mul."""

    def __init__(self, weight: torch.Tensor, silu_and_mul, kernels_choice: str = "auto"):
        fused = kernels.gated_linear_for(weight, kernels_choice)
        self.fused, self.fused_rows = fused if fused is not None else (None, 0)
        # With the fused path, the plain projection only serves long chunks: oneDNN's.
        self.linear = Linear(weight, few_rows=fused is None, kernels_choice=kernels_choice)
        self.silu_and_mul = silu_and_mul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.fused_rows:
            return self.fused(x)
        return self.silu_and_mul(self.linear(x))


class QuantGateUp:
    """GateUp over quantized weights: one projection, then the backend's silu_and_mul."""

    def __init__(self, linear: QuantLinear, silu_and_mul):
        self.linear = linear
        self.silu_and_mul = silu_and_mul

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.silu_and_mul(self.linear(x))


class LlamaModel(torch.nn.Module):
    """Weights in Hugging Face names, with q/k/v and gate/up fused into one matmul each.

    quantization "int8" or "int4" (kernels.quant): every linear layer and the LM head hold
    their weights quantized in groups of 32 and nothing else; the embedding table is the
    LM head's quantized weight when they are tied, its rows dequantized as they are looked
    up. Norms stay in `dtype`."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 kernels_choice: str = "auto", quantization: str = "none"):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.quantization = quantization
        bits = quant.BITS.get(quantization)
        if quantization != "none" and bits is None:
            raise ValueError(f"quantization must be none, int8 or int4, got {quantization!r}")

        def take(name: str, as_dtype: torch.dtype | None = None) -> torch.Tensor:
            try:
                t = tensors[name]
            except KeyError:
                raise ValueError(f"weight {name!r} missing from the checkpoint") from None
            return t.to(device=device, dtype=as_dtype or dtype).contiguous()

        def weight(name: str) -> torch.Tensor:
            # int8 from the checkpoint's own values, not from them rounded to the model's dtype
            # first: a Q4_1 GGUF's levels then land on its grid exactly, and a bf16 engine's int8
            # layers hold the bf16 model's weights bit for bit (from bf16-rounded values 24% of
            # SmolLM2's first qkv weights came out a bf16 step off). int4 stays on the rounded
            # values: from the exact ones its greedy replies moved, and on AMX one no longer
            # matched itself beside another request's prompt (int4's batch variance there).
            return take(name, torch.float32 if bits == 8 else None)

        self.ops = kernels.ops_for(device, dtype, kernels_choice)
        self.quant_rows = quant.QuantRows()
        # Called between layers while set (LLMEngine's step watch): it raises to abandon the
        # step, e.g. StepInterrupted when another tenant's request arrives that the step's rows
        # would make way for.
        self.interrupt: Callable[[], None] | None = None

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None, **options) -> Linear | QuantLinear:
            if bits is None:
                return Linear(weight, bias, kernels_choice=kernels_choice, **options)
            return QuantLinear(quant.quantize(weight, bits), bias, use_triton=kernels_choice != "reference",
                               rows=self.quant_rows, dtype=dtype)

        def gate_up(weight: torch.Tensor) -> GateUp | QuantGateUp:
            if bits is None:
                return GateUp(weight, self.ops.silu_and_mul, kernels_choice)
            return QuantGateUp(linear(weight), self.ops.silu_and_mul)

        self.tied = config.tie_word_embeddings or "lm_head.weight" not in tensors
        embed = weight("model.embed_tokens.weight")
        self.lm_head = linear(embed if self.tied else weight("lm_head.weight"), keep_weight=True)
        # Quantized, the table is looked up row by row (`_embed`); tied, it is the head's weight.
        self.embed = embed if bits is None else None
        self.embed_q = None if bits is None or self.tied else quant.quantize(embed, bits)
        del embed
        self.norm = take("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            qkv_bias = torch.cat([take(attn + f"{x}_proj.bias") for x in "qkv"]) if config.attention_bias else None
            self.layers.append(
                {
                    "input_norm": take(p + "input_layernorm.weight"),
                    "qkv": linear(torch.cat([weight(attn + f"{x}_proj.weight") for x in "qkv"]), qkv_bias),
                    "o": linear(weight(attn + "o_proj.weight")),
                    "post_norm": take(p + "post_attention_layernorm.weight"),
                    "gate_up": gate_up(torch.cat([weight(p + "mlp.gate_proj.weight"), weight(p + "mlp.up_proj.weight")])),
                    "down": linear(weight(p + "mlp.down_proj.weight")),
                }
            )

        inv_freq = rope_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_pos, head_dim // 2], fp32 as in transformers
        self.rope_cos = freqs.cos().to(device)
        self.rope_sin = freqs.sin().to(device)
        self.scale = config.head_dim**-0.5

    def num_parameters(self) -> int:
        tensors = [self.norm]
        count = self.config.vocab_size * self.config.hidden_size  # the embedding table
        if not self.tied:
            count += self.lm_head.out_features * self.lm_head.in_features
        for layer in self.layers:
            for part in layer.values():
                part = part.linear if isinstance(part, (GateUp, QuantGateUp)) else part
                if isinstance(part, (Linear, QuantLinear)):
                    count += part.out_features * part.in_features
                    tensors += [part.bias] if part.bias is not None else []
                else:
                    tensors.append(part)
        return count + sum(t.numel() for t in tensors)

    def verify_rows(self, rows: int) -> None:
        """A speculative verifying pass of this many rows (1 + k; 1 without speculation) must
        take the kernel a one-row decode does, so each of its rows gets the decode's bits."""
        self.quant_rows.int4 = max(quant.int4_linear_rows(), rows)
        self.quant_rows.int8 = max(quant.int8_linear_rows(), rows)

    def weight_bytes(self) -> int:
        """Bytes the weights hold (quantized ones as stored, scales included)."""
        seen: set[int] = set()
        total = 0

        def add(t: torch.Tensor | None) -> None:
            nonlocal total
            if t is not None and id(t) not in seen:  # by object: oneDNN's packed weights have no data pointer
                seen.add(id(t))
                total += t.numel() * t.element_size()

        def add_linear(part) -> None:
            if isinstance(part, QuantLinear):
                for t in (part.qw.qweight, part.qw.scales, part.qw.mins, part.bias):
                    add(t)
            else:
                for t in (part.weight, part.bias, part.packed):
                    add(t)

        add(self.embed)
        add(self.norm)
        if self.embed_q is not None:
            for t in (self.embed_q.qweight, self.embed_q.scales, self.embed_q.mins):
                add(t)
        add_linear(self.lm_head)
        for layer in self.layers:
            for part in layer.values():
                if isinstance(part, (GateUp, QuantGateUp)):
                    add_linear(part.linear)
                elif isinstance(part, (Linear, QuantLinear)):
                    add_linear(part)
                else:
                    add(part)
        return total

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return self.embed[input_ids]
        table = self.lm_head.qw if self.embed_q is None else self.embed_q
        return quant.dequantize_rows(table, input_ids, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        slot_mapping: torch.Tensor,  # [num_tokens]
        meta: PagedAttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, [num_blocks, block_size, kv_heads, head_dim]
    ) -> torch.Tensor:
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        hidden = self._embed(input_ids)  # [num_tokens, hidden]
        self.quant_rows.decodes = meta.num_decodes  # the leading rows (kernels/quant.py, QuantLinear)
        try:
            return self._layers(hidden, cos, sin, slot_mapping, meta, kv_caches)
        finally:
            self.quant_rows.decodes = None

    def _layers(self, hidden, cos, sin, slot_mapping, meta, kv_caches) -> torch.Tensor:
        cfg = self.config
        n = hidden.shape[0]
        eps = cfg.rms_norm_eps
        ops = self.ops
        residual = None
        interrupt = self.interrupt
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer["input_norm"], eps)
            else:
                if interrupt is not None:
                    interrupt()
                x, residual = ops.add_rms_norm(hidden, residual, layer["input_norm"], eps)
            q = ops.rotary_write_kv(layer["qkv"](x), cos, sin, k_cache, v_cache, slot_mapping, cfg.num_heads)
            attn = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)
            hidden = layer["o"](attn.view(n, -1))
            x, residual = ops.add_rms_norm(hidden, residual, layer["post_norm"], eps)
            hidden = layer["down"](layer["gate_up"](x))
        out, _ = ops.add_rms_norm(hidden, residual, self.norm, eps)
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_sampling, hidden] -> [num_sampling, vocab] in the model's dtype; the
        # sampler widens them to fp32 only for what needs it (not a plain greedy batch).
        return self.lm_head(hidden)


def random_tensors(config: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random weights of the given shape in Hugging Face names: tiny models for fast tests."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * std

    h, d = config.hidden_size, config.head_dim
    t = {
        "model.embed_tokens.weight": rnd(config.vocab_size, h),
        "model.norm.weight": 1 + rnd(h),
    }
    if not config.tie_word_embeddings:
        t["lm_head.weight"] = rnd(config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + rnd(h)
        t[p + "post_attention_layernorm.weight"] = 1 + rnd(h)
        t[p + "self_attn.q_proj.weight"] = rnd(config.num_heads * d, h)
        t[p + "self_attn.k_proj.weight"] = rnd(config.num_kv_heads * d, h)
        t[p + "self_attn.v_proj.weight"] = rnd(config.num_kv_heads * d, h)
        t[p + "self_attn.o_proj.weight"] = rnd(h, config.num_heads * d)
        if config.attention_bias:
            t[p + "self_attn.q_proj.bias"] = rnd(config.num_heads * d)
            t[p + "self_attn.k_proj.bias"] = rnd(config.num_kv_heads * d)
            t[p + "self_attn.v_proj.bias"] = rnd(config.num_kv_heads * d)
        t[p + "mlp.gate_proj.weight"] = rnd(config.intermediate_size, h)
        t[p + "mlp.up_proj.weight"] = rnd(config.intermediate_size, h)
        t[p + "mlp.down_proj.weight"] = rnd(h, config.intermediate_size)
    return t
