"""Directors (DELTA's director): once the filter has chosen a value to release, offload it to host
memory (copied back on next use, or prefetched) or evict it (recomputed on next use).

A director sees the value through :class:`TensorView`: ``swap_cost`` is one copy's time (bytes over
the host link's bandwidth), in the same unit as ``compute_cost``; ``has_host_copy`` says a copy made
earlier is still valid (a value never changes, so releasing it again costs nothing).
"""
from typing import ClassVar, Dict, List, Type

from .base import TensorView


class Director:
    """Base class: ``evaluate(t, now)`` is True to offload ``t``, False to evict it."""

    name: ClassVar[str] = ""

    def evaluate(self, t: TensorView, now: float) -> bool:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


_REGISTRY: Dict[str, Type[Director]] = {}


def register_director(cls: Type[Director]) -> Type[Director]:
    """Class decorator: make ``cls`` available to ``get_director(cls.name)``."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"director name {cls.name!r} is empty or already registered")
    _REGISTRY[cls.name] = cls
    return cls


def director_names() -> List[str]:
    return sorted(_REGISTRY)


def get_director(name: str) -> Director:
    """A new instance of the director registered as ``name``."""
    try:
        return _REGISTRY[name]()
    except (KeyError, TypeError):
        raise ValueError(f"unknown offload director {name!r}; accepted: {', '.join(director_names())}") from None


@register_director
class Delta(Director):
    """Offload when the round trip is cheaper than a recompute: copy out (free if a valid host copy
    exists) plus copy back < c + the evicted ancestors a recompute would redo first. DELTA's rule
    (2 c_s < c_r), with c_r counting the ancestry: deep in an evicted chain, recomputing one value
    means recomputing the chain."""

    name = "delta"

    def evaluate(self, t: TensorView, now: float) -> bool:
        out = 0.0 if t.has_host_copy else t.swap_cost
        return out + t.swap_cost < t.compute_cost + t.evicted_ancestor_cost


@register_director
class Never(Director):
    """Evict only (DTR): nothing goes to host memory."""

    name = "never"

    def evaluate(self, t: TensorView, now: float) -> bool:
        return False


@register_director
class Always(Director):
    """Offload every released value (swap-only, like Capuchin's passive mode): no recompute ever
    runs for a value that was resident once."""

    name = "always"

    def evaluate(self, t: TensorView, now: float) -> bool:
        return True


@register_director
class Capuchin(Director):
    """Capuchin's choice between swapping and recomputing, from the step plan: a value is offloaded
    when its transfer hides behind the compute before its next use, and otherwise only when the
    part of it left exposed still costs less than the recompute (c plus the evicted ancestors it
    would redo, MSPS's lineage). The copy out is exposed (it completes before the buffer is freed);
    the copy back runs ahead of use, over the d planned seconds until the next use. A value the step
    does not read again (d infinite) is evicted: that costs nothing. Where no plan says (the first
    steps, a step that left its plan), DELTA's rule decides."""

    name = "capuchin"

    def __init__(self) -> None:
        self.fallback = Delta()

    def evaluate(self, t: TensorView, now: float) -> bool:
        d = t.next_use
        if d is None:
            return self.fallback.evaluate(t, now)
        if d == float("inf"):
            return False
        exposed = (0.0 if t.has_host_copy else t.swap_cost) + max(0.0, t.swap_cost - d)
        return exposed < t.compute_cost + t.evicted_ancestor_cost
