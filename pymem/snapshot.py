"""Snapshots in the format of ``torch.cuda.memory._snapshot()``, so PyTorch's memory_viz opens them
(``python -m torch.cuda._memory_viz trace_plot snap.pickle -o out.html``).

Segments: the arena's two regions (main, small), each with its blocks in address order. History
(opt-in, ``record_memory_history``): the runtime's own events — evictions (``free_completed``),
rematerializations (``alloc``) and compaction moves (a ``free_completed`` and an ``alloc``) — each with
one frame naming what happened and the op that produced the value. Plain allocations and frees are
not recorded yet.
"""
import pickle
import time
from typing import List, Optional

_history: Optional[List[dict]] = None
_max_entries = 0


def record_memory_history(enabled: bool = True, max_entries: int = 100_000) -> None:
    """Start (or stop, ``enabled=False``) recording pymem's events for ``memory_snapshot()``;
    keeps the newest ``max_entries``."""
    global _history, _max_entries
    if not isinstance(max_entries, int) or max_entries <= 0:
        raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
    _history = [] if enabled else None
    _max_entries = max_entries


def record(action: str, addr: int, size: int, what: str) -> None:
    """Called by the runtime; a no-op unless history is on."""
    h = _history
    if h is None:
        return
    h.append({"action": action, "addr": addr, "size": size, "stream": 0,
              "time_us": int(time.time() * 1e6),
              "frames": [{"filename": "pymem", "line": 0, "name": what}]})
    if len(h) > _max_entries:
        del h[: len(h) - _max_entries]


def recording() -> bool:
    return _history is not None


def _segment(blocks, region: str) -> Optional[dict]:
    bs = [b for b in blocks if b.region == region]
    if not bs:
        return None
    out = [{"address": b.addr, "size": b.size, "requested_size": b.requested if b.allocated else 0,
            "state": "active_allocated" if b.allocated else "inactive", "frames": []} for b in bs]
    allocated = sum(b.size for b in bs if b.allocated)
    return {"device": 0, "address": bs[0].addr, "total_size": sum(b.size for b in bs),
            "allocated_size": allocated, "active_size": allocated,
            "requested_size": sum(b.requested for b in bs if b.allocated), "stream": 0,
            "segment_type": "large" if region == "main" else "small", "segment_pool_id": (0, 0),
            "is_expandable": False, "frames": [], "blocks": out}


def memory_snapshot(arena) -> dict:
    blocks = arena.blocks()
    segments = [s for s in (_segment(blocks, "main"), _segment(blocks, "small")) if s is not None]
    return {"segments": segments, "device_traces": [list(_history or [])], "allocator_settings": {}}


def dump_snapshot(arena, path: str) -> None:
    with open(path, "wb") as f:
        pickle.dump(memory_snapshot(arena), f)
