"""Each step's batch: who computes how many tokens, under the token and sequence budgets.

Mechanism lives here (budgets, blocks, preemption by recompute); policy (who goes
first, who is the victim) is a `Policy` that only orders sequences. Running
sequences are served first, in policy order, one decode token or their next
prefill chunk each; then waiting sequences are admitted while the budgets and the
block pool allow. When a running sequence cannot get a block, the running
sequence that the policy ranks last is preempted (its blocks freed, its tokens
recomputed later) until it can.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

from inference.engine.block_manager import BlockManager
from inference.engine.config import EngineConfig
from inference.engine.sequence import Sequence, SequenceStatus


class Policy(Protocol):
    def key(self, seq: Sequence) -> tuple:
        """Sort key: smaller goes first, the largest running sequence is preempted first."""


class FcfsPolicy:
    def key(self, seq: Sequence) -> tuple:
        return (seq.arrival_time, seq.seq_no)


POLICIES = {"fcfs": FcfsPolicy}


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # seq.num_computed_tokens when scheduled
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last known token, so a new token is sampled."""
        return self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]
    num_batched_tokens: int
    num_prefix_hit_tokens: int  # prompt tokens admitted this step straight from the prefix cache
    cache_entered: tuple[int, ...] = ()  # blocks keyed ahead of this step's compute

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


_seq_counter = itertools.count()


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, policy: Policy | None = None):
        self.config = config
        self.block_manager = block_manager
        self.policy = policy or POLICIES[config.policy]()
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.seq_no = next(_seq_counter)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the queues and free its blocks (finished or aborted)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        self.running.sort(key=self.policy.key)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.allocate(seq, num_new):
                victim = self.running.pop()  # ranked last by the policy, not yet scheduled
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
                budget -= num_new
                i += 1

        entered = [b for s in scheduled for b in bm.commit_blocks(s.seq, s.start + s.num_new_tokens)]
        hit_tokens = 0
        if not preempted:  # a step that had to preempt has no room to admit anyone
            self.waiting.sort(key=self.policy.key)
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                prefix = bm.find_cached_prefix(seq)
                cached = prefix.num_tokens(bm.block_size)
                num_new = min(seq.num_tokens - cached, budget)
                if not bm.allocate(seq, num_new, prefix):
                    break  # first come, first served: nobody overtakes the head of the queue
                self.waiting.pop(0)
                seq.num_computed_tokens = cached
                if seq.num_output_tokens == 0:
                    seq.num_cached_tokens = cached
                hit_tokens += cached
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                scheduled.append(ScheduledSeq(seq, cached, num_new))
                entered += bm.commit_blocks(seq, cached + num_new)
                budget -= num_new

        return SchedulerOutput(
            scheduled=tuple(scheduled),
            preempted=tuple(preempted),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            num_prefix_hit_tokens=hit_tokens,
            cache_entered=tuple(entered),
        )

    def _preempt(self, seq: Sequence) -> None:
        # Recompute: the sequence keeps its tokens and its arrival time, so it goes back
        # to the head of the queue and prefills again (mostly from the prefix cache).
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.num_preemptions += 1
