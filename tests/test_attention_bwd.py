"""Attention backward on the CPU: the float64 reference gradients against finite differences, the input rules, the
tile budgets."""
import numpy as np
import pytest

from cudart_kernels import reference as ref
from cudart_kernels.ops import attention_bwd as bwd
from cudart_kernels.runtime.interop import as_array


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(5, 7), (7, 5), (6, 6)])
def test_reference_gradients_match_finite_differences(causal, sq, sk):
    rng = np.random.default_rng(sq * 10 + sk)
    q, do = rng.standard_normal((2, sq, 4, 8)), rng.standard_normal((2, sq, 4, 8))
    k, v = rng.standard_normal((2, sk, 2, 8)), rng.standard_normal((2, sk, 2, 8))
    grads = ref.attention_backward(do, q, k, v, causal, 0.4)

    def loss(**x):
        args = dict(q=q, k=k, v=v)
        args.update(x)
        return (ref.attention(args["q"], args["k"], args["v"], causal, 0.4)[0] * do).sum()

    eps = 1e-6
    for name, x, g in zip("qkv", (q, k, v), grads):
        for idx in [(0, 0, 0, 0), (1, x.shape[1] - 1, x.shape[2] - 1, 7), (1, x.shape[1] // 2, 1, 3)]:
            hi, lo = x.copy(), x.copy()
            hi[idx] += eps
            lo[idx] -= eps
            fd = (loss(**{name: hi}) - loss(**{name: lo})) / (2 * eps)
            assert abs(fd - g[idx]) < 1e-6 * max(1.0, abs(fd)), (name, idx, fd, g[idx])


def test_reference_varlen_is_the_batched_reference_per_sequence():
    rng = np.random.default_rng(3)
    lens_q, lens_k = [3, 0, 1, 5], [4, 2, 1, 5]
    cq, ck = np.concatenate([[0], np.cumsum(lens_q)]), np.concatenate([[0], np.cumsum(lens_k)])
    q, do = rng.standard_normal((cq[-1], 4, 8)), rng.standard_normal((cq[-1], 4, 8))
    k, v = rng.standard_normal((ck[-1], 2, 8)), rng.standard_normal((ck[-1], 2, 8))
    dq, dk, dv = ref.attention_backward(do, q, k, v, True, None, cq, ck)
    for b in range(4):
        sl_q, sl_k = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        g = ref.attention_backward(do[None, sl_q], q[None, sl_q], k[None, sl_k], v[None, sl_k], True)
        for got, want in zip((dq[sl_q], dk[sl_k], dv[sl_k]), g):
            np.testing.assert_allclose(got, want[0], atol=1e-12)


def _arr(shape, dtype="bfloat16", strides=None, ptr=1 << 20):
    return as_array((ptr, shape, strides, dtype))


def _call(**over):
    a = dict(dov=_arr((1, 8, 4, 64)), qv=_arr((1, 8, 4, 64)), kv=_arr((1, 9, 2, 64)), vv=_arr((1, 9, 2, 64)),
             ov=_arr((1, 8, 4, 64)), lv=_arr((1, 4, 8), "float32"), cq=None, ck=None, max_q=None, max_k=None,
             dqv=None, dkv=None, dvv=None)
    a.update(over)
    return bwd.check_backward(a["dov"], a["qv"], a["kv"], a["vv"], a["ov"], a["lv"], a["cq"], a["ck"], a["max_q"],
                              a["max_k"], a["dqv"], a["dkv"], a["dvv"])


def test_a_valid_call_passes():
    assert _call().heads_kv == 2
    assert _call(dqv=_arr((1, 8, 4, 64)), dkv=_arr((1, 9, 2, 64)), dvv=_arr((1, 9, 2, 64))).seqlen_k == 9


@pytest.mark.parametrize("over,err,match", [
    (dict(lv=None), ValueError, "needs lse"),
    (dict(ov=None), ValueError, "needs out"),
    (dict(dov=None), ValueError, "needs dout"),
    (dict(dov=_arr((1, 8, 4, 64), "float16")), TypeError, "dout"),
    (dict(dov=_arr((1, 7, 4, 64))), ValueError, "dout"),
    (dict(lv=_arr((1, 4, 7), "float32")), ValueError, "lse"),
    (dict(lv=_arr((1, 4, 8))), TypeError, "lse"),
    (dict(dqv=_arr((1, 8, 4, 64), "float16")), TypeError, "dq"),
    (dict(dkv=_arr((1, 9, 4, 64))), ValueError, "dk"),
    (dict(dvv=_arr((1, 8, 2, 64))), ValueError, "dv"),
    (dict(dov=_arr((1, 8, 4, 192)), qv=_arr((1, 8, 4, 192)), kv=_arr((1, 9, 2, 192)), vv=_arr((1, 9, 2, 192)),
          ov=_arr((1, 8, 4, 192))), ValueError, "head dim 192 not supported"),
])
def test_bad_input_raises_before_any_launch(over, err, match):
    with pytest.raises(err, match=match):
        _call(**over)


@pytest.mark.parametrize("d", bwd.HEAD_DIMS)
def test_default_tiles_fit_shared_memory(d):
    for det in (False, True):
        cfg = bwd.pick_config(d, deterministic=det)
        assert cfg.smem <= bwd.SMEM_BUDGET and cfg.bm in (64, 128) and cfg.bn == (64 if d == 256 else 128)


@pytest.mark.parametrize("d,tile", [(64, (64, 128, 2)), (128, (128, 128, 2)), (256, (64, 128, 2))])
def test_tiles_the_kernel_does_not_take_raise(d, tile):
    with pytest.raises(ValueError, match="not one the kernel takes"):
        bwd.pick_config(d, bwd.AttnBwdTuning(tiles=((d, tile),)))


def test_causal_head_group_fits_l2_budget():
    from cudart_kernels.ops.attention import Dims

    def group(b, h, s, d):
        return bwd.causal_head_group(Dims(b, h, h, d, s, s, False))
    assert group(4, 16, 4096, 128) == 8  # 4 MiB of Q, dO and dQ sums a head in 32 MiB
    assert group(1, 16, 16384, 128) == 2
    assert group(1, 8, 65536, 256) == 1  # never below one head
    assert group(1, 2, 128, 64) == 2     # never more than the heads there are
    assert bwd.causal_head_group(Dims(1, 4, 4, 128, 4096, 4096, False), bwd.AttnBwdTuning(causal_l2_bytes=0)) == 1


def test_tail_split_evens_out_the_last_wave():
    whole = lambda tiles: tiles + bwd.TUNING.unit_overhead_tiles  # noqa: E731
    # 2048 units of 64 tiles on 132 CTAs: 15.5 rounds, the last half-full; splitting the last units ends sooner
    split, parts = bwd.tail_split(2048, 132, 64)
    assert split > 0 and parts > 1
    costs = [(p + 1) * 64 // parts - p * 64 // parts + 2 for p in range(parts)]
    assert bwd._tail_end(2048 - split, costs * split, 132, whole(64)) < 0.99 * 16 * whole(64)
    # a single small wave: parts spread it over more CTAs
    split, parts = bwd.tail_split(32, 132, 16)
    assert (split, parts) != (0, 1)
    # full rounds, or one-tile units: nothing to gain
    assert bwd.tail_split(264, 132, 64) == (0, 1)
    assert bwd.tail_split(100, 132, 1) == (0, 1)
    assert bwd.tail_split(0, 132, 8) == (0, 1)


def test_tail_end_models_rounds_then_greedy():
    assert bwd._tail_end(4, [], 2, 10.0) == 20.0
    assert bwd._tail_end(3, [], 2, 10.0) == 20.0
    assert bwd._tail_end(3, [4.0, 4.0], 2, 10.0) == 20.0  # the CTA with one unit takes both parts
    assert bwd._tail_end(2, [6.0, 6.0, 6.0], 2, 10.0) == 22.0
