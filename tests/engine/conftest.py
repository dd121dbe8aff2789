"""Fixtures for engine tests that need the real SmolLM2 model.

Loading it costs seconds, so the model, its tokenizer and the `transformers`
reference are loaded once per session and shared; each test builds its own
engine (cheap) around the shared weights.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from inference.engine.config import EngineConfig
from inference.engine.engine import LLMEngine, LoadedModel
from inference.engine.loader import load_model, resolve_source
from inference.engine.tokenizer import Tokenizer

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three prime numbers.",
    "Translate 'good morning' to Spanish.",
]


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer) of the packaged SmolLM2-135M-Instruct GGUF, in fp32 for parity."""
    model, source = load_model("SmolLM2-135M-Instruct", torch.float32, torch.device("cpu"))
    return model, Tokenizer.load(source)


@pytest.fixture(scope="session")
def quantized(smollm):
    """The packaged model in fp32 as each quantization loads it: "none" is `smollm`'s own."""
    loaded = {"none": smollm[0]}

    def get(name: str):
        if name not in loaded:
            loaded[name], _ = load_model("SmolLM2-135M-Instruct", torch.float32, torch.device("cpu"), quantization=name)
        return loaded[name]

    return get


@pytest.fixture(scope="session")
def hf_reference():
    """`transformers` loading the very same GGUF file."""
    from transformers import AutoModelForCausalLM

    source = resolve_source("SmolLM2-135M-Instruct")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture
def make_engine(smollm):
    model, tokenizer = smollm

    def make(**overrides) -> LLMEngine:
        return LLMEngine(EngineConfig(dtype="float32", **overrides), LoadedModel(model, tokenizer))

    return make


@pytest.fixture(scope="session")
def chat_prompt_ids(smollm):
    _, tokenizer = smollm
    return [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
