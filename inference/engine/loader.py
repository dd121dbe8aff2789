"""Weights and configuration from a GGUF file or a Hugging Face folder.

Both paths end in the same place: a `ModelConfig` and a dict of tensors in
Hugging Face names, which `LlamaModel` turns into a model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from inference.engine.errors import ConfigError
from inference.engine.models.llama import LlamaModel, ModelConfig
from inference.engine.sources import ModelSource, cache_root, file_key, resolve_source

log = logging.getLogger(__name__)

_GGUF_ARCHS = ("llama", "qwen2", "mistral")
# GGUF -> Hugging Face names, per layer and global.
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each head; undo it so the
    # weights match Hugging Face's rotate-half layout.
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Bump when read_gguf's output changes for the same file: older cache entries are then ignored.
_GGUF_CACHE_VERSION = "1"


def read_gguf(path: Path, cache_dir: str | os.PathLike | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The GGUF file's config and dequantized fp32 tensors, from the cache when converted before.

    Parsing the metadata (a 49k-token vocabulary) and dequantizing took ~9 s on a 2-core
    box, paid by every process that builds an engine; the cached safetensors file loads
    in well under a second.
    """
    from safetensors.torch import load_file, save_file

    cached = cache_root(cache_dir) / "weights" / f"{file_key(path, _GGUF_CACHE_VERSION)}.safetensors"
    if cached.is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(cached), "pt") as f:
                meta = json.loads(f.metadata()["config"])
            meta["eos_token_ids"] = tuple(meta["eos_token_ids"])
            return ModelConfig(**meta), load_file(str(cached))
        except Exception as exc:  # a truncated or foreign file: convert again and replace it
            log.warning("ignoring the converted copy %s of %s: %s", cached, path, exc)
    config, tensors = convert_gguf(path)
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
        os.close(fd)
        save_file(tensors, tmp, metadata={"config": json.dumps(dataclasses.asdict(config))})
        os.replace(tmp, cached)  # atomic: a concurrent reader sees the whole file or none
    except OSError as exc:  # a read-only or full disk: serve without the cache
        log.warning("could not keep a converted copy of %s: %s", path, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return config, tensors


def convert_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read the GGUF file's metadata and dequantize its tensors to fp32."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ConfigError(f"GGUF architecture {arch!r} is not supported ({', '.join(_GGUF_ARCHS)} are)", setting="model")
    heads = int(field(f"{arch}.attention.head_count"))
    kv_heads = int(field(f"{arch}.attention.head_count_kv", heads))
    hidden = int(field(f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    scaling = None
    if field(f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(field(f"{arch}.rope.scaling.factor"))}
    eos = field("tokenizer.ggml.eos_token_id")
    config = ModelConfig(
        vocab_size=int(field(f"{arch}.vocab_size", embed.shape[-1])),
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_layers=int(field(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        name=str(field("general.name", path.stem)),
    )
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        if t.name in _GGUF_GLOBAL_NAMES:
            name = _GGUF_GLOBAL_NAMES[t.name]
        else:
            _, idx, rest = t.name.split(".", 2)
            if rest not in _GGUF_LAYER_NAMES:
                continue  # e.g. rope_freqs, which we compute from the config
            name = f"model.layers.{idx}.{_GGUF_LAYER_NAMES[rest]}"
            if arch in ("llama", "mistral") and rest in ("attn_q.weight", "attn_k.weight"):
                w = _unpermute_qk(w, heads if rest == "attn_q.weight" else kv_heads)
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: the file is memory-mapped read-only
    return config, tensors


def read_hf_folder(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    model_type = cfg.get("model_type", "llama")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise ConfigError(f"model_type {model_type!r} is not supported (llama, qwen2, mistral are)", setting="model")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return ModelConfig.from_hf(cfg, name=path.name), tensors


def load_model(
    model: str,
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: str | os.PathLike | None = None,
    kernels_choice: str = "auto",
    quantization: str = "none",
) -> tuple[LlamaModel, ModelSource]:
    """The configured model's weights on `device`, running the kernels `kernels_choice` picks,
    quantized at load when `quantization` is int8 or int4 (kernels.quant: from a GGUF, its
    weights as dequantized, which int4 puts back on Q4_1's grid)."""
    source = resolve_source(model)
    config, tensors = read_gguf(source.path, cache_dir) if source.kind == "gguf" else read_hf_folder(source.path)
    return LlamaModel(config, tensors, dtype, device, kernels_choice, quantization), source
