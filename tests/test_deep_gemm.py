"""cudart_kernels.deep_gemm without a GPU: DeepGEMM's call signatures, the clear errors for what is not supported
(raised before any array is touched), how each call maps onto our ops (recorded by stand-ins), and the scale
layout helpers on numpy (and torch CPU tensors where torch is installed)."""
import ast
import glob
import inspect
import os
import subprocess
import sys
import zipfile

import ml_dtypes
import numpy as np
import pytest

import cudart_kernels as ck
import cudart_kernels.deep_gemm as dg

E4M3 = ml_dtypes.float8_e4m3fn
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_GEMM = "a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims='', disable_ue8m0_cast=False"
_CONTIG = ("a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None, compiled_dims='nk', "
           "disable_ue8m0_cast=False, use_psum_layout=False, ensure_zero_padding=True")
_KGROUPED = "a, b, d, ks, grouped_layout, c=None, recipe=(1, 1, 128), compiled_dims='mn', use_psum_layout=False"
# DeepGEMM's Python signatures, as sgl-deep-gemm 0.1.5.post1 defines them
SIGNATURES = {
    **dict.fromkeys(("fp8_gemm_nt", "fp8_gemm_nn", "fp8_gemm_tn", "fp8_gemm_tt"), _GEMM),
    "m_grouped_fp8_gemm_nt_contiguous": _CONTIG + ", expected_m_for_psum_layout=None",
    "m_grouped_fp8_gemm_nn_contiguous": _CONTIG,
    "m_grouped_fp8_gemm_nt_masked": ("a, b, d, masked_m, expected_m, recipe=None, recipe_a=None, recipe_b=None, "
                                     "compiled_dims='nk', disable_ue8m0_cast=False"),
    "k_grouped_fp8_gemm_nt_contiguous": _KGROUPED,
    "k_grouped_fp8_gemm_tn_contiguous": _KGROUPED,
    **dict.fromkeys(("bf16_gemm_nt", "bf16_gemm_nn", "bf16_gemm_tn", "bf16_gemm_tt"),
                    "a, b, d, c=None, compiled_dims=''"),
    "transform_sf_into_required_layout": ("sf, mn, k, recipe, num_groups=None, is_sfa=None, "
                                          "disable_ue8m0_cast=False"),
    "get_tma_aligned_size": "mn, element_size",
    "get_mn_major_tma_aligned_tensor": "sf",
    "get_mk_alignment_for_contiguous_layout": "",
    "set_mk_alignment_for_contiguous_layout": "new_value",
    "get_theoretical_mk_alignment_for_contiguous_layout": "expected_m=None",
    "per_token_cast_to_fp8": "x, use_ue8m0, gran_k=128, use_packed_ue8m0=False",
    "per_block_cast_to_fp8": "x, use_ue8m0, gran_k=128",
    "per_channel_cast_to_fp8": "x, use_ue8m0, gran_k=128",
    "ceil_div": "x, y",
    "align": "x, y",
}
ALIASES = {"fp8_fp4_gemm_nt": "fp8_gemm_nt", "m_grouped_fp8_fp4_gemm_nt_contiguous": "m_grouped_fp8_gemm_nt_contiguous",
           "m_grouped_fp8_fp4_gemm_nt_masked": "m_grouped_fp8_gemm_nt_masked",
           "fp8_m_grouped_gemm_nt_masked": "m_grouped_fp8_gemm_nt_masked",
           "get_m_alignment_for_contiguous_layout": "get_mk_alignment_for_contiguous_layout",
           "get_col_major_tma_aligned_tensor": "get_mn_major_tma_aligned_tensor"}


def _params(fn) -> str:
    """Names and defaults, annotations left out."""
    return ", ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}"
                     for p in inspect.signature(fn).parameters.values())


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_are_deepgemms(name):
    assert _params(getattr(dg, name)) == SIGNATURES[name]


def test_aliases():
    for alias, name in ALIASES.items():
        assert getattr(dg, alias) is getattr(dg, name), alias


def _wheel_functions():
    """name -> 'a, b=1' for every function the downloaded DeepGEMM wheel defines in Python (None: no wheel here)."""
    wheels = glob.glob(os.path.join(ROOT, ".dg", "sgl_deep_gemm-*.whl"))
    if not wheels:
        return None
    out = {}
    with zipfile.ZipFile(wheels[0]) as z:
        for path in ("deep_gemm/__init__.py", "deep_gemm/utils/layout.py", "deep_gemm/utils/math.py"):
            for node in ast.walk(ast.parse(z.read(path))):
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                    args = node.args.args
                    defaults = [None] * (len(args) - len(node.args.defaults)) + node.args.defaults
                    out[node.name] = ", ".join(a.arg if d is None else f"{a.arg}={ast.unparse(d)}"
                                               for a, d in zip(args, defaults))
    return out


def test_signatures_match_the_downloaded_wheel():
    """Where the wheel was downloaded into .dg/ (scripts/deepgemm_compat.py says how), every function both define
    has the same parameters and defaults."""
    theirs = _wheel_functions()
    if theirs is None:
        pytest.skip("no DeepGEMM wheel in .dg/")
    common = [n for n in theirs if callable(getattr(dg, n, None)) and not n.startswith("get_symm")]
    assert len(common) >= 20, common
    for name in common:
        assert _params(getattr(dg, name)) == theirs[name], name


def test_import_needs_no_torch():
    code = "import sys, cudart_kernels.deep_gemm; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_what_is_not_provided_says_so():
    with pytest.raises(AttributeError, match="does not provide DeepGEMM's fp8_mqa_logits"):
        dg.fp8_mqa_logits
    assert getattr(dg, "fp8_fp4_mega_moe", None) is None  # probes with a default still work
    with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
        dg.no_such_thing


# ---- errors before anything is touched ------------------------------------------------------------------------

def _fp8(*shape):
    return np.zeros(shape, E4M3)


def _f32(*shape, fill=0.0):
    return np.full(shape, fill, np.float32)


def _bf16(*shape):
    return np.zeros(shape, ml_dtypes.bfloat16)


A, SA = _fp8(64, 256), _f32(64, 2)
B, SB_BLOCK, SB_ROW = _fp8(96, 256), _f32(1, 2), _f32(96, 2)


@pytest.mark.parametrize("call,error,match", [
    (lambda: dg.fp8_gemm_nt((A, SA), (B, SB_BLOCK), _bf16(64, 96), recipe=(128, 128, 128)),
     NotImplementedError, r"recipe \(128, 128, 128\)"),
    (lambda: dg.fp8_gemm_nt((A, SA), (B, SB_BLOCK), _bf16(64, 96), recipe_a=(1, 32), recipe_b=(1, 32)),
     NotImplementedError, r"recipe \(1, 1, 32\)"),
    (lambda: dg.fp8_gemm_nt((A, SA), (B, SB_BLOCK), _bf16(64, 96), recipe_a=(1, 128), recipe_b=(1, 32)),
     NotImplementedError, "different K groups"),
    (lambda: dg.fp8_gemm_nt((A, SA), (B, SB_BLOCK), _bf16(64, 96), recipe=(1, 128, 128), recipe_a=(1, 128)),
     ValueError, "either recipe or both"),
    (lambda: dg.fp8_gemm_nt((A, SA.view(np.int32)), (B, SB_BLOCK), _bf16(64, 96)), NotImplementedError, "UE8M0"),
    (lambda: dg.fp8_gemm_nt((A.view(np.int8), SA), (B, SB_BLOCK), _bf16(64, 96)), NotImplementedError, "FP4"),
    (lambda: dg.fp8_gemm_nt(A, (B, SB_BLOCK), _bf16(64, 96)), TypeError, "per-tensor"),
    (lambda: dg.fp8_gemm_nt((A, SA), (B, SB_BLOCK), _f32(64, 96)), NotImplementedError, "bf16 d and takes no c"),
    (lambda: dg.fp8_gemm_nt((A, SA), (B, SB_BLOCK), _bf16(64, 96), c=_bf16(64, 96)), NotImplementedError,
     "takes no c"),
    (lambda: dg.fp8_gemm_nt((A, SA), (B, SB_BLOCK), _bf16(64, 95)), ValueError, r"d: expected shape \(64, 96\)"),
    (lambda: dg.fp8_gemm_nt((A, SA), (B, SB_ROW), _bf16(64, 96), recipe=(1, 1, 128)), NotImplementedError,
     "fp32 d and c"),
    (lambda: dg.fp8_gemm_nn((A, SA), (_fp8(256, 96), _f32(2, 1)), _bf16(64, 96)), NotImplementedError,
     "b is not K-major"),
    (lambda: dg.fp8_gemm_tn((_fp8(256, 64), _f32(2, 64)), (_fp8(256, 96), _f32(2, 1)), _bf16(64, 96)),
     NotImplementedError, "a is not K-major"),
    (lambda: dg.m_grouped_fp8_gemm_nt_contiguous((A, SA), (_fp8(2, 96, 256), _f32(2, 96, 2)), _bf16(64, 96),
                                                 np.zeros(64, np.int32), recipe=(1, 1, 128)),
     NotImplementedError, r"contiguous GEMM takes recipe \(1, 128, 128\)"),
    (lambda: dg.m_grouped_fp8_gemm_nt_contiguous((A, SA), (_fp8(2, 96, 256), _f32(2, 1, 2)), _bf16(64, 96),
                                                 np.zeros(64, np.int32), expected_m_for_psum_layout=64),
     ValueError, "use_psum_layout=True only"),
    (lambda: dg.m_grouped_fp8_gemm_nt_contiguous((A, SA), (_fp8(2, 96, 256), _f32(2, 1, 2)), _bf16(64, 96),
                                                 np.zeros(3, np.int32), use_psum_layout=True),
     ValueError, r"grouped_layout must be \[G\] = \[2\]"),
    (lambda: dg.m_grouped_fp8_gemm_nt_masked((_fp8(2, 64, 256), _f32(2, 64, 2)), (_fp8(2, 96, 256), _f32(2, 1, 2)),
                                             _bf16(2, 64, 96), np.zeros(2, np.int32), 0),
     ValueError, "expected_m must be positive"),
    (lambda: dg.k_grouped_fp8_gemm_tn_contiguous((A, SA), (B, SB_ROW), _f32(1, 64, 96), [256], None),
     NotImplementedError, "SM100 form"),
    (lambda: dg.k_grouped_fp8_gemm_nt_contiguous((A, SA), (B, SB_ROW), _f32(1, 64, 96), [256], None,
                                                 use_psum_layout=True), NotImplementedError, "use_psum_layout"),
    (lambda: dg.k_grouped_fp8_gemm_nt_contiguous((A, SA), (B, SB_ROW), _f32(1, 64, 96), [256], None,
                                                 recipe=(1, 128, 128)), NotImplementedError, "takes \\(1, 1, 128\\)"),
    (lambda: dg.bf16_gemm_tn(_bf16(256, 64), _bf16(256, 96), _bf16(64, 96)), NotImplementedError,
     "a is not K-major"),
    (lambda: dg.per_token_cast_to_fp8(_bf16(64, 256), use_ue8m0=True), NotImplementedError, "UE8M0"),
    (lambda: dg.per_block_cast_to_fp8(_bf16(64, 256), False, gran_k=32), NotImplementedError, "gran_k=32"),
    (lambda: dg.transform_sf_into_required_layout(SA.view(np.int32), 64, 256, (1, 128)), NotImplementedError,
     "UE8M0"),
    (lambda: dg.transform_sf_into_required_layout(SA, 64, 256, (1, 32)), NotImplementedError, r"\(1, 32\)"),
    (lambda: dg.transform_sf_into_required_layout(SA, 65, 256, (1, 128)), ValueError, r"expected shape \(65, 2\)"),
    (lambda: dg.transform_sf_into_required_layout(SA, 64, 256, (1, 128, 128)), ValueError, "needs is_sfa"),
    (lambda: dg.set_mk_alignment_for_contiguous_layout(96), ValueError, "64, 128, 256"),
])
def test_unsupported_and_invalid_calls_raise_clearly(call, error, match):
    with pytest.raises(error, match=match):
        call()


KA, KB_ = (_fp8(64 * 384), _f32(64, 3)), (_fp8(96 * 384), _f32(96, 3))  # K-grouped operands, sum(ks) = 384


@pytest.mark.parametrize("call,match", [
    (lambda d, c: dg.fp8_gemm_nt((_fp8(64, 200), _f32(64, 2)), (_fp8(96, 200), _f32(96, 2)), d[0], c[0],
                                 recipe=(1, 1, 128)), "multiple of 128"),
    (lambda d, c: dg.fp8_gemm_nt((A, _f32(64, 3)), (B, SB_ROW), d[0], c[0], recipe=(1, 1, 128)), "a's scales"),
    (lambda d, c: dg.fp8_gemm_nt((A, SA), (B, SB_BLOCK), d[0], c[0], recipe=(1, 1, 128)), "b's scales"),
    (lambda d, c: dg.fp8_gemm_nt((A, SA), (_bf16(96, 256), SB_ROW), d[0], c[0], recipe=(1, 1, 128)),
     "b: expected float8_e4m3fn"),
    (lambda d, c: dg.k_grouped_fp8_gemm_nt_contiguous(KA, KB_, d, [128, 200], None, c), "multiple of 128"),
    (lambda d, c: dg.k_grouped_fp8_gemm_nt_contiguous(KA, KB_, d, [128, 128], None, c), r"sum\(ks\) x 64"),
    (lambda d, c: dg.k_grouped_fp8_gemm_nt_contiguous(KA, KB_, d, [384], None, c), "ks has 1 groups"),
    (lambda d, c: dg.k_grouped_fp8_gemm_nt_contiguous(KA, KB_, d, [128, 256], None, c[0]), "c has shape"),
    (lambda d, c: dg.k_grouped_fp8_gemm_nt_contiguous((_fp8(384, 64).T, _f32(64, 3)), KB_, d, [128, 256], None, c),
     "a must be contiguous"),
    (lambda d, c: dg.k_grouped_fp8_gemm_nt_contiguous(KA, (KB_[0], _f32(3, 96)), d, [128, 256], None, c),
     "b's scales"),
])
def test_accumulating_calls_check_before_touching_d(call, match):
    d, c = _f32(2, 64, 96, fill=7.0), _f32(2, 64, 96, fill=1.0)
    with pytest.raises((ValueError, TypeError), match=match):
        call(d, c)
    assert (d == 7.0).all(), "d changed before the call was refused"


@pytest.mark.parametrize("call", [
    lambda: dg.fp8_gemm_nt((A, SA), (B, SB_BLOCK), _bf16(64, 96)),
    lambda: dg.fp8_gemm_nt((A, SA), (B, SB_ROW), _f32(64, 96), c=_f32(64, 96), recipe=(1, 1, 128)),
    lambda: dg.m_grouped_fp8_gemm_nt_contiguous((A, SA), (_fp8(2, 96, 256), _f32(2, 1, 2)), _bf16(64, 96),
                                                np.zeros(64, np.int32)),
    lambda: dg.m_grouped_fp8_gemm_nt_masked((_fp8(2, 64, 256), _f32(2, 64, 2)), (_fp8(2, 96, 256), _f32(2, 1, 2)),
                                            _bf16(2, 64, 96), np.zeros(2, np.int32), 32),
    lambda: dg.k_grouped_fp8_gemm_nt_contiguous(KA, KB_, _f32(2, 64, 96), [128, 256], None),
    lambda: dg.bf16_gemm_nt(_bf16(64, 256), _bf16(96, 256), _f32(64, 96)),
    lambda: dg.per_token_cast_to_fp8(_f32(64, 256), False),
    lambda: dg.per_block_cast_to_fp8(_f32(64, 256), False),
], ids=["normal", "accumulate", "contiguous", "masked", "k_grouped", "bf16", "per_token", "per_block"])
def test_valid_calls_reach_our_ops(call):
    """With the real ops (no stand-ins) a valid call gets as far as the ops' own check of its arrays: here, host
    arrays are refused before any GPU call."""
    with pytest.raises(ck.HostArrayError):
        call()


# ---- how calls map onto our ops --------------------------------------------------------------------------------

@pytest.fixture
def calls(monkeypatch):
    """Our ops replaced by recorders: (op name, positional args, keyword args) per call."""
    log = []
    for name in ("gemm_fp8", "gemm_fp8_grouped_contiguous", "gemm_fp8_grouped_masked", "gemm_fp8_wgrad", "gemm"):
        monkeypatch.setattr(dg, name, lambda *a, _n=name, **k: log.append((_n, a, k)))
    monkeypatch.setitem(dg._settings, "mk_alignment", 128)
    return log


def test_normal_gemm_maps_onto_gemm_fp8(calls):
    d = _bf16(64, 96)
    dg.fp8_gemm_nt((A, SA), (B, SB_BLOCK), d, compiled_dims="nk", disable_ue8m0_cast=True)
    (name, args, kw), = calls
    assert name == "gemm_fp8" and args == (A, SA, B, SB_BLOCK) and kw["out"] is d and "stream" not in kw
    assert kw["tuning"] is dg._settings["fp8"]


def test_transposed_forms_pass_k_major_views(calls):
    """tt / nn take A as [K, M] / B as [K, N]: transposed views of K-major tensors pass through as those."""
    dg.fp8_gemm_tt((A.T, SA.T), (B, SB_BLOCK), _bf16(64, 96))
    dg.fp8_gemm_nn((A, SA), (B.T, SB_BLOCK.T), _bf16(64, 96))
    dg.fp8_gemm_tn((A.T, SA.T), (B.T, SB_BLOCK.T), _bf16(64, 96))
    for _, args, _ in calls:
        assert [x.shape for x in args] == [(64, 256), (64, 2), (96, 256), (1, 2)]
        assert np.shares_memory(args[0], A) and args[0].strides == A.strides
        assert np.shares_memory(args[2], B) and args[2].strides == B.strides


@pytest.mark.parametrize("c_kind", ["none", "separate", "same"])
def test_accumulating_gemm_maps_onto_the_wgrad_kernel(calls, c_kind):
    d = _f32(64, 96, fill=5.0)
    c = {"none": None, "separate": _f32(64, 96, fill=2.0), "same": d}[c_kind]
    dg.fp8_gemm_nt((A, SA), (B, SB_ROW), d, c=c, recipe=(1, 1, 128))
    (name, args, kw), = calls
    assert name == "gemm_fp8_wgrad" and args[:4] == (A, SA, B, SB_ROW) and args[5] == [256]
    assert args[4].shape == (1, 64, 96) and np.shares_memory(args[4], d)
    assert (d == {"none": 0.0, "separate": 2.0, "same": 5.0}[c_kind]).all()  # d = c before the kernel adds


def test_empty_problems_follow_deepgemm(calls):
    d, c = _f32(64, 96, fill=5.0), _f32(64, 96, fill=3.0)
    dg.fp8_gemm_nt((_fp8(64, 0), _f32(64, 0)), (_fp8(96, 0), _f32(96, 0)), d, c=c, recipe=(1, 1, 128))
    assert (d == 3.0).all()  # K = 0: D = C
    dg.fp8_gemm_nt((_fp8(0, 256), _f32(0, 2)), (B, SB_BLOCK), _bf16(0, 96))
    assert not calls


@pytest.mark.parametrize("alignment", [128, 256])
def test_contiguous_passes_the_alignment(calls, alignment):
    dg.set_mk_alignment_for_contiguous_layout(alignment)
    assert dg.get_mk_alignment_for_contiguous_layout() == alignment
    ids, d = np.zeros(64, np.int32), _bf16(64, 96)
    b = (_fp8(2, 96, 256), _f32(2, 1, 2))
    dg.m_grouped_fp8_gemm_nt_contiguous((A, SA), b, d, ids)
    dg.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous((A, SA), b, d, ids)
    for name, args, kw in calls:
        assert name == "gemm_fp8_grouped_contiguous" and args == (A, SA) + b + (ids,)
        assert kw["out"] is d and kw["alignment"] == alignment


def test_masked_maps_onto_the_masked_op(calls):
    a, b = (_fp8(2, 64, 256), _f32(2, 64, 2)), (_fp8(2, 96, 256), _f32(2, 1, 2))
    masked, d = np.zeros(2, np.int32), _bf16(2, 64, 96)
    dg.m_grouped_fp8_gemm_nt_masked(a, b, d, masked, 32)
    (name, args, kw), = calls
    assert name == "gemm_fp8_grouped_masked" and args == a + b + (masked,) and kw["out"] is d
    assert kw["expected_m"] == 32  # (the tile pick's hint)


@pytest.mark.parametrize("c_kind", ["none", "separate", "same"])
def test_k_grouped_runs_one_launch_per_nonempty_group(calls, rng, c_kind):
    m, n, ks = 64, 96, [256, 0, 128]
    total = sum(ks)
    a = rng.standard_normal(total * m).astype(E4M3)
    b = rng.standard_normal(total * n).astype(E4M3)
    sa, sb = rng.random((m, total // 128)).astype(np.float32), rng.random((n, total // 128)).astype(np.float32)
    d = _f32(3, m, n, fill=5.0)
    c = {"none": None, "separate": _f32(3, m, n, fill=2.0), "same": d}[c_kind]
    dg.k_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), d, ks, np.array(ks, np.int32), c)
    assert (d == {"none": 0.0, "separate": 2.0, "same": 5.0}[c_kind]).all()
    assert [(name, args[5]) for name, args, _ in calls] == [("gemm_fp8_wgrad", [256]), ("gemm_fp8_wgrad", [128])]
    starts = (0, 256)
    for (_, (ag, sag, bg, sbg, dg_, _), _), start, g, kg in zip(calls, starts, (0, 2), (256, 128)):
        # group g is the [M, kg] row-major block after the previous groups' blocks, its scales columns likewise
        assert np.array_equal(ag.view(np.uint8), a[start * m:(start + kg) * m].reshape(m, kg).view(np.uint8))
        assert np.array_equal(bg.view(np.uint8), b[start * n:(start + kg) * n].reshape(n, kg).view(np.uint8))
        assert np.array_equal(sag, sa[:, start // 128:(start + kg) // 128])
        assert np.array_equal(sbg, sb[:, start // 128:(start + kg) // 128])
        assert dg_.shape == (1, m, n) and np.shares_memory(dg_, d[g])


def test_bf16_gemm_layouts(calls):
    a, b_nk, d = _bf16(64, 256), _bf16(96, 256), _f32(64, 96)
    b_kn = np.ascontiguousarray(b_nk.T)
    dg.bf16_gemm_nt(a, b_nk, d, c=d)
    dg.bf16_gemm_nn(a, b_kn, d)
    (n1, args1, kw1), (n2, args2, kw2) = calls
    assert n1 == n2 == "gemm" and args1 == (a, b_nk) and kw1["b_layout"] == "nk" and kw1["c"] is d
    assert args2[1] is not b_kn and np.shares_memory(args2[1], b_kn) and args2[1].shape == (256, 96)
    assert kw2["b_layout"] == "kn" and kw2["c"] is None


def test_runtime_settings():
    assert dg.get_theoretical_mk_alignment_for_contiguous_layout(64) == 128
    assert dg.get_pdl() is True
    dg.set_pdl(False)
    try:
        assert dg.get_pdl() is False and dg._settings["bf16"].pdl is False
    finally:
        dg.set_pdl(True)
    dg.set_ignore_compile_dims(True)


# ---- layout helpers ------------------------------------------------------------------------------------------

def test_tma_aligned_size():
    assert dg.get_tma_aligned_size(4097, 4) == 4100 and dg.get_tma_aligned_size(4096, 4) == 4096
    assert dg.get_tma_aligned_size(5, 2) == 8 and dg.get_tma_aligned_size(3, 1) == 16
    assert dg.ceil_div(7, 2) == 4 and dg.align(7, 4) == 8
    assert dg.mn_major_strides((5, 3)) == (1, 8) and dg.mn_major_strides((2, 5, 3)) == (24, 1, 8)


@pytest.mark.parametrize("shape", [(5, 3), (4, 7), (2, 5, 3), (3, 1, 2)])
def test_mn_major_tensor_numpy(rng, shape):
    sf = rng.random(shape).astype(np.float32)
    out = dg.get_mn_major_tma_aligned_tensor(sf)
    assert np.array_equal(out, sf)
    want = dg.mn_major_strides(shape)
    assert all(s // 4 == w or n == 1 for s, w, n in zip(out.strides, want, shape))
    assert dg.get_mn_major_tma_aligned_tensor(out) is out  # already in the layout: no copy
    t = dg.transform_sf_into_required_layout(sf[-1] if len(shape) == 3 else sf, shape[-2], shape[-1] * 128, (1, 128))
    assert np.array_equal(t, sf[-1] if len(shape) == 3 else sf)
    blocks = rng.random((2, 3)).astype(np.float32)
    assert dg.transform_sf_into_required_layout(blocks, 200, 300, (1, 128, 128), is_sfa=False) is blocks


# ---- torch CPU tensors, where torch is installed ----------------------------------------------------------------

def test_mn_major_tensor_torch():
    torch = pytest.importorskip("torch")
    sf = torch.rand(3, 130, 5)
    out = dg.get_mn_major_tma_aligned_tensor(sf)
    assert out.stride() == (132 * 5, 1, 132) and torch.equal(out, sf)
    assert dg.get_mn_major_tma_aligned_tensor(out) is out


def test_masked_scales_in_deepgemms_layout_are_laid_back_to_back(calls):
    torch = pytest.importorskip("torch")
    sa = dg.get_mn_major_tma_aligned_tensor(torch.rand(3, 62, 2))  # per group: strides (64 * 2, 1, 64)
    a, b = (torch.zeros(3, 62, 256), sa), (torch.zeros(3, 96, 256), torch.zeros(3, 1, 2))
    dg.m_grouped_fp8_gemm_nt_masked(a, b, torch.zeros(3, 62, 96), torch.zeros(3, dtype=torch.int32), 8)
    (_, args, _), = calls
    assert args[1].stride() == (62, 1, 188) and torch.equal(args[1], sa)  # [G * M, KB] M-major, 16-byte columns
    plain = torch.rand(3, 62, 2)  # row-major groups already follow each other: passed as they are
    dg.m_grouped_fp8_gemm_nt_masked((a[0], plain), b, torch.zeros(3, 62, 96), torch.zeros(3, dtype=torch.int32), 8)
    assert calls[1][1][1] is plain


@pytest.mark.parametrize("alignment", [64, 128])
def test_psum_layout_becomes_row_ids(rng, alignment):
    torch = pytest.importorskip("torch")
    counts = rng.integers(0, 3 * alignment, 5)
    counts[2] = 0  # an expert without tokens
    ends, start = [], 0
    for c in counts:
        ends.append(start + int(c))
        start = dg.align(ends[-1], alignment)
    m = start + alignment  # trailing rows of no expert
    want = np.full(m, -1, np.int32)
    start = 0
    for g, e in enumerate(ends):
        want[start:e] = g
        start = dg.align(e, alignment)
    got = dg._psum_to_m_indices(torch.tensor(ends, dtype=torch.int32), m, alignment)
    assert got.dtype == torch.int32 and np.array_equal(got.numpy(), want), (counts, ends)


def test_psum_layout_is_passed_as_row_ids(calls):
    torch = pytest.importorskip("torch")
    a = (torch.zeros(256, 256), torch.zeros(256, 2))
    b = (torch.zeros(2, 96, 256), torch.zeros(2, 1, 2))
    psum = torch.tensor([100, 150], dtype=torch.int32)
    dg.m_grouped_fp8_gemm_nt_contiguous(a, b, torch.zeros(256, 96), psum, use_psum_layout=True,
                                        expected_m_for_psum_layout=128)
    (_, args, _), = calls
    ids = args[4].numpy()
    assert (ids[:100] == 0).all() and (ids[100:128] == -1).all() and (ids[128:150] == 1).all()
    assert (ids[150:] == -1).all()
