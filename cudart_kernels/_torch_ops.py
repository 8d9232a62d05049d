"""The custom ops behind cudart_kernels.torch (imported on first use: it imports torch and registers them).

Each op calls the library op on torch tensors without `out=` or `stream=`: it runs on torch's current stream, into
tensors torch allocates (so a CUDA graph capture keeps them in its pool); the fake implementations give the same
shapes, dtypes and strides.
"""
from __future__ import annotations

import math

import torch

from .ops.attention import attention as _attention
from .ops.attention_bwd import attention_backward as _attention_backward
from .ops.gemm import gemm as _gemm
from .ops.gemm_fp8 import gemm_fp8 as _gemm_fp8
from .ops.quantize import quantize_fp8_per_block as _quantize_per_block
from .ops.quantize import quantize_fp8_per_token as _quantize_per_token

_LIB = "cudart_kernels"


def _lse_shape(q: torch.Tensor, varlen: bool) -> tuple:
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


@torch.library.custom_op(f"{_LIB}::attention_fwd", mutates_args=(), device_types="cuda")
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                  cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int,
                  max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    kw = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k) if cu_seqlens_q is not None else {}
    return _attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True, **kw)


@attention_fwd.register_fake
def _(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::attention_bwd", mutates_args=(), device_types="cuda")
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, softmax_scale: float, cu_seqlens_q: torch.Tensor | None,
                  cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                  deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kw = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k) if cu_seqlens_q is not None else {}
    return _attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                               deterministic=deterministic, **kw)


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, cu_q, cu_k, max_q, max_k = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (causal, scale, max_q, max_k)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    causal, scale, max_q, max_k = ctx.args
    if dout.stride(-1) != 1 or any(s % 8 for s in dout.stride()[:-1]):  # the kernel reads 16-byte aligned rows
        dout = dout.contiguous()
    dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, causal, scale, cu_q, cu_k, max_q, max_k,
                               torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv, None, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              softmax_scale: float | None = None, cu_seqlens_q: torch.Tensor | None = None,
              cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0) -> torch.Tensor:
    """Differentiable attention on torch tensors (cudart_kernels.attention's layouts: q [B, S_q, H_q, D], k and v
    [B, S_k, H_kv, D], or packed varlen with cu_seqlens_q / cu_seqlens_k and max_seqlen_q / max_seqlen_k). The
    backward runs cudart_kernels.attention_backward, in its deterministic mode when
    torch.use_deterministic_algorithms(True) is set."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, _ = attention_fwd(q, k, v, causal, scale, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    return out


# ---- GEMMs and FP8 quantization -----------------------------------------------------------------------------------

def _gemm_shape(a: torch.Tensor, b: torch.Tensor, b_layout: str) -> tuple:
    return a.shape[0], b.shape[1] if b_layout == "kn" else b.shape[0]


@torch.library.custom_op(f"{_LIB}::gemm", mutates_args=(), device_types="cuda")
def gemm_op(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, b_layout: str,
            out_dtype: torch.dtype | None) -> torch.Tensor:
    return _gemm(a, b, c=c, b_layout=b_layout, out_dtype=out_dtype)


@gemm_op.register_fake
def _(a, b, c, b_layout, out_dtype):
    return a.new_empty(_gemm_shape(a, b, b_layout), dtype=out_dtype or a.dtype)


def _gemm_setup(ctx, inputs, output):
    a, b, c, b_layout, _ = inputs
    ctx.save_for_backward(a, b)
    ctx.b_layout, ctx.has_c = b_layout, c is not None


def _matmul(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ y [K, N] with our GEMM where its rows are 16-byte aligned (K and N multiples of 8), else torch's."""
    x, y = x.contiguous(), y.contiguous()
    if x.shape[1] % 8 == 0 and y.shape[1] % 8 == 0:
        return gemm_op(x, y, None, "kn", dtype)
    return (x @ y).to(dtype)


def _gemm_backward(ctx, dd):
    """D = A B^T (nk) or A B (kn): dA and dB are GEMMs in dD's 16-bit dtype (cast when D was fp32); dC = dD."""
    a, b = ctx.saved_tensors
    g = dd.to(a.dtype)
    if ctx.b_layout == "nk":
        da, db = _matmul(g, b, a.dtype), _matmul(g.t(), a, b.dtype)      # dD B, dD^T A
    else:
        da, db = _matmul(g, b.t(), a.dtype), _matmul(a.t(), g, b.dtype)  # dD B^T, A^T dD
    return da, db, (dd if ctx.has_c else None), None, None


gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup)


def _token_scale_strides(m: int) -> tuple:
    return 1, (m + 3) // 4 * 4  # quantize_fp8_per_token's "mmajor" layout


@torch.library.custom_op(f"{_LIB}::quantize_fp8_per_token", mutates_args=(), device_types="cuda")
def quantize_fp8_per_token_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_per_token(x)  # M-major scales: strides _token_scale_strides(m)


@quantize_fp8_per_token_op.register_fake
def _(x):
    m, k = x.shape
    return (x.new_empty((m, k), dtype=torch.float8_e4m3fn),
            x.new_empty_strided((m, (k + 127) // 128), _token_scale_strides(m), dtype=torch.float32))


@torch.library.custom_op(f"{_LIB}::quantize_fp8_per_block", mutates_args=(), device_types="cuda")
def quantize_fp8_per_block_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_per_block(w)


@quantize_fp8_per_block_op.register_fake
def _(w):
    n, k = w.shape
    return (w.new_empty((n, k), dtype=torch.float8_e4m3fn),
            w.new_empty(((n + 127) // 128, (k + 127) // 128), dtype=torch.float32))


@torch.library.custom_op(f"{_LIB}::gemm_fp8", mutates_args=(), device_types="cuda")
def gemm_fp8_op(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    return _gemm_fp8(a, sa, b, sb)


@gemm_fp8_op.register_fake
def _(a, sa, b, sb):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)


def gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, *, b_layout: str = "nk",
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """cudart_kernels.gemm as a torch op: A @ B^T (b_layout "nk") or A @ B ("kn") (+ C), a new tensor of
    `out_dtype` (default A's); differentiable (the gradients are our GEMMs where their rows are 16-byte aligned,
    torch's otherwise)."""
    return gemm_op(a, b, c, b_layout, out_dtype)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cudart_kernels.quantize_fp8_per_token as a torch op: (e4m3 [M, K], fp32 scales [M, K / 128] M-major)."""
    return quantize_fp8_per_token_op(x)


def quantize_fp8_per_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cudart_kernels.quantize_fp8_per_block as a torch op: (e4m3 [N, K], fp32 scales per 128 x 128 block)."""
    return quantize_fp8_per_block_op(w)


def gemm_fp8(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """cudart_kernels.gemm_fp8 as a torch op: (A * sA) @ (B * sB)^T in bf16, a new tensor."""
    return gemm_fp8_op(a, sa, b, sb)
