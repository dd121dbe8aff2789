"""Triton where it is installed, and the checks every Triton host wrapper makes.

The CPU install (requirements.txt) carries no Triton, so importing `kernels` must not
need it: without it, `triton.jit` keeps the function undecorated, `available()` is
False and the dispatcher never picks a Triton kernel.

Triton decides when a kernel is decorated, that is when `kernels` is imported, whether
it runs compiled (CUDA tensors) or interpreted by numpy (CPU tensors, far slower), from
its own `TRITON_INTERPRET` variable: that must be set before the import, and
tests/conftest.py does so. `INTERPRETING` asks Triton what it decided rather than reading
the variable here.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install: kernels stay plain functions that nothing launches

    class _NoTriton:
        @staticmethod
        def jit(fn):
            return fn

    triton = _NoTriton()
    tl = None

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    return tl is not None


def _interpreting() -> bool:
    """Whether `triton.jit` hands out interpreted kernels in this process. Asked of Triton by
    decorating a probe, as the kernels modules are about to be: Triton alone reads
    TRITON_INTERPRET (and parses it its own way), so the answer cannot disagree with it."""
    if not available():
        return False
    from triton.runtime.jit import JITFunction

    @triton.jit
    def _probe():
        pass

    return not isinstance(_probe, JITFunction)


INTERPRETING = _interpreting()


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check(op: str, *tensors: torch.Tensor) -> None:
    """Raise a clear error for inputs a Triton kernel cannot take: the wrong device or dtype,
    or a last dimension that is not contiguous (every kernel reads rows as vectors)."""
    if not available():
        raise RuntimeError(f"{op}: Triton is not installed (pip install triton, or the kernels choice reference)")
    for t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{op}: Triton kernels take float32, bfloat16 or float16 tensors, got {t.dtype}")
        if not (t.is_cuda or INTERPRETING):
            raise ValueError(
                f"{op}: Triton runs on CUDA tensors, got a {t.device.type} tensor "
                "(set TRITON_INTERPRET=1 before importing kernels to interpret it on CPU)"
            )
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{op}: the last dimension must be contiguous, got strides {t.stride()}")


def output(op: str, out: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`out` checked against the shape and dtype an op writes, or a new tensor for it."""
    if out is None:
        return like.new_empty(shape)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"{op}: out must be {like.dtype} {tuple(shape)} on {like.device}, got {out.dtype} {tuple(out.shape)}")
    check(op, out)
    return out


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def dot_precision(dtype: torch.dtype) -> str:
    """How `tl.dot` multiplies fp32 tiles loaded from a `dtype` cache.

    The attention kernels upcast keys and values to fp32 before `tl.dot`, because the
    interpreter multiplies bf16 tiles as their raw uint16 bits (triton 3.9). TF32 holds
    every bf16 and fp16 value exactly, so for 16-bit caches TF32 tensor cores give the
    products a bf16 dot would; an fp32 cache gets full fp32 ("ieee").
    """
    return "ieee" if dtype == torch.float32 else "tf32"
