"""Snapshots in the format of ``torch.cuda.memory._snapshot()``, so PyTorch's memory_viz opens them
(``python -m torch.cuda._memory_viz trace_plot snap.pickle -o out.html``).

Segments: the arena's two regions (main, small), each with its blocks in address order. History
(opt-in, ``record_memory_history``): the arena's own log (csrc/history.h) of every allocation
(``alloc``) and free (``free_completed``), each with one frame naming it. The runtime labels the
events it causes: an eviction's free (``pymem evict <op>``), a rematerialization's allocation
(``pymem rematerialize <op>``) and the two halves of a compaction move (``pymem compact <op>``).
"""
import pickle
from typing import Optional

_max_entries = 0  # > 0: record, keeping the newest this many events


def record_memory_history(enabled: bool = True, max_entries: int = 100_000, arena=None) -> None:
    """Start (or stop, ``enabled=False``) recording for ``memory_snapshot()``; keeps the newest
    ``max_entries`` events. Applies to ``arena`` (the active one) now and to every later one."""
    global _max_entries
    if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries <= 0:
        raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
    _max_entries = max_entries if enabled else 0
    if arena is not None:
        arena.set_history(_max_entries)


def recording() -> bool:
    return _max_entries > 0


def attach(arena) -> None:
    """A new arena records if history is on."""
    if _max_entries:
        arena.set_history(_max_entries)


def _event(action: str, addr: int, size: int, time_us: int, label: str) -> dict:
    name = label or ("alloc" if action == "alloc" else "free")
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us,
            "frames": [{"filename": "pymem", "line": 0, "name": name}]}


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
    trace = [_event(*e) for e in arena.history()]
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {}}


def dump_snapshot(arena, path: str) -> None:
    with open(path, "wb") as f:
        pickle.dump(memory_snapshot(arena), f)
