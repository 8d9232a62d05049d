import os
import tempfile

import numpy as np
import pytest

# Keep the test run's compiled kernels out of the user's cache unless the caller chose a directory.
os.environ.setdefault("CUDART_KERNELS_CACHE_DIR", os.path.join(tempfile.gettempdir(), "cudart-kernels-test-cache"))

from cudart_kernels.runtime.driver import gpu_available  # noqa: E402

HAS_GPU = gpu_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    return np.random.default_rng()  # fresh random data every run
