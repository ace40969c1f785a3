"""CPU kernels that keep the thread count they were given, so that a recompute reruns an op the way
its first run ran it.

MKL, by default (``MKL_DYNAMIC`` true), may run a GEMM on fewer threads than it was given, and a
GEMM whose inner dimension is split across threads sums in another order on one thread: the
demo's head weight gradient, (512, 1016) x (1016, 128), rounds otherwise with
``torch.set_num_threads(1)``. Under pymem, a value recomputed on fewer threads than its first run
would differ from the value it replaces. Intel's condition for run-to-run reproducibility is a
fixed thread count with MKL_DYNAMIC and OMP_DYNAMIC false (oneMKL developer guide,
"Reproducibility Conditions"). ``torch.set_num_threads`` already turns MKL's off; a program that
never calls it runs with it on, so this module sets both while pymem runs on the CPU.

This is not what made the demo's unmanaged run differ now and then under heavy load: the demo
calls ``torch.set_num_threads``, and that variation stays (README, Set up).

Reached through ctypes: PyTorch's CPU library exports MKL's service functions and loads libgomp. A
build without them (no MKL: ARM, some source builds) has nothing to fix here, and nothing is done.
"""
import ctypes
import functools
import os
from typing import Optional, Tuple

import torch


def _library(name: str) -> Optional[ctypes.CDLL]:
    path = os.path.join(os.path.dirname(torch.__file__), "lib", name)
    try:
        return ctypes.CDLL(path) if os.path.exists(path) else None
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def _switches():
    """(get, set) pairs for MKL's and OpenMP's dynamic thread adjustment that this torch has. MKL's
    C entry is ``MKL_Set_Dynamic`` (by value); the lowercase ``mkl_set_dynamic`` exported beside it is
    the Fortran one, which takes a pointer."""
    found = []
    mkl = _library("libtorch_cpu.so")
    if mkl is not None and hasattr(mkl, "mkl_serv_get_dynamic") and hasattr(mkl, "MKL_Set_Dynamic"):
        found.append((mkl.mkl_serv_get_dynamic, mkl.MKL_Set_Dynamic))
    omp = _library("libgomp.so.1")
    if omp is not None and hasattr(omp, "omp_get_dynamic") and hasattr(omp, "omp_set_dynamic"):
        found.append((omp.omp_get_dynamic, omp.omp_set_dynamic))
    return found


def dynamic_adjustment() -> Tuple[int, ...]:
    """Whether MKL and OpenMP may each adjust thread counts (1) or not (0), for the libraries found."""
    return tuple(int(get()) for get, _ in _switches())


def fix() -> Tuple[int, ...]:
    """Turn dynamic thread adjustment off; returns what it was, for ``restore``. Only the calling
    thread's OpenMP setting changes (OpenMP keeps it per thread); MKL's is the process's."""
    was = []
    for get, set_ in _switches():
        was.append(int(get()))
        set_(0)
    return tuple(was)


def restore(was: Tuple[int, ...]) -> None:
    for (_, set_), value in zip(_switches(), was):
        set_(value)
