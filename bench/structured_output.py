"""What structured output costs batched decoding: 64 json_schema requests against the same 64
unconstrained, in one run, on the real model.

The constrained pass runs first (greedy, a person-record schema with nested objects, an enum,
an array and an optional field); each request's output length is then forced on the
unconstrained pass (ignore EOS, max_tokens = that length), so both passes compute the same
tokens in the same batch shapes and the ratio is the grammar's cost alone: masks filled by
llguidance on a thread of their own while the model runs, then applied to the logits.

Prints `structured vs unconstrained: <ratio>x` (tokens/s, target >= 0.85x) and the per-step
mask time with all 64 rows constrained (the fill on its thread, and the part of it the step
waited for after the forward pass).

    .venv/bin/python bench/structured_output.py            # about a minute on 2 cores
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference.engine import structured  # noqa: E402
from inference.engine.api import Grammar, SamplingParams  # noqa: E402
from inference.engine.config import EngineConfig  # noqa: E402
from inference.engine.engine import LLMEngine  # noqa: E402

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "role", "skills", "address", "nickname"],
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["engineer", "artist", "doctor", "teacher", "scientist", "other"]},
        "skills": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                    "properties": {"city": {"type": "string"}, "country": {"type": "string"}}},
        "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
}
WHO = ["a mathematician from London", "a painter from Mexico City", "a nurse in Sydney", "a physicist in Paris",
       "a teacher in Oslo", "an engineer from Bangalore", "an artist from Edo", "a doctor in Nairobi"]
PENALTY = 1.3  # a 135M model loops inside arrays without one (see tests/serving/test_structured_output.py)


class RecordedMasks(structured.MaskJob):
    """The runner's mask job, timed per step: (rows, seconds to fill)."""

    steps: list[tuple[int, float]] = []

    def wait(self):
        bitmask = super().wait()
        RecordedMasks.steps.append((bitmask.shape[0], self.seconds))
        return bitmask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    engine = LLMEngine.from_config(EngineConfig(max_num_seqs=max(64, args.requests)))
    tok = engine.tokenizer
    prompts = [tok.render_chat([{"role": "user", "content": f"Describe person {i}, {WHO[i % len(WHO)]}, as a record."}])
               for i in range(args.requests)]
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    engine.grammars.matcher(grammar)  # compiled once, as a server would have it cached
    structured.MaskJob = RecordedMasks  # the runner looks the class up on the module at each step
    warm = engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8))
    assert all(c.token_ids for c in warm)

    runner = engine.runner
    before = (runner.masked_steps, runner.mask_s, runner.mask_wait_s)
    RecordedMasks.steps.clear()
    started = time.perf_counter()
    constrained = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                          repetition_penalty=PENALTY, grammar=grammar))
    constrained_s = time.perf_counter() - started
    steps = runner.masked_steps - before[0]
    fill_s, wait_s = runner.mask_s - before[1], runner.mask_wait_s - before[2]
    full = [s for rows, s in RecordedMasks.steps if rows == args.requests]

    lengths = [len(c.token_ids) for c in constrained]
    started = time.perf_counter()
    free = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                    repetition_penalty=PENALTY) for n in lengths])
    free_s = time.perf_counter() - started
    assert [len(c.token_ids) for c in free] == lengths

    tokens = sum(lengths)
    parsed = sum(1 for c in constrained if _parses(c.text))
    stopped = sum(1 for c in constrained if c.finish_reason == "stop")
    print(f"requests: {args.requests}, generated tokens per pass: {tokens} (outputs {min(lengths)}-{max(lengths)}), "
          f"constrained documents that parse: {parsed}/{args.requests} ({stopped} ended by the grammar)")
    print("| pass | seconds | tokens/s |")
    print("|---|---|---|")
    print(f"| unconstrained | {free_s:.2f} | {tokens / free_s:.1f} |")
    print(f"| json_schema | {constrained_s:.2f} | {tokens / constrained_s:.1f} |")
    print(f"mask fill per step: {1000 * fill_s / max(steps, 1):.2f} ms mean over {steps} steps; with all "
          f"{args.requests} rows constrained: {1000 * statistics.median(full) if full else float('nan'):.2f} ms median "
          f"over {len(full)} steps; waited for after the forward pass: {1000 * wait_s / max(steps, 1):.2f} ms a step")
    print(f"structured vs unconstrained: {free_s / constrained_s:.2f}x")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
