"""Attention on the CPU: the reference the kernel is checked against, the input rules, the tile budgets."""
import numpy as np
import pytest

from cudart_kernels import reference as ref
from cudart_kernels.ops import attention as attn
from cudart_kernels.runtime.interop import as_array


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


# ---- input rules (device arrays described by pointer tuples) ----


def _arr(shape, dtype="bfloat16", strides=None, ptr=1 << 20):
    return as_array((ptr, shape, strides, dtype))


def test_batched_and_packed_dims():
    q, k = _arr((2, 100, 8, 128)), _arr((2, 300, 2, 128))
    assert attn.check_inputs(q, k, k) == attn.Dims(2, 8, 2, 128, 100, 300, False)
    # torch's [B, H, S, D] seen through a transpose: strides of [B, S, H, D] that are not row-major
    qt = _arr((2, 100, 8, 64), strides=(8 * 100 * 64, 64, 100 * 64, 1))
    assert attn.check_inputs(qt, qt, qt).head_dim == 64
    cu = _arr((4,), "int32")
    dims = attn.check_inputs(_arr((500, 8, 64)), _arr((700, 8, 64)), _arr((700, 8, 64)), cu, cu, 300, 400)
    assert dims == attn.Dims(3, 8, 8, 64, 300, 400, True)


@pytest.mark.parametrize("case,err,match", [
    (lambda: attn.check_inputs(_arr((1, 8, 4, 80)), _arr((1, 8, 4, 80)), _arr((1, 8, 4, 80))), ValueError,
     "head dim 80"),
    (lambda: attn.check_inputs(_arr((1, 8, 6, 64)), _arr((1, 8, 4, 64)), _arr((1, 8, 4, 64))), ValueError,
     "multiple of kv heads"),
    (lambda: attn.check_inputs(_arr((1, 8, 4, 64)), _arr((1, 8, 4, 64), "float16"), _arr((1, 8, 4, 64))),
     TypeError, "share a dtype"),
    (lambda: attn.check_inputs(_arr((1, 8, 4, 64), "float32"), _arr((1, 8, 4, 64)), _arr((1, 8, 4, 64))),
     TypeError, "not supported"),
    (lambda: attn.check_inputs(_arr((1, 8, 4, 64)), _arr((1, 8, 4, 64)), _arr((1, 9, 4, 64))), ValueError,
     "one shape"),
    (lambda: attn.check_inputs(_arr((2, 8, 4, 64)), _arr((1, 8, 4, 64)), _arr((1, 8, 4, 64))), ValueError,
     "batch"),
    (lambda: attn.check_inputs(_arr((1, 8, 4, 64), strides=(8 * 4 * 68, 4 * 68, 68, 1)),
                               _arr((1, 8, 4, 64)), _arr((1, 8, 4, 64))), ValueError, "multiple of 16 bytes"),
    (lambda: attn.check_inputs(_arr((1, 8, 4, 64), ptr=(1 << 20) + 8), _arr((1, 8, 4, 64)), _arr((1, 8, 4, 64))),
     ValueError, "aligned"),
    (lambda: attn.check_inputs(_arr((10, 4, 64)), _arr((10, 4, 64)), _arr((10, 4, 64))), ValueError,
     "cu_seqlens_q is required"),
    (lambda: attn.check_inputs(_arr((10, 4, 64)), _arr((10, 4, 64)), _arr((10, 4, 64)), _arr((3,), "int32"),
                               _arr((4,), "int32"), 5, 5), ValueError, "sequences"),
    (lambda: attn.check_inputs(_arr((10, 4, 64)), _arr((10, 4, 64)), _arr((10, 4, 64)), _arr((3,), "int64"),
                               _arr((3,), "int32"), 5, 5), TypeError, "cu_seqlens_q"),
    (lambda: attn.check_inputs(_arr((10, 4, 64)), _arr((10, 4, 64)), _arr((10, 4, 64)), _arr((3,), "int32"),
                               _arr((3,), "int32"), None, 5), ValueError, "max_seqlen_q"),
    (lambda: attn.check_inputs(_arr((1, 8, 4, 64)), _arr((1, 8, 4, 64)), _arr((1, 8, 4, 64)),
                               _arr((2,), "int32")), ValueError, "packed"),
])
def test_bad_input_raises_before_any_launch(case, err, match):
    with pytest.raises(err, match=match):
        case()


def test_outputs_are_checked():
    q = _arr((2, 100, 8, 64))
    dims = attn.check_inputs(q, q, q)
    attn.check_outputs(_arr((2, 100, 8, 64)), _arr((2, 8, 100), "float32"), q, dims)
    with pytest.raises(ValueError, match="lse"):
        attn.check_outputs(None, _arr((2, 100, 8), "float32"), q, dims)
    with pytest.raises(TypeError, match="out"):
        attn.check_outputs(_arr((2, 100, 8, 64), "float16"), None, q, dims)


@pytest.mark.parametrize("d", attn.HEAD_DIMS)
def test_default_tiles_fit_shared_memory_and_registers(d):
    cfg = attn.pick_config(d)
    assert cfg.smem <= attn.SMEM_BUDGET and cfg.bm % 64 == 0 and cfg.bn % 16 == 0
    assert attn.consumer_registers(cfg.bn, d) <= 200  # of 240 a consumer thread, with room for addresses
