"""Each step's batch: who computes how many tokens, under the token and sequence budgets.

Mechanism lives here (budgets, blocks, preemption, swapping); policy (who goes
first, who is the victim) is a `Policy` that only orders sequences. A step:

1. A waiting sequence of a strictly better effective lane than the worst running one
   may preempt it when the batch or the block pool is full (priority policy only).
2. Running sequences, best first, get one decode token or their next prefill chunk.
   When one cannot get a block, the worst running sequence is preempted until it can.
   Running batch (P2) work sits this step out when an interactive request has just
   arrived and can be admitted now (priority policy only): the step that prefills it
   carries no batch decodes, so batch traffic barely delays interactive first tokens.
   So do a crowd's: the running sequences of a tenant that runs many (crowd_sit_out_seqs)
   when another tenant's request of that lane or a better one has just arrived, for at most
   one part in crowd_sit_out_every of the engine's time and never two steps in a row, so a
   tenant's many streams within its tier neither slow other tenants' first tokens nor lose
   more than a share of their own time. A step of such rows alone in flight when the
   request arrives is abandoned between layers (LLMEngine._watch, makes_way).
   Sitting out keeps every block; the work runs again the next step.
3. Swapped and waiting sequences, in policy order, are swapped back in or admitted
   while the budgets and the pool allow; the first that does not fit stops the rest,
   so nobody overtakes the head of the queue.

A paused sequence (its consumer stopped taking its output) is skipped everywhere: it
keeps its blocks and its place but computes nothing, and it is the first victim when a
running sequence needs a block, since it loses nothing by waiting.

Victims from lane P2 are swapped to host memory when the swap pool has room (they
resume exactly where they stopped); others are recomputed (their blocks are freed
and their tokens prefilled again, mostly from the prefix cache). Both keep their
arrival time, so a preempted request does not lose its place.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

from inference.engine.api import Lane
from inference.engine.block_manager import BlockManager
from inference.engine.config import EngineConfig
from inference.engine.sequence import Sequence, SequenceStatus
from inference.engine.speculative import Governor, propose_ngram, speculates


class Policy:
    """Orders sequences. Smaller keys go first; the running sequence with the largest
    `victim_key` is preempted first."""

    def waiting_key(self, seq: Sequence, now: float) -> tuple:
        return (seq.arrival_time, seq.seq_no)

    def victim_key(self, seq: Sequence, now: float) -> tuple:
        return (seq.arrival_time, seq.seq_no)

    def effective_lane(self, seq: Sequence, now: float) -> int:
        return seq.lane

    def preempts_for_admission(self) -> bool:
        return False

    def served(self, seq: Sequence, num_tokens: int) -> None:
        """Called with the tokens computed for `seq` in a step (fair-share accounting)."""

    def yields_to(self, running: Sequence, arrival: Sequence) -> bool:
        """Whether `running` sits out the step that admits the newly arrived `arrival`."""
        return False

    # The batch lane's rules hold under every policy: its prompts share a per-step prefill cap
    # (EngineConfig.batch_prefill_tokens), and preempted, it keeps its KV in host memory.

    def caps_prefill(self, seq: Sequence) -> bool:
        """Whether `seq`'s prompt tokens count against the step's batch prefill cap."""
        return seq.lane == Lane.BATCH

    def swaps_out(self, seq: Sequence) -> bool:
        """Whether `seq`, preempted, is swapped to host memory (else it recomputes later)."""
        return seq.lane == Lane.BATCH


class FcfsPolicy(Policy):
    """First come, first served, whatever the lane."""


class ShortestFirstPolicy(Policy):
    """Fewest tokens left to generate first: short answers are not stuck behind long ones."""

    def waiting_key(self, seq: Sequence, now: float) -> tuple:
        return (seq.params.max_tokens - seq.num_output_tokens, seq.arrival_time, seq.seq_no)

    def victim_key(self, seq: Sequence, now: float) -> tuple:
        return self.waiting_key(seq, now)


class PriorityPolicy(Policy):
    """Lanes with aging, and fair share between the tenants of a lane.

    A request's effective lane rises one level for every `aging_threshold_s` it has
    existed, so a P2 request competes as P1 after 30 s and as P0 after 60 s: no lane
    starves. Inside a lane, tenants are ordered by the tokens the engine has computed
    for them (virtual time, as in weighted fair queuing), so a tenant flooding the
    lane waits behind tenants that have had less. A tenant that falls idle and comes
    back starts from the lane's least-served backlogged tenant, not from zero, so it
    cannot claim the lane for the time it was away.
    """

    def __init__(self, aging_threshold_s: float):
        self.aging = aging_threshold_s
        self.virtual: dict[int, dict[str | None, float]] = defaultdict(dict)
        self.frontier: dict[int, float] = defaultdict(float)  # per lane: the most any tenant has had

    def effective_lane(self, seq: Sequence, now: float) -> int:
        return max(0, seq.lane - int(max(0.0, now - seq.arrival_time) // self.aging))

    def waiting_key(self, seq: Sequence, now: float) -> tuple:
        lane = self.effective_lane(seq, now)
        if lane < seq.lane:
            # Aged up: its tenant's service was counted in another lane, so it cannot be
            # compared with this lane's; it has waited longest, so it goes first here.
            return (lane, 0, 0.0, seq.arrival_time, seq.seq_no)
        return (lane, 1, self.virtual[seq.lane].get(seq.tenant_id, 0.0), seq.arrival_time, seq.seq_no)

    def victim_key(self, seq: Sequence, now: float) -> tuple:
        # Worst lane first, latest arrival first.
        return (self.effective_lane(seq, now), seq.arrival_time, seq.seq_no)

    def preempts_for_admission(self) -> bool:
        return True

    def yields_to(self, running: Sequence, arrival: Sequence) -> bool:
        # Base lanes, not aged ones: a long batch job ages up while it runs, and must still
        # make way for a chat that has just arrived.
        return running.lane == Lane.BATCH and arrival.lane < Lane.BATCH

    def served(self, seq: Sequence, num_tokens: int) -> None:
        lane = self.virtual[seq.lane]
        lane[seq.tenant_id] = served = lane.get(seq.tenant_id, 0.0) + num_tokens
        self.frontier[seq.lane] = max(self.frontier[seq.lane], served)

    def backlogged(self, seq: Sequence, backlog: list[Sequence]) -> None:
        """`seq` joins the queue: lift its tenant to the least-served backlogged peer or, when
        nobody else has work in the lane, to the most-served tenant's level. A tenant that
        arrives while the lane is idle (sixteen requests at once, say) then starts level with
        tenants served before it, not at zero, which would put it ahead of all of them for as
        many tokens as they had had."""
        lane = self.virtual[seq.lane]
        peers = [lane.get(s.tenant_id, 0.0) for s in backlog if s.lane == seq.lane and s.tenant_id != seq.tenant_id]
        lane[seq.tenant_id] = max(lane.get(seq.tenant_id, 0.0), min(peers) if peers else self.frontier[seq.lane])


def make_policy(config: EngineConfig) -> Policy:
    if config.policy == "priority":
        return PriorityPolicy(config.aging_threshold_s)
    if config.policy == "shortest_first":
        return ShortestFirstPolicy()
    return FcfsPolicy()


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # seq.num_computed_tokens when scheduled
    num_new_tokens: int  # of the sequence's own tokens
    # Speculative tokens computed after them (a decode only), which the target verifies: the
    # tokens themselves when the scheduler proposed them (ngram), else the draft model proposes
    # num_draft of them in the runner.
    num_draft: int = 0
    draft: tuple[int, ...] = ()
    # Tokens the draft model computes for it this step beyond the one it always feeds: its lag
    # (all of the prompt on the first speculative step, a token for each step that did not
    # speculate since). Counted against the step's budget like prompt tokens; a sequence whose
    # lag does not fit catches up in part, proposing nothing, until it does.
    catch_up: int = 0

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last known token, so a new token is sampled."""
        return self.start + self.num_new_tokens == self.seq.num_tokens

    @property
    def num_query_tokens(self) -> int:
        """What the model computes for it this step: its new tokens and the draft."""
        return self.num_new_tokens + self.num_draft


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]
    num_batched_tokens: int
    num_prefix_hit_tokens: int  # prompt tokens admitted this step straight from the prefix cache
    cache_entered: tuple[int, ...] = ()  # blocks keyed ahead of this step's compute
    swap_out: tuple[tuple[int, int], ...] = ()  # (device block, host block) copies, made before the forward
    swap_in: tuple[tuple[int, int], ...] = ()  # (host block, device block) copies, made after swap_out
    timed_out: tuple[Sequence, ...] = ()  # waited past their lane's queue timeout; the engine fails them

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class _Step:
    """What one schedule() call has done so far."""

    budget: int
    batch_prefill: int  # what is left of the step's prompt tokens for batch (P2) work
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swaps: int = 0
    starved: bool = False  # a running sequence had to preempt to get a block: admit nobody
    tenant_seqs: Counter = field(default_factory=Counter)  # tenant -> its sequences in the step
    tenant_prefill: Counter = field(default_factory=Counter)  # tenant -> its prompt tokens in the step


_seq_counter = itertools.count()


@dataclass(frozen=True)
class _Newcomer:
    """What Scheduler._crowds reads of a request not yet added (LLMEngine's step watch)."""

    tenant_id: str | None
    lane: int


# The most a crowd may sit out at once after a quiet while (see Scheduler._credit): a few
# newcomers' steps, never two in a row.
CROWD_SIT_OUT_CREDIT_S = 0.1


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config
        self.clock = clock
        self.block_manager = block_manager
        self.policy = policy or make_policy(config)
        # The draft length that pays, by measured step times (None: always num_speculative_tokens).
        adaptive = config.speculative != "off" and config.speculative_adaptive
        self.governor = Governor(config.num_speculative_tokens) if adaptive else None
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.preemptions = {"recompute": 0, "swap": 0}
        self._sat_out_in_vain: Sequence | None = None
        self._step_no = 0
        self._crowd_sat_out: dict[str | None, int] = {}  # tenant -> the step it last sat out as a crowd
        # tenant -> (seconds of steps it may still sit out as a crowd, as of when): see _credit.
        self._sit_out_credit: dict[str | None, tuple[float, float]] = {}
        self._sitting_crowds: frozenset = frozenset()  # the crowds sitting out the step last scheduled

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    def add(self, seq: Sequence) -> None:
        seq.seq_no = next(_seq_counter)
        seq.status = SequenceStatus.WAITING
        if isinstance(self.policy, PriorityPolicy):
            self.policy.backlogged(seq, self.waiting + self.running + self.swapped)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def queue(self, status: SequenceStatus) -> list[Sequence]:
        return {SequenceStatus.WAITING: self.waiting, SequenceStatus.RUNNING: self.running, SequenceStatus.SWAPPED: self.swapped}[status]

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the queues and free its blocks (finished, aborted or failed)."""
        if seq.status is not SequenceStatus.FINISHED:
            self.queue(seq.status).remove(seq)
        self.block_manager.free(seq)
        self.block_manager.free_swapped(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = self.clock() if now is None else now
        self._step_no += 1
        cap = self.config.batch_prefill_tokens
        step = _Step(budget=self.config.max_num_batched_tokens, batch_prefill=cap or self.config.max_num_batched_tokens)
        timed_out = self._expire_waiting(now)
        policy = self.policy
        self.running.sort(key=lambda s: policy.victim_key(s, now))
        if policy.preempts_for_admission():
            self._preempt_for_better_lanes(now, step)
        head, sitting_out, crowds = self._sitting_out(now, step)
        self._sitting_crowds = crowds
        self._schedule_running(now, step, sitting_out, self._speculation_width())

        bm = self.block_manager
        entered = [b for s in step.scheduled for b in bm.commit_blocks(s.seq, s.start + s.num_new_tokens)]
        hit_tokens = 0
        if not step.starved:  # running work is short of blocks: bringing more in would thrash
            candidates = sorted((s for s in self.swapped + self.waiting if not s.paused),
                                key=lambda s: policy.waiting_key(s, now))
            for seq in candidates:
                if step.budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                if sitting_out and (policy.yields_to(seq, head) or seq.tenant_id in crowds):
                    continue  # the step that admits the new arrival stays free of what made way for it
                if self._crowd_room(seq, step) == 0:
                    continue  # its tenant's crowd has had its prompt tokens this step: others may not
                if seq.status is SequenceStatus.SWAPPED:
                    if not self._swap_in(seq, step):
                        break
                else:
                    admitted = self._admit(seq, step)
                    if admitted is None:
                        break
                    if seq.first_scheduled_at is None:
                        seq.first_scheduled_at = now
                    hit_tokens += admitted
                    entered += bm.commit_blocks(seq, step.scheduled[-1].start + step.scheduled[-1].num_new_tokens)

        if sitting_out and head.status is SequenceStatus.WAITING:
            self._sat_out_in_vain = head  # never again for this one: no step is given up twice
        for item in step.scheduled:
            policy.served(item.seq, item.num_new_tokens)
        return SchedulerOutput(
            scheduled=tuple(step.scheduled),
            preempted=tuple(step.preempted),
            num_batched_tokens=self.config.max_num_batched_tokens - step.budget,
            num_prefix_hit_tokens=hit_tokens,
            cache_entered=tuple(entered),
            swap_out=tuple(step.swap_out),
            swap_in=tuple(step.swap_in),
            timed_out=tuple(timed_out),
        )

    # -- the parts of a step ---------------------------------------------------------------

    def _expire_waiting(self, now: float) -> list[Sequence]:
        limits = self.config.lane_queue_timeout_s
        # Only requests never served: a preempted one is waiting again but was not left waiting.
        expired = [s for s in self.waiting if s.num_preemptions == 0 and now - s.arrival_time > limits[s.lane]]
        for seq in expired:
            self.finish(seq, "error")
        return expired

    def _sitting_out(self, now: float, step: _Step) -> tuple[Sequence | None, frozenset[Sequence], frozenset]:
        """The head of the queue, the running sequences that make way for it this step, and
        the crowded tenants among their owners: only for a request that has just arrived and
        gets in now (otherwise sitting out would only slow the batch down)."""
        nobody = None, frozenset(), frozenset()
        if not self.waiting or not self.running:
            return nobody
        head = min((s for s in self.swapped + self.waiting if not s.paused),
                   key=lambda s: self.policy.waiting_key(s, now), default=None)
        if head is None:
            return nobody
        if (head.status is not SequenceStatus.WAITING or head.num_preemptions or head is self._sat_out_in_vain
                or len(self.running) >= self.config.max_num_seqs):
            return nobody
        crowds = self._crowds(head, now)
        yielding = frozenset(s for s in self.running if self.policy.yields_to(s, head)
                             or (s.tenant_id in crowds and s.lane >= head.lane))
        if not yielding:
            return nobody
        bm = self.block_manager
        prefix = bm.find_cached_prefix(head)
        num_new = min(head.num_tokens - prefix.num_tokens(bm.block_size), step.budget)
        if not bm.can_allocate(head, num_new, prefix):
            return nobody
        for tenant in crowds:
            self._crowd_sat_out[tenant] = self._step_no
        if len(self._crowd_sat_out) > 1024:  # only the last step matters, and a credit short of full
            self._crowd_sat_out = {t: n for t, n in self._crowd_sat_out.items() if self._step_no - n < 2}
            self._sit_out_credit = {t: c for t, c in self._sit_out_credit.items()
                                    if self._credit(t, now) < CROWD_SIT_OUT_CREDIT_S}
        return head, yielding, crowds

    def _crowds(self, head: Sequence, now: float) -> frozenset:
        """Tenants other than `head`'s running at least crowd_sit_out_seqs sequences, more than
        `head`'s tenant runs, that did not sit out the last step and have time left to give."""
        least = self.config.crowd_sit_out_seqs
        if not least or not isinstance(self.policy, PriorityPolicy):
            return frozenset()
        counts = Counter(s.tenant_id for s in self.running if s.lane >= head.lane)
        theirs = sum(1 for s in self.running if s.tenant_id == head.tenant_id)
        return frozenset(t for t, n in counts.items() if t != head.tenant_id and n >= least and n > theirs
                         and self._step_no - self._crowd_sat_out.get(t, -2) >= 2 and self._credit(t, now) > 0)

    def _credit(self, tenant, now: float) -> float:
        """Seconds of steps `tenant`'s crowd may still sit out: a bucket that fills at one second
        in crowd_sit_out_every of the engine's clock, up to CROWD_SIT_OUT_CREDIT_S, and that each
        step it sits out empties by the step's length (sitting_out_took). Counted in time, not
        steps: the newcomer's step is short (one prompt) and the crowd's long (16 decodes: 40 ms
        against 15 on a 2-core Zen 4), and one step in four let a tenant's short chats arriving
        every ~2.5 crowd steps sit out every other one, the rest waiting for a crowd's step
        and then sharing one (issue 24's n fan-out, stalled readers)."""
        credit, at = self._sit_out_credit.get(tenant, (CROWD_SIT_OUT_CREDIT_S, now))
        return min(CROWD_SIT_OUT_CREDIT_S, credit + max(0.0, now - at) / self.config.crowd_sit_out_every)

    def sitting_out_took(self, seconds: float, now: float, crowds: frozenset | None = None) -> None:
        """The step last scheduled took `seconds`: the crowds that sat it out (or `crowds`, whose
        step was abandoned for a newcomer) gave that up."""
        for tenant in self._sitting_crowds if crowds is None else crowds:
            self._sit_out_credit[tenant] = (self._credit(tenant, now) - seconds, now)
        self._sitting_crowds = frozenset()

    def makes_way(self, schedule: SchedulerOutput, tenant, lane: int, now: float, spent: float = 0.0) -> frozenset | None:
        """The crowds among `schedule`'s rows if every row would sit out the step that admits a
        request of `tenant` in `lane` arriving now (a crowd of another tenant with more time left
        to give than the `spent` seconds of the step abandoned for it, so that it can still sit
        out the newcomer's step; or batch work before an interactive request), else None."""
        if not isinstance(self.policy, PriorityPolicy) or len(self.running) >= self.config.max_num_seqs:
            return None
        newcomer = _Newcomer(tenant, lane)
        crowds = self._crowds(newcomer, now)
        for item in schedule.scheduled:
            seq = item.seq
            if not ((seq.tenant_id in crowds and seq.lane >= lane) or self.policy.yields_to(seq, newcomer)):
                return None
        making_way = frozenset(item.seq.tenant_id for item in schedule.scheduled) & crowds
        if any(self._credit(t, now) <= spent for t in making_way):
            return None
        return making_way

    def _speculation_width(self) -> int:
        """Draft tokens a decoding sequence may propose this step: 0 when speculation is off, or
        when more sequences decode than speculative_max_batch (a compute-bound batch); else
        num_speculative_tokens, or with speculative_adaptive what the governor expects to pay."""
        config = self.config
        if config.speculative == "off":
            return 0
        decoding = [s for s in self.running if not s.paused and s.num_computed_tokens == s.num_tokens - 1]
        if len(decoding) > config.speculative_max_batch:
            return 0
        return self.governor.width(decoding) if self.governor is not None else config.num_speculative_tokens

    def _draft(self, seq: Sequence, width: int, step: _Step) -> tuple[tuple[int, ...], int]:
        """`seq`'s proposal for this decode step, cut to what its max_tokens, the step's budget
        and the free blocks allow (speculation never preempts anyone), and the draft model's
        catch-up (ScheduledSeq.catch_up). The catch-up is charged like prompt tokens: to the
        step's budget and, for a crowd, to its prompt tokens (crowd_prefill_tokens), so thirty
        sequences that start speculating together no longer feed their whole prompts to the
        draft model in one step (seconds on 2 cores, every abort waiting for it)."""
        room = min(width, seq.params.max_tokens - seq.num_output_tokens - 1, step.budget - 1)
        if room <= 0 or not speculates(seq):
            return (), 0
        if self.config.speculative == "ngram":
            draft, lag = propose_ngram(seq.token_ids, room, self.config.ngram_min), 0
        else:
            # A draft model proposes in the runner, always all it may: reserve room for them.
            lag = max(0, seq.num_tokens - 1 - seq.draft_computed_tokens)
            crowd = self._crowd_room(seq, step)
            lag_room = step.budget - 1 if crowd is None else min(step.budget - 1, crowd)
            draft = [0] * room if lag + room <= lag_room else []
        while draft and not self.block_manager.can_allocate(seq, 1 + len(draft)):
            draft.pop()
        if draft or not lag:
            return tuple(draft), lag
        return (), min(lag, lag_room)

    def _schedule_running(self, now: float, step: _Step, sitting_out: frozenset[Sequence] = frozenset(),
                          width: int = 0) -> None:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and step.budget > 0:
            seq = self.running[i]
            num_new = self._chunk(seq, seq.num_computed_tokens, step)
            if seq.paused or seq in sitting_out or num_new == 0:
                i += 1
                continue
            decoding = num_new == 1 and seq.num_computed_tokens == seq.num_tokens - 1
            draft, catch_up = self._draft(seq, width, step) if width and decoding else ((), 0)
            if draft and bm.allocate(seq, 1 + len(draft)):
                tokens = draft if self.config.speculative == "ngram" else ()
                self._take(step, ScheduledSeq(seq, seq.num_computed_tokens, 1, len(draft), tokens, catch_up))
                i += 1
                continue
            while not bm.allocate(seq, num_new):
                victim = self._victim(seq)
                if self.running.index(victim) < i:
                    i -= 1  # a paused one already passed over: seq moves up a place
                self._preempt(victim, step)
                step.starved = True
                if victim is seq:
                    break
            else:
                self._take(step, ScheduledSeq(seq, seq.num_computed_tokens, num_new, catch_up=0 if draft else catch_up))
                i += 1

    def _victim(self, needy: Sequence) -> Sequence:
        """Who gives up its blocks for `needy`: the worst paused sequence (it waits for its
        consumer anyway), else the worst running one, which is not scheduled yet this step."""
        return next((s for s in reversed(self.running) if s.paused and s is not needy), self.running[-1])

    def _chunk(self, seq: Sequence, start: int, step: _Step) -> int:
        """Tokens `seq` computes this step from `start`: its rest, within the step's budget
        and, for batch work's prompt tokens, within what is left of their cap."""
        num_new = min(seq.num_tokens - start, step.budget)
        if num_new > 1 and self.policy.caps_prefill(seq):
            num_new = min(num_new, step.batch_prefill)
        if num_new > 1:
            room = self._crowd_room(seq, step)
            if room is not None:
                num_new = min(num_new, room)
        return num_new

    def _crowd_room(self, seq: Sequence, step: _Step) -> int | None:
        """Prompt tokens `seq`'s tenant may still compute this step when it is a crowd in it
        (crowd_prefill_tokens); None when no cap applies."""
        cap, least = self.config.crowd_prefill_tokens, self.config.crowd_sit_out_seqs
        if (not cap or not least or seq.tenant_id is None or not isinstance(self.policy, PriorityPolicy)
                or step.tenant_seqs[seq.tenant_id] < least):
            return None
        return max(0, cap - step.tenant_prefill[seq.tenant_id])

    def _take(self, step: _Step, item: ScheduledSeq) -> None:
        step.scheduled.append(item)
        step.budget -= item.num_query_tokens + item.catch_up
        step.tenant_seqs[item.seq.tenant_id] += 1
        if item.num_new_tokens > 1:  # a prompt chunk (or a preempted sequence's recompute)
            step.tenant_prefill[item.seq.tenant_id] += item.num_new_tokens
        step.tenant_prefill[item.seq.tenant_id] += item.catch_up
        if item.num_new_tokens > 1 and self.policy.caps_prefill(item.seq):
            step.batch_prefill -= item.num_new_tokens

    def _preempt_for_better_lanes(self, now: float, step: _Step) -> None:
        """Let the best waiting request push out running work of a strictly worse lane."""
        if not self.waiting or not self.running:
            return
        policy, bm = self.policy, self.block_manager
        head = min((s for s in self.waiting if not s.paused), key=lambda s: policy.waiting_key(s, now), default=None)
        if head is None:
            return
        lane = policy.effective_lane(head, now)
        if policy.effective_lane(self.running[-1], now) <= lane:
            return  # nobody running is worse off: skip hashing the head's prompt (the common case)
        prefix = bm.find_cached_prefix(head)
        num_new = min(head.num_tokens - prefix.num_tokens(bm.block_size), step.budget)
        while self.running and (len(self.running) >= self.config.max_num_seqs or not bm.can_allocate(head, num_new, prefix)):
            victim = self.running[-1]
            if policy.effective_lane(victim, now) <= lane:
                return
            self._preempt(victim, step)

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        self.running.remove(seq)
        step.preempted.append(seq)
        bm = self.block_manager
        seq.num_preemptions += 1
        if self.policy.swaps_out(seq) and step.swaps < self.config.max_swaps_per_step and bm.can_swap_out(seq):
            # Batch work keeps its computed keys and values in host memory and resumes exactly there.
            step.swap_out += bm.swap_out(seq)
            step.swaps += 1
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.preemptions["swap"] += 1
        else:
            # Recompute: the sequence keeps its tokens and arrival time and prefills again.
            bm.free(seq)
            seq.num_computed_tokens = seq.draft_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)
            self.preemptions["recompute"] += 1

    def _swap_in(self, seq: Sequence, step: _Step) -> bool:
        if step.swaps >= self.config.max_swaps_per_step:
            return False
        bm = self.block_manager
        num_new = self._chunk(seq, seq.num_computed_tokens, step)
        if num_new == 0:
            return False
        # Room for the swapped blocks and this step's tokens, checked before anything moves.
        if bm.blocks_needed(seq.num_computed_tokens + num_new) > bm.num_free_blocks:
            return False
        step.swap_in += bm.swap_in(seq)
        if not bm.allocate(seq, num_new):
            raise RuntimeError("swap-in lost its blocks between the check and the allocation")
        step.swaps += 1
        self.swapped.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._take(step, ScheduledSeq(seq, seq.num_computed_tokens, num_new))
        return True

    def _admit(self, seq: Sequence, step: _Step) -> int | None:
        """Admit a waiting sequence; returns its prefix-cache hit tokens, None if it does not fit."""
        bm = self.block_manager
        prefix = bm.find_cached_prefix(seq)
        cached = prefix.num_tokens(bm.block_size)
        num_new = self._chunk(seq, cached, step)
        if num_new == 0 or not bm.allocate(seq, num_new, prefix):
            return None
        self.waiting.remove(seq)
        seq.num_computed_tokens = cached
        if seq.num_output_tokens == 0:
            # What the tenant is told (usage.cached_tokens); the hit itself may be larger.
            seq.num_cached_tokens = prefix.num_known_tokens(bm.block_size)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._take(step, ScheduledSeq(seq, cached, num_new))
        return cached
