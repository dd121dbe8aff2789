"""Hot-path operations of the engine, each with a PyTorch reference.

The model calls only the functions exported here; `dispatch.py` decides which
implementation runs. Nothing in this package imports Django or the engine.
"""

from kernels.activation import silu_and_mul
from kernels.dispatch import backend_name
from kernels.kv_cache import write_kv
from kernels.paged_attention import PagedAttentionMetadata, paged_attention
from kernels.rmsnorm import add_rms_norm, rms_norm
from kernels.rotary import apply_rotary

__all__ = [
    "PagedAttentionMetadata",
    "add_rms_norm",
    "apply_rotary",
    "backend_name",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv",
]
