"""Turns a scheduled batch into flat tensors, runs the model and samples.

The schedule is all the runner sees. Sequences with a single new token go first,
so attention can treat them as one batched decode.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import time
from dataclasses import dataclass, replace

import torch

from inference.engine.models.llama import LlamaModel
from inference.engine import speculative, structured
from inference.engine.sampler import draw, filter_probs, sample
from inference.engine.scheduler import ScheduledSeq, SchedulerOutput
from inference.engine.api import TokenLogprob
from inference.engine.sequence import Sequence
from kernels import PagedAttentionMetadata


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for the next step instead of handing it back to the OS.

    A step allocates the same large activations every time (a 2048-token prefill chunk's
    MLP input is 12 MB). By default glibc maps fresh pages for each such block and unmaps
    them on free, or trims the heap's top, so every step faults its activations in again:
    ~110,000 page faults and 0.9 s of system time in bench/engine_throughput.py's offline
    run, SiLU on a prefill chunk 3.2 ms instead of 1.3. With this, blocks up to 32 MB come
    from the heap and freed memory stays there (the process keeps its high-water mark, which
    the next step reuses). Returns whether it applied (glibc on Linux), once per process.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: its allocator has its own policy
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


@dataclass(frozen=True)
class SampledToken:
    seq: Sequence
    token_id: int
    logprob: TokenLogprob | None


class PagedCache:
    """A model's paged KV cache on its device and the host blocks it swaps to."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, num_swap_blocks: int):
        cfg, device = model.config, model.device
        # One allocation for the whole cache: [layers, k/v, blocks, block_size, kv_heads, head_dim].
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=device
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        # Host memory for swapped-out sequences, same layout; pinned on CUDA for fast copies.
        # Not zeroed: only blocks written by a swap-out are ever read back.
        self.swap_cache = torch.empty(
            cfg.num_layers, 2, num_swap_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=model.dtype, pin_memory=device.type == "cuda",
        )

    def swap(self, schedule: SchedulerOutput) -> None:
        """Copy swapped-out blocks to host, then swapped-in blocks back, before the forward
        pass can overwrite a block the scheduler has just released."""
        if schedule.swap_out:
            src, dst = zip(*schedule.swap_out)
            self.swap_cache[:, :, list(dst)] = self.kv_cache[:, :, list(src)].to("cpu")
        if schedule.swap_in:
            src, dst = zip(*schedule.swap_in)
            self.kv_cache[:, :, list(dst)] = self.swap_cache[:, :, list(src)].to(self.kv_cache.device)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int = 0, num_swap_blocks: int = 0,
                 draft: LlamaModel | None = None):
        """`draft`: the draft model of speculative "draft", given its own cache in the same blocks."""
        self.model = model
        self.device = model.device
        if self.device.type == "cpu":
            keep_freed_memory()
        self.block_size = block_size
        self.cache = PagedCache(model, num_blocks, block_size, num_swap_blocks)
        self.kv_cache, self.kv_caches = self.cache.kv_cache, self.cache.kv_caches
        self.drafter = Drafter(draft, num_blocks, block_size, num_swap_blocks) if draft is not None else None
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # Structured output: steps that filled grammar masks, the time the masks took on their own
        # thread, and the part of it the step waited for after the forward pass.
        self.masked_steps = 0
        self.mask_s = 0.0
        self.mask_wait_s = 0.0

    def swap(self, schedule: SchedulerOutput) -> None:
        self.cache.swap(schedule)
        if self.drafter is not None:
            self.drafter.cache.swap(schedule)

    def run(self, schedule: SchedulerOutput) -> list[SampledToken]:
        """Compute the schedule; the tokens sampled, in order, one per sampling sequence, or
        1 to k + 1 for a sequence that speculated k draft tokens."""
        self.swap(schedule)
        if not schedule.scheduled:
            return []
        # Grammar masks depend only on the tokens so far: they fill while the model runs.
        constrained = [item.seq for item in schedule.scheduled if item.samples and item.seq.matcher is not None]
        masks = structured.MaskJob([s.matcher for s in constrained], self.model.config.vocab_size) if constrained else None
        items, q = list(schedule.scheduled), {}
        if self.drafter is not None:
            with torch.inference_mode():
                items, q = self.drafter.propose(items, self.generator)
        items, rows, logits = self._logits(items)
        if masks is not None:
            self._apply_masks(masks, constrained, {id(item.seq): row for item, row in zip(items, rows)}, logits)
        if not items:
            return []
        plain = [i for i, item in enumerate(items) if not item.num_draft]
        out: dict[int, list[SampledToken]] = {}
        with torch.inference_mode():  # the logits are inference tensors; penalties edit them in place
            if plain:
                seqs = [items[i].seq for i in plain]
                picked = logits if len(plain) == len(logits) else logits[[rows[i] for i in plain]]
                tokens, logprobs = sample(picked, seqs, self.generator, self.model.ops.argmax_rows)
                for i, seq, t, lp in zip(plain, seqs, tokens, logprobs):
                    out[i] = [SampledToken(seq, t, lp)]
            if len(plain) < len(items):
                out.update(self._verify(items, rows, logits, q))
        return [token for i in range(len(items)) for token in out[i]]

    def _verify(self, items: list[ScheduledSeq], rows: list[int], logits: torch.Tensor,
                q: dict[int, torch.Tensor]) -> dict[int, list[SampledToken]]:
        """The tokens each speculating item emits, by the target's logits at its 1 + k rows.
        `q`: by id of sequence, the draft model's distributions of its sampled proposals
        (without one, the draft was prompt lookup's: a point mass)."""
        out = {}
        spec = [i for i, item in enumerate(items) if item.num_draft]
        greedy = [i for i in spec if items[i].seq.params.greedy]
        if greedy:
            spans = [range(rows[i], rows[i] + 1 + len(items[i].draft)) for i in greedy]
            argmax = self.model.ops.argmax_rows(logits[[r for span in spans for r in span]]).tolist()
            at = 0
            for i, span in zip(greedy, spans):
                out[i] = speculative.verify_greedy(argmax[at : at + len(span)], list(items[i].draft))
                at += len(span)
        vocab = logits.shape[1]
        for i in spec:
            if i in out:
                continue
            item, seq = items[i], items[i].seq
            k = len(item.draft)
            p = filter_probs(logits[rows[i] : rows[i] + k + 1].float(), [seq] * (k + 1))
            if seq.generator is not None:
                out[i] = speculative.verify_seeded(p, list(item.draft), seq.generator)
                continue
            proposal = q.get(id(seq))
            if proposal is None:
                proposal = speculative.point_mass(list(item.draft), vocab, logits.device)
            out[i] = speculative.verify(p, proposal, list(item.draft), seq.generator or self.generator)
        return {i: [SampledToken(items[i].seq, t, None) for t in tokens] for i, tokens in out.items()}

    def _apply_masks(self, masks: structured.MaskJob, constrained: list[Sequence], row_of: dict[int, int],
                     logits: torch.Tensor) -> None:
        waited = time.perf_counter()
        bitmask = masks.wait()
        self.mask_wait_s += time.perf_counter() - waited
        self.mask_s += masks.seconds
        self.masked_steps += 1
        order = sorted(range(len(constrained)), key=lambda i: row_of[id(constrained[i])])  # logits' row order
        with torch.inference_mode():
            structured.apply(logits, [row_of[id(constrained[i])] for i in order], bitmask[order])

    def compute_logits(self, schedule: SchedulerOutput) -> tuple[list[Sequence], torch.Tensor]:
        """Run the model on a schedule without drafts; logits ([n, vocab], in the model's dtype)
        only for sequences that sample."""
        items, _, logits = self._logits(list(schedule.scheduled))
        return [item.seq for item in items], logits

    def _logits(self, items: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[int], torch.Tensor]:
        """Run the model on a step's items: the items that sample, the row of each one's first
        logits, and the logits ([rows, vocab], in the model's dtype): one row per item, or
        1 + k for an item with k draft tokens (the target's next-token logits at each)."""
        items = sorted(items, key=_attention_order)  # decodes, then verifying passes, then chunks; stable
        inputs, ends = self._prepare(items)
        hidden = self.model(*inputs)
        sampling = [i for i, s in enumerate(items) if s.samples]
        if not sampling:
            return [], [], hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        positions, rows = [], []
        for i in sampling:
            rows.append(len(positions))
            positions.extend(range(ends[i] - 1 - items[i].num_draft, ends[i]))
        idx = torch.tensor(positions, device=self.device)
        return [items[i] for i in sampling], rows, self.model.compute_logits(hidden[idx])

    def _prepare(self, items: list[ScheduledSeq]):
        spans = [(it.seq, it.start, it.seq.token_ids[it.start : it.start + it.num_new_tokens] + list(it.draft)) for it in items]
        return prepare(spans, self.block_size, self.device, self.kv_caches, rowwise=[_verifying(it) for it in items])


def _verifying(item: ScheduledSeq) -> bool:
    return item.num_new_tokens == 1 and bool(item.draft)


def _attention_order(item: ScheduledSeq) -> int:
    return 0 if item.num_query_tokens == 1 else 1 if _verifying(item) else 2


class Drafter:
    """The draft model of speculative "draft": its own KV cache, indexed by the target's block
    tables, so the block manager's accounting covers both. It lags the target where a step did
    not speculate (a prefill, a full batch), and catches up before it proposes."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, num_swap_blocks: int):
        self.model = model
        self.block_size = block_size
        self.cache = PagedCache(model, num_blocks, block_size, num_swap_blocks)

    def propose(self, items: list[ScheduledSeq], generator: torch.Generator) -> tuple[list[ScheduledSeq], dict[int, torch.Tensor]]:
        """`items` with the drafts their num_draft reserved filled in, and by id of sequence the
        distributions q ([k, vocab]) the sampled ones were drawn from (greedy ones take the argmax).

        The first pass catches each sequence up to its last token (the prompt, on its first
        speculative step) and proposes from there; each further pass feeds back one proposal.
        A sequence whose catch-up did not fit the step (catch_up without num_draft) computes
        that much of its lag in the first pass and proposes nothing."""
        proposing = [i for i, item in enumerate(items) if item.num_draft and not item.draft]
        catching_up = [i for i, item in enumerate(items) if item.catch_up and not item.num_draft]
        if not proposing and not catching_up:
            return items, {}
        seqs = {i: items[i].seq for i in proposing + catching_up}
        spans = {i: (s, s.draft_computed_tokens, s.token_ids[s.draft_computed_tokens :]) for i, s in seqs.items()}
        for i in catching_up:
            seq, start, span = spans[i]
            spans[i] = (seq, start, span[: items[i].catch_up])
        drafts: dict[int, list[int]] = {i: [] for i in proposing}
        sampled = [i for i in proposing if not seqs[i].params.greedy]
        # A seeded sequence draws its proposals from a copy of its generator: the uniforms its
        # verifying pass will draw each position's token with (speculative.verify_seeded, which
        # needs no q). The others keep q for the rejection test.
        copies = {i: _copy(seqs[i].generator) for i in sampled if seqs[i].generator is not None}
        q: dict[int, list[torch.Tensor]] = {i: [] for i in sampled if i not in copies}
        live = proposing + catching_up
        while live:
            live.sort(key=lambda i: len(spans[i][2]) != 1)  # decodes first
            inputs, ends = prepare([spans[i] for i in live], self.block_size, self.model.device, self.cache.kv_caches)
            hidden = self.model(*inputs)
            picking = [(i, end) for i, end in zip(live, ends) if i in drafts]
            if picking:
                idx = torch.tensor([end - 1 for _, end in picking], device=self.model.device)
                order = [i for i, _ in picking]
                logits = self.model.compute_logits(hidden[idx])
                generators = [copies.get(i, generator) for i in order]
                for i, token in zip(order, self._pick(logits, [seqs[i] for i in order], generators, q, order)):
                    seq, start, span = spans[i]
                    drafts[i].append(token)
                    spans[i] = (seq, start + len(span), [token])
            live = [i for i in live if i in drafts and len(drafts[i]) < items[i].num_draft]
        for i in catching_up:
            items[i].seq.draft_computed_tokens += items[i].catch_up
        for i in proposing:
            # Its last proposal's keys and values were never computed: it was not fed back.
            seqs[i].draft_computed_tokens = seqs[i].num_tokens + items[i].num_draft - 1
            items[i] = replace(items[i], draft=tuple(drafts[i]))
        return items, {id(seqs[i]): torch.stack(rows) for i, rows in q.items()}

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence], generators: list[torch.Generator],
              q: dict[int, list[torch.Tensor]], order: list[int]) -> list[int]:
        """One proposal per row: the argmax for greedy sequences, else a draw from the draft's
        filtered distribution with the row's generator (kept in `q` where the rejection test needs it)."""
        tokens = self.model.ops.argmax_rows(logits).tolist()
        sampled = [j for j, seq in enumerate(seqs) if not seq.params.greedy]
        if sampled:
            probs = filter_probs(logits[sampled].float(), [seqs[j] for j in sampled])
            probs = probs / probs.sum(-1, keepdim=True)
            drawn = draw(probs, [generators[j] for j in sampled]).tolist()
            for row, j in enumerate(sampled):
                tokens[j] = drawn[row]
                if order[j] in q:
                    q[order[j]].append(probs[row])
        return tokens


def _copy(generator: torch.Generator) -> torch.Generator:
    """Another generator in the same state: its draws are the ones `generator` will make next."""
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return copy


def prepare(spans: list[tuple[Sequence, int, list[int]]], block_size: int, device: torch.device, kv_caches,
            rowwise: list[bool] | None = None):
    """The model's inputs for computing each (sequence, first position, token ids) span over
    `kv_caches` through the sequences' block tables, and where each span's rows end. Spans of one
    token (decodes) must come first, so attention treats them as one batched decode, then the
    `rowwise` ones: each of their tokens attends as a decode at its position would. A verifying
    pass's rows then get the bits its decodes would have (the prefill kernel sums in another
    order: in bf16, greedy output with speculation left that without it on 5 of 6 chat prompts)."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens, seq_lens, tables = [], [], []
    for i, (seq, start, token_ids) in enumerate(spans):
        end = start + len(token_ids)
        table = seq.block_table
        input_ids.extend(token_ids)
        positions.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        if rowwise is not None and rowwise[i]:
            if query_lens and query_lens[-1] != 1:
                raise ValueError("rowwise spans must come before every prompt chunk")
            query_lens.extend([1] * (end - start))
            seq_lens.extend(range(start + 1, end + 1))
            tables.extend([table] * (end - start))
            continue
        query_lens.append(end - start)
        seq_lens.append(end)
        tables.append(table)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = PagedAttentionMetadata.of(query_lens, seq_lens, block_tables, device)
    inputs = (
        torch.tensor(input_ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        torch.tensor(slots, dtype=torch.long, device=device),
        meta,
        kv_caches,
    )
    return inputs, list(itertools.accumulate(len(token_ids) for _, _, token_ids in spans))
