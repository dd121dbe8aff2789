"""Compiling the Triton kernels for a GPU on a machine without one.

The interpreter runs a kernel's Python, not Triton's compiler: a kernel can pass under
it and still fail to compile (a `tl.dot` tile under 16, a loop-carried value whose type
changes, a non-constexpr block size). Triton compiles ahead of time for a named target
without a device, down to a cubin through the bundled ptxas. So tests record the launches
the host wrappers make under the interpreter (`record_launches`), and `compile_launches`
compiles each in a fresh interpreter-free process, as on a GPU machine.

    python -m tests.kernels.gpu_compile < launches.json   # what compile_launches runs
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

KERNEL_MODULES = (
    "kernels.activation",
    "kernels.rmsnorm",
    "kernels.rotary",
    "kernels.kv_cache",
    "kernels.paged_decode",
    "kernels.paged_prefill",
    "kernels.quant",
)
# H100/H200 (sm_90) and A100 (sm_80), the GPUs a lent machine is likely to have.
TARGETS = ((90, "sm_90"), (80, "sm_80"))
_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32", torch.int64: "*i64",
                  torch.uint8: "*u8"}


def kernels() -> dict[str, object]:
    """Every `_..._kernel` of the kernel modules, by 'module:name'."""
    found = {}
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if name.startswith("_") and name.endswith("_kernel"):
                found[f"{module_name}:{name}"] = obj
    return found


def _argument_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _launch_spec(key: str, kernel, args, kwargs) -> dict:
    params = inspect.signature(kernel.fn).parameters
    signature, constexprs = {}, {}
    for name, value in inspect.signature(kernel.fn).bind(*args, **kwargs).arguments.items():
        if "constexpr" in str(params[name].annotation):
            signature[name], constexprs[name] = "constexpr", value
        else:
            signature[name] = _argument_type(value)
    return {"kernel": key, "signature": signature, "constexprs": constexprs}


@contextlib.contextmanager
def record_launches():
    """Collect each distinct (kernel, argument types, constexprs) launched under the interpreter."""
    launches: dict[str, dict] = {}
    hooks = []
    for key, kernel in kernels().items():

        def hook(*args, _key=key, _kernel=kernel, **kwargs):
            spec = _launch_spec(_key, _kernel, args, kwargs)
            launches.setdefault(json.dumps(spec, sort_keys=True), spec)

        kernel.add_pre_run_hook(hook)
        hooks.append((kernel, hook))
    try:
        yield launches
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)


def compile_launches(launches: list[dict]) -> list[str]:
    """Compile each launch for every target in a process without TRITON_INTERPRET; the failures."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # today's default, said out loud to silence its warning
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.gpu_compile"], input=json.dumps(launches), capture_output=True,
        text=True, env=env, cwd=root, timeout=300,
    )
    if done.returncode:
        raise RuntimeError(f"the compile process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compile_all(launches: list[dict]) -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    found = kernels()
    failures = []
    for launch in launches:
        source = ASTSource(fn=found[launch["kernel"]], signature=launch["signature"], constexprs=launch["constexprs"])
        for capability, name in TARGETS:
            try:
                triton.compile(source, target=GPUTarget("cuda", capability, 32))
            except Exception as exc:  # report every failure, not the first
                failures.append(f"{launch['kernel']} {launch['constexprs']} on {name}: {exc}")
    return failures


if __name__ == "__main__":
    print(json.dumps(_compile_all(json.load(sys.stdin))))
