"""Hot-path operations of the engine, each with a PyTorch reference and a Triton kernel
(CUDA; CPU tensors under TRITON_INTERPRET=1), and some with a compiled CPU kernel.

Every op can be called directly (`kernels.silu_and_mul(x)`, dispatched per call,
which is what tests use, taking the `auto` choice) or resolved once for a device and
a backend choice with `ops_for(device, dtype, choice)`, which is what the model does:
choosing per call would cost more than some ops. Nothing in this package imports
Django or the engine, or reads the environment to choose (see `kernels.dispatch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels.activation import silu_and_mul, silu_and_mul_impl
from kernels.argmax import argmax_rows, argmax_rows_impl
from kernels.dispatch import CHOICES, check_choice
from kernels.kv_cache import rotary_write_kv, rotary_write_kv_impl, write_kv, write_kv_impl
from kernels.linear import ALL_ROWS, SMALL_ROWS, gated_linear_for, panel_linear_for, small_linear_for
from kernels.paged_attention import PagedAttentionMetadata, paged_attention, paged_attention_impl
from kernels.rmsnorm import add_rms_norm, add_rms_norm_impl, rms_norm, rms_norm_impl
from kernels.rotary import apply_rotary, apply_rotary_impl


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable
    add_rms_norm: Callable
    apply_rotary: Callable
    silu_and_mul: Callable
    write_kv: Callable
    rotary_write_kv: Callable
    paged_attention: Callable
    argmax_rows: Callable


def ops_for(device: torch.device, dtype: torch.dtype = torch.float32, choice: str = "auto") -> Ops:
    """The implementations `choice` (one of CHOICES) selects for tensors on `device`, chosen now."""
    probe = torch.empty(0, device=device, dtype=dtype)
    return Ops(
        rms_norm=rms_norm_impl(probe, choice),
        add_rms_norm=add_rms_norm_impl(probe, choice),
        apply_rotary=apply_rotary_impl(probe, choice),
        silu_and_mul=silu_and_mul_impl(probe, choice),
        write_kv=write_kv_impl(probe, choice),
        rotary_write_kv=rotary_write_kv_impl(probe, choice),
        paged_attention=paged_attention_impl(probe, choice),
        argmax_rows=argmax_rows_impl(probe, choice),
    )


__all__ = [
    "ALL_ROWS",
    "CHOICES",
    "Ops",
    "PagedAttentionMetadata",
    "SMALL_ROWS",
    "add_rms_norm",
    "argmax_rows",
    "apply_rotary",
    "check_choice",
    "gated_linear_for",
    "panel_linear_for",
    "ops_for",
    "paged_attention",
    "rms_norm",
    "rotary_write_kv",
    "silu_and_mul",
    "small_linear_for",
    "write_kv",
]
