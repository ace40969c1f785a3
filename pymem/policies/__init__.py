"""Eviction policies: tiny registered classes whose score is data (``costs`` over ``per``, see
base.py), read through one ``evaluate`` method (lowest score goes first).

The runtime and the simulator both call these; policies import nothing from either (the runtime's
C++ release scan evaluates the same declared terms). A policy sees a tensor only through the
read-only attributes of :class:`TensorView` and the logical clock::

    from pymem.policies import get_policy
    dtr = get_policy("dtr")
    victim = min(candidates, key=lambda t: dtr.evaluate(t, now))

Names: ``dtr`` (h_DTR with the union-find estimate of e*), ``dtr-chain`` (h_DTR plus the exact cost of
evicted ancestors), ``dtr-local``, ``lru``, ``size``,
``msps`` (Capuchin), ``coop`` (h = c'/s, fed to the arena's window search as block cost).
``Planned`` (planned.py, not registered) wraps any of them with Belady's rule from the step plan.

Directors (``director.py``) decide, for a value chosen for release, between offloading it to host
memory and evicting it: ``delta`` (offload when the round trip is cheaper than the recompute),
``capuchin`` (from the step plan: offload when the copy hides behind compute before the next use,
or its exposed part costs less than the recompute), ``never``, ``always``.
"""
from .base import Policy, TensorView, get_policy, policy_names, register
from .director import Director, director_names, get_director, register_director
from .heuristics import Coop, DTR, DTRChain, DTRLocal, LRU, MSPS, Size
from .planned import Planned
from .sampling import sample_candidates

__all__ = ["Policy", "TensorView", "get_policy", "policy_names", "register", "DTR", "DTRChain", "DTRLocal", "LRU",
           "Size", "MSPS", "Coop", "Planned", "EvictedNeighbourhood", "sample_candidates", "Director", "director_names",
           "get_director", "register_director"]


def __getattr__(name: str):
    if name == "EvictedNeighbourhood":  # lazily: it is pymem._C's, which imports torch
        from . import neighbourhood

        return neighbourhood.EvictedNeighbourhood
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
