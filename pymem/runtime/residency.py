"""Which values are in memory: releasing one (evicted, or offloaded through ``swap.py``), bringing one
back, the values recomputed only as inputs (the cache), DTR's evicted neighbourhood, and pins.

Records read this (``Record.home``), not the runtime: a policy scoring a value asks its home for the
evicted neighbourhood, what is available, and the cost of a host copy.

Invariants: a record is *available* when its value is in memory, in its own storage (not evicted, the
storage alive) or in the cache. A record is in the neighbourhood (and in ``gone``) from the moment its
value leaves memory until it comes back; only the policies that ask (``uses_neighbourhood``) pay for it.
A pinned record (``pins > 0``) is never released, and the backend keeps its block from moving.
"""
import weakref
from typing import Dict, Optional

from .. import _C
from ..errors import OutOfBudgetError
from ..policies import EvictedNeighbourhood
from .records import Record


class Residency:
    def __init__(self, backend, uses_neighbourhood: bool, link_bandwidth: float) -> None:
        self.backend = backend
        self.uses_neighbourhood = uses_neighbourhood
        self.link_bandwidth = link_bandwidth  # bytes/s of a host copy (Record.swap_cost)
        self.swap = None  # the Swapper, when values may be offloaded
        self.offload_leaves = False  # values with no recipe may be released too (offloaded only)
        self.plan = None  # the step trace, when it plans each step from the last (Record.next_use)
        self.verify = None  # verify=True: a RestoreCheck (verify.py) sees every release and return
        # Values recomputed only as inputs (no storage of their own): record -> (StorageRef, tensor).
        self.cache: Dict[Record, tuple] = {}
        self.neighbourhood = EvictedNeighbourhood()
        # Records in the neighbourhood, weakly: one no recipe needs any more dies, and the next
        # rebuild leaves it out (union-find cannot delete, so it is rebuilt when mostly stale).
        self.gone: "weakref.WeakValueDictionary[int, Record]" = weakref.WeakValueDictionary()
        self.pin_counts: Dict[str, int] = {}  # pins made, by why (raw_access.py, pymem.pin)
        self.num_evictions = 0
        self.evicted_bytes = 0
        self.num_rematerializations = 0
        self.remat_seconds = 0.0

    def is_available(self, r: Record) -> bool:
        if r in self.cache:
            return True
        s = r.sref
        return s is not None and not r.evicted and s.alive

    # ------------------------------------------------------------------ release
    def leaf_releasable(self, r: Record) -> bool:
        """Whether leaf r (no recipe) could leave memory now (the caller checks locks, pins and
        waits; a value with a recipe always can): leaves are offloaded and the host pool has room
        for it. A leaf's return costs its copy only: that is its cost for the policy, set here."""
        if not self.offload_leaves or not self.swap.host.fits(r.nbytes):
            return False
        r.compute_cost = 2 * r.nbytes / self.link_bandwidth  # out and back: Record.swap_cost twice
        return True

    def leaf_rule(self):
        """leaf_releasable as the C++ scans take it (csrc/release_scan.h, leaf_may_go): None where
        no leaf goes; the host link's bytes/s where every leaf goes (the host pool has no cap),
        so that no scan calls back into Python for each leaf; else leaf_releasable itself."""
        if not self.offload_leaves:
            return None
        if not self.swap.host.capped:
            return float(self.link_bandwidth)
        return self.leaf_releasable

    def release(self, r: Record) -> None:
        """Free one value's buffer now: offloaded (a host copy brings it back) if it has a host copy
        already or the director says so, else evicted (it stays recomputable). A leaf is always
        offloaded (it has no recipe)."""
        cached = self.cache.get(r)
        s = cached[0] if cached is not None else r.sref
        if self.plan is not None:
            self.plan.note_release(r)  # the next step's plan releases it early (csrc/step_plan.h)
        swap = self.swap
        if swap is not None:
            swap.settle_out(r)  # however r goes, a copy out ahead reads its buffer
        if self.verify is not None:
            self.verify.left(r, s)
        if r.recipe is None:
            if swap is None or not swap.copy_out(r, s):
                raise OutOfBudgetError(
                    f"pymem: {r.op} ({r.nbytes} B, no recipe) can only be offloaded, and the host pool has no "
                    f"room: {swap.host.describe() if swap is not None else 'offloading is off'}. Raise host_budget.")
            offload = True
        else:
            # A host copy already made (an earlier offload, a copy out ahead) brings it back, whatever
            # the director would say of a new one: an offload that copies nothing.
            offload = swap is not None and (r.host is not None or swap.wants_offload(r)) and \
                swap.copy_out(r, s)
        history = self.backend.history()
        if history is not None:
            history.label_next_free(s.data_ptr, f"pymem {'offload' if offload else 'evict'} {r.op}")
        if cached is not None:
            nbytes = r.nbytes
            del self.cache[r]
        else:
            nbytes = r.sref.evict()
            r.evicted = True
        if not offload:
            self.evicted_bytes += nbytes
            self.num_evictions += 1
            self.mark_gone(r)

    def mark_gone(self, r: Record) -> None:
        """r's value left memory (evicted, or its last tensor died): it joins DTR's evicted neighbourhood."""
        if self.uses_neighbourhood and not self.neighbourhood.is_evicted(r.id):
            self.neighbourhood.on_evict(r.id, r.compute_cost, r.neighbour_ids())
            self.gone[r.id] = r

    def rebuild_neighbourhood(self) -> None:
        """Union-find cannot forget: rebuild it from the records still gone once it is mostly stale."""
        nb = self.neighbourhood
        if len(nb) > 4 * (len(self.gone) + 64):
            self.neighbourhood = EvictedNeighbourhood()
            for r in sorted(self.gone.values(), key=lambda r: r.id):
                if nb.is_evicted(r.id):
                    self.neighbourhood.on_evict(r.id, r.compute_cost, r.neighbour_ids())

    # ------------------------------------------------------------------ bring back
    def bring_back(self, r: Record, tensor, now: float, how: str = "rematerialize") -> None:
        """r's value is in ``tensor`` (recomputed, or copied back): moved into r's own storage if a
        tensor still holds it, else kept in the cache for the recipes that read it."""
        if self.verify is not None:
            self.verify.back(r, tensor, how)
        if self.plan is not None:
            self.plan.note_back(r)  # a recompute's input back early: the plan does not release it early
        sref = r.sref
        if sref is not None and r.evicted and sref.alive:
            sref.adopt(tensor)
            r.evicted = False
            r.in_arena = self.backend.releasable(sref.data_ptr, r.nbytes)  # a small value may change region
            self.on_back(r, now, how=how)
            return
        ref = _C.StorageRef(tensor)
        if ref.nbytes != r.nbytes:
            raise RuntimeError(f"pymem: {how} {r.op} gave {ref.nbytes} B, the original held {r.nbytes} B")
        self.cache[r] = (ref, tensor)
        self.on_back(r, now, ref, how)

    def on_back(self, r: Record, now: float, sref=None, how: str = "rematerialize") -> None:
        """r's value is back (``how``: rematerialize, swap in, prefetch), in its own storage or
        (``sref``) in the cache."""
        history = self.backend.history()
        if history is not None:
            s = sref if sref is not None else r.sref
            history.label_last_alloc(s.data_ptr, f"pymem {how} {r.op}")
        r.last_access = now
        self.forget(r)

    def forget(self, r: Record) -> None:
        """r's value is back in memory (or no longer recomputable): it leaves the evicted neighbourhood."""
        if self.neighbourhood.is_evicted(r.id):
            self.neighbourhood.on_rematerialize(r.id)

    def count_remat(self, seconds: float) -> None:
        self.num_rematerializations += 1
        self.remat_seconds += seconds

    # ------------------------------------------------------------------ pins
    def add_pins(self, r: Record, n: int, reason: str) -> None:
        self.set_pins(r, r.pins + n)
        self.pin_counts[reason] = self.pin_counts.get(reason, 0) + 1

    def set_pins(self, r: Record, pins: int) -> None:
        """The backend's block is pinned too: compaction refuses it, and pinned_bytes counts it."""
        if (r.pins > 0) != (pins > 0) and r.sref is not None:
            self.backend.set_pinned(r.sref.data_ptr, pins > 0)
        r.pins = pins

    def hand_over_pins(self, old: Record, new: Record) -> None:
        """``new`` holds the storage's next value (an in-place op, a regrow): a pin is the storage's,
        whichever value it holds, and so is a data_ptr() pin."""
        pins, old.pins = old.pins, 0
        new.address_out, old.address_out = old.address_out, False
        self.set_pins(new, pins)

    def stats(self) -> dict:
        return {
            "num_evictions": self.num_evictions,
            "evicted_bytes": self.evicted_bytes,
            "num_rematerializations": self.num_rematerializations,
            "remat_seconds": self.remat_seconds,
            "num_verified_restores": self.verify.num_verified if self.verify is not None else 0,
        }
