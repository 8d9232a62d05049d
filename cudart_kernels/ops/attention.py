"""Attention forward (FlashAttention-3 class), host side: input rules, tile configs and shared-memory budgets.

The kernel (ptx/attention.cu, not built yet) is warp-specialized: a producer warpgroup loads a Q tile once and
streams K and V tiles through a TMA + mbarrier ring; consumer warpgroups own 64 query rows each, compute S = Q K^T
(SS-wgmma), the online softmax in registers, and O += P V with P from registers (RS-wgmma). This module holds what
does not need the GPU: the validation every call runs before any launch, and the pure config functions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..runtime import dtypes as dt
from ..runtime.interop import DeviceArray, require

HEAD_DIMS = (64, 96, 128, 192, 256)
_INPUTS = (dt.bfloat16, dt.float16)
SMEM_BUDGET = 227 * 1024  # opt-in dynamic shared memory of an SM90 CTA


class Dims(NamedTuple):
    """One call's sizes: batch (sequences), query and kv heads, head dim, query and key lengths (the longest,
    for varlen), and whether the layout is packed varlen."""
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    seqlen_q: int
    seqlen_k: int
    varlen: bool


def _check_seqlens(v: DeviceArray | None, name: str, batch: int | None) -> int:
    """cu_seqlens: int32 [B + 1] on the GPU (the kernel reads it; no host copy). Returns B."""
    if v is None:
        raise ValueError(f"{name} is required with packed [total, H, D] inputs")
    require(v, name, dtypes=(dt.int32,), ndim=1, row_align=0, align=4)
    if v.shape[0] < 2:
        raise ValueError(f"{name}: expected [batch + 1] offsets, got shape {v.shape}")
    if batch is not None and v.shape[0] - 1 != batch:
        raise ValueError(f"{name} has {v.shape[0] - 1} sequences but cu_seqlens_q has {batch}")
    return v.shape[0] - 1


def check_inputs(q: DeviceArray, k: DeviceArray, v: DeviceArray, cu_seqlens_q: DeviceArray | None = None,
                 cu_seqlens_k: DeviceArray | None = None, max_seqlen_q: int | None = None,
                 max_seqlen_k: int | None = None) -> Dims:
    """Validate q, k, v (and the varlen offsets); raise TypeError / ValueError naming the argument."""
    require(q, "q", dtypes=_INPUTS)
    for name, x in (("k", k), ("v", v)):
        require(x, name, dtypes=_INPUTS)
        if x.dtype is not q.dtype:
            raise TypeError(f"q, k and v must share a dtype, got q {q.dtype.name} and {name} {x.dtype.name}")
    varlen = q.ndim == 3
    if q.ndim not in (3, 4):
        raise ValueError(f"q: expected [B, S, H, D] or packed [total, H, D], got shape {q.shape}")
    for name, x in (("k", k), ("v", v)):
        if x.ndim != q.ndim:
            raise ValueError(f"{name} has {x.ndim} dimensions but q has {q.ndim}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {k.shape} and {v.shape}")
    heads_q, d = q.shape[-2:]
    heads_kv = k.shape[-2]
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim {d} not supported (supported: {', '.join(map(str, HEAD_DIMS))})")
    if k.shape[-1] != d:
        raise ValueError(f"q has head dim {d} but k and v have {k.shape[-1]}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of kv heads ({heads_kv})")
    if varlen:
        batch = _check_seqlens(cu_seqlens_q, "cu_seqlens_q", None)
        _check_seqlens(cu_seqlens_k, "cu_seqlens_k", batch)
        for name, x in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if x.device != q.device:
                raise ValueError(f"{name} is on cuda:{x.device} but q is on cuda:{q.device}")
        for name, x in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if x is None or int(x) != x or x < 0:
                raise ValueError(f"{name} (a host int: the longest sequence, for the grid) is required with "
                                 f"cu_seqlens, got {x!r}")
        seqlen_q, seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    else:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_q / cu_seqlens_k go with packed [total, H, D] inputs, not [B, S, H, D]")
        batch, seqlen_q = q.shape[0], q.shape[1]
        if k.shape[0] != batch:
            raise ValueError(f"q has batch {batch} but k and v have {k.shape[0]}")
        seqlen_k = k.shape[1]
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name} is on cuda:{x.device} but q is on cuda:{q.device}")
    return Dims(batch, heads_q, heads_kv, d, seqlen_q, seqlen_k, varlen)


def check_outputs(out: DeviceArray | None, lse: DeviceArray | None, q: DeviceArray, dims: Dims) -> None:
    """out: q's shape and dtype; lse: fp32 [B, H_q, S_q] (packed: [H_q, total_q]), rows contiguous."""
    if out is not None:
        require(out, "out", dtypes=(q.dtype,), ndim=q.ndim, shape=q.shape)
        if out.device != q.device:
            raise ValueError(f"out is on cuda:{out.device} but q is on cuda:{q.device}")
    if lse is not None:
        shape = (dims.heads_q, q.shape[0]) if dims.varlen else (dims.batch, dims.heads_q, dims.seqlen_q)
        require(lse, "lse", dtypes=(dt.float32,), ndim=len(shape), shape=shape, row_align=0, align=4)
        if lse.device != q.device:
            raise ValueError(f"lse is on cuda:{lse.device} but q is on cuda:{q.device}")


# ---- tile configs ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttnTuning:
    """Starting points per head dim (query rows a CTA, keys a tile, ring stages), FlashAttention-3's published
    tile shapes for the H100; to be fitted on the device."""
    tiles: tuple = ((64, (192, 128, 2)), (96, (128, 128, 2)), (128, (128, 128, 2)), (192, (128, 96, 2)),
                    (256, (128, 80, 2)))
    pdl: bool = True


TUNING = AttnTuning()


@dataclass(frozen=True)
class AttnConfig:
    bm: int       # query rows a CTA (64 a consumer warpgroup)
    bn: int       # keys a K / V tile
    stages: int   # K and V tiles in flight
    head_dim: int
    smem: int

    @property
    def consumers(self) -> int:
        return self.bm // 64

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)


def smem_bytes(bm: int, bn: int, d: int, stages: int, in_bytes: int = 2) -> int:
    """Q tile (reused to stage O for its TMA store), the K and V rings, 2 x stages + 2 mbarriers, 1 KB of
    alignment slack."""
    return bm * d * in_bytes + 2 * stages * bn * d * in_bytes + (2 * stages + 2) * 8 + 1024


def consumer_registers(bn: int, d: int) -> int:
    """fp32 registers a consumer thread holds across the loop: S (64 x bn), O (64 x d), P as 16-bit (64 x bn)."""
    return bn // 2 + d // 2 + bn // 4


def pick_config(d: int, tuning: AttnTuning = TUNING) -> AttnConfig:
    bm, bn, stages = dict(tuning.tiles)[d]
    smem = smem_bytes(bm, bn, d, stages)
    if smem > SMEM_BUDGET:
        raise ValueError(f"attention tile {bm}x{bn}x{d} with {stages} stages needs {smem} bytes of shared memory")
    return AttnConfig(bm, bn, stages, d, smem)
