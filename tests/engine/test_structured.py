"""Structured output in the engine: grammar masks from llguidance, applied in the sampler.

Random-weight models say anything, so whatever they produce under a grammar shows the mask at
work: a tiny Llama with SmolLM2's vocabulary (49,152 tokens) and the real tokenizer, so the
grammar sees real token texts.
"""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.engine import structured
from inference.engine.api import Grammar, InvalidRequestError, SamplingParams
from inference.engine.config import EngineConfig
from inference.engine.engine import LLMEngine, LoadedModel
from inference.engine.grammar import check
from inference.engine.models.llama import LlamaModel, ModelConfig, random_tensors
from tests.engine.tiny import ManualClock, one_thread, run_to_completion, smol_tokenizer, tokens_of

assert one_thread  # an autouse fixture: importing it is what applies it here

SMOL_VOCAB = 49152
WIDE = ModelConfig(vocab_size=SMOL_VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, max_position_embeddings=1024)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "artist", "doctor"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                    "required": ["city"], "additionalProperties": False},
        "nickname": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
    },
    "required": ["name", "age", "role", "tags", "address", "nickname"],
    "additionalProperties": False,
}


def person() -> Grammar:
    return Grammar("json_schema", json.dumps(PERSON))


_grammars: dict[str, structured.Grammars] = {}


def grammars() -> structured.Grammars:
    """One llguidance tokenizer for the module (building it takes about a second)."""
    if "smol" not in _grammars:
        tok = smol_tokenizer()
        _grammars["smol"] = structured.Grammars(tok.hf, SMOL_VOCAB, tok.eos_token_ids)
    return _grammars["smol"]


def wide_engine(**overrides) -> LLMEngine:
    model = LlamaModel(WIDE, random_tensors(WIDE, 0, std=0.5), torch.float32, torch.device("cpu"))
    config = EngineConfig(num_blocks=overrides.pop("num_blocks", 256), block_size=4, swap_space_bytes=1 << 20,
                          max_num_batched_tokens=256, **overrides)
    engine = LLMEngine(config, LoadedModel(model, smol_tokenizer()), clock=ManualClock())
    engine.grammars = grammars()  # share the compiled tokenizer and grammars between tests
    return engine


def text_of(outputs) -> str:
    return "".join(out.new_text for out in outputs)


# -- masks ------------------------------------------------------------------------------------


def _leaf():
    return st.one_of(
        st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n}),
        st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
            lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
        st.just({"type": "boolean"}),
        st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
        st.just({"type": "null"}),
    )


def _schema():
    leaf = _leaf()
    array = st.tuples(leaf, st.integers(0, 3)).map(lambda t: {"type": "array", "items": t[0], "maxItems": t[1]})
    field = st.one_of(leaf, array)
    return st.dictionaries(st.text("abcdefgh", min_size=1, max_size=6), field, min_size=1, max_size=4).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(lambda required: {
            "type": "object", "properties": props, "required": sorted(required), "additionalProperties": False}))


_BITS = torch.arange(32, dtype=torch.int32)


def _allowed(row: torch.Tensor) -> list[int]:
    return torch.nonzero(((row[:, None] >> _BITS) & 1).reshape(-1)[:SMOL_VOCAB]).flatten().tolist()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_schema(), seed=st.integers(0, 2**32 - 1))
def test_a_mask_never_allows_a_token_that_leaves_the_grammar(schema, seed):
    """A random walk through each random schema's masks: every allowed token picked is one the
    grammar accepts, and a walk that reaches the end is JSON that validates against the schema."""
    rng = random.Random(seed)
    grammar = Grammar("json_schema", json.dumps(schema))
    matcher = grammars().matcher(grammar)
    tokens: list[int] = []
    for _ in range(150):
        if matcher.is_stopped():
            break
        bitmask = structured.MaskJob([matcher], SMOL_VOCAB).wait()
        allowed = _allowed(bitmask[0])
        assert allowed, f"no token allowed after {tokens}"
        token = rng.choice(allowed)
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    if matcher.is_stopped():
        tok = smol_tokenizer()
        text = tok.hf.decode([t for t in tokens if t not in tok.eos_token_ids])
        jsonschema.validate(json.loads(text), schema)


def test_a_compiled_grammar_is_kept_by_its_key_and_each_request_gets_a_fresh_copy():
    g = grammars()
    before = g.compiled
    first = g.matcher(Grammar("json_schema", json.dumps({"type": "object", "properties": {"k": {"type": "boolean"}}})))
    second = g.matcher(Grammar("json_schema", json.dumps({"type": "object", "properties": {"k": {"type": "boolean"}}})))
    assert g.compiled == before + 1
    assert first.consume_token(smol_tokenizer().hf.encode("{")[0])
    # The copy handed to the second request did not move with the first's token.
    assert second.validate_tokens(smol_tokenizer().hf.encode("{")) == 1


# The last: an integer past 64 bits, which llguidance's conversion refuses with a ValueError
# (schemathesis sent one in a tool's parameters, and it was a 500).
@pytest.mark.parametrize("schema, part", [({"type": "strnig"}, "strnig"), ({"not": {}}, "not"),
                                          ({"$ref": "#/defs/missing"}, "/defs/missing"),
                                          ({"enum": [-105628833314754707083036946201575424]}, "105628833314754707083036946201575424")])
def test_a_schema_the_grammar_engine_cannot_compile_is_refused_naming_what(schema, part):
    with pytest.raises(InvalidRequestError) as caught:
        check(Grammar("json_schema", json.dumps(schema), param="response_format.json_schema.schema"))
    assert part in caught.value.message
    assert caught.value.param == "response_format.json_schema.schema"


# -- decoding ---------------------------------------------------------------------------------

def test_constrained_and_unconstrained_sequences_share_a_batch():
    """The constrained ones parse and validate; the unconstrained ones produce exactly the tokens
    they produce alone, so masks touch only their own rows."""
    alone = wide_engine()
    alone.add_request("free", "Hello there", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    expected = tokens_of(run_to_completion(alone)["free"])

    engine = wide_engine()
    for i in range(3):
        engine.add_request(f"json-{i}", f"Person {i}", SamplingParams(temperature=1.0, seed=i, max_tokens=160, grammar=person()))
    engine.add_request("free", "Hello there", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    engine.add_request("object", "Anything", SamplingParams(temperature=1.0, seed=9, max_tokens=160,
                                                             grammar=Grammar("json_object")))
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["free"]) == expected
    for i in range(3):
        assert outputs[f"json-{i}"][-1].finish_reason == "stop"
        jsonschema.validate(json.loads(text_of(outputs[f"json-{i}"])), PERSON)
    assert engine.runner.masked_steps > 0


def _person_run(params: SamplingParams, lane: int, preempt: bool) -> tuple[LLMEngine, list]:
    """The person request alone in a one-sequence batch; with `preempt`, a P0 request arrives
    mid-document and pushes it out (P2 work swaps to host memory, P1 work recomputes)."""
    engine = wide_engine(max_num_seqs=1)
    engine.add_request("person", "Tell me about a person", params, lane=lane)
    outputs = []
    for _ in range(6):
        outputs += [o for o in engine.step() if o.request_id == "person"]
    if preempt:
        engine.add_request("chat", "Hi", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), lane=0)
    return engine, outputs + run_to_completion(engine)["person"]


@pytest.mark.parametrize("lane, kind", [(1, "recompute"), (2, "swap")])
def test_a_preempted_constrained_sequence_resumes_its_grammar_exactly(lane, kind):
    """Preempted mid-document (its blocks freed and recomputed, or swapped to host and back), a
    constrained sequence produces the same tokens as one never preempted, and they validate."""
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=160, grammar=person())
    _, undisturbed = _person_run(params, lane, preempt=False)
    engine, outputs = _person_run(params, lane, preempt=True)
    assert getattr(engine.stats(), f"preemptions_{kind}") == 1
    assert tokens_of(outputs) == tokens_of(undisturbed)
    assert outputs[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(outputs)), PERSON)


def _generate(engine: LLMEngine, request_id: str, params: SamplingParams) -> list:
    engine.add_request(request_id, "Tell me about a person", params)
    return run_to_completion(engine)[request_id]


def test_an_aborted_constrained_request_leaves_the_next_with_a_fresh_grammar():
    engine = wide_engine()
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=160, grammar=person())
    engine.add_request("first", "Tell me about a person", params)
    for _ in range(5):
        engine.step()
    engine.abort("first")
    outputs = _generate(engine, "second", params)
    assert outputs[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(outputs)), PERSON)


def test_an_unsatisfiable_schema_is_refused_before_it_runs():
    impossible = Grammar("json_schema", json.dumps({"type": "integer", "minimum": 5, "maximum": 1}))
    with pytest.raises(InvalidRequestError, match="minimum"):
        wide_engine().add_request("impossible", "Pick a number", SamplingParams(max_tokens=20, grammar=impossible))


def test_a_grammar_at_a_dead_end_ends_its_request_with_an_error_and_the_engine_serves_on():
    """A grammar that compiles but leads nowhere after its first token ("a", then a character
    class that matches nothing): that request ends with finish_reason "error" and says why; its
    neighbour in the batch finishes normally."""
    engine = wide_engine()
    impossible = Grammar("lark", 'start: "a" x\nx: /[^\\s\\S]/')
    engine.add_request("impossible", "Pick a number", SamplingParams(temperature=0, max_tokens=20, grammar=impossible))
    engine.add_request("fine", "Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outputs = run_to_completion(engine)
    last = outputs["impossible"][-1]
    assert last.finish_reason == "error" and last.error_kind == "grammar"
    assert "dead end" in last.error
    assert outputs["fine"][-1].finish_reason == "length"


def test_max_tokens_cuts_a_document_with_length():
    engine = wide_engine()
    engine.add_request("short", "Tell me", SamplingParams(temperature=1.0, seed=5, max_tokens=4, grammar=person()))
    outputs = run_to_completion(engine)
    assert outputs["short"][-1].finish_reason == "length"
    assert text_of(outputs["short"]).startswith('{"name": "')


def test_under_tool_choice_auto_text_is_free_and_a_started_call_is_held_to_its_schema():
    """Hermes format, tool_choice auto: the model's text is unconstrained until it writes
    <tool_call>; from there every allowed token keeps the call valid for the function's schema."""
    from inference.tool_calls import CallParser, Tools, grammar
    parameters = {"type": "object", "additionalProperties": False, "required": ["city"],
                  "properties": {"city": {"type": "string", "maxLength": 10}}}
    tools = Tools(({"name": "get_weather", "parameters": parameters},), "auto", parallel=False)
    tok = smol_tokenizer()
    rng = random.Random(5)
    for _ in range(5):
        matcher = grammars().matcher(grammar(tools))
        free = tok.hf.encode("Let me look that up. Zebra 42!")
        assert matcher.consume_tokens(free), matcher.get_error()  # any text at all
        tokens = tok.hf.encode("<tool_call>\n")
        assert matcher.consume_tokens(tokens), matcher.get_error()
        for _ in range(60):
            allowed = _allowed(structured.MaskJob([matcher], SMOL_VOCAB).wait()[0])
            # Once the call is closed the text is free again: stop at the closing tag.
            if tok.hf.decode(tokens).endswith("</tool_call>"):
                break
            token = rng.choice(allowed)
            assert matcher.consume_token(token), matcher.get_error()
            tokens.append(token)
        content, calls = CallParser().feed(tok.hf.decode(tokens), final=True)
        assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather", tok.hf.decode(tokens)
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), parameters)
