"""The engine's CPU threads (INFERENCE_CPU_THREADS): by default a core fewer than the machine
has, so the web process keeps one; what another tenant's first token gains from it is asserted
in tests/security/test_grammar_checks.py (the order of answers, not a time)."""
import os

import pytest
import torch
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from inference.engine.api import SamplingParams
from inference.engine.config import EngineConfig
from inference.engine.engine import LLMEngine
from inference.engine.errors import ConfigError
from inference.host import engine_config


def test_by_default_the_engine_leaves_the_web_process_a_core(settings):
    settings.INFERENCE = {**settings.INFERENCE, "CPU_THREADS": 0}
    cores = len(os.sched_getaffinity(0))
    threads = engine_config().cpu_threads
    assert threads >= 1
    assert threads < cores or cores == 1


def test_a_number_of_threads_is_taken_as_given(settings):
    settings.INFERENCE = {**settings.INFERENCE, "CPU_THREADS": 3}
    assert engine_config().cpu_threads == 3


def test_a_negative_number_fails_the_system_checks_naming_the_variable(settings):
    settings.INFERENCE = {**settings.INFERENCE, "CPU_THREADS": -1}
    with pytest.raises(SystemCheckError, match="INFERENCE_CPU_THREADS must be 0"):
        call_command("check")
    with pytest.raises(ConfigError, match="cpu_threads"):
        EngineConfig(cpu_threads=-1)


def test_the_engine_runs_its_kernels_on_the_threads_it_was_given():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        engine = LLMEngine.from_config(EngineConfig(kv_cache_bytes=1 << 24, max_num_seqs=2, cpu_threads=1))
        assert torch.get_num_threads() == 1
        engine.add_request("one", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0))
        while engine.has_unfinished():
            engine.step()
    finally:
        torch.set_num_threads(before)
