"""The policy interface and its registry.

A policy's score is data: the sum of its ``costs`` over the product of its ``per`` terms, each a
TensorView field (``staleness``: now - last_access). ``evaluate`` computes it here (the simulator,
and every caller in Python); the runtime's release scan computes the same data in C++
(csrc/release_scan.h) over every candidate at once. So a policy is a name and two tuples, and the
two never disagree.
"""
from typing import Callable, ClassVar, Dict, List, Optional, Protocol, Tuple, Type


class TensorView(Protocol):
    """What a policy may read of a tensor record (the runtime's and the simulator's records both
    provide it). Costs are in one unit per run (seconds on CPU, estimated seconds on GPU)."""

    nbytes: int                 # bytes of its storage (alias pool)
    compute_cost: float         # c: cost of the op that produces it
    last_access: float          # logical clock of its last use
    evicted_neighbour_cost: float  # e*: cost of the evicted neighbourhood (union-find estimate)
    evicted_ancestor_cost: float   # cost of evicted ancestors that a recompute would also redo
    swap_cost: float            # c_s: one copy to or from host memory (bytes / link bandwidth)
    has_host_copy: bool         # a valid host copy exists: releasing again copies nothing
    next_use: Optional[float]   # d: planned seconds until its next use in this step (inf: none);
                                # None: no plan says (see planned.py)


# The terms a score may read, in the order they are summed and multiplied (floating-point sums
# depend on it; csrc/release_scan.cpp uses the same order).
COST_TERMS = ("compute_cost", "evicted_neighbour_cost", "evicted_ancestor_cost", "last_access")
PER_TERMS: Dict[str, Callable[[TensorView, float, Optional[float]], float]] = {
    "nbytes": lambda t, now, d: max(t.nbytes, 1),
    "staleness": lambda t, now, d: max(now - t.last_access, 1e-12),
    "next_use": lambda t, now, d: max(d, 1e-12),  # d: t.next_use, read once by the caller
}


def canonical_terms(costs, per) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """``costs`` and ``per`` in the order of COST_TERMS and PER_TERMS; ValueError on an unknown term."""
    bad = [c for c in costs if c not in COST_TERMS] + [p for p in per if p not in PER_TERMS]
    if bad:
        raise ValueError(f"unknown score term(s) {bad}; accepted: costs {list(COST_TERMS)}, per {list(PER_TERMS)}")
    return (tuple(c for c in COST_TERMS if c in costs), tuple(p for p in PER_TERMS if p in per))


def formula_score(costs, per, t: TensorView, now: float, next_use: Optional[float] = None) -> float:
    """(sum of the ``costs`` fields of t, or 1 with none) / (product of the ``per`` terms, or 1)."""
    num = 1.0
    if costs:
        num = getattr(t, costs[0])
        for c in costs[1:]:
            num = num + getattr(t, c)
    if not per:
        return num
    den = PER_TERMS[per[0]](t, now, next_use)
    for p in per[1:]:
        den = den * PER_TERMS[p](t, now, next_use)
    return num / den


class Policy:
    """Base class: ``evaluate(t, now)`` returns a score; the lowest score is released first. A
    subclass declares its score as data (``costs``, ``per``: see above)."""

    name: ClassVar[str] = ""
    costs: ClassVar[Tuple[str, ...]] = ()
    per: ClassVar[Tuple[str, ...]] = ()
    block_cost_per_byte: ClassVar[bool] = True  # see block_cost
    # True if the policy reads evicted_neighbour_cost: the caller then keeps an EvictedNeighbourhood.
    uses_neighbourhood: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.costs, cls.per = canonical_terms(cls.costs, cls.per)
        # A policy with its own evaluate may read e* without declaring it as a term: it says so.
        cls.uses_neighbourhood = cls.__dict__.get("uses_neighbourhood", False) or "evicted_neighbour_cost" in cls.costs

    def evaluate(self, t: TensorView, now: float) -> float:
        return formula_score(self.costs, self.per, t, now)

    def block_cost(self, t: TensorView, now: float) -> float:
        """The cost (>= 0) of releasing t's whole block, for the arena's window search, which sums
        it over address-contiguous blocks: the score times the bytes (a per-byte score), or the
        score alone where ``block_cost_per_byte`` is False (a score that is already per block)."""
        s = max(self.evaluate(t, now), 0.0)
        return s * max(t.nbytes, 1) if self.block_cost_per_byte else s

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_REGISTRY: Dict[str, Type[Policy]] = {}


def register(cls: Type[Policy]) -> Type[Policy]:
    """Class decorator: make ``cls`` available to ``get_policy(cls.name)``."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"policy name {cls.name!r} is empty or already registered")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> List[str]:
    return sorted(_REGISTRY)


def get_policy(name: str) -> Policy:
    """A new instance of the policy registered as ``name``."""
    try:
        return _REGISTRY[name]()
    except (KeyError, TypeError):
        raise ValueError(f"unknown policy {name!r}; accepted: {', '.join(policy_names())}") from None
