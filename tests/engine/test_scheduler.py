"""Scheduler, block pool and engine together, with a deterministic runner at the runner seam.

`SumRunner` picks next token = sum of the last 3 tokens mod vocab, so every
request's whole output is known in advance: a token lost or repeated by chunking,
preemption or prefix reuse shows up as a wrong token.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inference.engine.sequence import SequenceStatus
from tests.engine.tiny import expected_output, fake_runner, greedy_params as params, VOCAB, SumRunner, live_seqs, one_thread, run_to_completion, tiny_engine, tokens_of

assert one_thread  # an autouse fixture: importing it is what applies it here


def fake_engine(**kw):
    return tiny_engine(make_runner=fake_runner(SumRunner()), **kw)


def test_chunked_prefill_takes_four_steps_before_the_first_token():
    engine = fake_engine(num_blocks=64, block_size=16, max_num_batched_tokens=32, max_num_seqs=4)
    prompt = [i % VOCAB for i in range(100)]
    engine.add_request("long", prompt, params(3))

    firsts = []
    for _ in range(4):
        firsts.append(engine.step())
    counts = [[(s.start, s.num_new_tokens) for s in sch.scheduled] for sch in engine.runner.schedules]
    assert counts == [[(0, 32)], [(32, 32)], [(64, 32)], [(96, 4)]]
    assert [len(outs) for outs in firsts] == [0, 0, 0, 1]
    assert engine.stats().computed_tokens == 100

    outputs = run_to_completion(engine)
    decodes = [[s.num_new_tokens for s in sch.scheduled] for sch in engine.runner.schedules[4:]]
    assert decodes == [[1], [1]]
    assert tokens_of(firsts[3]) + tokens_of(outputs["long"]) == expected_output(prompt, 3)


def test_running_decodes_go_before_a_new_prefill_chunk():
    engine = fake_engine(num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    engine.add_request("first", [1, 2, 3], params(5))
    engine.step()
    engine.add_request("second", list(range(40)), params(1))
    engine.step()
    last = engine.runner.schedules[-1]
    assert [(s.seq.request_id, s.num_new_tokens) for s in last.scheduled] == [("first", 1), ("second", 15)]
    assert last.num_batched_tokens == 16


def test_admission_is_first_come_first_served():
    engine = fake_engine(max_num_seqs=1, max_num_batched_tokens=8)
    # Arrival times, not call order, decide.
    engine.add_request("b", [1, 2], params(2), arrival_time=2.0)
    engine.add_request("c", [3, 4], params(2), arrival_time=3.0)
    engine.add_request("a", [5, 6], params(2), arrival_time=1.0)
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["a", "b", "c"]


def test_nobody_overtakes_the_head_of_the_queue():
    engine = fake_engine(num_blocks=8, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    engine.add_request("holder", list(range(20)), params(8), arrival_time=0.0)
    engine.step()  # holder: 20 prompt tokens in 5 blocks, then a 21st token
    engine.add_request("big", [7] * 16, params(1), arrival_time=1.0)  # 4 blocks
    engine.add_request("small", [1], params(1), arrival_time=2.0)  # 1 block
    engine.step()  # holder's decode takes a 6th block: 2 left, enough for small but not for big
    assert [s.request_id for s in engine.scheduler.running] == ["holder"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["big", "small"]
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["big"]) == expected_output([7] * 16, 1)
    assert tokens_of(outputs["small"]) == expected_output([1], 1)
    assert engine.stats().blocks_free == 8


def test_preemption_by_recompute_when_the_pool_is_too_small():
    engine = fake_engine(num_blocks=8, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    prompts = {f"r{i}": [i, i + 1, i + 2, i + 3, i + 4, i + 5] for i in range(4)}
    seqs = {rid: engine.add_request(rid, p, params(10), arrival_time=float(i)) for i, (rid, p) in enumerate(prompts.items())}
    outputs = run_to_completion(engine)

    stats = engine.stats()
    assert stats.preemptions > 0
    assert any(s.num_preemptions for s in seqs.values())
    assert seqs["r0"].num_preemptions == 0  # the oldest is never the victim under FCFS
    for rid, prompt in prompts.items():
        assert tokens_of(outputs[rid]) == expected_output(prompt, 10)
        assert outputs[rid][-1].finish_reason == "length"
    assert stats.blocks_free == stats.blocks_total
    assert stats.running == stats.waiting == 0


def test_a_step_never_exceeds_the_sequence_budget():
    engine = fake_engine(num_blocks=64, max_num_batched_tokens=64, max_num_seqs=3)
    for i in range(7):
        engine.add_request(f"r{i}", [i + 1] * 5, params(4))
    while engine.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 3
        assert len(engine.runner.schedules[-1].scheduled) <= 3
    assert engine.stats().finished_requests == 7


# -- random interleavings ---------------------------------------------------------------------

PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9] * 8]
# A pool that four sequences overfill, so preemption is common.
NUM_BLOCKS, BLOCK_SIZE, TOKEN_BUDGET, MAX_SEQS = 10, 4, 16, 4


class EngineMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.engine = fake_engine(
            num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=TOKEN_BUDGET, max_num_seqs=MAX_SEQS
        )
        self.seqs = {}  # request id -> Sequence, every request ever added
        self.tokens = {}  # request id -> tokens streamed so far
        self.aborted = set()
        self.n = 0

    def _live_ids(self):
        return sorted(self.engine.requests)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 5), max_size=12),
        max_tokens=st.integers(1, 12),
        salt=st.sampled_from([None, None, "tenant-b"]),
    )
    def add_request(self, prefix, suffix, max_tokens, salt):
        prompt = (prefix + suffix) or [0]
        rid = f"r{self.n}"
        self.n += 1
        self.seqs[rid] = self.engine.add_request(rid, prompt, params(max_tokens), cache_salt=salt)
        self.tokens[rid] = []

    @rule(n=st.integers(1, 3))
    def step(self, n):
        for _ in range(n):
            self._step()

    def _step(self):
        before = len(self.engine.runner.schedules)
        for out in self.engine.step():
            self.tokens[out.request_id] += out.new_token_ids
        if len(self.engine.runner.schedules) == before:
            return
        self.engine.block_manager.check_invariants(live_seqs(self.engine))
        schedule = self.engine.runner.schedules[-1]
        counts = [s.num_new_tokens for s in schedule.scheduled]
        assert sum(counts) == schedule.num_batched_tokens <= TOKEN_BUDGET
        assert all(n >= 1 for n in counts)
        assert len({id(s.seq) for s in schedule.scheduled}) == len(counts) <= MAX_SEQS
        assert not set(map(id, schedule.preempted)) & {id(s.seq) for s in schedule.scheduled}

    @precondition(lambda self: self.engine.requests)
    @rule(i=st.integers(0, 100))
    def abort(self, i):
        ids = self._live_ids()
        rid = ids[i % len(ids)]
        out = self.engine.abort(rid)
        assert out.finished and out.finish_reason == "abort"
        self.aborted.add(rid)

    @invariant()
    def books_balance(self):
        engine = self.engine
        live = live_seqs(engine)
        engine.block_manager.check_invariants(live)
        stats = engine.stats()
        assert stats.blocks_free + stats.blocks_used == NUM_BLOCKS
        assert stats.running <= MAX_SEQS
        assert {s.request_id for s in live} == set(engine.requests)
        for rid, seq in self.seqs.items():
            if seq.is_finished:
                assert seq.block_table == [], f"{rid} finished but holds blocks"
                assert rid not in engine.requests
            else:
                assert seq.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING)
            if seq.status is SequenceStatus.WAITING:
                assert seq.block_table == []
            # What has streamed out so far is always a prefix of the right answer.
            assert self.tokens[rid] == expected_output(seq.prompt_token_ids, len(self.tokens[rid]))

    def teardown(self):
        for out_list in run_to_completion(self.engine).values():
            for out in out_list:
                self.tokens[out.request_id] += out.new_token_ids
        stats = self.engine.stats()
        assert stats.blocks_free == NUM_BLOCKS
        assert stats.running == stats.waiting == 0
        self.engine.block_manager.check_invariants([])
        for rid, seq in self.seqs.items():
            assert seq.is_finished
            if rid in self.aborted:
                assert seq.finish_reason == "abort"
                assert len(self.tokens[rid]) < seq.params.max_tokens
            else:
                assert seq.finish_reason == "length"
                assert self.tokens[rid] == expected_output(seq.prompt_token_ids, seq.params.max_tokens)
        assert stats.finished_requests + stats.aborted_requests == len(self.seqs)


EngineMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_engine_random_interleavings = EngineMachine.TestCase


# -- paused requests (a stream whose client stopped taking its tokens) --------------------------


def scheduled_ids(engine) -> list[str]:
    return [s.seq.request_id for s in engine.runner.schedules[-1].scheduled]


def test_a_paused_request_computes_nothing_keeps_its_blocks_and_resumes_where_it_stopped():
    engine = fake_engine(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    engine.add_request("stalled", [1, 2, 3], params(12))
    engine.add_request("other", [4, 5, 6], params(12))
    outputs: dict[str, list] = {}

    def step() -> None:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)

    for _ in range(3):
        step()
    assert engine.pause("stalled")
    blocks = list(engine.requests["stalled"].block_table)
    computed = engine.requests["stalled"].num_computed_tokens
    for _ in range(4):
        step()
        assert scheduled_ids(engine) == ["other"]
    held = engine.requests["stalled"]
    assert held.block_table == blocks and held.num_computed_tokens == computed  # nothing freed, nothing run
    assert engine.stats().paused == 1 and engine.stats().running == 2

    assert engine.pause("stalled", False)
    rest = run_to_completion(engine)
    for rid, prompt in (("stalled", [1, 2, 3]), ("other", [4, 5, 6])):
        assert tokens_of(outputs.get(rid, []) + rest[rid]) == expected_output(prompt, 12)
    assert engine.stats().paused == 0 and engine.stats().blocks_free == 64
    assert not engine.pause("stalled")  # finished: nothing to pause


def test_only_paused_requests_left_make_empty_steps_not_a_busy_batch():
    engine = fake_engine(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    engine.add_request("a", [1, 2, 3], params(8))
    engine.step()
    engine.pause("a")
    runs = len(engine.runner.schedules)
    assert engine.step() == [] and engine.step() == []
    assert len(engine.runner.schedules) == runs  # the model is not even called
    assert engine.has_unfinished()  # still there, holding its place


def test_a_paused_request_is_the_first_to_give_up_its_blocks():
    # 8 blocks of 4: "old" (arrived first) is paused holding 3; "new" needs more than the free ones.
    engine = fake_engine(num_blocks=8, block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    engine.add_request("old", list(range(11)), params(20), arrival_time=0.0)
    outputs = {"old": engine.step()}
    engine.pause("old")
    engine.add_request("new", [9] * 10, params(20), arrival_time=1.0)
    while engine.requests.get("new") is not None and engine.requests["new"].num_preemptions == 0 \
            and engine.requests["old"].num_preemptions == 0:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    # FCFS would preempt the latest arrival ("new"); the paused one goes instead.
    assert engine.requests["old"].num_preemptions == 1 and engine.requests["new"].num_preemptions == 0
    assert engine.requests["old"].paused  # preempted, still paused: it is not brought back in
    for _ in range(30):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert "old" in engine.requests and engine.requests["old"].status is SequenceStatus.WAITING
    engine.pause("old", False)
    rest = run_to_completion(engine)
    for rid, prompt in (("old", list(range(11))), ("new", [9] * 10)):
        assert tokens_of(outputs.get(rid, []) + rest.get(rid, [])) == expected_output(prompt, 20)
