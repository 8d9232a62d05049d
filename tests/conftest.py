import os
import tempfile

import numpy as np
import pytest

# Keep the test run's compiled kernels out of the user's cache unless the caller chose a directory.
os.environ.setdefault("CUDART_KERNELS_CACHE_DIR", os.path.join(tempfile.gettempdir(), "cudart-kernels-test-cache"))

from cudart_kernels.runtime.driver import gpu_available  # noqa: E402

HAS_GPU = gpu_available()


def pytest_collection_modifyitems(config, items):
    shard = os.environ.get("CK_TEST_SHARD")  # "k/n": run every n-th test from the k-th (scripts/gpu_check.sh)
    if shard:
        k, n = map(int, shard.split("/"))
        config.hook.pytest_deselected(items=[t for i, t in enumerate(items) if i % n != k])
        items[:] = items[k::n]
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def capture_graph(torch, run):
    """Warm `run()` up on a side stream (plans, kernels, scratch), as torch.cuda.graph asks, then capture it on the
    current device: (the graph, what the captured `run()` returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    return g, out


@pytest.fixture
def rng():
    return np.random.default_rng()  # fresh random data every run
