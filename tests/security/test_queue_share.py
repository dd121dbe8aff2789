"""One tenant cannot fill a lane's waiting queue: past its share (INFERENCE["TENANT_QUEUE_SHARE"]
of the lane's limit) its requests are refused with a 429 `lane_full` and a Retry-After, while
another tenant's requests still queue in the same lane.

The real engine (a tiny random-weight model) with the platform's settings turned into its config
the way the platform does it (inference.host.engine_config), and the API's answer to its refusal
(inference.streaming.engine_error)."""
from __future__ import annotations

import dataclasses

from django.conf import settings

from inference.engine.engine import LLMEngine, LoadedModel
from inference.engine.errors import QueueFullError
from inference.engine.api import SamplingParams
from inference.host import engine_config
from inference.streaming import engine_error
from tests.engine.tiny import ManualClock, one_thread, run_to_completion, tiny_model  # noqa: F401

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def platform_engine(lane_max_waiting: tuple[int, int, int]) -> LLMEngine:
    # The platform's configuration, with a model and a queue small enough to fill in a test.
    config = dataclasses.replace(engine_config(), num_blocks=256, block_size=4, max_num_seqs=4,
                                 max_num_batched_tokens=64, lane_max_waiting=lane_max_waiting)
    return LLMEngine(config, LoadedModel(tiny_model()), clock=ManualClock())


def test_a_tenant_flooding_a_lane_is_refused_its_extra_requests_while_another_still_queues():
    limit = 10
    engine = platform_engine((limit, limit, limit))
    share = int(limit * settings.INFERENCE["TENANT_QUEUE_SHARE"])
    assert 1 <= share < limit

    accepted, refusals = 0, []
    for i in range(limit):  # as many as the whole lane holds
        try:
            engine.add_request(f"flood-{i}", [1, 2, 3], PARAMS, lane=1, tenant_id="flooder")
            accepted += 1
        except QueueFullError as exc:
            refusals.append(engine_error(exc))
    assert accepted == share
    assert len(refusals) == limit - share
    for error in refusals:
        assert error.status == 429 and error.body()["error"]["code"] == "lane_full"
        assert int(error.headers["Retry-After"]) >= 1

    # The bystander's requests still find room in the same lane, up to its own share.
    for i in range(share):
        engine.add_request(f"bystander-{i}", [4, 5, 6], PARAMS, lane=1, tenant_id="bystander")
    outputs = run_to_completion(engine)
    assert sum(1 for rid in outputs if rid.startswith("bystander")) == share
