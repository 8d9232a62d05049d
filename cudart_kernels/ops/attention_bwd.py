"""Attention backward (FlashAttention-3 class): dQ, dK, dV of `attention` from dO, the forward's output and its
log-sum-exp, for the forward's layouts (batched [B, S, H, D] or packed varlen), causal (bottom-right), GQA / MQA.

Three kernels run in order on the stream (ptx/attention_bwd_prep.cu, ptx/attention_bwd.cu):
- prep: dPsum = rowsum(dO * O) and the LSE in base 2, into padded per-head rows; the fp32 dQ accumulator cleared;
- main: persistent, warp-specialized; a unit is a block of 128 keys (64 at head dim 256) of a query head, whose K
  and V stay in shared memory while a producer streams the head's Q and dO tiles; two consumer warpgroups keep dK
  and dV in registers and add each tile's dQ partial into the accumulator straight from their registers (kept in
  wgmma fragment order, ptx/attention_bwd_layout.cuh; in a fixed order with `deterministic`);
- dq: accumulator * softmax scale -> dq's dtype (GQA: the fp32 dK and dV sums too).
This module validates every call before any launch, picks the config, builds the tensor maps and launches.
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, field

from ..runtime import dtypes as dt
from cuda.bindings import driver as cu

from ..runtime.driver import check, device_context, device_properties, enter_device, leave_device
from ..runtime.interop import DeviceArray, call_arrays, require, same_device
from ..runtime.launch import ArgsMemo, get_launcher
from ..runtime.plans import PLANS
from ..runtime.scratch import SCRATCH
from . import sm90
from .attention import _INPUTS, _KIND, SMEM_BUDGET, Dims, _key, _map_layout, check_inputs, check_outputs
from .sm90 import MapLayout

HEAD_DIMS = (64, 128, 256)
ROWS_PREP = 64  # query rows a CTA of the row kernels (ptx/attention_bwd_prep.cu)
STAT_PAD = 128  # the LSE / dPsum rows' padding (both kernels)
_MAIN_ARGS = ("tmap",) * 7 + ("ptr", "ptr", "i64", "i64", "i64", "i64", "ptr", "ptr") + ("i32",) * 8 + ("f32",) * 2 \
    + ("ptr",) * 7
_PREP_ARGS = ("ptr", "i64", "i64", "i64", "ptr", "i64", "i64", "i64", "ptr", "i64", "i64", "ptr", "i64", "ptr",
              "ptr", "i32")
_DQ_ARGS = ("ptr", "ptr", "i64", "i64", "i64", "ptr", "i32", "f32")
_SPLIT_KV_ARGS = ("ptr",) + ("ptr", "i64", "i64", "i64") * 2 + ("i32",) * 5


@dataclass(frozen=True)
class AttnBwdTuning:
    """Per head dim: query rows a tile (64; 128 at head dim 64), keys a unit (128: 64 per consumer warpgroup) and
    Q / dO ring stages (docs/tuning.md). Head dim 256 takes 64-key units (its consumers split the head dim)."""
    tiles: tuple = ((64, (128, 128, 2)), (128, (64, 128, 2)), (256, (64, 64, 2)))
    # causal units run in chunks of (sequence, query head) pairs whose Q, dO and fp32 dQ sums take about this much L2
    causal_l2_bytes: int = 32 << 20
    # the grid's last wave (not causal, varlen or deterministic): split the last units over their query tiles into
    # as many parts as evens out the CTAs' work (tail_split), each unit costing its tiles plus this many for its
    # K / V load and epilogue, a part this many more for its share of the fp32 dK / dV sums
    tail_split: bool = True
    unit_overhead_tiles: float = 1.0
    part_overhead_tiles: float = 1.0
    pdl: bool = True


TUNING = AttnBwdTuning()


@dataclass(frozen=True)
class AttnBwdConfig:
    bm: int
    bn: int
    stages: int
    head_dim: int
    smem: int
    threads: int = 384


def smem_bytes(bm: int, bn: int, d: int, stages: int, deterministic: bool = False) -> int:
    """Mirror of ptx/attention_bwd.cu (which checks it against the launch's: SMEM_LAUNCH): K (two buffers; one at
    head dim 256) and V, the Q and dO rings, two dS^T tiles (head dim 256: within the epilogue's staging for dK and
    dV), the consumers' 64 x 64 fp32 dQ blocks (deterministic mode, head dims 64 and 128), the LSE and dPsum rows of
    each stage, the barriers and unit slots, 1 KB of alignment slack."""
    exchange = 2 * bn * d if d == 256 else 2 * bn * bm * 2  # (256: the dK / dV staging)
    if deterministic and d != 256:
        exchange += 2 * 64 * 64 * 4
    k_bufs = 1 if d == 256 else 2  # (the next unit's K loads while this one runs)
    return ((k_bufs + 1) * bn * d * 2 + 2 * stages * bm * d * 2 + exchange + 2 * stages * bm * 4
            + (4 * stages + 14) * 8 + 8 + 1024)


def pick_config(d: int, tuning: AttnBwdTuning = TUNING, deterministic: bool = False) -> AttnBwdConfig:
    bm, bn, stages = dict(tuning.tiles)[d]
    # (ptx/attention_bwd.cu: a consumer's dQ is one 64 x 64 block a tile, its dK and dV 64 keys)
    if (bm, bn) != ((128, 128) if d == 64 else (64, 64) if d == 256 else (64, 128)):
        raise ValueError(f"attention backward tile {bm}x{bn} at head dim {d} is not one the kernel takes (query rows "
                         f"x keys: 128 x 128 at head dim 64, 64 x 128 at 128, 64 x 64 at 256)")
    smem = smem_bytes(bm, bn, d, stages, deterministic)
    if smem > SMEM_BUDGET:
        raise ValueError(f"attention backward tile {bm}x{bn}x{d} with {stages} stages needs {smem} bytes of shared "
                         f"memory")
    return AttnBwdConfig(bm, bn, stages, d, smem)


def _main_defines(dtype, cfg: AttnBwdConfig, causal: bool, varlen: bool, deterministic: bool) -> dict:
    return {"IN_KIND": _KIND[dtype], "HEAD_DIM": cfg.head_dim, "BM": cfg.bm, "BN": cfg.bn, "STAGES": cfg.stages,
            "CAUSAL": int(causal), "VARLEN": int(varlen), "DETERMINISTIC": int(deterministic),
            "SMEM_LAUNCH": cfg.smem}


def _row_defines(dtype, d: int, varlen: bool) -> dict:
    return {"IN_KIND": _KIND[dtype], "HEAD_DIM": d, "VARLEN": int(varlen)}


def variants():
    """Every kernel variant: each head dim, causal or not, batched or varlen, deterministic or not, bf16; fp16 at
    head dim 128; the row kernels for each (the split units' dK / dV conversion: batched)."""
    out = []
    for d in HEAD_DIMS:
        for dtype in (dt.bfloat16, dt.float16) if d == 128 else (dt.bfloat16,):
            for varlen in (False, True):
                for causal in (False, True):
                    for det in (False, True):
                        cfg = pick_config(d, deterministic=det)
                        out.append(("attention_bwd.cu", "attention_bwd_kernel",
                                    _main_defines(dtype, cfg, causal, varlen, det), cfg.smem))
                for entry in ("attention_bwd_prep", "attention_bwd_dq", "attention_bwd_rows") + (
                        () if varlen else ("attention_bwd_split_kv",)):
                    out.append(("attention_bwd_prep.cu", entry, _row_defines(dtype, d, varlen), 0))
    return out


# ---- validation -------------------------------------------------------------------------------------------------

def _check_like(x: DeviceArray | None, name: str, ref: DeviceArray, ref_name: str) -> None:
    if x is None:
        return
    require(x, name, dtypes=(ref.dtype,), ndim=ref.ndim, shape=ref.shape)
    same_device(**{ref_name: ref, name: x})


def check_backward(dov, qv, kv, vv, ov, lv, cq, ck, max_q, max_k, dqv, dkv, dvv) -> Dims:
    """Validate a backward call; raise TypeError / ValueError naming the argument."""
    dims = check_inputs(qv, kv, vv, cq, ck, max_q, max_k)
    if dims.head_dim not in HEAD_DIMS:
        raise ValueError(f"attention_backward: head dim {dims.head_dim} not supported "
                         f"(supported: {', '.join(map(str, HEAD_DIMS))})")
    for name, x in (("dout", dov), ("out", ov), ("lse", lv)):
        if x is None:
            raise ValueError(f"attention_backward needs {name} (the forward's output, its lse and the gradient of "
                             f"its output)")
    require(dov, "dout", dtypes=_INPUTS)
    _check_like(dov, "dout", qv, "q")
    check_outputs(ov, lv, qv, dims)
    _check_like(dqv, "dq", qv, "q")
    _check_like(dkv, "dk", kv, "k")
    _check_like(dvv, "dv", vv, "v")
    return dims


# ---- plans and launch ---------------------------------------------------------------------------------------------

def dq_acc_floats(dims: Dims, rows: int) -> int:
    """The fp32 dQ accumulator's size (ptx/attention_bwd_layout.cuh): a slot of 64 rows by H_q x D per 64-row tile of
    each sequence, rows / 64 + batch slots at most (rows: B * S_q, or total_q)."""
    return (rows // 64 + dims.batch) * 64 * dims.heads_q * dims.head_dim


def _stat_head(dims: Dims, rows: int) -> int:
    """Floats a head's LSE / dPsum rows take (ptx/attention_bwd_prep.cu), a multiple of 4."""
    if dims.varlen:
        n = rows + 2 * STAT_PAD * dims.batch + STAT_PAD
    else:
        n = dims.batch * (-(-dims.seqlen_q // STAT_PAD) * STAT_PAD)
    n = max(n, STAT_PAD)  # (no query rows: the main kernel still gets a valid map, which it never reads)
    return n + -n % 4


@dataclass(frozen=True)
class _Plan:
    cfg: AttnBwdConfig
    main: object
    prep: object
    post: object
    rows: object       # GQA's dK / dV sums to 16 bits (None without GQA)
    grid: tuple
    row_grid: tuple
    maps: tuple        # q, k, v, do, dk, dv, stats layouts
    scalars: tuple
    scratch: tuple
    stat_head: int
    run_main: bool
    run_rows: bool
    kv_acc_floats: int  # GQA: the fp32 dK (and dV) accumulator's size, else 0
    kv_grid: tuple      # (the dK / dV conversion's grid)
    split_kv: object    # the split units' dK / dV conversion (None: no split units, or GQA)
    split_grid: tuple
    memo: ArgsMemo = field(default_factory=ArgsMemo, compare=False, repr=False)


def _plan(arrays, dims: Dims, causal: bool, scale: float, deterministic: bool, tuning: AttnBwdTuning) -> _Plan:
    dov, qv, kv, vv, ov, lv, dqv, dkv, dvv = arrays
    cfg = pick_config(dims.head_dim, tuning, deterministic)
    dev = qv.device
    main = get_launcher("attention_bwd.cu", "attention_bwd_kernel",
                        _main_defines(qv.dtype, cfg, causal, dims.varlen, deterministic), dev, _MAIN_ARGS,
                        (cfg.threads,), cfg.smem, pdl=tuning.pdl)
    row_defs = _row_defines(qv.dtype, dims.head_dim, dims.varlen)
    prep = get_launcher("attention_bwd_prep.cu", "attention_bwd_prep", row_defs, dev, _PREP_ARGS, (256,), 0,
                        pdl=tuning.pdl)
    post = get_launcher("attention_bwd_prep.cu", "attention_bwd_dq", row_defs, dev, _DQ_ARGS, (256,), 0,
                        pdl=tuning.pdl)
    n_blocks = -(-dims.seqlen_k // cfg.bn)
    units = n_blocks * dims.heads_q * dims.batch
    m_blocks = -(-dims.seqlen_q // cfg.bm)
    ctas = device_properties(dev).sm_count
    split_units, parts = (0, 1)
    if tuning.tail_split and not (causal or dims.varlen or deterministic):
        split_units, parts = tail_split(units, ctas, m_blocks, tuning)
    grid = (max(1, min(units + split_units * (parts - 1), ctas)), 1, 1)
    m_prep = -(-dims.seqlen_q // STAT_PAD) * (STAT_PAD // ROWS_PREP)  # (the stats rows up to the padding)
    row_grid = (max(1, m_prep), dims.heads_q, dims.batch)
    rows_q = qv.shape[0] if dims.varlen else dims.batch * dims.seqlen_q
    stat_head = _stat_head(dims, rows_q)
    maps = (_map_layout(qv, dims.varlen, cfg.bm), _map_layout(kv, dims.varlen, cfg.bn),
            _map_layout(vv, dims.varlen, cfg.bn), _map_layout(dov, dims.varlen, cfg.bm),
            _map_layout(dkv, dims.varlen, 64), _map_layout(dvv, dims.varlen, 64),
            MapLayout(dt.float32, (stat_head, 2 * dims.heads_q), (stat_head * 4,), (cfg.bm, 1), 0))
    group = dims.heads_q // dims.heads_kv
    scalars = (dims.seqlen_q, dims.seqlen_k, dims.heads_q, dims.batch, group, causal_head_group(dims, tuning),
               units - split_units, parts, scale * math.log2(math.e), scale)
    scratch = (("attn_bwd_dq", dq_acc_floats(dims, rows_q) * 4, False),
               ("attn_bwd_stats", 2 * dims.heads_q * stat_head * 4, False),
               ("attention_units", 8, True))
    rows_k = kv.shape[0] if dims.varlen else dims.batch * dims.seqlen_k
    kv_acc_floats = rows_k * dims.heads_kv * dims.head_dim if group > 1 else 0
    rows = None
    if group > 1:  # GQA: dK and dV summed over the group in fp32, then converted
        scratch += (("attn_bwd_dkv", 2 * max(kv_acc_floats, 1) * 4, False),)
        rows = get_launcher("attention_bwd_prep.cu", "attention_bwd_rows", row_defs, dev, _DQ_ARGS, (256,), 0,
                            pdl=tuning.pdl)
    split_kv, split_grid = None, ()
    if split_units and group == 1:  # (GQA: the split units' parts add into the group's sums as any unit)
        scratch += (("attn_bwd_split", split_units * 2 * cfg.bn * dims.head_dim * 4, True),)
        split_kv = get_launcher("attention_bwd_prep.cu", "attention_bwd_split_kv", row_defs, dev, _SPLIT_KV_ARGS,
                                (256,), 0, pdl=tuning.pdl)
        split_grid = (split_units, 2, -(-cfg.bn // ROWS_PREP))
    if deterministic:
        # (an int per query tile and consumer)
        scratch += (("attn_bwd_order", dims.batch * dims.heads_q * m_blocks * 4 * 2, True),
                    ("attn_bwd_kv_order", dims.batch * dims.heads_kv * max(n_blocks, 1) * 4, True))
    kv_grid = (max(1, -(-dims.seqlen_k // ROWS_PREP)), dims.heads_kv, dims.batch)
    return _Plan(cfg, main, prep, post, rows, grid, row_grid, maps, scalars, scratch, stat_head,
                 run_main=units > 0, run_rows=m_prep > 0 and dims.batch > 0, kv_acc_floats=kv_acc_floats,
                 kv_grid=kv_grid, split_kv=split_kv, split_grid=split_grid)


@functools.lru_cache(maxsize=256)  # (about 6 ms of Python a call: shapes of one unit count share it)
def tail_split(units: int, ctas: int, tiles: int, tuning: AttnBwdTuning = TUNING) -> tuple:
    """(split units, parts): the last `split units` of `units` equal units (`tiles` query tiles each) come as `parts`
    parts each, where that ends the grid of `ctas` CTAs at least 1% sooner; else (0, 1)."""
    if units == 0 or tiles < 2:
        return 0, 1
    whole = tiles + tuning.unit_overhead_tiles
    best, choice = -(-units // ctas) * whole, (0, 1)
    for parts in (2, 3, 4):
        if parts > tiles:
            break
        costs = [(p + 1) * tiles // parts - p * tiles // parts + tuning.unit_overhead_tiles + tuning.part_overhead_tiles
                 for p in range(parts)]
        most = min(units, 2 * ctas)
        for split in sorted({*range(max(1, ctas // 8), most + 1, max(1, ctas // 8)), most}):
            end = _tail_end(units - split, costs * split, ctas, whole)
            if end < 0.99 * best:
                best, choice = end, (split, parts)
    return choice


def _tail_end(n_whole: int, tail: list, ctas: int, whole: float) -> float:
    """When the last CTA finishes: `n_whole` units of cost `whole` run in rounds, then each of the `tail` costs (in
    order) goes to the CTA that finishes first (the kernel's CTAs take their next unit near the end of the current
    one)."""
    rounds, rest = divmod(n_whole, ctas)
    free = [(rounds + (i < rest)) * whole for i in range(ctas)]
    heapq.heapify(free)
    for cost in tail:
        heapq.heappush(free, heapq.heappop(free) + cost)
    return max(free)


def causal_head_group(dims: Dims, tuning: AttnBwdTuning = TUNING) -> int:
    """(sequence, query head) pairs per causal chunk (ptx/attention_bwd.cu, BwdScheduler): as many as share
    causal_l2_bytes of Q, dO (16-bit) and dQ sums (fp32)."""
    per_head = max(dims.seqlen_q, 1) * dims.head_dim * 8
    return max(1, min(dims.heads_q * dims.batch, tuning.causal_l2_bytes // per_head))


def _strides(x: DeviceArray, varlen: bool) -> tuple:
    """(row, head, batch) element strides (batch 0 for packed varlen)."""
    if varlen:
        return x.strides[0], x.strides[1], 0
    return x.strides[1], x.strides[2], x.strides[0]


def attention_backward(dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None,
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int | None = None,
                       max_seqlen_k: int | None = None, deterministic: bool = False, dq=None, dk=None, dv=None,
                       stream=None, tuning: AttnBwdTuning | None = None):
    """Attention backward: (dq, dk, dv) of out = attention(q, k, v, ...) given dout, out and the forward's lse.

    q, k, v, causal, softmax_scale, cu_seqlens_q / cu_seqlens_k and max_seqlen_q / max_seqlen_k are the forward
    call's (see `attention`; head dims 64, 128 and 256); out is its output and lse its fp32 log-sum-exp
    ([B, H_q, S_q], varlen [H_q, total_q]: `attention(..., return_lse=True)`); dout has out's shape and dtype.
    dq has q's shape and dtype, dk and dv k's and v's (GQA: summed over the query heads of each kv head); they are
    allocated when None, in the inputs' framework (inside a CUDA graph capture, pass them unless the inputs are
    torch tensors). Accumulation is fp32. With `deterministic` the results are bitwise identical from run to run
    (the dQ partials of the key blocks are added in a fixed order, at some cost in speed); otherwise dq may differ
    in the last bits between runs. Runs on `stream` (None as for `attention`).
    """
    arrays = call_arrays((dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv), stream)
    dov, qv, kv, vv, ov, lv, cq, ck, dqv, dkv, dvv, h, native = arrays
    dims = check_backward(dov, qv, kv, vv, ov, lv, cq, ck, max_seqlen_q, max_seqlen_k, dqv, dkv, dvv)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(dims.head_dim)
    softmax_scale = float(softmax_scale)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    if dqv is None:
        dqv = native.empty(qv.shape, qv.dtype, qv.device, h, stream)
    if dkv is None:
        dkv = native.empty(kv.shape, kv.dtype, kv.device, h, stream)
    if dvv is None:
        dvv = native.empty(vv.shape, vv.dtype, vv.device, h, stream)
    if dims.batch == 0 or (qv.size == 0 and kv.size == 0):
        return _result(native, (dqv, dkv, dvv), (dq, dk, dv))
    key = ("attention_bwd", _key(dov), _key(qv), _key(kv), _key(vv), _key(ov), _key(lv), _key(cq), _key(dqv),
           _key(dkv), _key(dvv), dims, causal, softmax_scale, bool(deterministic), tuning)
    plan = PLANS.get(key)
    if plan is None:
        plan = PLANS.add(key, _plan((dov, qv, kv, vv, ov, lv, dqv, dkv, dvv), dims, causal, softmax_scale,
                                    bool(deterministic), tuning or TUNING))
    caller = enter_device(qv.device)  # (every array was checked to be on q's device)
    try:
        _launch(plan, dims, h, (dov, qv, kv, vv, ov, lv, cq, ck, dqv, dkv, dvv))
    finally:
        leave_device(caller)
    return _result(native, (dqv, dkv, dvv), (dq, dk, dv))


def _launch(plan: _Plan, dims: Dims, h: int, arrays) -> None:
    """The prep, main and conversion launches of one call, with the device's context current."""
    dov, qv, kv, vv, ov, lv, cq, ck, dqv, dkv, dvv = arrays
    scratch = dict(zip((n[0] for n in plan.scratch), SCRATCH.acquire(qv.device, h, plan.scratch)))
    dkv_acc = scratch.get("attn_bwd_dkv", 0)
    ptrs = (dov.ptr, qv.ptr, kv.ptr, vv.ptr, ov.ptr, lv.ptr, 0 if cq is None else cq.ptr,
            0 if ck is None else ck.ptr, dqv.ptr, dkv.ptr, dvv.ptr, scratch["attn_bwd_dq"], scratch["attn_bwd_stats"],
            scratch["attention_units"], scratch.get("attn_bwd_order", 0), scratch.get("attn_bwd_kv_order", 0),
            dkv_acc, dkv_acc + 4 * plan.kv_acc_floats if dkv_acc else 0, scratch.get("attn_bwd_split", 0))
    args = plan.memo.get(ptrs)
    if args is None:
        args = plan.memo.add(ptrs, _args(plan, dims, (dov, qv, ov, lv, dqv, dkv, dvv), ptrs))
    prep_args, main_args, post_args, kv_post_args, split_args = args
    if plan.run_rows:
        plan.prep.run(plan.row_grid, h, prep_args)
    if plan.run_main:
        if plan.kv_acc_floats:
            if cu.cuMemsetD32Async(dkv_acc, 0, 2 * plan.kv_acc_floats, h)[0]:  # (a caller's own context: again in ours)
                with device_context(qv.device):
                    check(cu.cuMemsetD32Async(dkv_acc, 0, 2 * plan.kv_acc_floats, h))
        plan.main.run(plan.grid, h, main_args)
        if plan.split_kv is not None:
            plan.split_kv.run(plan.split_grid, h, split_args)
        for a in kv_post_args:
            plan.rows.run(plan.kv_grid, h, a)
    if plan.run_rows:
        plan.post.run(plan.row_grid, h, post_args)


def _result(native, views, given) -> tuple:
    """(dq, dk, dv): the arrays given, else the ones allocated, in the inputs' framework (after the launch)."""
    return tuple(native.result(v) if g is None else g for v, g in zip(views, given))


def _args(plan: _Plan, dims: Dims, arrays, ptrs) -> tuple:
    dov, qv, ov, lv, dqv, dkv, dvv = arrays
    do_p, q_p, k_p, v_p, o_p, lse_p, cq_p, ck_p, dq_p, dk_p, dv_p, acc, stats, counter, order, kv_order, dk_acc, \
        dv_acc, split = ptrs
    maps = sm90.thread_maps()
    m_q, m_k, m_v, m_do, m_dk, m_dv, m_stats = plan.maps
    lse_b, lse_h = (0, lv.strides[0]) if dims.varlen else (lv.strides[0], lv.strides[1])
    seqlen_q = dims.seqlen_q
    prep = (o_p, *_strides(ov, dims.varlen), do_p, *_strides(dov, dims.varlen), lse_p, lse_b, lse_h, stats,
            plan.stat_head, acc, cq_p, seqlen_q)
    post = (acc, dq_p, *_strides(dqv, dims.varlen), cq_p, seqlen_q, plan.scalars[-1])
    kv_post = ((dk_acc, dk_p, *_strides(dkv, dims.varlen), ck_p, dims.seqlen_k, 1.0),
               (dv_acc, dv_p, *_strides(dvv, dims.varlen), ck_p, dims.seqlen_k, 1.0)) if plan.kv_acc_floats else ()
    if not plan.run_main:
        return prep, None, post, kv_post, None
    dk_row, dk_head, _ = _strides(dkv, dims.varlen)
    dv_row, dv_head, _ = _strides(dvv, dims.varlen)
    main = (maps.get(m_q, q_p), maps.get(m_k, k_p), maps.get(m_v, v_p), maps.get(m_do, do_p), maps.get(m_dk, dk_p),
            maps.get(m_dv, dv_p), maps.get(m_stats, stats), dk_p, dv_p, dk_row, dk_head, dv_row, dv_head, cq_p, ck_p,
            *plan.scalars, acc, dk_acc, dv_acc, counter, order, kv_order, split)
    seqlen_k, heads_q, split_from = plan.scalars[1], plan.scalars[2], plan.scalars[6]
    split_kv = (split, dk_p, *_strides(dkv, False), dv_p, *_strides(dvv, False), split_from,
                -(-seqlen_k // plan.cfg.bn), heads_q, seqlen_k, plan.cfg.bn) if plan.split_kv is not None else None
    return prep, main, post, kv_post, split_kv
