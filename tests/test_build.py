"""What the build promises: the CUDA library wherever a CUDA toolkit is installed, and the
extension built against the torch that was already there."""
import os
import shutil

import pytest
import torch

import pymem
from pymem import cuda_lib


def cuda_toolkit():
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    return next((h for h in homes if h and os.path.isfile(os.path.join(h, "include", "cuda_runtime_api.h"))), None)


def test_cuda_library_is_built_where_a_toolkit_is_installed():
    if cuda_toolkit() is None:
        pytest.skip("no CUDA toolkit on this machine: the build skips libpymem_cuda.so by design")
    path = cuda_lib.library_path()
    assert path and os.path.isfile(path), "a CUDA toolkit is installed but libpymem_cuda.so was not built"


def test_extension_and_errors_are_wired():
    assert pymem._C.HAS_TORCH_HOOK is True
    assert issubclass(pymem.OutOfBudgetError, torch.OutOfMemoryError)
    assert pymem._C.ALIGNMENT == 512 and pymem._C.DEFAULT_SMALL_THRESHOLD == 16 * 1024
