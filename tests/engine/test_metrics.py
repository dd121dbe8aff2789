"""EngineMetrics alone (counter arithmetic, registries) and fed by a live AsyncEngine."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from inference.engine.async_engine import AsyncEngine
from inference.engine.metrics import LATENCY_BUCKETS, EngineMetrics
from inference.engine.api import EngineStats, Lane, LaneStats, SamplingParams
from tests.engine import tiny
from tests.engine.tiny import GREEDY, one_thread

assert one_thread  # an autouse fixture: importing it is what applies it here

# A hang inside a test fails after its asyncio.wait_for (15 s); this outer limit only leaves
# room for the first tiny model to build the CPU kernels when their compile cache is cold.
pytestmark = pytest.mark.timeout(120)


def tiny_engine(**kw):
    return tiny.tiny_engine(**{"swap_space_bytes": 1 << 16, **kw})


class TickingClock:
    """Advances by `tick` seconds on every read: latencies become non-zero and countable."""

    def __init__(self, tick: float):
        self.now = 0.0
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def families(metrics: EngineMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def value(metrics: EngineMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


# -- the metrics object ----------------------------------------------------------------------


def test_two_instances_keep_separate_registries():
    a, b = EngineMetrics(), EngineMetrics()  # the default registry would refuse the second
    a.observe_tokens("acme", 3)
    assert value(a, "llm_engine_generation_tokens_total", tenant="acme") == 3
    assert value(b, "llm_engine_generation_tokens_total", tenant="acme") is None
    shared = CollectorRegistry()
    assert EngineMetrics(shared).registry is shared


def test_engine_totals_become_counter_increments():
    m = EngineMetrics()
    m.observe_stats(EngineStats(preemptions_recompute=2, prefix_hit_tokens=16))
    m.observe_stats(EngineStats(preemptions_recompute=5, prefix_hit_tokens=16))
    assert value(m, "llm_engine_preemptions_total", mode="recompute") == 5
    assert value(m, "llm_engine_preemptions_total", mode="swap") == 0
    assert value(m, "llm_engine_prefix_cache_hit_tokens_total") == 16
    # A rebuilt engine counts from zero again: its totals add on, nothing goes backwards.
    m.observe_stats(EngineStats(preemptions_recompute=1, prefix_hit_tokens=4))
    assert value(m, "llm_engine_preemptions_total", mode="recompute") == 6
    assert value(m, "llm_engine_prefix_cache_hit_tokens_total") == 20


def test_speculative_totals_become_counters_by_lane_and_their_ratios_gauges():
    m = EngineMetrics()
    lanes = {lane: LaneStats() for lane in Lane}
    m.observe_stats(EngineStats(lanes={**lanes, Lane.REALTIME: LaneStats(spec_passes=4, spec_draft_tokens=16,
                                                                          spec_accepted_tokens=6)}))
    m.observe_stats(EngineStats(lanes={**lanes, Lane.REALTIME: LaneStats(spec_passes=10, spec_draft_tokens=40,
                                                                          spec_accepted_tokens=30),
                                       Lane.BATCH: LaneStats(spec_passes=1, spec_draft_tokens=4)}))
    assert value(m, "llm_engine_spec_passes_total", lane="P0") == 10
    assert value(m, "llm_engine_spec_draft_tokens_total", lane="P0") == 40
    assert value(m, "llm_engine_spec_accepted_tokens_total", lane="P0") == 30
    assert value(m, "llm_engine_spec_draft_tokens_total", lane="P2") == 4
    assert value(m, "llm_engine_spec_accepted_tokens_total", lane="P1") == 0  # exported before any
    assert value(m, "llm_engine_spec_acceptance_ratio") == 30 / 44
    assert value(m, "llm_engine_spec_tokens_per_pass") == 1 + 30 / 11


def test_preemptions_are_counted_by_mode():
    m = EngineMetrics()
    m.observe_stats(EngineStats(preemptions=3, preemptions_recompute=2, preemptions_swap=1))
    m.observe_stats(EngineStats(preemptions=9, preemptions_recompute=5, preemptions_swap=4))
    assert value(m, "llm_engine_preemptions_total", mode="swap") == 4
    assert value(m, "llm_engine_preemptions_total", mode="recompute") == 5


def test_steps_abandoned_for_a_newcomer_are_counted():
    m = EngineMetrics()
    m.observe_stats(EngineStats(steps_interrupted=2))
    m.observe_stats(EngineStats(steps_interrupted=7))
    assert value(m, "llm_engine_steps_interrupted_total") == 7


def test_gauges_follow_the_last_snapshot():
    m = EngineMetrics()
    lanes = {Lane.REALTIME: LaneStats(waiting=3, running=1), Lane.NEAR_REALTIME: LaneStats(),
             Lane.BATCH: LaneStats(running=2, swapped=5)}
    m.observe_stats(EngineStats(lanes=lanes, blocks_total=64, blocks_free=10, blocks_cached=7, swap_blocks_used=12))
    assert value(m, "llm_engine_requests_waiting", lane="P0") == 3
    assert value(m, "llm_engine_requests_running", lane="P2") == 2
    assert value(m, "llm_engine_requests_swapped", lane="P2") == 5
    assert value(m, "llm_engine_kv_blocks_total") == 64
    assert value(m, "llm_engine_kv_blocks_free") == 10
    assert value(m, "llm_engine_kv_blocks_cached") == 7
    assert value(m, "llm_engine_swap_blocks_used") == 12
    m.observe_stats(EngineStats(blocks_total=64, blocks_free=64))
    assert value(m, "llm_engine_swap_blocks_used") == 0
    assert value(m, "llm_engine_requests_running", lane="P2") == 0


def test_time_per_output_token_is_the_mean_gap_after_the_first():
    m = EngineMetrics()
    m.observe_finished(1, "length", num_tokens=5, first_at=10.0, last_at=12.0)
    m.observe_finished(1, "abort", num_tokens=1, first_at=10.0, last_at=10.0)  # one token: no gap to measure
    m.observe_finished(1, "error", num_tokens=0, first_at=None, last_at=None)
    assert value(m, "llm_engine_time_per_output_token_seconds_sum", lane="P1") == pytest.approx(0.5)
    assert value(m, "llm_engine_time_per_output_token_seconds_count", lane="P1") == 1
    for reason in ("length", "abort", "error"):
        assert value(m, "llm_engine_requests_finished_total", reason=reason) == 1


def test_kv_usage_is_the_share_of_blocks_live_sequences_hold():
    m = EngineMetrics()
    m.observe_stats(EngineStats())  # no cache yet: 0, not a division by zero
    assert value(m, "llm_engine_kv_usage_ratio") == 0
    # Cached prefixes nobody holds are free to allocate: they count as free, not used.
    m.observe_stats(EngineStats(blocks_total=64, blocks_free=48, blocks_used=16, blocks_cached=30))
    assert value(m, "llm_engine_kv_usage_ratio") == 0.25


def test_latency_and_queue_time_of_ended_requests_by_lane():
    m = EngineMetrics()
    m.observe_finished(0, "stop", 3, 1.0, 2.0, latency_s=2.5, queue_s=0.5)
    m.observe_finished(2, "length", 3, 1.0, 2.0, latency_s=90.0, queue_s=None)  # never scheduled: no queue time
    m.observe_finished(0, "abort", 0, None, None, latency_s=7.0, queue_s=0.25)  # the client's choice: no latency
    assert value(m, "llm_engine_e2e_request_latency_seconds_count", lane="P0") == 1
    assert value(m, "llm_engine_e2e_request_latency_seconds_sum", lane="P0") == 2.5
    assert value(m, "llm_engine_e2e_request_latency_seconds_bucket", lane="P2", le="60.0") == 0
    assert value(m, "llm_engine_e2e_request_latency_seconds_bucket", lane="P2", le="120.0") == 1
    assert value(m, "llm_engine_request_queue_time_seconds_sum", lane="P0") == 0.75
    assert value(m, "llm_engine_request_queue_time_seconds_count", lane="P2") is None


def test_step_duration_and_prompt_tokens():
    m = EngineMetrics()
    m.observe_step(0.004)
    m.observe_step(0.3)
    m.observe_prompt("acme", 17)
    m.observe_prompt(None, 5)
    assert value(m, "llm_engine_step_duration_seconds_bucket", le="0.005") == 1
    assert value(m, "llm_engine_step_duration_seconds_bucket", le="0.5") == 2
    assert value(m, "llm_engine_step_duration_seconds_count") == 2
    assert value(m, "llm_engine_prompt_tokens_total", tenant="acme") == 17
    assert value(m, "llm_engine_prompt_tokens_total", tenant="none") == 5


def test_a_sequence_is_first_scheduled_once_a_seat_frees():
    clock = tiny.ManualClock()
    engine = tiny_engine(clock=clock, max_num_seqs=1)
    first = engine.add_request("first", [1, 2, 3], tiny.greedy_params(3))
    second = engine.add_request("second", [4, 5, 6], tiny.greedy_params(3))
    scheduled_at = {}
    while engine.has_unfinished():
        clock.advance(0.25)
        engine.step()
        for seq in (first, second):
            if seq.first_scheduled_at is not None:
                scheduled_at.setdefault(seq.request_id, seq.first_scheduled_at)
    # One seat: the second waits for the first's three steps, then is admitted in the next.
    assert scheduled_at == {"first": 0.25, "second": 1.0}
    assert first.arrival_time == second.arrival_time == 0.0


def test_latency_buckets_span_ten_milliseconds_to_a_minute():
    m = EngineMetrics()
    m.observe_first_token(0, 0.3)
    buckets = {
        float(s.labels["le"]): s.value
        for s in families(m)["llm_engine_time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket")
    }
    assert min(buckets) == 0.01 and max(b for b in buckets if b != float("inf")) == 60.0
    assert buckets[0.25] == 0 and buckets[0.5] == 1
    assert tuple(sorted(b for b in buckets if b != float("inf"))) == LATENCY_BUCKETS


# -- fed by the engine thread ----------------------------------------------------------------


def test_an_async_engine_feeds_latencies_tokens_and_gauges():
    metrics = EngineMetrics()
    ae = AsyncEngine(tiny_engine(), clock=TickingClock(0.001), metrics=metrics)
    ae.start()

    async def one(rid, lane, tenant):
        return [out async for out in await ae.submit(rid, [1, 2, 3, rid.count("x")], GREEDY, lane=lane, tenant_id=tenant)]

    async def main():
        await asyncio.gather(one("a", 0, "acme"), one("ax", 0, "acme"), one("b", 2, "globex"))
        while ae.stats().in_flight or ae.stats().running:
            await asyncio.sleep(0.002)

    try:
        asyncio.run(asyncio.wait_for(main(), 15))
        stats = ae.stats()
    finally:
        ae.shutdown()

    assert value(metrics, "llm_engine_time_to_first_token_seconds_count", lane="P0") == 2
    assert value(metrics, "llm_engine_time_to_first_token_seconds_count", lane="P2") == 1
    assert value(metrics, "llm_engine_time_to_first_token_seconds_sum", lane="P0") > 0
    assert value(metrics, "llm_engine_time_per_output_token_seconds_count", lane="P2") == 1
    assert value(metrics, "llm_engine_generation_tokens_total", tenant="acme") == 2 * GREEDY.max_tokens
    assert value(metrics, "llm_engine_generation_tokens_total", tenant="globex") == GREEDY.max_tokens
    assert value(metrics, "llm_engine_requests_finished_total", reason="length") == 3
    assert value(metrics, "llm_engine_prompt_tokens_total", tenant="acme") == 8
    assert value(metrics, "llm_engine_prompt_tokens_total", tenant="globex") == 4
    for lane, n in (("P0", 2), ("P2", 1)):
        assert value(metrics, "llm_engine_e2e_request_latency_seconds_count", lane=lane) == n
        assert value(metrics, "llm_engine_request_queue_time_seconds_count", lane=lane) == n
    # The clock ticks on every read, so each request's latency covers its reads of it.
    assert value(metrics, "llm_engine_e2e_request_latency_seconds_sum", lane="P0") > 2 * GREEDY.max_tokens * 0.001
    assert 0 < value(metrics, "llm_engine_step_duration_seconds_count") <= stats.steps
    assert value(metrics, "llm_engine_kv_usage_ratio") == 0
    assert value(metrics, "llm_engine_kv_blocks_total") == stats.blocks_total
    assert value(metrics, "llm_engine_kv_blocks_free") == stats.blocks_free == stats.blocks_total
    assert value(metrics, "llm_engine_kv_blocks_cached") == stats.blocks_cached > 0
    assert value(metrics, "llm_engine_prefix_cache_hit_tokens_total") == stats.prefix_hit_tokens
    for lane in ("P0", "P1", "P2"):
        assert value(metrics, "llm_engine_requests_running", lane=lane) == 0
        assert value(metrics, "llm_engine_requests_waiting", lane=lane) == 0

    text = metrics.render().decode()
    assert 'llm_engine_time_to_first_token_seconds_bucket{lane="P0",le="0.01"}' in text
    assert 'llm_engine_generation_tokens_total{tenant="acme"} 24.0' in text
    assert all(name.startswith("llm_engine_") for name in families(metrics))


def test_a_request_that_times_out_in_its_queue_counts_its_whole_wait():
    clock = tiny.ManualClock()
    metrics = EngineMetrics()
    engine = tiny_engine(max_num_seqs=1, clock=clock, lane_queue_timeout_s=(30.0, 30.0, 5.0))
    ae = AsyncEngine(engine, clock=clock, metrics=metrics)
    ae.start()

    async def main():
        long = await ae.submit("long", [4, 5], SamplingParams(temperature=0, max_tokens=250, ignore_eos=True), lane=0)
        while value(metrics, "llm_engine_requests_running", lane="P0") != 1:
            await asyncio.sleep(0.002)
        long.pause()  # it keeps the only sequence slot, and never ends by itself
        while value(metrics, "llm_engine_requests_paused") != 1:
            await asyncio.sleep(0.002)
        late = await ae.submit("late", [6, 7], GREEDY, lane=2)
        while value(metrics, "llm_engine_requests_waiting", lane="P2") != 1:
            await asyncio.sleep(0.002)
        clock.advance(6.0)
        outs = [out async for out in late]
        await long.aclose()
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(main(), 15))
    finally:
        ae.shutdown()
    assert outs[-1].error_kind == "queue_timeout" and not any(o.new_token_ids for o in outs)
    assert value(metrics, "llm_engine_request_queue_time_seconds_count", lane="P2") == 1
    assert value(metrics, "llm_engine_request_queue_time_seconds_sum", lane="P2") >= 6.0


def test_gauges_show_a_request_in_flight():
    metrics = EngineMetrics()
    ae = AsyncEngine(tiny_engine(num_blocks=128), metrics=metrics)
    ae.start()

    async def main():
        stream = await ae.submit("long", [4, 5], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), lane=2)
        while value(metrics, "llm_engine_requests_running", lane="P2") != 1:
            await asyncio.sleep(0.002)
        assert value(metrics, "llm_engine_kv_blocks_free") < value(metrics, "llm_engine_kv_blocks_total")
        assert value(metrics, "llm_engine_kv_usage_ratio") > 0
        await stream.aclose()
        while value(metrics, "llm_engine_requests_running", lane="P2") != 0:
            await asyncio.sleep(0.002)

    try:
        asyncio.run(asyncio.wait_for(main(), 15))
    finally:
        ae.shutdown()
    assert value(metrics, "llm_engine_requests_finished_total", reason="abort") == 1
    assert value(metrics, "llm_engine_request_queue_time_seconds_count", lane="P2") == 1  # it was scheduled
    assert value(metrics, "llm_engine_e2e_request_latency_seconds_count", lane="P2") is None
