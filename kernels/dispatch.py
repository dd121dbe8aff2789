"""Chooses which implementation of a kernel runs.

The caller says which it wants (the engine passes `EngineConfig.kernels`; nothing here
reads the environment): `reference` forces the PyTorch references, `triton` forces
Triton (under `TRITON_INTERPRET=1` that runs on CPU tensors, which is how CI tests the
kernels), `cpu` forces the compiled CPU kernels. The default `auto` takes Triton for
CUDA tensors, the compiled CPU kernel where an op has one and it built, and the
reference elsewhere.
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels import _triton

CHOICES = ("auto", "reference", "triton", "cpu")


def check_choice(choice: str) -> str:
    """`choice` if it names a backend; ValueError otherwise."""
    if choice not in CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(CHOICES)}, got {choice!r}")
    return choice


def pick(
    reference: Callable,
    triton_impl: Callable | None,
    tensor: torch.Tensor,
    cpu_impl: Callable | None = None,
    choice: str = "auto",
) -> Callable:
    """Return the implementation `choice` (one of CHOICES) runs for an op whose main input is `tensor`.

    `cpu_impl`, when given, returns None if the compiled CPU kernels are unavailable.
    """
    check_choice(choice)
    if choice == "reference":
        return reference
    if choice == "triton" or (choice == "auto" and tensor.is_cuda):
        missing = _why_not_triton(triton_impl, tensor)
        if missing is None:
            return triton_impl
        if choice == "triton":
            raise NotImplementedError(f"kernels=triton but {reference.__name__} {missing}")
        return reference
    if cpu_impl is not None and not tensor.is_cuda:
        impl = cpu_impl()
        if impl is not None:
            return impl
    if choice == "cpu" and cpu_impl is not None:
        raise RuntimeError("kernels=cpu but the CPU kernels could not be built (see the log)")
    return reference


def _why_not_triton(triton_impl: Callable | None, tensor: torch.Tensor) -> str | None:
    if triton_impl is None:
        return "has no Triton implementation yet"
    if not _triton.available():
        return "cannot run: Triton is not installed (pip install triton)"
    if not (tensor.is_cuda or _triton.INTERPRETING):
        return f"cannot run on {tensor.device.type} tensors unless TRITON_INTERPRET=1 is set before importing kernels"
    return None
