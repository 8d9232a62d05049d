"""Host (numpy / ml_dtypes) references for the ops, used by the tests and `cudart-kernels selftest`.

The quantization references follow the kernels' fp32 arithmetic step by step, so results match bit for bit.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_MAX = np.float32(448.0)
_FLOOR = np.float32(1e-4)


def _quantize_tiles(x32: np.ndarray, rows: int, cols: int):
    """Quantize x32 [M, K] with one scale per rows x cols tile; returns (q e4m3 [M, K], scales [ceil, ceil])."""
    m, k = x32.shape
    gm, gk = -(-m // rows), -(-k // cols)
    padded = np.zeros((gm * rows, gk * cols), np.float32)
    padded[:m, :k] = x32
    tiles = padded.reshape(gm, rows, gk, cols)
    amax = np.maximum(np.abs(tiles).max(axis=(1, 3)), _FLOOR).astype(np.float32)
    inv = (_MAX / amax).astype(np.float32)
    q = (tiles * inv[:, None, :, None]).astype(np.float32).reshape(gm * rows, gk * cols)[:m, :k]
    return q.astype(E4M3), (amax / _MAX).astype(np.float32)


def quantize_per_token(x) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] (any float dtype) -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)])."""
    return _quantize_tiles(np.asarray(x).astype(np.float32), 1, 128)


def quantize_per_block(w) -> tuple[np.ndarray, np.ndarray]:
    """w [N, K] -> (e4m3 [N, K], fp32 scales [ceil(N/128), ceil(K/128)])."""
    return _quantize_tiles(np.asarray(w).astype(np.float32), 128, 128)


def random_activations(rng: np.random.Generator, m: int, k: int, dtype) -> np.ndarray:
    """Random rows with magnitudes spread over several decades, one all-zero group and tiny values included."""
    x = rng.standard_normal((m, k)).astype(np.float32)
    x *= np.exp2(rng.integers(-12, 8, size=(m, 1))).astype(np.float32)
    if m > 1 and k >= 128:
        x[m // 2, :128] = 0.0  # exercises the all-zero guard
    if m > 2:
        x[1] *= np.float32(1e-6)  # fp8 subnormals after scaling
    return x.astype(np.dtype(dtype))


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None, cu_seqlens_q=None,
              cu_seqlens_k=None) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention in float64: (O [..., S_q, H_q, D] as float64, LSE [B, H_q, S_q] or [H_q, total_q]).

    q [B, S_q, H_q, D], k and v [B, S_k, H_kv, D] (H_q a multiple of H_kv: query head h reads kv head
    h // (H_q / H_kv)); or packed [total, H, D] with cu_seqlens_q / cu_seqlens_k ([B + 1] offsets). Causal masks
    aligned bottom-right: query i of a sequence sees keys j <= i + S_k - S_q. A query that sees no key (causal with
    S_q > S_k, or S_k = 0) gets O = 0 and LSE = -inf. LSE is the natural log of each row's sum of exp(scale * s)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if cu_seqlens_q is None:
        seqs = [(q[b], k[b], v[b]) for b in range(q.shape[0])]
    else:
        cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
        seqs = [(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]) for b in range(len(cq) - 1)]
    outs, lses = [], []
    for qs, ks, vs in seqs:
        sq, hq = qs.shape[0], qs.shape[1]
        sk, hkv = ks.shape[0], ks.shape[1]
        rep = hq // hkv
        kh = np.repeat(ks, rep, axis=1)  # [S_k, H_q, D]
        vh = np.repeat(vs, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", qs, kh) * scale  # [H_q, S_q, S_k]
        if causal:
            allowed = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
            s = np.where(allowed[None], s, -np.inf)
        m = s.max(axis=-1, keepdims=True) if sk else np.full((hq, sq, 1), -np.inf)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m_safe)
        l = p.sum(axis=-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            o = np.einsum("hqk,khd->qhd", np.where(l > 0, p / np.where(l > 0, l, 1), 0.0), vh)
            lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1)) + m_safe[..., 0], -np.inf)
        outs.append(o)
        lses.append(lse)  # [H_q, S_q]
    if cu_seqlens_q is None:
        return np.stack(outs), np.stack(lses)
    return np.concatenate(outs, axis=0), np.concatenate(lses, axis=1)


def attention_backward(dout, q, k, v, causal: bool = False, softmax_scale: float | None = None, cu_seqlens_q=None,
                       cu_seqlens_k=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients (dQ, dK, dV) in float64 of `attention`'s O with respect to q, k, v, given dO (same layouts as
    `attention`; GQA: a kv head's dK and dV sum over the query heads that read it)."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    d = q.shape[-1]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if cu_seqlens_q is None:
        spans = [((b, slice(None)), (b, slice(None))) for b in range(q.shape[0])]
    else:
        cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
        spans = [((slice(cq[b], cq[b + 1]),), (slice(ck[b], ck[b + 1]),)) for b in range(len(cq) - 1)]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for sq_idx, sk_idx in spans:
        qs, ks, vs, dos = q[sq_idx], k[sk_idx], v[sk_idx], dout[sq_idx]
        sq, hq = qs.shape[0], qs.shape[1]
        sk, hkv = ks.shape[0], ks.shape[1]
        rep = hq // hkv
        kh, vh = np.repeat(ks, rep, axis=1), np.repeat(vs, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", qs, kh) * scale
        if causal:
            allowed = np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)
            s = np.where(allowed[None], s, -np.inf)
        m = s.max(axis=-1, keepdims=True) if sk else np.full((hq, sq, 1), -np.inf)
        p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
        l = p.sum(axis=-1, keepdims=True)
        p = np.where(l > 0, p / np.where(l > 0, l, 1), 0.0)  # [H_q, S_q, S_k]
        o = np.einsum("hqk,khd->qhd", p, vh)
        dp = np.einsum("qhd,khd->hqk", dos, vh)
        ds = p * (dp - np.einsum("qhd,qhd->hq", dos, o)[..., None])
        dq[sq_idx] = np.einsum("hqk,khd->qhd", ds, kh) * scale
        dkh = np.einsum("hqk,qhd->khd", ds, qs) * scale
        dvh = np.einsum("hqk,qhd->khd", p, dos)
        dk[sk_idx] = dkh.reshape(sk, hkv, rep, d).sum(axis=2)
        dv[sk_idx] = dvh.reshape(sk, hkv, rep, d).sum(axis=2)
    return dq, dk, dv
