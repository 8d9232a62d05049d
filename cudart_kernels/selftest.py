"""`cudart-kernels selftest`: each op on fresh random data against the host reference, as a pass/fail table."""
from __future__ import annotations

import numpy as np

from .reference import quantize_per_block as ref_block
from .reference import quantize_per_token as ref_token
from .reference import random_activations
from .runtime.interop import DeviceArray


def _quant_case(fn, ref, m, k, dtype, rng, **kw):
    x = random_activations(rng, m, k, dtype)
    q, s = fn(DeviceArray.from_numpy(x), **kw)
    rq, rs = ref(x)
    q_ok = np.array_equal(q.numpy().view(np.uint8), rq.view(np.uint8))
    s_ok = np.array_equal(s.numpy(), rs)
    return q_ok and s_ok, f"q {'==' if q_ok else '!='} ref, scales {'==' if s_ok else '!='} ref"


def cases():
    from .ops.quantize import quantize_fp8_per_block, quantize_fp8_per_token

    out = []
    for dtype in ("bfloat16", "float16", "float32"):
        for m, k in ((1, 128), (77, 7168 + 8 * (dtype != "float32") + 4 * (dtype == "float32")), (4096, 1536)):
            out.append((f"quantize_fp8_per_token {dtype} {m}x{k}",
                        lambda rng, m=m, k=k, d=dtype: _quant_case(quantize_fp8_per_token, ref_token, m, k, d, rng)))
        for m, k in ((130, 264), (1024, 2048)):
            out.append((f"quantize_fp8_per_block {dtype} {m}x{k}",
                        lambda rng, m=m, k=k, d=dtype: _quant_case(quantize_fp8_per_block, ref_block, m, k, d, rng)))
    out.append(("quantize_fp8_per_token row-major scales 300x1000",
                lambda rng: _quant_case(quantize_fp8_per_token, ref_token, 300, 1000, "bfloat16", rng,
                                        scale_layout="rowmajor")))
    return out


def _gemm_case(m, n, k, dtype, out_dtype, rng, **kw):
    from .ops.gemm import gemm
    from .runtime.dtypes import as_dtype

    a = (rng.standard_normal((m, k)) * 0.5).astype(np.float32).astype(as_dtype(dtype).numpy)
    b = (rng.standard_normal((n, k)) * 0.5).astype(np.float32).astype(as_dtype(dtype).numpy)
    out = DeviceArray.empty((m, n), out_dtype).fill_bytes(0xFF)
    gemm(DeviceArray.from_numpy(a), DeviceArray.from_numpy(b), out=out, **kw)
    got = out.numpy().astype(np.float64)
    ref = a.astype(np.float64) @ b.astype(np.float64).T
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    tol = 1e-4 if out_dtype == "float32" else 1e-2
    return bool(np.isfinite(got).all() and err <= tol), f"rel. Frobenius error {err:.2e} (limit {tol:g})"


def gemm_cases():
    return [
        (f"gemm {d} -> {o} {m}x{n}x{k}{' ' + str(kw) if kw else ''}",
         lambda rng, m=m, n=n, k=k, d=d, o=o, kw=kw: _gemm_case(m, n, k, d, o, rng, **kw))
        for (m, n, k, d, o, kw) in [
            (777, 1000, 136, "bfloat16", "bfloat16", {}),
            (2048, 2048, 2048, "float16", "float32", {}),
            (17, 264, 4104, "bfloat16", "float32", {"split_k": 5}),
            (128, 128, 65536, "bfloat16", "bfloat16", {}),
            (128, 128, 8192, "bfloat16", "float32", {"split_k": 8, "deterministic": True}),
            (13, 1400, 4104, "float16", "float16", {}),  # the decode kernel (M <= 16), tails in M, N and K
        ]
    ]


def _gemm_fp8_case(m, n, k, rng, rowmajor_scales=False):
    from .ops.gemm_fp8 import gemm_fp8
    from .ops.quantize import quantize_fp8_per_block, quantize_fp8_per_token

    x = (rng.standard_normal((m, k)) * 2).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    qa, sa = quantize_fp8_per_token(DeviceArray.from_numpy(x), scale_layout="rowmajor" if rowmajor_scales else "mmajor")
    qb, sb = quantize_fp8_per_block(DeviceArray.from_numpy(w))
    out = DeviceArray.empty((m, n), "bfloat16").fill_bytes(0xFF)
    gemm_fp8(qa, sa, qb, sb, out)
    sa_h, sb_h = sa.numpy().astype(np.float64), sb.numpy().astype(np.float64)
    deq_a = qa.numpy().astype(np.float64) * np.repeat(sa_h, 128, axis=1)[:, :k]
    deq_b = qb.numpy().astype(np.float64) * np.repeat(np.repeat(sb_h, 128, axis=0), 128, axis=1)[:n, :k]
    ref = deq_a @ deq_b.T
    got = out.numpy().astype(np.float64)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    return bool(np.isfinite(got).all() and err <= 5e-3), f"rel. Frobenius error {err:.2e} (limit 5e-3)"


def gemm_fp8_cases():
    return [(f"gemm_fp8 {m}x{n}x{k}{' row-major scales' if rm else ''}",
             lambda rng, m=m, n=n, k=k, rm=rm: _gemm_fp8_case(m, n, k, rng, rm))
            for m, n, k, rm in [(1, 16, 16, False), (129, 2112, 1040, False), (300, 776, 4112, True)]]


def _grouped_fp8_case(kind, rng):
    """One small case of each grouped FP8 op against float64 on the dequantized inputs (random e4m3 values and
    scales), poisoned outputs: padding and masked rows must stay untouched, wgrad run twice into one D."""
    import ml_dtypes

    from .ops import gemm_fp8 as f

    def e4m3(shape):
        return np.clip(rng.standard_normal(shape) * 64, -448, 448).astype(ml_dtypes.float8_e4m3fn)

    def scales(shape):
        return (rng.uniform(0.5, 2.0, shape) / 448).astype(np.float32)

    def deq(x, s, block_rows):
        s = np.repeat(s.astype(np.float64), 128, axis=-1)[..., :x.shape[-1]]
        if block_rows:
            s = np.repeat(s, 128, axis=-2)[..., :x.shape[-2], :]
        return x.astype(np.float64) * s

    up = DeviceArray.from_numpy
    groups, n, k = 3, 264, 1040
    b, sb = e4m3((groups, n, k)), scales((groups, 3, 9))
    errs, untouched = [], True
    if kind == "contiguous":
        ids = np.array([0] * 100 + [-1] * 28 + [2] * 130 + [-1] * 126 + [-1] * 128, np.int32)
        a, sa = e4m3((len(ids), k)), scales((len(ids), 9))
        out = DeviceArray.empty((len(ids), n), "bfloat16").fill_bytes(0xFF)
        f.gemm_fp8_grouped_contiguous(up(a), up(sa), up(b), up(sb), up(ids), out)
        got = out.numpy().astype(np.float64)
        for e in (0, 2):
            r = ids == e
            ref = deq(a[r], sa[r], False) @ deq(b[e], sb[e], True).T
            errs.append(np.linalg.norm(got[r] - ref) / np.linalg.norm(ref))
        untouched = np.isnan(got[ids < 0]).all()
    elif kind == "masked":
        m = 200
        masked = np.array([0, 77, 200], np.int32)
        a, sa = e4m3((groups, m, k)), scales((groups, m, 9))
        out = DeviceArray.empty((groups, m, n), "bfloat16").fill_bytes(0xFF)
        f.gemm_fp8_grouped_masked(up(a), up(sa), up(b), up(sb), up(masked), out)
        got = out.numpy().astype(np.float64)
        for e in (1, 2):
            ref = deq(a[e, :masked[e]], sa[e, :masked[e]], False) @ deq(b[e], sb[e], True).T
            errs.append(np.linalg.norm(got[e, :masked[e]] - ref) / np.linalg.norm(ref))
        untouched = all(np.isnan(got[e, masked[e]:]).all() for e in range(groups))
    else:
        m, ks = 200, (256, 0, 384)
        kt = sum(ks)
        a, sa, bw, sbw = e4m3((m, kt)), scales((m, kt // 128)), e4m3((n, kt)), scales((n, kt // 128))
        d0 = rng.standard_normal((groups, m, n)).astype(np.float32)
        d = up(d0)
        for _ in range(2):
            f.gemm_fp8_wgrad(up(a), up(sa), up(bw), up(sbw), d, ks)
        got = (d.numpy().astype(np.float64) - d0) / 2
        da, db = deq(a, sa, False), deq(bw, sbw, False)
        for e, lo, hi in ((0, 0, 256), (2, 256, 640)):
            ref = da[:, lo:hi] @ db[:, lo:hi].T
            errs.append(np.linalg.norm(got[e] - ref) / np.linalg.norm(ref))
        untouched = (got[1] == 0).all()
    err = max(errs)
    ok = bool(err <= 5e-3 and untouched)
    return ok, f"rel. Frobenius error {err:.2e} (limit 5e-3); skipped rows untouched: {bool(untouched)}"


def grouped_fp8_cases():
    return [(f"gemm_fp8 {kind}", lambda rng, kind=kind: _grouped_fp8_case(kind, rng))
            for kind in ("contiguous", "masked", "wgrad")]


def _attention_inputs(rng, d, varlen):
    """Random bf16 q, k, v and dO (host arrays, GQA 8 / 2), the call's varlen keyword arguments and the host
    cu_seqlens (None, None when batched): 2 sequences of 257 queries and 1000 keys, or 4 packed sequences with an
    empty and a length-1 one."""
    import ml_dtypes

    def rand(shape):
        return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)

    if not varlen:
        return rand((2, 257, 8, d)), rand((2, 1000, 2, d)), rand((2, 1000, 2, d)), rand((2, 257, 8, d)), {}, \
            (None, None)
    lens_q, lens_k = [0, 1, 300, 129], [5, 1, 400, 129]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    kw = dict(cu_seqlens_q=DeviceArray.from_numpy(cq), cu_seqlens_k=DeviceArray.from_numpy(ck),
              max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    return rand((cq[-1], 8, d)), rand((ck[-1], 2, d)), rand((ck[-1], 2, d)), rand((cq[-1], 8, d)), kw, (cq, ck)


def _attention_case(rng, d, causal, varlen):
    from .ops.attention import attention
    from .reference import attention as ref_attention

    q, k, v, _, kw, cu = _attention_inputs(rng, d, varlen)
    ref_o, ref_lse = ref_attention(q, k, v, causal, None, *cu)
    out = DeviceArray.empty(q.shape, "bfloat16").fill_bytes(0xFF)
    _, lse = attention(DeviceArray.from_numpy(q), DeviceArray.from_numpy(k), DeviceArray.from_numpy(v),
                       causal=causal, out=out, return_lse=True, **kw)
    got, got_lse = out.numpy().astype(np.float64), lse.numpy()
    err = np.linalg.norm(got - ref_o) / np.linalg.norm(ref_o)
    fin = np.isfinite(ref_lse)
    lerr = float(np.abs(got_lse[fin] - ref_lse[fin]).max()) if fin.any() else 0.0
    ok = bool(np.isfinite(got).all() and err <= 1e-2 and lerr <= 1e-3
              and np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse)))
    return ok, f"rel. Frobenius error {err:.2e} (limit 1e-2), LSE max error {lerr:.1e} (limit 1e-3)"


def attention_cases():
    return [(f"attention D {d}{' causal' if c else ''}{' varlen' if vl else ' 257 x 1000 GQA 8/2'}",
             lambda rng, d=d, c=c, vl=vl: _attention_case(rng, d, c, vl))
            for d in (64, 128, 256) for c in (False, True) for vl in (False, True)]


def _attention_bwd_case(rng, d, causal, varlen, deterministic):
    from .ops.attention import attention
    from .ops.attention_bwd import attention_backward
    from .reference import attention_backward as ref_backward

    q, k, v, do, kw, cu = _attention_inputs(rng, d, varlen)
    want = ref_backward(do, q, k, v, causal, None, *cu)
    qd, kd, vd = (DeviceArray.from_numpy(x) for x in (q, k, v))
    out, lse = attention(qd, kd, vd, causal=causal, return_lse=True, **kw)
    grads = [DeviceArray.empty(x.shape, "bfloat16").fill_bytes(0xFF) for x in (q, k, v)]
    attention_backward(DeviceArray.from_numpy(do), qd, kd, vd, out, lse, causal=causal,
                       deterministic=deterministic, dq=grads[0], dk=grads[1], dv=grads[2], **kw)
    errs = []
    for g, w in zip(grads, want):
        got = g.numpy().astype(np.float64)
        errs.append(np.linalg.norm(got - w) / max(np.linalg.norm(w), 1e-3 * np.sqrt(w.size))
                    if np.isfinite(got).all() else np.inf)
    return max(errs) <= 2e-2, "rel. Frobenius errors dq / dk / dv " + " / ".join(f"{e:.2e}" for e in errs) + \
        " (limit 2e-2)"


def attention_bwd_cases():
    from .ops.attention_bwd import HEAD_DIMS

    return [(f"attention backward D {d}{' causal' if c else ''}{' varlen' if vl else ' 257 x 1000 GQA 8/2'}"
             f"{' deterministic' if det else ''}",
             lambda rng, d=d, c=c, vl=vl, det=det: _attention_bwd_case(rng, d, c, vl, det))
            for d in HEAD_DIMS for c in (False, True) for vl in (False, True) for det in (False, True)
            if not det or (c and vl)]


def run() -> bool:
    rng = np.random.default_rng()
    results = []
    all_cases = (cases() + gemm_cases() + gemm_fp8_cases() + grouped_fp8_cases() + attention_cases()
                 + attention_bwd_cases())
    for name, case in all_cases:
        try:
            ok, detail = case(rng)
        except Exception as e:  # report and keep going
            ok, detail = False, f"{type(e).__name__}: {e}"
        results.append((name, ok, detail))
    width = max(len(n) for n, _, _ in results)
    print(f"{'case'.ljust(width)}  result  detail")
    for name, ok, detail in results:
        print(f"{name.ljust(width)}  {'PASS' if ok else 'FAIL'}    {detail}")
    passed = sum(ok for _, ok, _ in results)
    print(f"\n{passed} passed, {len(results) - passed} failed")
    return passed == len(results)
