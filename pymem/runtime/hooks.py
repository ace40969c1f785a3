"""How the runtime's arena becomes PyTorch's allocator (allocator="arena").

  CpuHook      ``csrc/hook_cpu``: the arena as PyTorch's CPU allocator (c10::SetCPUAllocator).
  CudaLibHook  ``libpymem_cuda.so`` as PyTorch's CUDA allocator (CUDAPluggableAllocator), taking
               its blocks from the arena (a block provider, ``csrc/hook_pluggable``): the arena's
               pressure handler runs the policy before a CUDA allocation goes through, and a
               refusal raises pymem.OutOfBudgetError from the op. PyTorch allows the swap only
               before CUDA initialises, and never back: it is done once per process, and after
               ``disable()`` the library passes requests straight to cudaMalloc / cudaFree. The
               arena is one cudaMalloc slab; compaction moves its blocks with device-to-device
               copies on the compacting thread's current stream (``move_stream``), so every kernel
               queued there before reads the old bytes and every one after the new.
               ``route="cpu"`` sends CPU tensors down the same path (the pluggable CPU hook) with
               the library on a fake CUDA table over host memory: the route's tests without a GPU.
"""
from typing import Optional

import torch

from .. import _C
from .. import cuda_lib

# The CUDA library serving PyTorch's CUDA allocations in this process (swapped in at most once).
_cuda_allocator_lib: Optional[cuda_lib.CudaLib] = None


def cuda_allocator_is_pymem() -> bool:
    """True once pymem's library is PyTorch's CUDA allocator in this process."""
    return _cuda_allocator_lib is not None


def check_cuda_order(device: str, allocator: str, cuda_initialized=None, swapped=None) -> None:
    """The arena replaces PyTorch's CUDA allocator, which PyTorch allows only before CUDA
    initialises, and only once: a clear error instead of a half-installed allocator, or a native
    cap on an allocator that ignores it. ``cuda_initialized`` / ``swapped``: None reads the process."""
    if not device.startswith("cuda"):
        return
    swapped = cuda_allocator_is_pymem() if swapped is None else swapped
    if allocator == "native":
        if swapped:
            raise RuntimeError(
                "allocator='native' caps PyTorch's CUDA caching allocator, but an earlier "
                "pymem.enable(allocator='arena') in this process replaced it with pymem's library, and "
                "PyTorch cannot swap it back; use allocator='arena', or a new process")
        return
    if swapped:  # the library is PyTorch's allocator already: a new arena plugs into it
        return
    initialized = torch.cuda.is_initialized() if cuda_initialized is None else cuda_initialized
    if initialized:
        raise RuntimeError(
            "pymem.enable() came after CUDA was initialised (a CUDA tensor or call ran first), and "
            "PyTorch's CUDA allocator can only be replaced before that. Call pymem.enable() at the top "
            "of the script, before any CUDA work, or start the unchanged script with PYMEM_BUDGET=<budget> "
            "in the environment (pymem then enables itself at interpreter start); or pass "
            "allocator='native' to keep PyTorch's caching allocator, capped at the budget.")


def _swap_cuda_allocator(lib: cuda_lib.CudaLib, cuda=torch.cuda) -> None:
    global _cuda_allocator_lib
    if _cuda_allocator_lib is not None:
        return
    check_cuda_order("cuda", "arena", cuda_initialized=cuda.is_initialized(), swapped=False)
    cuda.memory.change_current_allocator(cuda_lib.pluggable_allocator())
    _cuda_allocator_lib = lib


class CpuHook:
    """The arena as PyTorch's CPU allocator."""

    def prepare(self) -> None:
        pass

    def make_arena(self, budget: int):
        # The handler decides what to release (it refreshes block owners before any window search).
        return _C.Arena(budget, backing="host", search="handler")

    def install(self, arena) -> None:
        _C.install_cpu_hook(arena)

    def uninstall(self) -> None:
        _C.uninstall_cpu_hook()


class CudaLibHook:
    """The arena behind libpymem_cuda.so on device ``index`` (see the module docstring)."""

    def __init__(self, index: Optional[int], lib: Optional[cuda_lib.CudaLib] = None,
                 route: str = "cuda") -> None:
        """``index`` None: the current CUDA device, read once the allocator is swapped."""
        if route not in ("cuda", "cpu"):
            raise ValueError(f"route {route!r} is not one of 'cuda', 'cpu'")
        self.index = index
        self.lib = lib if lib is not None else cuda_lib.load()
        self.route = route

    def prepare(self) -> None:
        """Before anything touches CUDA: PyTorch's allocator becomes the library, passing requests
        through until ``install`` (so calibration's buffers stay out of the budget)."""
        devices = []
        if self.route == "cuda":
            _swap_cuda_allocator(self.lib)
            if self.index is None:
                self.index = torch.cuda.current_device()
            devices = range(torch.cuda.device_count())  # the library serves them all from now on
        for i in {self.index, *devices}:
            self.lib.set_provider(i, self.lib.passthrough_provider())

    def make_arena(self, budget: int):
        return _C.Arena(budget, backing="cuda", device=self.index, cuda_table=self.lib.runtime_table(),
                        search="handler")

    def move_stream(self) -> int:
        """The stream compaction's copies go on: the current one (the fake table's route: 0)."""
        return torch.cuda.current_stream(self.index).cuda_stream if self.route == "cuda" else 0

    def install(self, arena) -> None:
        _C.set_pluggable_relocation(*self.lib.relocation_points())
        self.lib.set_provider(self.index, _C.arena_block_provider(arena))
        if self.route == "cpu":
            _C.install_pluggable_cpu_hook(*self.lib.entry_points())

    def uninstall(self) -> None:
        if self.route == "cpu":
            _C.uninstall_pluggable_cpu_hook()
        self.lib.set_provider(self.index, self.lib.passthrough_provider())
