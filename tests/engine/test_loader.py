"""Hugging Face safetensors folders: our model's logits against `transformers` on the same weights."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.engine.config import EngineConfig
from inference.engine.engine import LLMEngine, LoadedModel
from inference.engine.errors import ConfigError
from inference.engine import loader
from inference.engine.loader import load_model
from inference.engine.api import SamplingParams
from tests.engine.tiny import one_thread

assert one_thread  # an autouse fixture: importing it is what applies it here

VOCAB = 64
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so positions below 40 reach the scaled band
}


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    return {
        "llama": lambda: LlamaConfig(**SMALL),
        "llama-tied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True),
        "llama3-rope": lambda: LlamaConfig(**SMALL, rope_parameters=LLAMA3_ROPE),
        "qwen2-bias": lambda: Qwen2Config(**SMALL),
        # head_dim 24 is not hidden_size / heads: it must come from the config.
        "mistral": lambda: MistralConfig(**SMALL, head_dim=24, sliding_window=None),
    }


def save_hf_model(kind: str, path) -> torch.nn.Module:
    """A random `transformers` model saved as safetensors, with weights large enough to matter."""
    from transformers import AutoModelForCausalLM

    config = _configs()[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # transformers starts biases at 0 and norms at 1: randomise them too, or a loader
            # that dropped them would still pass.
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(path))
    return model


PROMPT = [(7 * i + 3) % VOCAB for i in range(40)]
# Each prefix is its own request: the batch yields the logits after 1, 5, 17 and 40 tokens.
CUTS = (1, 5, 17, 40)


def our_logits(model) -> torch.Tensor:
    engine = LLMEngine(EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=256, max_num_seqs=8), LoadedModel(model))
    for cut in CUTS:
        engine.add_request(f"cut-{cut}", PROMPT[:cut], SamplingParams(temperature=0, max_tokens=1))
    seqs, logits = engine.runner.compute_logits(engine.scheduler.schedule())
    order = {s.request_id: i for i, s in enumerate(seqs)}
    return logits[[order[f"cut-{c}"] for c in CUTS]]


def hf_logits(hf_model) -> torch.Tensor:
    with torch.inference_mode():
        full = hf_model(torch.tensor([PROMPT])).logits[0].float()
    return full[[c - 1 for c in CUTS]]


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "llama3-rope", "qwen2-bias", "mistral"])
def test_logits_match_transformers(tmp_path, kind):
    hf_model = save_hf_model(kind, tmp_path)
    model, source = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    assert source.kind == "hf"
    ours, theirs = our_logits(model), hf_logits(hf_model)
    assert theirs.abs().max() > 1  # logits of some size, so the tolerance means something
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_tied_checkpoint_has_no_lm_head_and_uses_the_embedding(tmp_path):
    save_hf_model("llama-tied", tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    model, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.embed


def test_llama3_rope_scaling_is_applied_not_ignored(tmp_path):
    hf_model = save_hf_model("llama3-rope", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    unscaled, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    # Had the loader dropped the scaling, the comparison above would have failed by this much.
    assert (our_logits(unscaled) - hf_logits(hf_model)).abs().max() > 1e-2


def test_legacy_rope_scaling_keys_load_the_same(tmp_path):
    """Configs written by transformers 4 carry `rope_theta` and `rope_scaling` at the top level."""
    hf_model = save_hf_model("llama3-rope", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(str(tmp_path), torch.float32, torch.device("cpu"))
    torch.testing.assert_close(our_logits(model), hf_logits(hf_model), rtol=1e-4, atol=1e-4)


def test_folder_without_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a packaged model"):
        load_model(str(tmp_path / "nope"), torch.float32, torch.device("cpu"))


def test_unsupported_model_type_is_a_clear_error(tmp_path):
    save_hf_model("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_config_without_weights_is_a_clear_error(tmp_path):
    save_hf_model("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def test_missing_weight_names_the_weight(tmp_path):
    save_hf_model("llama", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def write_tiny_gguf(path, seed: int = 0) -> dict[str, np.ndarray]:
    """A one-layer llama GGUF with fp32 tensors (GGUF shapes: rows are the last axis)."""
    import gguf

    rng = np.random.default_rng(seed)
    hidden, inter, vocab, heads, kv_heads = 16, 32, 32, 4, 2
    tensors = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (hidden // heads * kv_heads, hidden),
        "blk.0.attn_v.weight": (hidden // heads * kv_heads, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.ffn_gate.weight": (inter, hidden),
        "blk.0.ffn_up.weight": (inter, hidden),
        "blk.0.ffn_down.weight": (hidden, inter),
    }
    arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in tensors.items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(1)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_eos_token_id(2)
    for name, array in arrays.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return arrays


def test_a_gguf_file_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    path = tmp_path / "tiny.gguf"
    arrays = write_tiny_gguf(path)
    config, tensors = loader.read_gguf(path, cache)
    assert torch.equal(tensors["model.layers.0.mlp.down_proj.weight"], torch.from_numpy(arrays["blk.0.ffn_down.weight"]))
    (cached,) = (tmp_path / "cache" / "weights").iterdir()

    def no_conversion(path):
        raise AssertionError("converted again although a converted copy was cached")

    monkeypatch.setattr(loader, "convert_gguf", no_conversion)
    again_config, again = loader.read_gguf(path, cache)
    assert again_config == config and config.eos_token_ids == (2,) and config.num_kv_heads == 2
    assert again.keys() == tensors.keys() and all(torch.equal(again[k], tensors[k]) for k in tensors)

    # A damaged copy is converted again and replaced; a file with other contents gets a copy
    # of its own, and the same contents elsewhere share the first.
    monkeypatch.undo()
    cached.write_bytes(cached.read_bytes()[:100])
    _, repaired = loader.read_gguf(path, cache)
    assert all(torch.equal(repaired[k], tensors[k]) for k in tensors)
    assert cached.stat().st_size > 100
    elsewhere = tmp_path / "elsewhere.gguf"
    elsewhere.write_bytes(path.read_bytes())
    os.utime(elsewhere, ns=(1, 1))
    loader.read_gguf(elsewhere, cache)
    assert list((tmp_path / "cache" / "weights").iterdir()) == [cached]
    other = write_tiny_gguf(path, seed=1)
    _, changed = loader.read_gguf(path, cache)
    assert torch.equal(changed["model.layers.0.mlp.down_proj.weight"], torch.from_numpy(other["blk.0.ffn_down.weight"]))
    assert len(list((tmp_path / "cache" / "weights").iterdir())) == 2
