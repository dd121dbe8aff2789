"""Chooses between a kernel's Triton implementation and its PyTorch reference.

`KERNELS=reference` forces the reference, `KERNELS=triton` forces Triton (under
`TRITON_INTERPRET=1` that runs on CPU tensors, which is how CI tests kernels),
and the default `auto` takes Triton for CUDA tensors and the reference elsewhere.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

_CHOICES = ("auto", "reference", "triton")


def backend_name() -> str:
    choice = os.environ.get("KERNELS", "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"KERNELS must be one of {', '.join(_CHOICES)}, got {choice!r}")
    return choice


def pick(reference: Callable, triton_impl: Callable | None, tensor: torch.Tensor) -> Callable:
    """Return the implementation to run for an op whose main input is `tensor`."""
    choice = backend_name()
    if choice == "reference" or triton_impl is None:
        if choice == "triton" and triton_impl is None:
            raise NotImplementedError("KERNELS=triton but this op has no Triton implementation yet")
        return reference
    if choice == "triton" or tensor.is_cuda:
        return triton_impl
    return reference
