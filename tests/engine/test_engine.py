"""The engine end to end on a tiny random-weight Llama: what a caller of add_request / step sees."""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from inference.engine.config import EngineConfig
from inference.engine.engine import LLMEngine, LoadedModel
from inference.engine.errors import DuplicateRequestError, InvalidRequestError
from inference.engine.api import SamplingParams
from tests.engine.tiny import (
    GREEDY,
    TINY,
    VOCAB,
    one_thread,
    run_to_completion,
    smol_tokenizer,
    tiny_engine,
    tiny_model,
    tokens_of,
)

assert one_thread  # an autouse fixture: importing it is what applies it here


def random_prompts(n: int, seed: int, min_len: int = 1, max_len: int = 50) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def alone(prompt: list[int], params: SamplingParams = GREEDY, **engine_kw) -> list[int]:
    """The tokens `prompt` gets on an engine of its own."""
    return list(_alone(tuple(prompt), params, tuple(sorted(engine_kw.items()))))


@lru_cache(maxsize=None)
def _alone(prompt: tuple[int, ...], params: SamplingParams, engine_kw: tuple) -> tuple[int, ...]:
    engine = tiny_engine(**dict(engine_kw))
    engine.add_request("alone", list(prompt), params)
    return tuple(tokens_of(run_to_completion(engine)["alone"]))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def sampled(seed: int | None, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)


# -- same tokens whatever the company ---------------------------------------------------------


def test_greedy_output_is_the_same_alone_and_in_a_mixed_batch():
    prompts = random_prompts(10, seed=1)
    expected = [alone(p) for p in prompts]
    # A token budget below the longest prompt: prefills are chunked and share steps with decodes.
    engine = tiny_engine(num_blocks=128, max_num_batched_tokens=24, max_num_seqs=6)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    outputs = run_to_completion(engine)
    assert [tokens_of(outputs[f"r{i}"]) for i in range(len(prompts))] == expected
    assert len(set(map(tuple, expected))) > 1  # the model does not say the same thing to everyone


def test_greedy_output_survives_preemption():
    prompts = random_prompts(4, seed=2, min_len=10, max_len=14)
    params = greedy(16)
    expected = [alone(p, params) for p in prompts]
    # 4 sequences of up to 30 tokens want up to 32 blocks of 4; there are 16.
    engine = tiny_engine(num_blocks=16, max_num_batched_tokens=64, max_num_seqs=4)
    seqs = [engine.add_request(f"r{i}", p, params, arrival_time=float(i)) for i, p in enumerate(prompts)]
    outputs = run_to_completion(engine)
    assert seqs[-1].num_preemptions > 0
    assert engine.stats().preemptions > 0
    assert [tokens_of(outputs[f"r{i}"]) for i in range(4)] == expected
    assert engine.stats().blocks_free == 16


def test_seeded_sampling_is_the_same_alone_in_a_batch_and_after_preemption():
    prompt = random_prompts(1, seed=3, min_len=12, max_len=12)[0]
    expected = alone(prompt, sampled(seed=1234, max_tokens=16))

    engine = tiny_engine(num_blocks=16, max_num_batched_tokens=64, max_num_seqs=4)
    others = random_prompts(3, seed=4, min_len=10, max_len=14)
    engine.add_request("other-seeded", others[0], sampled(seed=7, max_tokens=16), arrival_time=0.0)
    engine.add_request("other-unseeded", others[1], sampled(seed=None, max_tokens=16), arrival_time=1.0)
    engine.add_request("other-greedy", others[2], greedy(16), arrival_time=2.0)
    me = engine.add_request("me", prompt, sampled(seed=1234, max_tokens=16), arrival_time=3.0)
    outputs = run_to_completion(engine)
    assert me.num_preemptions > 0
    assert tokens_of(outputs["me"]) == expected


def test_different_seeds_give_different_samples_and_the_same_seed_the_same():
    prompt = [5, 6, 7]
    a = alone(prompt, sampled(seed=1, max_tokens=16))
    assert alone(prompt, sampled(seed=1, max_tokens=16)) == a
    assert alone(prompt, sampled(seed=2, max_tokens=16)) != a


def test_chunked_prefill_gives_the_same_tokens_as_one_chunk():
    prompt = random_prompts(1, seed=5, min_len=100, max_len=100)[0]
    whole = alone(prompt, num_blocks=64, max_num_batched_tokens=128)
    engine = tiny_engine(num_blocks=64, max_num_batched_tokens=32)
    engine.add_request("chunked", prompt, GREEDY)
    first_token_step = None
    for step in range(1, 50):
        if engine.step():
            first_token_step = step
            break
    assert first_token_step == 4  # 32 + 32 + 32 + 4
    outputs = run_to_completion(engine)
    assert [whole[0]] + tokens_of(outputs["chunked"]) == whole


# -- prefix caching ---------------------------------------------------------------------------


def test_prefix_hit_computes_only_the_tokens_after_the_cached_blocks():
    rng = random.Random(6)
    shared = [rng.randrange(VOCAB) for _ in range(35)]
    first, second = shared + [1, 2, 3, 4, 5], shared + [6, 7, 8, 9, 10]
    params = greedy(4)
    engine = tiny_engine(num_blocks=64, block_size=16, max_num_batched_tokens=64)
    engine.add_request("first", first, params)
    run_to_completion(engine)
    before = engine.stats()

    engine.add_request("second", second, params)
    outputs = run_to_completion(engine)
    after = engine.stats()
    # Blocks 0 and 1 (32 tokens) come from the cache; 8 prompt tokens and 3 decodes are computed.
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 32
    assert after.computed_tokens - before.computed_tokens == 8 + 3
    assert outputs["second"][-1].num_cached_tokens == 32
    assert tokens_of(outputs["second"]) == alone(second, params, block_size=16, enable_prefix_caching=False)


def test_a_fully_cached_prompt_still_computes_its_last_block():
    prompt = random_prompts(1, seed=7, min_len=32, max_len=32)[0]
    params = greedy(4)
    engine = tiny_engine(num_blocks=64, block_size=16, max_num_batched_tokens=64)
    engine.add_request("first", prompt, params)
    expected = tokens_of(run_to_completion(engine)["first"])
    before = engine.stats()
    engine.add_request("again", prompt, params)
    outputs = run_to_completion(engine)
    after = engine.stats()
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 16
    assert after.computed_tokens - before.computed_tokens == 16 + 3
    assert tokens_of(outputs["again"]) == expected


def test_an_evicted_prefix_is_recomputed_to_the_same_tokens():
    prompt = random_prompts(1, seed=8, min_len=20, max_len=20)[0]
    params = greedy(4)
    engine = tiny_engine(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    engine.add_request("first", prompt, params)
    expected = tokens_of(run_to_completion(engine)["first"])
    # Fill the whole pool with something else: every cached block of "first" is evicted.
    engine.add_request("filler", random_prompts(1, seed=9, min_len=28, max_len=28)[0], greedy(4))
    run_to_completion(engine)
    before = engine.stats()
    engine.add_request("again", prompt, params)
    outputs = run_to_completion(engine)
    assert engine.stats().prefix_hit_tokens == before.prefix_hit_tokens
    assert tokens_of(outputs["again"]) == expected


def test_requests_sharing_a_prompt_in_the_same_step_get_their_own_answers():
    prompt = random_prompts(1, seed=14, min_len=37, max_len=37)[0]
    params = greedy(6)
    variants = {"twin-1": prompt, "twin-2": prompt, "longer": prompt + [1, 2, 3, 4, 5, 6], "shorter": prompt[:20]}
    engine = tiny_engine(num_blocks=64, block_size=4, max_num_batched_tokens=256)
    for rid, p in variants.items():
        engine.add_request(rid, p, params)
    outputs = run_to_completion(engine)
    for rid, p in variants.items():
        assert tokens_of(outputs[rid]) == alone(p, params), rid
    assert engine.stats().blocks_free == 64
    engine.block_manager.check_invariants([])


def test_different_cache_salts_share_no_block():
    prompt = random_prompts(1, seed=10, min_len=40, max_len=40)[0]
    params = greedy(6)
    engine = tiny_engine(num_blocks=64, block_size=16, max_num_batched_tokens=64)
    a = engine.add_request("tenant-a", prompt, params, cache_salt="tenant-a")
    engine.step()  # a's prompt is computed and its full blocks are cached
    b = engine.add_request("tenant-b", prompt, params, cache_salt="tenant-b")
    engine.step()
    assert a.block_table and b.block_table
    assert not set(a.block_table) & set(b.block_table)
    assert engine.stats().prefix_hit_tokens == 0
    outputs = run_to_completion(engine)
    assert engine.stats().prefix_hit_tokens == 0
    assert outputs["tenant-b"][-1].num_cached_tokens == 0

    # The control: the same tenant again does share.
    c = engine.add_request("tenant-a-again", prompt, params, cache_salt="tenant-a")
    engine.step()
    assert c.num_cached_tokens == 32
    assert engine.stats().prefix_hit_tokens == 32


def test_a_shared_salt_reuses_another_tenants_blocks_without_reporting_them():
    """Tenants of a sharing tier have one salt. B's guess of A's prompt reuses A's blocks
    (the prefill saved), yet B is told of no hit, and a right guess sent twice is told the
    same as a wrong one: cached_tokens cannot confirm A's prompt."""
    secret, wrong = random_prompts(2, seed=15, min_len=40, max_len=40)
    engine = tiny_engine(num_blocks=64, block_size=16, max_num_batched_tokens=64)

    def send(request_id: str, prompt: list[int], tenant: str) -> tuple[int, int]:
        hits = engine.stats().prefix_hit_tokens
        engine.add_request(request_id, prompt, greedy(2), cache_salt="shared-tier", tenant_id=tenant)
        told = run_to_completion(engine)[request_id][-1].num_cached_tokens
        return told, engine.stats().prefix_hit_tokens - hits

    assert send("a", secret, "A") == (0, 0)
    assert send("b-right", secret, "B") == (0, 32)  # reused, not reported
    assert send("b-right-again", secret, "B") == (32, 32)
    assert send("b-wrong", wrong, "B") == (0, 0)
    assert send("b-wrong-again", wrong, "B") == (32, 32)
    assert send("a-again", secret, "A") == (32, 32)
    engine.block_manager.check_invariants([])


# -- abort ------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps_before_abort", [1, 2, 5], ids=["mid-prefill", "prefill-done", "mid-decode"])
def test_abort_frees_every_block_and_the_engine_keeps_serving(steps_before_abort):
    prompt = random_prompts(1, seed=11, min_len=80, max_len=80)[0]
    engine = tiny_engine(num_blocks=64, block_size=4, max_num_batched_tokens=32)
    seq = engine.add_request("victim", prompt, greedy(20))
    neighbour = random_prompts(1, seed=12, min_len=6, max_len=6)[0]
    engine.add_request("neighbour", neighbour, greedy(20))
    early = []
    for _ in range(steps_before_abort):
        early += [t for out in engine.step() if out.request_id == "neighbour" for t in out.new_token_ids]
    assert seq.block_table

    out = engine.abort("victim")
    assert out.finished and out.finish_reason == "abort"
    assert seq.block_table == []
    assert engine.abort("victim") is None
    outputs = run_to_completion(engine)
    assert "victim" not in outputs
    assert engine.stats().blocks_free == 64
    assert engine.stats().aborted_requests == 1
    engine.block_manager.check_invariants([])
    assert early + tokens_of(outputs["neighbour"]) == alone(neighbour, greedy(20))

    good = random_prompts(1, seed=13)[0]
    engine.add_request("after", good, GREEDY)
    assert tokens_of(run_to_completion(engine)["after"]) == alone(good)


def test_abort_of_an_unknown_or_finished_request_is_a_no_op():
    engine = tiny_engine()
    assert engine.abort("never-seen") is None
    engine.add_request("done", [1, 2, 3], greedy(2))
    run_to_completion(engine)
    assert engine.abort("done") is None
    assert engine.stats().aborted_requests == 0
    assert engine.stats().finished_requests == 1


# -- validation -------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("max_tokens=-1", lambda: ([1, 2, 3], SamplingParams(max_tokens=-1)), "max_tokens"),
    ("max_tokens=0", lambda: ([1, 2, 3], SamplingParams(max_tokens=0)), "max_tokens"),
    ("top_p=0", lambda: ([1, 2, 3], SamplingParams(top_p=0)), "top_p"),
    ("top_p=1.5", lambda: ([1, 2, 3], SamplingParams(top_p=1.5)), "top_p"),
    ("temperature=nan", lambda: ([1, 2, 3], SamplingParams(temperature=math.nan)), "temperature"),
    ("empty-prompt", lambda: ([], GREEDY), "prompt"),
    ("token-id=vocab", lambda: ([1, VOCAB], GREEDY), "prompt"),
    ("token-id<0", lambda: ([1, -1], GREEDY), "prompt"),
    ("token-id-not-int", lambda: ([1, 2.0], GREEDY), "prompt"),
    ("text-without-tokenizer", lambda: ("hello", GREEDY), "prompt"),
    ("prompt+max_tokens>max_model_len", lambda: ([1] * 40, greedy(9)), "max_tokens"),
    ("prompt>=max_model_len", lambda: ([1] * 48, greedy(1)), "prompt"),
    ("more-than-the-kv-cache", lambda: ([1] * 30, greedy(10)), "max_tokens"),
]


@pytest.mark.parametrize("make, param", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_rejected_with_its_param_and_the_engine_keeps_serving(make, param):
    engine = tiny_engine(num_blocks=9, block_size=4, max_model_len=48)  # 36 tokens of KV cache
    before = engine.stats()
    with pytest.raises(InvalidRequestError) as err:
        prompt, params = make()
        engine.add_request("bad", prompt, params)
    assert err.value.param == param
    assert err.value.message
    assert "bad" not in engine.requests
    assert engine.stats() == before

    good = [3, 1, 4, 1, 5]
    engine.add_request("good", good, GREEDY)
    assert tokens_of(run_to_completion(engine)["good"]) == alone(good)


def test_duplicate_request_id_is_rejected_while_in_flight_only():
    engine = tiny_engine()
    engine.add_request("same", [1, 2, 3], greedy(3))
    with pytest.raises(DuplicateRequestError) as err:
        engine.add_request("same", [4, 5, 6], greedy(3))
    assert isinstance(err.value, InvalidRequestError)
    assert err.value.param == "request_id"
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["same"]) == alone([1, 2, 3], greedy(3))
    engine.add_request("same", [4, 5, 6], greedy(3))  # finished ids may be reused
    assert tokens_of(run_to_completion(engine)["same"]) == alone([4, 5, 6], greedy(3))


# -- how requests end -------------------------------------------------------------------------


def test_stop_token_ids_end_with_stop_and_max_tokens_with_length():
    prompt = [11, 22, 33]
    free_run = run_to_completion(_engine_with(prompt, greedy(12)))["r"]
    tokens = tokens_of(free_run)
    assert len(tokens) == 12 and free_run[-1].finish_reason == "length"
    assert [o.finished for o in free_run] == [False] * 11 + [True]

    stop = tokens[4]
    k = tokens.index(stop)
    stopped = run_to_completion(_engine_with(prompt, greedy(12, stop_token_ids=[stop])))["r"]
    assert tokens_of(stopped) == tokens[: k + 1]
    assert stopped[-1].finished and stopped[-1].finish_reason == "stop"


def test_eos_ends_a_request_unless_ignore_eos():
    prompt = [11, 22, 33]
    tokens = alone(prompt, greedy(12))
    eos = tokens[3]
    k = tokens.index(eos)
    model = tiny_model(0, dataclasses.replace(TINY, eos_token_ids=(eos,)))
    engine = LLMEngine(EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8), LoadedModel(model))
    engine.add_request("eos", prompt, SamplingParams(temperature=0, max_tokens=12))
    engine.add_request("ignore", prompt, greedy(12))
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["eos"]) == tokens[: k + 1]
    assert outputs["eos"][-1].finish_reason == "stop"
    assert tokens_of(outputs["ignore"]) == tokens


def _engine_with(prompt, params) -> LLMEngine:
    engine = tiny_engine()
    engine.add_request("r", prompt, params)
    return engine


# -- logprobs and penalties -------------------------------------------------------------------


def test_logprobs_give_n_sorted_alternatives_per_token():
    engine = tiny_engine()
    engine.add_request("greedy", [1, 2, 3], greedy(8, logprobs=5))
    engine.add_request("sampled", [4, 5, 6], SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, logprobs=3))
    engine.add_request("own-only", [7, 8, 9], greedy(8, logprobs=0))
    engine.add_request("none", [7, 8, 9], greedy(8))
    outputs = run_to_completion(engine)

    for rid, n in (("greedy", 5), ("sampled", 3), ("own-only", 0)):
        entries = [lp for out in outputs[rid] for lp in out.logprobs]
        assert [lp.token_id for lp in entries] == tokens_of(outputs[rid])
        for lp in entries:
            assert len(lp.top) == n
            assert lp.logprob <= 0
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
            assert all(v <= 0 for v in values)
            assert sum(math.exp(v) for v in values) <= 1 + 1e-5
            if n:
                assert lp.logprob <= values[0] + 1e-6
            if rid == "greedy":
                assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))
    assert all(out.logprobs == () for out in outputs["none"])


def _repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_frequency_penalty_reduces_repeats_in_greedy_output():
    prompt = [1, 2, 3]
    plain = alone(prompt, greedy(40))
    penalised = alone(prompt, greedy(40, frequency_penalty=2.0))
    assert _repeats(plain) > 0
    assert _repeats(penalised) < _repeats(plain)
    assert penalised != plain


@pytest.mark.parametrize("penalty", [{"presence_penalty": 2.0}, {"repetition_penalty": 3.0}, {"frequency_penalty": -2.0}])
def test_other_penalties_change_greedy_output(penalty):
    prompt = [1, 2, 3]
    plain = alone(prompt, greedy(40))
    penalised = alone(prompt, greedy(40, **penalty))
    assert penalised != plain
    if penalty.get("frequency_penalty", 0) < 0:
        assert _repeats(penalised) > _repeats(plain)
    else:
        assert _repeats(penalised) < _repeats(plain)


def test_stats_count_what_happened():
    engine = tiny_engine()
    engine.add_request("a", [1, 2, 3, 4, 5], greedy(3))
    engine.add_request("b", [6, 7], greedy(2))
    run_to_completion(engine)
    s = engine.stats()
    assert s.prompt_tokens == 7
    assert s.generated_tokens == 5
    assert s.computed_tokens == 7 + 2 + 1  # prompts, then the decodes of all but the last token
    assert s.finished_requests == 2
    assert s.running == s.waiting == 0
    assert s.blocks_free == s.blocks_total == 64


# -- text and stop strings (the real SmolLM2 tokenizer over a tiny model of its vocabulary) ------


@lru_cache(maxsize=None)
def _text_model():
    tok = smol_tokenizer()
    config = dataclasses.replace(TINY, vocab_size=tok.vocab_size, num_layers=1)
    return tiny_model(0, config), tok


def _text_engine() -> LLMEngine:
    model, tok = _text_model()
    return LLMEngine(EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8), LoadedModel(model, tok))


def _stream_text(engine: LLMEngine, request_id: str, prompt: str, params: SamplingParams):
    engine.add_request(request_id, prompt, params)
    outputs = run_to_completion(engine)[request_id]
    return "".join(o.new_text for o in outputs), outputs


def test_streamed_text_adds_up_to_the_decoded_tokens():
    engine = _text_engine()
    text, outputs = _stream_text(engine, "t", "Hello there", greedy(30))
    _, tok = _text_model()
    assert text == tok.decode(tokens_of(outputs))
    assert len(text) > 30


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_request_and_is_cut_from_the_text(include):
    free_text, _ = _stream_text(_text_engine(), "free", "Hello there", greedy(30))
    stop = free_text[40:46]  # six characters well inside the text, likely across a token boundary
    cut = free_text.index(stop)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
    text, outputs = _stream_text(_text_engine(), "stopped", "Hello there", params)
    assert text == free_text[: cut + (len(stop) if include else 0)]
    assert outputs[-1].finished and outputs[-1].finish_reason == "stop"
    assert len(tokens_of(outputs)) < 30


_WHERE_A_STEP_SIZED_BLOCK_LIVES = """
import ctypes, sys
if sys.argv[1] == "engine":
    from inference.engine.config import EngineConfig
    from inference.engine.engine import LLMEngine, LoadedModel
    from inference.engine.model_runner import keep_freed_memory
    from tests.engine.tiny import tiny_model
    LLMEngine(EngineConfig(num_blocks=16), LoadedModel(tiny_model()))
    assert keep_freed_memory()  # glibc on Linux, where the suite runs
libc = ctypes.CDLL("libc.so.6")
libc.sbrk.restype = libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
heap_start = next(int(line.split("-")[0], 16) for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
address = libc.malloc(24 << 20)  # a step's 24-MB activation (torch's CPU allocator takes its blocks from malloc)
heap_end = libc.sbrk(0)
libc.free(address)
print(heap_start <= address < heap_end, libc.sbrk(0) == heap_end)
"""


def test_a_step_sized_block_comes_from_the_heap_and_stays_there_when_freed():
    # A CPU engine has glibc keep freed memory: a step's activations, allocated and freed
    # every step, come back from the heap the last step left instead of freshly mapped
    # (faulting) pages. glibc's default maps a block this size afresh and unmaps it on
    # free (and trims a heap whose free top grows past 128 KB), so every step faulted its
    # activations in again: ~110,000 faults in bench/engine_throughput.py's offline run.
    # A fresh process each: the suite's own heap and threads are nothing to count on.
    def where_the_block_lives(setup: str) -> str:
        code = [sys.executable, "-c", _WHERE_A_STEP_SIZED_BLOCK_LIVES, setup]
        root = Path(__file__).resolve().parents[2]  # where `tests.engine.tiny` imports from
        return subprocess.run(code, check=True, capture_output=True, text=True, cwd=root).stdout.strip()

    assert where_the_block_lives("glibc-default") == "False True"  # mapped on its own
    assert where_the_block_lives("engine") == "True True"  # from the heap, which keeps it when freed
