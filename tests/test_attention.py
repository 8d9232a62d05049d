"""The attention reference (CPU): the rules the kernel is checked against."""
import numpy as np

from cudart_kernels import reference as ref


def _naive(q, k, v, causal, scale):
    """One query at a time, straight from the definition (batched layout)."""
    b_, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    o = np.zeros((b_, sq, hq, d))
    lse = np.full((b_, hq, sq), -np.inf)
    for b in range(b_):
        for h in range(hq):
            g = h // (hq // hkv)
            for i in range(sq):
                keys = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not keys:
                    continue
                s = np.array([q[b, i, h] @ k[b, j, g] * scale for j in keys])
                w = np.exp(s - s.max())
                o[b, i, h] = (w[:, None] * np.array([v[b, j, g] for j in keys])).sum(0) / w.sum()
                lse[b, h, i] = np.log(w.sum()) + s.max()
    return o, lse


def test_reference_matches_the_definition_with_gqa_and_bottom_right_causal():
    rng = np.random.default_rng(0)
    for sq, sk, causal in ((5, 7, True), (7, 5, True), (6, 6, False), (3, 0, False)):
        q = rng.standard_normal((2, sq, 4, 8))
        k = rng.standard_normal((2, sk, 2, 8))
        v = rng.standard_normal((2, sk, 2, 8))
        o, lse = ref.attention(q, k, v, causal, 0.3)
        o2, lse2 = _naive(q, k, v, causal, 0.3)
        np.testing.assert_allclose(o, o2, atol=1e-12)
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse2))
        np.testing.assert_allclose(lse[np.isfinite(lse)], lse2[np.isfinite(lse2)], atol=1e-12)


def test_reference_varlen_is_the_batched_reference_per_sequence():
    rng = np.random.default_rng(1)
    lens_q, lens_k = [3, 0, 1, 5], [4, 2, 1, 5]
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    q = rng.standard_normal((cq[-1], 4, 8))
    k = rng.standard_normal((ck[-1], 1, 8))
    v = rng.standard_normal((ck[-1], 1, 8))
    o, lse = ref.attention(q, k, v, True, None, cq, ck)
    assert o.shape == q.shape and lse.shape == (4, cq[-1])
    for b in range(4):
        ob, lb = ref.attention(q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b + 1]], v[None, ck[b]:ck[b + 1]], True)
        np.testing.assert_allclose(o[cq[b]:cq[b + 1]], ob[0], atol=1e-12)
        np.testing.assert_array_equal(lse[:, cq[b]:cq[b + 1]], lb[0])
