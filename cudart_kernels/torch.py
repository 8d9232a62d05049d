"""The torch layer: cudart-kernels ops as `torch.library` custom ops, with fake (meta) implementations (and autograd
formulas for attention and gemm), so that they compose with `loss.backward()`, `torch.compile(fullgraph=True)` and
`torch.cuda.graph`. Each returns new tensors allocated by torch on torch's current stream.

    import cudart_kernels.torch as ckt
    out = ckt.attention(q, k, v, causal=True)   # q [B, S, H, D] (or packed varlen), differentiable
    out.float().sum().backward()                # q.grad, k.grad, v.grad from the attention backward kernel

Importing this module imports nothing from torch: torch is imported, and the ops registered (as
torch.ops.cudart_kernels.*), the first time one of its functions is looked up. The core library never imports torch.
"""
from __future__ import annotations

__all__ = ["attention", "gemm", "gemm_fp8", "quantize_fp8_per_block", "quantize_fp8_per_token"]


def __getattr__(name: str):
    if name in __all__:
        from . import _torch_ops

        value = getattr(_torch_ops, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
