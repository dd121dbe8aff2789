"""Turns a scheduled batch into flat tensors, runs the model and samples.

The schedule is all the runner sees. Sequences with a single new token go first,
so attention can treat them as one batched decode.
"""

from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass

import torch

from inference.engine.models.llama import LlamaModel
from inference.engine import speculative, structured
from inference.engine.sampler import filter_probs, sample
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


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int = 0, num_swap_blocks: int = 0):
        cfg = model.config
        self.model = model
        self.device = model.device
        if self.device.type == "cpu":
            keep_freed_memory()
        self.block_size = block_size
        # One allocation for the whole cache: [layers, k/v, blocks, block_size, kv_heads, head_dim].
        self.kv_cache = torch.zeros(
            cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=self.device
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        # Host memory for swapped-out sequences, same layout; pinned on CUDA for fast copies.
        # Not zeroed: only blocks written by a swap-out are ever read back.
        self.swap_cache = torch.empty(
            cfg.num_layers, 2, num_swap_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            dtype=model.dtype, pin_memory=self.device.type == "cuda",
        )
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # Structured output: steps that filled grammar masks, the time the masks took on their own
        # thread, and the part of it the step waited for after the forward pass.
        self.masked_steps = 0
        self.mask_s = 0.0
        self.mask_wait_s = 0.0

    def swap(self, schedule: SchedulerOutput) -> None:
        """Copy swapped-out blocks to host, then swapped-in blocks back, before the forward
        pass can overwrite a block the scheduler has just released."""
        if schedule.swap_out:
            src, dst = zip(*schedule.swap_out)
            self.swap_cache[:, :, list(dst)] = self.kv_cache[:, :, list(src)].to("cpu")
        if schedule.swap_in:
            src, dst = zip(*schedule.swap_in)
            self.kv_cache[:, :, list(dst)] = self.swap_cache[:, :, list(src)].to(self.device)

    def run(self, schedule: SchedulerOutput) -> list[SampledToken]:
        """Compute the schedule; the tokens sampled, in order, one per sampling sequence, or
        1 to k + 1 for a sequence that speculated k draft tokens."""
        self.swap(schedule)
        if not schedule.scheduled:
            return []
        # Grammar masks depend only on the tokens so far: they fill while the model runs.
        constrained = [item.seq for item in schedule.scheduled if item.samples and item.seq.matcher is not None]
        masks = structured.MaskJob([s.matcher for s in constrained], self.model.config.vocab_size) if constrained else None
        items, rows, logits = self._logits(schedule)
        if masks is not None:
            self._apply_masks(masks, constrained, {id(item.seq): row for item, row in zip(items, rows)}, logits)
        if not items:
            return []
        plain = [i for i, item in enumerate(items) if not item.draft]
        out: dict[int, list[SampledToken]] = {}
        with torch.inference_mode():  # the logits are inference tensors; penalties edit them in place
            if plain:
                seqs = [items[i].seq for i in plain]
                picked = logits if len(plain) == len(logits) else logits[[rows[i] for i in plain]]
                tokens, logprobs = sample(picked, seqs, self.generator, self.model.ops.argmax_rows)
                for i, seq, t, lp in zip(plain, seqs, tokens, logprobs):
                    out[i] = [SampledToken(seq, t, lp)]
            if len(plain) < len(items):
                out.update(self._verify(items, rows, logits))
        return [token for i in range(len(items)) for token in out[i]]

    def _verify(self, items: list[ScheduledSeq], rows: list[int], logits: torch.Tensor) -> dict[int, list[SampledToken]]:
        """The tokens each speculating item emits, by the target's logits at its 1 + k rows."""
        out = {}
        spec = [i for i, item in enumerate(items) if item.draft]
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
            q = speculative.point_mass(list(item.draft), vocab, logits.device)
            out[i] = speculative.verify(p, q, list(item.draft), seq.generator or self.generator)
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
        items, _, logits = self._logits(schedule)
        return [item.seq for item in items], logits

    def _logits(self, schedule: SchedulerOutput) -> tuple[list[ScheduledSeq], list[int], torch.Tensor]:
        """Run the model on the schedule: the items that sample, the row of each one's first
        logits, and the logits ([rows, vocab], in the model's dtype): one row per item, or
        1 + k for an item with k draft tokens (the target's next-token logits at each)."""
        items = sorted(schedule.scheduled, key=lambda s: s.num_query_tokens != 1)  # decodes first, stable
        inputs, ends = self._prepare(items)
        hidden = self.model(*inputs)
        sampling = [i for i, s in enumerate(items) if s.samples]
        if not sampling:
            return [], [], hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        positions, rows = [], []
        for i in sampling:
            rows.append(len(positions))
            positions.extend(range(ends[i] - 1 - len(items[i].draft), ends[i]))
        idx = torch.tensor(positions, device=self.device)
        return [items[i] for i in sampling], rows, self.model.compute_logits(hidden[idx])

    def _prepare(self, items: list[ScheduledSeq]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for item in items:
            seq, start, end = item.seq, item.start, item.start + item.num_query_tokens
            table = seq.block_table
            input_ids.extend(seq.token_ids[start : item.start + item.num_new_tokens])
            input_ids.extend(item.draft)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(end - start)
            seq_lens.append(end)
            tables.append(table)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        dev = self.device
        meta = PagedAttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            num_decodes=sum(1 for q in query_lens if q == 1),
            query_lens_host=tuple(query_lens),
            seq_lens_host=tuple(seq_lens),
        )
        inputs = (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            torch.tensor(slots, dtype=torch.long, device=dev),
            meta,
            self.kv_caches,
        )
        return inputs, starts[1:]
