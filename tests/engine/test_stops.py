"""Stop strings: the incremental matcher releases exactly the text the old brute-force check
released (a search of the recent text and every prefix of every stop tested against the
text's end), and its work per token does not grow with the stop strings' length."""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.engine.config import EngineConfig
from inference.engine.api import SamplingParams
from inference.engine.engine import LLMEngine, LoadedModel
from inference.engine.stops import StopMatcher
from tests.engine.tiny import TINY, one_thread, run_to_completion, smol_tokenizer, tiny_model  # noqa: F401


def reference_release(text: str, sent: int, stops: tuple[str, ...], include: bool, reason: str | None):
    """The engine's stop check before the fix (quadratic in the stop length): (end, reason)."""
    end = len(text)
    window = max(0, sent - max(len(s) for s in stops) + 1)
    hits = [(i, s) for s in stops if (i := text.find(s, window)) != -1]
    if hits:
        i, s = min(hits)
        return (i + len(s) if include else i), "stop"
    if reason is None:
        end -= max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return end, reason


def matcher_release(matcher: StopMatcher, text: str, include: bool, reason: str | None):
    """What `LLMEngine._text_delta` does with the matcher (kept in step with it)."""
    end = len(text)
    hit = matcher.feed(text)
    if hit:
        i, s = hit
        return (i + len(s) if include else i), "stop"
    if reason is None:
        end -= matcher.holdback()
    return end, reason


def released(release, chunks, final_at):
    """Stream `chunks` (each token's text) through `release`; the deltas and how it ended."""
    text, sent, deltas = "", 0, []
    for step, chunk in enumerate(chunks):
        text += chunk
        reason = "length" if step == final_at else None
        end, reason = release(text, sent, reason)
        deltas.append(text[sent:end] if end > sent else "")
        sent = max(sent, end)
        if reason is not None:
            return deltas, reason
    return deltas, None


# A two-letter alphabet makes overlaps, repeats and self-overlapping stops ("aba", "aa") common.
_stops = st.lists(st.text("ab", min_size=1, max_size=5), min_size=1, max_size=4).map(tuple)
_chunks = st.lists(st.text("abc", max_size=3), min_size=1, max_size=30)


@settings(max_examples=1500, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(stops=_stops, chunks=_chunks, include=st.booleans(), final_at=st.integers(0, 40))
def test_matcher_releases_what_the_brute_force_check_released(stops, chunks, include, final_at):
    matcher = StopMatcher(stops)
    ours = released(lambda text, sent, reason: matcher_release(matcher, text, include, reason), chunks, final_at)
    theirs = released(lambda text, sent, reason: reference_release(text, sent, stops, include, reason), chunks, final_at)
    assert ours == theirs


# -- in the engine (the real SmolLM2 tokenizer over a tiny model of its vocabulary) ----------


@lru_cache(maxsize=None)
def _text_engine_parts():
    tok = smol_tokenizer()
    return tiny_model(0, dataclasses.replace(TINY, vocab_size=tok.vocab_size, num_layers=1)), tok


def _text_engine() -> LLMEngine:
    model, tok = _text_engine_parts()
    config = EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    return LLMEngine(config, LoadedModel(model, tok))


class CountingStr(str):
    """A stop string that counts the characters read out of it by indexing or slicing."""

    reads = 0

    def __getitem__(self, key):
        piece = super().__getitem__(key)
        CountingStr.reads += len(piece)
        return piece


def test_stop_check_work_per_token_does_not_grow_with_the_stop_length():
    """Four long stop strings that never match: the characters the engine reads out of them
    are their length once (the tables) plus a few per generated character, not their length
    squared per token (2 million characters a token here before the fix)."""
    length, tokens = 2000, 16
    stops = [CountingStr("\x00" + "q" * (length - 2) + chr(1 + i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, stop=stops)
    engine = _text_engine()
    CountingStr.reads = 0
    engine.add_request("long-stops", "Hello there", params)
    outputs = run_to_completion(engine)["long-stops"]
    assert outputs[-1].finish_reason == "length"
    text = "".join(o.new_text for o in outputs)
    assert CountingStr.reads <= 4 * (2 * length + 4 * (len(text) + tokens))


def test_text_held_back_for_a_possible_stop_is_released_when_it_cannot_be_one():
    free = run_to_completion(_with(_text_engine(), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))["r"]
    free_text = "".join(o.new_text for o in free)
    # A stop that starts like the text's opening but then differs: its prefix is held back
    # while it could still match, then released; the whole text arrives, no earlier, no later.
    stop = free_text[:3] + "\x00"
    outputs = run_to_completion(_with(_text_engine(), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                     stop=[stop])))["r"]
    assert "".join(o.new_text for o in outputs) == free_text
    assert outputs[-1].finish_reason == "length"


def _with(engine: LLMEngine, params: SamplingParams) -> LLMEngine:
    engine.add_request("r", "Hello there", params)
    return engine


def test_the_engine_refuses_stop_work_past_its_own_ceilings_whatever_the_caller():
    """The API's bounds are lower; the engine holds its own for any other caller."""
    from inference.engine.errors import InvalidRequestError
    from inference.engine.api import MAX_STOP_TOTAL_CHARS, MAX_STOP_TOKEN_IDS

    SamplingParams(stop=["x" * (MAX_STOP_TOTAL_CHARS // 4)] * 4, stop_token_ids=[1] * MAX_STOP_TOKEN_IDS)
    for too_much in ({"stop": ["x" * 260_000] * 4}, {"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}):
        try:
            SamplingParams(**too_much)
        except InvalidRequestError as exc:
            assert exc.param == next(iter(too_much))
        else:
            raise AssertionError(f"accepted {next(iter(too_much))}")
