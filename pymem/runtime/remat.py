"""Rematerialization: make evicted values resident again by replaying their missing ancestry forward
(no recursion: chains are deep; an offloaded value is one step, its copy back, whatever its
ancestry), and invalidate recipes whose leaf input is about to be overwritten.

Values recomputed only as inputs of others (their storage is dead: no user tensor holds them) are
kept in ``rt.cache`` as ordinary evictable values, so restoring a run of neighbours (backward through
an evicted region) does not recompute the shared chain again for each one.
"""
import time
import weakref
from typing import Callable, Iterable, List, Optional

import torch

from .. import _C
from .. import restore_order
from ..errors import OutOfBudgetError
from .fallbacks import refusals_here
from .records import Record, Slot

_THRASH_FACTOR = 4   # a restore's recomputes per value it could need, before it gives up


class _Budget:
    """Recompute count of one top-level restore: one that keeps recomputing what pressure took back
    from it is thrashing, and raises instead of looping."""

    __slots__ = ("target", "count", "limit")

    def __init__(self, rt, target: Record) -> None:
        self.target, self.count = target, 0
        self.limit = _THRASH_FACTOR * (len(rt.table) + len(rt.cache) + 64)

    def tick(self) -> None:
        self.count += 1
        if self.count > self.limit:
            t = self.target
            raise OutOfBudgetError(
                f"pymem: restoring {t.op} ({t.nbytes} B) thrashes: {self.count} recomputes and counting, each "
                f"releasing values the restore still needs. Raise the budget.")


def restore(rt, records: Iterable[Record]) -> None:
    """Make every record resident in its own storage (recomputing what is missing): their missing
    ancestry replayed forward (pymem/restore_order.py)."""
    targets = [r for r in records if not rt.residency.is_available(r)]
    if targets:
        restore_order.replay(_RecordValues(rt), targets, _Budget(rt, targets[0]).tick)


class _RecordValues(restore_order.Values):
    """Records, as the restore order sees them."""

    __slots__ = ("rt",)

    def __init__(self, rt) -> None:
        self.rt = rt

    def available(self, r: Record) -> bool:
        return self.rt.residency.is_available(r)

    def copied(self, r: Record) -> bool:
        return r.host is not None

    def inputs(self, r: Record):
        return r.recipe.input_records() if r.recipe is not None else None

    def key(self, r: Record) -> int:
        return r.id

    def unrecoverable(self, r: Record) -> Exception:
        return RuntimeError(f"pymem: {r.op} output ({r.nbytes} B) is needed again but cannot be "
                            f"recomputed: {r.lost or 'it has no recipe and its storage is gone'}")

    def bring_back(self, r: Record) -> None:
        _recompute(self.rt, r)

    def thrashing(self, t: Record, nesting: int) -> Exception:
        return OutOfBudgetError(f"pymem: restoring {t.op} ({t.nbytes} B) thrashes: {nesting} nested restores, "
                                f"each for a value released while still needed. Raise the budget.")


class _Base:
    """A storage to cut argument views from; ``keep`` holds a private copy alive."""

    __slots__ = ("sref", "keep")

    def __init__(self, sref, keep=None) -> None:
        self.sref, self.keep = sref, keep


def _base_of(rt, rec: Record, private: bool) -> _Base:
    cached = rt.cache.get(rec)
    if cached is not None:
        if private:  # the op will write it: take it out of the cache so no one else reads the result
            del rt.cache[rec]
        return _Base(cached[0], cached[1])
    if private:  # a resident value the op would write: work on a copy
        copy = rt.allocating(_clone, rec.sref.strong())
        return _Base(_C.StorageRef(copy), copy)
    return _Base(rec.sref)


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


def _blank(nbytes: int, device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _fill(template, tensors):
    if isinstance(template, Slot):
        return tensors[template.i]
    if isinstance(template, (list, tuple)):
        return type(template)(_fill(x, tensors) for x in template)
    if isinstance(template, dict):
        return {k: _fill(v, tensors) for k, v in template.items()}
    return template


def _recompute(rt, r: Record) -> None:
    if r.host is not None:  # offloaded: its copy, not its recipe
        buf, how = rt.swap.copy_in(r)
        rt.residency.bring_back(r, buf, rt.clock, how)
        return
    rc = r.recipe
    locked = rc.input_records()
    for rec in locked:
        rec.locks += 1
    # What the kernels below read must not move under them (compaction): records and leaf aliases.
    rt.running.append(locked + [a.leaf for a in rc.refs if a.leaf is not None])
    try:
        if rt.residency.offload_leaves:
            _lock_leaves(rt, rc, locked)
        bases = {}
        tensors = []
        for a in rc.refs:
            if a.rec is not None:
                b = bases.get(a.rec.id)
                if b is None:
                    private = any(x.mutated and x.rec is a.rec for x in rc.refs)
                    b = bases[a.rec.id] = _base_of(rt, a.rec, private)
                tensors.append(a.view(b.sref))
            elif a.leaf is not None:
                v = a.leaf_view()
                tensors.append(rt.allocating(_clone, v) if a.mutated else v)
            else:  # blank: the op overwrites every byte
                buf = rt.allocating(_blank, a.blank_nbytes, rt.device)
                tensors.append(a.view(_C.StorageRef(buf)))
        args, kwargs = _fill(rc.args, tensors), _fill(rc.kwargs, tensors)
        t0 = time.perf_counter()
        refusals = refusals_here()
        try:
            out = _call(rc, args, kwargs)
            if refusals_here() != refusals:
                rt.fallbacks.note(r.op, recompute=True)
        except torch.OutOfMemoryError as e:
            if any(a.mutated for a in rc.refs):  # it may have written its private copy: no retry
                raise
            # A functional recompute left no trace: make room (its inputs stay locked), run it again.
            out = rt.run_again(_call, (rc, args, kwargs), {}, e, name=r.op, recompute=True)
        # It is an op run too: the clock moves on (by the estimate when costs are estimated).
        rt.stats_remat(time.perf_counter() - t0 if rt.cost_model is None else r.compute_cost)
    finally:
        for rec in locked:
            rec.locks -= 1
        rt.running.pop()
    kind, i = rc.out
    rt.residency.bring_back(r, tensors[i] if kind == "arg" else (out if isinstance(out, torch.Tensor) else _flat(out)[i]),
                            rt.clock)


def _lock_leaves(rt, rc, locked: List[Record]) -> None:
    """offload_leaves: the leaves the recipe reads through their tensors (not records), and its
    generator state, may be in host memory. Each is brought back (the inputs already locked) and
    locked, added to ``locked`` (which the caller unlocks): a recompute reads them in place."""
    tensors = [a.leaf for a in rc.refs if a.leaf is not None]
    if rc.rng is not None:
        tensors.append(rc.rng[1])
    for t in tensors:
        rec = rt.table.get(_C.storage_key(t))
        if rec is not None and rec.recipe is None and rec not in locked:
            if rec.evicted:
                restore(rt, [rec])
            rec.locks += 1
            locked.append(rec)


def _call(rc, args, kwargs):
    with torch.no_grad():
        if rc.rng is None:
            return rc.func(*args, **kwargs)
        gen, state = rc.rng
        saved = gen.get_state()
        gen.set_state(state)
        try:
            return rc.func(*args, **kwargs)
        finally:
            gen.set_state(saved)


def _flat(out) -> List:
    flat = []
    for x in out:
        if isinstance(x, (list, tuple)):
            flat.extend(x)
        else:
            flat.append(x)
    return flat


def invalidate_dependents(rt, leaf: Record, why: str, keep: bool = False) -> None:
    """``leaf`` (no recipe) is about to be written in place: every recipe that read its old value,
    directly or through other recipes, becomes invalid. Values whose storage is still alive are made
    resident first (from the still-valid inputs) and become leaves; the rest are marked lost.
    ``keep``: copy the old value aside whenever a tensor still holds a dependent (see
    _keep_old_value)."""
    direct = [c for c in (w() for w in leaf.children) if c is not None]
    leaf.children = []
    closure = _dependents(direct)
    if not closure or _keep_old_value(rt, leaf, direct, closure, keep):
        return
    # Hold every resident member, then restore the evicted ones that a tensor still references one at a
    # time, holding each: no restore can evict a member whose recipe is about to be dropped.
    held = [r for r in closure if rt.residency.is_available(r)]
    for r in held:
        r.locks += 1
    try:
        for r in closure:
            if r.evicted and r.sref is not None and r.sref.alive:
                restore(rt, [r])
                r.locks += 1
                held.append(r)
    finally:
        for r in held:
            r.locks -= 1
    _cut(rt, closure, why)


def release_orphaned_leaf(rt, leaf: Record) -> bool:
    """No user tensor holds ``leaf``'s storage any more, only the recipes that read it (a batch whose
    outputs the program keeps). Unmanaged, it would be freed now; kept for those recipes, every
    kept output would hold its inputs for good. So the recipes are dropped — their values become
    leaves — and the storage dies with them, when that costs no recompute (no dependent is evicted
    or half-way through a restore) and pins no more bytes than it frees (else the leaf is the
    cheaper thing to keep: the activations autograd saves from a batch nobody else holds). True
    when the recipes were dropped."""
    direct = [c for c in (w() for w in leaf.children) if c is not None]
    room = leaf.nbytes  # what the dependents may pin in its place

    def keeps_the_leaf(r: Record) -> bool:
        nonlocal room
        if r.evicted or r.waits or r in rt.cache:
            return True
        if rt.residency.is_available(r):
            room -= r.nbytes
        return room < 0

    closure = _dependents(direct, stop=keeps_the_leaf)
    if closure is None:
        return False
    leaf.children = []
    _cut(rt, closure, f"its input {leaf.op} ({leaf.nbytes} B) was freed: no tensor held it")
    return True


def _dependents(direct: List[Record], stop: Optional[Callable[[Record], bool]] = None) -> Optional[List[Record]]:
    """Records whose recipes read ``direct``'s values, directly or through other recipes, them
    included; None as soon as ``stop`` is true of one of them (the sweep asks of every leaf that
    only recipes hold, at every pressure event: most answers are no, found early in the walk)."""
    closure: List[Record] = []
    seen = set()
    stack = list(direct)
    while stack:  # walk through leaves too: a record made a leaf earlier may have older dependents
        r = stack.pop()
        if r is None or r.id in seen:
            continue
        seen.add(r.id)
        if r.recipe is not None:
            if stop is not None and stop(r):
                return None
            closure.append(r)
        stack.extend(w() for w in r.children)
    return closure


def _cut(rt, closure: List[Record], why: str) -> None:
    """Drop the recipes of ``closure``: resident values become leaves, the rest are lost."""
    for r in closure:
        if r in rt.cache:
            del rt.cache[r]
        r.recipe = None
        r.children = []
        if not rt.residency.is_available(r) and r.host is None:  # a host copy still brings it back
            r.lost = why
        rt.residency.forget(r)


def _keep_old_value(rt, leaf: Record, direct: List[Record], closure: List[Record],
                    keep: bool = False) -> bool:
    """Instead of restoring the dependents a tensor still holds (evicted, storage alive) before
    ``leaf`` is overwritten, copy the leaf's current value aside and point the recipes that read it
    at the copy: nothing is recomputed, every recipe stays valid, and the copy lives exactly as long
    as they do. Chosen when those dependents outweigh the leaf: the logits a training step keeps in
    a local while the optimizer updates the weights they came from would otherwise cost a whole
    forward pass, recomputed for a value nobody reads again. With ``keep``, chosen whenever a tensor
    still holds a dependent, resident ones too: FSDP frees a layer's parameters right after its
    forward, and dropping the recipes would make all the activations autograd keeps for backward
    unreleasable. Falls back (False) when the copy does not fit."""
    s = leaf.sref
    if s is None or not s.alive:
        return False
    if keep:
        if not any(r.sref is not None and r.sref.alive for r in closure):
            return False
    elif sum(r.nbytes for r in closure if r.evicted and r.sref is not None and r.sref.alive) < leaf.nbytes:
        return False
    try:
        copy = rt.allocating(_clone, s.strong())
    except torch.OutOfMemoryError:
        return False
    # The copy is pymem's own (no Record.hold): it lives exactly as long as the recipes reading it.
    old = rt._new_record(copy, _C.storage_key(copy), 0.0, None, f"old value of {leaf.op}")
    key = s.key
    for c in direct:
        if c.recipe is None:
            continue
        for a in c.recipe.refs:
            if a.leaf is not None and _C.storage_key(a.leaf) == key:
                a.leaf = copy
        old.children.append(weakref.ref(c))
    rt.num_leaf_copies += 1
    return True
