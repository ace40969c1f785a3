"""The public runtime API: enable, disable, stats."""
from typing import Optional, Union

import torch

from .runtime import Runtime

_current: Optional[Runtime] = None
_last_stats: dict = {}


def enable(budget: int, policy: str = "dtr", device: str = "cpu") -> Runtime:
    """Keep every tensor allocated from now on inside ``budget`` bytes, evicting and recomputing
    tensors under pressure. Tensors that exist already stay where they are (outside the budget).

    policy: one of ``pymem.policies.policy_names()`` (``dtr``, ``dtr-local``, ``lru``, ``size``,
    ``msps``, ``coop``). device: ``"cpu"``.
    """
    global _current
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"budget must be an int number of bytes, got {budget!r}")
    if budget <= 0:
        raise ValueError(f"budget must be a positive number of bytes, got {budget}")
    if _current is not None:
        raise RuntimeError("pymem is already enabled; call pymem.disable() first")
    rt = Runtime(budget, policy=policy, device=device)
    rt.start()
    _current = rt
    return rt


def disable() -> None:
    """Return to plain PyTorch: every evicted tensor is restored; all tensors stay valid."""
    global _current, _last_stats
    rt = _current
    if rt is None:
        return
    _current = None
    try:
        rt.stop()
    finally:
        _last_stats = rt.memory_stats()


def is_enabled() -> bool:
    return _current is not None


def current() -> Optional[Runtime]:
    """The active runtime, or None."""
    return _current


def memory_stats() -> dict:
    """Statistics of the active runtime (or of the last one, after ``disable``), named after
    ``torch.cuda.memory_stats``: ``allocated_bytes.current``, ``allocated_bytes.peak``,
    ``budget_bytes``, ``num_evictions``, ``num_rematerializations``, ``remat_seconds``, ..."""
    return _current.memory_stats() if _current is not None else dict(_last_stats)


def max_memory_allocated() -> int:
    return memory_stats().get("allocated_bytes.peak", 0)


def reset_peak_memory_stats() -> None:
    if _current is not None:
        _current.arena.reset_peak_memory_stats()


def evict(tensor: torch.Tensor) -> None:
    """Evict ``tensor``'s storage now; it is recomputed when next used."""
    if _current is None:
        raise RuntimeError("pymem is not enabled")
    _current.evict(tensor)


def is_evicted(tensor: torch.Tensor) -> bool:
    return _current is not None and _current.is_evicted(tensor)
