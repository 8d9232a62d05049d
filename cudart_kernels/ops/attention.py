"""Attention forward (FlashAttention-3 class): O = softmax(scale * Q K^T) V with the row log-sum-exp, batched
[B, S, H, D] or packed variable-length [total, H, D] inputs, causal (bottom-right), GQA / MQA.

The kernel (ptx/attention.cu) is warp-specialized and persistent: a producer warpgroup loads a Q tile once and
streams K and V tiles through TMA + mbarrier rings; consumer warpgroups own 64 query rows each, compute S = Q K^T
(SS-wgmma), the online softmax in registers, and O += P V with P from registers (RS-wgmma), taking turns on the
tensor cores (pingpong). This module validates every call before any launch, picks the tiles, builds the 4-d
tensor maps and launches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ..runtime import dtypes as dt
from ..runtime.driver import device_properties, enter_device, leave_device
from ..runtime.interop import DeviceArray, call_arrays, require, same_device
from ..runtime.launch import ArgsMemo, get_launcher
from ..runtime.plans import PLANS
from ..runtime.scratch import SCRATCH
from . import sm90
from .sm90 import MapLayout

HEAD_DIMS = (64, 128, 192, 256)
_KIND = {dt.bfloat16: "KIND_BF16", dt.float16: "KIND_FP16"}
_ARGS = ("tmap", "tmap", "tmap", "tmap", "ptr", "i64", "i64", "ptr", "i64", "i64", "ptr", "ptr", "i32", "i32", "i32",
          "i32", "i32", "i32", "f32", "ptr")
PANEL = 64  # head-dim columns of one 128-byte swizzled box
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
    same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return Dims(batch, heads_q, heads_kv, d, seqlen_q, seqlen_k, varlen)


def check_outputs(out: DeviceArray | None, lse: DeviceArray | None, q: DeviceArray, dims: Dims) -> None:
    """out: q's shape and dtype; lse: fp32 [B, H_q, S_q] (packed: [H_q, total_q]), rows contiguous."""
    if out is not None:
        require(out, "out", dtypes=(q.dtype,), ndim=q.ndim, shape=q.shape)
    if lse is not None:
        shape = (dims.heads_q, q.shape[0]) if dims.varlen else (dims.batch, dims.heads_q, dims.seqlen_q)
        require(lse, "lse", dtypes=(dt.float32,), ndim=len(shape), shape=shape, row_align=0, align=4)
    same_device(q=q, out=out, lse=lse)


# ---- tile configs ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttnTuning:
    """Tiles per head dim: (query rows a CTA = 64 x consumer warpgroups, keys a K / V tile, ring stages), from
    FlashAttention-3's published H100 shapes (docs/tuning.md); for non-causal attention over at least
    wide_min_seqlen_k keys, wider key tiles, and for causal attention over at most short_max_seqlen_k keys, shorter
    query tiles, where they measured faster; pingpong: the consumers take turns on the tensor cores; o_buffer: O gets
    a shared-memory tile of its own wherever it fits (ptx/attention.cu O_BUFFER)."""
    tiles: tuple = ((64, (192, 128, 3)), (128, (128, 128, 2)), (192, (128, 96, 2)), (256, (128, 80, 2)))
    noncausal_tiles: tuple = ((128, (128, 160, 2)),)
    wide_min_seqlen_k: int = 4096
    short_causal_tiles: tuple = ((64, (128, 128, 3)),)
    short_max_seqlen_k: int = 1024
    pingpong: bool = True
    o_buffer: bool = True
    # causal units run in chunks of (batch, head) pairs whose K and V together take about this much L2
    causal_l2_bytes: int = 32 << 20
    pdl: bool = True


TUNING = AttnTuning()


@dataclass(frozen=True)
class AttnConfig:
    bm: int       # query rows a CTA (64 a consumer warpgroup)
    bn: int       # keys a K / V tile
    stages: int   # K and V tiles in flight
    head_dim: int
    smem: int
    pingpong: bool = True
    o_buffer: bool = False

    @property
    def consumers(self) -> int:
        return self.bm // 64

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)


def smem_bytes(bm: int, bn: int, d: int, stages: int, o_buffer: bool = False, in_bytes: int = 2) -> int:
    """Mirror of ptx/attention.cu: the Q tile, O's own tile (else O is staged in the Q tile), the K and V rings,
    their 4 x stages mbarriers and the Q tile's two, 1 KB of alignment slack."""
    return ((2 if o_buffer else 1) * bm * d * in_bytes + 2 * stages * bn * d * in_bytes + 4 * stages * 8 + 16
            + 1024)


def consumer_registers(bn: int, d: int) -> int:
    """fp32 registers a consumer thread holds across the loop: S (64 x bn), O (64 x d), P as 16-bit (64 x bn)."""
    return bn // 2 + d // 2 + bn // 4


def pick_config(d: int, causal: bool = False, seqlen_k: int = 0, tuning: AttnTuning = TUNING) -> AttnConfig:
    if not causal and seqlen_k >= tuning.wide_min_seqlen_k:
        special = tuning.noncausal_tiles
    elif causal and 0 < seqlen_k <= tuning.short_max_seqlen_k:
        special = tuning.short_causal_tiles
    else:
        special = ()
    bm, bn, stages = dict(special).get(d) or dict(tuning.tiles)[d]
    o_buffer = tuning.o_buffer and smem_bytes(bm, bn, d, stages, True) <= SMEM_BUDGET
    smem = smem_bytes(bm, bn, d, stages, o_buffer)
    if smem > SMEM_BUDGET:
        raise ValueError(f"attention tile {bm}x{bn}x{d} with {stages} stages needs {smem} bytes of shared memory")
    return AttnConfig(bm, bn, stages, d, smem, tuning.pingpong, o_buffer)


def _defines(dtype, cfg: AttnConfig, causal: bool, varlen: bool) -> dict:
    return {"IN_KIND": _KIND[dtype], "HEAD_DIM": cfg.head_dim, "BM": cfg.bm, "BN": cfg.bn, "STAGES": cfg.stages,
            "CAUSAL": int(causal), "VARLEN": int(varlen), "PINGPONG": int(cfg.pingpong),
            "O_BUFFER": int(cfg.o_buffer)}


def variants():
    """Every kernel variant: each head dim, causal or not (short and long keys), batched or varlen, bf16; fp16 at
    head dim 128."""
    out = []
    for d in HEAD_DIMS:
        for dtype in (dt.bfloat16, dt.float16) if d == 128 else (dt.bfloat16,):
            for causal, seqlen_k in ((False, 0), (False, TUNING.wide_min_seqlen_k), (True, 0),
                                     (True, TUNING.short_max_seqlen_k)):
                cfg = pick_config(d, causal, seqlen_k)
                for varlen in (False, True):
                    out.append(("attention.cu", "attention_fwd_kernel", _defines(dtype, cfg, causal, varlen),
                                cfg.smem))
    return list({tuple(sorted(v[2].items())): v for v in out}.values())


# ---- plans and launch -------------------------------------------------------------------------------------------

def _map_layout(x: DeviceArray, varlen: bool, rows_box: int) -> MapLayout:
    """(head dim, rows, heads, batch) with 128-byte boxes of 64 columns by `rows_box` rows. Packed inputs have one
    batch; a dimension of one element gets a stride TMA accepts (its stride is never used)."""
    it = x.dtype.itemsize
    if varlen:
        (rows, heads, d), (s_row, s_head, _) = x.shape, x.strides
        batch, s_batch = 1, 0
    else:
        (batch, rows, heads, d), (s_batch, s_row, s_head, _) = x.shape, x.strides
    strides = tuple(s * it if n > 1 else d * it for n, s in zip((rows, heads, batch), (s_row, s_head, s_batch)))
    return MapLayout(x.dtype, (d, max(rows, 1), heads, batch), strides, (PANEL, rows_box, 1, 1), 128)


@dataclass(frozen=True)
class _Plan:
    cfg: AttnConfig
    launch: object
    grid: tuple
    map_q: MapLayout
    map_k: MapLayout
    map_v: MapLayout
    map_o: MapLayout
    kv_from_q: bool  # no keys at all: K and V maps are never read, so Q's memory stands in for them
    scalars: tuple   # o_row, o_head, lse_b, lse_h; then seqlen_q, seqlen_k, heads, batch, group, head_group,
    #                  scale_log2
    scratch: tuple   # units of unequal length (causal, varlen) are handed out by a counter: its scratch slot
    memo: ArgsMemo = field(default_factory=ArgsMemo, compare=False, repr=False)


def _plan(qv, kv, vv, ov, lv, dims: Dims, causal: bool, scale: float, tuning: AttnTuning) -> _Plan:
    cfg = pick_config(dims.head_dim, causal, dims.seqlen_k, tuning)
    props = device_properties(qv.device)
    launch = get_launcher("attention.cu", "attention_fwd_kernel", _defines(qv.dtype, cfg, causal, dims.varlen),
                          qv.device, _ARGS, (cfg.threads,), cfg.smem, pdl=tuning.pdl)
    units = -(-dims.seqlen_q // cfg.bm) * dims.heads_q * dims.batch
    grid = (max(1, min(units, props.sm_count)), 1, 1)
    kv_from_q = kv.shape[-3] == 0
    src_k, src_v = (qv, qv) if kv_from_q else (kv, vv)
    if lv is None:
        lse_b = lse_h = 0
    elif dims.varlen:
        lse_b, lse_h = 0, lv.strides[0]
    else:
        lse_b, lse_h = lv.strides[0], lv.strides[1]
    o_row, o_head = ov.strides[-3], ov.strides[-2]
    group = dims.heads_q // dims.heads_kv
    scalars = (o_row, o_head, lse_b, lse_h, dims.seqlen_q, dims.seqlen_k, dims.heads_q, dims.batch, group,
               causal_head_group(dims, tuning), scale * math.log2(math.e))
    scratch = (("attention_units", 8, True),) if causal or dims.varlen else ()
    return _Plan(cfg, launch, grid, _map_layout(qv, dims.varlen, cfg.bm), _map_layout(src_k, dims.varlen, cfg.bn),
                 _map_layout(src_v, dims.varlen, cfg.bn), _map_layout(ov, dims.varlen, 64), kv_from_q, scalars,
                 scratch)


def causal_head_group(dims: Dims, tuning: AttnTuning = TUNING) -> int:
    """(batch, head) pairs per causal chunk: as many query heads as share causal_l2_bytes of K and V (a kv head's
    K and V serve `group` query heads)."""
    per_q_head = 2 * max(dims.seqlen_k, 1) * dims.head_dim * 2 / (dims.heads_q // dims.heads_kv)
    return max(1, min(dims.heads_q * dims.batch, int(tuning.causal_l2_bytes // per_q_head)))


def _args(plan: _Plan, q: int, k: int, v: int, o: int, lse: int, cu_q: int, cu_k: int, counter: int) -> tuple:
    maps = sm90.thread_maps()
    if plan.kv_from_q:
        k = v = q
    o_row, o_head, lse_b, lse_h, *rest = plan.scalars
    return (maps.get(plan.map_q, q), maps.get(plan.map_k, k), maps.get(plan.map_v, v), maps.get(plan.map_o, o), o,
            o_row, o_head, lse, lse_b, lse_h, cu_q, cu_k, *rest, counter)


def _key(x: DeviceArray | None):
    return None if x is None else sm90.array_key(x)


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
              return_lse: bool = False, out=None, lse=None, stream=None, tuning: AttnTuning | None = None):
    """Attention forward: out = softmax(softmax_scale * q k^T) v per query head, fp32 accumulation.

    q [B, S_q, H_q, D], k and v [B, S_k, H_kv, D] (bf16 or fp16, one dtype; D in 64, 128, 192, 256; H_q a multiple
    of H_kv: GQA / MQA), or packed varlen q [total_q, H_q, D] and k, v [total_k, H_kv, D] with `cu_seqlens_q` /
    `cu_seqlens_k` (int32 [B + 1] on the GPU, read by the kernel: no host sync) and `max_seqlen_q` /
    `max_seqlen_k` (host ints, at least the longest sequence: the grid is sized from max_seqlen_q). Any strides
    with a contiguous head dim and 16-byte aligned rows: a slice of a fused QKV tensor, or torch's [B, H, S, D]
    seen through .transpose(1, 2), run without a copy. `causal` aligns the mask bottom-right (query i sees keys
    j <= i + S_k - S_q); a query that sees no key gets out = 0 and lse = -inf. `softmax_scale` defaults to
    1 / sqrt(D). With `return_lse` (or an `lse` given), the natural-log row log-sum-exp is written in fp32,
    [B, H_q, S_q] (varlen [H_q, total_q]), and (out, lse) is returned; otherwise out. `out` / `lse` are allocated
    when None, in the inputs' framework (README: results and streams; inside a CUDA graph capture, pass both
    unless the inputs are torch tensors). Runs on `stream` (None: torch's or cupy's current stream for their
    arrays, else the legacy default stream).
    """
    qv, kv, vv, ov, lv, cq, ck, h, native = call_arrays((q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k), stream)
    dims = check_inputs(qv, kv, vv, cq, ck, max_seqlen_q, max_seqlen_k)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(dims.head_dim)
    softmax_scale = float(softmax_scale)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    check_outputs(ov, lv, qv, dims)
    if ov is None:
        ov = native.empty(qv.shape, qv.dtype, qv.device, h, stream)
    if lv is None and return_lse:
        shape = (dims.heads_q, qv.shape[0]) if dims.varlen else (dims.batch, dims.heads_q, dims.seqlen_q)
        lv = native.empty(shape, dt.float32, qv.device, h, stream)
    if qv.size == 0 or dims.batch == 0 or dims.seqlen_q == 0:
        return _result(native, ov, lv, out, lse, return_lse)
    key = ("attention", _key(qv), _key(kv), _key(vv), _key(ov), _key(lv), _key(cq), dims, causal, softmax_scale,
           tuning)
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.add(key, _plan(qv, kv, vv, ov, lv, dims, causal, softmax_scale, tuning or TUNING))
    caller = enter_device(qv.device)  # (every array was checked to be on q's device)
    try:
        counter = SCRATCH.acquire(qv.device, h, plan.scratch)[0] if plan.scratch else 0
        ptrs = (qv.ptr, kv.ptr, vv.ptr, ov.ptr, 0 if lv is None else lv.ptr, 0 if cq is None else cq.ptr,
                0 if ck is None else ck.ptr, counter)
        args = plan.memo.get(ptrs)
        if args is None:
            args = plan.memo.add(ptrs, _args(plan, *ptrs))
        plan.launch.run(plan.grid, h, args)
    finally:
        leave_device(caller)
    return _result(native, ov, lv, out, lse, return_lse)


def _result(native, ov, lv, out, lse, return_lse: bool):
    """out, or (out, lse): the arrays given, else the ones allocated, in the inputs' framework (after the launch)."""
    o = native.result(ov) if out is None else out
    if return_lse or lse is not None:
        return o, (native.result(lv) if lse is None else lse)
    return o
