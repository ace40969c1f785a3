"""Rematerialization: make evicted values resident again, with an explicit stack (chains are deep),
and invalidate recipes whose leaf input is about to be overwritten.

Values recomputed only as inputs of others (their storage is dead: no user tensor holds them) are
kept in ``rt.cache`` as ordinary evictable values, so restoring a run of neighbours (backward through
an evicted region) does not recompute the shared chain again for each one.
"""
import math
import time
from typing import Iterable, List

import torch

from .. import _C
from ..errors import OutOfBudgetError
from . import compaction
from .records import Record, Slot

_THRASH_LIMIT = 1_000_000  # deepest recompute chain we follow
_THRASH_FACTOR = 4         # a soft restore's recomputes per record in the table


def restore(rt, records: Iterable[Record]) -> None:
    """Make every record resident in its own storage (recomputing what is missing)."""
    for r in records:
        if not rt.is_available(r):
            try:
                _build(rt, r, soft=False)
            except OutOfBudgetError:  # what it restored stays; the waiting inputs did not fit at once
                _build(rt, r, soft=True)


def _build(rt, target: Record, soft: bool) -> None:
    """Recompute ``target`` and whatever it needs, depth first on an explicit stack.

    While a record waits on the stack, its available inputs are held for it. ``soft=False``: locked,
    so the pressure handler cannot release them and every recompute is progress — or the budget is
    too small and an allocation raises OutOfBudgetError. A long chain whose waiting inputs do not all
    fit at once is then retried with ``soft=True``: held inputs are only marked (``waits``) and
    released when nothing else is left, those of the shallowest level first (needed last, after the
    chain below is back); one released this way is recomputed on the way up. A soft restore that
    keeps recomputing what it released (over ``_THRASH_FACTOR`` recomputes per record in the table)
    raises OutOfBudgetError instead of looping.
    """
    stack: List[Record] = [target]
    held = {}  # record id -> (set of held input ids, list of them)
    recomputes, limit = 0, _THRASH_FACTOR * (len(rt.table) + 64) if soft else math.inf
    try:
        while stack:
            r = stack[-1]
            if rt.is_available(r):
                stack.pop()
                _unlock(held.pop(r.id, None))
                continue
            if r.recipe is None:
                raise RuntimeError(f"pymem: {r.op} output ({r.nbytes} B) is needed again but cannot be "
                                   f"recomputed: {r.lost or 'it has no recipe and its storage is gone'}")
            inputs = r.recipe.input_records()
            h = held.get(r.id)
            if h is None:
                h = held[r.id] = (set(), [], soft)
            missing = []
            for a in inputs:
                if rt.is_available(a):
                    if a.id not in h[0]:
                        h[0].add(a.id)
                        h[1].append(a)
                        if not soft:
                            a.locks += 1
                            continue
                        a.waits += 1
                        if len(stack) > a.wait_depth:
                            a.wait_depth = len(stack)
                elif a not in missing:  # again, if it was released while r waited
                    missing.append(a)
            if missing:
                if len(stack) > _THRASH_LIMIT:
                    raise RuntimeError(f"pymem: the recompute chain of {r.op} is deeper than {_THRASH_LIMIT}")
                stack.extend(missing)
                continue
            stack.pop()
            recomputes += 1
            if recomputes > limit:
                raise OutOfBudgetError(
                    f"pymem: restoring {target.op} ({target.nbytes} B) thrashes: {recomputes} recomputes and "
                    f"counting, each releasing inputs another one still waits for. Raise the budget.")
            _recompute(rt, r)
            _unlock(held.pop(r.id, None))
    finally:
        for h in held.values():
            _unlock(h)


def _unlock(h) -> None:
    if h:
        if not h[2]:
            for a in h[1]:
                a.locks -= 1
            return
        for a in h[1]:
            a.waits -= 1
            if not a.waits:
                a.wait_depth = 0


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
        copy = rec.sref.strong().clone()
        return _Base(_C.StorageRef(copy), copy)
    return _Base(rec.sref)


def _fill(template, tensors):
    if isinstance(template, Slot):
        return tensors[template.i]
    if isinstance(template, (list, tuple)):
        return type(template)(_fill(x, tensors) for x in template)
    if isinstance(template, dict):
        return {k: _fill(v, tensors) for k, v in template.items()}
    return template


def _recompute(rt, r: Record) -> None:
    rc = r.recipe
    locked = rc.input_records()
    for rec in locked:
        rec.locks += 1
    # What the kernels below read must not move under them (compaction): records and leaf aliases.
    rt.running.append(locked + [a.leaf for a in rc.refs if a.leaf is not None])
    try:
        bases = {}
        tensors = []
        for a in rc.refs:
            if a.rec is not None:
                b = bases.get(a.rec.id)
                if b is None:
                    private = any(x.mutated and x.rec is a.rec for x in rc.refs)
                    b = bases[a.rec.id] = _base_of(rt, a.rec, private)
                tensors.append(b.sref.view(a.dtype, a.size, a.stride, a.offset))
            elif a.leaf is not None:
                tensors.append(a.leaf.clone() if a.mutated else a.leaf)
            else:  # blank: the op overwrites every byte
                buf = torch.empty(a.blank_nbytes, dtype=torch.uint8, device=rt.device)
                tensors.append(_C.StorageRef(buf).view(a.dtype, a.size, a.stride, a.offset))
        args, kwargs = _fill(rc.args, tensors), _fill(rc.kwargs, tensors)
        t0 = time.perf_counter()
        try:
            out = _call(rc, args, kwargs)
        except OutOfBudgetError:
            # A functional recompute left no trace: compact with its inputs movable, run it again.
            if any(a.mutated for a in rc.refs) or not compaction.defragment_after_failure(rt):
                raise
            out = _call(rc, args, kwargs)
        rt.stats_remat(time.perf_counter() - t0)
    finally:
        for rec in locked:
            rec.locks -= 1
        rt.running.pop()
    kind, i = rc.out
    result = tensors[i] if kind == "arg" else (out if isinstance(out, torch.Tensor) else _flat(out)[i])
    sref = r.sref
    if sref is not None and r.evicted and sref.alive:
        sref.adopt(result)
        r.evicted = False
        rt.on_rematerialized(r)
    else:
        ref = _C.StorageRef(result)
        if ref.nbytes != r.nbytes:
            raise RuntimeError(f"pymem: recomputing {r.op} gave {ref.nbytes} B, the original held {r.nbytes} B")
        rt.add_cached(r, ref, result)


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


def invalidate_dependents(rt, leaf: Record, why: str) -> None:
    """``leaf`` (no recipe) is about to be written in place: every recipe that read its old value,
    directly or through other recipes, becomes invalid. Values whose storage is still alive are made
    resident first (from the still-valid inputs) and become leaves; the rest are marked lost."""
    closure: List[Record] = []
    seen = set()
    stack = [w() for w in leaf.children]
    leaf.children = []
    while stack:  # walk through leaves too: a record made a leaf earlier may have older dependents
        r = stack.pop()
        if r is None or r.id in seen:
            continue
        seen.add(r.id)
        if r.recipe is not None:
            closure.append(r)
        stack.extend(w() for w in r.children)
    if not closure:
        return
    # Hold every resident member, then restore the evicted ones that a tensor still references one at a
    # time, holding each: no restore can evict a member whose recipe is about to be dropped.
    held = [r for r in closure if rt.is_available(r)]
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
    for r in closure:
        if r in rt.cache:
            del rt.cache[r]
        r.recipe = None
        r.children = []
        if not rt.is_available(r):
            r.lost = why
        rt.neighbourhood_forget(r)
