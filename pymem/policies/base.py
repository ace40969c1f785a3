"""The policy interface and its registry."""
from typing import ClassVar, Dict, List, Optional, Protocol, Type


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


class Policy:
    """Base class: ``evaluate(t, now)`` returns a score; the lowest score is released first."""

    name: ClassVar[str] = ""
    # True if the policy reads evicted_neighbour_cost: the caller then keeps an EvictedNeighbourhood.
    uses_neighbourhood: ClassVar[bool] = False

    def evaluate(self, t: TensorView, now: float) -> float:
        raise NotImplementedError

    def block_cost(self, t: TensorView, now: float) -> float:
        """The cost (>= 0) of releasing t's whole block, for the arena's window search, which sums
        it over address-contiguous blocks. Default: a per-byte score times the bytes."""
        return max(self.evaluate(t, now), 0.0) * max(t.nbytes, 1)

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


def staleness(t: TensorView, now: float) -> float:
    """Time since last use on the logical clock; never 0, so scores stay finite."""
    return max(now - t.last_access, 1e-12)
