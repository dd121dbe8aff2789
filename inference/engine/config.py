"""Engine configuration: one frozen value, built once from the caller's settings.

Everything the engine and its kernels are told comes in here: neither reads the
environment (the Django settings do, and pass it on). A value the engine cannot be
built with raises ConfigError, a startup failure, never an InvalidRequestError."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inference.engine.errors import ConfigError

# torch only where the engine is built: the web process, which validates this config and hands
# it to the engine process, never imports it.
if TYPE_CHECKING:
    import torch

QUANTIZATIONS = ("none", "int8", "int4")
SPECULATIVE_MODES = ("off", "ngram", "draft")
MAX_SPECULATIVE_TOKENS = 16
NGRAM_MAX = 3  # the longest suffix prompt lookup matches (inference/engine/speculative.py)

DTYPES = ("float32", "bfloat16", "float16")
# kernels.dispatch.CHOICES, named here too because importing the kernels package imports torch
# (tests/engine/test_config.py holds the two equal).
KERNELS_CHOICES = ("auto", "reference", "triton", "cpu")


log = logging.getLogger(__name__)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return frozenset()


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX make bf16 matmuls fast; without them bf16 is emulated and slow."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


@functools.cache
def _warn_slow_bf16() -> None:
    log.warning(
        "dtype bfloat16 on a CPU without AVX-512: its matmuls run several times slower than in float32 here "
        "(~15 against ~100 GFLOP/s on a 2-core AVX2 EPYC); dtype auto picks float32 on this CPU"
    )


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for but no CUDA device is available", setting="device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    if name == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16()):
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}", setting="dtype")
    dtype = getattr(torch, name)
    if dtype == torch.bfloat16 and device.type == "cpu" and "avx512f" not in cpu_flags():
        # The CPU kernels' bf16 paths need AVX-512 (with or without AVX512-BF16); below it
        # everything falls back to PyTorch's own bf16, which crawls. Said once per process.
        _warn_slow_bf16()
    return dtype


@dataclass(frozen=True)
class EngineConfig:
    # What to serve: "SmolLM2-135M-Instruct" (the packaged GGUF), a .gguf path or a Hugging Face folder.
    model: str = "SmolLM2-135M-Instruct"
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    # Memory for the device KV cache; the number of blocks is derived from it unless num_blocks is set.
    kv_cache_bytes: int = 512 * 1024**2
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context length
    enable_prefix_caching: bool = True
    # Who goes first: "priority" (lanes, aging, fair share between tenants), "fcfs" or
    # "shortest_first" (fewest tokens left to generate).
    policy: str = "priority"
    # A waiting request's lane improves by one for every aging_threshold_s it has waited.
    aging_threshold_s: float = 30.0
    # Host memory for P2 sequences swapped out of the device cache (0: always recompute).
    swap_space_bytes: int = 1024**3
    # Prompt tokens of batch (P2) work computed in one step at most (0: no cap). Steps stay
    # short, so an interactive request arriving mid-step waits little for the next one: on
    # a 2-core CPU a step prefilling ~200 batch tokens took ~100 ms, one capped at 64 ~30 ms.
    batch_prefill_tokens: int = 64
    # At most this many sequences swapped in or out per step, so swapping cannot thrash.
    max_swaps_per_step: int = 4
    # Per lane (P0, P1, P2): the most requests allowed to wait, and how long one may wait.
    lane_max_waiting: tuple[int, int, int] = (256, 1024, 100_000)
    lane_queue_timeout_s: tuple[float, float, float] = (30.0, 120.0, 24 * 3600.0)
    # The most of a lane's waiting queue (a fraction of lane_max_waiting) one tenant's requests
    # may hold, so one tenant cannot fill a lane and turn every other tenant's request away.
    tenant_queue_share: float = 0.5
    # A tenant running at least crowd_sit_out_seqs sequences (and more than the newcomer's
    # tenant) sits out the step that admits another tenant's new request of its lane or a
    # better one (crowd_sit_out_seqs 0: never), for at most one part in crowd_sit_out_every of
    # the engine's time and never two steps in a row (Scheduler._credit). The newcomer's first
    # token comes from that step, and 16 decodes beside it make it longer (2-core CPU, the
    # packaged model: a 40-token prefill alone 72 ms, beside 16 decodes 98 ms).
    crowd_sit_out_seqs: int = 4
    crowd_sit_out_every: int = 4
    # Prompt tokens one tenant computes in a step once it has crowd_sit_out_seqs sequences in
    # that step (0: no cap). Sixteen requests of one tenant arriving at once otherwise prefill
    # together: a step of 242 tokens took 100 ms on a 2-core CPU, and another tenant arriving
    # during it waited that long before its own step; capped at 64, steps take ~35 ms. A lone
    # long prompt is not capped (one sequence is no crowd).
    crowd_prefill_tokens: int = 64
    seed: int = 0
    # Which kernel implementations the model runs (KERNELS_CHOICES): "auto" (Triton on CUDA,
    # the compiled CPU kernels where they built, else the PyTorch references), "reference",
    # "triton" or "cpu" to force one.
    kernels: str = "auto"
    # Weight-only quantization at load (kernels.quant): "none", "int8" or "int4" (groups of 32).
    # Batch-1 decode streams every weight per token: int8 reads 8.5 bits a weight, int4 5, where
    # bf16 reads 16.
    quantization: str = "none"
    # Speculative decoding (inference/engine/speculative.py): "off", "ngram" (prompt lookup:
    # the tokens that followed the latest earlier occurrence of a sequence's last tokens) or
    # "draft" (a second, smaller model proposes). A decoding sequence proposes up to
    # num_speculative_tokens (1-16) and the target verifies them in one pass.
    speculative: str = "off"
    num_speculative_tokens: int = 4
    # "ngram" proposes only after a match of at least this many of the sequence's last tokens
    # (1-3). Batch-1 int4 on a 2-core Xeon, 128 tokens of five chat replies and of a summary that
    # quotes its passage, two runs: from 1-token matches, 16% and 21% of drafts were accepted and
    # decoding ran at 0.72-0.84x and 0.70-0.79x int4 alone (the verifying pass costs ~2x a
    # decode there); from 3-token matches only, 31% and 66%, at 0.86-1.08x and 1.08-1.17x.
    ngram_min: int = 3
    # The draft model of "draft" (as `model` names one); None: the served model quantized to int4.
    draft_model: str | None = None
    # No speculation in a step whose decoding sequences exceed this many: a full batch is
    # compute-bound, and the pass over rejected drafts costs more than it saves.
    speculative_max_batch: int = 8
    # Up to num_speculative_tokens, the draft length each step expects to emit the most tokens
    # per second with, from step times and acceptance measured as it runs (speculative.Governor):
    # speculation that does not pay on this machine and text turns itself down or off. False:
    # always num_speculative_tokens.
    speculative_adaptive: bool = True
    # Where converted weights and tokenizers are kept (None: ~/.cache/llm-platform).
    cache_dir: str | None = None
    # Threads of the CPU kernels (torch.set_num_threads at load; 0: PyTorch's default, one per
    # core). Serving sets it to a core fewer than the machine has (inference.host), so the web
    # process beside the engine does not share a core with a team of OpenMP threads: a step's
    # ~300 parallel regions each wait for every thread of the team, and a team that shares its
    # cores with other work waits for the one that is not running. On a 2-core AMX Xeon a
    # one-token step of SmolLM2 took 13 ms on 2 threads and 22 on 1 quiet, and beside one busy
    # process 31-35 ms on 2, 23 on 1 (bench/engine_contention.py); another tenant's first token
    # while a tenant's 16 large schemas were checked came after 480 ms on 2, 178 on 1.
    cpu_threads: int = 0

    def __post_init__(self):
        if self.cpu_threads < 0:
            raise ConfigError(f"cpu_threads must be 0 (every core) or more, got {self.cpu_threads}", setting="cpu_threads")
        if self.kernels not in KERNELS_CHOICES:
            raise ConfigError(f"kernels must be one of {', '.join(KERNELS_CHOICES)}, got {self.kernels!r}", setting="kernels")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}",
                              setting="quantization")
        if self.speculative not in SPECULATIVE_MODES:
            raise ConfigError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {self.speculative!r}",
                              setting="speculative")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be 1-{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}",
                              setting="num_speculative_tokens")
        if self.speculative_max_batch < 0:
            raise ConfigError("speculative_max_batch must not be negative", setting="speculative_max_batch")
        if not 1 <= self.ngram_min <= NGRAM_MAX:
            raise ConfigError(f"ngram_min must be 1-{NGRAM_MAX}, got {self.ngram_min}", setting="ngram_min")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size must be a positive power of two", setting="block_size")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be at least 1", setting="max_num_seqs")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                "max_num_batched_tokens must be at least max_num_seqs, or running sequences cannot all decode",
                setting="max_num_batched_tokens",
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError("num_blocks must be at least 1", setting="num_blocks")
        if self.kv_cache_bytes <= 0:
            raise ConfigError("kv_cache_bytes must be positive", setting="kv_cache_bytes")
        if self.policy not in ("priority", "fcfs", "shortest_first"):
            raise ConfigError(f"unknown scheduling policy {self.policy!r}", setting="policy")
        if self.aging_threshold_s <= 0:
            raise ConfigError("aging_threshold_s must be positive", setting="aging_threshold_s")
        if self.batch_prefill_tokens < 0:
            raise ConfigError("batch_prefill_tokens must not be negative", setting="batch_prefill_tokens")
        if self.swap_space_bytes < 0 or self.max_swaps_per_step < 0:
            raise ConfigError("swap_space_bytes and max_swaps_per_step must not be negative", setting="swap_space_bytes")
        if self.crowd_prefill_tokens < 0:
            raise ConfigError("crowd_prefill_tokens must not be negative", setting="crowd_prefill_tokens")
        if self.crowd_sit_out_seqs < 0 or self.crowd_sit_out_every < 1:
            raise ConfigError("crowd_sit_out_seqs must not be negative, crowd_sit_out_every at least 1",
                              setting="crowd_sit_out_seqs")
        if not 0 < self.tenant_queue_share <= 1:
            raise ConfigError("tenant_queue_share must be in (0, 1]", setting="tenant_queue_share")
        if len(self.lane_max_waiting) != 3 or len(self.lane_queue_timeout_s) != 3:
            raise ConfigError("lane limits take one value per lane (P0, P1, P2)", setting="lane_max_waiting")
