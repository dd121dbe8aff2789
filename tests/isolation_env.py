"""Tiers, tenants and settings of the one live platform that tests/security/,
tests/reliability/ and tests/cluster/test_nginx.py share (the `hostile_live` fixture in
tests/conftest.py).

Each test module uses its own tenants, so one module's limits, leases and budgets never
leak into another's assertions. Keep every entry's comment naming the module that uses it.
"""

BIG = {"requests_per_minute": 100_000, "tokens_per_minute": 50_000_000, "concurrent_streams": 1000,
       "max_tokens_per_request": 512, "monthly_token_budget": 10**12}

TIERS: dict[str, dict] = {
    "hostile-p0": {"lane": 0, **BIG},
    "hostile-p1": {"lane": 1, **BIG},
    "hostile-p2": {"lane": 2, **BIG, "allow_batch": True},
    # tests/security/test_input_bounds.py: a tier whose own max_tokens lets n x max_tokens reach
    # the request bound (MAX_REQUEST_TOKENS) before the tier's limit does.
    "bounds-wide": {"lane": 1, **{**BIG, "max_tokens_per_request": 8192}},
    # tests/security/test_generation_slots.py: eight concurrent generations
    "slots-8": {"lane": 1, **{**BIG, "concurrent_streams": 8}},
    # tests/security/test_generation_slots.py: four generations, and a requests/min whose remainder
    # shows what a burst spent (it refills 5 a second)
    "inflight-4": {"lane": 1, **{**BIG, "concurrent_streams": 4, "requests_per_minute": 300}},
    # tests/security/test_budget_reservation.py: a budget a few replies spend
    "budget-100": {"lane": 1, **{**BIG, "monthly_token_budget": 100}},
    # tests/security/test_socket_reauth.py: a tier of its own to change under an open socket
    "reauth-tier": {"lane": 1, **BIG},
    # tests/security/test_zero_limits.py: an operator set a limit to 0
    "zero-rpm": {"lane": 1, **{**BIG, "requests_per_minute": 0}},
    "zero-tpm": {"lane": 1, **{**BIG, "tokens_per_minute": 0}},
    "zero-streams": {"lane": 1, **{**BIG, "concurrent_streams": 0}},
    # tests/reliability/test_slots_after_redis_blip.py: one generation at a time, long enough to
    # outlast the test's Redis outage (500 tokens ended inside it on a fast box)
    "one-slot": {"lane": 1, **{**BIG, "concurrent_streams": 1, "max_tokens_per_request": 4096}},
    # tests/security/test_prefix_cache_isolation.py: a tier whose tenants share their prefix cache.
    "cache-sharing": {"lane": 1, **BIG, "share_prefix_cache": True},
    # tests/reliability/test_status_lines.py: a second request within the minute is a 429
    "rpm-1": {"lane": 1, **{**BIG, "requests_per_minute": 1}},
    # tests/reliability/test_stalled_readers.py: streams long enough that the server must cut them.
    "stall-long": {"lane": 1, **{**BIG, "max_tokens_per_request": 2048}},
}

# tenant name -> tier name
TENANTS: dict[str, str] = {
    # the bystander whose latency the attacks must not move
    "bystander": "hostile-p1",
    # tests/security/test_input_bounds.py
    "bounds": "bounds-wide",
    "bounds-bystander": "hostile-p1",
    "bounds-batch": "hostile-p2",
    # tests/security/test_file_upload_bounds.py
    "uploads-acme": "hostile-p2",
    # tests/security/test_utility_endpoints.py: a flood of /tokenize, and another tenant's files list
    "tokenizer": "hostile-p1",
    "tokenizer-bystander": "hostile-p2",
    # tests/reliability/test_admission_isolation.py: files whose rows another transaction holds
    "lock-timeout": "hostile-p2",
    # tests/security/test_grammar_checks.py: large JSON schemas, and a tenant streaming beside them
    "schemas": "hostile-p1",
    "schemas-bystander": "hostile-p1",
    # tests/reliability/test_connection_burst.py: 400 concurrent streams, under its 1000 slots
    "burst": "hostile-p1",
    # tests/security/test_generation_slots.py
    "slots": "slots-8",
    "inflight": "inflight-4",
    # tests/security/test_budget_reservation.py
    "budget": "budget-100",
    # tests/security/test_socket_reauth.py: one tenant per way of losing its rights
    "reauth-revoked": "hostile-p1",
    "reauth-inactive": "hostile-p1",
    "reauth-tier": "reauth-tier",
    # tests/security/test_websocket_limits.py
    "ws-limits": "hostile-p1",
    "ws-flood": "hostile-p1",
    "ws-stall": "hostile-p1",
    # tests/security/test_batch_billing.py
    "batch-billing": "hostile-p2",
    # tests/reliability/test_usage_outbox.py
    "outbox": "hostile-p1",
    # tests/security/test_zero_limits.py
    "zero-rpm": "zero-rpm",
    "zero-tpm": "zero-tpm",
    "zero-streams": "zero-streams",
    # tests/reliability/test_slots_after_redis_blip.py
    "blip": "one-slot",
    # tests/reliability/test_admission_isolation.py: the tenant whose key row is locked, and four more
    "locked": "hostile-p1",
    "calm-a": "hostile-p1",
    "calm-b": "hostile-p1",
    "calm-c": "hostile-p1",
    "calm-d": "hostile-p1",
    # ... and one that makes no generation before Redis stalls
    "stranger": "hostile-p1",
    # tests/security/test_prefix_cache_isolation.py: a pair on a default tier, a pair on a sharing one
    "cache-a": "hostile-p1",
    "cache-b": "hostile-p1",
    "cache-sharing-a": "cache-sharing",
    "cache-sharing-b": "cache-sharing",
    # tests/reliability/test_stalled_readers.py
    "stall": "stall-long",
    # tests/reliability/test_status_lines.py
    "rpm-1": "rpm-1",
    # tests/reliability/test_intake.py
    "intake": "hostile-p1",
    "intake-other": "hostile-p1",
    "intake-timed": "hostile-p1",  # ... whose held chat's usage row is read
    # tests/cluster/test_nginx.py: nginx in front of this server
    "proxied": "hostile-p1",
}

# Settings of the live server (environment variables).
ENV: dict[str, str] = {
    "SSE_HEARTBEAT_S": "0.5",
    "WS_AUTH_TIMEOUT_S": "2",
    # tests/security/test_input_bounds.py: under the live server's 256 KiB body limit, so a prompt
    # past it meets this bound rather than the body's.
    "MAX_PROMPT_CHARS": "65536",
    # tests/security/test_socket_reauth.py: a revoked key's socket closes within a second or so
    "WS_AUTH_RECHECK_S": "1",
    # tests/security/test_websocket_limits.py
    "WS_MAX_SOCKETS_PER_KEY": "2",
    "WS_MAX_FRAMES_PER_S": "10",
    # tests/security/test_generation_slots.py: two requests of a tenant wait for a slot, no more
    "SLOT_WAITERS_PER_TENANT": "2",
    # tests/reliability/test_admission_isolation.py: a stuck admission answers 503 in seconds, and
    # so does a write that meets a row another transaction holds
    "ADMISSION_TIMEOUT_S": "4",
    "DATABASE_LOCK_TIMEOUT_S": "3",
    # tests/reliability/test_slots_after_redis_blip.py: slots (renewed every second) lapse after
    # a 3 s Redis outage
    "STREAM_LEASE_TTL_S": "3",
    # tests/reliability/test_stalled_readers.py: a stream stops writing at 8 KiB its client has not
    # taken (~30 chat chunks) and is cut after 3 s of no progress, so a stalled client is cut within
    # seconds. A client that reads keeps the kernel's queue near empty (8 KiB is 300 ms of a
    # 100-token/s stream in flight), and one that pauses first fills its own receive buffer
    # (128 KiB by default on Linux) before the server counts a byte.
    "STREAM_MAX_BUFFERED_BYTES": str(8 * 1024),
    "STREAM_STALL_S": "3",
    # ... and its choices pause in the engine once 8 tokens each wait behind a client that has
    # stopped taking them, so a stalled stream stops decoding long before it is cut.
    "STREAM_PAUSE_AFTER_TOKENS": "8",
    # tests/security/test_file_upload_bounds.py: a refused upload's connection is seen held open
    # well inside this
    "FILES_REFUSAL_LINGER_S": "2",
    # tests/reliability/test_intake.py: a tenant's requests parsed and not yet answered (the default)
    "INTAKE_PENDING_PER_CALLER": "16",
    # tests/reliability/test_request_deadlines.py: a request's head and its body's pauses
    "REQUEST_HEAD_TIMEOUT_S": "6",
    "REQUEST_BODY_IDLE_S": "6",
    # ... and a kept-alive connection's silence between requests
    "HTTP_KEEPALIVE_TIMEOUT_S": "8",  # above the two deadlines, as 75 is above 60 and 30
}
