"""Framework-native results on the GPU: every op called with torch, cupy and jax inputs and no `out=` returns that
framework's arrays (where it has the dtype and, for jax, the layout: README's table), runs on the framework's
current stream (a non-default one for torch and cupy; every launch's stream is recorded), and is correct against a
float64 reference on fresh random data. torch.cuda.graph captures gemm, quantize and gemm_fp8 without `out=` and
replays them on new inputs. (The dispatch itself, with fakes: tests/test_native_results.py.)"""
import contextlib

import ml_dtypes
import numpy as np
import pytest

import cudart_kernels as ck
from cudart_kernels import reference as ref
from cudart_kernels.ops.quantize import mmajor_stride
from cudart_kernels.runtime import dtypes as dt
from cudart_kernels.runtime import interop
from cudart_kernels.runtime.interop import DeviceArray
from cudart_kernels.runtime.launch import Launcher
from conftest import capture_graph

pytestmark = pytest.mark.gpu

BF16, FP16, E4M3 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(ml_dtypes.float8_e4m3fn)


def _rel(got, want):
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-3 * np.sqrt(want.size), 1e-30)


def _np(x) -> np.ndarray:
    """Any result (DeviceArray, torch, cupy, jax) as a host numpy array (ml_dtypes for bfloat16 / float8)."""
    if type(x) is DeviceArray:
        return x.numpy()
    root = type(x).__module__.split(".")[0]
    if root == "torch":
        import torch

        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).cpu().numpy().view(BF16)
        if x.dtype == torch.float8_e4m3fn:
            return x.view(torch.uint8).cpu().numpy().view(E4M3)
        return x.cpu().numpy()
    if root == "cupy":
        import cupy

        return cupy.asnumpy(x)
    return np.asarray(x)  # jax


# ---- the three frameworks ----------------------------------------------------------------------------------------

class Torch:
    name = "torch"
    half = BF16

    def __init__(self):
        self.torch = torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch without CUDA")

    def put(self, host: np.ndarray):
        torch = self.torch
        host = np.ascontiguousarray(host)
        if host.dtype == BF16:
            return torch.from_numpy(host.view(np.int16)).cuda().view(torch.bfloat16)
        if host.dtype == E4M3:
            return torch.from_numpy(host.view(np.uint8)).cuda().view(torch.float8_e4m3fn)
        return torch.from_numpy(host).cuda()

    def zeros(self, shape):
        return self.torch.zeros(shape, device="cuda", dtype=self.torch.float32)

    @contextlib.contextmanager
    def current_stream(self):
        """A fresh torch stream made current, kept busy first (a result read before it finishes would be wrong);
        yields its handle; synchronizes it (and only it) on the way out."""
        torch = self.torch
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.cuda._sleep(20_000_000)
            yield s.cuda_stream
        s.synchronize()

    def is_native(self, x, dtype, row_major=True) -> bool:
        return isinstance(x, self.torch.Tensor)


class Cupy:
    name = "cupy"
    half = FP16  # (no bfloat16 before cupy 14)

    def __init__(self):
        self.cp = pytest.importorskip("cupy")

    def put(self, host: np.ndarray):
        if not interop._cupy_has(self.cp, dt.as_dtype(host.dtype)):
            return DeviceArray.from_numpy(host)  # float8 (and bfloat16 before cupy 14): our arrays beside cupy's
        return self.cp.asarray(np.ascontiguousarray(host))

    def zeros(self, shape):
        return self.cp.zeros(shape, dtype=np.float32)

    @contextlib.contextmanager
    def current_stream(self):
        cp = self.cp
        cp.cuda.runtime.deviceSynchronize()  # the inputs were made on the null stream; ours does not wait for it
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            yield s.ptr
        s.synchronize()

    def is_native(self, x, dtype, row_major=True) -> bool:
        if interop._cupy_has(self.cp, dtype):
            return isinstance(x, self.cp.ndarray)
        return type(x) is DeviceArray


class Jax:
    name = "jax"
    half = BF16

    def __init__(self):
        self.jax = jax = pytest.importorskip("jax")
        if not any(d.platform == "gpu" for d in jax.devices()):
            pytest.skip("jax without GPU")

    def put(self, host: np.ndarray):
        x = self.jax.device_put(np.ascontiguousarray(host))
        if host.dtype == E4M3:
            try:
                interop.as_array(x)
            except (TypeError, BufferError, RuntimeError) as e:
                pytest.skip(f"this jax cannot export float8 through DLPack ({e})")
        return x

    def zeros(self, shape):
        pytest.skip("jax arrays are immutable: an op that adds into a given array (gemm_fp8_wgrad) has no jax form")

    @contextlib.contextmanager
    def current_stream(self):
        yield 0  # jax has no current stream to share: the legacy default stream

    def is_native(self, x, dtype, row_major=True) -> bool:
        if not row_major:  # jax imports row-major buffers only
            return type(x) is DeviceArray
        if dtype is dt.float8_e4m3:  # a jax whose DLPack import lacks float8 leaves a DeviceArray
            return isinstance(x, self.jax.Array) or type(x) is DeviceArray
        return isinstance(x, self.jax.Array)


FRAMEWORKS = {"torch": Torch, "cupy": Cupy, "jax": Jax}


@pytest.fixture(params=list(FRAMEWORKS))
def fw(request):
    return FRAMEWORKS[request.param]()


@pytest.fixture
def launch_streams(monkeypatch):
    """The stream of every kernel launch (Launcher.run is where they all go)."""
    seen = []
    run = Launcher.run

    def recording(self, grid, stream, args):
        seen.append(stream)
        return run(self, grid, stream, args)

    monkeypatch.setattr(Launcher, "run", recording)
    return seen


def _fp8_input(fw, rng, rows, k, per_block=False):
    """Host (e4m3, fp32 scales) quantized by the reference, and the framework's copies."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    q, s = ref.quantize_per_block(x) if per_block else ref.quantize_per_token(x)
    return q, s, fw.put(q), fw.put(s)


def _deq_rows(q, s):
    return q.astype(np.float64) * np.repeat(s.astype(np.float64), 128, axis=-1)[..., :q.shape[-1]]


def _deq_blocks(q, s):
    n, k = q.shape
    return q.astype(np.float64) * np.repeat(np.repeat(s.astype(np.float64), 128, 0), 128, 1)[:n, :k]


# ---- each op -------------------------------------------------------------------------------------------------------

def test_gemm(fw, rng, launch_streams):
    m, n, k = 200, 264, 512
    a_h, b_h = (rng.standard_normal(s).astype(fw.half) for s in ((m, k), (n, k)))
    a, b = fw.put(a_h), fw.put(b_h)
    with fw.current_stream() as h:
        d = ck.gemm(a, b)
        d32 = ck.gemm(a, b, out_dtype="float32")
    assert launch_streams and set(launch_streams) == {h}
    assert fw.is_native(d, dt.as_dtype(fw.half)) and fw.is_native(d32, dt.float32)
    want = a_h.astype(np.float64) @ b_h.astype(np.float64).T
    assert _np(d).shape == (m, n) and _np(d).dtype == fw.half
    assert _rel(_np(d).astype(np.float64), want) < 1e-2
    assert _rel(_np(d32).astype(np.float64), want) < 1e-4


def test_quantize(fw, rng, launch_streams):
    m, k = 203, 640
    x_h = ref.random_activations(rng, m, k, np.float32).astype(fw.half)
    x = fw.put(x_h)
    with fw.current_stream() as h:
        q, s = ck.quantize_fp8_per_token(x)
        q_r, s_r = ck.quantize_fp8_per_token(x, scale_layout="rowmajor")
        qw, sw = ck.quantize_fp8_per_block(x)
    assert launch_streams and set(launch_streams) == {h}
    assert fw.is_native(q, dt.float8_e4m3) and fw.is_native(s, dt.float32, row_major=False)
    assert fw.is_native(s_r, dt.float32) and fw.is_native(qw, dt.float8_e4m3) and fw.is_native(sw, dt.float32)
    if fw.name == "torch":
        assert tuple(s.stride()) == (1, mmajor_stride(m))  # the layout gemm_fp8 reads in place
    eq, es = ref.quantize_per_token(x_h)
    for qq, ss in ((q, s), (q_r, s_r)):
        assert np.array_equal(_np(qq).view(np.uint8), eq.view(np.uint8))
        assert np.array_equal(_np(ss), es)
    ew, ews = ref.quantize_per_block(x_h)
    assert np.array_equal(_np(qw).view(np.uint8), ew.view(np.uint8)) and np.array_equal(_np(sw), ews)


def test_gemm_fp8(fw, rng, launch_streams):
    m, n, k = 200, 384, 640
    qa, sa, a, a_s = _fp8_input(fw, rng, m, k)
    qb, sb, b, b_s = _fp8_input(fw, rng, n, k, per_block=True)
    with fw.current_stream() as h:
        d = ck.gemm_fp8(a, a_s, b, b_s)
    assert launch_streams and set(launch_streams) == {h}
    assert fw.is_native(d, dt.bfloat16)
    want = _deq_rows(qa, sa) @ _deq_blocks(qb, sb).T
    assert _np(d).shape == (m, n) and _rel(_np(d).astype(np.float64), want) < 1e-2


def test_gemm_fp8_grouped_contiguous(fw, rng, launch_streams):
    groups, n, k = 3, 256, 512
    ids = np.concatenate([np.zeros(100), -np.ones(28), np.full(256, 2)]).astype(np.int32)  # expert 1: no rows
    qa, sa, a, a_s = _fp8_input(fw, rng, len(ids), k)
    w = [ref.quantize_per_block(rng.standard_normal((n, k)).astype(np.float32)) for _ in range(groups)]
    qb, sb = np.stack([x[0] for x in w]), np.stack([x[1] for x in w])
    with fw.current_stream() as h:
        d = ck.gemm_fp8_grouped_contiguous(a, a_s, fw.put(qb), fw.put(sb), fw.put(ids))
    assert launch_streams and set(launch_streams) == {h}
    assert fw.is_native(d, dt.bfloat16)
    got, deq_a = _np(d).astype(np.float64), _deq_rows(qa, sa)
    for g in (0, 2):
        rows = ids == g
        want = deq_a[rows] @ _deq_blocks(qb[g], sb[g]).T
        assert _rel(got[rows], want) < 1e-2, g


def test_gemm_fp8_grouped_masked(fw, rng, launch_streams):
    groups, m, n, k = 2, 128, 256, 512
    masked = np.array([100, 37], np.int32)
    xa = rng.standard_normal((groups * m, k)).astype(np.float32)
    qa, sa = ref.quantize_per_token(xa)
    qa, sa = qa.reshape(groups, m, k), sa.reshape(groups, m, -1)
    w = [ref.quantize_per_block(rng.standard_normal((n, k)).astype(np.float32)) for _ in range(groups)]
    qb, sb = np.stack([x[0] for x in w]), np.stack([x[1] for x in w])
    with fw.current_stream() as h:
        d = ck.gemm_fp8_grouped_masked(fw.put(qa), fw.put(sa), fw.put(qb), fw.put(sb), fw.put(masked))
    assert launch_streams and set(launch_streams) == {h}
    assert fw.is_native(d, dt.bfloat16)
    got = _np(d).astype(np.float64)
    assert got.shape == (groups, m, n)
    for g in range(groups):
        want = _deq_rows(qa[g], sa[g]) @ _deq_blocks(qb[g], sb[g]).T
        assert _rel(got[g, :masked[g]], want[:masked[g]]) < 1e-2, g


def test_gemm_fp8_wgrad(fw, rng, launch_streams):
    """No output to allocate (D is added to); still the framework's current stream, and D returned as given."""
    ks, m, n = [128, 256, 0, 128], 136, 256
    qa, sa, a, a_s = _fp8_input(fw, rng, m, sum(ks))
    qb, sb, b, b_s = _fp8_input(fw, rng, n, sum(ks))
    d = fw.zeros((len(ks), m, n))
    with fw.current_stream() as h:
        res = ck.gemm_fp8_wgrad(a, a_s, b, b_s, d, ks)
    assert res is d and launch_streams and set(launch_streams) == {h}
    got, da, db = _np(d).astype(np.float64), _deq_rows(qa, sa), _deq_rows(qb, sb)
    offs = np.concatenate([[0], np.cumsum(ks)])
    for g in range(len(ks)):
        want = da[:, offs[g]:offs[g + 1]] @ db[:, offs[g]:offs[g + 1]].T
        if ks[g]:
            assert _rel(got[g], want) < 1e-2, g
        else:
            assert not got[g].any()


def test_attention_forward_and_backward(fw, rng, launch_streams):
    b, s, hq, hkv, d = 2, 300, 4, 2, 64
    q_h, do_h = (rng.standard_normal((b, s, hq, d)).astype(fw.half) for _ in range(2))
    k_h, v_h = (rng.standard_normal((b, s, hkv, d)).astype(fw.half) for _ in range(2))
    q, k, v, do = (fw.put(x) for x in (q_h, k_h, v_h, do_h))
    with fw.current_stream() as h:
        out, lse = ck.attention(q, k, v, causal=True, return_lse=True)
        dq, dk, dv = ck.attention_backward(do, q, k, v, out, lse, causal=True)
    assert launch_streams and set(launch_streams) == {h}
    half = dt.as_dtype(fw.half)
    assert fw.is_native(out, half) and fw.is_native(lse, dt.float32)
    assert all(fw.is_native(x, half) for x in (dq, dk, dv))
    o_ref, lse_ref = ref.attention(q_h, k_h, v_h, True)
    assert _rel(_np(out).astype(np.float64), o_ref) < 1e-2
    fin = np.isfinite(lse_ref)
    assert np.abs(_np(lse)[fin] - lse_ref[fin]).max() < 1e-3
    wants = ref.attention_backward(do_h, q_h, k_h, v_h, True)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), wants):
        assert _np(got).shape == want.shape and _rel(_np(got).astype(np.float64), want) < 2e-2, name


# ---- torch specifics -------------------------------------------------------------------------------------------

def test_torch_explicit_stream_allocates_and_runs_on_it(rng, launch_streams):
    fw = Torch()
    torch = fw.torch
    a_h, b_h = (rng.standard_normal(s).astype(BF16) for s in ((200, 512), (264, 512)))
    a, b = fw.put(a_h), fw.put(b_h)
    other = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(other):
        torch.cuda._sleep(20_000_000)
    d = ck.gemm(a, b, stream=other)  # torch's current stream is the default one: the result is made on `other`
    assert isinstance(d, torch.Tensor) and set(launch_streams) == {other.cuda_stream}
    other.synchronize()
    assert _rel(_np(d).astype(np.float64), a_h.astype(np.float64) @ b_h.astype(np.float64).T) < 1e-2


def test_torch_graph_capture_without_out(rng):
    """gemm (split-K: scratch inside the capture), quantize and gemm_fp8 with no `out=` inside torch.cuda.graph:
    their outputs come from the graph's pool; replays on new inputs give new, correct results."""
    fw = Torch()
    torch = fw.torch
    m, n, k = 200, 2048, 8192
    a, b = fw.put(rng.standard_normal((m, k)).astype(BF16)), fw.put(rng.standard_normal((n, k)).astype(BF16))
    x = fw.put(rng.standard_normal((m, k)).astype(BF16))
    wq, ws = ck.quantize_fp8_per_block(fw.put(rng.standard_normal((n, k)).astype(BF16)))
    assert isinstance(wq, torch.Tensor)

    def run():
        xq, xs = ck.quantize_fp8_per_token(x)
        return ck.gemm(a, b), ck.gemm_fp8(xq, xs, wq, ws)

    g, (d, d8) = capture_graph(torch, run)
    assert isinstance(d, torch.Tensor) and isinstance(d8, torch.Tensor)
    qw_h, sw_h = _np(wq), _np(ws)
    for _ in range(2):
        a_h, x_h = rng.standard_normal((m, k)).astype(BF16), rng.standard_normal((m, k)).astype(BF16)
        a.copy_(fw.put(a_h))
        x.copy_(fw.put(x_h))
        d.fill_(float("nan"))
        d8.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        b_h = _np(b).astype(np.float64)
        assert _rel(_np(d).astype(np.float64), a_h.astype(np.float64) @ b_h.T) < 1e-2
        xq_h, xs_h = ref.quantize_per_token(x_h)
        want = _deq_rows(xq_h, xs_h) @ _deq_blocks(qw_h, sw_h).T
        assert _rel(_np(d8).astype(np.float64), want) < 1e-2


def test_device_arrays_stay_device_arrays(rng, launch_streams):
    """numpy-only use is unchanged: DeviceArrays in, DeviceArrays out, the legacy default stream."""
    a_h, b_h = (rng.standard_normal(s).astype(BF16) for s in ((64, 256), (128, 256)))
    d = ck.gemm(DeviceArray.from_numpy(a_h), DeviceArray.from_numpy(b_h))
    q, s = ck.quantize_fp8_per_token(DeviceArray.from_numpy(a_h))
    assert type(d) is DeviceArray and type(q) is DeviceArray and type(s) is DeviceArray
    assert set(launch_streams) == {0}
    assert _rel(d.numpy().astype(np.float64), a_h.astype(np.float64) @ b_h.astype(np.float64).T) < 1e-2
