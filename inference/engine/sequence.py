"""A request's life inside the engine: its parameters, its sequence state, its outputs.

Following vLLM's counter model there is no separate prefill phase: a sequence has
`num_computed_tokens` (tokens whose keys and values are in the cache) and a
target (`num_tokens`); each step the scheduler hands it some new tokens to compute.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from inference.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
LANES = (0, 1, 2)
# Hard ceilings whatever a caller passes (the API's own bounds are lower, in its settings): the
# stop matcher's tables cost the stops' total length once per request, and every sampled token
# is looked up in stop_token_ids.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 65_536  # all stop strings of a request together
MAX_STOP_TOKEN_IDS = 1024


def _check(ok: bool, message: str, param: str) -> None:
    # Not `assert`: validation of user input must survive `python -O`.
    if not ok:
        raise InvalidRequestError(message, param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens, as in transformers
    presence_penalty: float = 0.0  # over output tokens, as in the OpenAI API
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per sampled token; 0 = the token's own only
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens must be an integer of at least 1", "max_tokens")
        _check(_is_number(self.temperature) and 0 <= self.temperature <= 100, "temperature must be between 0 and 100", "temperature")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p must be greater than 0 and at most 1", "top_p")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k must be -1, 0 (disabled) or a positive integer", "top_k")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p must be between 0 and 1", "min_p")
        _check(_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 10, "repetition_penalty must be in (0, 10]", "repetition_penalty")
        _check(_is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty must be between -2 and 2", "presence_penalty")
        _check(_is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty must be between -2 and 2", "frequency_penalty")
        _check(self.seed is None or _is_int(self.seed), "seed must be an integer", "seed")
        _check(len(self.stop) <= MAX_STOP_SEQUENCES, f"at most {MAX_STOP_SEQUENCES} stop sequences", "stop")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop sequences must be non-empty strings", "stop")
        _check(sum(map(len, self.stop)) <= MAX_STOP_CHARS, f"stop sequences hold at most {MAX_STOP_CHARS} characters together", "stop")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", "stop_token_ids")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers", "stop_token_ids")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos must be a boolean", "ignore_eos")
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs must be between 0 and {MAX_LOGPROBS}",
            "logprobs",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob) best first


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request: a delta, never the whole text so far."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    lane: int = 1  # 0 realtime, 1 near-realtime, 2 batch
    tenant_id: str | None = None

    status: SequenceStatus = SequenceStatus.WAITING
    seq_no: int = 0  # admission order, the tie-breaker between equal arrival times
    token_ids: list[int] = field(init=False)  # prompt then output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission that its tenant had before
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of this sequence's full, computed blocks
    swap_table: list[int] = field(default_factory=list)  # host blocks while swapped out
    num_preemptions: int = 0
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    detokenizer: Any = None  # tokenizer.IncrementalDetokenizer when the engine has a tokenizer
    stop_matcher: Any = None  # stops.StopMatcher when the request has stop strings
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    text_sent: int = 0  # characters of the detokenized output already released

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
