"""Records (one per value of an alias pool) and recipes (how to recompute one).

A ``Record`` is one *value* of one storage. It references the storage weakly (``_C.StorageRef``): the
buffer dies the moment the last user tensor does (eager eviction), while the record lives on as long
as some recipe still needs its value. An in-place op on a recomputable storage splits its record
(Coop's recomputable in-place): the old record keeps the old recipe and loses the storage, and a new
record for the storage gets the in-place op as recipe — so recipes that read the old value stay right.

A ``Recipe`` holds the op, its arguments with tensors replaced by ``Slot``s, and per slot an ``ArgRef``:
a record (recomputable input: strong ref to the record, weak to its storage), a leaf (a strong
whole-storage tensor: parameters, inputs), or a blank (an input the op overwrites entirely, so its old
value is never needed). All the recipes that read one leaf share one holder tensor (``Record.hold``):
when it is the storage's only holder left, no user tensor needs the value any more (see
``remat.release_orphaned_leaf``).
"""
from typing import Any, Iterator, List, Optional, Tuple

import torch

from .. import _C

_StorageRef = _C.StorageRef


class Slot:
    """Placeholder for the i-th tensor argument in a recipe's argument template."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


_set_conj, _set_neg = torch._C._set_conj, torch._C._set_neg


def with_math_bits(v: torch.Tensor, conj: bool, neg: bool) -> torch.Tensor:
    """``v`` (a bare view of a storage) with the lazy conjugate / negative bits of the tensor it
    stands for: a conj() or _neg_view() argument holds its bytes unconjugated, un-negated, and
    the bits tell the kernel so. A view without them reads another value."""
    if conj:
        _set_conj(v, True)
    if neg:
        _set_neg(v, True)
    return v


class ArgRef:
    """How a recipe gets one tensor argument back: a view (dtype, size, stride, offset, math bits)
    of a record's value, of a leaf's storage (``leaf``: a strong uint8 tensor over all of it), or of
    a blank buffer. ``mutated``: the op writes it, so the recompute must get a private copy."""

    __slots__ = ("rec", "leaf", "dtype", "size", "stride", "offset", "conj", "neg", "mutated", "blank_nbytes")

    def __init__(self, rec, leaf, t: torch.Tensor, mutated: bool, blank_nbytes: int = 0) -> None:
        self.rec = rec
        self.leaf = leaf
        self.dtype = t.dtype
        self.size = tuple(t.shape)
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.conj = t.is_conj()
        self.neg = t.is_neg()
        self.mutated = mutated
        self.blank_nbytes = blank_nbytes

    def view(self, sref) -> torch.Tensor:
        """The argument as a view of ``sref`` (a _C.StorageRef)."""
        return with_math_bits(sref.view(self.dtype, self.size, self.stride, self.offset), self.conj, self.neg)

    def leaf_view(self) -> torch.Tensor:
        """The argument as a view of its leaf's storage."""
        return self.view(_StorageRef(self.leaf))


class Recipe(_C.RecipeBase):
    """``func(*args, **kwargs)`` with ``Slot``s for tensors; ``out``: ("ret", i) the i-th flat output,
    or ("arg", slot) the tensor the op mutated in place. ``rng``: (generator, state) for seeded ops.
    The fast path makes recipes in C++ (csrc/recipe.h): their fields become these Python objects the
    first time one is read. ``input_records()``: the records of the recomputable inputs, in order."""

    __slots__ = ()

    def __init__(self, func, args, kwargs, refs: List[ArgRef], out: Tuple[str, int], rng) -> None:
        self.func, self.args, self.kwargs, self.refs, self.out, self.rng = func, args, kwargs, refs, out, rng


class Record(_C.RecordBase):
    """One value of one alias pool; read by policies through the TensorView attributes. Its fields
    live in C (``_C.RecordBase``, csrc/record.h), where the fast path writes them directly; a
    record made there skips ``__init__`` and gets the same defaults. ``id``: unique, increasing."""

    __slots__ = ()

    def __init__(self, home, sref, nbytes: int, cost: float, now: float, recipe: Optional[Recipe], op,
                 in_arena: bool) -> None:
        self.home = home            # the Residency it lives in (residency.py): what its scores read
        self.sref = sref            # _C.StorageRef of the storage holding this value, or None
        self.nbytes = nbytes
        self.compute_cost = cost
        self.last_access = now
        self.recipe = recipe        # None: a leaf, never evicted
        # locks (> 0: a running op reads it; never released), waits (> 0: a pending recompute needs
        # it; released only as a last resort) and need_rank (how soon a pending restore reads it,
        # higher: sooner) start at 0.
        # evicted: the storage is alive but its buffer was released by us (starts False).
        self.in_arena = in_arena
        # children: weakrefs to records whose recipes read this value (starts [])
        # lost: why this value can no longer be recomputed (str), if so (starts None)
        self.op = op                # name of the producing op, for messages
        # host: a host copy of the value (swap.py), valid while the record lives (None)
        # pins: > 0: its storage is shared outside torch (raw_access.py): never released, moved or
        #       offloaded; address_out: data_ptr() handed its address out, one of its pins is that
        # depth: longest chain of recipes ending here (0: a leaf)
        # hold: a leaf read by recipes: weakref to the one tensor they share to keep its storage
        #       (ArgRef.leaf); dies with the last of them (None)

    # --- TensorView (what policies read) ---
    @property
    def evicted_neighbour_cost(self) -> float:
        return self.home.neighbourhood.neighbour_cost(self.neighbour_ids())

    @property
    def evicted_ancestor_cost(self) -> float:
        total, seen, stack = 0.0, set(), list(self.recipe.input_records()) if self.recipe else []
        while stack and len(seen) < 64:
            r = stack.pop()
            if r.id in seen or self.home.is_available(r):
                continue
            seen.add(r.id)
            if r.host is not None:  # comes back by a copy; its own ancestors are not needed
                total += r.swap_cost
                continue
            total += r.compute_cost
            if r.recipe is not None:
                stack.extend(r.recipe.input_records())
        return total

    @property
    def swap_cost(self) -> float:
        return self.nbytes / self.home.link_bandwidth

    @property
    def has_host_copy(self) -> bool:
        return self.host is not None

    @property
    def next_use(self) -> Optional[float]:
        plan = self.home.plan
        return _next_use(plan, self, 8) if plan is not None else None

    # --- graph ---
    def evicted_readers(self) -> Iterator["Record"]:
        """The evicted (not offloaded) records whose recompute reads this one."""
        for w in self.children:
            c = w()
            if c is not None and c.evicted and c.host is None:
                yield c

    def neighbour_ids(self) -> List[int]:
        ids = [r.id for r in self.recipe.input_records()] if self.recipe else []
        for w in self.children:
            c = w()
            if c is not None:
                ids.append(c.id)
        return ids

    def __repr__(self) -> str:
        state = ("lost" if self.lost else "offloaded" if self.evicted and self.host is not None else
                 "evicted" if self.evicted else
                 "leaf" if self.recipe is None else "resident")
        return f"Record(#{self.id} {self.op} {self.nbytes} B {state})"


def _next_use(plan, r: "Record", depth: int) -> Optional[float]:
    """Planned seconds until r's value is next needed: read by an op, or read by the recompute of an
    evicted reader when that reader is next needed (``depth`` levels of evicted readers)."""
    d = plan.seconds_to_next_use(r)
    if d is None or depth == 0:
        return d
    for c in r.evicted_readers():
        dc = _next_use(plan, c, depth - 1)
        if dc is not None and dc < d:
            d = dc
    return d
