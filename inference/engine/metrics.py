"""Prometheus metrics of one engine, in a registry of its own.

Each `EngineMetrics` owns a `CollectorRegistry` unless given one, so tests and
several engines in one process never collide on the global registry. The
`AsyncEngine` feeds it from its engine thread; `render()` is what a /metrics
endpoint serves.

| name | type | labels | meaning |
|---|---|---|---|
| `llm_engine_requests_waiting` | gauge | lane | sequences queued for admission |
| `llm_engine_requests_running` | gauge | lane | sequences in the running batch |
| `llm_engine_requests_swapped` | gauge | lane | sequences swapped out to host memory |
| `llm_engine_requests_paused` | gauge | | sequences held out of the steps until their clients take their tokens |
| `llm_engine_kv_blocks_total` | gauge | | device KV-cache blocks |
| `llm_engine_kv_blocks_free` | gauge | | blocks free to allocate (evictable cached blocks included) |
| `llm_engine_kv_blocks_cached` | gauge | | blocks holding a reusable prefix |
| `llm_engine_kv_usage_ratio` | gauge | | used / total KV blocks: blocks live sequences hold (cached prefixes nobody holds count as free) |
| `llm_engine_swap_blocks_used` | gauge | | host swap blocks in use |
| `llm_engine_preemptions_total` | counter | mode | preemptions, by `recompute` or `swap` |
| `llm_engine_steps_interrupted_total` | counter | | steps abandoned between layers for another tenant's new request |
| `llm_engine_prefix_cache_hit_tokens_total` | counter | | prompt tokens served from the prefix cache |
| `llm_engine_spec_passes_total` | counter | lane | sequence steps that verified a speculative draft |
| `llm_engine_spec_draft_tokens_total` | counter | lane | speculative draft tokens proposed |
| `llm_engine_spec_accepted_tokens_total` | counter | lane | draft tokens the target accepted |
| `llm_engine_spec_acceptance_ratio` | gauge | | accepted / proposed draft tokens since the engine started |
| `llm_engine_spec_tokens_per_pass` | gauge | | tokens a speculating sequence's step yields since the engine started: 1 + accepted / passes |
| `llm_engine_prompt_tokens_total` | counter | tenant | prompt tokens of requests the engine accepted |
| `llm_engine_generation_tokens_total` | counter | tenant | output tokens generated |
| `llm_engine_requests_finished_total` | counter | reason | requests ended: stop, length, abort, error |
| `llm_engine_time_to_first_token_seconds` | histogram | lane | submit -> first output carrying tokens |
| `llm_engine_time_per_output_token_seconds` | histogram | lane | (last token - first token) / (tokens - 1) |
| `llm_engine_e2e_request_latency_seconds` | histogram | lane | submit -> final output, of requests not aborted |
| `llm_engine_request_queue_time_seconds` | histogram | lane | submit -> first scheduled, observed when the request ends |
| `llm_engine_step_duration_seconds` | histogram | | one engine step that computed tokens: schedule, forward, sample, hand out |

Lane labels read `P0`, `P1`, `P2`. The tenant label holds the tenant id string (`none` for requests without one):
tenants are a bounded, operator-created set, not per-user values.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from inference.engine.api import EngineStats, Lane

# A `*_created` series per counter and histogram (its creation time) is noise to a dashboard
# and doubles the series count; process-wide, so the web side's registry drops them too.
disable_created_metrics()

# 10 ms .. 60 s: a P0 first token aims under 500 ms, a P2 one may wait for minutes behind
# interactive traffic (everything past 60 s lands in +Inf, which still counts it).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# Queue time and whole requests run on to the lanes' queue timeouts (P1 120 s, P2 a day).
WAIT_BUCKETS = LATENCY_BUCKETS + (120.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)
# 1 ms .. 5 s: a batch-1 decode step took 8-48 ms on the CPUs of README's benchmarks (119 and
# 21 tokens/s), a GPU's takes a few ms, and a full 2048-token prefill step seconds on a CPU.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
PREEMPTION_MODES = ("recompute", "swap")
NO_TENANT = "none"


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.waiting = Gauge("llm_engine_requests_waiting", "Sequences queued for admission", ["lane"], registry=r)
        self.running = Gauge("llm_engine_requests_running", "Sequences in the running batch", ["lane"], registry=r)
        self.swapped = Gauge("llm_engine_requests_swapped", "Sequences swapped out to host memory", ["lane"], registry=r)
        self.paused = Gauge("llm_engine_requests_paused", "Sequences paused until their clients take their tokens", registry=r)
        self.blocks_total = Gauge("llm_engine_kv_blocks_total", "Device KV-cache blocks", registry=r)
        self.blocks_free = Gauge("llm_engine_kv_blocks_free", "KV-cache blocks free to allocate", registry=r)
        self.blocks_cached = Gauge("llm_engine_kv_blocks_cached", "KV-cache blocks holding a reusable prefix", registry=r)
        self.kv_usage = Gauge("llm_engine_kv_usage_ratio", "Used / total KV-cache blocks", registry=r)
        self.swap_blocks_used = Gauge("llm_engine_swap_blocks_used", "Host swap blocks in use", registry=r)
        self.preemptions = Counter("llm_engine_preemptions", "Preemptions by mode", ["mode"], registry=r)
        self.steps_interrupted = Counter("llm_engine_steps_interrupted",
                                         "Steps abandoned between layers for another tenant's new request", registry=r)
        self.prefix_hit_tokens = Counter("llm_engine_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.spec_passes = Counter("llm_engine_spec_passes", "Sequence steps that verified a speculative draft", ["lane"],
                                   registry=r)
        self.spec_draft_tokens = Counter("llm_engine_spec_draft_tokens", "Speculative draft tokens proposed", ["lane"], registry=r)
        self.spec_accepted_tokens = Counter("llm_engine_spec_accepted_tokens", "Draft tokens the target accepted", ["lane"],
                                            registry=r)
        self.spec_acceptance = Gauge("llm_engine_spec_acceptance_ratio", "Accepted / proposed draft tokens", registry=r)
        self.spec_tokens_per_pass = Gauge("llm_engine_spec_tokens_per_pass", "Tokens a speculating sequence's step yields",
                                          registry=r)
        self.prompt_tokens = Counter("llm_engine_prompt_tokens", "Prompt tokens of accepted requests", ["tenant"], registry=r)
        self.generation_tokens = Counter("llm_engine_generation_tokens", "Output tokens generated", ["tenant"], registry=r)
        self.finished = Counter("llm_engine_requests_finished", "Requests ended, by finish reason", ["reason"], registry=r)
        self.ttft = Histogram(
            "llm_engine_time_to_first_token_seconds", "Submit to first output token", ["lane"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "llm_engine_time_per_output_token_seconds", "Mean time between output tokens", ["lane"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "llm_engine_e2e_request_latency_seconds", "Submit to final output", ["lane"], buckets=WAIT_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "llm_engine_request_queue_time_seconds", "Submit to first scheduled", ["lane"], buckets=WAIT_BUCKETS, registry=r
        )
        self.step_time = Histogram("llm_engine_step_duration_seconds", "Engine steps that computed tokens",
                                   buckets=STEP_BUCKETS, registry=r)
        # The engine's counters are cumulative totals; Prometheus counters only go up by deltas.
        self._last_totals: dict[str, int] = {}
        for mode in PREEMPTION_MODES:
            self.preemptions.labels(mode=mode)  # export zeros, so rate() sees the series from the start
        for lane in Lane:
            for counter in (self.spec_passes, self.spec_draft_tokens, self.spec_accepted_tokens):
                counter.labels(lane=lane.label)

    # -- fed by the engine thread --------------------------------------------------------------

    def observe_stats(self, stats: EngineStats) -> None:
        """Gauges and counters from one `AsyncEngine.stats()` snapshot."""
        for lane, counts in stats.lanes.items():
            self.waiting.labels(lane=lane.label).set(counts.waiting)
            self.running.labels(lane=lane.label).set(counts.running)
            self.swapped.labels(lane=lane.label).set(counts.swapped)
        self.paused.set(stats.paused)
        self.blocks_total.set(stats.blocks_total)
        self.blocks_free.set(stats.blocks_free)
        self.blocks_cached.set(stats.blocks_cached)
        self.kv_usage.set(stats.blocks_used / stats.blocks_total if stats.blocks_total else 0.0)
        self.swap_blocks_used.set(stats.swap_blocks_used)
        self._add_delta("preemptions_swap", stats.preemptions_swap, self.preemptions.labels(mode="swap"))
        self._add_delta("preemptions_recompute", stats.preemptions_recompute, self.preemptions.labels(mode="recompute"))
        self._add_delta("prefix_hit_tokens", stats.prefix_hit_tokens, self.prefix_hit_tokens)
        self._add_delta("steps_interrupted", stats.steps_interrupted, self.steps_interrupted)
        for lane, counts in stats.lanes.items():
            self._add_delta(f"spec_passes_{lane.label}", counts.spec_passes, self.spec_passes.labels(lane=lane.label))
            self._add_delta(f"spec_draft_{lane.label}", counts.spec_draft_tokens, self.spec_draft_tokens.labels(lane=lane.label))
            self._add_delta(f"spec_accepted_{lane.label}", counts.spec_accepted_tokens,
                            self.spec_accepted_tokens.labels(lane=lane.label))
        self.spec_acceptance.set(stats.spec_acceptance_rate)
        self.spec_tokens_per_pass.set(stats.spec_tokens_per_pass)

    def _add_delta(self, key: str, total: int, counter) -> None:
        last = self._last_totals.get(key, 0)
        # A total below the last one means the engine was rebuilt and its counters restarted at 0.
        delta = total - last if total >= last else total
        if delta > 0:
            counter.inc(delta)
        self._last_totals[key] = total

    def reset_totals(self) -> None:
        """The engine was replaced: its counters start again from zero."""
        self._last_totals.clear()

    def observe_prompt(self, tenant_id: str | None, n: int) -> None:
        self.prompt_tokens.labels(tenant=tenant_id or NO_TENANT).inc(n)

    def observe_tokens(self, tenant_id: str | None, n: int) -> None:
        if n:
            self.generation_tokens.labels(tenant=tenant_id or NO_TENANT).inc(n)

    def observe_first_token(self, lane: int, seconds: float) -> None:
        self.ttft.labels(lane=Lane(lane).label).observe(max(0.0, seconds))

    def observe_step(self, seconds: float) -> None:
        self.step_time.observe(max(0.0, seconds))

    def observe_finished(self, lane: int, reason: str | None, num_tokens: int, first_at: float | None, last_at: float | None,
                         latency_s: float | None = None, queue_s: float | None = None) -> None:
        """A request's end. `latency_s`: submit to now; `queue_s`: its wait before it was first
        scheduled, None if it never was. An abort's latency is its client's choice, not ours:
        left out."""
        label = Lane(lane).label
        self.finished.labels(reason=reason or "unknown").inc()
        if num_tokens >= 2 and first_at is not None and last_at is not None:
            self.tpot.labels(lane=label).observe(max(0.0, (last_at - first_at) / (num_tokens - 1)))
        if latency_s is not None and reason != "abort":
            self.e2e.labels(lane=label).observe(max(0.0, latency_s))
        if queue_s is not None:
            self.queue_time.labels(lane=label).observe(max(0.0, queue_s))

    # -- read by the endpoint -------------------------------------------------------------------

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)
