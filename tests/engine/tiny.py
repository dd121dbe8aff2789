"""Tiny random-weight Llama models and engines for fast engine tests.

Weights are drawn with std 0.5 so the logits are far apart: greedy choices do not
hinge on the last bit of a float, and batch composition cannot flip them.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from inference.engine.config import EngineConfig
from inference.engine.engine import LLMEngine, LoadedModel, RunnerFactory
from inference.engine.loader import resolve_source
from inference.engine.model_runner import ModelRunner, SampledToken
from inference.engine.models.llama import LlamaModel, ModelConfig, random_tensors
from inference.engine.scheduler import SchedulerOutput
from inference.engine.api import SamplingParams
from inference.engine.sequence import Sequence
from inference.engine.tokenizer import Tokenizer

VOCAB = 64
TINY = ModelConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=512,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread():
    """Run tiny models on one thread; import this into a test module to apply it there.

    Matrices this small gain nothing from a second thread, and on a busy 2-core
    machine OpenMP's spin-waiting made each step ~10x slower (170 ms vs 15 ms
    for a 12-token run, measured while other test suites ran alongside).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@lru_cache(maxsize=None)
def tiny_model(seed: int = 0, config: ModelConfig = TINY, dtype: torch.dtype = torch.float32) -> LlamaModel:
    # Shared between tests: the model holds no state between forward calls (the cache is the runner's).
    return LlamaModel(config, random_tensors(config, seed, std=0.5), dtype, torch.device("cpu"))


@lru_cache(maxsize=None)
def smol_tokenizer() -> Tokenizer:
    """The real SmolLM2 tokenizer (seconds to load), shared by every test that needs text."""
    return Tokenizer.load(resolve_source("SmolLM2-135M-Instruct"))


class ManualClock:
    """The engine's clock in tests: time moves only when the test says so."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def tiny_engine(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    clock: ManualClock | None = None,
    swap_space_bytes: int = 64 * 1024,
    make_runner: RunnerFactory = ModelRunner,
    draft: LlamaModel | None = None,
    model: LlamaModel | None = None,
    **overrides,
) -> LLMEngine:
    """A tiny-model engine on a manual clock (arrival times in tests are on that clock),
    with a swap pool sized for tiny models rather than the 1 GiB default. `make_runner`:
    the runner seam (`fake_runner(SumRunner())`, or a wrapper around the real ModelRunner);
    `draft`: the draft model of speculative "draft"; `model`: another than tiny_model()."""
    config = EngineConfig(
        swap_space_bytes=swap_space_bytes,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        **overrides,
    )
    return LLMEngine(config, LoadedModel(model or tiny_model(), draft=draft), make_runner=make_runner,
                     clock=clock or ManualClock())


def fake_runner(runner) -> RunnerFactory:
    """A make_runner that hands the engine `runner` (which needs no KV cache) as it is."""
    return lambda model, **kv_cache: runner


def make_seq(request_id: str, token_ids: list[int], salt: str | None = None, max_tokens: int = 16,
             tenant: str | None = None) -> Sequence:
    """A bare sequence, for block-manager tests that need no engine."""
    return Sequence(
        request_id=request_id,
        prompt_token_ids=list(token_ids),
        params=SamplingParams(max_tokens=max_tokens),
        arrival_time=0.0,
        cache_salt=salt,
        tenant_id=tenant,
    )


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list]:
    """Step until idle; every RequestOutput per request id, in order."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def tokens_of(outputs: list) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def live_seqs(engine: LLMEngine) -> list[Sequence]:
    return list(engine.scheduler.running) + list(engine.scheduler.waiting) + list(engine.scheduler.swapped)


def expected_output(prompt: list[int], n: int) -> list[int]:
    """The n tokens SumRunner produces after `prompt`."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(sum(tokens[-3:]) % VOCAB)
    return tokens[len(prompt) :]


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


class SumRunner:
    """Deterministic stand-in for the model runner: next token = sum of the last 3 tokens mod vocab.

    It samples exactly where the real runner does (a chunk that reaches the
    sequence's last token) and records each schedule it was given.
    """

    def __init__(self, vocab: int = VOCAB):
        self.vocab = vocab
        self.schedules: list[SchedulerOutput] = []

    def run(self, schedule: SchedulerOutput) -> list[SampledToken]:
        self.schedules.append(schedule)
        return [
            SampledToken(item.seq, sum(item.seq.token_ids[-3:]) % self.vocab, None)
            for item in schedule.scheduled
            if item.samples
        ]
