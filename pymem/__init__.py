"""pymem: a runtime tensor memory manager for PyTorch.

``import pymem`` costs nothing until a name is used: the startup hook (``pymem._startup``) imports
the package in every process that has ``PYMEM_BUDGET`` set, most of which never touch a tensor.
Each public name is loaded from its module on first use (PEP 562). Every module that needs torch
has torch imported before it is looked for (``pymem.import_hook.import_first``); ``pymem._C``, the
extension, gets pymem's error type right after it loads.
"""
import importlib
import sys
from typing import Optional

from . import budget as _budget_module  # torch-free; loaded now so that its import never rebinds
from .import_hook import import_first, when_imported

del budget  # ``pymem.budget`` is the context manager of ``pymem.api``, not the module of that name

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    **dict.fromkeys(["budget", "current", "disable", "dump_snapshot", "enable", "evict", "is_enabled",
                     "is_evicted", "manage_thread", "max_memory_allocated", "memory_snapshot", "memory_stats",
                     "memory_summary", "no_recompute", "pin", "pinned", "record_memory_history",
                     "reset_peak_memory_stats", "step", "step_trace", "unpin"], "api"),
    **dict.fromkeys(["Arena", "Block", "Victim", "Window"], "_C"),
    "OutOfBudgetError": "errors",
    "RestoreMismatchError": "errors",
    "parse_budget": "budget",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        if name.startswith("__"):
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        try:  # a submodule not imported yet: ``pymem.policies``, ``from . import _C``
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


def _register_errors() -> None:
    from .errors import OutOfBudgetError

    sys.modules[f"{__name__}._C"]._set_out_of_budget_error(OutOfBudgetError)


# Torch comes before every module of pymem that needs it (_C links against libtorch): then no module
# of pymem is half-run when the startup hook enables pymem at torch's import. These need no torch.
_TORCH_FREE = frozenset(f"{__name__}.{m}" for m in ("__main__", "_startup", "budget", "choices", "cli",
                                                      "import_hook", "policies", "profile"))
import_first(__name__, "torch", _TORCH_FREE)
when_imported(f"{__name__}._C", _register_errors)


def install_cpu_hook(arena) -> None:
    """Make ``arena`` (a ``backing="host"`` Arena) PyTorch's CPU allocator.

    Tensors allocated before keep their own deleters and stay valid.
    """
    from . import _C

    _C.install_cpu_hook(arena)


def uninstall_cpu_hook() -> None:
    """Give PyTorch back its own CPU allocator; tensors made under the hook stay valid."""
    from . import _C

    _C.uninstall_cpu_hook()


def cpu_hook_arena() -> Optional["Arena"]:
    """The arena installed as the CPU allocator, or None."""
    from . import _C

    return _C.cpu_hook_arena()


__all__ = ["enable", "disable", "budget", "is_enabled", "current", "memory_stats", "memory_summary",
           "max_memory_allocated", "reset_peak_memory_stats", "parse_budget", "memory_snapshot", "dump_snapshot",
           "record_memory_history", "evict", "is_evicted", "pin", "unpin", "pinned", "manage_thread", "no_recompute",
           "step", "step_trace", "Arena", "Block", "Victim", "Window", "OutOfBudgetError", "RestoreMismatchError",
           "install_cpu_hook", "uninstall_cpu_hook", "cpu_hook_arena", "__version__"]
