"""SiLU-and-multiply, the SwiGLU gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_ext
from kernels.dispatch import pick


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * intermediate] holding gate then up.
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_impl(probe: torch.Tensor):
    return pick(silu_and_mul_ref, None, probe, cpu_impl=cpu_ext.op("silu_and_mul"))


def silu_and_mul(x):
    return silu_and_mul_impl(x)(x)
