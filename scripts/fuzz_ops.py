"""Random shapes through every public op and its own picks (no forced tiles): poisoned outputs, fp32 references
from torch, rows that must stay unwritten checked. One line per failure, a summary per op
exit status 1 on any.

    python scripts/fuzz_ops.py [--seed N] [--seconds S] [--verbose]

Shapes are log-uniform, often near powers of two, with every tail the ops allow (M any, N and K multiples of 8 or
16), grouped layouts with empty groups, masked counts of 0 and above M, causal and GQA attention with S_q != S_k.
A run of 1700 cases on an H200 (2026-11-29) found the masked GEMM's faults at M = 1 that the shape lists of the
tests missed.
"""
import argparse
import itertools
import math
import random
import sys
import time
import traceback

import torch

import cudart_kernels as ck

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--seed", type=int, default=1)
ARGS.add_argument("--seconds", type=float, default=240, help="stop starting cases after this long")
ARGS.add_argument("--verbose", action="store_true", help="print each case before it runs")
OPT = ARGS.parse_args()
rng = random.Random(OPT.seed)
torch.manual_seed(OPT.seed)
dev = "cuda"
stats = {}
E4 = torch.float8_e4m3fn


def rel(x, ref, floor=1e-30):
    """Norm-wise relative error; `floor`: the smallest RMS of ref it is taken relative to (a reference that is
    zero but for rounding, as dq and dk with one key)."""
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(floor * ref.numel() ** 0.5)).item()


def note(op, desc):
    if OPT.verbose:
        print("RUN", op, desc, flush=True)


def record(op, desc, ok, msg=""):
    s = stats.setdefault(op, [0, 0])
    s[0] += 1
    if not ok:
        s[1] += 1
        print(f"FAIL {op} {desc} {msg}", flush=True)


def pick(lo, hi, align=1, skew=True):
    """log-uniform in [lo, hi], rounded up to align; sometimes exactly a power-of-two-ish size +- a bit"""
    x = math.exp(rng.uniform(math.log(lo), math.log(hi))) if skew else rng.uniform(lo, hi)
    x = int(x)
    if rng.random() < 0.3:
        x = 1 << max(0, int(round(math.log2(max(x, 1)))))
        x += rng.choice([0, 0, align, -align])
    x = max(lo, min(hi, x))
    return -(-x // align) * align


def maybe_strided(x):
    """x, or the same values in a slice of a wider tensor (rows further apart, 16-byte aligned): the layout of a
    fused projection's output"""
    if rng.random() < 0.7 or x.dim() != 2:
        return x
    pad = 16 // x.element_size() * rng.randint(1, 8)
    wide = torch.empty(x.shape[0], x.shape[1] + pad, device=dev, dtype=x.dtype)
    wide.view(torch.uint8 if x.element_size() == 1 else torch.int16 if x.element_size() == 2 else torch.int32).fill_(
        {1: 0x7F, 2: 0x7FFF, 4: 0x7FFFFFFF}[x.element_size()])  # NaN in e4m3, bf16 / fp16 and fp32
    off = rng.choice([0, pad])
    wide[:, off:off + x.shape[1]] = x
    return wide[:, off:off + x.shape[1]]


def only_view_written(out):
    """out finite, and where out is a slice of a wider tensor, the rest of that tensor still NaN"""
    base = out if out._base is None else out._base
    return torch.isfinite(out).all().item() and torch.isnan(base).sum().item() == base.numel() - out.numel()


def maybe_side_stream():
    """None (the current stream) or a fresh side stream, after the current one's work; the caller syncs on it"""
    if rng.random() < 0.75:
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    return side


def fp8_operands(rows, k):
    q = (torch.randn(rows, k, device=dev) * 2).to(E4)
    s = torch.rand(rows, -(-k // 128), device=dev) + 0.25
    return q, s


def deq_rows(q, s):  # 1x128 scales
    k = q.shape[-1]
    return q.float() * s.repeat_interleave(128, dim=-1)[..., :k]


def deq_blocks(q, s):  # 128x128 scales: q [N, K], s [ceil(N/128), ceil(K/128)]
    n, k = q.shape
    return q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]


def case_gemm():
    m = pick(1, 8192)
    n = pick(8, 16384, 8)
    k = pick(8, 32768, 8)
    while m * n * k > 2e11:
        k = max(8, (k // 2) // 8 * 8)
        m = max(1, m // 2)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    kn = rng.random() < 0.3
    out_dtype = rng.choice([dtype, dtype, torch.float32])
    a = torch.randn(m, k, device=dev, dtype=dtype)
    b = torch.randn(k, n, device=dev, dtype=dtype) if kn else torch.randn(n, k, device=dev, dtype=dtype)
    use_c = rng.random() < 0.25
    c = torch.randn(m, n, device=dev, dtype=out_dtype) if use_c else None
    a, b = maybe_strided(a), maybe_strided(b)
    out = maybe_strided(torch.full((m, n), float("nan"), device=dev, dtype=out_dtype))
    det = rng.random() < 0.2
    side = maybe_side_stream()
    note("gemm", f"{m}x{n}x{k} {dtype} kn={kn} out={out_dtype} c={use_c} det={det} side={side is not None} "
         f"lda={a.stride(0)} ldb={b.stride(0)} ldd={out.stride(0)}")
    ck.gemm(a, b, out=out, c=c, b_layout="kn" if kn else "nk", deterministic=det, stream=side)
    if side is not None:
        side.synchronize()
    ref = a.float() @ (b.float() if kn else b.float().t())
    if use_c:
        ref += c.float()
    e = rel(out, ref)
    tol = 2e-2 if out_dtype != torch.float32 else 1e-3
    record("gemm", f"{m}x{n}x{k} {dtype} kn={kn} out={out_dtype} c={use_c} det={det} lda={a.stride(0)} "
           f"ldb={b.stride(0)} ldd={out.stride(0)} side={side is not None}",
           only_view_written(out) and e < tol, f"rel {e:.2e}")


def case_gemm_acc():
    m, n, k = pick(1, 4096), pick(8, 8192, 8), pick(8, 16384, 8)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    d = torch.randn(m, n, device=dev)
    ref = d + a.float() @ b.float().t()
    ck.gemm(a, b, out=d, c=d)
    e = rel(d, ref)
    record("gemm_acc", f"{m}x{n}x{k}", e < 1e-3, f"rel {e:.2e}")


def case_fp8():
    m, n, k = pick(1, 8192), pick(8, 24576, 8), pick(16, 24576, 16)
    while m * n * k > 3e11:
        m = max(1, m // 2)
    qa, sa = fp8_operands(m, k)
    qb = (torch.randn(n, k, device=dev) * 2).to(E4)
    sb = torch.rand(-(-n // 128), -(-k // 128), device=dev) + 0.25
    mmajor = rng.random() < 0.5
    if mmajor:  # the quantizer's layout: M-major, ld a multiple of 4
        ld = -(-m // 4) * 4
        buf = torch.empty(sa.shape[1], ld, device=dev)
        buf[:, :m] = sa.t()
        sa_arg = buf.t()[:m]
    else:
        sa_arg = sa
    qa_arg = maybe_strided(qa)
    out = maybe_strided(torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16))
    side = maybe_side_stream()
    note("fp8", f"{m}x{n}x{k} mmajor={mmajor} lda={qa_arg.stride(0)} ldd={out.stride(0)} side={side is not None}")
    ck.gemm_fp8(qa_arg, sa_arg, qb, sb, out, stream=side)
    if side is not None:
        side.synchronize()
    ref = deq_rows(qa, sa) @ deq_blocks(qb, sb).t()
    e = rel(out, ref)
    record("gemm_fp8", f"{m}x{n}x{k} mmajor={mmajor} lda={qa_arg.stride(0)} ldd={out.stride(0)}",
           only_view_written(out) and e < 1e-2, f"rel {e:.2e}")


def case_contiguous():
    g = rng.choice([1, 2, 3, 4, 8, 16, 32])
    align = rng.choice([64, 128, 128, 256])
    n, k = pick(8, 8192, 8), pick(128, 8192, 16)
    counts = [rng.choice([0, rng.randint(1, 3000), rng.randint(1, 300)]) for _ in range(g)]
    segs = [-(-c // align) * align for c in counts]
    mtot = sum(segs)
    if mtot == 0:
        segs[0] = align
        counts[0] = rng.randint(1, align)
        mtot = align
    while mtot * n * k > 3e11:
        n = max(8, n // 2 // 8 * 8)
    ids = torch.full((mtot,), -1, dtype=torch.int32)
    r = 0
    for i, (c, s) in enumerate(zip(counts, segs)):
        ids[r:r + c] = i
        r += s
    ids = ids.to(dev)
    qa, sa = fp8_operands(mtot, k)
    qb = (torch.randn(g, n, k, device=dev) * 2).to(E4)
    sb = torch.rand(g, -(-n // 128), -(-k // 128), device=dev) + 0.25
    out = torch.full((mtot, n), float("nan"), device=dev, dtype=torch.bfloat16)
    note("contiguous", f"G{g} align{align} N{n} K{k} counts={counts}")
    ck.gemm_fp8_grouped_contiguous(qa, sa, qb, sb, ids, out, alignment=align)
    ok, worst = True, 0.0
    A = deq_rows(qa, sa)
    r = 0
    for i, (c, s) in enumerate(zip(counts, segs)):
        if c:
            ref = A[r:r + c] @ deq_blocks(qb[i], sb[i]).t()
            e = rel(out[r:r + c], ref)
            worst = max(worst, e)
            ok &= torch.isfinite(out[r:r + c]).all().item() and e < 1e-2
        ok &= torch.isnan(out[r + c:r + s].float()).all().item()  # padding rows untouched
        r += s
    record("contiguous", f"G{g} align{align} N{n} K{k} counts={counts}", ok, f"rel {worst:.2e}")


def case_masked():
    g = rng.choice([1, 2, 4, 8, 16, 32])
    m = pick(1, 2048)
    n, k = pick(8, 8192, 8), pick(16, 8192, 16)
    while g * m * n * k > 3e11:
        m = max(1, m // 2)
    mm = [rng.choice([0, m, rng.randint(0, m), m + 5]) for _ in range(g)]
    qa = (torch.randn(g, m, k, device=dev) * 2).to(E4)
    sa = torch.rand(g, m, -(-k // 128), device=dev) + 0.25
    qb = (torch.randn(g, n, k, device=dev) * 2).to(E4)
    sb = torch.rand(g, -(-n // 128), -(-k // 128), device=dev) + 0.25
    out = torch.full((g, m, n), float("nan"), device=dev, dtype=torch.bfloat16)
    note("masked", f"G{g} M{m} N{n} K{k} masked={mm}")
    ck.gemm_fp8_grouped_masked(qa, sa, qb, sb, torch.tensor(mm, dtype=torch.int32, device=dev), out)
    ok, worst = True, 0.0
    for i in range(g):
        r = min(mm[i], m)
        if r:
            ref = deq_rows(qa[i, :r], sa[i, :r]) @ deq_blocks(qb[i], sb[i]).t()
            e = rel(out[i, :r], ref)
            worst = max(worst, e)
            ok &= torch.isfinite(out[i, :r]).all().item() and e < 1e-2
        ok &= torch.isnan(out[i, r:].float()).all().item()
    record("masked", f"G{g} M{m} N{n} K{k} masked={mm}", ok, f"rel {worst:.2e}")


def case_wgrad():
    g = rng.choice([1, 2, 4, 8, 16])
    m, n = pick(8, 8192, 8), pick(8, 8192, 8)
    ks = [128 * rng.choice([0, rng.randint(1, 8), rng.randint(1, 48)]) for _ in range(g)]
    if sum(ks) == 0:
        ks[0] = 128
    while g * m * n > 1.5e8 or sum(ks) * m * n > 3e11:
        m = max(8, m // 2 // 8 * 8)
        n = max(8, n // 2 // 8 * 8)
    K = sum(ks)
    qa, sa = fp8_operands(m, K)
    qb, sb = fp8_operands(n, K)
    d = torch.randn(g, m, n, device=dev)
    d0 = d.clone()
    note("wgrad", f"G{g} M{m} N{n} ks={ks}")
    ck.gemm_fp8_wgrad(qa, sa, qb, sb, d, ks)
    A, Bm = deq_rows(qa, sa), deq_rows(qb, sb)
    ok, worst, c0 = True, 0.0, 0
    for i, kk in enumerate(ks):
        ref = d0[i] + A[:, c0:c0 + kk] @ Bm[:, c0:c0 + kk].t()
        e = rel(d[i], ref)
        worst = max(worst, e)
        ok &= e < 1e-3  # (FP8 tensor cores sum a k block in less than fp32: 1.2-1.5e-4 seen)
        c0 += kk
    record("wgrad", f"G{g} M{m} N{n} ks={ks}", ok, f"rel {worst:.2e}")


def case_quant():
    m, k = pick(1, 8192), pick(16, 16384, 16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * rng.choice([1e-3, 1, 100])
    q, s = ck.quantize_fp8_per_token(x)
    back = deq_rows(q, s)
    e = rel(back, x)
    record("quant_token", f"{m}x{k}", e < 6e-2, f"rel {e:.2e}")
    n = pick(1, 8192)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    qw, sw = ck.quantize_fp8_per_block(w)
    e = rel(deq_blocks(qw, sw), w)
    record("quant_block", f"{n}x{k}", e < 6e-2, f"rel {e:.2e}")


def sdpa_ref(q, k, v, causal, scale):  # [B, S, H, D] -> out [B, S, H, D] fp32, bottom-right causal
    hq, hk = q.shape[2], k.shape[2]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf = kf.repeat_interleave(hq // hk, 1)
    vf = vf.repeat_interleave(hq // hk, 1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        i = torch.arange(sq, device=dev)[:, None]
        j = torch.arange(sk, device=dev)[None]
        hidden = j > i + sk - sq
        p = torch.softmax(s.masked_fill(hidden, -1e30), -1) * ~hidden  # a query with no key: p = 0
    else:
        p = torch.softmax(s, -1)
    return (p @ vf).transpose(1, 2)


def attention_inputs(b, sq, sk, hq, hk, d, dtype, layout):
    """q [B, S_q, H_q, D], k, v [B, S_k, H_kv, D] in a layout: dense; slices of one fused QKV projection
    (S_q = S_k); torch's [B, H, S, D] seen through .transpose(1, 2)"""
    if layout == "fused":
        qkv = torch.randn(b, sq, hq + 2 * hk, d, device=dev, dtype=dtype)
        return qkv[:, :, :hq], qkv[:, :, hq:hq + hk], qkv[:, :, hq + hk:]
    if layout == "bhsd":
        return (torch.randn(b, h, s, d, device=dev, dtype=dtype).transpose(1, 2)
                for h, s in ((hq, sq), (hk, sk), (hk, sk)))
    return (torch.randn(b, s, h, d, device=dev, dtype=dtype) for h, s in ((hq, sq), (hk, sk), (hk, sk)))


def case_attention(backward):
    from cudart_kernels.ops import attention as fa, attention_bwd as fb
    d = rng.choice((fb if backward else fa).HEAD_DIMS)
    hk = rng.choice([1, 2, 4, 8])
    hq = hk * rng.choice([1, 1, 2, 4, 8])
    b = rng.choice([1, 1, 2, 3, 5])
    layout = rng.choice(["dense", "dense", "fused", "bhsd", "varlen", "varlen"])
    sq = pick(1, 4096)
    sk = sq if rng.random() < 0.6 or layout == "fused" else pick(1, 4096)
    while b * hq * sq * sk * d > 4e10:
        sq = max(1, sq // 2)
        sk = sq if layout == "fused" else max(1, sk // 2)
    causal = rng.random() < 0.5
    dtype = rng.choice([torch.bfloat16, torch.float16])
    scale = 1 / math.sqrt(d) if rng.random() < 0.7 else rng.uniform(0.02, 0.3)
    kw = dict(causal=causal, softmax_scale=scale)
    if layout == "varlen":  # B sequences of 0..S rows each, packed; per-sequence references
        lq = [rng.choice([0, sq, rng.randint(1, sq)]) for _ in range(b)]
        lk = lq if sk == sq and rng.random() < 0.5 else [rng.choice([0, sk, rng.randint(1, sk)]) for _ in range(b)]
        cu = [torch.tensor([0] + list(itertools.accumulate(x)), dtype=torch.int32, device=dev) for x in (lq, lk)]
        q = torch.randn(sum(lq), hq, d, device=dev, dtype=dtype)
        k, v = (torch.randn(sum(lk), hk, d, device=dev, dtype=dtype) for _ in range(2))
        kw.update(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=max(lq), max_seqlen_k=max(lk))
        spans = [(int(cu[0][i]), lq[i], int(cu[1][i]), lk[i]) for i in range(b)]
        lse = torch.full((hq, sum(lq)), float("nan"), device=dev)
        desc = f"varlen lq={lq} lk={lk}"
    else:
        q, k, v = attention_inputs(b, sq, sk, hq, hk, d, dtype, layout)
        lse = torch.full((b, hq, sq), float("nan"), device=dev)
        desc = f"{layout} B{b} Sq{sq} Sk{sk}"
    desc += f" Hq{hq} Hk{hk} D{d} causal={causal} scale={scale:.3g} {str(dtype)[6:]}"
    out = torch.full_like(q, float("nan"))
    side = maybe_side_stream()
    note("attention_bwd" if backward else "attention", desc)
    ck.attention(q, k, v, out=out, lse=lse, stream=side, **kw)

    def ref_of(q, k, v):  # fp32, per sequence for varlen
        if layout != "varlen":
            return sdpa_ref(q, k, v, causal, scale)
        parts = []
        for q0, nq, k0, nk in spans:
            if nq:
                qi, ki, vi = q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk]
                parts.append(sdpa_ref(qi, ki, vi, causal, scale)[0] if nk else
                             torch.zeros(nq, hq, d, device=dev))  # no keys: out = 0
        return torch.cat(parts) if parts else torch.zeros(0, hq, d, device=dev)

    if not backward:
        if side is not None:
            side.synchronize()
        ref = ref_of(q, k, v)
        e = rel(out, ref) if out.numel() else 0.0
        record("attention", desc, torch.isfinite(out).all().item() and e < 1e-2, f"rel {e:.2e}")
        return
    dout = torch.randn_like(q)
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    det = rng.random() < 0.3
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    ck.attention_backward(dout, q, k, v, out, lse, deterministic=det, dq=dq, dk=dk, dv=dv, stream=side, **kw)
    if side is not None:
        side.synchronize()
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = ref_of(qr, kr, vr)
    if ref.requires_grad:
        ref.backward(dout.float())
    grads = [torch.zeros_like(r) if r.grad is None else r.grad for r in (qr, kr, vr)]
    es = [rel(x, g, 1e-3) if x.numel() else 0.0 for x, g in zip((dq, dk, dv), grads)]
    fin = all(torch.isfinite(x).all().item() for x in (dq, dk, dv))
    record("attention_bwd", desc + f" det={det}", fin and max(es) < 2e-2, "rel " + " ".join(f"{e:.2e}" for e in es))


def case_attention_fwd():
    case_attention(False)


def case_attention_bwd():
    case_attention(True)


CASES = [case_gemm, case_gemm_acc, case_fp8, case_contiguous, case_masked, case_wgrad, case_quant, case_attention_fwd,
         case_attention_bwd]
deadline = time.time() + OPT.seconds
n = 0
while time.time() < deadline:
    fn = CASES[n % len(CASES)]
    n += 1
    try:
        fn()
    except Exception as ex:  # a raise on a valid shape is a failure too
        record(fn.__name__[5:], "exception", False, "".join(
            traceback.format_exception_only(type(ex), ex)).strip()[:300])
    torch.cuda.synchronize()
print("seed", OPT.seed, "cases", n)
for op, (tot, bad) in stats.items():
    print(f"{op:14s} {tot:4d} cases {bad:3d} failed")
sys.exit(1 if any(bad for _, bad in stats.values()) else 0)
