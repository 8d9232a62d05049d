"""Another version of the library imported beside this tree's, for same-process A/B scripts (host_ab.py,
gemm_pick_ab.py): `git archive BASE cudart_kernels ptx | tar -x -C /tmp/base`, then load_base("/tmp/base")."""
import importlib
import os
import shutil
import sys
import tempfile


def load_base(base_dir: str):
    """The base package as cudart_kernels_base (its imports within the package are relative), with its own ptx/
    beside it, and its gemm and driver modules loaded."""
    tmp = tempfile.mkdtemp()
    shutil.copytree(os.path.join(base_dir, "cudart_kernels"), os.path.join(tmp, "cudart_kernels_base"))
    shutil.copytree(os.path.join(base_dir, "ptx"), os.path.join(tmp, "ptx"))  # the base's kernels, found beside it
    sys.path.insert(0, tmp)
    for sub in ("ops.gemm", "runtime.driver", "runtime.compiler", "runtime.dtypes"):
        importlib.import_module("cudart_kernels_base." + sub)
    return importlib.import_module("cudart_kernels_base")
