"""How the engine's dtype follows the CPU it runs on, and that a configuration the engine
cannot be built with is a ConfigError (a startup failure), never an InvalidRequestError
(the API's 400)."""

from __future__ import annotations

import logging

import pytest
import torch

from inference.engine import config
from inference.engine.config import EngineConfig, resolve_device, resolve_dtype
from inference.engine.engine import LLMEngine
from inference.engine.errors import ConfigError, InvalidRequestError

CPU = torch.device("cpu")
AVX2 = frozenset({"avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512_vnni"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16"}


@pytest.fixture
def cpu(monkeypatch):
    """Pretend to run on a CPU with these flags; the slow-bf16 warning may fire again."""

    def with_flags(flags: frozenset[str]) -> None:
        monkeypatch.setattr(config, "cpu_flags", lambda: flags)
        config._warn_slow_bf16.cache_clear()

    yield with_flags
    config._warn_slow_bf16.cache_clear()


@pytest.mark.parametrize("flags, auto", [(AVX2, torch.float32), (AVX512, torch.float32), (AVX512_BF16, torch.bfloat16), (AMX, torch.bfloat16)],
                         ids=["avx2", "avx512", "avx512-bf16", "amx"])
def test_auto_dtype_is_bf16_only_where_the_cpu_has_native_bf16(cpu, flags, auto):
    cpu(flags)
    assert resolve_dtype("auto", CPU) == auto
    assert resolve_dtype("float32", CPU) == torch.float32 and resolve_dtype("bfloat16", CPU) == torch.bfloat16
    with pytest.raises(ConfigError, match="dtype must be auto or one of"):
        resolve_dtype("int8", CPU)


def test_bf16_asked_for_on_a_cpu_without_avx512_is_said_to_be_slow_once(cpu, caplog):
    cpu(AVX2)
    with caplog.at_level(logging.WARNING, logger="inference.engine.config"):
        resolve_dtype("auto", CPU)
        resolve_dtype("float32", CPU)
        assert not caplog.records
        resolve_dtype("bfloat16", CPU)
        resolve_dtype("bfloat16", CPU)
    assert len(caplog.records) == 1
    assert "several times slower than in float32" in caplog.records[0].getMessage()
    # With AVX-512 the CPU kernels have bf16 paths (emulated without AVX512-BF16): no warning.
    caplog.clear()
    for flags in (AVX512, AVX512_BF16):
        cpu(flags)
        with caplog.at_level(logging.WARNING, logger="inference.engine.config"):
            resolve_dtype("bfloat16", CPU)
        assert not caplog.records


def test_cpu_flags_are_this_machines():
    with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
        line = next(line for line in f if line.startswith("flags"))
    assert config.cpu_flags() == frozenset(line.split())
    assert config.cpu_has_native_bf16() == bool({"avx512_bf16", "amx_bf16"} & set(line.split()))


def _config_error(build) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build()
    assert not isinstance(info.value, InvalidRequestError)
    return info.value


def test_an_unknown_kernels_choice_is_a_config_error_not_a_bad_request():
    error = _config_error(lambda: EngineConfig(kernels="cuda-magic"))
    assert error.setting == "kernels" and "auto, reference, triton, cpu" in error.message
    for choice in ("auto", "reference", "triton", "cpu"):
        assert EngineConfig(kernels=choice).kernels == choice


@pytest.mark.parametrize("bad", [dict(block_size=12), dict(max_num_seqs=0), dict(policy="random"), dict(tenant_queue_share=0),
                                 dict(speculative="eagle"), dict(num_speculative_tokens=0), dict(num_speculative_tokens=17),
                                 dict(speculative_max_batch=-1)],
                         ids=["block_size", "max_num_seqs", "policy", "tenant_queue_share", "speculative",
                              "num_speculative_tokens-0", "num_speculative_tokens-17", "speculative_max_batch"])
def test_every_invalid_engine_setting_is_a_config_error(bad):
    assert _config_error(lambda: EngineConfig(**bad)).setting == next(iter(bad))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_fails_the_engine_build_with_a_config_error():
    _config_error(lambda: resolve_device("cuda"))
    # from_config resolves the device before it reads a byte of weights.
    error = _config_error(lambda: LLMEngine.from_config(EngineConfig(device="cuda", model="/nonexistent")))
    assert error.setting == "device"


def test_a_dtype_the_engine_cannot_run_fails_the_engine_build_with_a_config_error():
    error = _config_error(lambda: LLMEngine.from_config(EngineConfig(device="cpu", dtype="int8", model="/nonexistent")))
    assert error.setting == "dtype"


def test_the_configs_kernel_choices_are_the_kernels():
    from kernels.dispatch import CHOICES

    assert config.KERNELS_CHOICES == CHOICES  # named twice, so a config is checked without torch
