"""Speculative decoding on the real SmolLM2-135M-Instruct, by prompt lookup and with the packaged
model at int4 as draft: greedy output token for token what the engine gives without it (which
tests/engine/test_real_model.py holds to `transformers`, alone, in a batch and preempted).

Kept to one run alone and one batch per mode on a 2-core machine: a batch of 32 verifying 4 draft
tokens each computes 160 tokens a step (~100 s for the batch, against ~75 s without speculation),
so the batch verifies 2 draft tokens and its fillers are shorter (1-40 words, not 1-120)."""

from __future__ import annotations

import pytest

from inference.engine.api import SamplingParams
from inference.engine.config import EngineConfig
from inference.engine.engine import LLMEngine, LoadedModel
from tests.engine.test_real_model import _filler_prompts

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def unspeculated(smollm, chat_prompt_ids):
    """The engine's greedy tokens for the chat prompts without speculation, each alone."""
    model, tokenizer = smollm
    engine = LLMEngine(EngineConfig(dtype="float32"), LoadedModel(model, tokenizer))
    return [engine.generate([ids], GREEDY_64)[0].token_ids for ids in chat_prompt_ids]


@pytest.fixture(scope="module")
def speculating(smollm, quantized):
    """Builds an engine speculating by `mode`; "draft" drafts with the same GGUF at int4."""
    model, tokenizer = smollm
    draft = quantized("int4")

    def make(mode: str, **overrides) -> LLMEngine:
        # Every step proposes k: these check what verifying does, not when it pays.
        config = EngineConfig(dtype="float32", speculative=mode, speculative_adaptive=False, **overrides)
        return LLMEngine(config, LoadedModel(model, tokenizer, draft=draft if mode == "draft" else None))

    return make


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_greedy_alone_is_token_identical(speculating, chat_prompt_ids, unspeculated, mode):
    engine = speculating(mode)
    got = [engine.generate([ids], GREEDY_64)[0].token_ids for ids in chat_prompt_ids]
    assert got == unspeculated
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.steps < stats.generated_tokens
    print(f"{mode} alone: acceptance {stats.spec_acceptance_rate:.2f}, {stats.spec_tokens_per_pass:.2f} tokens a pass")


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_greedy_in_a_preempted_batch_of_32_is_token_identical(speculating, smollm, chat_prompt_ids, unspeculated, mode):
    _, tokenizer = smollm
    prompts = _filler_prompts(tokenizer, 27, seed=1, max_words=40)
    for i, ids in enumerate(chat_prompt_ids):
        prompts.insert(i * 6, ids)
    # 120 blocks cannot hold the batch: sequences are preempted and recomputed. Speculating
    # with every batch size (speculative_max_batch 32), so the full batch verifies drafts too.
    engine = speculating(mode, num_blocks=120, max_num_seqs=32, speculative_max_batch=32, num_speculative_tokens=2)
    completions = engine.generate(prompts, GREEDY_64)
    assert [completions[i * 6].token_ids for i in range(5)] == unspeculated
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0
    assert stats.preemptions > 0, "the small cache was meant to force preemption"
    assert stats.blocks_free == stats.blocks_total


def test_greedy_alone_is_token_identical_in_the_dtype_the_engine_serves_in(chat_prompt_ids):
    """bf16 where the CPU has AVX-512 (fp32 elsewhere, as the tests above run): each row of a
    verifying pass must get the bits its decode step would, from the linears too."""
    engine = LLMEngine.from_config(EngineConfig(enable_prefix_caching=False, kv_cache_bytes=1 << 26))
    plain = [engine.generate([ids], GREEDY_64)[0].token_ids for ids in chat_prompt_ids]
    spec = LLMEngine(EngineConfig(enable_prefix_caching=False, kv_cache_bytes=1 << 26, speculative="ngram",
                                  speculative_adaptive=False), engine.loaded)
    assert [spec.generate([ids], GREEDY_64)[0].token_ids for ids in chat_prompt_ids] == plain
    assert spec.stats().spec_accepted_tokens > 0
