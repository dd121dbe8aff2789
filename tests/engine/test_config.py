"""How the engine's dtype follows the CPU it runs on."""

from __future__ import annotations

import logging

import pytest
import torch

from inference.engine import config
from inference.engine.config import resolve_dtype
from inference.engine.errors import InvalidRequestError

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
    with pytest.raises(InvalidRequestError, match="dtype must be auto or one of"):
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
