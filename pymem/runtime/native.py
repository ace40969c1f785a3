"""allocator="native": PyTorch's own allocator, capped at the budget. A request over the cap is
refused (an exception, nothing allocated); the runtime then releases values and runs the op again.

  CPU   ``csrc/hook_budget.cpp`` wraps PyTorch's CPU allocator; a refusal raises OutOfBudgetError
        carrying requested / budget / allocated bytes.
  CUDA  the caching allocator with ``torch.cuda.set_per_process_memory_fraction(budget / total)``;
        a refusal is ``torch.OutOfMemoryError`` (the allocator has already returned its cached
        blocks to the driver by then). cudagraphs and CUDA IPC keep working. The cap holds for
        *reserved* memory, so the caching allocator's own fragmentation counts against it.

Each cap answers ``deficit(error, round)``: the bytes to release before retrying a refused request.
The CUDA calls go through the ``cuda`` namespace given (``torch.cuda`` by default) so the logic is
tested on machines without a GPU.
"""
import gc
import re
from typing import Optional

import torch

from .. import _C

_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB|TiB)")


def requested_bytes(e: BaseException) -> Optional[int]:
    """The size a refused request asked for: the error's ``requested`` attribute (pymem), or the
    "Tried to allocate 20.00 MiB" of PyTorch's CUDA out-of-memory message; None if neither."""
    n = getattr(e, "requested", None)
    if n is not None:
        return int(n)
    m = _TRIED.search(str(e))
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


class CpuCap:
    """PyTorch's CPU allocator capped by ``csrc/hook_budget``."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def install(self) -> None:
        _C.install_budget_hook(self.budget)

    def uninstall(self) -> None:
        _C.uninstall_budget_hook()

    def stats(self) -> dict:
        return _C.budget_hook_stats()

    def reset_peak(self) -> None:
        _C.budget_hook_reset_peak()

    def deficit(self, e: BaseException, round: int) -> int:
        """What the refused request lacked (the hook's error carries its numbers)."""
        budget, allocated = getattr(e, "budget", None), getattr(e, "allocated", None)
        requested = requested_bytes(e)
        if None in (requested, budget, allocated):
            return 1
        return max(requested - (budget - allocated), 1)


class CudaCap:
    """The CUDA caching allocator capped with ``set_per_process_memory_fraction``."""

    def __init__(self, budget: int, device: torch.device, cuda=torch.cuda) -> None:
        if device.index is None:
            raise ValueError(f"CudaCap needs a device with an index (cuda:N), got {device}")
        self.budget = budget
        self.cuda = cuda
        self.index = device.index
        self._base_ooms = 0

    def install(self) -> None:
        total = self.cuda.get_device_properties(self.index).total_memory
        if self.budget > total:
            raise ValueError(f"budget {self.budget} B is more than cuda:{self.index}'s memory ({total} B); "
                             f"allocator='native' caps the caching allocator at a fraction of it")
        # The cap counts every byte the caching allocator holds, from before enable() too. Garbage
        # of an earlier run (a model in a reference cycle) held a budget's worth on an H100.
        if self.cuda.memory_reserved(self.index) > self.budget:
            gc.collect()
            self.cuda.empty_cache()
        held = self.cuda.memory_reserved(self.index)
        if held > self.budget:
            raise ValueError(f"allocator='native' caps what PyTorch's caching allocator holds on cuda:{self.index}, "
                             f"and tensors made before enable() hold {held} B there, more than the budget "
                             f"{self.budget} B; raise the budget, free them first, or use allocator='arena' "
                             f"(which counts only what is allocated after enable)")
        self.cuda.set_per_process_memory_fraction(self.budget / total, self.index)
        self.cuda.reset_peak_memory_stats(self.index)
        self._base_ooms = self.cuda.memory_stats(self.index).get("num_ooms", 0)

    def uninstall(self) -> None:
        self.cuda.set_per_process_memory_fraction(1.0, self.index)

    def stats(self) -> dict:
        s = self.cuda.memory_stats(self.index)
        return {
            "budget_bytes": self.budget,
            "allocated_bytes.current": s.get("allocated_bytes.all.current", 0),
            "allocated_bytes.peak": s.get("allocated_bytes.all.peak", 0),
            "reserved_bytes.current": s.get("reserved_bytes.all.current", 0),
            "reserved_bytes.peak": s.get("reserved_bytes.all.peak", 0),
            "num_allocs": s.get("allocation.all.allocated", 0),
            "num_frees": s.get("allocation.all.freed", 0),
            "num_refused": s.get("num_ooms", 0) - self._base_ooms,
        }

    def reset_peak(self) -> None:
        self.cuda.reset_peak_memory_stats(self.index)

    def deficit(self, e: BaseException, round: int) -> int:
        """What the request lacks against the cap, first; from the second round on, the whole
        request: freed tensors return to the allocator's cache, and only a wholly free segment
        goes back to the driver, so a retry may need more than the arithmetic says."""
        requested = requested_bytes(e) or 1
        if round > 0:
            return requested
        reserved = self.cuda.memory_reserved(self.index)
        return max(requested - (self.budget - reserved), 1)


def cap_for(device: torch.device, budget: int):
    """The native cap of ``device`` (``cpu`` or ``cuda[:N]``)."""
    return CudaCap(budget, device) if device.type == "cuda" else CpuCap(budget)
