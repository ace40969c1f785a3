"""Checking that a run under pymem computed bitwise what the unmanaged run computed.

``torch.equal`` is not that check: NaN != NaN, so two identical runs whose values hold a NaN (an
``exp`` that overflowed, ``inf - inf``) compare unequal, and -0.0 == 0.0 hides a difference.
These helpers compare the bytes themselves.
"""
from typing import Iterable

import torch


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.contiguous().reshape(-1).view(torch.uint8)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs equal when their bits are)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def all_bitwise_equal(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> bool:
    """Pairwise bitwise_equal over two sequences of the same length."""
    a, b = list(a), list(b)
    return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))


def deterministic_cpu() -> None:
    """CPU kernels that keep their thread count for the rest of the process (MKL's and OpenMP's
    dynamic adjustment off, as ``torch.set_num_threads`` leaves MKL's), for the unmanaged runs a
    managed one is compared with (``pymem.runtime.fixed_threads``). pymem sets the same while it
    runs on the CPU; this is for the runs outside it."""
    from .runtime import fixed_threads

    fixed_threads.fix()


def deterministic_cuda() -> None:
    """CUDA kernels that give the same bits run after run, as a bitwise comparison of a managed run
    with an unmanaged one needs: deterministic algorithms (warnings only), no TF32, and the math
    attention kernel (float32 attention would run the memory-efficient one, whose backward adds with
    atomics: two unmanaged runs differ). cuBLAS also needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or
    ``:16:8``) in the environment before CUDA starts."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
