"""Structured output: a request's tokens held to a grammar, so what it generates always parses.

The grammar engine is llguidance (MIT, no dependencies, a Rust core): it computes the set of
tokens that keep the output inside the grammar from the tokens so far, lazily and on the CPU
(tens of microseconds a token for JSON), for JSON schemas, any JSON object, Lark and regular
expressions, and it fills a batch's masks on its own threads with the GIL released.

- `Grammars` (one per engine) turns a `Grammar` into a matcher: the llguidance tokenizer is
  built from the engine's at first use (~1 s), and a compiled grammar is kept by its key in
  a bounded LRU, each request getting a copy of the pristine one.
- `MaskJob` fills one step's masks for the sequences that sample under a grammar, on a thread
  of its own while the model computes the logits; `apply` sets every other token's logit to
  -inf before penalties, temperature and top-p.
- The engine advances a sequence's matcher with each token it samples: the grammar's end is
  `finish_reason` "stop", a dead end (no token allowed, or a token refused) is "error".

Preemption (recompute or swap) keeps a sequence's tokens, and its matcher with them: the
grammar resumes exactly where it was. Imports no Django.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.hf
import torch

from inference.engine.api import Grammar
from inference.engine.errors import InvalidRequestError
from inference.engine.grammar import LIMITS, GrammarEngineFailure, describe, grammar_text, guarded


class Grammars:
    """The matchers of one engine's requests: one tokenizer, compiled grammars cached by key."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 128):
        self.vocab_size = vocab_size
        self._hf = hf_tokenizer
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self.compiled = 0  # grammars built (cache misses), for stats and tests

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=self._eos or None)
            return self._tokenizer

    def cached(self, grammar: Grammar) -> llguidance.LLMatcher | None:
        """A fresh copy of `grammar`'s compiled matcher if one is cached, else None (no compile)."""
        with self._lock:
            pristine = self._cache.get(grammar.key)
            if pristine is None:
                return None
            self._cache.move_to_end(grammar.key)
            return guarded(pristine.deep_copy)

    def matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A fresh matcher for `grammar`: a copy of the cached compiled one, or a new compile (which
        releases the GIL: call it off the engine thread). Raises InvalidRequestError."""
        copy = self.cached(grammar)
        if copy is not None:
            return copy
        key = grammar.key
        text = grammar_text(grammar)
        try:
            pristine = guarded(llguidance.LLMatcher, self.tokenizer(), text, log_level=0,
                               limits=llguidance.LLParserLimits(**LIMITS))
        except GrammarEngineFailure as exc:
            raise InvalidRequestError(describe(str(exc)), param=grammar.param) from None
        if pristine.is_error():
            raise InvalidRequestError(describe(pristine.get_error()), param=grammar.param)
        with self._lock:
            self.compiled += 1
            self._cache[key] = pristine
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return guarded(pristine.deep_copy)


_executor = llguidance.LLExecutor()
_filler = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")


class MaskJob:
    """One step's masks for `matchers` (row i of the bitmask for matchers[i]), filled on a thread of
    their own from the moment the job is made: start it before the forward pass and `wait` after."""

    def __init__(self, matchers: list[llguidance.LLMatcher], vocab_size: int):
        # A bit a token, 32 a word, every bit set (all allowed) until filled. llguidance.torch has
        # the same two helpers but compiles a kernel with torch.compile at import, which took
        # 2.5-3 s of every engine process's start (Zen 4) for a function this engine never calls.
        self.bitmask = torch.full((len(matchers), (vocab_size + 31) // 32), -1, dtype=torch.int32)
        self.seconds = 0.0  # how long the filling took, once done
        self._future: Future = _filler.submit(self._fill, [(m, i) for i, m in enumerate(matchers)])

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int]]) -> None:
        started = time.perf_counter()
        words = self.bitmask.shape[1]
        guarded(_executor.unsafe_compute_mask_ptr, rows, self.bitmask.data_ptr(), words * 4, len(rows))
        self.seconds = time.perf_counter() - started

    def wait(self) -> torch.Tensor:
        self._future.result()
        return self.bitmask


# Byte value -> the additive bias of its 8 tokens (bit i of a byte is its i-th token): 0 where
# allowed, -inf where not. A bitmask viewed as bytes indexes it in one embedding lookup; on 2
# cores, for 64 rows of 49,152 tokens, 0.6 ms to build and 0.3 ms to add, against 12 ms for
# unpacking bits and masked_fill (masked_fill alone: 6 ms).
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()
_BIAS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _bias_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    table = _BIAS.get((dtype, device))
    if table is None:
        table = _BIAS[(dtype, device)] = torch.zeros(256, 8, dtype=dtype).masked_fill_(~_BYTE_BITS, float("-inf")).to(device)
    return table


def apply(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: in each of `rows` of logits (row i for bitmask row i), -inf for every token the
    bitmask forbids.

    A row that allows nothing (the grammar is at a dead end) is left as it is: its sampled token
    is then refused by the matcher, which ends the request with an error, and no row of the
    batch becomes NaN."""
    vocab = logits.shape[1]
    bitmask = bitmask.to(logits.device)
    # Little-endian int32 words viewed as bytes: byte t // 8 holds token t at bit t % 8.
    bias = torch.nn.functional.embedding(bitmask.view(torch.uint8).int(), _bias_table(logits.dtype, logits.device))
    bias = bias.reshape(len(rows), -1)[:, :vocab]
    dead = ~(bitmask != 0).any(1)
    if bool(dead.any()):
        bias[dead] = 0
    if rows == list(range(logits.shape[0])):
        logits.add_(bias)
    else:
        logits.index_add_(0, torch.tensor(rows, device=logits.device), bias)
