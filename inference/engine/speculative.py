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
emitted token is then distributed exactly as p, whatever q was. A seeded request instead keeps
its drafts while they equal the draws it would make without speculation (`verify_seeded`), so
its seed gives the same reply with or without speculation and however wide the passes are.
For prompt lookup q is a point mass on the proposal: accept with probability p(x), else draw from p without x. Greedy rows
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


def verify_seeded(p: torch.Tensor, draft: list[int], generator: torch.Generator) -> list[int]:
    """The tokens a seeded sampled row emits: at each position the draw decoding without
    speculation makes there (the exponential race on p, the next uniforms of the request's own
    generator), the drafts kept while they equal it. Each emitted token is a draw from p, as in
    `verify`, and the generator moves one draw a token, so the reply is the one the seed gives
    without speculation, whatever width the passes had. The draft's proposals came from a copy
    of the generator (`Drafter`), the same uniforms at the same positions: where its q is close
    to p the two races mostly pick alike (with q == p always).

    p: [k + 1, vocab] the target's filtered probabilities, as `sample` draws from them."""
    out: list[int] = []
    for i in range(len(draft) + 1):
        out.append(int(draw(p[i : i + 1], [generator])[0]))
        if i == len(draft) or out[-1] != draft[i]:
            break
    return out


def verify_greedy(argmax: list[int], draft: list[int]) -> list[int]:
    """The tokens a greedy row emits: drafts while they equal the target's argmax, then its argmax.

    argmax: the target's choice at each of the k + 1 positions."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == argmax[accepted]:
        accepted += 1
    return argmax[: accepted + 1]


# -- how many draft tokens pay -------------------------------------------------------------

# A pass's weight in a sequence's acceptance estimates against its history: the last ~10 passes
# dominate, so a sequence that starts or stops quoting its context is followed within a few steps.
ACCEPTANCE_DECAY = 0.9
STEP_TIME_WEIGHT = 0.2  # of a new step's duration in the running estimate for its row count
# Steps without drafts after which a sequence is given a full-width pass whatever its estimate:
# where a pass costs several steps (a draft model: 4 drafts and their verifying pass took 3.7x a
# step of the bf16 target on a 2-core AMX Xeon), even odds never pay, and a summary whose first
# two passes missed (1 of 8 drafts) decoded its other 126 tokens unspeculated, where runs that
# began well accepted 80%. At most one wasted pass in this many steps: ~8% there.
RETRY_AFTER_STEPS = 32


class Governor:
    """The step's draft length, 0 to max_width: the one that emits the most tokens per second by
    what this engine has measured. A verifying pass costs what its rows cost, and on a CPU a row
    of a pass costs nearly what a decode does (a 5-row int4 pass of SmolLM2 took 2.3x a one-row
    step on a 2-core Zen 4 EPYC), so drafts pay only when they are mostly right.

    Step times are kept per row count of decode-only steps (decodes and verifying passes, no
    prompt chunk); a row count not yet seen is interpolated between the nearest seen ones, so a
    width is tried, measured and kept or left. A sequence's drafts are judged position by
    position: how often its i-th draft was accepted when the ones before it were (decayed counts;
    before any, even odds for the first and acceptance for the rest, which are then tried). Acceptance comes in runs (a quote is taken whole or not at all: on a
    quoting summary 66% of prompt lookup's drafts were accepted, yet 3.5 tokens a pass came of 4
    drafts, where independent 66% chances give 2.6), which one rate per sequence would miss.
    While a sequence does not speculate its counts age toward even odds, so one whose drafts
    stopped paying is tried again some steps on, and after RETRY_AFTER_STEPS it is tried at
    full width whatever the estimate says."""

    def __init__(self, max_width: int):
        self.max_width = max_width
        self.step_s: dict[int, float] = {}

    def observe_step(self, rows: int, seconds: float) -> None:
        if seconds <= 0:
            return
        old = self.step_s.get(rows)
        self.step_s[rows] = seconds if old is None else old + STEP_TIME_WEIGHT * (seconds - old)

    def observe_pass(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Position i (from 0) of the draft was reached if the ones before it were accepted."""
        self._age(seq)
        seq.spec_idle = 0
        for i in range(min(accepted + 1, proposed)):
            seq.spec_reached[i] += 1
            seq.spec_accepted[i] += i < accepted

    def _age(self, seq: Sequence) -> None:
        if len(seq.spec_reached) < self.max_width:
            seq.spec_reached = [0.0] * self.max_width
            seq.spec_accepted = [0.0] * self.max_width
        for i in range(self.max_width):
            seq.spec_reached[i] *= ACCEPTANCE_DECAY
            seq.spec_accepted[i] *= ACCEPTANCE_DECAY

    def expected_tokens(self, seq: Sequence, k: int) -> float:
        """Tokens a pass over k drafts of `seq` is expected to emit: the target's own one, and
        each draft while every one before it is accepted."""
        return self._expected(seq)[k]

    def _expected(self, seq: Sequence) -> list[float]:
        """expected_tokens of `seq` for every k from 0 to max_width, in one pass."""
        totals, reach = [1.0], 1.0
        for i in range(self.max_width):
            reached = seq.spec_reached[i] if i < len(seq.spec_reached) else 0.0
            accepted = seq.spec_accepted[i] if i < len(seq.spec_accepted) else 0.0
            # Past the first, a position seldom reached is taken to be accepted whenever the one
            # before it is, until passes say otherwise: else a width once cut to 1 would never
            # widen again, its second position never tried (prompt lookup's summary sat at 1
            # draft, 1.9 tokens a pass, where 4 drafts gave 3.5).
            reach *= (accepted + (0.5 if i == 0 else 1.0)) / (reached + 1)
            totals.append(totals[-1] + reach)
        return totals

    def step_time(self, rows: int) -> float:
        """The measured time of a decode-only step of `rows` rows, or an interpolation."""
        if rows in self.step_s:
            return self.step_s[rows]
        below = sorted(r for r in self.step_s if r < rows)
        above = sorted(r for r in self.step_s if r > rows)
        if below and above:
            lo, hi = below[-1], above[0]
            return self.step_s[lo] + (self.step_s[hi] - self.step_s[lo]) * (rows - lo) / (hi - lo)
        if below:  # past the widest seen: its slope, or none (then the width is tried and measured)
            if len(below) == 1:
                return self.step_s[below[-1]]
            lo, hi = below[-2], below[-1]
            return self.step_s[hi] + max(0.0, (self.step_s[hi] - self.step_s[lo]) / (hi - lo)) * (rows - hi)
        return self.step_s[above[0]] * rows / above[0]  # narrower than any seen: at most pro rata

    def width(self, decoding: list[Sequence]) -> int:
        """Draft tokens each speculating sequence of `decoding` (the step's decoding sequences)
        proposes this step."""
        drafting = [s for s in decoding if speculates(s)]
        if not drafting:
            return 0
        if not self.step_s:
            return self.max_width  # nothing measured yet: speculate, and measure it
        plain = len(decoding) - len(drafting)
        tokens = [plain + sum(by_width) for by_width in zip(*(self._expected(s) for s in drafting))]
        rates = [tokens[k] / self.step_time(len(decoding) + k * len(drafting)) for k in range(self.max_width + 1)]
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))
        if best == 0:
            for s in drafting:
                self._age(s)
                s.spec_idle += 1
            if min(s.spec_idle for s in drafting) >= RETRY_AFTER_STEPS:
                return self.max_width
        return best
