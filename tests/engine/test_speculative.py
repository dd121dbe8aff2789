"""Speculative decoding on tiny random-weight models: prompt lookup, exact rejection sampling,
rollback of rejected tokens, and the sequences and steps that do not speculate."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference.engine.api import ConfigError, Lane, SamplingParams
from inference.engine.engine import LLMEngine, LoadedModel
from inference.engine.config import EngineConfig
from inference.engine.model_runner import ModelRunner
from inference.engine.sampler import draw, filter_probs
from inference.engine.scheduler import ScheduledSeq, SchedulerOutput
from inference.engine.speculative import RETRY_AFTER_STEPS, Governor, propose_ngram, verify
from tests.engine.tiny import (TINY, ManualClock, greedy_params, live_seqs, one_thread, run_to_completion,  # noqa: F401
                               smol_tokenizer, tiny_engine, tiny_model, tokens_of)

# The tiny model falls into short loops, so prompt lookup finds drafts it partly accepts.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3], [5, 9, 11, 5, 9, 11, 5, 9], [3] * 5,
           list(range(1, 30)), [7, 8, 7, 8, 7]]


def outputs_of(engine: LLMEngine, prompts=PROMPTS, params=greedy_params(40), lane=Lane.NEAR_REALTIME) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, lane=lane)
    outputs = run_to_completion(engine)
    engine.block_manager.check_invariants(live_seqs(engine))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return {rid: tokens_of(outs) for rid, outs in outputs.items()}


def ngram_engine(**overrides) -> LLMEngine:
    """Proposing from 1-token matches: a tiny random model's 40 tokens rarely repeat three."""
    return tiny_engine(**{"speculative": "ngram", "num_speculative_tokens": 4, "ngram_min": 1, **overrides})


def draft_engine(draft_seed: int = 0, **overrides) -> LLMEngine:
    """Drafting with the target's own weights (seed 0, which agrees with it on every token) or
    another tiny model's (which rarely does)."""
    return tiny_engine(**{"speculative": "draft", "num_speculative_tokens": 4, "draft": tiny_model(draft_seed), **overrides})


# -- prompt lookup ---------------------------------------------------------------------------


def test_prompt_lookup_copies_what_followed_the_latest_occurrence_of_the_longest_suffix():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    # [9, 2, 3] does not recur, [2, 3] does: the shorter suffix is looked up next.
    assert propose_ngram([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]
    # The latest occurrence wins over an earlier one.
    assert propose_ngram([3, 7, 3, 8, 3], 2) == [8, 3]
    # Fewer than k tokens follow it: what there is.
    assert propose_ngram([4, 6, 4], 5) == [6, 4]
    assert propose_ngram([1, 2, 3], 4) == [] and propose_ngram([5], 4) == []
    # Token ids whose bytes overlap another's (256 = 00 01 ..., 1 = 01 00 ...) match only whole.
    assert propose_ngram([256, 1, 256, 1, 5, 1], 4) == [5, 1]
    # Only the window is searched.
    far = [9, 1] + [2] * 10 + [9]
    assert propose_ngram(far, 1) == [1] and propose_ngram(far, 1, window=8) == []


def test_prompt_lookup_proposes_nothing_from_a_match_shorter_than_ngram_min():
    # [5, 2, 3] does not recur; [2, 3] does, and [3] does.
    tokens = [1, 2, 3, 4, 6, 3, 7, 5, 2, 3]
    assert propose_ngram(tokens, 2, n_min=1) == [4, 6]
    assert propose_ngram(tokens, 2, n_min=2) == [4, 6]
    assert propose_ngram(tokens, 2, n_min=3) == []
    assert propose_ngram([8, 6, 3, 7, 5, 3], 2, n_min=1) == [7, 5]  # the latest [3]
    assert propose_ngram([8, 6, 3, 7, 5, 3], 2, n_min=2) == []
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 2, n_min=3) == [4, 1]


@pytest.mark.parametrize("value", [0, 4])
def test_an_ngram_min_outside_1_to_3_is_refused_naming_the_setting(value):
    with pytest.raises(ConfigError) as err:
        EngineConfig(speculative="ngram", ngram_min=value)
    assert err.value.setting == "ngram_min"


# -- greedy: token for token what decoding without speculation gives -------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_each_row_of_a_verifying_pass_has_the_logits_its_decode_step_would_have_bit_for_bit(dtype):
    # Greedy output with speculation is then the same as without it whatever the dtype. In bf16
    # the prefill kernel's other summing order moved the packaged model's greedy output off the
    # unspeculated one's on 5 of 6 chat prompts.
    prompt, draft = [5, 9, 11, 5, 9, 11, 5, 9, 3, 7, 8, 2, 6, 1, 4, 10, 12], (11, 5, 9, 4)

    def prefilled():
        engine = ngram_engine(model=tiny_model(dtype=dtype))
        seq = engine.add_request("s", prompt, greedy_params(8))
        engine.block_manager.allocate(seq, len(prompt) + len(draft))
        engine.runner._logits([ScheduledSeq(seq, 0, len(prompt) - 1)])
        seq.num_computed_tokens = len(prompt) - 1
        return engine.runner, seq

    runner, seq = prefilled()
    _, rows, verified = runner._logits([ScheduledSeq(seq, len(prompt) - 1, 1, len(draft), draft)])
    assert rows == [0] and verified.shape[0] == len(draft) + 1

    runner, seq = prefilled()
    decoded = []
    for token in (None, *draft):
        if token is not None:
            seq.append_token(token)
        start = seq.num_tokens - 1
        decoded.append(runner._logits([ScheduledSeq(seq, start, 1)])[2][0])
        seq.num_computed_tokens = start + 1
    assert torch.equal(verified, torch.stack(decoded))


@pytest.mark.parametrize("k", [1, 4, 16])
def test_greedy_output_is_token_identical_to_no_speculation_and_drafts_are_both_accepted_and_rejected(k):
    off = outputs_of(tiny_engine())
    engine = ngram_engine(num_speculative_tokens=k)
    assert outputs_of(engine) == off
    stats = engine.stats()
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens > 0
    assert stats.lane(Lane.NEAR_REALTIME).spec_passes == stats.spec_passes > 0


def test_accepted_drafts_save_steps_and_the_stats_add_up():
    off_engine, engine = tiny_engine(), ngram_engine()
    assert outputs_of(engine) == outputs_of(off_engine)
    off, spec = off_engine.stats(), engine.stats()
    assert spec.generated_tokens == off.generated_tokens == 40 * len(PROMPTS)
    assert spec.steps < off.steps
    assert spec.spec_acceptance_rate == spec.spec_accepted_tokens / spec.spec_draft_tokens
    assert spec.spec_tokens_per_pass == 1 + spec.spec_accepted_tokens / spec.spec_passes
    # Every draft token went through the model beside the decodes.
    assert spec.computed_tokens == off.computed_tokens + spec.spec_draft_tokens - spec.spec_accepted_tokens


@pytest.mark.parametrize("lane", [Lane.NEAR_REALTIME, Lane.BATCH], ids=["recompute", "swap"])
def test_preemption_while_speculating_changes_no_token(lane):
    # 20 blocks of 4 tokens cannot hold five sequences of up to 69 tokens at once.
    off_engine, engine = tiny_engine(num_blocks=20), ngram_engine(num_blocks=20)
    off = outputs_of(off_engine, lane=lane)
    assert outputs_of(engine, lane=lane) == off
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.spec_accepted_tokens > 0
    assert (stats.preemptions_swap > 0) == (lane == Lane.BATCH)


def test_abort_in_the_middle_of_speculation_frees_every_block():
    engine = ngram_engine()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy_params(40))
    while engine.stats().spec_passes < 5:
        engine.step()
    for i in range(len(PROMPTS)):
        engine.abort(f"r{i}")
    engine.block_manager.check_invariants(live_seqs(engine))
    assert engine.stats().blocks_free == engine.stats().blocks_total


def test_a_paused_sequence_neither_decodes_nor_speculates():
    engine = ngram_engine()
    engine.add_request("a", PROMPTS[0], greedy_params(40))
    engine.add_request("b", PROMPTS[1], greedy_params(40))
    engine.step()
    engine.pause("a")
    seq = engine.requests["a"]
    before = seq.num_tokens
    for _ in range(5):
        engine.step()
    assert seq.num_tokens == before
    engine.pause("a", False)
    run_to_completion(engine)


# -- what the rejected tokens leave behind ---------------------------------------------------


def test_no_prefix_cache_block_holds_a_rejected_token():
    """A follow-up whose prompt is the first request's prompt and output hits the cache for the
    same tokens, and reads the same keys and values, as without speculation."""
    runs = {}
    for mode in ("off", "ngram"):
        engine = tiny_engine(speculative=mode, ngram_min=1)
        (first,) = engine.generate([PROMPTS[0]], greedy_params(45))
        assert mode == "off" or engine.stats().spec_draft_tokens > engine.stats().spec_accepted_tokens
        (second,) = engine.generate([list(first.prompt_token_ids + first.token_ids)], greedy_params(20))
        kv = engine.runner.kv_cache
        blocks = {key: kv[:, :, block].clone() for key, block in engine.block_manager.cached.items()}
        runs[mode] = first.token_ids, second.token_ids, second.num_cached_tokens, blocks
    (off_first, off_second, off_cached, off_blocks), (first, second, cached, blocks) = runs["off"], runs["ngram"]
    assert (first, second, cached) == (off_first, off_second, off_cached) and cached >= 48
    assert blocks.keys() == off_blocks.keys()
    for key, values in blocks.items():
        assert torch.allclose(values, off_blocks[key], atol=1e-5), "a cached block holds other keys and values"


def test_rejected_positions_give_their_blocks_back():
    engine = ngram_engine(num_speculative_tokens=16)
    engine.add_request("a", PROMPTS[2], greedy_params(60))
    bm = engine.block_manager
    while engine.has_unfinished():
        engine.step()
        seq = engine.requests.get("a")
        if seq is not None:
            # As after a decode without speculation: blocks for the computed tokens, no more.
            assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
    assert engine.stats().spec_draft_tokens > engine.stats().spec_accepted_tokens


# -- cut where the request ends --------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7])
def test_max_tokens_cuts_the_accepted_run_exactly(max_tokens):
    off = outputs_of(tiny_engine(), params=greedy_params(max_tokens))
    engine = ngram_engine()
    assert outputs_of(engine, params=greedy_params(max_tokens)) == off
    assert all(len(tokens) == max_tokens for tokens in off.values())
    assert engine.stats().generated_tokens == max_tokens * len(PROMPTS)


def test_a_stop_token_inside_an_accepted_run_ends_it_there():
    off = outputs_of(tiny_engine())["r2"]
    stop = off[12]
    params = dataclasses.replace(greedy_params(40), stop_token_ids=(stop,))
    engine = ngram_engine()
    engine.add_request("r", PROMPTS[2], params)
    outs = run_to_completion(engine)["r"]
    assert tokens_of(outs) == off[: off.index(stop) + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens == off.index(stop) + 1
    assert engine.stats().generated_tokens == off.index(stop) + 1


def test_a_stop_string_inside_an_accepted_run_cuts_the_text_and_the_tokens_there():
    def run(mode: str, stop: tuple[str, ...] = ()):
        config = EngineConfig(num_blocks=64, block_size=4, speculative=mode, swap_space_bytes=0)
        engine = LLMEngine(config, LoadedModel(tiny_model(), smol_tokenizer()), clock=ManualClock())
        (done,) = engine.generate([PROMPTS[2]], dataclasses.replace(greedy_params(40), stop=stop))
        return done, engine.stats()

    full, _ = run("off")
    # This prompt's text ends "...9999940000000000000", in runs that prompt lookup drafts well.
    at = full.text.rindex("9") + 1
    stop = full.text[at : at + 4]
    want, _ = run("off", (stop,))
    got, stats = run("ngram", (stop,))
    assert want.finish_reason == got.finish_reason == "stop" and stop not in want.text
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    assert stats.spec_accepted_tokens > 0 and stats.generated_tokens == len(want.token_ids)


# -- the draft length that pays ---------------------------------------------------------------


def seq_after(governor: Governor, passes: list[tuple[int, int]]):
    """A sequence whose verifying passes, in order, proposed and accepted these many drafts."""
    seq = tiny_engine().add_request("g", [1, 2, 3], greedy_params(8))
    for proposed, accepted in passes:
        governor.observe_pass(seq, proposed, accepted)
    return seq


def measured(governor: Governor, seconds_for_rows) -> Governor:
    for rows in range(1, 6):
        governor.observe_step(rows, seconds_for_rows(rows))
    return governor


# Step times of int4 SmolLM2 batch-1 on a 2-core Zen 4 EPYC, 1-5 rows.
ZEN4_STEP_S = [0.0065, 0.008, 0.0096, 0.0112, 0.015]


def test_a_sequences_expected_tokens_follow_its_last_passes_run_by_run():
    governor = Governor(4)
    fresh = seq_after(governor, [])
    assert governor.expected_tokens(fresh, 0) == 1 and governor.expected_tokens(fresh, 1) == 1.5  # even odds
    # A quote taken whole two passes in three: 66% of drafts accepted, and those in runs, so
    # 4 drafts give 1 + 4 x 2/3 tokens a pass, not the 2.6 of independent 2/3 chances.
    quoting = seq_after(governor, [(4, 4), (4, 4), (4, 0)] * 6)
    assert 3.1 < governor.expected_tokens(quoting, 4) < 3.7
    assert governor.expected_tokens(quoting, 1) < 1.75
    # Its last passes count most: ten rejections in a row bring it far below even odds.
    for _ in range(10):
        governor.observe_pass(quoting, 4, 0)
    assert governor.expected_tokens(quoting, 1) < 1.3


def test_the_governor_speculates_until_it_has_measured_then_proposes_what_pays():
    seq = seq_after(Governor(4), [(4, 2)])
    assert Governor(4).width([seq]) == 4  # nothing measured yet: try, and measure
    # A verifying row costing what a decode does never pays; rows nearly free always do.
    assert measured(Governor(4), lambda rows: 0.006 * rows).width([seq]) == 0
    assert measured(Governor(4), lambda rows: 0.006 + 0.0001 * rows).width([seq]) == 4
    zen4 = measured(Governor(4), lambda rows: ZEN4_STEP_S[rows - 1])
    # Quoting its context two passes in three: 3 drafts a step (4 cost the fifth row's jump).
    quoting = seq_after(zen4, [(4, 4), (4, 4), (4, 0)] * 6)
    rates = [zen4.expected_tokens(quoting, k) / zen4.step_time(1 + k) for k in range(5)]
    assert zen4.width([quoting]) == 3 == max(range(5), key=rates.__getitem__)
    # A third of first drafts right (chat): one draft pays a little; a fifth: none does.
    assert zen4.width([seq_after(zen4, [(4, 0), (4, 0), (4, 1)] * 6)]) == 1
    assert zen4.width([seq_after(zen4, [(4, 1), (4, 0), (4, 0), (4, 0), (4, 0)] * 4)]) == 0
    # A row count not measured is interpolated; past the widest measured, its slope goes on.
    assert zen4.step_time(7) == pytest.approx(0.015 + 2 * 0.0038)
    half = Governor(4)
    half.observe_step(1, 0.006), half.observe_step(5, 0.010)
    assert half.step_time(3) == pytest.approx(0.008)


def test_a_sequence_whose_drafts_stopped_paying_is_tried_again_some_steps_on():
    governor = measured(Governor(4), lambda rows: 0.006 + 0.0015 * (rows - 1))
    seq = seq_after(governor, [(4, 0)] * 10)
    widths = [governor.width([seq]) for _ in range(30)]
    assert widths[0] == 0 and 0 < widths[-1]
    assert 3 <= widths.index(next(w for w in widths if w))  # the stale counts age toward even odds first
    # A sequence that may not speculate gets no drafts whatever the estimate.
    opted_out = tiny_engine().add_request("o", [1, 2], dataclasses.replace(greedy_params(8), speculative=False))
    assert governor.width([opted_out]) == 0


def test_where_a_pass_costs_several_steps_a_sequence_that_missed_is_tried_again_at_full_width():
    """A draft model's 4 proposals and their verifying pass took 3.7x a decode step: even odds
    never pay there, and a summary whose first two passes missed (1 of 8 drafts) decoded the
    rest of its 128 tokens unspeculated where runs that began well accepted 80%."""
    governor = measured(Governor(4), lambda rows: 0.013 + 0.00875 * (rows - 1))
    seq = seq_after(governor, [(4, 1), (4, 0)])
    widths = [governor.width([seq]) for _ in range(RETRY_AFTER_STEPS)]
    assert widths == [0] * (RETRY_AFTER_STEPS - 1) + [4]
    governor.observe_pass(seq, 4, 3)  # the retry's drafts pay: the estimate follows from here
    assert governor.width([seq]) > 0


class CostedRunner(ModelRunner):
    """The real runner, moving the engine's manual clock by what a step of its rows would cost."""

    def __init__(self, clock: ManualClock, cost, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock, self.cost = clock, cost

    def run(self, schedule: SchedulerOutput):
        self.clock.advance(self.cost(sum(item.num_query_tokens for item in schedule.scheduled)))
        return super().run(schedule)


def costed(cost, **overrides) -> tuple[LLMEngine, ManualClock]:
    clock = ManualClock()
    engine = tiny_engine(clock=clock, make_runner=lambda *a, **kw: CostedRunner(clock, cost, *a, **kw), max_num_seqs=1,
                         **overrides)
    return engine, clock


@pytest.mark.parametrize("row_cost", [0.010, 0.0001], ids=["rows-cost-like-decodes", "rows-nearly-free"])
def test_adaptive_speculation_is_never_much_slower_than_none_and_as_fast_as_fixed_where_drafts_pay(row_cost):
    def cost(rows):
        return 0.010 + row_cost * (rows - 1)

    times, outputs = {}, {}
    for name, overrides in {"off": {}, "fixed": {"speculative": "ngram", "ngram_min": 1, "speculative_adaptive": False},
                            "adaptive": {"speculative": "ngram", "ngram_min": 1}}.items():
        engine, clock = costed(cost, **overrides)
        outputs[name] = outputs_of(engine)
        times[name] = clock.now
    assert outputs["adaptive"] == outputs["fixed"] == outputs["off"]
    if row_cost == 0.010:  # a pass over 4 drafts costs 4 decodes: fixed speculation loses
        assert times["fixed"] > 1.2 * times["off"]
        assert times["adaptive"] < 1.1 * times["off"]
    else:  # drafts cost next to nothing: whatever is accepted is saved
        assert times["fixed"] < 0.95 * times["off"]
        assert times["adaptive"] < 1.02 * times["fixed"]
    print(f"{row_cost * 1000:g} ms a row: " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in times.items()))


# -- who speculates, and when ----------------------------------------------------------------


class RecordingRunner(ModelRunner):
    """The real runner, keeping each step's drafts per request."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drafts: list[dict[str, int]] = []

    def run(self, schedule: SchedulerOutput):
        self.drafts.append({item.seq.request_id: len(item.draft) for item in schedule.scheduled})
        return super().run(schedule)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, speculative=False),
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.2),
    SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, presence_penalty=0.5, seed=1),
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2),
], ids=["opt-out", "repetition-penalty", "presence-penalty", "logprobs"])
def test_a_request_that_opts_out_or_needs_each_token_in_turn_never_speculates(params):
    engine = ngram_engine(make_runner=RecordingRunner)
    engine.add_request("no", PROMPTS[2], params)
    engine.add_request("yes", PROMPTS[2], greedy_params(30))
    run_to_completion(engine)
    assert not any(step.get("no") for step in engine.runner.drafts)
    assert any(step.get("yes") for step in engine.runner.drafts)


def test_a_full_batch_turns_speculation_off_for_the_step():
    engine = ngram_engine(make_runner=RecordingRunner, speculative_max_batch=2)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, greedy_params(20 + 10 * i))
    run_to_completion(engine)
    for step in engine.runner.drafts:
        if len(step) > 2:  # three decoding: a compute-bound batch
            assert not any(step.values())
    assert any(step.get("r2") for step in engine.runner.drafts if len(step) == 1)


def test_speculation_takes_no_block_another_sequence_needs():
    # Five 5-block sequences in 26 blocks: a draft that crossed into a sixth block would preempt.
    engine = ngram_engine(num_blocks=26, num_speculative_tokens=16, make_runner=RecordingRunner)
    prompts = [[3] * 5] * 5
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy_params(15))
    run_to_completion(engine)
    assert engine.stats().preemptions == 0


def test_a_seeded_sampled_request_speculates_the_same_way_every_time():
    params = SamplingParams(temperature=0.7, max_tokens=40, ignore_eos=True, seed=7)
    runs = [outputs_of(ngram_engine(), params=params)["r2"] for _ in range(2)]
    alone = ngram_engine()
    alone.add_request("r2", PROMPTS[2], params)
    assert runs[0] == runs[1] == tokens_of(run_to_completion(alone)["r2"])


@pytest.mark.parametrize("drafting", ["ngram", "draft-is-target", "other-draft"])
def test_a_seeded_sampled_request_gets_the_tokens_it_gets_without_speculation(drafting):
    """A seed fixes the text whether the server speculates or not and whatever width each pass
    has: the governor sizes passes by measured step times, so by load, and a live server's
    seeded reply changed from one request to the next."""
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, ignore_eos=True, seed=11)
    want = outputs_of(tiny_engine(), params=params)
    make = {"ngram": ngram_engine, "draft-is-target": draft_engine,
            "other-draft": lambda **o: draft_engine(draft_seed=1, **o)}[drafting]
    for k in (1, 4):
        engine = make(num_speculative_tokens=k)
        assert outputs_of(engine, params=params) == want, k
        stats = engine.stats()
        assert stats.spec_draft_tokens > 0, k
        if drafting != "other-draft":
            assert stats.spec_accepted_tokens > 0, k


# -- a draft model ---------------------------------------------------------------------------


@pytest.mark.parametrize("draft_seed", [0, 1], ids=["draft-is-target", "other-draft"])
def test_a_draft_models_greedy_output_is_token_identical(draft_seed):
    engine = draft_engine(draft_seed)
    assert outputs_of(engine) == outputs_of(tiny_engine())
    stats = engine.stats()
    if draft_seed == 0:
        # Its cache caught up on every prompt and bonus token: it proposes what the target picks.
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    else:
        assert stats.spec_draft_tokens > stats.spec_accepted_tokens


@pytest.mark.parametrize("lane", [Lane.NEAR_REALTIME, Lane.BATCH], ids=["recompute", "swap"])
def test_the_draft_models_cache_survives_preemption(lane):
    engine = draft_engine(num_blocks=20)
    assert outputs_of(engine, lane=lane) == outputs_of(tiny_engine(num_blocks=20), lane=lane)
    stats = engine.stats()
    assert stats.preemptions > 0 and (stats.preemptions_swap > 0) == (lane == Lane.BATCH)
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0


def test_a_prefix_cache_hit_is_recomputed_by_the_draft_model():
    engine = draft_engine()
    (first,) = engine.generate([PROMPTS[3]], greedy_params(20))
    (second,) = engine.generate([list(first.prompt_token_ids + first.token_ids)], greedy_params(20))
    assert second.num_cached_tokens >= 44
    stats = engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0


class WorkRecorder(ModelRunner):
    """The real runner, keeping each step's work per request: (id, target query tokens, the
    draft model's catch-up, draft tokens reserved)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.work: list[list[tuple[str, int, int, int]]] = []

    def run(self, schedule: SchedulerOutput):
        self.work.append([(item.seq.request_id, item.num_query_tokens, item.catch_up, item.num_draft)
                          for item in schedule.scheduled])
        return super().run(schedule)


def test_the_draft_models_catch_up_is_charged_to_the_steps_budget_and_spread_over_steps():
    """With the packaged model as its own int4 draft, thirty sequences that started speculating
    together fed their whole prompts to the draft model in one step, outside the token budget,
    and the aborts of clients that had left waited over a second for it. A step's target tokens
    and draft catch-up now stay within max_num_batched_tokens; a lag that does not fit is
    computed in part, proposing nothing, and no output token changes."""
    budget = 48
    prompts = [[(7 * i + j) % 50 + 1 for j in range(6)] for i in range(8)]  # all prefilled in one step
    engine = draft_engine(max_num_batched_tokens=budget, max_num_seqs=16, speculative_max_batch=16,
                          make_runner=WorkRecorder)
    got = outputs_of(engine, prompts=prompts, params=greedy_params(12))
    assert got == outputs_of(tiny_engine(max_num_batched_tokens=budget, max_num_seqs=16), prompts=prompts,
                             params=greedy_params(12))
    for step in engine.runner.work:
        assert sum(tokens + catch_up for _, tokens, catch_up, _ in step) <= budget, step
    assert any(catch_up and not drafted for step in engine.runner.work for _, _, catch_up, drafted in step)
    stats = engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0


def test_sampling_with_the_targets_own_weights_as_draft_accepts_every_token():
    """p == q (the same filters on the same logits): min(1, p / q) is 1 for every proposal."""
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=40, ignore_eos=True, seed=5)
    engine = draft_engine()
    outputs_of(engine, params=params)
    stats = engine.stats()
    assert stats.spec_accepted_tokens >= 0.99 * stats.spec_draft_tokens > 0


def test_a_draft_model_with_another_vocabulary_fails_the_engine_start_naming_it():
    other = tiny_model(0, dataclasses.replace(TINY, vocab_size=80))
    with pytest.raises(ConfigError, match="INFERENCE_DRAFT_MODEL") as caught:
        tiny_engine(speculative="draft", draft=other)
    assert caught.value.setting == "draft_model"


def test_the_draft_models_cache_shares_the_kv_memory():
    config = dict(num_blocks=None, kv_cache_bytes=1 << 20)
    alone, drafted = tiny_engine(**config).block_manager.num_blocks, draft_engine(**config).block_manager.num_blocks
    assert drafted == alone // 2


# -- rejection sampling: the emitted tokens are distributed as the target's ------------------

DRAWS = 10_000


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed `counts` against `probs` (tokens expected under 5 times pooled)."""
    expected = probs * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    expected = torch.cat([expected[big], expected[~big].sum()[None]]).double()
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def target_rows(prompt: list[int], draft: tuple[int, ...], params: SamplingParams):
    """The runner's verifying pass over `prompt` with `draft` after it: the scheduled item, its
    logits at the 1 + k positions, and the plain next-token logits of the prompt."""
    engine = ngram_engine()
    seq = engine.add_request("s", prompt, params)
    engine.block_manager.allocate(seq, len(prompt) + len(draft))
    item = ScheduledSeq(seq, 0, len(prompt), len(draft), draft)
    items, rows, logits = engine.runner._logits([item])
    _, plain = engine.runner.compute_logits(SchedulerOutput((ScheduledSeq(seq, 0, len(prompt)),), (), len(prompt), 0))
    return engine.runner, items, rows, logits, plain


def test_prompt_lookup_drafts_leave_the_sampled_distribution_the_targets():
    params = SamplingParams(temperature=0.9, top_k=40, max_tokens=8, seed=3)
    prompt = [5, 9, 11, 5, 9]
    probe = target_rows(prompt, (), params)
    p0 = filter_probs(probe[4].float(), [probe[1][0].seq])[0]
    p0 = p0 / p0.sum()
    # Draft the second likeliest token first (accepted about as often as it is right), then the
    # second position's likeliest.
    d0 = int(p0.argsort(descending=True)[1])
    runner, items, rows, logits, plain = target_rows(prompt, (d0, 0), params)
    assert torch.allclose(logits[0], plain[0], atol=1e-5), "the verifying pass changed the target's first distribution"
    p1 = filter_probs(logits[1:2].float(), [items[0].seq])[0]
    p1 = p1 / p1.sum()
    d1 = int(p1.argmax())
    items = [dataclasses.replace(items[0], draft=(d0, d1))]
    items[0].seq.generator = torch.Generator().manual_seed(0)
    first, second = torch.zeros(TINY.vocab_size), torch.zeros(TINY.vocab_size)
    lengths = torch.zeros(4)
    with torch.inference_mode():
        for _ in range(DRAWS):
            tokens = [t.token_id for t in runner._verify(items, rows, logits, {})[0]]
            first[tokens[0]] += 1
            lengths[len(tokens)] += 1
            if tokens[0] == d0:
                second[tokens[1]] += 1
    assert first[p0 == 0].sum() == 0 and second[p1 == 0].sum() == 0
    assert chi_square_p(first, p0) > 0.01
    assert chi_square_p(second, p1) > 0.01
    assert lengths[3] > 0 and lengths[1] > 0  # both drafts accepted (a bonus token), and the first rejected


def test_a_draft_models_proposals_leave_the_sampled_distribution_the_targets():
    """q from another tiny model: x ~ q is accepted with min(1, p(x) / q(x)), else the token
    comes from norm(max(0, p - q)); either way it is distributed as p."""
    params = SamplingParams(temperature=1.0, max_tokens=8)
    prompt = [5, 9, 11, 5, 9]
    target = target_rows(prompt, (), params)
    p = filter_probs(target[4].float(), [target[1][0].seq])[0]
    other = LLMEngine(EngineConfig(num_blocks=16, block_size=4, swap_space_bytes=0),
                      LoadedModel(tiny_model(seed=1)), clock=ManualClock())
    seq = other.add_request("q", prompt, params)
    _, q_logits = other.runner.compute_logits(other.scheduler.schedule())
    q = filter_probs(q_logits.float(), [seq])[0]
    assert (p - q / q.sum()).abs().sum() > 0.5, "the draft should disagree with the target"
    generator = torch.Generator().manual_seed(0)
    counts, accepted = torch.zeros(TINY.vocab_size), 0
    for _ in range(DRAWS):
        x = int(draw(q[None], [generator])[0])
        tokens = verify(torch.stack([p, p]), q[None], [x], generator)
        counts[tokens[0]] += 1
        accepted += len(tokens) == 2
    assert chi_square_p(counts, p / p.sum()) > 0.01
    assert 0 < accepted < DRAWS
