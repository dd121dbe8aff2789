"""A request's life inside the engine: its sequence state (its parameters and outputs are in `api`).

Following vLLM's counter model there is no separate prefill phase: a sequence has
`num_computed_tokens` (tokens whose keys and values are in the cache) and a
target (`num_tokens`); each step the scheduler hands it some new tokens to compute.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inference.engine.api import Lane, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    import torch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    lane: Lane = Lane.NEAR_REALTIME
    tenant_id: str | None = None

    status: SequenceStatus = SequenceStatus.WAITING
    seq_no: int = 0  # admission order, the tie-breaker between equal arrival times
    token_ids: list[int] = field(init=False)  # prompt then output
    num_computed_tokens: int = 0
    # Tokens whose keys and values the draft model (speculative "draft") has in its own cache,
    # in the same blocks: it catches up from here before it proposes.
    draft_computed_tokens: int = 0
    # Per draft position, decayed counts of passes that reached it (every draft before it was
    # accepted) and of those that accepted it: speculative.Governor's estimate of how far this
    # sequence's drafts are right.
    spec_reached: list[float] = field(default_factory=list)
    spec_accepted: list[float] = field(default_factory=list)
    spec_idle: int = 0  # steps the Governor gave it no drafts since its last verifying pass
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission that its tenant had before
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of this sequence's full, computed blocks
    swap_table: list[int] = field(default_factory=list)  # host blocks while swapped out
    num_preemptions: int = 0
    first_scheduled_at: float | None = None  # on the scheduler's clock: where its queue time ends
    # Its consumer has not taken what it generated (a client that stopped reading): it keeps
    # its blocks but is not scheduled, so a stalled stream costs other requests no compute.
    paused: bool = False
    finish_reason: str | None = None
    generator: torch.Generator | None = None  # per-request seed
    detokenizer: Any = None  # tokenizer.IncrementalDetokenizer when the engine has a tokenizer
    stop_matcher: Any = None  # stops.StopMatcher when the request has stop strings
    matcher: Any = None  # llguidance.LLMatcher when the request has a grammar (structured output)
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
