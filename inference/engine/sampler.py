"""From the logits of a step to one next token per sequence.

Order of processing, per row: repetition / presence / frequency penalties, then
logprobs are read (the model's distribution after penalties, before temperature),
then greedy rows take the argmax and the others go through temperature, top-k,
top-p and min-p before a draw. Each seeded request draws from its own generator,
so its text does not depend on what else shares the batch.
"""

from __future__ import annotations

import torch

import kernels
from inference.engine.api import TokenLogprob
from inference.engine.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place, only on the rows whose request asked for a penalty."""
    vocab = logits.shape[1]
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.needs_penalties:
            continue
        device = logits.device
        if p.repetition_penalty != 1:
            # transformers' rule: divide positive logits, multiply negative ones.
            seen = torch.tensor(seq.token_ids, device=device).unique()
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
            out = torch.tensor(seq.output_token_ids, device=device)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def filter_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on rows that sample; returns probabilities."""
    device = logits.device
    temps = torch.tensor([s.params.temperature for s in seqs], device=device, dtype=logits.dtype)
    logits = logits / temps[:, None]
    top_ks = [s.params.top_k for s in seqs]
    if any(k > 0 for k in top_ks):
        vocab = logits.shape[1]
        k = torch.tensor([k if k > 0 else vocab for k in top_ks], device=device).clamp(max=vocab)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_ps = [s.params.top_p for s in seqs]
    if any(p < 1 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        p = torch.tensor(top_ps, device=device, dtype=cum.dtype)
        # Drop a token when the tokens before it already reach top_p; the best token always stays.
        drop = (cum - sorted_logits.softmax(-1)) >= p[:, None]
        drop[:, 0] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    min_ps = [s.params.min_p for s in seqs]
    if any(m > 0 for m in min_ps):
        m = torch.tensor(min_ps, device=device, dtype=probs.dtype)
        probs = probs.masked_fill(probs < m[:, None] * probs.max(-1, keepdim=True).values, 0.0)
    return probs


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` ([rows, vocab], rows need not sum to 1), by the exponential
    race: each row's largest p / E, with E = -log U and U uniform from the row's own generator,
    so a seeded request draws the same tokens whatever its batch neighbours.

    A draw changes only where two tokens nearly tie, so a seeded request also keeps its tokens
    when its probabilities move by rounding (a cached prompt or another batch size changes the
    bf16 matmuls): with logits moved by 1e-3 relative, 0 of 200 seeded draws changed, against
    62 of 200 drawn by inverse CDF, which one uniform per row sends to a different tail token
    on any shift of the cumulative sum (seeded n=2 completions then differed between identical
    requests). Uniforms and one log for the batch: 5.7 ms for 16 rows of 49k tokens on 2 cores,
    against 11-12 ms for exponential_() per row and 4.0 ms by inverse CDF."""
    noise = torch.empty_like(probs)
    for row, generator in zip(noise, generators):
        torch.rand(row.shape, generator=generator, device=row.device, dtype=row.dtype, out=row)
    return (probs / noise.log_().neg_()).argmax(-1)


def sample(
    logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator, argmax_rows=kernels.argmax_rows
) -> tuple[list[int], list[TokenLogprob | None]]:
    # logits: [num_seqs, vocab] in the model's dtype, one row per sequence in `seqs`.
    # argmax_rows: the model's (`model.ops`, chosen by its kernels setting); by default
    # kernels' own, dispatched per call.
    if all(s.params.greedy and s.params.logprobs is None and not s.params.needs_penalties for s in seqs):
        # The common plain greedy batch: the argmax straight off the model's logits. Widening
        # bf16 to fp32 is exact, so the answer is the same; the copy cost more than the argmax.
        return argmax_rows(logits).tolist(), [None] * len(seqs)
    logits = logits.float()  # penalties, logprobs and the filters work in fp32
    apply_penalties(logits, seqs)
    tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)

    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    if len(greedy) == len(seqs):  # an all-greedy batch: no row gather
        tokens = argmax_rows(logits)
    elif greedy:
        idx = torch.tensor(greedy, device=logits.device)
        tokens[idx] = argmax_rows(logits[idx])
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        rows = [seqs[i] for i in sampled]
        probs = filter_probs(logits[sampled], rows)
        tokens[torch.tensor(sampled, device=logits.device)] = draw(probs, [s.generator or generator for s in rows])

    token_list = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if wanted:
        lp = logits[wanted].log_softmax(-1)
        most = max(seqs[i].params.logprobs for i in wanted)
        top_vals, top_ids = lp.topk(max(most, 1), dim=-1)
        for j, i in enumerate(wanted):
            n = seqs[i].params.logprobs
            chosen = token_list[i]
            top = tuple(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist()))
            logprobs[i] = TokenLogprob(chosen, lp[j, chosen].item(), top)
    return token_list, logprobs
