"""`LLMEngine`: requests in, token deltas out, one `step()` at a time.

A step is three moves: the scheduler picks the batch, the runner computes it and
samples, and postprocessing appends tokens, detokenizes, checks stop conditions
and frees what finished.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable, Protocol

import torch

from inference.engine.api import EngineStats, Lane, LaneStats, RequestOutput, SamplingParams
from inference.engine.block_manager import BlockManager
from inference.engine.config import EngineConfig, resolve_device, resolve_dtype
from inference.engine.errors import ConfigError, DuplicateRequestError, InvalidRequestError, QueueFullError
from inference.engine.request_checks import RequestChecks
from inference.engine.loader import load_model
from inference.engine.model_runner import ModelRunner, SampledToken
from inference.engine.models.llama import LlamaModel
from inference.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from inference.engine.sequence import Sequence
from inference.engine.stops import StopMatcher
from inference.engine.grammar import GrammarEngineFailure, guarded
from inference.engine.structured import Grammars
from inference.engine.tokenizer import Tokenizer


@dataclass
class Counters:
    steps: int = 0
    prompt_tokens: int = 0  # of admitted requests
    computed_tokens: int = 0  # tokens run through the model (prefill chunks and decodes)
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache instead
    generated_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    # Speculative decoding, by lane: verifying passes (a sequence's step with a draft), draft
    # tokens proposed, and those the target accepted.
    spec_passes: Counter = field(default_factory=Counter)
    spec_draft_tokens: Counter = field(default_factory=Counter)
    spec_accepted_tokens: Counter = field(default_factory=Counter)
    steps_interrupted: int = 0  # abandoned between layers for a newcomer (LLMEngine._watch)


class StepInterrupted(Exception):
    """A step given up between layers for a newly arrived request (LLMEngine._watch)."""

    def __init__(self, crowds: frozenset):
        super().__init__("the step was abandoned for a newly arrived request")
        self.crowds = crowds


@dataclass(frozen=True)
class Completion:
    """One finished request of an offline `generate` call."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    num_cached_tokens: int
    logprobs: tuple = field(default=(), repr=False)


@dataclass(frozen=True)
class LoadedModel:
    """What loading gives an engine: the weights on their device, the tokenizer (None: the
    engine takes token ids only) and the model's name (empty: the configured model)."""

    model: LlamaModel
    tokenizer: Tokenizer | None = None
    name: str = ""
    draft: LlamaModel | None = None  # the draft model of speculative "draft"


def _draft_model(config: EngineConfig, loaded: LoadedModel) -> LlamaModel | None:
    """The draft model speculative "draft" runs, checked against the target; None otherwise."""
    if config.speculative != "draft":
        return None
    if loaded.draft is None:
        raise ConfigError("speculative 'draft' needs a draft model (INFERENCE_DRAFT_MODEL)", setting="draft_model")
    ours, theirs = loaded.model.config.vocab_size, loaded.draft.config.vocab_size
    if ours != theirs:
        # Rejection sampling compares the two distributions token by token.
        raise ConfigError(f"the draft model (INFERENCE_DRAFT_MODEL) has a vocabulary of {theirs} tokens, "
                          f"the served model {ours}: they must be the same", setting="draft_model")
    return loaded.draft


class Runner(Protocol):
    """What the engine steps: computes a schedule and samples (ModelRunner; tests fake it)."""

    def run(self, schedule: SchedulerOutput) -> list[SampledToken]: ...


# Builds the runner once the engine has sized the KV cache; called with ModelRunner's arguments.
RunnerFactory = Callable[..., Runner]


class LLMEngine(RequestChecks):
    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        make_runner: RunnerFactory = ModelRunner,
        clock: Callable[[], float] = time.monotonic,
    ):
        """An engine around weights already loaded (`from_config` loads them); reads nothing
        from disk. `make_runner(model, num_blocks=, block_size=, seed=, num_swap_blocks=)`
        builds the runner for the KV cache this engine sizes (default: a real ModelRunner)."""
        self.config = config
        self.clock = clock
        self.loaded = loaded
        model, tokenizer = loaded.model, loaded.tokenizer
        self.model_name = loaded.name or config.model
        self.model = model
        self.tokenizer = tokenizer
        mc = model.config
        self.vocab_size = mc.vocab_size
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.eos_token_ids = frozenset(mc.eos_token_ids) | (tokenizer.eos_token_ids if tokenizer else frozenset())
        model.verify_rows(1 + config.num_speculative_tokens if config.speculative != "off" else 1)
        draft = _draft_model(config, loaded)
        # A draft model keeps its own keys and values in the same blocks: a block costs both.
        block_bytes = config.block_size * sum(m.config.kv_bytes_per_token(m.dtype) for m in (model, draft) if m is not None)
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // block_bytes)
        num_swap_blocks = config.swap_space_bytes // block_bytes
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, num_swap_blocks)
        self.scheduler = Scheduler(config, self.block_manager, clock=clock)
        self.runner = make_runner(model, num_blocks=num_blocks, block_size=config.block_size, seed=config.seed,
                                  num_swap_blocks=num_swap_blocks, **({"draft": draft} if draft is not None else {}))
        self.tokens_per_s = 0.0  # recent throughput (decaying peak), reported in stats
        self.step_s = 0.0  # recent duration of a step that computed tokens (EWMA), for queue-wait estimates
        self.requests: dict[str, Sequence] = {}
        self.counters = Counters()
        self.arrivals: deque = deque()  # note_arrival's (tenant, lane) not yet added
        # Structured output needs text: an engine without a tokenizer takes no grammar.
        self.grammars = Grammars(tokenizer.hf, mc.vocab_size, self.eos_token_ids) if tokenizer else None

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """The real engine: the configured model's weights loaded (through the cache in
        config.cache_dir) on the configured device and dtype, running config.kernels, with its
        tokenizer, a KV cache sized by the config and a ModelRunner over it. Raises ConfigError
        for a device or dtype this machine cannot use, or a model architecture it cannot run."""
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        if config.cpu_threads and device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)  # process-wide: every thread's parallel regions
        model, source = load_model(config.model, dtype, device, config.cache_dir, config.kernels, config.quantization)
        draft = None
        if config.speculative == "draft":
            # By default the served model itself at int4: a real draft and target pair from one file.
            draft, _ = load_model(config.draft_model or config.model, dtype, device, config.cache_dir, config.kernels,
                                  "int4" if config.draft_model is None else "none")
        return cls(config, LoadedModel(model, Tokenizer.load(source, config.cache_dir), source.name, draft))

    # -- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lane: int = Lane.NEAR_REALTIME,
        tenant_id: str | None = None,
        admission_control: bool = True,
        matcher=None,
    ) -> Sequence:
        """Validate and queue a request. Raises InvalidRequestError (bad request) or
        QueueFullError (the lane cannot take it now); never half-adds.

        `admission_control=False` skips the lane's queue limits (offline `generate`). `matcher`:
        the grammar's matcher when the caller built it (`AsyncEngine` does, off this thread);
        otherwise a request with a grammar gets one here."""
        params = params or SamplingParams()
        try:
            lane = Lane(lane)
        except ValueError:
            raise InvalidRequestError(f"lane must be one of {[int(x) for x in Lane]}", param="priority") from None
        if admission_control:
            self._admission_control(lane, tenant_id)
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        if request_id in self.requests:
            raise DuplicateRequestError(request_id)
        token_ids = self._prompt_tokens(prompt)
        self.check_context(len(token_ids), params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer", param="stop")
        if params.grammar is not None and matcher is None:
            if self.grammars is None:
                raise InvalidRequestError("structured output needs a tokenizer", param=params.grammar.param)
            matcher = self.grammars.matcher(params.grammar)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            cache_salt=cache_salt,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            lane=lane,
            tenant_id=tenant_id,
        )
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        if self.tokenizer is not None:
            seq.detokenizer = self.tokenizer.detokenizer()
        if params.stop:
            seq.stop_matcher = StopMatcher(params.stop)
        seq.matcher = matcher
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.counters.prompt_tokens += len(token_ids)
        return seq

    def _admission_control(self, lane: int, tenant_id: str | None) -> None:
        """Refuse (QueueFullError with a retry-after) what the lane cannot take in time, and what
        would take a tenant past its share of the lane's waiting queue."""
        in_lane = [s for s in self.scheduler.waiting if s.lane == lane]
        wait = self._estimated_wait(lane)
        retry = max(1.0, wait / max(1, len(in_lane)))  # about when the first one ahead leaves
        limit = self.config.lane_max_waiting[lane]
        if len(in_lane) >= limit:
            raise QueueFullError(f"lane P{lane} has {len(in_lane)} requests waiting, its limit", retry_after_s=retry, lane=lane)
        share = max(1, int(limit * self.config.tenant_queue_share))
        if tenant_id is not None and sum(1 for s in in_lane if s.tenant_id == tenant_id) >= share:
            raise QueueFullError(
                f"this tenant already has {share} requests waiting in lane P{lane}, its share of the lane's queue",
                retry_after_s=retry, lane=lane,
            )
        timeout = self.config.lane_queue_timeout_s[lane]
        if wait > timeout:
            raise QueueFullError(
                f"lane P{lane} would make this request wait about {wait:.0f} s, over its {timeout:.0f} s queue timeout",
                retry_after_s=max(1.0, wait - timeout),
                lane=lane,
            )

    def _estimated_wait(self, lane: int) -> float:
        """Seconds until a new request of `lane` would be scheduled, in steps of recent length.

        Requests waiting ahead of it (its lane or a better one) are prefilled
        max_num_batched_tokens a step, then decode beside it: they hold it back only while no
        slot is left for it. Then it waits until enough running sequences finish, each after
        at most its remaining max_tokens steps (the estimate errs long: EOS comes sooner).
        Under the priority policy, running work of a worse lane does not hold a slot against
        it: the scheduler preempts that work for it.
        """
        config, scheduler = self.config, self.scheduler
        ahead = [s for s in scheduler.waiting if s.lane <= lane]
        steps = sum(s.num_tokens - s.num_computed_tokens for s in ahead) / config.max_num_batched_tokens
        holding = [s for s in scheduler.running if config.policy != "priority" or s.lane <= lane]
        needed = len(ahead) + 1 - (config.max_num_seqs - len(holding))  # slots that must free up first
        if needed > 0:
            remaining = sorted(s.params.max_tokens - s.num_output_tokens for s in holding)
            if needed <= len(remaining):
                steps += remaining[needed - 1]
            else:  # whole rounds of the queue ahead must finish too
                rounds = math.ceil((needed - len(remaining)) / config.max_num_seqs)
                steps += (remaining[-1] if remaining else 0) + rounds * max(s.params.max_tokens for s in ahead)
        return steps * self.step_s

    def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this engine has no tokenizer: send token ids", param="prompt")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise InvalidRequestError("prompt token ids must be integers", param="prompt")
            self.check_token_ids(token_ids)
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return token_ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its blocks are free before the next step. None if unknown or done."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        self.counters.aborted_requests += 1
        return self._output(seq, (), "", finished=True)

    def pause(self, request_id: str, paused: bool = True) -> bool:
        """Hold a request out of the steps (`paused`) or let it run again; it keeps its blocks
        and its place. False if the request is unknown or done."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        seq.paused = paused
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step -------------------------------------------------------------------------

    def note_arrival(self, tenant_id: str | None, lane: int) -> None:
        """A request of `tenant_id` in `lane` is on its way to add_request (any thread): a step
        in progress whose every row would make way for it is abandoned between two layers
        (_watch). Whoever adds requests clears `arrivals` when it takes them in."""
        self.arrivals.append((tenant_id, int(lane)))

    def step(self) -> list[RequestOutput]:
        started, began = time.perf_counter(), self.clock()
        schedule = self.scheduler.schedule()
        watch = self._watch(schedule, began)
        try:
            if watch is not None:
                self.model.interrupt = watch
            sampled = self.runner.run(schedule) if schedule.scheduled or schedule.swap_out else []
        except StepInterrupted as interrupted:
            self.block_manager.forget(schedule.cache_entered)
            now = self.clock()
            self.scheduler.sitting_out_took(now - began, now, interrupted.crowds)
            self.counters.steps_interrupted += 1
            return []
        except BaseException:
            # Blocks keyed ahead of a compute that never happened hold garbage: unkey them.
            self.block_manager.forget(schedule.cache_entered)
            raise
        finally:
            if watch is not None:
                self.model.interrupt = None
        now = self.clock()
        self.scheduler.sitting_out_took(now - began, now)
        if schedule.num_batched_tokens:
            # A slowly decaying peak, not an average: light load runs small batches, and their
            # rate says nothing of what the engine can do once a queue builds (an average
            # after one warm-up request refused work the engine would finish in time).
            elapsed = max(time.perf_counter() - started, 1e-6)
            self.tokens_per_s = max(schedule.num_batched_tokens / elapsed, 0.98 * self.tokens_per_s)
            self.step_s = elapsed if not self.step_s else 0.8 * self.step_s + 0.2 * elapsed
        outputs = self._timed_out_outputs(schedule) + self._postprocess(schedule, sampled)
        governor = self.scheduler.governor
        if governor is not None and schedule.scheduled and not schedule.swap_out and not schedule.swap_in and all(
                item.num_new_tokens == 1 and not item.catch_up for item in schedule.scheduled):
            # A decode-only step, timed on the engine's clock (a test's manual one is moved by its runner).
            governor.observe_step(sum(item.num_query_tokens for item in schedule.scheduled), self.clock() - began)
        return outputs

    def _watch(self, schedule, now: float) -> Callable[[], None] | None:
        """For a step whose rows all decode one token, on the CPU without speculation: a check
        the model makes between layers, which abandons the step (StepInterrupted) when a request
        has arrived that every row would make way for (Scheduler.makes_way). A newcomer otherwise
        waits for the step in flight before its own: a crowd's 16 decodes take ~40 ms on a 2-core
        Zen 4, against ~1.5 ms a layer. Abandoning loses nothing but the time: a decode step
        writes each row's keys and values at its next position, which the step run again writes
        the same; nothing is sampled or counted until the forward pass ends. The time lost is
        charged to the crowds' share (Scheduler._credit). Not on CUDA, whose steps run as graphs."""
        if (self.config.speculative != "off" or self.model.device.type != "cpu" or not schedule.scheduled
                or schedule.swap_out or schedule.swap_in or schedule.preempted or schedule.timed_out):
            return None
        arrivals, scheduler, seen, decodes = self.arrivals, self.scheduler, set(), []

        def watch() -> None:
            if not arrivals:
                return
            if not decodes:  # looked at once, and only in a step something arrived during
                decodes.append(all(
                    item.num_new_tokens == 1 and not item.draft and not item.num_draft and not item.catch_up
                    and item.seq.matcher is None and item.seq.num_computed_tokens == item.seq.num_tokens - 1
                    for item in schedule.scheduled))
            if not decodes[0]:
                return
            for tenant, lane in list(arrivals):
                if (tenant, lane) in seen:
                    continue
                seen.add((tenant, lane))
                crowds = scheduler.makes_way(schedule, tenant, lane, now, self.clock() - now)
                if crowds is not None:
                    raise StepInterrupted(crowds)

        return watch

    def _timed_out_outputs(self, schedule) -> list[RequestOutput]:
        outputs = []
        for seq in schedule.timed_out:
            del self.requests[seq.request_id]
            self.counters.finished_requests += 1
            timeout = self.config.lane_queue_timeout_s[seq.lane]
            out = self._output(seq, (), "", finished=True)
            outputs.append(replace(out, error=f"waited longer than lane P{seq.lane}'s queue timeout ({timeout:.0f} s)",
                                   error_kind="queue_timeout"))
        return outputs

    def _postprocess(self, schedule, sampled: list[SampledToken]) -> list[RequestOutput]:
        c = self.counters
        c.steps += 1
        c.computed_tokens += schedule.num_batched_tokens
        c.prefix_hit_tokens += schedule.num_prefix_hit_tokens
        by_seq: dict[int, list[SampledToken]] = {}
        for s in sampled:
            by_seq.setdefault(id(s.seq), []).append(s)
        for item in schedule.scheduled:
            item.seq.num_computed_tokens = item.start + item.num_new_tokens
            if item.num_draft:
                self._settle_draft(item, len(by_seq[id(item.seq)]) - 1)
        outputs = []
        for tokens in by_seq.values():
            outputs.append(self._emit(tokens[0].seq, tokens))
        return outputs

    def _settle_draft(self, item: ScheduledSeq, accepted: int) -> None:
        """The accepted draft tokens' keys and values are in the cache; the rejected ones' slots
        are not: their blocks go back, so none is ever keyed into the prefix cache."""
        seq = item.seq
        seq.num_computed_tokens += accepted
        # The draft model's cache holds its proposals' keys and values: the accepted ones stay.
        seq.draft_computed_tokens = min(seq.draft_computed_tokens, seq.num_computed_tokens)
        self.block_manager.release_tail(seq, seq.num_computed_tokens)
        if self.scheduler.governor is not None:
            self.scheduler.governor.observe_pass(seq, item.num_draft, accepted)
        c = self.counters
        c.spec_passes[seq.lane] += 1
        c.spec_draft_tokens[seq.lane] += item.num_draft
        c.spec_accepted_tokens[seq.lane] += accepted

    def _emit(self, seq: Sequence, sampled: list[SampledToken]) -> RequestOutput:
        """Append a step's tokens for `seq` (several when it speculated), up to the first that
        finishes it: nothing after a stop or the length limit is emitted or counted."""
        emitted, texts, reason, error = [], [], None, None
        for s in sampled:
            seq.append_token(s.token_id)
            emitted.append(s.token_id)
            self.counters.generated_tokens += 1
            if s.logprob is not None:
                seq.pending_logprobs.append(s.logprob)
            reason = self._stop_reason(seq, s.token_id)
            if seq.matcher is not None:
                reason, error = self._grammar_step(seq, s.token_id, reason)
            text, reason = self._text_delta(seq, s.token_id, reason)
            texts.append(text)
            if reason is not None:
                break
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self.requests[seq.request_id]
            self.counters.finished_requests += 1
        out = self._output(seq, tuple(emitted), "".join(texts), finished=reason is not None)
        return replace(out, error=error, error_kind="grammar") if error else out

    @staticmethod
    def _grammar_step(seq: Sequence, token_id: int, reason: str | None) -> tuple[str | None, str | None]:
        """Advance the grammar by the sampled token: "stop" where the grammar ends, "error" with
        a message where it cannot go on (no token was allowed, or its own limits were hit)."""
        matcher = seq.matcher
        try:
            consumed = guarded(matcher.consume_token, token_id)
        except GrammarEngineFailure as exc:
            return "error", f"structured output failed: {exc}"
        if not consumed or matcher.is_error():
            detail = matcher.get_error() or "no token could continue the output"
            return "error", f"structured output reached a dead end: {detail[:300]}"
        if matcher.is_stopped():
            return reason or "stop", None
        return reason, None

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        p = seq.params
        if token_id in seq.eos_token_ids or token_id in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _text_delta(self, seq: Sequence, token_id: int, reason: str | None) -> tuple[str, str | None]:
        """Text to release for this token, holding back what could still become a stop string."""
        detok = seq.detokenizer
        if detok is None:
            return "", reason
        is_stop_token = token_id in seq.eos_token_ids or token_id in seq.params.stop_token_ids
        if not is_stop_token:
            detok.push((token_id,))
        if reason is not None:
            detok.flush()
        text, sent = detok.text, seq.text_sent
        end = len(text)
        if seq.stop_matcher is not None:
            hit = seq.stop_matcher.feed(text)
            if hit:
                i, s = hit
                end = i + len(s) if seq.params.include_stop_str_in_output else i
                reason = "stop"
            elif reason is None:
                end -= seq.stop_matcher.holdback()
        delta = text[sent:end] if end > sent else ""
        seq.text_sent = max(sent, end)
        return delta, reason

    def _output(self, seq: Sequence, token_ids: tuple[int, ...], text: str, finished: bool) -> RequestOutput:
        logprobs = tuple(seq.pending_logprobs)
        seq.pending_logprobs.clear()
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            logprobs=logprobs,
        )

    # -- offline use and introspection ---------------------------------------------------------

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Run every prompt to completion; results in the order of `prompts`."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{id(self)}-{i}" for i in range(len(prompts))]
        seqs = [self.add_request(rid, p, sp, admission_control=False) for rid, p, sp in zip(ids, prompts, params_list)]
        texts = {rid: [] for rid in ids}
        logprobs = {rid: [] for rid in ids}
        while any(not s.is_finished for s in seqs):
            for out in self.step():
                texts[out.request_id].append(out.new_text)
                logprobs[out.request_id].extend(out.logprobs)
        return [
            Completion(
                request_id=s.request_id,
                prompt_token_ids=tuple(s.prompt_token_ids),
                token_ids=tuple(s.output_token_ids),
                text="".join(texts[s.request_id]),
                finish_reason=s.finish_reason,
                num_cached_tokens=s.num_cached_tokens,
                logprobs=tuple(logprobs[s.request_id]),
            )
            for s in seqs
        ]

    def stats(self) -> EngineStats:
        bm = self.block_manager
        c = self.counters
        sched = self.scheduler
        now = self.clock()
        # One pass over each queue (the batch lane's may hold thousands): this runs every step.
        waiting, aged_up = Counter(), Counter()
        paused = sum(s.paused for s in sched.running) + sum(s.paused for s in sched.swapped)
        for seq in sched.waiting:
            waiting[seq.lane] += 1
            paused += seq.paused
            if sched.policy.effective_lane(seq, now) < seq.lane:
                aged_up[seq.lane] += 1
        running, swapped = Counter(s.lane for s in sched.running), Counter(s.lane for s in sched.swapped)
        lanes = {lane: LaneStats(waiting=waiting[lane], running=running[lane], swapped=swapped[lane], aged_up=aged_up[lane],
                                 spec_passes=c.spec_passes[lane], spec_draft_tokens=c.spec_draft_tokens[lane],
                                 spec_accepted_tokens=c.spec_accepted_tokens[lane])
                 for lane in Lane}
        return EngineStats(
            lanes=MappingProxyType(lanes),
            running=len(sched.running),
            waiting=len(sched.waiting),
            swapped=len(sched.swapped),
            paused=paused,
            blocks_total=bm.num_blocks,
            blocks_free=bm.num_free_blocks,
            blocks_used=bm.num_used_blocks,
            blocks_cached=bm.num_cached_blocks,
            block_size=bm.block_size,
            swap_blocks_total=bm.swap.num_blocks,
            swap_blocks_used=bm.swap.num_used_blocks,
            preemptions=sched.num_preemptions,
            preemptions_recompute=sched.preemptions["recompute"],
            preemptions_swap=sched.preemptions["swap"],
            steps_interrupted=c.steps_interrupted,
            tokens_per_s=self.tokens_per_s,
            steps=c.steps,
            prompt_tokens=c.prompt_tokens,
            computed_tokens=c.computed_tokens,
            prefix_hit_tokens=c.prefix_hit_tokens,
            generated_tokens=c.generated_tokens,
            finished_requests=c.finished_requests,
            aborted_requests=c.aborted_requests,
        )
