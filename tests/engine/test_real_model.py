"""The engine on the real SmolLM2-135M-Instruct weights, against `transformers`."""

from __future__ import annotations

import random

import pytest
import torch

from inference.engine.api import SamplingParams

GREEDY_64 = SamplingParams(max_tokens=64, temperature=0)

# Loading SmolLM2 twice (ours and transformers') is most of this module's time.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def reference_tokens(hf_reference, chat_prompt_ids):
    """transformers' greedy continuation of each chat prompt, 64 new tokens at most."""
    out = []
    with torch.inference_mode():
        for ids in chat_prompt_ids:
            full = hf_reference.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
            out.append(full[0, len(ids) :].tolist())
    return out


def _filler_prompts(tokenizer, n: int, seed: int, max_words: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    words = "river mountain code tensor garden violin orbit lantern harbor puzzle".split()
    prompts = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, max_words)))
        prompts.append(tokenizer.encode_chat([{"role": "user", "content": f"Summarise: {text}"}]))
    return prompts


def test_greedy_tokens_match_transformers(make_engine, chat_prompt_ids, reference_tokens):
    engine = make_engine()
    for ids, expected in zip(chat_prompt_ids, reference_tokens):
        (completion,) = engine.generate([ids], GREEDY_64)
        assert list(completion.token_ids) == expected


def test_first_step_logits_match_transformers(make_engine, hf_reference, chat_prompt_ids):
    engine = make_engine()
    for i, ids in enumerate(chat_prompt_ids):
        engine.add_request(f"logits-{i}", ids, GREEDY_64)
    seqs, logits = engine.runner.compute_logits(engine.scheduler.schedule())
    assert len(seqs) == len(chat_prompt_ids)
    with torch.inference_mode():
        for seq, row in zip(seqs, logits):
            ref = hf_reference(torch.tensor([seq.prompt_token_ids])).logits[0, -1].float()
            rel = (row - ref).norm() / ref.norm()
            assert rel < 1e-3, f"relative error {rel:.2e} for {seq.request_id}"


@pytest.mark.parametrize("num_blocks", [None, 120], ids=["roomy-cache", "cache-forces-preemption"])
def test_batch_of_32_mixed_lengths_matches_transformers(make_engine, smollm, chat_prompt_ids, reference_tokens, num_blocks):
    _, tokenizer = smollm
    prompts = _filler_prompts(tokenizer, 27, seed=1, max_words=60)
    for i, ids in enumerate(chat_prompt_ids):
        prompts.insert(i * 6, ids)  # spread the five checked prompts through the batch
    assert len(prompts) == 32 and len({len(p) for p in prompts}) > 10
    engine = make_engine(num_blocks=num_blocks, max_num_seqs=32)
    completions = engine.generate(prompts, GREEDY_64)
    got = [list(completions[i * 6].token_ids) for i in range(5)]
    assert got == reference_tokens
    if num_blocks is not None:
        assert engine.stats().preemptions > 0, "the small cache was meant to force preemption"
    assert engine.stats().blocks_free == engine.stats().blocks_total


def _system_prefix(tokenizer, length: int) -> list[int]:
    text = "You are a meticulous assistant. " * 200
    ids = tokenizer.encode_chat([{"role": "system", "content": text}], add_generation_prompt=False)
    return ids[:length]


def test_shared_512_token_prefix_is_computed_once(make_engine, smollm):
    _, tokenizer = smollm
    prefix = _system_prefix(tokenizer, 512)
    first = prefix + tokenizer.encode("\nQuestion: what is 2+2?")
    second = prefix + tokenizer.encode("\nQuestion: name a colour.")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    engine = make_engine()
    engine.generate([first], params)
    before = engine.stats()
    (cached,) = engine.generate([second], params)
    after = engine.stats()

    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 512
    assert cached.num_cached_tokens == 512
    # The rest of the prompt once, then one token per decode step after the first sample.
    assert after.computed_tokens - before.computed_tokens == (len(second) - 512) + (params.max_tokens - 1)

    (uncached,) = make_engine(enable_prefix_caching=False).generate([second], params)
    assert uncached.num_cached_tokens == 0
    assert cached.token_ids == uncached.token_ids


def test_64_requests_sharing_a_system_prompt_save_90_percent_of_prefill(make_engine, smollm):
    _, tokenizer = smollm
    prefix = _system_prefix(tokenizer, 512)
    rng = random.Random(0)
    prompts = [prefix + [rng.randrange(1000, 40000) for _ in range(32)] for _ in range(64)]
    engine = make_engine(max_num_seqs=64)
    engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    stats = engine.stats()
    prompt_tokens = 64 * 544
    assert stats.prompt_tokens == prompt_tokens
    saved = stats.prefix_hit_tokens / prompt_tokens
    assert saved >= 0.90, f"only {saved:.1%} of prefill tokens came from the cache"
    assert stats.computed_tokens == prompt_tokens - stats.prefix_hit_tokens


def test_isolated_tenants_never_share_blocks(make_engine, smollm):
    _, tokenizer = smollm
    prompt = _system_prefix(tokenizer, 256) + tokenizer.encode("\nHello")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine = make_engine()
    engine.add_request("tenant-a", prompt, params, cache_salt="tenant-a")
    while engine.has_unfinished():
        engine.step()
    engine.add_request("tenant-b", prompt, params, cache_salt="tenant-b")
    a_blocks = set(engine.block_manager.cached.values())
    engine.step()
    b_seq = engine.requests["tenant-b"]
    assert b_seq.num_cached_tokens == 0
    assert not a_blocks & set(b_seq.block_table)
    engine.abort("tenant-b")
    # The same tenant again reuses its own cache.
    engine.add_request("tenant-a-again", prompt, params, cache_salt="tenant-a")
    engine.step()
    assert engine.requests["tenant-a-again"].num_cached_tokens == 256
