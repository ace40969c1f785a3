"""Kernels that went on with less memory than they asked for.

A refusal thrown through the CUDA library is c10's OutOfMemoryError (csrc/allocator_install.h,
ArenaRefusal), which some libraries catch to retry with less: cuDNN halves its workspace request and
runs a convolution plan that needs less. The kernel then succeeds, but on another algorithm than an
unmanaged run picks, so its results may differ in rounding; and cuDNN keeps the new plan for that
shape, so a value recomputed later may differ from the one first computed. Training goes on (PyTorch
does the same when cudaMalloc fails); pymem counts each such kernel and says so once per op.

The C++ side counts the refusals thrown on each thread (``_C.arena_refusals``): a kernel that
returns with that count moved went on after one. Read around every kernel the runtime runs: the
fast path's (csrc/fast_op.cpp), ``Runtime._kernel``, ``Runtime.run_again`` and recomputes.
"""
import warnings

from .. import _C

refusals_here = _C.arena_refusals


class KernelFallbacks:
    def __init__(self) -> None:
        self.count = 0
        self.recomputes = 0
        self._warned = set()

    def note(self, name: str, recompute: bool = False) -> None:
        """``name``'s kernel returned after a refusal on this thread (``recompute``: rerunning a
        released value)."""
        self.count += 1
        self.recomputes += recompute
        refusal = _C.take_last_refusal()
        if name in self._warned:
            return
        self._warned.add(name)
        asked = f"{refusal.requested} B" if refusal is not None else "memory"
        warnings.warn(
            f"pymem: {name} went on with less memory than it asked for: the budget could not hold its "
            f"{asked} (cuDNN then runs a convolution plan that needs a smaller workspace). Its results may "
            f"differ in rounding from an unmanaged run's, and a value recomputed later from the one first "
            f"computed. memory_stats()['num_kernel_fallbacks'] counts these; a budget that holds the request "
            f"keeps training bitwise.", RuntimeWarning, stacklevel=3)

    def stats(self) -> dict:
        return {"num_kernel_fallbacks": self.count, "num_kernel_fallbacks.recompute": self.recomputes}
