"""Priority scheduling: lanes, aging, tenant fair share, preemption by swap or recompute,
admission control and queue timeouts.

Scheduler tests use `SumRunner` at the runner seam (next token = sum of the last 3
mod vocab), so each request's output is known in advance; the swap and recompute
parity tests use the real tiny model, since only real keys and values can show a
block copied to the wrong place. Every engine runs on a `ManualClock`: aging and
timeouts move only when a test advances it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inference.engine.errors import QueueFullError
from inference.engine.api import LaneStats, SamplingParams
from inference.engine.sequence import SequenceStatus
from tests.engine.tiny import expected_output, greedy_params as params, TINY, VOCAB, ManualClock, SumRunner, fake_runner, live_seqs, one_thread, run_to_completion, tiny_engine, tokens_of

assert one_thread  # an autouse fixture: importing it is what applies it here


def swap_bytes(num_blocks: int, block_size: int = 4) -> int:
    """swap_space_bytes for `num_blocks` host blocks of the tiny fp32 model.

    Always pass it: the 256 MiB default allocates (and zeroes) a quarter of a
    gigabyte of host memory per engine, seconds each on a busy machine.
    """
    return num_blocks * block_size * TINY.kv_bytes_per_token(torch.float32)


def fake_engine(clock: ManualClock | None = None, swap_blocks: int = 16, **kw):
    return tiny_engine(clock=clock or ManualClock(), swap_space_bytes=swap_bytes(swap_blocks, kw.get("block_size", 4)),
                       make_runner=fake_runner(SumRunner()), **kw)


def first_scheduled(engine) -> dict[str, int]:
    """Request id -> index of the first schedule (step) that gave it tokens."""
    first: dict[str, int] = {}
    for i, schedule in enumerate(engine.runner.schedules):
        for item in schedule.scheduled:
            first.setdefault(item.seq.request_id, i)
    return first


def start_order(engine) -> list[str]:
    first = first_scheduled(engine)
    return sorted(first, key=lambda rid: first[rid])


# -- who goes first ---------------------------------------------------------------------------


def test_lanes_are_admitted_in_strict_order_when_nobody_has_aged():
    engine = fake_engine(max_num_seqs=2, max_num_batched_tokens=64)
    # Worst lane arrives first: arrival order must not matter across lanes.
    for i, lane in enumerate([2, 2, 1, 1, 0, 0]):
        engine.add_request(f"p{lane}-{i}", [i + 1, 2, 3], params(3), lane=lane, arrival_time=float(i))
    outputs = run_to_completion(engine)
    assert start_order(engine) == ["p0-4", "p0-5", "p1-2", "p1-3", "p2-0", "p2-1"]
    first = first_scheduled(engine)
    # Two at a time: the P1s wait for both P0s to finish, the P2s for both P1s.
    assert first["p0-4"] == first["p0-5"] < first["p1-2"] == first["p1-3"] < first["p2-0"] == first["p2-1"]
    assert engine.stats().preemptions == 0
    for rid, outs in outputs.items():
        assert outs[-1].finish_reason == "length"


def test_a_p2_request_under_saturating_p0_load_starts_within_two_aging_thresholds():
    aging, tick = 1.0, 0.25  # binary fractions: the clock lands exactly on the thresholds
    clock = ManualClock()
    engine = fake_engine(clock, max_num_seqs=2, max_num_batched_tokens=64, aging_threshold_s=aging)
    engine.add_request("batch", [7, 8, 9], params(2), lane=2)
    started_at = None
    n = 0
    for step in range(40):
        # More P0 work every step than the batch can take: P0 always has someone waiting.
        for _ in range(3):
            engine.add_request(f"chat-{n}", [n % VOCAB, 1, 2], params(1), lane=0, tenant_id="chat")
            n += 1
        engine.step()
        if started_at is None and "batch" in first_scheduled(engine):
            started_at = clock()
        assert engine.stats().lane(0).waiting > 0 or started_at is not None
        clock.advance(tick)
    assert started_at is not None, "the P2 request starved"
    assert aging <= started_at <= 2 * aging  # it did wait behind P0, and aging bounded the wait


def test_aging_bounds_the_wait_even_for_a_tenant_long_served_in_its_own_lane():
    """An aged-up request must not be ordered by its tenant's served tokens in its own lane
    against those of the lane it aged into: a batch tenant with 300 tokens of P2 history
    then sorted behind every P0 tenant with less P0 history, and waited 12.5 s, not 2 s
    (fixed in 8300431)."""
    aging, tick = 1.0, 0.25
    clock = ManualClock()
    engine = fake_engine(clock, max_num_seqs=2, max_num_batched_tokens=64, aging_threshold_s=aging)
    for i in range(30):
        engine.add_request(f"old-{i}", [i % VOCAB, 1, 2], params(8), lane=2, tenant_id="batch")
    run_to_completion(engine)
    arrival = clock()
    engine.add_request("batch", [7, 8, 9], params(2), lane=2, tenant_id="batch")
    started_at, n = None, 0
    for step in range(80):
        for _ in range(3):
            engine.add_request(f"chat-{n}", [n % VOCAB, 1, 2], params(1), lane=0, tenant_id="chat")
            n += 1
        engine.step()
        if "batch" in first_scheduled(engine):
            started_at = clock()
            break
        clock.advance(tick)
    assert started_at is not None and started_at - arrival <= 2 * aging, f"started {started_at} s after arriving"


def test_two_p1_tenants_get_equal_token_shares_though_one_sends_ten_times_more():
    engine = fake_engine(max_num_seqs=2, max_num_batched_tokens=64, num_blocks=64)
    # Both backlogged for the whole window: "flood" queues 10x as many requests as "quiet".
    for i in range(200):
        engine.add_request(f"flood-{i}", [i % VOCAB, 1, 2, 3], params(4), lane=1, tenant_id="flood")
    for i in range(20):
        engine.add_request(f"quiet-{i}", [i % VOCAB, 4, 5, 6], params(4), lane=1, tenant_id="quiet")

    def quiet_backlogged():
        return any(s.tenant_id == "quiet" for s in engine.scheduler.waiting)

    steps = 0
    while quiet_backlogged():
        engine.step()
        steps += 1
    served = {"flood": 0, "quiet": 0}
    for schedule in engine.runner.schedules:
        for item in schedule.scheduled:
            served[item.seq.tenant_id] += item.num_new_tokens
    assert steps > 20
    total = served["flood"] + served["quiet"]
    for tenant, tokens in served.items():
        assert abs(tokens / total - 0.5) <= 0.5 * 0.2, (tenant, served)


def test_a_tenant_arriving_while_the_lane_idles_starts_level_with_those_served_before():
    """Issue 24's 400 burst: the attacker arrived while the bystander idled and started at zero
    tokens served, so the bystander, served for a while before, queued behind all of its requests
    until it had caught up. A tenant arriving to an idle lane starts at the most-served level."""
    engine = fake_engine(max_num_seqs=2, max_num_batched_tokens=64, num_blocks=64)
    for i in range(10):  # "regular" is served, then idles
        engine.add_request(f"before-{i}", [i + 1, 1, 2, 3], params(8), lane=1, tenant_id="regular")
    run_to_completion(engine)
    for i in range(8):
        engine.add_request(f"burst-{i}", [i + 1, 4, 5, 6], params(8), lane=1, tenant_id="burst")
    engine.step()  # the burst holds both slots
    engine.add_request("chat", [9, 9, 9], params(2), lane=1, tenant_id="regular")
    run_to_completion(engine)
    order = [rid for rid in start_order(engine) if not rid.startswith("before-")]
    assert order.index("chat") == 2, order  # the first slot that frees, not after the whole burst


def test_fcfs_ignores_lanes():
    engine = fake_engine(max_num_seqs=1, policy="fcfs")
    for i, lane in enumerate([2, 1, 0, 2, 0]):
        engine.add_request(f"r{i}-p{lane}", [i + 1, 2], params(2), lane=lane, arrival_time=float(i))
    run_to_completion(engine)
    assert start_order(engine) == ["r0-p2", "r1-p1", "r2-p0", "r3-p2", "r4-p0"]
    assert engine.stats().preemptions == 0


def test_shortest_first_orders_by_max_tokens():
    engine = fake_engine(max_num_seqs=1, policy="shortest_first")
    for i, (lane, max_tokens) in enumerate([(0, 9), (2, 1), (1, 5), (0, 3), (2, 7)]):
        engine.add_request(f"m{max_tokens}", [i + 1, 2], params(max_tokens), lane=lane, arrival_time=float(i))
    outputs = run_to_completion(engine)
    assert start_order(engine) == ["m1", "m3", "m5", "m7", "m9"]
    for rid, outs in outputs.items():
        assert len(tokens_of(outs)) == int(rid[1:])


# -- preemption ---------------------------------------------------------------------------------


def test_an_arriving_p0_preempts_running_p2_work_when_the_batch_is_full():
    """vLLM issue #40004: a high-priority request waited behind a full batch of low-priority work."""
    engine = fake_engine(max_num_seqs=2, max_num_batched_tokens=64, num_blocks=64)
    batch = [engine.add_request(f"batch-{i}", [i + 1, 2, 3, 4, 5], params(40), lane=2, arrival_time=0.0) for i in range(2)]
    for _ in range(3):
        engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["batch-0", "batch-1"]

    chat = engine.add_request("chat", [9, 9, 9], params(4), lane=0)
    outs = engine.step()
    stats = engine.stats()
    assert chat.status is SequenceStatus.RUNNING
    assert [o.request_id for o in outs if o.new_token_ids].count("chat") == 1  # TTFT: one step
    assert stats.preemptions_swap == 1 and stats.preemptions_recompute == 0
    assert stats.lane(2) == LaneStats(waiting=0, running=1, swapped=1, aged_up=0)
    # The latest-arriving (here: highest seq_no) P2 is the victim.
    assert [s.request_id for s in engine.scheduler.swapped] == ["batch-1"]
    engine.block_manager.check_invariants(live_seqs(engine))

    chat_tokens = tokens_of(o for o in outs if o.request_id == "chat")
    outputs = run_to_completion(engine)
    assert chat_tokens + tokens_of(outputs["chat"]) == expected_output([9, 9, 9], 4)
    for i, seq in enumerate(batch):
        assert outputs[f"batch-{i}"][-1].finish_reason == "length"
        assert seq.output_token_ids == expected_output([i + 1, 2, 3, 4, 5], 40)
    stats = engine.stats()
    assert stats.blocks_free == stats.blocks_total and stats.swap_blocks_used == 0


def test_a_p0_whose_prefix_is_cached_but_unreferenced_still_preempts_at_once():
    """Unreferenced (evictable) cached-prefix blocks are already counted as free, and
    reviving them uses that room up: subtracting them from the head's need preempted
    nobody, admission failed, and the P0 waited while the P2s evicted its prefix
    (TTFT 3 steps; fixed in 8300431)."""
    engine = fake_engine(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    prefix = list(range(1, 17))
    engine.add_request("warm", prefix, params(1), lane=1)
    run_to_completion(engine)  # 4 keyed blocks, unreferenced: evictable
    for i in range(2):
        engine.add_request(f"batch-{i}", [30 + i] * 11, params(20), lane=2)
    engine.step()  # the batch holds the 6 plain free blocks; only the cached 4 are left
    assert engine.stats().blocks_free == 4  # all of them the warm prompt's cached blocks

    engine.add_request("chat", prefix + [50, 51, 52, 53], params(2), lane=0)
    outs = engine.step()
    assert [o.request_id for o in outs if o.new_token_ids].count("chat") == 1, "P0 TTFT was more than one step"
    assert engine.stats().preemptions == 1
    outputs = run_to_completion(engine)
    assert outputs["chat"][-1].finish_reason == "length"


def test_a_p0_does_not_preempt_running_p0_work():
    engine = fake_engine(max_num_seqs=1)
    engine.add_request("first", [1, 2, 3], params(5), lane=0)
    engine.step()
    engine.add_request("second", [4, 5, 6], params(5), lane=0)
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["first"]
    assert engine.stats().preemptions == 0


def _scheduled_ids(schedule) -> list[str]:
    return [item.seq.request_id for item in schedule.scheduled]


def test_running_batch_work_sits_out_the_step_that_admits_an_arriving_chat():
    """The step that prefills a new P0 carries no P2 decodes, so a running batch barely
    delays first tokens; the batch decodes again the step after, token-identical."""
    engine = fake_engine(max_num_seqs=8, max_num_batched_tokens=64)
    batch = [engine.add_request(f"batch-{i}", [i + 1, 2, 3], params(12), lane=2) for i in range(3)]
    for _ in range(3):
        engine.step()
    engine.add_request("chat", [9, 9, 9, 9, 9], params(3), lane=0)
    engine.step()
    engine.step()
    admitting, after = engine.runner.schedules[-2:]
    assert _scheduled_ids(admitting) == ["chat"]
    assert sorted(_scheduled_ids(after)) == ["batch-0", "batch-1", "batch-2", "chat"]
    outputs = run_to_completion(engine)
    for i, seq in enumerate(batch):
        assert outputs[f"batch-{i}"][-1].finish_reason == "length"
        assert seq.output_token_ids == expected_output([i + 1, 2, 3], 12)
    assert engine.stats().preemptions == 0


def test_no_batch_work_is_admitted_in_the_step_that_admits_an_arriving_chat():
    engine = fake_engine(max_num_seqs=8, max_num_batched_tokens=64)
    engine.add_request("batch-0", [1, 2, 3], params(8), lane=2)
    engine.step()
    engine.add_request("batch-1", [4, 5, 6], params(8), lane=2)
    engine.add_request("chat", [9, 9, 9], params(2), lane=0)
    engine.step()
    engine.step()
    admitting, after = engine.runner.schedules[-2:]
    assert _scheduled_ids(admitting) == ["chat"]
    assert sorted(_scheduled_ids(after)) == ["batch-0", "batch-1", "chat"]


def test_batch_prompts_are_prefilled_in_capped_chunks_and_others_are_not():
    """A long batch prompt cannot make one step long: at most batch_prefill_tokens of batch
    prompt per step (decodes are never capped); interactive prompts take the whole budget."""
    engine = fake_engine(max_num_seqs=8, max_num_batched_tokens=256, batch_prefill_tokens=16, num_blocks=256)
    batch = engine.add_request("batch", list(range(1, 41)), params(3), lane=2)
    chat = engine.add_request("chat", [(7 * i) % 60 + 1 for i in range(40)], params(3), lane=1)
    engine.step()
    first = {item.seq.request_id: item.num_new_tokens for item in engine.runner.schedules[-1].scheduled}
    assert first == {"chat": 40, "batch": 16}
    outputs = run_to_completion(engine)
    chunks = [item.num_new_tokens for sched in engine.runner.schedules for item in sched.scheduled
              if item.seq.request_id == "batch"]
    assert chunks == [16, 16, 8, 1, 1]
    assert batch.output_token_ids == expected_output(list(range(1, 41)), 3)
    assert chat.output_token_ids == expected_output([(7 * i) % 60 + 1 for i in range(40)], 3)
    assert outputs["batch"][-1].finish_reason == "length"


def test_batch_work_keeps_running_while_an_arriving_chat_cannot_get_in():
    """Sitting out only helps a request admitted in that very step. Two P2s that have aged
    to P0 fill the batch and may not be preempted by a new P0: they keep decoding."""
    clock = ManualClock()
    engine = fake_engine(clock, max_num_seqs=2, max_num_batched_tokens=64, aging_threshold_s=1.0)
    for i in range(2):
        engine.add_request(f"batch-{i}", [i + 1, 2, 3], params(20), lane=2)
    engine.step()
    clock.advance(2.5)  # aged up two lanes: P2 -> P0
    engine.add_request("chat", [9, 9, 9], params(3), lane=0)
    engine.step()
    assert sorted(_scheduled_ids(engine.runner.schedules[-1])) == ["batch-0", "batch-1"]
    outputs = run_to_completion(engine)
    assert outputs["chat"][-1].finish_reason == "length"


def test_other_policies_never_sit_batch_work_out():
    engine = fake_engine(max_num_seqs=8, max_num_batched_tokens=64, policy="fcfs")
    engine.add_request("batch", [1, 2, 3], params(6), lane=2)
    engine.step()
    engine.add_request("chat", [9, 9, 9], params(2), lane=0)
    engine.step()
    assert sorted(_scheduled_ids(engine.runner.schedules[-1])) == ["batch", "chat"]


def crowded_engine(crowd: int, **kw):
    """A fake engine with `crowd` P1 requests of tenant "crowd" decoding."""
    engine = fake_engine(max_num_seqs=32, max_num_batched_tokens=128, **kw)
    engine.crowd = [engine.add_request(f"crowd-{i}", [i + 1, 2, 3], params(24), lane=1, tenant_id="crowd")
                    for i in range(crowd)]
    engine.step()
    engine.step()
    return engine


def test_a_tenants_crowd_of_streams_sits_out_the_step_that_admits_another_tenants_request():
    """Issue 24's n fan-out: one tenant's 16 streams, within its tier, made every step slow, and
    another tenant's first token waited for one and shared the next. Now the newcomer's step
    carries none of the crowd's decodes; the crowd decodes again the step after, token-identical."""
    engine = crowded_engine(6)
    engine.add_request("chat", [9, 9, 9, 9, 9], params(3), lane=1, tenant_id="bystander")
    engine.step()
    engine.step()
    admitting, after = engine.runner.schedules[-2:]
    assert _scheduled_ids(admitting) == ["chat"]
    assert sorted(_scheduled_ids(after)) == ["chat"] + [f"crowd-{i}" for i in range(6)]
    outputs = run_to_completion(engine)
    for i in range(6):
        assert outputs[f"crowd-{i}"][-1].finish_reason == "length"
        assert engine.crowd[i].output_token_ids == expected_output([i + 1, 2, 3], 24)
    assert engine.stats().preemptions == 0


def test_every_newcomer_gets_into_the_step_the_crowd_sits_out_not_only_the_first():
    """Two tenants' requests arriving together, a crowd's between them in the queue: the crowd's
    request waits for the next step, the second newcomer does not wait behind it."""
    engine = crowded_engine(6)
    engine.add_request("chat-a", [9, 9, 9], params(3), lane=1, tenant_id="bystander-a")
    engine.add_request("crowd-late", [8, 2, 3], params(3), lane=1, tenant_id="crowd")
    engine.add_request("chat-b", [7, 9, 9], params(3), lane=1, tenant_id="bystander-b")
    engine.step()
    assert sorted(_scheduled_ids(engine.runner.schedules[-1])) == ["chat-a", "chat-b"]
    engine.step()
    assert "crowd-late" in _scheduled_ids(engine.runner.schedules[-1])


class TimedSumRunner(SumRunner):
    """SumRunner on a manual clock: a step takes 5 ms and 1 ms a computed token, as the real
    one grows with its tokens (a newcomer's prompt alone ~25 ms here, a crowd's decodes ~11)."""

    def __init__(self, clock: ManualClock):
        super().__init__()
        self.clock = clock

    def run(self, schedule):
        self.clock.advance(0.005 + 0.001 * sum(item.num_new_tokens for item in schedule.scheduled))
        return super().run(schedule)


def timed_crowd(crowd: int, max_tokens: int = 400):
    """An engine whose steps take time, with `crowd` long P1 requests of tenant "crowd" decoding."""
    clock = ManualClock()
    engine = tiny_engine(clock=clock, make_runner=fake_runner(TimedSumRunner(clock)), max_num_seqs=32,
                         max_num_batched_tokens=128, num_blocks=256, swap_space_bytes=swap_bytes(16))
    engine.crowd = [engine.add_request(f"crowd-{i}", [i + 1, 2, 3], params(max_tokens), lane=1, tenant_id="crowd")
                    for i in range(crowd)]
    engine.step()
    engine.step()
    return engine


def crowd_sat_out(engine) -> bool:
    return not any(rid.startswith("crowd-") for rid in _scheduled_ids(engine.runner.schedules[-1]))


def test_short_chats_arriving_every_few_crowd_steps_each_get_a_step_the_crowd_sits_out():
    """Issue 24's n fan-out on a 2-core Zen 4: another tenant's chats arrived every ~2.5 crowd
    steps, and with one sit-out in four steps every other one waited for a crowd step and then
    shared one. Counted in time, their short steps fit the crowd's quarter each time."""
    engine = timed_crowd(16, max_tokens=200)
    sat_out = []
    for n in range(12):
        engine.add_request(f"chat-{n}", [n + 1, 9, 9], params(1), lane=1, tenant_id="bystander")
        engine.step()
        sat_out.append(crowd_sat_out(engine))
        engine.step()
        engine.step()
    assert sat_out == [True] * 12


def test_a_crowd_sits_out_at_most_a_quarter_of_the_time_and_never_two_steps_in_a_row():
    """Newcomers every step, each prompt's step longer than the crowd's: the crowd gives them at
    most one part in crowd_sit_out_every of the engine's time (and its first 0.1 s of credit),
    every other step at most, and decodes the rest token-identically."""
    engine = timed_crowd(6)
    start, sat_out_s, sat_out = engine.clock(), 0.0, []
    for n in range(200):
        engine.add_request(f"chat-{n}", [n % 50 + 1] + [9] * 19, params(1), lane=1, tenant_id=f"bystander-{n}")
        before = engine.clock()
        engine.step()
        sat_out.append(crowd_sat_out(engine))
        if sat_out[-1]:
            sat_out_s += engine.clock() - before
    elapsed = engine.clock() - start
    assert not any(a and b for a, b in itertools.pairwise(sat_out)), sat_out
    assert sat_out_s <= elapsed / 4 + 0.1 + 0.025
    assert sat_out_s >= elapsed / 4 - 0.05  # it gives what it may: newcomers are not turned away for nothing
    outputs = run_to_completion(engine)
    for i, seq in enumerate(engine.crowd):
        assert outputs[f"crowd-{i}"][-1].finish_reason == "length"
        assert seq.output_token_ids == expected_output([i + 1, 2, 3], 400)


def crowd_on_the_tiny_model(clock: ManualClock | None = None, max_tokens: int = 12):
    """The real tiny model (two layers, so a step can end between them) with six P1 requests of
    tenant "crowd" decoding."""
    engine = tiny_engine(clock=clock or ManualClock(), max_num_seqs=16, max_num_batched_tokens=128,
                         num_blocks=6 * (5 + max_tokens) // 4 + 64, swap_space_bytes=swap_bytes(16))
    for i in range(6):
        engine.add_request(f"crowd-{i}", [i + 1, 2, 3, 4, 5], params(max_tokens), lane=1, tenant_id="crowd")
    engine.step()
    engine.step()
    return engine


def outputs_by_request(outputs) -> dict[str, list[int]]:
    return {rid: tokens_of(outs) for rid, outs in outputs.items()}


def test_a_crowds_step_in_flight_is_abandoned_for_another_tenants_arrival_and_loses_no_token():
    """Issue 24's n fan-out: another tenant's first token waited for the crowd's step in flight
    (16 decodes, ~40 ms on a 2-core Zen 4) before its own. The step now ends between two layers
    when such a request arrives; the newcomer's step comes next, and every stream's tokens are
    the ones it would have had."""
    reference = crowd_on_the_tiny_model()
    reference.add_request("chat", [9, 8, 7, 6], params(3), lane=1, tenant_id="bystander")
    expected = outputs_by_request(run_to_completion(reference))

    engine = crowd_on_the_tiny_model()
    computed = [seq.num_computed_tokens for seq in live_seqs(engine)]
    engine.note_arrival("bystander", 1)
    assert engine.step() == []
    assert engine.stats().steps_interrupted == 1
    assert [seq.num_computed_tokens for seq in live_seqs(engine)] == computed
    engine.arrivals.clear()
    engine.add_request("chat", [9, 8, 7, 6], params(3), lane=1, tenant_id="bystander")
    first = engine.step()
    assert [out.request_id for out in first] == ["chat"]  # the crowd sits out the newcomer's step
    outputs = run_to_completion(engine)
    outputs["chat"] = first + outputs["chat"]
    assert outputs_by_request(outputs) == expected
    assert engine.counters.steps_interrupted == 1


@pytest.mark.parametrize("arrival", ["own tenant", "a worse lane", "a prompt in the step"])
def test_a_step_is_not_abandoned_for_a_request_it_would_not_make_way_for(arrival):
    engine = crowd_on_the_tiny_model()
    if arrival == "a prompt in the step":
        engine.add_request("peer", [7, 7, 7], params(4), lane=1, tenant_id="peer")
    tenant, lane = {"own tenant": ("crowd", 1), "a worse lane": ("bystander", 2)}.get(arrival, ("bystander", 1))
    engine.note_arrival(tenant, lane)
    assert engine.step() != []
    assert engine.counters.steps_interrupted == 0


def test_abandoned_steps_come_out_of_the_crowds_share():
    """Arrivals noted on every step, none ever added: each abandoned step's time is charged to
    the crowd's credit, so it loses at most a quarter of the time and its 0.1 s, and decodes on."""
    clock = ManualClock()
    engine = crowd_on_the_tiny_model(clock, max_tokens=100)
    real = engine.model._layers

    def slow_layers(*args):  # each step takes 20 ms on the manual clock, abandoned or not
        clock.advance(0.02)
        return real(*args)

    engine.model._layers = slow_layers
    decoded = 0
    for _ in range(40):
        engine.note_arrival("bystander", 1)
        decoded += bool(engine.step())
    abandoned = engine.counters.steps_interrupted
    assert decoded == 40 - abandoned
    assert 0.1 / 0.02 <= abandoned and abandoned * 0.02 <= clock() / 4 + 0.1 + 0.02, abandoned


def test_a_step_is_abandoned_only_while_the_crowd_can_still_sit_out_the_newcomers_step():
    """Charged for abandoned steps, a crowd ran out of its share and the newcomer it had been
    abandoned for then shared a crowd step after all (41-47 ms where its own took 14; traced on
    a 2-core Zen 4). A step is abandoned only while the crowd has more time left to give than
    the step has taken, so the newcomer's step always follows alone."""
    clock = ManualClock()
    engine = crowd_on_the_tiny_model(clock, max_tokens=200)
    real = engine.model._layers

    def slow_layers(*args):
        clock.advance(0.02)
        return real(*args)

    engine.model._layers = slow_layers
    for n in range(20):
        engine.note_arrival("bystander", 1)
        abandoned = engine.step() == []
        engine.arrivals.clear()
        engine.add_request(f"chat-{n}", [n + 1, 9, 9], params(1), lane=1, tenant_id="bystander")
        after = [out.request_id for out in engine.step()]
        if abandoned:
            assert after == [f"chat-{n}"], (n, after)
        for _ in range(4):  # the crowd decodes alone meanwhile
            engine.step()
    assert engine.counters.steps_interrupted >= 5


@pytest.mark.parametrize("crowd, newcomer_has", [(3, 0), (6, 6)], ids=["below-the-threshold", "as-many-as-the-crowd"])
def test_no_one_sits_out_for_a_tenant_running_as_many_or_when_few_are_running(crowd, newcomer_has):
    engine = crowded_engine(crowd)
    for i in range(newcomer_has):
        engine.add_request(f"peer-{i}", [i + 5, 2, 3], params(24), lane=1, tenant_id="peer")
    engine.step()
    engine.add_request("chat", [9, 9, 9], params(3), lane=1, tenant_id="peer")
    engine.step()
    assert sum(rid.startswith("crowd-") for rid in _scheduled_ids(engine.runner.schedules[-1])) == crowd


def prompt_tokens_by_tenant(schedule) -> dict[str, int]:
    tokens: dict[str, int] = {}
    for item in schedule.scheduled:
        if item.num_new_tokens > 1:
            tokens[item.seq.tenant_id] = tokens.get(item.seq.tenant_id, 0) + item.num_new_tokens
    return tokens


def test_a_tenants_burst_of_prompts_is_spread_over_steps_so_another_tenants_prompt_gets_in():
    """Issue 24's 400 burst: sixteen of one tenant's requests arriving together prefilled in one
    step (242 tokens, 100 ms on 2 cores), and another tenant's request arriving during it waited
    for all of it. Once a tenant has crowd_sit_out_seqs sequences in a step, its prompt tokens
    in that step stop at crowd_prefill_tokens; the rest come in the next steps, token-identical,
    and a newcomer's prompt is never held back by the crowd's cap."""
    engine = fake_engine(max_num_seqs=32, max_num_batched_tokens=512, num_blocks=128, crowd_prefill_tokens=24)
    prompts = {f"burst-{i}": [i + 1] + [7] * 9 for i in range(16)}  # 10 tokens each
    burst = [engine.add_request(rid, prompt, params(4), lane=1, tenant_id="burst") for rid, prompt in prompts.items()]
    engine.step()
    first = engine.runner.schedules[-1]
    # Four sequences before the cap applies (40 tokens), none after: the step is a quarter of the burst.
    assert prompt_tokens_by_tenant(first) == {"burst": 40}
    engine.add_request("chat", [9] * 12, params(3), lane=1, tenant_id="bystander")
    engine.step()
    assert prompt_tokens_by_tenant(engine.runner.schedules[-1]).get("bystander") == 12
    outputs = run_to_completion(engine)
    assert outputs["chat"][-1].finish_reason == "length"
    for seq, prompt in zip(burst, prompts.values()):
        assert seq.output_token_ids == expected_output(prompt, 4)
    assert all(sum(prompt_tokens_by_tenant(s).values()) <= 40 + 12 for s in engine.runner.schedules)


def test_one_long_prompt_is_no_crowd_and_prefills_in_one_step():
    engine = fake_engine(max_num_seqs=8, max_num_batched_tokens=512, crowd_prefill_tokens=24)
    engine.add_request("long", [(3 * i) % VOCAB for i in range(200)], params(2), lane=1, tenant_id="alone")
    engine.step()
    assert prompt_tokens_by_tenant(engine.runner.schedules[-1]) == {"alone": 200}


def test_a_crowd_in_a_better_lane_does_not_make_way_for_a_worse_one():
    engine = crowded_engine(6)
    engine.add_request("batch", [9, 9, 9], params(3), lane=2, tenant_id="bystander")
    engine.step()
    assert sum(rid.startswith("crowd-") for rid in _scheduled_ids(engine.runner.schedules[-1])) == 6


# -- swap and recompute keep outputs exact (real tiny model) -----------------------------------------

SAMPLINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, seed=1234, max_tokens=24, ignore_eos=True),
}
VICTIM_PROMPT = [(7 * i + 3) % VOCAB for i in range(10)]


def run_alone(sampling: SamplingParams) -> list[int]:
    engine = tiny_engine(swap_space_bytes=swap_bytes(16))
    engine.add_request("victim", VICTIM_PROMPT, sampling, lane=2)
    return tokens_of(run_to_completion(engine)["victim"])


def run_preempted(sampling: SamplingParams, victim_lane: int, swap_blocks: int):
    engine = tiny_engine(max_num_seqs=1, swap_space_bytes=swap_bytes(swap_blocks))
    victim = engine.add_request("victim", VICTIM_PROMPT, sampling, lane=victim_lane)
    tokens = []
    for _ in range(5):
        tokens += tokens_of(engine.step())
    # A better lane arrives with the batch full: the victim makes room mid-generation.
    engine.add_request("chat", [1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), lane=0)
    outputs = run_to_completion(engine)
    return engine, victim, tokens + tokens_of(outputs["victim"])


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_a_swapped_p2_sequence_produces_the_tokens_it_would_have_unpreempted(sampling):
    engine, victim, tokens = run_preempted(sampling, victim_lane=2, swap_blocks=16)
    assert engine.stats().preemptions_swap > 0 and engine.stats().preemptions_recompute == 0
    assert victim.num_preemptions > 0
    assert tokens == run_alone(sampling)


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("victim_lane, swap_blocks", [(1, 16), (2, 0)], ids=["p1-victim", "no-swap-space"])
def test_a_recomputed_sequence_produces_the_tokens_it_would_have_unpreempted(sampling, victim_lane, swap_blocks):
    engine, victim, tokens = run_preempted(sampling, victim_lane, swap_blocks)
    assert engine.stats().preemptions_recompute > 0 and engine.stats().preemptions_swap == 0
    assert victim.num_preemptions > 0
    assert tokens == run_alone(sampling)


# -- admission control and queue timeouts ----------------------------------------------------------


def test_a_full_lane_refuses_with_a_retry_after():
    engine = fake_engine(lane_max_waiting=(2, 1, 3))
    engine.add_request("a", [1, 2], params(2), lane=1)
    with pytest.raises(QueueFullError) as refused:
        engine.add_request("b", [1, 2], params(2), lane=1)
    assert refused.value.lane == 1 and refused.value.retry_after_s >= 1
    assert "b" not in engine.requests
    # Other lanes have their own limits.
    engine.add_request("c", [1, 2], params(2), lane=0)
    engine.add_request("d", [1, 2], params(2), lane=2)
    outputs = run_to_completion(engine)
    assert sorted(outputs) == ["a", "c", "d"]


def test_one_tenant_cannot_hold_more_than_its_share_of_a_lanes_waiting_queue():
    engine = fake_engine(lane_max_waiting=(8, 4, 8), tenant_queue_share=0.5)
    for i in range(2):
        engine.add_request(f"greedy{i}", [1, 2], params(2), lane=1, tenant_id="greedy")
    with pytest.raises(QueueFullError) as refused:
        engine.add_request("greedy2", [1, 2], params(2), lane=1, tenant_id="greedy")
    assert refused.value.lane == 1 and refused.value.retry_after_s >= 1
    assert "share" in refused.value.message and "greedy2" not in engine.requests
    # Another tenant still finds room in the lane, and the greedy one in another lane.
    engine.add_request("other0", [1, 2], params(2), lane=1, tenant_id="other")
    engine.add_request("greedy-p2", [1, 2], params(2), lane=2, tenant_id="greedy")
    # Once its requests leave the queue (admitted), the tenant may queue again.
    run_to_completion(engine)
    engine.add_request("greedy3", [1, 2], params(2), lane=1, tenant_id="greedy")
    assert sorted(run_to_completion(engine)) == ["greedy3"]


def test_a_request_whose_estimated_wait_exceeds_the_lane_timeout_is_refused():
    engine = fake_engine(max_num_seqs=2, lane_queue_timeout_s=(30.0, 1e-9, 3600.0))
    engine.add_request("warmup", [1, 2, 3], params(4), lane=2)
    run_to_completion(engine)  # the engine now knows how long a step takes
    assert engine.step_s > 0
    engine.add_request("running", [1, 2, 3], params(50), lane=1)
    engine.step()
    engine.add_request("queued", [4, 5, 6], params(50), lane=1)  # a slot is free for it: no wait
    with pytest.raises(QueueFullError) as refused:
        # No slot left: it would wait for "running" to finish its ~49 remaining tokens.
        engine.add_request("late", [4, 5, 6], params(5), lane=1)
    assert refused.value.lane == 1 and refused.value.retry_after_s >= 1
    assert "timeout" in refused.value.message
    engine.add_request("p0", [4, 5, 6], params(5), lane=0)  # P1 work does not hold slots against P0: preempted


def test_the_wait_estimate_counts_slots_not_the_sum_of_all_queued_work():
    """64 requests admitted at once into an idle engine with 64 slots all run side by side:
    none is refused for the work of the others, however slow the steps were."""
    engine = fake_engine(max_num_seqs=64, num_blocks=4096, lane_queue_timeout_s=(0.5, 0.5, 0.5))
    engine.step_s = 0.05  # a slow machine: summing everyone's 200 tokens would predict minutes
    for i in range(64):
        engine.add_request(f"r{i}", [1, 2, 3, 4], params(200), lane=0)
    with pytest.raises(QueueFullError):  # the 65th must wait for a slot: ~200 steps of 50 ms
        engine.add_request("r64", [1, 2, 3, 4], params(200), lane=0)


def test_a_request_waiting_past_its_lane_timeout_fails_and_the_engine_keeps_serving():
    clock = ManualClock()
    engine = fake_engine(clock, max_num_seqs=1, lane_queue_timeout_s=(30.0, 5.0, 3600.0))
    engine.add_request("holder", [1, 2, 3], params(20), lane=1)
    engine.step()
    waiter = engine.add_request("waiter", list(range(1, 13)), params(5), lane=1)
    engine.step()
    assert waiter.status is SequenceStatus.WAITING
    clock.advance(5.5)
    outs = engine.step()
    failed = [o for o in outs if o.request_id == "waiter"]
    assert len(failed) == 1 and failed[0].finished
    assert failed[0].finish_reason == "error" and failed[0].error
    assert failed[0].new_token_ids == ()
    assert "waiter" not in engine.requests and waiter.block_table == [] and waiter.swap_table == []
    engine.block_manager.check_invariants(live_seqs(engine))

    engine.add_request("after", [4, 5, 6], params(3), lane=1)
    outputs = run_to_completion(engine)
    assert outputs["holder"][-1].finish_reason == "length"
    assert tokens_of(outputs["after"]) == expected_output([4, 5, 6], 3)
    stats = engine.stats()
    assert stats.blocks_free == stats.blocks_total


# -- random interleavings -------------------------------------------------------------------------

PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9] * 8]
# Pools that a handful of sequences overfill, so preemption, swapping and refusals are common.
NUM_BLOCKS, BLOCK_SIZE, TOKEN_BUDGET, MAX_SEQS, SWAP_BLOCKS = 10, 4, 16, 4, 6
LANE_MAX_WAITING = (3, 4, 6)
LANE_TIMEOUTS = (4.0, 8.0, 30.0)
TEARDOWN_STEPS = 2_000


class PriorityMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = ManualClock()
        self.engine = fake_engine(
            self.clock,
            swap_blocks=SWAP_BLOCKS,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=TOKEN_BUDGET,
            max_num_seqs=MAX_SEQS,
            aging_threshold_s=3.0,
            max_swaps_per_step=2,
            lane_max_waiting=LANE_MAX_WAITING,
            lane_queue_timeout_s=LANE_TIMEOUTS,
        )
        self.seqs = {}  # request id -> Sequence, every request admitted
        self.tokens = {}  # request id -> tokens streamed so far
        self.final = {}  # request id -> its finished RequestOutput
        self.refused = 0
        self.n = 0

    @rule(
        lane=st.integers(0, 2),
        tenant=st.sampled_from(["a", "b", "c"]),
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 5), max_size=10),
        max_tokens=st.integers(1, 16),
    )
    def submit(self, lane, tenant, prefix, suffix, max_tokens):
        prompt = (prefix + suffix) or [0]
        rid = f"r{self.n}"
        self.n += 1
        try:
            self.seqs[rid] = self.engine.add_request(rid, prompt, params(max_tokens), lane=lane, tenant_id=tenant)
        except QueueFullError as e:
            assert e.lane == lane and e.retry_after_s >= 1
            self.refused += 1
            return
        self.tokens[rid] = []

    @rule(n=st.integers(1, 3), dt=st.sampled_from([0.0, 0.5, 1.0, 2.5, 5.0]))
    def step(self, n, dt):
        for _ in range(n):
            self._step()
            self.clock.advance(dt)

    def _step(self):
        before = len(self.engine.runner.schedules)
        for out in self.engine.step():
            self._record(out)
        if len(self.engine.runner.schedules) == before:
            return
        schedule = self.engine.runner.schedules[-1]
        counts = [s.num_new_tokens for s in schedule.scheduled]
        assert sum(counts) == schedule.num_batched_tokens <= TOKEN_BUDGET
        assert all(c >= 1 for c in counts)
        assert len({id(s.seq) for s in schedule.scheduled}) == len(counts) <= MAX_SEQS
        assert len(schedule.swap_out) <= SWAP_BLOCKS and len(schedule.swap_in) <= NUM_BLOCKS

    def _record(self, out):
        assert out.request_id not in self.final, f"{out.request_id} produced output after finishing"
        self.tokens[out.request_id] += out.new_token_ids
        if out.finished:
            self.final[out.request_id] = out

    @precondition(lambda self: self.engine.requests)
    @rule(i=st.integers(0, 100))
    def abort(self, i):
        if i % 3:  # abort a third as often as the other rules run: a drained engine shows little
            return
        ids = sorted(self.engine.requests)
        out = self.engine.abort(ids[i % len(ids)])
        assert out.finished and out.finish_reason == "abort"
        self._record(out)

    @invariant()
    def books_balance(self):
        engine = self.engine
        live = live_seqs(engine)
        engine.block_manager.check_invariants(live)
        stats = engine.stats()
        assert stats.blocks_free + stats.blocks_used == stats.blocks_total == NUM_BLOCKS
        assert stats.swap_blocks_used <= stats.swap_blocks_total == SWAP_BLOCKS
        assert engine.block_manager.swap.num_free_blocks + stats.swap_blocks_used == SWAP_BLOCKS
        assert stats.running <= MAX_SEQS
        assert {s.request_id for s in live} == set(engine.requests)
        for rid, seq in self.seqs.items():
            if seq.status is SequenceStatus.FINISHED:
                assert seq.block_table == [] and seq.swap_table == [], f"{rid} finished but holds blocks"
            elif seq.status is SequenceStatus.SWAPPED:
                assert seq.block_table == [] and seq.swap_table
            else:
                assert seq.swap_table == []
            # What has streamed out so far is always a prefix of the right answer.
            assert self.tokens[rid] == expected_output(seq.prompt_token_ids, len(self.tokens[rid]))

    def teardown(self):
        engine = self.engine
        for _ in range(TEARDOWN_STEPS):
            if not engine.has_unfinished():
                break
            self._step()
            engine.block_manager.check_invariants(live_seqs(engine))
        else:
            raise AssertionError(f"engine still busy after {TEARDOWN_STEPS} steps: {engine.stats()}")
        stats = engine.stats()
        assert stats.blocks_free == NUM_BLOCKS and stats.swap_blocks_used == 0
        assert engine.block_manager.swap.num_free_blocks == SWAP_BLOCKS
        engine.block_manager.check_invariants([])
        assert set(self.final) == set(self.seqs)
        for rid, seq in self.seqs.items():
            out = self.final[rid]
            assert out.finish_reason in ("length", "abort", "error"), (rid, out.finish_reason)
            if out.finish_reason == "length":
                assert self.tokens[rid] == expected_output(seq.prompt_token_ids, seq.params.max_tokens)
            elif out.finish_reason == "error":
                assert out.error and self.tokens[rid] == []


PriorityMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_priority_random_interleavings = PriorityMachine.TestCase


def test_stats_count_aged_up_requests_in_their_own_lane():
    """A waiting P2 request that has aged counts in P2's aged_up only, not in every lane's."""
    clock = ManualClock()
    engine = fake_engine(clock, max_num_seqs=1, max_num_batched_tokens=64, aging_threshold_s=1.0)
    engine.add_request("running", [1, 2, 3], params(50), lane=0)
    engine.step()
    engine.add_request("batch", [4, 5, 6], params(4), lane=2)
    clock.advance(1.5)  # the batch request competes as P1 now
    engine.add_request("chat", [7, 8, 9], params(4), lane=1)  # just arrived: not aged
    stats = engine.stats()
    assert [(stats.lane(lane).waiting, stats.lane(lane).aged_up) for lane in (0, 1, 2)] == \
        [(0, 0), (1, 0), (1, 1)]
