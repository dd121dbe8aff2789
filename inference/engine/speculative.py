"""Speculative decoding: cheap guesses of a sequence's next tokens, and the exact test the
target's probabilities put them to.

A decoding sequence proposes up to k draft tokens: by prompt lookup (`propose_ngram`, in the
scheduler) or from a draft model (`model_runner.Drafter`, in the runner, into the k slots the
scheduler reserved). The scheduler gives it 1 + k query tokens in the step, the runner returns the target's
logits at all 1 + k positions, and `verify` keeps the longest run the target agrees with plus
one token of its own, so a step emits 1 to k + 1 tokens.

`verify` is rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft token x_i,
drawn from q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)); the first rejection
draws from norm(max(0, p_i - q_i)); when all k are accepted a bonus token comes from p_k. Each
emitted token is then distributed exactly as p, whatever q was. For prompt lookup q is a point
mass on the proposal: accept with probability p(x), else draw from p without x. Greedy rows
accept while the draft equals the argmax and emit the argmax where it first differs, which is
token for token what decoding without speculation emits.
"""

from __future__ import annotations

from array import array

import torch

from inference.engine.config import NGRAM_MAX  # the longest suffix looked up; shorter ones, down to ngram_min, when it is not found
from inference.engine.sampler import draw
from inference.engine.sequence import Sequence

# Only the last tokens are searched, which bounds a proposal's cost: 0.16 ms a sequence for a
# 4,096-token window, hit or miss (2-core EPYC, 5,000 random token ids).
NGRAM_WINDOW = 4096


def propose_ngram(token_ids: list[int], k: int, n_min: int = 1, n_max: int = NGRAM_MAX,
                  window: int = NGRAM_WINDOW) -> list[int]:
    """The up to k tokens that followed the latest earlier occurrence of the last n tokens
    (n from n_max down to n_min) within the last `window` tokens; [] when none recurs."""
    tokens = array("q", token_ids[-window:])
    length = len(tokens)
    haystack = tokens[:-1].tobytes()  # an occurrence must have a token after it
    width = tokens.itemsize
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        needle = tokens[-n:].tobytes()
        # bytes.rfind runs in C (a Python loop over the window cost ~1 ms a sequence); a hit
        # off a token boundary is a false one, so look again to its left.
        end = len(haystack)
        while (at := haystack.rfind(needle, 0, end)) >= 0:
            if at % width == 0:
                start = at // width + n
                return tokens[start : start + k].tolist()
            end = at + len(needle) - 1
    return []


def speculates(seq: Sequence) -> bool:
    """Whether `seq` may speculate: not with a grammar (each token must pass the matcher first),
    penalties (they depend on the tokens before, draft ones included) or logprobs, nor against
    the request's own opt-out."""
    p = seq.params
    return p.speculative and seq.matcher is None and not p.needs_penalties and p.logprobs is None


def point_mass(draft: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """q of a prompt-lookup draft: all of each position's probability on its proposed token."""
    q = torch.zeros(len(draft), vocab, device=device)
    q[torch.arange(len(draft), device=device), torch.tensor(draft, device=device)] = 1.0
    return q


def verify(p: torch.Tensor, q: torch.Tensor, draft: list[int], generator: torch.Generator) -> list[int]:
    """The tokens a sampled row emits: the accepted drafts, then a resampled or bonus token.

    p: [k + 1, vocab] the target's filtered probabilities at the k + 1 positions (rows need not
    sum to 1); q: [k, vocab] the draft's. Uniforms come from `generator` (the request's own
    when seeded), so a seeded request speculates the same way every time.
    """
    p = p / p.sum(-1, keepdim=True)
    k = len(draft)
    idx = torch.arange(k, device=p.device)
    drafted = torch.tensor(draft, device=p.device)
    ratio = (p[idx, drafted] / q[idx, drafted]).clamp(max=1.0)
    uniforms = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)
    rejected = (uniforms >= ratio).nonzero()
    accepted = int(rejected[0]) if len(rejected) else k
    if accepted == k:
        last = p[k]
    else:
        last = (p[accepted] - q[accepted]).clamp(min=0.0)
        if last.sum() <= 0:  # p == q exactly, where rejection has probability 0: rounding only
            last = p[accepted]
    # The same exponential race as a step without speculation draws with.
    return draft[:accepted] + [int(draw(last[None], [generator])[0])]


def verify_greedy(argmax: list[int], draft: list[int]) -> list[int]:
    """The tokens a greedy row emits: drafts while they equal the target's argmax, then its argmax.

    argmax: the target's choice at each of the k + 1 positions."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == argmax[accepted]:
        accepted += 1
    return argmax[: accepted + 1]
