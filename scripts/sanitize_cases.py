"""One small, tail-heavy case per kernel, for compute-sanitizer (memcheck, racecheck, synccheck)."""
import numpy as np

import cudart_kernels as ck
from cudart_kernels import reference as ref
from cudart_kernels.runtime.interop import DeviceArray

rng = np.random.default_rng(1)
for dtype in (ck.bfloat16, ck.float32):
    x = ref.random_activations(rng, 67, 264 if dtype is ck.bfloat16 else 260, dtype.numpy)
    q, s = ck.quantize_fp8_per_token(DeviceArray.from_numpy(x))
    assert np.array_equal(s.numpy(), ref.quantize_per_token(x)[1])
    w = ref.random_activations(rng, 131, 264, dtype.numpy)
    qw, sw = ck.quantize_fp8_per_block(DeviceArray.from_numpy(w))
    assert np.array_equal(sw.numpy(), ref.quantize_per_block(w)[1])
print("sanitize cases ran")

# GEMM: one unsplit config with C, one split-K config in each mode, one accumulate-in-place (all with tails).
a = DeviceArray.from_numpy(rng.standard_normal((130, 520)).astype(ck.bfloat16.numpy))
b = DeviceArray.from_numpy(rng.standard_normal((136, 520)).astype(ck.bfloat16.numpy))
cmat = DeviceArray.from_numpy(rng.standard_normal((130, 136)).astype(np.float32))
ref = a.numpy().astype(np.float64) @ b.numpy().astype(np.float64).T
for kw in ({}, {"c": cmat}, {"split_k": 4}, {"split_k": 4, "deterministic": True}):
    d = ck.gemm(a, b, out_dtype="float32", **kw)  # 130 rows: 192-row tiles (three consumers)
    want = ref + (cmat.numpy() if "c" in kw else 0)
    assert np.abs(d.numpy() - want).max() < 1e-2 * np.abs(want).max(), kw
a_250 = DeviceArray.from_numpy(rng.standard_normal((250, 520)).astype(ck.bfloat16.numpy))
ref_250 = a_250.numpy().astype(np.float64) @ b.numpy().astype(np.float64).T
for kw in ({}, {"split_k": 4, "deterministic": True}):
    d = ck.gemm(a_250, b, out_dtype="float32", **kw)  # 128-row tiles
    assert np.abs(d.numpy() - ref_250).max() < 1e-2 * np.abs(ref_250).max(), kw
# M <= 64 split-K (one consumer warpgroup), with C, twice (the counters must come back to zero)
a_small, b_small = DeviceArray.from_numpy(a.numpy()[:13].copy()), DeviceArray.from_numpy(b.numpy()[:120].copy())
c_small = DeviceArray.from_numpy(cmat.numpy()[:13, :120].copy())
for _ in range(2):
    d = ck.gemm(a_small, b_small, c=c_small, out_dtype="bfloat16", split_k=5)
    want = ref[:13, :120] + c_small.numpy()
    assert np.abs(d.numpy().astype(np.float64) - want).max() < 2e-2 * np.abs(want).max()
acc = DeviceArray.from_numpy(np.zeros((130, 136), np.float32))
ck.gemm(a, b, out=acc, c=acc, split_k=3)
assert np.abs(acc.numpy() - ref).max() < 1e-2 * np.abs(ref).max()
# Decode kernel (M <= 16; forced on for this small N and K), with tails in M, N and K and with C.
from dataclasses import replace  # noqa: E402

from cudart_kernels.ops import gemm as g  # noqa: E402
from cudart_kernels.ops import gemm_fp8 as f  # noqa: E402
from cudart_kernels.ops import sm90  # noqa: E402
from cudart_kernels.runtime.driver import device_properties  # noqa: E402
from cudart_kernels.runtime.plans import PLANS  # noqa: E402


def plans_under(op, tuning):
    return [p for k, p in PLANS.items(op) if any(x is tuning for x in k)]


t = replace(g.TUNING, decode_min_k=1, decode_min_fill=0, decode_max_fill=float("inf"), decode_max_a_bytes=float("inf"))
for kw in ({}, {"c": c_small}):
    d = ck.gemm(a_small, b_small, out_dtype="float32", tuning=t, **kw)
    want = ref[:13, :120] + (c_small.numpy() if kw else 0)
    assert np.abs(d.numpy() - want).max() < 1e-2 * np.abs(want).max(), kw
assert any(isinstance(p, g._DecodePlan) for p in plans_under("gemm", t))
# B with the evict-first L2 policy (forced on for this short K), unsplit and split, 100 rows
t = replace(g.TUNING, stream_b_min_row_bytes=0)
a_100 = DeviceArray.from_numpy(a.numpy()[:100].copy())
for kw in ({}, {"split_k": 4}):
    d = ck.gemm(a_100, b, out_dtype="float32", tuning=t, **kw)
    assert np.abs(d.numpy() - ref[:100]).max() < 1e-2 * np.abs(ref[:100]).max(), kw
assert all(p.cfg.stream_b for p in plans_under("gemm", t))
# One wave of unsplit 64-row tiles above M = 128 (unsplit_wave), tails in M, N and K
a_w = DeviceArray.from_numpy(rng.standard_normal((290, 2056)).astype(ck.bfloat16.numpy))
b_w = DeviceArray.from_numpy(rng.standard_normal((2600, 2056)).astype(ck.bfloat16.numpy))
d = ck.gemm(a_w, b_w, out_dtype="float32")
ref_w = a_w.numpy().astype(np.float64) @ b_w.numpy().astype(np.float64).T
assert np.abs(d.numpy() - ref_w).max() < 1e-2 * np.abs(ref_w).max()
cfg_w = g.pick_config(290, 2600, 2056, 4, device_properties(0))
assert (cfg_w.bm, cfg_w.splits) == (64, 1), cfg_w
# Swapped operands (D^T = B A^T through the transposed epilogue): odd M on the tile's columns, tails in N and K;
# 128 x 152 in pairs with C added, 256-row tiles (four consumers) alone (three column tiles over M = 257) and in pairs
# sharing the weights (four column tiles over M = 288); split over K beyond one wave (144 units: the last split
# finishes) and in one wave, deterministic (the splits share the finish in K order); 128 x 96 in fours sharing the
# activations
b_s = DeviceArray.from_numpy(b_w.numpy()[:1000].copy())
for m_s, bm_s, bn_s, splits_s, mcast_s, with_c in (
        (301, 128, 152, 1, g.MCAST_SHARE_A, True), (257, 256, 88, 1, g.MCAST_NONE, False),
        (288, 256, 72, 1, g.MCAST_SHARE_A, False), (257, 128, 88, 6, g.MCAST_NONE, True),
        (144, 128, 72, 5, g.MCAST_SHARE_A, False), (257, 128, 96, 1, sm90.MCAST_SHARE_B4, False)):
    cfg_s = g.make_config(1000, m_s, 2056, 2, device_properties(0), bm_s, bn_s, splits_s, swap_ab=True,
                          mcast=mcast_s)
    a_s = DeviceArray.from_numpy(rng.standard_normal((m_s, 2056)).astype(ck.bfloat16.numpy))
    c_s = DeviceArray.from_numpy(rng.standard_normal((m_s, 1000)).astype(ck.bfloat16.numpy)) if with_c else None
    d = DeviceArray.empty((m_s, 1000), "bf16").fill_bytes(0xFF)  # NaN: every element must be written
    ck.gemm(a_s, b_s, out=d, c=c_s, tuning=g.GemmTuning(force_config=cfg_s), deterministic=splits_s == 5)
    ref_s = a_s.numpy().astype(np.float64) @ b_s.numpy().astype(np.float64).T
    if with_c:
        ref_s += c_s.numpy().astype(np.float64)
    assert np.abs(d.numpy().astype(np.float64) - ref_s).max() < 2e-2 * np.abs(ref_s).max(), m_s
print("gemm sanitize cases ran")

# 2-CTA clusters with multicast (forced on both sides; odd tile rows leave a spare tile), plain and split-K.

b2 = DeviceArray.from_numpy(rng.standard_normal((256, 520)).astype(ck.bfloat16.numpy))
ref2 = a.numpy().astype(np.float64) @ b2.numpy().astype(np.float64).T
for mode in (g.MCAST_SHARE_B, g.MCAST_SHARE_A):
    t = replace(g.TUNING, force_mcast=mode)
    for kw in ({}, {"split_k": 3, "deterministic": True}):
        d = ck.gemm(a, b2, out_dtype="float32", tuning=t, **kw)
        assert np.abs(d.numpy() - ref2).max() < 1e-2 * np.abs(ref2).max(), (mode, kw)
    assert {p.cfg.mcast for p in plans_under("gemm", t)} == {mode}
# B as [K, N] shared by a pair of 64-row tiles (every other 64-column panel each; three panels, N past the last)
b_kn = DeviceArray.from_numpy(np.ascontiguousarray(rng.standard_normal((520, 1000)).astype(ck.bfloat16.numpy)))
a_kn = DeviceArray.from_numpy(rng.standard_normal((100, 520)).astype(ck.bfloat16.numpy))
cfg_kn = g.make_config(100, 1000, 520, 4, device_properties(0), 64, 192, 2, b_kn=True, mcast=g.MCAST_SHARE_B)
d = DeviceArray.empty((100, 1000), "fp32").fill_bytes(0xFF)
ck.gemm(a_kn, b_kn, out=d, b_layout="kn", deterministic=True, tuning=g.GemmTuning(force_config=cfg_kn))
ref_kn = a_kn.numpy().astype(np.float64) @ b_kn.numpy().astype(np.float64)
assert np.abs(d.numpy() - ref_kn).max() < 1e-2 * np.abs(ref_kn).max()
# ... and with swapped operands, its [K, N] memory the kernel's MN-major A (A_MN): pairs sharing it, and split
a_kn = DeviceArray.from_numpy(rng.standard_normal((300, 520)).astype(ck.bfloat16.numpy))
ref_kn = a_kn.numpy().astype(np.float64) @ b_kn.numpy().astype(np.float64)
for bm_s, bn_s, splits_s, mcast_s in ((128, 152, 1, g.MCAST_SHARE_A), (128, 104, 3, g.MCAST_NONE)):
    cfg_kn = g.make_config(1000, 300, 520, 2, device_properties(0), bm_s, bn_s, splits_s, swap_ab=True, mcast=mcast_s)
    d = DeviceArray.empty((300, 1000), "bf16").fill_bytes(0xFF)
    ck.gemm(a_kn, b_kn, out=d, b_layout="kn", deterministic=True, tuning=g.GemmTuning(force_config=cfg_kn))
    assert np.abs(d.numpy().astype(np.float64) - ref_kn).max() < 2e-2 * np.abs(ref_kn).max(), (bm_s, bn_s)
print("gemm cluster sanitize cases ran")

# FP8 block-scaled GEMM: tails on M, N and K; zero-copy M-major scales from the quantize op and row-major scales
# (converted); then 2-CTA pairs on both sides.
x8 = DeviceArray.from_numpy((rng.standard_normal((130, 528)) * 2).astype(np.float32))
w8 = DeviceArray.from_numpy((rng.standard_normal((136, 528)) * 0.1).astype(np.float32))
qa, sa = ck.quantize_fp8_per_token(x8)
qb, sb = ck.quantize_fp8_per_block(w8)
deq_a = qa.numpy().astype(np.float64) * np.repeat(sa.numpy().astype(np.float64), 128, axis=1)[:, :528]
deq_b = qb.numpy().astype(np.float64) * np.repeat(np.repeat(sb.numpy().astype(np.float64), 128, 0), 128, 1)[:136, :528]
ref8 = deq_a @ deq_b.T
sa_rowmajor = DeviceArray.from_numpy(np.ascontiguousarray(sa.numpy()))


def check8(tuning, what):
    d = ck.gemm_fp8(qa, sa, qb, sb, tuning=tuning)
    assert np.abs(d.numpy().astype(np.float64) - ref8).max() < 2e-2 * np.abs(ref8).max(), what


for mode in (g.MCAST_SHARE_B, g.MCAST_SHARE_A):
    t = replace(f.TUNING, force_mcast=mode)
    for scales in (sa, sa_rowmajor):
        d = ck.gemm_fp8(qa, scales, qb, sb, tuning=t)
        assert np.abs(d.numpy().astype(np.float64) - ref8).max() < 2e-2 * np.abs(ref8).max(), mode
    assert {p.cfg.mcast for p in plans_under("gemm_fp8", t)} == {mode}
# Two rows of 64-row tiles in a pair sharing B, the second row partial (72 rows: the narrow pairs of _small_m).
qa72, sa72 = ck.quantize_fp8_per_token(DeviceArray.from_numpy(x8.numpy()[:72]))
t = replace(f.TUNING, force_tile=(64, 64), force_mcast=g.MCAST_SHARE_B)
d = ck.gemm_fp8(qa72, sa72, qb, sb, tuning=t)
assert np.abs(d.numpy().astype(np.float64) - ref8[:72]).max() < 2e-2 * np.abs(ref8).max(), "narrow pairs"
assert {(p.cfg.bm, p.cfg.mcast) for p in plans_under("gemm_fp8", t)} == {(64, g.MCAST_SHARE_B)}
# Scales loaded at the wgmma issue (SCALES_AT_ISSUE; K here is under its usual minimum): 128-row tiles and one row
# of 64-row tiles.
qa40, sa40 = ck.quantize_fp8_per_token(DeviceArray.from_numpy(x8.numpy()[:40]))
for tile, qx, sx, rows in (((128, 64), qa, sa, 130), ((64, 64), qa40, sa40, 40)):
    t = replace(f.TUNING, force_tile=tile, force_mcast=g.MCAST_NONE, scales_at_issue_min_k=0)
    d = ck.gemm_fp8(qx, sx, qb, sb, tuning=t)
    assert np.abs(d.numpy().astype(np.float64) - ref8[:rows]).max() < 2e-2 * np.abs(ref8).max(), tile
    assert {p.cfg.scales_at_issue for p in plans_under("gemm_fp8", t)} == {True}, tile
# Tiles of more than 192 columns (two column halves, A from registers), 128 and 64 rows.
for bm in (128, 64):
    check8(replace(f.TUNING, force_tile=(bm, 256), force_mcast=g.MCAST_NONE), bm)
# Tiles of 144..192 columns (a k block's two column halves in flight): 128 rows paired along M, 64 rows alone.
for bm, bn, mode in ((128, 192, g.MCAST_SHARE_B), (64, 176, g.MCAST_NONE)):
    check8(replace(f.TUNING, force_tile=(bm, bn), force_mcast=mode), (bm, bn))
# 256-row tiles (two row blocks per consumer), alone and in pairs sharing A.
for mode in (g.MCAST_NONE, g.MCAST_SHARE_A):
    t = replace(f.TUNING, force_tile=(256, 128), force_mcast=mode)
    check8(t, mode)
    assert {(p.cfg.bm, p.cfg.mcast) for p in plans_under("gemm_fp8", t)} == {(256, mode)}
# 192-row tiles (three consumers), alone and in pairs sharing B or A (96-row halves).
for mode in (g.MCAST_NONE, g.MCAST_SHARE_B, g.MCAST_SHARE_A):
    t = replace(f.TUNING, force_tile=(192, 128), force_mcast=mode)
    check8(t, (192, mode))
    assert {(p.cfg.bm, p.cfg.mcast) for p in plans_under("gemm_fp8", t)} == {(192, mode)}
# Split-K through the cluster's shared memory (2 and 3 K slices; 5 k blocks do not divide by either), B loaded
# with the evict-first L2 policy.
for bm, bn, splits in ((64, 32, 2), (128, 64, 3)):
    t = replace(f.TUNING, force_tile=(bm, bn), force_splits=splits, stream_b_min_row_bytes=0, stream_b_max_m=1 << 30)
    check8(t, (bm, bn, splits))
    assert {(p.cfg.splits, p.cfg.stream_b) for p in plans_under("gemm_fp8", t)} == {(splits, True)}
print("gemm_fp8 sanitize cases ran")

# The grouped layouts and the weight gradient, one small case each (tails, padding rows, masked rows, an empty
# K group, direct-store slices), also under 2-CTA pairs.
for mode in (g.MCAST_NONE, g.MCAST_SHARE_A):
    t = replace(f.TUNING, force_mcast=mode)
    ids = DeviceArray.from_numpy(np.array([0] * 100 + [-1] * 28 + [1] * 128 + [-1] * 128, np.int32))
    qa3, sa3 = ck.quantize_fp8_per_token(DeviceArray.from_numpy(rng.standard_normal((384, 528)).astype(np.float32)))
    qw3, sw3 = ck.quantize_fp8_per_block(DeviceArray.from_numpy(rng.standard_normal((2 * 256, 528)).astype(np.float32)))
    qw3 = DeviceArray(qw3.ptr, (2, 256, 528), qw3.dtype, None, qw3.device, owner=qw3)
    sw3 = DeviceArray(sw3.ptr, (2, 2, 5), sw3.dtype, None, sw3.device, owner=sw3)
    d = ck.gemm_fp8_grouped_contiguous(qa3, sa3, qw3, sw3, ids, tuning=t)
    assert np.isfinite(d.numpy()[:100].astype(np.float32)).all()
    # 256- and 192-row tiles over both experts' segments (aligned to 128): from the tile list, one entry per expert
    # in a tile row (192 rows: a segment starts at row 128 of the first, the padding at row 64 of the second)
    for bm in (256, 192):
        d2 = ck.gemm_fp8_grouped_contiguous(qa3, sa3, qw3, sw3, ids, tuning=replace(t, force_tile=(bm, 128)))
        for rows in (slice(0, 100), slice(128, 256)):
            got, want = d2.numpy()[rows].astype(np.float32), d.numpy()[rows].astype(np.float32)
            assert np.allclose(got, want, rtol=2e-2, atol=1e-2)
    qm = DeviceArray(qa3.ptr, (2, 192, 528), qa3.dtype, None, qa3.device, owner=qa3)
    sm = DeviceArray(sa3.ptr, (2, 192, 5), sa3.dtype, (1 * 192, 1, sa3.strides[1]), sa3.device, owner=sa3)
    d = ck.gemm_fp8_grouped_masked(qm, sm, qw3, sw3, DeviceArray.from_numpy(np.array([70, 192], np.int32)), tuning=t)
    # groups of fewer rows than half a tile (boxes that stop at their own group's last row), and of a row count
    # not a multiple of 4 (scales copied, each group's padded to 16 bytes)
    q4 = DeviceArray(qa3.ptr, (4, 5, 528), qa3.dtype, None, qa3.device, owner=qa3)
    s4 = DeviceArray(sa3.ptr, (4, 5, 5), sa3.dtype, (5, 1, sa3.strides[1]), sa3.device, owner=sa3)
    w4 = DeviceArray(qw3.ptr, (4, 128, 528), qw3.dtype, None, qw3.device, owner=qw3)
    sw4 = DeviceArray.from_numpy(np.ones((4, 1, 5), np.float32))
    d4 = ck.gemm_fp8_grouped_masked(q4, s4, w4, sw4, DeviceArray.from_numpy(np.array([5, 3, 0, 5], np.int32)),
                                    tuning=t)
    assert np.isfinite(d4.numpy()[0].astype(np.float32)).all()
    dw = DeviceArray.from_numpy(np.zeros((2, 136, 132), np.float32))
    qa_t, sa_t = ck.quantize_fp8_per_token(DeviceArray.from_numpy(rng.standard_normal((136, 384)).astype(np.float32)))
    qb_t, sb_t = ck.quantize_fp8_per_token(DeviceArray.from_numpy(rng.standard_normal((132, 384)).astype(np.float32)))
    ck.gemm_fp8_wgrad(qa_t, sa_t, qb_t, sb_t, dw, [256, 128], tuning=t)
    assert np.isfinite(dw.numpy()).all()
    # the weight gradient on 192-row tiles (three consumers): one partial tile row, its last slice written directly
    w192 = replace(t, force_tile=(192, 128))
    dw2 = DeviceArray.from_numpy(np.zeros((2, 136, 132), np.float32))
    ck.gemm_fp8_wgrad(qa_t, sa_t, qb_t, sb_t, dw2, [256, 128], tuning=w192)
    assert np.allclose(dw2.numpy(), dw.numpy(), rtol=1e-5, atol=1e-4)
print("gemm_fp8 grouped sanitize cases ran")

# Attention: a causal varlen case per head dim (empty and length-1 sequences, tails, GQA, S_q != S_k), forward and
# (head dims 64 and 128) backward, checked against the float64 reference, plus one batched non-causal case.
from cudart_kernels import reference as attn_ref  # noqa: E402  (`ref` above is a GEMM result)
from cudart_kernels.ops import attention as at  # noqa: E402
from cudart_kernels.ops import attention_bwd as bwd  # noqa: E402

lens_q, lens_k = [0, 1, 70, 130], [3, 1, 90, 129]
cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
ckv = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
for d in at.HEAD_DIMS:
    xq = rng.standard_normal((cq[-1], 4, d)).astype(ck.bfloat16.numpy)
    xk = rng.standard_normal((ckv[-1], 2, d)).astype(ck.bfloat16.numpy)
    xv = rng.standard_normal((ckv[-1], 2, d)).astype(ck.bfloat16.numpy)
    o, lse = ck.attention(DeviceArray.from_numpy(xq), DeviceArray.from_numpy(xk), DeviceArray.from_numpy(xv),
                          causal=True, cu_seqlens_q=DeviceArray.from_numpy(cq),
                          cu_seqlens_k=DeviceArray.from_numpy(ckv), max_seqlen_q=max(lens_q),
                          max_seqlen_k=max(lens_k), return_lse=True)
    want, _ = attn_ref.attention(xq, xk, xv, True, None, cq, ckv)
    got = o.numpy().astype(np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2, d
    if d in bwd.HEAD_DIMS:  # the backward of the same case, in both modes
        xdo = rng.standard_normal(xq.shape).astype(ck.bfloat16.numpy)
        wants = attn_ref.attention_backward(xdo, xq, xk, xv, True, None, cq, ckv)
        for det in (False, True):
            grads = ck.attention_backward(
                DeviceArray.from_numpy(xdo), DeviceArray.from_numpy(xq), DeviceArray.from_numpy(xk),
                DeviceArray.from_numpy(xv), o, lse, causal=True, cu_seqlens_q=DeviceArray.from_numpy(cq),
                cu_seqlens_k=DeviceArray.from_numpy(ckv), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                deterministic=det)
            for g, w in zip(grads, wants):
                assert np.linalg.norm(g.numpy().astype(np.float64) - w) / np.linalg.norm(w) < 2e-2, (d, det)
xb = rng.standard_normal((2, 77, 2, 128)).astype(ck.bfloat16.numpy)
o = ck.attention(DeviceArray.from_numpy(xb), DeviceArray.from_numpy(xb), DeviceArray.from_numpy(xb))
want, _ = attn_ref.attention(xb, xb, xb)
assert np.linalg.norm(o.numpy().astype(np.float64) - want) / np.linalg.norm(want) < 1e-2
# The backward of a batched non-causal case whose few units are split over their query tiles (the split dK / dV
# sums and their conversion), with and without GQA.
for hkv in (2, 1):
    xq = rng.standard_normal((1, 300, 2, 128)).astype(ck.bfloat16.numpy)
    xk, xv, xdo = (rng.standard_normal(shape).astype(ck.bfloat16.numpy)
                   for shape in ((1, 333, hkv, 128), (1, 333, hkv, 128), xq.shape))
    o, lse = ck.attention(*(DeviceArray.from_numpy(x) for x in (xq, xk, xv)), return_lse=True)
    grads = ck.attention_backward(*(DeviceArray.from_numpy(x) for x in (xdo, xq, xk, xv)), o, lse)
    for g, w in zip(grads, attn_ref.attention_backward(xdo, xq, xk, xv, False)):
        assert np.linalg.norm(g.numpy().astype(np.float64) - w) / np.linalg.norm(w) < 2e-2, hkv
print("attention sanitize cases ran")
