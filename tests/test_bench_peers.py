"""The FP8 benches' DeepGEMM peer without a GPU: a numpy-backed stand-in for torch and a stand-in `deep_gemm` module
(in sys.modules) that asserts the layouts the real one reads without a copy and computes the products; the timing
functions and our ops stubbed. Checks the calls made (names, argument layouts), the rows' DeepGEMM columns, the
cross-check that flags a wrong peer call, the one skip line where `import deep_gemm` fails, the markdown and JSON,
the JIT prewarm's workers, and the scripts that install DeepGEMM on the GPU machine."""
import importlib
import json
import math
import os
import sys
import types

import ml_dtypes
import numpy as np
import pytest

from cudart_kernels import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E4M3, BF16 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.bfloat16)
F32, I32 = np.dtype(np.float32), np.dtype(np.int32)


# ---- a numpy stand-in for the parts of torch the FP8 benches use ----------------------------------------------

class T(np.ndarray):
    """A numpy array with torch's tensor methods (those the benches call); strides in elements."""

    device = "cuda"

    def stride(self, dim=None):
        s = tuple(x // self.itemsize for x in self.strides)
        return s if dim is None else s[dim]

    def data_ptr(self):
        return self.__array_interface__["data"][0]

    def t(self):
        return self.T

    def transpose(self, a, b):
        return np.swapaxes(self, a, b)

    def contiguous(self):
        return np.ascontiguousarray(self).view(T)

    def float(self):
        return self.astype(F32)

    def int(self):
        return self.astype(I32)

    def to(self, x):
        return self.astype(x) if isinstance(x, (type, np.dtype)) else self

    def view(self, *shape):
        if not shape or isinstance(shape[0], (type, np.dtype)):  # numpy's own view (to a type)
            return np.ndarray.view(self, *shape)
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        v = np.ndarray.view(self)
        v.shape = shape  # raises where torch's view would (a copy needed)
        return v

    def copy_(self, src):
        self[...] = src
        return self

    def fill_(self, value):
        self[...] = value
        return self

    def norm(self):
        return np.sqrt(np.sum(np.square(np.asarray(self, dtype=np.float64))))

    def clamp(self, min=None, max=None):  # noqa: A002
        return np.clip(self, min, max)

    def repeat_interleave(self, r):
        return np.repeat(np.asarray(self), r).view(T)


def _t(x, dtype=None):
    return np.asarray(x, dtype=dtype).view(T)


def _shape(shape):
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)


def _full(shape, dtype):
    dtype = np.dtype(dtype)
    return _t(np.full(shape, 0 if dtype.kind in "iub" else np.nan, dtype=dtype))  # torch.empty: never zeros


class FakeCuda:
    def is_available(self):
        return True

    def synchronize(self):
        pass

    def empty_cache(self):
        pass


class FakeTorch(types.ModuleType):
    float32, bfloat16, int32, float8_e4m3fn = F32, BF16, I32, E4M3

    def __init__(self):
        super().__init__("torch")
        self.cuda = FakeCuda()
        self.rng = np.random.default_rng(0)
        self.calls = []  # the torch peers' calls, by name

        class Generator:
            def manual_seed(gen, seed):  # noqa: N805
                gen.rng = np.random.default_rng(seed)
                return gen
        self.Generator = Generator

    def randn(self, *shape, device=None, dtype=F32):
        return _t(self.rng.standard_normal(_shape(shape)).astype(dtype))

    def rand(self, *shape, generator=None, device=None, dtype=F32):
        return _t((generator.rng if generator else self.rng).random(_shape(shape)).astype(dtype))

    def empty(self, *shape, device=None, dtype=F32):
        return _full(_shape(shape), dtype)

    def zeros(self, *shape, device=None, dtype=F32):
        return _t(np.zeros(_shape(shape), dtype=dtype))

    def ones(self, *shape, device=None, dtype=F32):
        return _t(np.ones(_shape(shape), dtype=dtype))

    def empty_strided(self, shape, strides, device=None, dtype=F32):
        dtype = np.dtype(dtype)
        size = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0
        buf = _full((size,), dtype)
        return np.lib.stride_tricks.as_strided(buf, shape, tuple(s * dtype.itemsize for s in strides)).view(T)

    def arange(self, start, end=None, device=None, dtype=np.int64):
        return _t(np.arange(start, end) if end is not None else np.arange(start), dtype)

    def tensor(self, data, device=None, dtype=None):
        return _t(data, dtype)

    def from_dlpack(self, x):
        return x

    def _scaled_mm(self, *args, **kw):
        self.calls.append("_scaled_mm")

    def _grouped_mm(self, *args, **kw):
        self.calls.append("_grouped_mm")

    def matmul(self, *args, **kw):
        self.calls.append("matmul")


# ---- products (float64) for our stubbed ops and the stand-in DeepGEMM ------------------------------------------

def _deq_rows(q, s):
    q, s = np.asarray(q, np.float64), np.asarray(s, np.float64)
    return q * np.repeat(s, 128, axis=-1)[..., :q.shape[-1]]


def _deq_blocks(q, s):
    q, s = np.asarray(q, np.float64), np.asarray(s, np.float64)
    n, k = q.shape[-2:]
    return q * np.repeat(np.repeat(s, 128, axis=-2)[..., :n, :], 128, axis=-1)[..., :k]


def _align4(m):
    return -(-m // 4) * 4


class StandInDeepGemm(types.ModuleType):
    """DeepGEMM's SM90 FP8 calls as sgl-deep-gemm 0.1.5.post1 names them (no m_grouped_fp8_gemm_nt_masked), each
    asserting the layouts the real one reads in place and writing the product. `wrong=True` ignores sB: a peer
    call that is off, which the bench's cross-check must catch."""

    def __init__(self, wrong=False):
        super().__init__("deep_gemm")
        self.__version__ = "0.1.5.post1-standin"
        self.calls, self.wrong = [], wrong

    def get_mk_alignment_for_contiguous_layout(self):
        return 128

    def _b(self, b, sb):
        return _deq_blocks(b, np.ones_like(np.asarray(sb)) if self.wrong else sb)

    def fp8_gemm_nt(self, a, b, d, c=None, recipe=None, recipe_a=None, recipe_b=None, compiled_dims="",
                    disable_ue8m0_cast=False):
        (a, sa), (b, sb) = a, b
        m, k = a.shape
        n = b.shape[0]
        assert a.dtype == E4M3 and b.dtype == E4M3 and a.stride() == (k, 1) and b.stride() == (k, 1)
        assert sa.dtype == F32 and sa.shape == (m, k // 128) and sa.stride() == (1, _align4(m)), sa.stride()
        assert sb.dtype == F32 and sb.shape == (n // 128, k // 128) and sb.stride() == (k // 128, 1)
        assert d.dtype == BF16 and d.shape == (m, n) and c is None and recipe is None
        self.calls.append(("fp8_gemm_nt", dict(m=m, n=n, k=k, compiled_dims=compiled_dims)))
        d[...] = _deq_rows(a, sa) @ self._b(b, sb).T

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None,
                                         compiled_dims="nk", disable_ue8m0_cast=False, use_psum_layout=False,
                                         ensure_zero_padding=True, expected_m_for_psum_layout=None):
        (a, sa), (b, sb) = a, b
        m, k = a.shape
        groups, n, _ = b.shape
        ids = np.asarray(grouped_layout)
        assert grouped_layout.dtype == I32 and ids.shape == (m,) and not use_psum_layout
        assert sa.shape == (m, k // 128) and sa.stride() == (1, _align4(m))
        assert sb.shape == (groups, n // 128, k // 128) and sb.stride() == ((n // 128) * (k // 128), k // 128, 1)
        starts = [i for i in range(m) if ids[i] >= 0 and (i == 0 or ids[i - 1] != ids[i])]
        assert all(s % 128 == 0 for s in starts), starts  # each group's segment on the 128-row alignment
        self.calls.append(("m_grouped_fp8_gemm_nt_contiguous", dict(m=m, n=n, k=k, groups=groups)))
        ad = _deq_rows(a, sa)
        for g in range(groups):
            rows = np.nonzero(ids == g)[0]
            d[rows] = ad[rows] @ self._b(b[g], sb[g]).T

    def fp8_m_grouped_gemm_nt_masked(self, a, b, d, masked_m, expected_m, recipe=None, recipe_a=None,
                                     recipe_b=None, compiled_dims="nk", disable_ue8m0_cast=False):
        (a, sa), (b, sb) = a, b
        groups, max_m, k = a.shape
        kb, am = k // 128, _align4(max_m)
        assert sa.shape == (groups, max_m, kb) and sa.stride() == (am * kb, 1, am), sa.stride()
        assert masked_m.dtype == I32 and isinstance(expected_m, int)
        self.calls.append(("fp8_m_grouped_gemm_nt_masked", dict(groups=groups, max_m=max_m, expected_m=expected_m,
                                                                masked=[int(x) for x in masked_m])))
        for g, r in enumerate(np.asarray(masked_m)):
            d[g, :r] = _deq_rows(a[g, :r], sa[g, :r]) @ self._b(b[g], sb[g]).T

    def k_grouped_fp8_gemm_nt_contiguous(self, a, b, d, ks, grouped_layout, c=None, recipe=(1, 1, 128),
                                         compiled_dims="mn", use_psum_layout=False):
        (a, sa), (b, sb) = a, b
        groups, m, n = d.shape
        total = sum(ks)
        assert isinstance(ks, list) and all(isinstance(x, int) for x in ks) and len(ks) == groups
        assert list(np.asarray(grouped_layout)) == ks and grouped_layout.dtype == I32
        assert a.ndim == 1 and a.shape == (total * m,) and b.shape == (total * n,) and a.dtype == E4M3
        assert sa.shape == (m, total // 128) and sa.stride() == (1, m) and sb.stride() == (1, n)
        assert c is d and tuple(recipe) == (1, 1, 128) and d.dtype == F32
        self.calls.append(("k_grouped_fp8_gemm_nt_contiguous", dict(m=m, n=n, ks=list(ks))))
        start = 0
        for g, kg in enumerate(ks):
            ag = a[start * m:(start + kg) * m].view(m, kg)
            bg = b[start * n:(start + kg) * n].view(n, kg)
            cols = slice(start // 128, (start + kg) // 128)
            sbg = np.ones_like(np.asarray(sb[:, cols])) if self.wrong else sb[:, cols]
            d[g] += (_deq_rows(ag, sa[:, cols]) @ _deq_rows(bg, sbg).T).astype(np.float32)
            start += kg


# ---- our ops stubbed (products in float64, written where ours would write them) --------------------------------

def _quant_per_token(x):
    x = np.asarray(x, np.float32)
    m, k = x.shape
    amax = np.maximum(np.abs(x.reshape(m, k // 128, 128)).max(-1), 1e-4)
    q = _t((x.reshape(m, k // 128, 128) * (448.0 / amax)[..., None]).reshape(m, k).astype(E4M3))
    s = FakeTorch().empty_strided((m, k // 128), (1, _align4(m)), dtype=F32)  # M-major, aligned column stride
    s[...] = amax / 448.0
    return q, s


def _quant_per_block(w):
    w = np.asarray(w, np.float32)
    n, k = w.shape
    v = w.reshape(n // 128, 128, k // 128, 128)
    amax = np.maximum(np.abs(v).max(axis=(1, 3)), 1e-4)
    q = _t((v * (448.0 / amax)[:, None, :, None]).reshape(n, k).astype(E4M3))
    return q, _t(amax / 448.0, F32)


class OursStub:
    def __init__(self):
        self.calls = []

    def gemm_fp8(self, a, sa, b, sb, out, stream=None):
        self.calls.append("gemm_fp8")
        out[...] = _deq_rows(a, sa) @ _deq_blocks(b, sb).T
        return out

    def gemm_fp8_grouped_contiguous(self, a, sa, b, sb, ids, out, alignment=128, stream=None):
        self.calls.append(f"contiguous alignment={alignment}")
        ids, ad = np.asarray(ids), _deq_rows(a, sa)
        for g in range(b.shape[0]):
            rows = np.nonzero(ids == g)[0]
            out[rows] = ad[rows] @ _deq_blocks(b[g], sb[g]).T
        return out

    def gemm_fp8_grouped_masked(self, a, sa, b, sb, masked, out, expected_m=None, stream=None):
        assert expected_m == max(1, -(-int(np.asarray(masked).sum()) // len(masked)))  # (the hint DeepGEMM gets)
        self.calls.append("masked")
        for g, r in enumerate(np.asarray(masked)):
            out[g, :r] = _deq_rows(a[g, :r], sa[g, :r]) @ _deq_blocks(b[g], sb[g]).T
        return out

    def gemm_fp8_wgrad(self, a, sa, b, sb, d, ks, stream=None):
        self.calls.append("wgrad")
        start = 0
        for g, kg in enumerate(ks):
            cols, scols = slice(start, start + kg), slice(start // 128, (start + kg) // 128)
            d[g] += (_deq_rows(a[:, cols], sa[:, scols]) @ _deq_rows(b[:, cols], sb[:, scols]).T).astype(np.float32)
            start += kg
        return d


SHAPES = {"normal": [(64, 256, 384), (130, 384, 256)],  # M = 130: the scales' column stride rounds up to 132
          "contiguous": [(2, 128, 256, 256)], "masked": [(2, 64, 256, 384)], "wgrad": [(2, 128, 128, 256)]}
UNEVEN = [((100, 200, 130), 256, 256)]


@pytest.fixture
def stand_ins(monkeypatch):
    """The fake torch, our ops stubbed, graph timing stubbed (each run called once per set; run j of a call takes
    100 + j us), no prewarm processes, and a fresh DeepGEMM state; returns (torch, ours, timed runs per call)."""
    torch, ours, timed = FakeTorch(), OursStub(), []
    monkeypatch.setitem(sys.modules, "torch", torch)
    gemm_fp8 = importlib.import_module("cudart_kernels.ops.gemm_fp8")
    quantize = importlib.import_module("cudart_kernels.ops.quantize")
    monkeypatch.setattr(gemm_fp8, "BENCH_SHAPES", SHAPES)
    for name in ("gemm_fp8", "gemm_fp8_grouped_contiguous", "gemm_fp8_grouped_masked", "gemm_fp8_wgrad"):
        monkeypatch.setattr(gemm_fp8, name, getattr(ours, name))
    monkeypatch.setattr(quantize, "quantize_fp8_per_token", _quant_per_token)
    monkeypatch.setattr(quantize, "quantize_fp8_per_block", _quant_per_block)
    monkeypatch.setattr(bench, "CONTIGUOUS_UNEVEN", UNEVEN)
    monkeypatch.setattr(bench, "sets_beyond_l2", lambda nbytes, device=0, cap=64: 2)

    def graph_times_us(torch_, runs, n_sets=1, iters=20, repeats=7, warmup=3):
        for run in runs:
            for i in range(n_sets):
                run(i, "side stream")
        timed.append(len(runs))
        return [100.0 + j for j in range(len(runs))]
    monkeypatch.setattr(bench, "graph_times_us", graph_times_us)
    monkeypatch.setattr(bench, "graph_time_us", lambda torch_, run, n_sets=1, **kw: graph_times_us(
        torch_, [run], n_sets)[0])
    monkeypatch.setattr(bench, "_dg_state", {})
    monkeypatch.setenv("CK_BENCH_DG_WORKERS", "0")
    monkeypatch.delenv("CK_REQUIRE_DEEPGEMM", raising=False)
    monkeypatch.delenv("CK_BENCH_DEEPGEMM", raising=False)
    return torch, ours, timed


@pytest.fixture
def deep_gemm(monkeypatch):
    dg = StandInDeepGemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", dg)
    return dg


def _dg_rows(rows):
    return [r for r in rows if "deepgemm_us" in r.extra]


# ---- the rows -------------------------------------------------------------------------------------------------

def test_gemm_fp8_times_deepgemm_beside_cublas(stand_ins, deep_gemm, capsys):
    torch, ours, timed = stand_ins
    rows = bench.bench_gemm_fp8()
    main = [r for r in rows if r.op == "gemm_fp8"]
    assert [r.case for r in main] == ["64x256x384", "130x384x256"]
    assert _dg_rows(rows) == main  # DeepGEMM on every normal shape, on no context row
    for r in main:
        assert r.peer == "cuBLAS blockwise" and (r.peer_us, r.us) == (100.0, 100.0)  # cuBLAS stays the peer
        x = r.extra
        assert x["deepgemm_us"] == 101.0 and x["ours_over_deepgemm"] == pytest.approx(100.0 / 101.0)
        assert x["deepgemm_tflops"] == pytest.approx(r.tflops / 101e-6)
        assert x["deepgemm_agrees"] and x["deepgemm_rel_err"] < 1e-6 and x["deepgemm_call"] == "fp8_gemm_nt"
    # one cross-check call per shape (compiled_dims "nk", DeepGEMM's own default), then one per rotating set in
    # the timed rounds beside cuBLAS and ours
    assert [c[1]["m"] for c in deep_gemm.calls] == [64] * 3 + [130] * 3
    assert all(c == ("fp8_gemm_nt", dict(c[1], compiled_dims="nk")) for c in deep_gemm.calls)
    # ours and DeepGEMM take turns alone, cuBLAS in rounds of its own (a third kernel in the rounds would run
    # before ours every other turn and before DeepGEMM never), then cuBLAS per-tensor for context
    assert timed[:3] == [2, 1, 1]
    out = capsys.readouterr().out
    assert "DeepGEMM peer: deep_gemm 0.1.5.post1-standin" in out and "skipped" not in out


def test_grouped_rows_call_deepgemm_with_its_layouts(stand_ins, deep_gemm, capsys):
    torch, ours, timed = stand_ins
    rows = bench.bench_gemm_fp8_grouped()
    by_op = {}
    for r in rows:
        by_op.setdefault(r.op, []).append(r)
    contiguous = by_op["gemm_fp8_contiguous"]
    assert [r.case.rsplit(", ", 1)[-1] for r in contiguous] == ["alignment=256", "alignment=128", "alignment=128"]
    assert "3 groups of [100, 200, 130] rows (segments padded to 128)" in contiguous[2].case
    assert contiguous[2].tflops == pytest.approx(2 * 430 * 256 * 256 / 1e12)  # the real rows only
    assert not contiguous[2].peer  # uneven groups: DeepGEMM only
    assert _dg_rows(rows) == contiguous + by_op["gemm_fp8_masked"] + by_op["gemm_fp8_wgrad"]
    for r in _dg_rows(rows):
        assert r.extra["deepgemm_agrees"] and r.extra["deepgemm_rel_err"] < 1e-6, r.case
    # each alignment's run alone with DeepGEMM (torch in rounds of its own)
    assert contiguous[0].extra["deepgemm_us"] == contiguous[1].extra["deepgemm_us"] == 101.0
    assert contiguous[0].extra["ours_over_deepgemm"] == pytest.approx(100.0 / 101.0)
    assert contiguous[1].extra["ours_over_deepgemm"] == pytest.approx(100.0 / 101.0)
    assert contiguous[0].peer_us == contiguous[1].peer_us == 100.0
    assert by_op["gemm_fp8_masked"][0].extra["ours_over_deepgemm"] == pytest.approx(100.0 / 101.0)
    assert by_op["gemm_fp8_wgrad"][0].extra["deepgemm_call"] == "k_grouped_fp8_gemm_nt_contiguous"
    assert by_op["gemm_fp8_masked"][0].extra["deepgemm_call"] == "fp8_m_grouped_gemm_nt_masked"
    names = [c[0] for c in deep_gemm.calls]
    assert names == ["m_grouped_fp8_gemm_nt_contiguous"] * 5 + ["fp8_m_grouped_gemm_nt_masked"] * 2 \
        + ["k_grouped_fp8_gemm_nt_contiguous"] * 2  # each: the cross-check, then the timed runs
    masked_call = deep_gemm.calls[5][1]
    real = masked_call["masked"]
    assert masked_call["expected_m"] == -(-sum(real) // 2) and all(48 <= r <= 64 for r in real)
    assert f"({sum(real)} real rows)" in by_op["gemm_fp8_masked"][0].case
    assert deep_gemm.calls[7][1] == dict(m=128, n=256, ks=[128, 128])
    # contiguous, each alignment: ours + DG, then torch; context; uneven; masked; wgrad: ours + DG, then torch
    assert timed == [2, 1, 2, 1, 1, 2, 2, 2, 1]
    assert "skipped" not in capsys.readouterr().out


def test_a_wrong_peer_call_is_flagged(stand_ins, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "deep_gemm", StandInDeepGemm(wrong=True))
    rows = bench.bench_gemm_fp8() + bench.bench_gemm_fp8_grouped()
    flagged = _dg_rows(rows)
    assert len(flagged) == 2 + 3 + 1 + 1
    assert all(not r.extra["deepgemm_agrees"] and r.extra["deepgemm_rel_err"] > bench.DG_AGREE for r in flagged)
    out = capsys.readouterr().out
    assert out.count("DeepGEMM peer MISMATCH on ") == 6  # the two contiguous rows share one check
    md = bench.markdown(rows, 0.0)
    assert md.count(" MISMATCH |") == 7


def test_skip_line_when_deep_gemm_does_not_import(stand_ins, monkeypatch, capsys):
    torch, ours, timed = stand_ins
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import deep_gemm raises ImportError
    rows = bench.bench_gemm_fp8() + bench.bench_gemm_fp8_grouped()
    out = capsys.readouterr().out
    skip = [ln for ln in out.splitlines() if "DeepGEMM" in ln]
    assert len(skip) == 1
    assert skip[0].startswith("DeepGEMM peer skipped: import deep_gemm failed (ModuleNotFoundError: import of ")
    assert not _dg_rows(rows)
    assert timed == [2, 1, 1] * 2 + [2, 2, 1, 1, 1, 2]  # no DeepGEMM run anywhere
    assert [r.case for r in rows if r.op == "gemm_fp8_contiguous"][-1].startswith("3 groups of [100, 200, 130]")
    md = bench.markdown(rows, 0.0)
    assert "DeepGEMM" not in md and md.splitlines()[0].endswith("| peer/ours |")
    assert bench.deepgemm_summary()["skipped"].startswith("import deep_gemm failed (ModuleNotFoundError")


def test_skip_by_environment_and_required_import(stand_ins, deep_gemm, monkeypatch, capsys):
    monkeypatch.setenv("CK_BENCH_DEEPGEMM", "0")
    assert not _dg_rows(bench.bench_gemm_fp8())
    assert "DeepGEMM peer skipped: CK_BENCH_DEEPGEMM=0" in capsys.readouterr().out
    monkeypatch.setattr(bench, "_dg_state", {})
    monkeypatch.delenv("CK_BENCH_DEEPGEMM")
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    monkeypatch.setenv("CK_REQUIRE_DEEPGEMM", "1")
    with pytest.raises(RuntimeError, match="import deep_gemm failed"):
        bench.bench_gemm_fp8()


def test_a_build_without_a_call_skips_those_rows(stand_ins, monkeypatch, capsys):
    dg = StandInDeepGemm()
    dg.k_grouped_fp8_gemm_nt_contiguous = None  # (as if this build had no K-grouped GEMM)
    monkeypatch.setitem(sys.modules, "deep_gemm", dg)
    rows = bench.bench_gemm_fp8_grouped()
    assert [r.op for r in _dg_rows(rows)] == ["gemm_fp8_contiguous"] * 3 + ["gemm_fp8_masked"]
    assert capsys.readouterr().out.count("has no k_grouped_fp8_gemm_nt_contiguous") == 1
    assert bench.deepgemm_summary()["missing"] == ["wgrad"]


def test_a_failing_peer_call_leaves_the_row_without_it(stand_ins, deep_gemm, monkeypatch, capsys):
    def broken(*args, **kw):
        raise RuntimeError("Assertion failed: sfa layout\nmore")
    monkeypatch.setattr(deep_gemm, "fp8_gemm_nt", broken)
    rows = bench.bench_gemm_fp8()
    assert not _dg_rows(rows) and [r.us for r in rows if r.op == "gemm_fp8"] == [101.0, 101.0]
    out = capsys.readouterr().out
    assert out.count("DeepGEMM peer failed on gemm_fp8 ") == 2 and "sfa layout; the row is timed without it" in out


def test_markdown_and_json_carry_the_deepgemm_columns(stand_ins, deep_gemm, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench, "require_gpu", lambda: None)
    monkeypatch.setattr(bench, "use_device", lambda device: None)
    monkeypatch.setattr(bench, "device_properties",
                        lambda device: types.SimpleNamespace(name="stand-in", sm_count=132, l2_bytes=50 << 20))
    monkeypatch.setattr(bench, "copy_bandwidth_row", lambda device=0: bench.Row("copy", "1 GiB", 500.0, gbytes=2.0))
    path = tmp_path / "bench.json"
    rows = bench.run(["gemm_fp8", "gemm_fp8_grouped"], str(path))
    md = capsys.readouterr().out
    header = next(ln for ln in md.splitlines() if ln.startswith("| op |"))
    assert header.endswith("| peer/ours | DeepGEMM (us) | DeepGEMM TFLOP/s | ours/DeepGEMM time |")
    line = next(ln for ln in md.splitlines() if ln.startswith("| gemm_fp8 | 64x256x384 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert len(cells) == 12 and cells[9:] == ["101.0", f"{2 * 64 * 256 * 384 / 101e-6 / 1e12:.1f}", "0.990"]
    context = next(ln for ln in md.splitlines() if ln.startswith("| gemm_fp8_context |"))
    assert context.endswith("|  |  |  |")  # rows without DeepGEMM: empty cells
    body = json.loads(path.read_text())
    assert body["deepgemm"]["version"] == "0.1.5.post1-standin"
    assert body["deepgemm"]["calls"] == {"normal": "fp8_gemm_nt", "contiguous": "m_grouped_fp8_gemm_nt_contiguous",
                                         "masked": "fp8_m_grouped_gemm_nt_masked",
                                         "wgrad": "k_grouped_fp8_gemm_nt_contiguous"}
    assert body["deepgemm"]["normal_kw"] == {"compiled_dims": "nk"}
    js = [r for r in body["rows"] if r["op"] == "gemm_fp8"]
    assert js[0]["extra"]["deepgemm_us"] == 101.0 and js[0]["extra"]["ours_over_deepgemm"] == pytest.approx(100 / 101)
    assert len(rows) == len(body["rows"])


# ---- JIT prewarm -----------------------------------------------------------------------------------------------

def test_prewarm_gets_every_case_and_its_calls_match_the_bench(stand_ins, deep_gemm, monkeypatch):
    torch, ours, timed = stand_ins
    seen = []
    monkeypatch.setattr(bench, "dg_prewarm", lambda cases: seen.extend(cases))
    bench.bench_gemm_fp8()
    bench.bench_gemm_fp8_grouped()
    assert [c["kind"] for c in seen] == ["normal"] * 2 + ["contiguous"] * 2 + ["masked", "wgrad"]
    bench_calls = list(deep_gemm.calls)
    deep_gemm.calls.clear()
    # a worker in this process: each case's call on random inputs passes the stand-in's layout checks and has the
    # shapes (and masked rows, expected_m) of the bench's own call, so the kernels it compiles are the bench's
    bench._dg_prewarm_worker(seen)
    warm = deep_gemm.calls
    assert len(warm) == len(seen)
    assert [c for c in bench_calls if c[0] == "fp8_gemm_nt"][::3] == warm[:2]
    contiguous = [c for c in bench_calls if c[0] == "m_grouped_fp8_gemm_nt_contiguous"]
    assert [contiguous[0], contiguous[3]] == warm[2:4]  # (even groups: a check and two timed runs; then uneven)
    assert [c for c in bench_calls if c[0] == "fp8_m_grouped_gemm_nt_masked"][0] == warm[4]
    assert [c for c in bench_calls if c[0] == "k_grouped_fp8_gemm_nt_contiguous"][0] == warm[5]


class FakePopen:
    launched = []

    def __init__(self, argv, stdout=None, stderr=None, text=None):
        self.argv, self.pid = argv, 4242
        self.cases = json.loads(argv[-1])
        FakePopen.launched.append(self)

    def communicate(self, timeout=None):
        out = "".join(f"ok {bench._dg_label(c)} 3.0s\n" if c.get("n") != 999 else
                      f"FAILED {bench._dg_label(c)}: RuntimeError: nvcc failed\n" for c in self.cases)
        self.returncode = 0
        return out, None


def test_prewarm_spreads_kernels_over_processes(monkeypatch, capsys):
    FakePopen.launched = []
    monkeypatch.setattr(bench.subprocess, "Popen", FakePopen)
    monkeypatch.setenv("CK_BENCH_DG_WORKERS", "2")
    cases = [dict(kind="normal", m=m, n=n, k=512) for m in (64, 128, 4096) for n in (256, 512)]
    cases.append(dict(kind="normal", m=64, n=999, k=512))
    bench.dg_prewarm(cases)
    procs = FakePopen.launched
    assert len(procs) == 2 and sorted(len(p.cases) for p in procs) == [3, 4]
    for p in procs:  # the shapes of one (N, K) go to one worker, in turn
        assert len({c["n"] for c in p.cases}) == len(p.cases) // 3 + (1 if len(p.cases) % 3 else 0)
        assert p.argv[:2] == [sys.executable, "-c"]
        compile(p.argv[2], "<worker>", "exec")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("DeepGEMM JIT prewarm: 6 of 7 shapes compiled or cached by 2 processes")
    assert out[1].startswith("  FAILED normal 64x999x512: RuntimeError: nvcc failed")
    monkeypatch.setenv("CK_BENCH_DG_WORKERS", "0")
    FakePopen.launched = []
    bench.dg_prewarm(cases)
    assert not FakePopen.launched


def test_layout_helpers():
    torch = FakeTorch()
    q, s = _quant_per_token(torch.randn(6, 256))
    s3 = s.view(2, 3, -1)  # ours for a masked case: [G * M] rows M-major as one
    mine = bench.dg_masked_scales(torch, s3)
    assert mine.stride() == (8, 1, 4) and np.array_equal(mine, s3)  # per group, column stride 3 -> 4
    x, sx = _quant_per_token(torch.randn(4, 384))
    flat, sflat = bench.dg_k_grouped_operand(torch, x, sx, [128, 0, 256])
    assert flat.shape == (4 * 384,) and sflat is sx
    assert np.array_equal(flat[:512].view(4, 128).astype(np.float32), x[:, :128].astype(np.float32))
    assert np.array_equal(flat[512:].view(4, 256).astype(np.float32), x[:, 128:].astype(np.float32))
    x, sx = _quant_per_token(torch.randn(5, 256))  # rows not a multiple of 4: the scales made M-major with stride 5
    _, s5 = bench.dg_k_grouped_operand(torch, x, sx, [256])
    assert s5.stride() == (1, 5) and np.array_equal(s5, sx)
    assert bench._rel_err([(_t([1.0, 2.0]), _t([1.0, 2.0]))]) == 0.0
    assert math.isclose(bench._rel_err([(_t([3.0, 4.0]), _t([0.0, 0.0])), (_t([1.0]), _t([2.0]))]), math.sqrt(26) / 2)
    assert math.isnan(bench._rel_err([(_t([np.nan]), _t([1.0]))]))
    assert bench._contiguous_ids([2, 0, 3], 4) == ([0, 0, -1, -1, 2, 2, 2, -1], [0, 4, 4])


# ---- the scripts that install DeepGEMM on the GPU machine ------------------------------------------------------

@pytest.fixture
def scripts(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    return importlib.import_module("deepgemm_env"), importlib.import_module("bench_deepgemm")


def test_bench_script_command(scripts):
    dge, script = scripts
    cmd = script.bench_command([], "/out")
    assert cmd[:4] == [sys.executable, "-m", "cudart_kernels", "bench"]
    assert cmd[4:] == ["--op", "gemm_fp8", "--op", "gemm_fp8_grouped", "--json", "/out/bench_fp8_deepgemm.json"]
    assert script.bench_command(["--quick", "--op", "gemm_fp8"], "/out")[4:] == [
        "--json", "/out/bench_fp8_deepgemm.json", "--quick", "--op", "gemm_fp8"]
    importlib.import_module("deepgemm_compat")  # the other user of the helper still imports


def test_survey_cases(scripts):
    survey = importlib.import_module("deepgemm_survey")
    got = survey.cases(3, 40, 10, 10)
    assert got == survey.cases(3, 40, 10, 10) and got != survey.cases(4, 40, 10, 10)
    assert [c["kind"] for c in got] == ["normal"] * 40 + ["contiguous"] * 10 + ["masked"] * 10
    for c in got:
        assert c["k"] % 128 == 0 and c["n"] % 64 == 0  # (shapes DeepGEMM takes)
        if c["kind"] == "normal":
            assert 1 <= c["m"] <= 6144
        elif c["kind"] == "contiguous":
            assert sum(c["rows"]) > 0 and min(c["rows"]) >= 0
        else:
            assert all(0 <= r <= c["max_m"] for r in c["masked"]) and c["expected_m"] >= 1
    assert {c["m"] <= 128 for c in got if c["kind"] == "normal"} == {True, False}
    assert callable(survey.run_case) and callable(survey.main)


def test_survey_runs_each_case_against_deepgemm(scripts, stand_ins, deep_gemm, monkeypatch, tmp_path, capsys):
    """The survey's cases, small, through the stand-ins: each kind compared and timed against DeepGEMM."""
    survey = importlib.import_module("deepgemm_survey")
    for name, value in (("LAYERS", [(256, 384)]), ("EXPERTS", [(128, 256)]), ("M_RANGES", [(1, 150)]),
                        ("EXPERT_COUNTS", [2, 3]), ("CONTIGUOUS_ROWS", (200, 400)), ("MASKED_M", [64])):
        monkeypatch.setattr(survey, name, value)
    torch, ours, timed = stand_ins
    out = tmp_path / "rows.json"
    args = types.SimpleNamespace(seed=5, normal=2, contiguous=2, masked=2, json=str(out))
    assert survey.survey(args) == 0
    rows = json.loads(out.read_text())
    assert [r["kind"] for r in rows] == ["normal"] * 2 + ["contiguous"] * 2 + ["masked"] * 2
    assert all(r["rel_diff"] < 1e-6 and r["ratio"] == pytest.approx(100.0 / 101.0) for r in rows)
    assert ours.calls.count("gemm_fp8") == 2 * 3  # the check, then the rotated sets (2 here)
    assert ours.calls.count("masked") == 2 * 2  # the check, then one set
    assert [c[0] for c in deep_gemm.calls].count("fp8_m_grouped_gemm_nt_masked") == 2 * 2
    assert "  masked       2 cases  0.990" in capsys.readouterr().out


def test_wheel_helper(scripts, tmp_path, monkeypatch):
    dge, _ = scripts
    monkeypatch.setattr(dge, "WHEELS", str(tmp_path / "none"))
    assert "no sgl_deep_gemm wheel" in dge.install(str(tmp_path / "site"))
    env = dge.environment("/tmp/site", base={"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(os.pathsep) == [dge.ROOT, "/tmp/site", "/x"]
    assert env["CUDA_HOME"] == "/usr/local/cuda" and env["DG_JIT_CACHE_DIR"] == "/tmp/dg_jit_cache"
    env["DG_JIT_CACHE_DIR"] = str(tmp_path / "cache_dir")
    (tmp_path / "cache_dir" / "cache" / "kernel.abc").mkdir(parents=True)
    (tmp_path / "cache_dir" / "cache" / "kernel.abc" / "kernel.cubin").write_bytes(b"\0")
    saved = dge.save_cache(env, str(tmp_path / "out"))
    assert saved == str(tmp_path / "out" / "dg_jit_cache.tgz") and dge.save_cache(env, None) is None
    env["DG_JIT_CACHE_DIR"] = str(tmp_path / "restored")
    assert dge.restore_cache(env, saved) == 1 and dge.restore_cache(env, str(tmp_path / "absent.tgz")) == 0
