"""A request's output does not depend on how many threads the engine's CPU kernels run on
(INFERENCE_CPU_THREADS, a core fewer than the machine has by default): replicas set up
differently, or one whose setting changed, give a request the same greedy tokens."""
from __future__ import annotations

import itertools

import torch

from inference.engine.api import SamplingParams
from inference.engine.config import EngineConfig
from inference.engine.engine import LLMEngine


def test_a_requests_tokens_and_logprobs_do_not_depend_on_the_threads_its_steps_ran_on():
    """Greedy tokens and their logprobs, 12 chats in one batch, in the dtype the engine serves in
    here: every step on one thread, against steps alternating between one thread and two."""
    before = torch.get_num_threads()
    try:
        engine = LLMEngine.from_config(EngineConfig(kv_cache_bytes=1 << 26, max_num_seqs=16, cpu_threads=1,
                                                    enable_prefix_caching=False))
        questions = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primes.",
                     "Explain recursion briefly.", "Say hello in German.", "What is 12 times 12?"]
        prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q * (1 + i // 6)}])
                   for i, q in enumerate(questions * 2)]
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
        alone = engine.generate(prompts, params)

        switching = LLMEngine(engine.config, engine.loaded)
        steps = itertools.count()
        step = switching.step

        def step_on_one_then_two():
            torch.set_num_threads(1 + next(steps) % 2)
            return step()

        switching.step = step_on_one_then_two
        switched = switching.generate(prompts, params)
        assert next(steps) >= 16  # a prefill step and 15 decodes at least
        for a, b in zip(alone, switched):
            assert a.token_ids == b.token_ids
            assert a.logprobs == b.logprobs
    finally:
        torch.set_num_threads(before)
