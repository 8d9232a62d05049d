"""cudart_kernels.torch on meta tensors (no GPU needed, torch needed): the ops' schemas, the fake implementations'
shapes, dtypes and strides, the autograd formulas' shapes, and torch.compile(fullgraph=True) tracing them without a
graph break."""
import pytest

torch = pytest.importorskip("torch")

import cudart_kernels.torch as ckt  # noqa: E402

META = "meta"


def _t(*shape, dtype=torch.bfloat16, grad=False):
    return torch.empty(*shape, dtype=dtype, device=META, requires_grad=grad)


def test_fake_implementations():
    a, b = _t(256, 512), _t(128, 512)
    assert ckt.gemm(a, b).shape == (256, 128)
    assert ckt.gemm(a, _t(512, 96), b_layout="kn", out_dtype=torch.float32).dtype == torch.float32
    q, s = ckt.quantize_fp8_per_token(_t(250, 512))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (250, 4) and s.stride() == (1, 252)
    qw, sw = ckt.quantize_fp8_per_block(_t(300, 512))
    assert qw.shape == (300, 512) and sw.shape == (3, 4)
    assert ckt.gemm_fp8(q, s, qw, sw).shape == (250, 300)
    assert ckt.attention(_t(2, 100, 4, 64), _t(2, 90, 2, 64), _t(2, 90, 2, 64)).shape == (2, 100, 4, 64)


@pytest.mark.parametrize("layout,b_shape", [("nk", (96, 256)), ("kn", (256, 96))])
@pytest.mark.parametrize("m", [128, 130])
def test_gemm_gradient_shapes(layout, b_shape, m):
    a, b = _t(m, 256, grad=True), _t(*b_shape, grad=True)
    ckt.gemm(a, b, b_layout=layout).float().sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape


def test_compiled_blocks_have_no_graph_break():
    qw, sw = ckt.quantize_fp8_per_block(_t(512, 256))
    w2 = _t(256, 512)

    def mlp(x):
        q, s = ckt.quantize_fp8_per_token(x)
        return ckt.gemm(torch.nn.functional.gelu(ckt.gemm_fp8(q, s, qw, sw)), w2)

    assert torch.compile(mlp, fullgraph=True, backend="aot_eager")(_t(64, 256)).shape == (64, 256)

    def attn_loss(q, k, v):
        return ckt.attention(q, k, v, causal=True).float().square().mean()

    q, k = _t(2, 128, 4, 64, grad=True), _t(2, 128, 2, 64, grad=True)
    torch.compile(attn_loss, fullgraph=True, backend="aot_eager")(q, k, k).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
