"""cuTensorMapEncodeTiled's documented rules, checked in Python (CPU); encoding itself on the GPU."""
import pytest

from cudart_kernels.runtime.tensormap import AddressedMapCache, check_tensor_map, encode_tensor_map

OK = dict(dtype="bf16", address=0x10000, dims=[4096, 512], strides=[8192], box=[64, 128], swizzle=128)


def test_valid_map_passes():
    check_tensor_map(**OK)


@pytest.mark.parametrize("change,rule", [
    (dict(dims=[1] * 6, strides=[16] * 5, box=[8] * 6), "rank must be 1..5"),
    (dict(address=0x10008), "16-byte aligned"),
    (dict(strides=[8200]), "multiple of 16"),
    (dict(strides=[2**40]), r"\(0, 2\^40\)"),
    (dict(box=[64, 257]), r"box\[1\]=257 must be in 1..256"),
    (dict(box=[4, 128]), "inner box extent 8 bytes must be a multiple of 16"),
    (dict(box=[128, 64]), "exceeds the 128-byte swizzle span"),
    (dict(swizzle=48), "swizzle must be one of"),
    (dict(dims=[0, 512]), r"dims\[0\]=0"),
    (dict(strides=[]), "need rank-1"),
    (dict(box=[64]), "box needs 2 entries"),
    (dict(dtype="float64"), "unknown dtype|unsupported"),
])
def test_rule_violations_name_the_rule(change, rule):
    with pytest.raises((ValueError, TypeError), match=rule):
        check_tensor_map(**{**OK, **change})


def test_swizzle_none_allows_wide_inner_box():
    check_tensor_map(**{**OK, "box": [128, 64], "swizzle": 0})


@pytest.mark.gpu
def test_encode_and_repoint_on_gpu():
    from cudart_kernels.runtime import DeviceArray

    a = DeviceArray.empty((512, 4096), "bf16")
    m = encode_tensor_map("bf16", a.ptr, [4096, 512], [8192], [64, 128])
    raw = m.bytes()
    assert len(raw) == 128 and raw != bytes(128)
    b = DeviceArray.empty((512, 4096), "bf16")
    before = m.bytes()
    m.repoint(b.ptr)
    assert m.base == b.ptr and m.bytes() != before
    fresh = encode_tensor_map("bf16", b.ptr, [4096, 512], [8192], [64, 128])
    assert fresh.bytes() == m.bytes()  # re-pointing equals re-encoding
    layout = ("bf16", (4096, 512), (8192,), (64, 128), 128)
    cache = AddressedMapCache()
    m1 = cache.get(layout, a.ptr)
    assert cache.get(layout, a.ptr) is m1 and m1.base == a.ptr  # same layout object and address: a hit
    equal = tuple(layout)  # an equal layout, another object (another plan's): its own entry, the same bytes
    other = cache.get(("bf16",) + layout[1:], a.ptr)
    assert other is not m1 and other.bytes() == m1.bytes() and equal == layout
    m2 = cache.get(layout, b.ptr)  # another address: another map
    assert m2 is not m1 and m2.base == b.ptr and m2.bytes() == fresh.bytes()
