"""pymem: a runtime tensor memory manager for PyTorch.

This layer exposes the arena (``pymem.Arena``), the CPU allocator hook, and the CUDA library's
location. The runtime (eviction and rematerialization) builds on it.
"""
from typing import Optional

import torch  # noqa: F401  (loads libc10, which _C links against)

from . import _C
from ._C import Arena, Block, Victim, Window
from .errors import OutOfBudgetError
from .api import (budget, current, disable, dump_snapshot, enable, evict, is_enabled, is_evicted,
                  manage_thread, max_memory_allocated, memory_snapshot, memory_stats, memory_summary, no_recompute, pin, step, step_trace,
                  pinned,
                  record_memory_history, reset_peak_memory_stats, unpin)
from .budget import parse_budget

__version__ = "0.1.0"

_C._set_out_of_budget_error(OutOfBudgetError)


def install_cpu_hook(arena: Arena) -> None:
    """Make ``arena`` (a ``backing="host"`` Arena) PyTorch's CPU allocator.

    Tensors allocated before keep their own deleters and stay valid.
    """
    _C.install_cpu_hook(arena)


def uninstall_cpu_hook() -> None:
    """Give PyTorch back its own CPU allocator; tensors made under the hook stay valid."""
    _C.uninstall_cpu_hook()


def cpu_hook_arena() -> Optional[Arena]:
    """The arena installed as the CPU allocator, or None."""
    return _C.cpu_hook_arena()


__all__ = ["enable", "disable", "budget", "is_enabled", "current", "memory_stats", "memory_summary",
           "max_memory_allocated", "reset_peak_memory_stats", "parse_budget", "memory_snapshot", "dump_snapshot",
           "record_memory_history", "evict", "is_evicted", "pin", "unpin", "pinned", "manage_thread", "no_recompute", "step", "step_trace", "Arena", "Block", "Victim", "Window", "OutOfBudgetError", "install_cpu_hook",
           "uninstall_cpu_hook", "cpu_hook_arena", "__version__"]
