"""Another tenant cannot confirm a guessed prompt through the prefix cache (issue 24, item 3):
tenant B sending tenant A's exact prompt is told of no cached tokens, on a default tier (where
B's prefill is really recomputed) and on a tier that shares its cache (where B reuses A's
blocks, the point of sharing, but `usage.prompt_tokens_details.cached_tokens` still says 0).

Tenants (tests/isolation_env.py): "cache-a" and "cache-b" on a default tier, "cache-sharing-a"
and "cache-sharing-b" on a tier with share_prefix_cache.
"""
from __future__ import annotations

import uuid

import requests

from tests.live import LiveServer

HANG_GUARD_S = 120  # a broken server fails the test instead of hanging it; never a timing assertion


def secret_prompt() -> str:
    # Opens with a value no other request of the session has, so only A can have cached it.
    words = " ".join(f"item-{i}" for i in range(150))
    return f"Ledger {uuid.uuid4().hex}, read it carefully: {words}. How many items?"


def send(live: LiveServer, tenant: str, prompt: str) -> tuple[dict, dict]:
    """(usage, engine stats counters moved by this request): the server is idle around it."""
    before = live.wait_idle(timeout=30)
    response = requests.post(
        live.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {live.keys[tenant]}"},
        json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}, timeout=HANG_GUARD_S,
    )
    assert response.status_code == 200, response.text[:500]
    after = live.wait_idle(timeout=30)
    moved = {name: after[name] - before[name] for name in ("prefix_hit_tokens", "computed_tokens")}
    return response.json()["usage"], moved


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_on_a_default_tier_another_tenants_exact_guess_finds_nothing_cached(hostile_live: LiveServer):
    prompt = secret_prompt()
    block = hostile_live.stats()["kv_block_size"]
    first, _ = send(hostile_live, "cache-a", prompt)
    prompt_tokens = first["prompt_tokens"]
    assert prompt_tokens > 4 * block

    guess, moved = send(hostile_live, "cache-b", prompt)
    assert cached(guess) == 0
    assert moved["prefix_hit_tokens"] == 0  # B's prefill was computed, not read from A's blocks
    assert moved["computed_tokens"] >= prompt_tokens

    again, moved = send(hostile_live, "cache-a", prompt)
    assert cached(again) >= prompt_tokens - block  # A's own repeat is told of its hit
    assert moved["prefix_hit_tokens"] == cached(again)


def test_on_a_sharing_tier_another_tenant_reuses_the_blocks_but_is_told_of_no_hit(hostile_live: LiveServer):
    prompt = secret_prompt()
    block = hostile_live.stats()["kv_block_size"]
    first, _ = send(hostile_live, "cache-sharing-a", prompt)
    prompt_tokens = first["prompt_tokens"]
    assert prompt_tokens > 4 * block

    guess, moved = send(hostile_live, "cache-sharing-b", prompt)
    assert cached(guess) == 0
    # Sharing still saves the prefill: every full block of A's prompt served B.
    assert moved["prefix_hit_tokens"] >= prompt_tokens - block
    assert moved["computed_tokens"] <= block

    # B's repeat is told of what its first request was served, as any prompt sent twice is:
    # a right guess sent twice reads like a wrong one sent twice.
    again, _ = send(hostile_live, "cache-sharing-b", prompt)
    assert cached(again) >= prompt_tokens - block
    own, _ = send(hostile_live, "cache-sharing-a", prompt)
    assert cached(own) >= prompt_tokens - block
