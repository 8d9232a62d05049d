"""The custom ops behind cudart_kernels.torch (imported on first use: it imports torch and registers them).

Each op runs our kernel on torch's current stream, into tensors torch allocates (so a CUDA graph capture keeps
them in its pool); the fake implementations give the same shapes, dtypes and (contiguous) strides.
"""
from __future__ import annotations

import math

import torch

from .ops.attention import attention as _attention
from .ops.attention_bwd import attention_backward as _attention_backward

_LIB = "cudart_kernels"


def _lse_shape(q: torch.Tensor, varlen: bool) -> tuple:
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


@torch.library.custom_op(f"{_LIB}::attention_fwd", mutates_args=(), device_types="cuda")
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                  cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int,
                  max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    varlen = cu_seqlens_q is not None
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    kw = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k) if varlen else {}
    _attention(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out, lse=lse,
               stream=torch.cuda.current_stream(q.device), **kw)
    return out, lse


@attention_fwd.register_fake
def _(q, k, v, causal, softmax_scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q, cu_seqlens_q is not None), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::attention_bwd", mutates_args=(), device_types="cuda")
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, softmax_scale: float, cu_seqlens_q: torch.Tensor | None,
                  cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                  deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    kw = dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k) if cu_seqlens_q is not None else {}
    _attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                        deterministic=deterministic, dq=dq, dk=dk, dv=dv,
                        stream=torch.cuda.current_stream(q.device), **kw)
    return dq, dk, dv


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
