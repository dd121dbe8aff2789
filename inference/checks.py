"""System checks for the inference settings, so a bad value fails `manage.py check`
(and every process start) instead of the first request."""
from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, Warning, register

from inference.engine import api

POLICIES = ("priority", "fcfs", "shortest_first")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KERNELS = ("auto", "reference", "triton", "cpu")  # kernels.CHOICES, named here so checks import no torch
QUANTIZATIONS = ("none", "int8", "int4")  # inference.engine.config.QUANTIZATIONS, likewise
SPECULATIVE_MODES = ("off", "ngram", "draft")  # inference.engine.config.SPECULATIVE_MODES, likewise
MAX_SPECULATIVE_TOKENS = 16  # inference.engine.config.MAX_SPECULATIVE_TOKENS, likewise
NGRAM_MAX = 3  # inference.engine.config.NGRAM_MAX, likewise
MIN_INTERNAL_TOKEN_LENGTH = 32


@register()
def check_inference_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    conf = settings.INFERENCE
    problems = []
    if conf["POLICY"] not in POLICIES:
        problems.append(Error(f"INFERENCE_POLICY must be one of {', '.join(POLICIES)}.", id="inference.E001"))
    if conf["DEVICE"].split(":")[0] not in DEVICES:
        problems.append(Error(f"INFERENCE_DEVICE must be one of {', '.join(DEVICES)}.", id="inference.E002"))
    if conf["DTYPE"] not in DTYPES:
        problems.append(Error(f"INFERENCE_DTYPE must be one of {', '.join(DTYPES)}.", id="inference.E003"))
    for name in ("KV_CACHE_BYTES", "MAX_NUM_SEQS", "MAX_BATCHED_TOKENS"):
        if conf[name] < 1:
            problems.append(Error(f"INFERENCE_{name} must be positive.", id="inference.E004"))
    if conf["SWAP_BYTES"] < 0:
        problems.append(Error("INFERENCE_SWAP_BYTES must not be negative.", id="inference.E004"))
    if conf["AGING_S"] <= 0:
        problems.append(Error("INFERENCE_AGING_S must be positive.", id="inference.E005"))
    if conf["KERNELS"] not in KERNELS:
        problems.append(Error(f"KERNELS must be one of {', '.join(KERNELS)}.", id="inference.E006"))
    if conf["CPU_THREADS"] < 0:
        problems.append(Error("INFERENCE_CPU_THREADS must be 0 (a core fewer than the machine has) or a number of "
                              "threads.", id="inference.E013"))
    if conf["QUANTIZATION"] not in QUANTIZATIONS:
        problems.append(Error(f"INFERENCE_QUANTIZATION must be one of {', '.join(QUANTIZATIONS)}.", id="inference.E010"))
    return problems + _speculative_problems(conf)


def _speculative_problems(conf: dict) -> list[Error]:
    problems = []
    if conf["SPECULATIVE"] not in SPECULATIVE_MODES:
        problems.append(Error(f"INFERENCE_SPECULATIVE must be one of {', '.join(SPECULATIVE_MODES)}.", id="inference.E011"))
    if not 1 <= conf["NUM_SPECULATIVE_TOKENS"] <= MAX_SPECULATIVE_TOKENS:
        problems.append(Error(f"INFERENCE_NUM_SPECULATIVE_TOKENS must be 1-{MAX_SPECULATIVE_TOKENS}.", id="inference.E011"))
    if conf["SPECULATIVE_MAX_BATCH"] < 0:
        problems.append(Error("INFERENCE_SPECULATIVE_MAX_BATCH must not be negative.", id="inference.E011"))
    if not 1 <= conf["NGRAM_MIN"] <= NGRAM_MAX:
        problems.append(Error(f"INFERENCE_NGRAM_MIN must be 1-{NGRAM_MAX}.", id="inference.E011"))
    return problems


@register()
def check_request_bounds(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """The API's stop bounds are settings; the engine refuses past its own ceilings, so a setting
    above a ceiling would turn requests the API let through into engine errors."""
    stops = settings.MAX_STOP, settings.MAX_STOP * settings.MAX_STOP_CHARS, settings.MAX_STOP_TOKEN_IDS
    ceilings = api.MAX_STOP_SEQUENCES, api.MAX_STOP_TOTAL_CHARS, api.MAX_STOP_TOKEN_IDS
    names = "MAX_STOP", "MAX_STOP x MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS"
    return [Error(f"{name} is {value}; the engine takes at most {ceiling}.", id="inference.E007")
            for name, value, ceiling in zip(names, stops, ceilings) if value > ceiling]


@register()
def check_limits_fallback(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """tenants.fallback: a deadline of 0 would send every admission to the local limits."""
    problems = []
    if not settings.LIMITS_REDIS_TIMEOUT_S > 0:
        problems.append(Error("LIMITS_REDIS_TIMEOUT_S must be positive.", id="inference.E008"))
    if not settings.LIMITS_REDIS_CONFIRM_S >= settings.LIMITS_REDIS_TIMEOUT_S:
        problems.append(Error("LIMITS_REDIS_CONFIRM_S must be at least LIMITS_REDIS_TIMEOUT_S.", id="inference.E008"))
    if not 0 <= settings.LIMITS_FALLBACK_SHARE <= 1:
        problems.append(Error("LIMITS_FALLBACK_SHARE must be between 0 and 1.", id="inference.E008"))
    return problems


@register()
def check_connection_deadlines(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """config.intake's read deadlines and the idle close (config.daphne_hooks). Twisted's idle
    clock also runs while a request is read, so at or below a read deadline it would close a
    slow request without the 408 that says why."""
    names = ("REQUEST_HEAD_TIMEOUT_S", "REQUEST_BODY_IDLE_S", "HTTP_KEEPALIVE_TIMEOUT_S")
    problems = [Error(f"{name} must not be negative (0: no deadline).", id="inference.E012")
                for name in names if getattr(settings, name) < 0]
    idle = settings.HTTP_KEEPALIVE_TIMEOUT_S
    for name in names[:2]:
        if idle > 0 and idle <= getattr(settings, name):
            problems.append(Error(f"HTTP_KEEPALIVE_TIMEOUT_S ({idle:g}) must be above {name} ({getattr(settings, name):g}): "
                                  "a slow request would be closed without its 408.", id="inference.E012"))
    return problems


@register(Tags.security, deploy=True)
def check_internal_token(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    return [
        Warning(
            f"{name} is shorter than {MIN_INTERNAL_TOKEN_LENGTH} characters.",
            hint="Generate one with: python -c 'import secrets; print(secrets.token_urlsafe(48))'",
            id="inference.W001",
        )
        for name in ("INTERNAL_API_TOKEN", "OPERATOR_API_TOKEN", "BATCH_WORKER_TOKEN", "METRICS_TOKEN")
        if len(getattr(settings, name)) < MIN_INTERNAL_TOKEN_LENGTH
    ]
