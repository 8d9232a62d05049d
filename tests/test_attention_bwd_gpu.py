"""Attention backward on the GPU against the float64 reference gradients, on fresh random data with poisoned
outputs: sequence tails, causal with S_q != S_k, GQA / MQA, varlen with empty and length-1 sequences, strided
inputs, fp16 and a custom scale, and deterministic mode's bitwise-identical results."""
import ml_dtypes
import numpy as np
import pytest

import cudart_kernels as ck
from cudart_kernels import reference as ref
from cudart_kernels.ops import attention_bwd as bwd
from cudart_kernels.runtime.interop import DeviceArray

pytestmark = pytest.mark.gpu

_NP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
TOL = 2e-2


def _rand(rng, shape, dtype="bfloat16"):
    x = rng.standard_normal(shape).astype(_NP[dtype])
    return x.astype(np.float64), DeviceArray.from_numpy(x)


def _poisoned(shape, dtype):
    return DeviceArray.empty(shape, dtype).fill_bytes(0xFF)  # NaN in every float format: unwritten shows


def _rel(got, want):
    """Relative Frobenius error, against at least 1e-3 an element: a gradient that is zero in exact arithmetic
    (one key: dS = P (dP - dO . O) = 0) comes out at the rounding level of O."""
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-3 * np.sqrt(want.size), 1e-30)


class Case:
    """Fresh random q, k, v, dO (host float64 copies and device arrays), the forward's out and lse."""

    def __init__(self, rng, q_shape, k_shape, causal, dtype="bfloat16", scale=None, cu_q=None, cu_k=None):
        self.q, self.dq_in = _rand(rng, q_shape, dtype)
        self.k, self.dk_in = _rand(rng, k_shape, dtype)
        self.v, self.dv_in = _rand(rng, k_shape, dtype)
        self.do, self.ddo = _rand(rng, q_shape, dtype)
        self.shapes, self.dtype, self.causal, self.scale, self.cu_q, self.cu_k = (q_shape, k_shape), dtype, causal, \
            scale, cu_q, cu_k
        self.kw = {}
        if cu_q is not None:
            self.kw = dict(cu_seqlens_q=DeviceArray.from_numpy(np.asarray(cu_q, np.int32)),
                           cu_seqlens_k=DeviceArray.from_numpy(np.asarray(cu_k, np.int32)),
                           max_seqlen_q=int(np.diff(cu_q).max()), max_seqlen_k=int(np.diff(cu_k).max()))
        self.out, self.lse = ck.attention(self.dq_in, self.dk_in, self.dv_in, causal=causal, softmax_scale=scale,
                                          return_lse=True, **self.kw)

    def backward(self, deterministic=False, tuning=None):
        """The device gradients, into NaN-poisoned outputs, as numpy arrays."""
        q_shape, k_shape = self.shapes
        grads = (_poisoned(q_shape, self.dtype), _poisoned(k_shape, self.dtype), _poisoned(k_shape, self.dtype))
        res = ck.attention_backward(self.ddo, self.dq_in, self.dk_in, self.dv_in, self.out, self.lse,
                                    causal=self.causal, softmax_scale=self.scale, deterministic=deterministic,
                                    dq=grads[0], dk=grads[1], dv=grads[2], tuning=tuning, **self.kw)
        assert all(r is g for r, g in zip(res, grads))
        return [g.numpy() for g in grads]

    def check(self, grads):
        want = ref.attention_backward(self.do, self.q, self.k, self.v, self.causal, self.scale, self.cu_q, self.cu_k)
        errs = []
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            got = g.astype(np.float64)
            assert np.isfinite(got).all(), f"{name}: elements left unwritten (NaN poison) or non-finite"
            errs.append(_rel(got, w))
        assert max(errs) <= TOL, f"relative Frobenius errors dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}"
        return errs


def _run(rng, q_shape, k_shape, causal, dtype="bfloat16", scale=None, cu_q=None, cu_k=None, deterministic=False):
    case = Case(rng, q_shape, k_shape, causal, dtype, scale, cu_q, cu_k)
    return case.check(case.backward(deterministic))


@pytest.mark.parametrize("d", bwd.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1, 17, 129, 1000])
def test_batched_tails(rng, d, causal, s):
    _run(rng, (2, s, 2, d), (2, s, 2, d), causal)


@pytest.mark.parametrize("d", bwd.HEAD_DIMS)
@pytest.mark.parametrize("sq,sk", [(17, 300), (300, 17), (129, 1000), (1000, 129), (5, 0), (0, 7)])
def test_causal_with_different_lengths(rng, d, sq, sk):
    _run(rng, (1, sq, 2, d), (1, sk, 1, d), True)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_mqa(rng, hq, hkv, causal):
    _run(rng, (2, 300, hq, 128), (2, 333, hkv, 128), causal)


def test_fp16_and_scale(rng):
    _run(rng, (1, 257, 4, 128), (1, 190, 2, 128), True, "float16", scale=0.2)
    _run(rng, (1, 100, 2, 64), (1, 70, 2, 64), False, "float16")


@pytest.mark.parametrize("d", bwd.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(rng, d, causal):
    lens_q = [0, 1, 300, 64, 129, 0, 500]
    lens_k = [5, 1, 250, 64, 300, 0, 500]
    cu_q, cu_k = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    _run(rng, (cu_q[-1], 4, d), (cu_k[-1], 2, d), causal, cu_q=cu_q, cu_k=cu_k)


@pytest.mark.parametrize("varlen", [False, True])
def test_deterministic_is_bitwise_repeatable(rng, varlen):
    if varlen:
        cu = np.concatenate([[0], np.cumsum([700, 1, 1200, 333])])
        case = Case(rng, (cu[-1], 8, 128), (cu[-1], 2, 128), True, cu_q=cu, cu_k=cu)
    else:
        case = Case(rng, (1, 1500, 8, 128), (1, 1500, 2, 128), True)
    first = case.backward(deterministic=True)
    case.check(first)
    for _ in range(4):
        for a, b in zip(first, case.backward(deterministic=True)):
            np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("d", bwd.HEAD_DIMS)
@pytest.mark.parametrize("hkv", [4, 1])
def test_split_units(rng, d, hkv):
    """Units of the grid's last wave split over their query tiles (this shape's few units spread over more CTAs):
    the parts' dK and dV sums, through the conversion kernel or the GQA sums, against the reference; twice (the split
    sums are left zero for the next call)."""
    from cudart_kernels.runtime.driver import device_properties

    cfg = bwd.pick_config(d)
    s = 1000
    assert bwd.tail_split(-(-s // cfg.bn) * 4, device_properties(0).sm_count, -(-s // cfg.bm))[0] > 0
    case = Case(rng, (1, s, 4, d), (1, s, hkv, d), False)
    for _ in range(2):
        case.check(case.backward())


@pytest.mark.parametrize("causal", [False, True])
def test_repeated_calls(rng, causal):
    """Three calls in a row on fresh data (the plan, its scratch and the dQ accumulator reused: prep clears it each
    call), GQA with a sequence tail."""
    for _ in range(3):
        case = Case(rng, (2, 700, 4, 128), (2, 700, 2, 128), causal)
        case.check(case.backward())
