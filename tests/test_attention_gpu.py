"""Attention forward on the GPU against the float64 reference, on fresh random data with poisoned outputs: every
sequence tail, causal with S_q != S_k, GQA / MQA, varlen with empty and length-1 sequences, strided and
transposed inputs, fp16, the LSE, and run-to-run identical results."""
import ml_dtypes
import numpy as np
import pytest

import cudart_kernels as ck
from cudart_kernels import reference as ref
from cudart_kernels.ops import attention as attn
from cudart_kernels.runtime.interop import DeviceArray

pytestmark = pytest.mark.gpu

_NP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _rand(rng, shape, dtype="bfloat16"):
    """Random normal data rounded to the input dtype: (host float64 copy, device array)."""
    x = rng.standard_normal(shape).astype(_NP[dtype])
    return x.astype(np.float64), DeviceArray.from_numpy(x)


def _poisoned(shape, dtype):
    return DeviceArray.empty(shape, dtype).fill_bytes(0xFF)  # NaN in every float format: unwritten shows


def _check(o_dev, lse_dev, o_ref, lse_ref):
    o = o_dev.numpy().astype(np.float64)
    assert np.isfinite(o).all(), "output elements left unwritten (NaN poison) or non-finite"
    scale = max(np.linalg.norm(o_ref), 1e-6)
    err = np.linalg.norm(o - o_ref) / scale
    assert err <= 1e-2, f"relative Frobenius error of O {err:.2e}"
    if lse_dev is not None:
        lse = lse_dev.numpy().astype(np.float64)
        assert not np.isnan(lse).any(), "LSE elements left unwritten"
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
        fin = np.isfinite(lse_ref)
        if fin.any():
            lerr = np.abs(lse[fin] - lse_ref[fin]).max()
            assert lerr <= 1e-3, f"LSE max abs error {lerr:.2e}"
    return err


def _batched(rng, b, sq, sk, hq, hkv, d, causal, dtype="bfloat16", scale=None):
    q, dq = _rand(rng, (b, sq, hq, d), dtype)
    k, dk = _rand(rng, (b, sk, hkv, d), dtype)
    v, dv = _rand(rng, (b, sk, hkv, d), dtype)
    out, lse = _poisoned((b, sq, hq, d), dtype), _poisoned((b, hq, sq), "float32")
    res = attn.attention(dq, dk, dv, causal=causal, softmax_scale=scale, out=out, lse=lse)
    assert res[0] is out and res[1] is lse
    o_ref, lse_ref = ref.attention(q, k, v, causal, scale)
    return _check(out, lse, o_ref, lse_ref)


@pytest.mark.parametrize("d", attn.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1, 17, 129, 1000])
def test_batched_tails(rng, d, causal, s):
    _batched(rng, 2, s, s, 2, 2, d, causal)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq,sk", [(17, 300), (300, 17), (129, 1000), (1000, 129), (5, 0)])
def test_causal_with_different_lengths(rng, d, sq, sk):
    _batched(rng, 1, sq, sk, 2, 1, d, True)  # rows with no key: O = 0, LSE = -inf


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_mqa(rng, hq, hkv, causal):
    _batched(rng, 2, 300, 333, hq, hkv, 128, causal)


def test_fp16_and_scale(rng):
    _batched(rng, 1, 257, 190, 4, 2, 128, True, "float16", scale=0.2)
    _batched(rng, 1, 100, 70, 2, 2, 64, False, "float16")


@pytest.mark.parametrize("d", attn.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_empty_and_single_token_sequences(rng, d, causal):
    lens_q = [0, 1, 17, 300, 129, 1, 0, 650]
    lens_k = [5, 1, 40, 300, 0, 1, 0, 700]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ckk = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    hq, hkv = 4, 2
    q, dq = _rand(rng, (cq[-1], hq, d))
    k, dk = _rand(rng, (ckk[-1], hkv, d))
    v, dv = _rand(rng, (ckk[-1], hkv, d))
    out, lse = _poisoned(q.shape, "bfloat16"), _poisoned((hq, cq[-1]), "float32")
    attn.attention(dq, dk, dv, causal=causal, cu_seqlens_q=DeviceArray.from_numpy(cq),
                   cu_seqlens_k=DeviceArray.from_numpy(ckk), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                   out=out, lse=lse)
    o_ref, lse_ref = ref.attention(q, k, v, causal, None, cq, ckk)
    _check(out, lse, o_ref, lse_ref)


def _view(base: DeviceArray, offset_elems: int, shape, strides):
    return DeviceArray.from_pointer(base.ptr + offset_elems * base.dtype.itemsize, shape, base.dtype, strides,
                                    base.device, owner=base)


@pytest.mark.parametrize("causal", [False, True])
def test_fused_qkv_slices_and_transposed_layouts(rng, causal):
    b, s, h, d = 2, 200, 4, 128
    qkv, dqkv = _rand(rng, (b, s, 3, h, d))  # one fused projection: q, k, v are strided slices of it
    st = (s * 3 * h * d, 3 * h * d, d, 1)
    dq, dk, dv = (_view(dqkv, i * h * d, (b, s, h, d), st) for i in range(3))
    out = _poisoned((b, s, h, d), "bfloat16")
    attn.attention(dq, dk, dv, causal=causal, out=out)
    o_ref, _ = ref.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal)
    _check(out, None, o_ref, None)
    # torch's [B, H, S, D] seen as [B, S, H, D] through a transpose, for the inputs and the output
    x, dx = _rand(rng, (b, h, s, d))
    tst = (h * s * d, d, s * d, 1)
    dt_ = _view(dx, 0, (b, s, h, d), tst)
    obuf = _poisoned((b, h, s, d), "bfloat16")
    out_t = _view(obuf, 0, (b, s, h, d), tst)
    o, lse = attn.attention(dt_, dt_, dt_, causal=causal, out=out_t, return_lse=True)
    xs = x.transpose(0, 2, 1, 3)
    o_ref, lse_ref = ref.attention(xs, xs, xs, causal)
    _check(obuf, lse, o_ref.transpose(0, 2, 1, 3), lse_ref)


def test_allocated_outputs_and_repeatability(rng):
    """Outputs allocated by the op; two runs give bitwise-identical results (a moving result would be a race)."""
    q, dq = _rand(rng, (1, 1000, 4, 64))
    k, dk = _rand(rng, (1, 1000, 2, 64))
    v, dv = _rand(rng, (1, 1000, 2, 64))
    o1, l1 = attn.attention(dq, dk, dv, causal=True, return_lse=True)
    o2 = attn.attention(dq, dk, dv, causal=True)
    assert o1.shape == (1, 1000, 4, 64) and l1.shape == (1, 4, 1000)
    np.testing.assert_array_equal(o1.numpy(), o2.numpy())
    o_ref, lse_ref = ref.attention(q, k, v, True)
    _check(o1, l1, o_ref, lse_ref)
    assert ck.attention is attn.attention


def test_bad_inputs_raise_before_launch(rng):
    _, dq = _rand(rng, (1, 8, 2, 64))
    with pytest.raises(ValueError, match="softmax_scale"):
        attn.attention(dq, dq, dq, softmax_scale=-1.0)
    with pytest.raises(TypeError, match="out"):
        attn.attention(dq, dq, dq, out=DeviceArray.empty((1, 8, 2, 64), "float16"))
    with pytest.raises(TypeError, match="host|numpy|device"):
        attn.attention(np.zeros((1, 8, 2, 64), np.float32), dq, dq)


@pytest.mark.parametrize("causal", [False, True])
def test_long_keys_take_the_wide_tiles(rng, causal):
    """Non-causal attention over many keys runs wider key tiles (AttnTuning.noncausal_tiles): keys that are no
    multiple of them, batched and varlen."""
    sk = attn.TUNING.wide_min_seqlen_k + 37
    assert causal or attn.pick_config(128, False, sk) != attn.pick_config(128, False, 1000)
    _batched(rng, 1, 200, sk, 4, 2, 128, causal)
    lens_q, lens_k = [3, 150], [sk, 4000]
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ckk = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q, dq = _rand(rng, (cq[-1], 2, 128))
    k, dk = _rand(rng, (ckk[-1], 2, 128))
    v, dv = _rand(rng, (ckk[-1], 2, 128))
    out = _poisoned(q.shape, "bfloat16")
    _, lse = attn.attention(dq, dk, dv, causal=causal, cu_seqlens_q=DeviceArray.from_numpy(cq),
                            cu_seqlens_k=DeviceArray.from_numpy(ckk), max_seqlen_q=max(lens_q),
                            max_seqlen_k=max(lens_k), out=out, return_lse=True)
    _check(out, lse, *ref.attention(q, k, v, causal, None, cq, ckk))
