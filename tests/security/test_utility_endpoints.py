"""vLLM's utility endpoints (/tokenize, /detokenize) do a tokenizer's work for a tenant: up to
MAX_PROMPT_CHARS of text each (256K characters by default: ~0.1-0.2 s of CPU). Served like Django's other sync views, on the
one thread Django runs them all on under ASGI, a tenant's burst of them queued every other
tenant's files, batches and usage requests behind it. They run on a pool of their own.

Tenants (tests/isolation_env.py): "tokenizer" sends the burst; "tokenizer-bystander" lists its
files meanwhile.
"""
from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.live import LiveServer

pytestmark = pytest.mark.slow

TIMEOUT_S = 120  # a hang guard, never a timing assertion
BURST = 100


def test_a_burst_of_tokenize_calls_does_not_queue_another_tenants_requests_behind_it(hostile_live: LiveServer):
    text = "tokenize this sentence, please, " * 2000  # 64,000 characters: the live server's MAX_PROMPT_CHARS
    key = hostile_live.keys["tokenizer"]
    answered: list[float] = []
    statuses: list[int] = []
    lock = threading.Lock()

    def tokenize() -> None:
        response = requests.post(hostile_live.url + "/tokenize", json={"prompt": text},
                                 headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT_S)
        with lock:
            statuses.append(response.status_code)
            answered.append(time.monotonic())

    burst = [threading.Thread(target=tokenize) for _ in range(BURST)]
    for thread in burst:
        thread.start()
    time.sleep(0.3)  # the burst is in: its requests wait for the server's tokenizer
    files = requests.get(hostile_live.url + "/v1/files", timeout=TIMEOUT_S,
                         headers={"Authorization": f"Bearer {hostile_live.keys['tokenizer-bystander']}"})
    listed_at = time.monotonic()
    for thread in burst:
        thread.join(TIMEOUT_S)
    assert files.status_code == 200, files.text
    assert statuses == [200] * BURST
    # Ordered, not timed: queued behind the burst on one thread, the list came after all of it.
    waited_for = sum(1 for at in answered if at < listed_at)
    assert waited_for < BURST - 25, f"another tenant's files list was answered after {waited_for} of {BURST} tokenize calls"
