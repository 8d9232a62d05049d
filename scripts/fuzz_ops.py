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
    out = torch.full((m, n), float("nan"), device=dev, dtype=out_dtype)
    det = rng.random() < 0.2
    note("gemm", f"{m}x{n}x{k} {dtype} kn={kn} out={out_dtype} c={use_c} det={det}")
    ck.gemm(a, b, out=out, c=c, b_layout="kn" if kn else "nk", deterministic=det)
    ref = a.float() @ (b.float() if kn else b.float().t())
    if use_c:
        ref += c.float()
    e = rel(out, ref)
    tol = 2e-2 if out_dtype != torch.float32 else 1e-3
    record("gemm", f"{m}x{n}x{k} {dtype} kn={kn} out={out_dtype} c={use_c} det={det}",
           torch.isfinite(out).all().item() and e < tol, f"rel {e:.2e}")


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
    out = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
    note("fp8", f"{m}x{n}x{k} mmajor={mmajor}")
    ck.gemm_fp8(qa, sa_arg, qb, sb, out)
    ref = deq_rows(qa, sa) @ deq_blocks(qb, sb).t()
    e = rel(out, ref)
    record("gemm_fp8", f"{m}x{n}x{k} mmajor={mmajor}", torch.isfinite(out).all().item() and e < 1e-2, f"rel {e:.2e}")


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


def case_attention(backward):
    from cudart_kernels.ops import attention as fa, attention_bwd as fb
    d = rng.choice((fb if backward else fa).HEAD_DIMS)
    hk = rng.choice([1, 2, 4, 8])
    hq = hk * rng.choice([1, 1, 2, 4, 8])
    b = rng.choice([1, 1, 2, 3])
    sq = pick(1, 4096)
    sk = sq if rng.random() < 0.6 else pick(1, 4096)
    while b * hq * sq * sk * d > 4e10:
        sq = max(1, sq // 2)
        sk = max(1, sk // 2)
    causal = rng.random() < 0.5
    dtype = rng.choice([torch.bfloat16, torch.float16])
    q = torch.randn(b, sq, hq, d, device=dev, dtype=dtype)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
    v = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
    scale = 1 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq, sq), float("nan"), device=dev)
    note("attention", f"B{b} Sq{sq} Sk{sk} Hq{hq} Hk{hk} D{d} causal={causal} {dtype} bwd={backward}")
    ck.attention(q, k, v, causal=causal, out=out, lse=lse)
    desc = f"B{b} Sq{sq} Sk{sk} Hq{hq} Hk{hk} D{d} causal={causal} {dtype}"
    if not backward:
        ref = sdpa_ref(q, k, v, causal, scale)
        e = rel(out, ref)
        record("attention", desc, torch.isfinite(out).all().item() and e < 1e-2, f"rel {e:.2e}")
        return
    dout = torch.randn_like(q)
    dq, dk, dv = (torch.full_like(x, float("nan")) for x in (q, k, v))
    det = rng.random() < 0.3
    ck.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, dq=dq, dk=dk, dv=dv)
    qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = sdpa_ref(qr, kr, vr, causal, scale)
    ref.backward(dout.float())
    es = [rel(x, r.grad, 1e-3) for x, r in ((dq, qr), (dk, kr), (dv, vr))]
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
